"""`dflash-eval` end to end on the tiny target, its report, and its refusals."""

import json
import subprocess
import sys

import matplotlib.image as mpimg
import pytest

from conftest import ROOT, run_main
from dflash_train.checkpoint.folders import drafter_fingerprint, load_drafter
from dflash_train.cli.eval import main
from dflash_train.evaluation.speed import verdict_text
from dflash_train.model.cpu_linear import kernel


@pytest.fixture(scope="module")
def report(trained_drafter_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "report"
    mt = out.parent / "mt.jsonl"
    mt.write_text(json.dumps({"prompt": ["What is 12 + 30?", "Thank you!"]}) + "\n")
    gpu = out.parent / "gpu_costs.json"  # the keys benchmarks/gpu_costs.py writes
    gpu.write_text(json.dumps({"device": "Some GPU", "verify_ms_by_width": {"1": 10, "64": 10.5, "1024": 20},
                               "draft_ms": 1.0, "draft_ms_by_batch": {"1": 1.0, "4": 1.2},
                               "tree_build_ms_by_budget": {"16": 0.5, "64": 1.0}}))
    main(["--drafter", str(trained_drafter_dir), "--budgets", "0,4,64", "--limit", "6", "--max-new-tokens",
          "32", "--suite", "tinychat", "--suite", f"mt-bench={mt}", "--repeats", "2", "--concurrency", "1,4",
          "--verify-times", str(gpu), "--output", str(out)])
    return out, json.loads((out / "report.json").read_text())


def test_report_results(report):
    out, rep = report
    rows = rep["results"]
    # budget 0 is plain decoding: reported once, as AR, never as a tree of no nodes
    assert [(r["suite"], r["method"], r["budget"]) for r in rows] == [
        (s, m, b) for s in ["tinychat", "mt-bench"] for m, b in [("ar", 0), ("dflash", 7), ("ddtree", 4),
                                                                  ("ddtree", 64)]]
    assert rep["budgets"] == [4, 64] and rep["repeats"] == 2
    for r in rows:
        assert {"suite", "method", "budget", "temperature", "tau", "tokens_per_s", "lossless"} <= r.keys()
        assert r["lossless"] is True, r  # every repeat of every method equals AR's output
        assert sum(r["accept_hist"].values()) == r["rounds"]
        assert r["tokens_per_s"] > 0 and r["repeats"] == 2
        lo, hi = r["speedup_interval"]
        assert lo <= r["speedup"] <= hi
        assert set(r["predicted"]) == {"1", "4"}
        assert r["predicted"]["4"]["verify_width"] == 4 * (r["budget"] + 1)
        assert set(r["predicted_on_device"]) == {"1", "4"}
    by = {(r["suite"], r["method"], r["budget"]): r for r in rows}
    for s in ["tinychat", "mt-bench"]:
        ar = by[(s, "ar", 0)]
        assert ar["tau"] == 1.0 and ar["speedup"] == 1.0 and ar["speedup_interval"] == [1.0, 1.0]
        # at one request the prediction is the measured per-prompt ratio again (same data, same median)
        for m in ["dflash", "ddtree"]:
            for r in [x for x in rows if x["suite"] == s and x["method"] == m]:
                assert r["predicted"]["1"]["speedup"] == pytest.approx(r["speedup"], rel=1e-6)
    # the tree accepts more than the chain on the bundled suite
    assert by[("tinychat", "ddtree", 64)]["tau"] > by[("tinychat", "dflash", 7)]["tau"]
    # 2 turns x 2
    assert by[("mt-bench", "ar", 0)]["prompts"] == 1 and by[("mt-bench", "ar", 0)]["rounds"] > 2 * 10
    hw = rep["hardware"]
    assert hw["device_type"] == "cpu" and hw["torch"] and hw["device"]
    # fp32 on a CPU verifies through the streaming linear wherever it builds (auto)
    assert hw["cpu_linear"] == ("stream" if kernel()[0] is not None else "torch")
    assert hw["attention"] == "sdpa_shared_kv"  # GQA heads shared, not copied, on a CPU (model/gqa_attention)
    costs = rep["costs"]
    # timed up to the first width covering the widest prediction (4 requests x DDTree@64 = 260): 512
    assert list(costs["verify_ms_by_width"]) == [str(2**k) for k in range(10)] and costs["context"] > 0
    for r in rows:  # trees state probabilities the target then judges; the chain and AR have no cells
        cal = r.get("calibration")
        assert (cal is not None) == (r["method"] == "ddtree")
        if cal:
            assert 0 <= cal["ece"] <= 1 and cal["nodes"] == sum(c["nodes"] for c in cal["cells"]) > 0
    assert list(costs["draft_ms_by_batch"]) == ["1", "4"]
    for suite in ["tinychat", "mt-bench"]:
        adv = rep["advice"][suite]
        for v in [adv["measured"], adv["concurrency"]["4"]]:
            assert (v["recommended"] is None) == bool(v["indistinguishable"])
            assert v["best"] in [{"method": r["method"], "budget": r["budget"]} for r in rows]


def test_report_records_the_drafter_it_measured(report, trained_drafter_dir):
    _, rep = report
    drafter = load_drafter(trained_drafter_dir)[0]
    assert rep["drafter_fingerprint"] == drafter_fingerprint(drafter)
    assert rep["block_size"] == drafter.config.block_size == 8
    assert (rep["target"] == json.loads((trained_drafter_dir
                                         / "config.json").read_text())["target"]["name_or_path"])
    assert "target_revision" in rep


def test_report_markdown_and_plots(report):
    out, rep = report
    md = (out / "report.md").read_text()
    chain = next(r for r in rep["results"] if r["suite"] == "tinychat" and r["method"] == "dflash")
    lo, hi = chain["speedup_interval"]
    assert f"| dflash | 7 | {chain['tau']:.2f} | {chain['speedup']:.2f}x ({lo:.2f}-{hi:.2f}) |" in md
    assert "| ddtree | 0 |" not in md
    assert "Measured here, one request at a time:" in md and "- 4 requests:" in md
    assert verdict_text(rep["advice"]["tinychat"]["measured"]) in md
    assert "Predicted on Some GPU" in md and rep["advice"]["tinychat"]["device"]["name"] == "Some GPU"
    for png in ["tau_vs_budget.png", "accept_hist.png", "speedup_vs_budget.png", "verify_cost.png"]:
        img = mpimg.imread(out / png)
        assert img.ndim == 3 and img.shape[0] > 100 and img.std() > 0  # a real, non-blank image


def test_eval_decodes_in_the_interleaved_order(trained_drafter_dir, tmp_path, monkeypatch):
    """The decoding calls dflash-eval really makes: one warm-up call per method, then per prompt
    every method back to back, in an order rotated from prompt to prompt, for each repeat."""
    import dflash_train.evaluation.sweep as ev

    questions = ["What is 2 + 2?", "Hello!", "Tell me about Oakgate."]
    suite = tmp_path / "three.jsonl"
    suite.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                             for q in questions))
    calls, real_decode = [], ev.decode

    def recording_decode(target, drafter, prompt_ids, method, budget, *rest):
        text = target.tokenizer.decode(prompt_ids[0])
        calls.append((next(i for i, q in enumerate(questions) if q in text), method, budget))
        return real_decode(target, drafter, prompt_ids, method, budget, *rest)

    monkeypatch.setattr(ev, "decode", recording_decode)
    main(["--drafter", str(trained_drafter_dir), "--suite", str(suite), "--budgets", "4", "--max-new-tokens",
          "6", "--repeats", "2", "--concurrency", "1", "--output", str(tmp_path / "out")])
    A, C, T = ("ar", 0), ("dflash", 7), ("ddtree", 4)
    expected = [(0, *A), (0, *C), (0, *T)]  # warm-up on the first prompt, untimed
    rotations = [[A, C, T], [C, T, A], [T, A, C]]
    for k in range(6):  # 2 repeats x 3 prompts, the rotation carried on across repeats
        expected += [(k % 3, *m) for m in rotations[k % 3]]
    assert calls == expected


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash_train.cli.eval", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_bad_input_is_one_line_exit_2(tmp_path, trained_drafter_dir, llama_target_dir):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep")
    cases = [
        (["--drafter", str(tmp_path / "nope"), "--output", str(tmp_path / "o1")], "drafter not found"),
        (["--drafter", str(trained_drafter_dir), "--target", str(llama_target_dir), "--output",
          str(tmp_path / "o2")],
         "does not match target"),
        (["--drafter", str(trained_drafter_dir), "--suite", "nope", "--output", str(tmp_path / "o3")],
         "unknown suite"),
        (["--drafter", str(trained_drafter_dir), "--budgets", "4,x", "--output", str(tmp_path / "o4")],
         "--budgets must be"),
        (["--drafter", str(trained_drafter_dir), "--output", str(busy)], "is not empty"),
        (["--drafter", str(trained_drafter_dir), "--target-dtype", "bf16", "--cpu-linear", "stream",
          "--output", str(tmp_path / "o5")], "--cpu-linear stream runs fp32 on a CPU only"),
    ]
    for i, (args, message) in enumerate(cases):
        # the first case through the real command line, the rest in-process (the same code under cli_guard)
        if i == 0:
            r = run_cli(*args)
            code, stderr = r.returncode, r.stderr
        else:
            code, _, stderr = run_main(main, args)
        assert code == 2, (args, stderr[-2000:])
        lines = [ln for ln in stderr.strip().splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and message in lines[0], stderr[-2000:]
        assert "Traceback" not in stderr
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))
    assert (busy / "x").read_text() == "keep"


def test_target_dtype_bf16_decodes_and_is_recorded(trained_drafter_dir, tmp_path):
    """--target-dtype bf16 runs target and drafter in bf16 (the fast CPU path on AVX-512 BF16) and
    the report says so; at temperature 0 lossless is still computed (against the bf16 target's own
    AR, which a tree's verify may part from at near-ties, so only fp32 must be exact). The default
    on a CPU stays fp32."""
    runs = {}
    for dtype in ("bf16", "auto"):
        out = tmp_path / dtype
        main(["--drafter", str(trained_drafter_dir), "--budgets", "4", "--limit", "2", "--max-new-tokens",
              "16", "--concurrency", "1", "--target-dtype", dtype, "--output", str(out)])
        runs[dtype] = json.loads((out / "report.json").read_text())
    assert runs["bf16"]["hardware"]["dtype"] == "bfloat16"
    assert runs["auto"]["hardware"]["dtype"] == "float32"
    assert runs["bf16"]["hardware"]["cpu_linear"] == "torch"  # the streaming linear is fp32 only
    assert "weights in bfloat16" in (tmp_path / "bf16" / "report.md").read_text()
    for rep in runs.values():
        assert {r["method"] for r in rep["results"]} == {"ar", "dflash", "ddtree"}
        assert all(isinstance(r["lossless"], bool) for r in rep["results"])
    assert all(r["lossless"] is True for r in runs["auto"]["results"])


@pytest.mark.skipif(kernel()[0] is None, reason="no streaming linear here")
def test_target_dtype_bf16_weights_streams_and_stays_lossless(trained_drafter_dir, tmp_path):
    """--target-dtype bf16-weights: weights rounded to bf16, activations in fp32, through the streaming
    linear (which reads their bf16 copies); lossless is exact, and the report says what ran."""
    out = tmp_path / "bf16w"
    main(["--drafter", str(trained_drafter_dir), "--budgets", "4", "--limit", "2", "--max-new-tokens", "16",
          "--concurrency", "1", "--target-dtype", "bf16-weights", "--output", str(out)])
    rep = json.loads((out / "report.json").read_text())
    assert rep["hardware"]["dtype"] == "bf16-weights" and rep["hardware"]["cpu_linear"] == "stream"
    assert "weights rounded to bf16, activations in float32" in (out / "report.md").read_text()
    assert {r["method"] for r in rep["results"]} == {"ar", "dflash", "ddtree"}
    assert all(r["lossless"] is True for r in rep["results"])
    # as stored
    assert rep["drafter_fingerprint"] == drafter_fingerprint(load_drafter(trained_drafter_dir)[0])
