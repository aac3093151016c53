"""benchmarks/variants_table.py: an arm calibrated beside the DFlash reference is scaled to the first
calibration's load, and the committed card's reports read back as the issue quotes them."""

import importlib.util
import json

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("variants_table", ROOT / "benchmarks" / "variants_table.py")
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)


def calibration(runs, name, steps, seconds):
    (runs / f"calib-{name}").mkdir(parents=True)
    tokens = 1000 * steps  # s/step = tokens / (tokens / s) / steps
    (runs / f"calib-{name}" / "summary.json").write_text(json.dumps(
        {"steps": steps, "train_tokens": tokens, "train_tokens_per_s": tokens / seconds}))


def test_arms_calibrated_under_load_are_scaled_by_the_reference(tmp_path):
    calibration(tmp_path, "dflash", 20, 30.0)  # 1.5 s/step on an idle machine
    calibration(tmp_path, "xpress", 20, 120.0)
    calibration(tmp_path, "dflashref", 20, 90.0)  # the same DFlash arm under load: 4.5 s/step
    calibration(tmp_path, "dspark", 20, 180.0)  # 9 s/step under that load -> 2x DFlash -> 3 s/step
    assert table.s_per_step(tmp_path, "dflash") == pytest.approx(1.5)
    assert table.s_per_step(tmp_path, "xpress") == pytest.approx(6.0)  # calibrated idle: not scaled
    assert table.s_per_step(tmp_path, "dspark") == pytest.approx(3.0)
    assert table.s_per_step(tmp_path, "dflash2") is None


def test_the_committed_cards_reports_read_as_quoted():
    """Issue 44 quotes the committed drafter: MT-Bench chain tau 1.41, DDTree@64 2.00, best T=0 speedups
    1.14x / 1.27x / 1.13x."""
    row = table.committed_row()
    t0 = row["t0"]["suites"]
    mtbench = t0["mtbench"]
    assert round(mtbench["chain_tau"], 2) == 1.41 and round(mtbench["ddtree_tau"]["64"], 2) == 2.00
    assert [round(t0[s]["best_speedup"], 2) for s in table.SUITES] == [1.14, 1.27, 1.13]
    assert all(t0[s]["lossless"] for s in table.SUITES)
    assert all(x["lossless"] is None for x in row["t1"]["suites"].values())  # T=1: not judged
    text = table.tables([row])
    assert "committed DFlash card" in text and "1.41 / 2.00 / 1.14x (DDTree@3, 1.11-1.26)" in text


def report(runs, folder, suites, drafter="runs/variants/dflash/final", budgets=(3, 64)):
    rows = [{"suite": s, "method": m, "budget": b, "tau": tau, "speedup": 1.0 + tau / 10,
             "speedup_interval": [0.9, 1.1], "lossless": True, "tokens_per_s": 10.0}
            for s in suites for m, b, tau in [("ar", 0, 1.0), ("dflash", 0, 1.5), ("ddtree", 3, 1.6),
                                               ("ddtree", 64, 2.1)]]
    (runs / folder).mkdir()
    (runs / folder / "report.json").write_text(json.dumps(
        {"command": f"dflash-eval {folder}", "drafter": drafter, "temperature": 0.0, "budgets": list(budgets),
         "results": rows}))


def test_an_arms_later_suites_join_its_report(tmp_path):
    """MT-Bench was decoded one session and GSM8K / HumanEval the next (TAG=more): one row, both commands;
    a continuation of another drafter or a suite decoded twice stops the table."""
    report(tmp_path, "eval-dflash-t0", ["mtbench"])
    report(tmp_path, "eval-dflash-t0-more", ["gsm8k", "humaneval"])
    report(tmp_path, "eval-dflash2-t0", ["mtbench"], drafter="runs/variants/dflash2/final")  # not dflash's
    joined = table.arm_reports(tmp_path, "dflash", "t0")
    assert joined["command"] == ["dflash-eval eval-dflash-t0", "dflash-eval eval-dflash-t0-more"]
    assert sorted(table.suite_rows(joined)) == sorted(table.SUITES)
    assert table.arm_reports(tmp_path, "dflash", "t1") is None
    report(tmp_path, "eval-dflash-t0-again", ["gsm8k"])
    with pytest.raises(AssertionError, match="evaluated twice"):
        table.arm_reports(tmp_path, "dflash", "t0")
    report(tmp_path, "eval-xpress-t0", ["mtbench"], drafter="runs/variants/xpress/final")
    report(tmp_path, "eval-xpress-t0-more", ["gsm8k"], drafter="runs/variants/xpress/checkpoints/step_000100")
    with pytest.raises(AssertionError, match="another drafter"):
        table.arm_reports(tmp_path, "xpress", "t0")


def test_the_committed_drafter_re_measured_here_is_its_own_row(tmp_path):
    assert table.committed_here_row(tmp_path) is None
    report(tmp_path, "eval-committed-t0", table.SUITES, drafter="checkpoints/smollm2-135m-dflash")
    row = table.committed_here_row(tmp_path)
    assert row["arm"] == "committed-here" and sorted(row["t0"]["suites"]) == sorted(table.SUITES)
    assert "committed DFlash drafter, re-measured here" in table.tables([row])


def test_rows_of_runs_gone_are_kept_with_the_commit_that_measured_them(tmp_path):
    """runs/ does not outlive a machine: a table written over a fresh runs/ keeps the earlier rows of the arms
    it no longer finds, marked, and replaces those measured again."""
    report(tmp_path, "eval-committed-t0", table.SUITES, drafter="checkpoints/smollm2-135m-dflash")
    now = [table.committed_here_row(tmp_path)]
    previous = {"commit": "abc1234" + "0" * 33,
                "rows": [{"arm": "committed-here", "t0": {}}, {"arm": "xpress", "steps": 610},
                         {"arm": "dflash", "steps": 2483, "measured_at": "fed9876" + "0" * 33}]}
    rows = table.merge_kept(now, previous)
    assert [r["arm"] for r in rows] == ["dflash", "xpress", "committed-here"]
    assert rows[2] is now[0] and "measured_at" not in rows[2]  # measured again: the new row
    assert rows[1] == {"arm": "xpress", "steps": 610, "measured_at": previous["commit"]}
    assert rows[0]["measured_at"].startswith("fed9876")  # kept twice: still its first measurement's
    assert table.label(rows[1]) == "XPress (measured at abc1234)"
    assert table.merge_kept(now, None) == now


def test_an_arm_calibrated_on_an_earlier_machine_keeps_its_recorded_s_per_step(tmp_path):
    """The train stage's step count: the calibration here wins; without one, the s/step the results recorded;
    without either, none (the stage stops and says to calibrate)."""
    previous = {"commit": "0" * 40, "rows": [{"arm": "dflash2", "s_per_step": 3.159}, {"arm": "dflash"}]}
    assert table.recorded_s_per_step(tmp_path, "dflash2", previous) == 3.159
    assert table.recorded_s_per_step(tmp_path, "dflash2", None) is None
    assert table.recorded_s_per_step(tmp_path, "xpress", previous) is None
    calibration(tmp_path, "dflash2", 20, 60.0)
    assert table.recorded_s_per_step(tmp_path, "dflash2", previous) == pytest.approx(3.0)
