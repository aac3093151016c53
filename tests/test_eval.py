"""`dflash-eval` end to end on the tiny target, its report, and its refusals."""

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from dflash_train.eval import main
from dflash_train.report import advise_budget

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(trained_drafter_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "report"
    mt = out.parent / "mt.jsonl"
    mt.write_text(json.dumps({"prompt": ["What is 12 + 30?", "Thank you!"]}) + "\n")
    main(["--drafter", str(trained_drafter_dir), "--budgets", "0,4,64", "--limit", "6", "--max-new-tokens", "48",
          "--suite", "tinychat", "--suite", f"mt-bench={mt}", "--output", str(out)])
    return out, json.loads((out / "report.json").read_text())


def test_report_results(report):
    out, rep = report
    rows = rep["results"]
    assert {(r["suite"], r["method"], r["budget"]) for r in rows} == {
        (s, m, b) for s in ["tinychat", "mt-bench"] for m, b in [("ar", 0), ("dflash", 7), ("ddtree", 0),
                                                                  ("ddtree", 4), ("ddtree", 64)]}
    for r in rows:
        assert {"suite", "method", "budget", "temperature", "tau", "tokens_per_s", "lossless"} <= r.keys()
        assert r["lossless"] is True, r
        assert sum(r["accept_hist"].values()) == r["rounds"]
        assert r["tokens_per_s"] > 0
    by = {(r["suite"], r["method"], r["budget"]): r for r in rows}
    for s in ["tinychat", "mt-bench"]:
        assert by[(s, "ar", 0)]["tau"] == 1.0 and by[(s, "ddtree", 0)]["tau"] == 1.0  # root only = AR
    # the tree accepts more than the chain on the bundled suite
    assert by[("tinychat", "ddtree", 64)]["tau"] > by[("tinychat", "dflash", 7)]["tau"]
    assert by[("mt-bench", "ar", 0)]["prompts"] == 1 and by[("mt-bench", "ar", 0)]["rounds"] > 10  # two turns
    hw = rep["hardware"]
    assert hw["device_type"] == "cpu" and hw["torch"] and hw["device"]
    assert rep["advice"]["tinychat"]["best_budget"] in (0, 4, 64)


def test_report_markdown_and_plots(report):
    out, rep = report
    md = (out / "report.md").read_text()
    chain = next(r for r in rep["results"] if r["suite"] == "tinychat" and r["method"] == "dflash")
    assert f"| dflash | 7 | {chain['tau']:.2f} |" in md
    assert "Recommended DDTree budget" in md
    for png in ["tau_vs_budget.png", "accept_hist.png"]:
        img = mpimg.imread(out / png)
        assert img.ndim == 3 and img.shape[0] > 100 and img.std() > 0  # a real, non-blank image


def test_advice_uses_device_verify_costs():
    stage = lambda ms: {"draft": 0.0, "tree": 0.0, "verify": ms, "commit": 0.0}  # noqa: E731
    results = [{"suite": "s", "method": "ar", "budget": 0, "tau": 1.0, "stage_ms_per_round": stage(10)},
               {"suite": "s", "method": "dflash", "budget": 7, "tau": 3.0, "stage_ms_per_round": stage(12)},
               {"suite": "s", "method": "ddtree", "budget": 16, "tau": 4.0, "stage_ms_per_round": stage(20)},
               {"suite": "s", "method": "ddtree", "budget": 64, "tau": 5.0, "stage_ms_per_round": stage(50)}]
    costs = {"device": "GPU", "verify_ms_by_width": {"1": 10, "16": 10, "128": 11}, "draft_ms": 1.0,
             "tree_build_ms_by_budget": {"16": 0.5, "64": 1.0}}
    adv = advise_budget(results, costs)["s"]
    assert adv["best_budget"] == 16 and adv["best_predicted_speedup"] == pytest.approx(2.0)
    # on the device, verify at width 65 is interpolated in log-width between 16 and 128
    v65 = 10 + (11 - 10) * (__import__("math").log(65 / 16) / __import__("math").log(128 / 16))
    assert adv["device"]["best_budget"] == 64
    assert adv["device"]["best_predicted_speedup"] == pytest.approx(5.0 * 10 / (1.0 + 1.0 + v65), rel=1e-3)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash_train.eval", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_bad_input_is_one_line_exit_2(tmp_path, trained_drafter_dir, llama_target_dir):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep")
    cases = [
        (["--drafter", str(tmp_path / "nope"), "--output", str(tmp_path / "o1")], "drafter not found"),
        (["--drafter", str(trained_drafter_dir), "--target", str(llama_target_dir), "--output", str(tmp_path / "o2")],
         "does not match target"),
        (["--drafter", str(trained_drafter_dir), "--suite", "nope", "--output", str(tmp_path / "o3")],
         "unknown suite"),
        (["--drafter", str(trained_drafter_dir), "--budgets", "4,x", "--output", str(tmp_path / "o4")],
         "--budgets must be"),
        (["--drafter", str(trained_drafter_dir), "--output", str(busy)], "is not empty"),
    ]
    for args, message in cases:
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and message in lines[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))
    assert (busy / "x").read_text() == "keep"
