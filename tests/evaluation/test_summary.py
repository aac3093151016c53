"""evaluation/summary.py: a report row's paired speedup from samples, and the speedup predicted on another
device from its measured costs (--verify-times), against numbers computed here by hand."""

import pytest

from dflash_train.evaluation import speed
from dflash_train.evaluation.run import EvalSettings
from dflash_train.evaluation.summary import device_costs_model, predictions, summarize
from dflash_train.evaluation.sweep import Sample


def test_summary_speedup_is_paired_per_prompt():
    """The report's speedup on samples where the machine got 4x slower for the last two prompts
    (both methods alike) and prompts differ in length: each prompt's AR / chain ratio is exactly
    2, so the median is 2 with no spread. (Pure statistics are in tests/evaluation/test_speed.py.)"""
    samples = []
    for i in range(5):
        load = 4.0 if i >= 3 else 1.0
        for m, b, verify_s, lengths in [("ar", 0, 1.0, [1] * 20), ("dflash", 7, 0.5, [2] * 10)]:
            stage_s = {"draft": 0.0, "tree": 0.0, "verify": verify_s * load * (1 + i), "commit": 0.0}
            samples.append(Sample(0, i, 0, m, b, accept_lengths=lengths, outputs=[[1] * 21], decoded=20,
                                  stage_s=stage_s))
    settings = EvalSettings(drafter="d", output="o", temperature=0.0, max_new_tokens=32, repeats=1)
    ar = [x for x in samples if x.method == "ar"]
    row, resampled = summarize([x for x in samples if x.method == "dflash"], ar, "s", 5, settings, 8,
                               speed.resample(5))
    assert row["speedup"] == pytest.approx(2.0) and row["speedup_interval"] == [2.0, 2.0]
    assert row["lossless"] is True and row["tau"] == 2.0


def test_prediction_on_another_device_uses_its_costs():
    """--verify-times: the device's verify curve, draft time and tree build, hand-computed here."""
    samples = []
    for i in range(4):
        samples.append(Sample(0, i, 0, "ar", 0, accept_lengths=[1] * 12, decoded=12))
        samples.append(Sample(0, i, 0, "ddtree", 16, accept_lengths=[4] * 3, decoded=12))
    costs = {"device": "GPU", "verify_ms_by_width": {"1": 10, "16": 10, "128": 11}, "draft_ms": 1.0,
             "tree_build_ms_by_budget": {"16": 0.5, "64": 1.0}}
    settings = EvalSettings(drafter="d", output="o", temperature=0.0, repeats=1, concurrency=[1, 4])
    by_method = {m: [x for x in samples if (x.method, x.budget) == m] for m in [("ar", 0), ("ddtree", 16)]}
    rows, verdicts = predictions(by_method, list(by_method), 4, settings, speed.resample(4),
                                 *device_costs_model(costs, 4, 1))
    v17 = 10 + (11 - 10) * (17 - 16) / (128 - 16)  # linear in width between measured widths
    assert rows[("ddtree", 16)]["1"]["speedup"] == pytest.approx(4 * 10 / (1.0 + 0.5 + v17), rel=1e-3)
    v68 = 10 + (11 - 10) * (68 - 16) / (128 - 16)
    # 4 requests: drafting 4x (no batch table), tree build per request, one verify of width 4 x 17
    assert rows[("ddtree", 16)]["4"]["speedup"] == pytest.approx(4 * 10 / (4 * 1.0 + 4 * 0.5 + v68), rel=1e-3)
    assert verdicts["1"]["recommended"] == {"method": "ddtree", "budget": 16}
