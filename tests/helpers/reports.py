"""A dflash-eval report.json for tests that export or evaluate a drafter without measuring it."""

from conftest import TINY_TARGET


def fake_report(fingerprint, device_type="cpu", device="Some CPU", tau64=5.1234):
    """A dflash-eval report.json of the drafter with this fingerprint (block 8, the bundled target)."""
    rows = [{"suite": "tinychat", "method": m, "budget": b, "temperature": 0.0, "max_new_tokens": 64,
             "prompts": 8, "tau": t, "lossless": True, "speedup": x, "speedup_interval": iv}
            for m, b, t, x, iv in [("ar", 0, 1.0, 1.0, [1.0, 1.0]), ("dflash", 7, 3.4567, 1.5, [1.4, 1.6]),
                                   ("ddtree", 64, tau64, 1.9, [1.8, 2.05])]]
    hw = {"device": device, "device_type": device_type, "torch": "2.x"}
    if device_type == "cuda":
        hw.update(cuda="12.8", driver="570.1")
    best = {"best": {"method": "ddtree", "budget": 64}, "speedup": 1.9, "interval": [1.8, 2.05],
            "recommended": {"method": "ddtree", "budget": 64}, "indistinguishable": []}
    return {"target": str(TINY_TARGET), "target_revision": None, "block_size": 8,
            "drafter_fingerprint": fingerprint, "hardware": hw, "results": rows,
            "advice": {"tinychat": {"measured": best, "concurrency": {"1": best}}}}
