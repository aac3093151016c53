"""benchmarks/real_target.py's stage bookkeeping (its stages themselves are the toolkit's own
commands, tested elsewhere): --stages selects, two invocations sharing a cache folder keep each
other's stage times, and an eval whose drafter was never trained stops with one line."""

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("real_target_bench", ROOT / "benchmarks" / "real_target.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_stages_select_and_timings_are_shared(tmp_path):
    ran = []
    trainer = bench.Bench(tmp_path, "full", stages=("train",))
    evaluator = bench.Bench(tmp_path, "full", stages=("eval-dflash-t",))
    trainer.timed("train-dflash", lambda: ran.append("train-dflash"))
    evaluator.timed("train-dspark", lambda: ran.append("train-dspark"))  # not the evaluator's stage
    evaluator.timed("eval-dflash-t0", lambda: ran.append("eval-dflash-t0"))
    evaluator.timed("eval-dflash-fp32taps-t0", lambda: ran.append("fp32taps"))  # another prefix
    trainer.timed("train-dspark", lambda: ran.append("train-dspark"))
    trainer.timed("train-dflash", lambda: ran.append("again"))  # done: skipped
    assert ran == ["train-dflash", "eval-dflash-t0", "train-dspark"]
    # each wrote after the other: neither lost the other's entries
    assert (set(json.loads((tmp_path / "timings.json").read_text()))
            == {"train-dflash", "eval-dflash-t0", "train-dspark"})
    assert not list(tmp_path.glob("*.part"))


def test_eval_of_an_untrained_row_is_one_line(tmp_path):
    b = bench.Bench(tmp_path, "quick", stages=("eval",))
    with pytest.raises(SystemExit) as e:
        b.evaluate("dspark", 0.0)
    assert "'dspark': it is not trained" in str(e.value)


def test_off_path_prompts_are_the_training_prompts_without_val(tmp_path):
    """--tree's temperature-1 set asks the greedy set's training prompts again: never a val prompt,
    never one whose row prepare dropped (matched by the chat prompt's token ids)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    target = ROOT / "data" / "tiny-target"
    tok = AutoTokenizer.from_pretrained(target)
    convs = [[{"role": "user", "content": q}, {"role": "assistant", "content": f"answer {i}"}]
             for i, q in enumerate(["What is 2 + 2?", "Hello!", "Sort 3, 1, 2.", "Tell me about Oakgate."])]
    ids = [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in convs]
    prepared = tmp_path / "prepared"
    Dataset.from_dict({"input_ids": [ids[0], ids[2]]}).save_to_disk(str(prepared / "train"))
    # a cut reply still matches
    Dataset.from_dict({"input_ids": [ids[1][:-2]]}).save_to_disk(str(prepared / "val"))
    # 3: dropped
    (prepared / "regenerated.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    info = bench.Bench.t1_prompts(prepared, target, tmp_path / "prompts-t1.jsonl")
    got = [json.loads(line)["messages"] for line in (tmp_path / "prompts-t1.jsonl").read_text().splitlines()]
    assert got == [convs[0][:1], convs[2][:1]]
    assert info == {"rows": 4, "train_prompts": 2, "val_prompts_left_out": 1, "train_rows": 2}


@pytest.mark.parametrize("mode", ["full", "quick"])
def test_every_command_the_benchmark_runs_parses(tmp_path, monkeypatch, mode):
    """Each stage's command line, as both modes build it (the objectives and tree rows included), is
    accepted by its tool's own parser, and a training command's recipe with its overrides validates:
    a recipe rule added later (eval.deploy_budget must be among eval.ddtree_budgets) once broke the
    speed stage, found only when --quick ran an hour's worth of stages later."""
    from dflash_train.cli import cache as hs_cache, eval as dflash_eval, prepare
    from dflash_train.cli import real_target as fetch
    from dflash_train.training.config import load_recipe
    from dflash_train.cli.train import parse_args as train_args

    seen = []

    def run(cmd, log):
        cmd = [str(c) for c in cmd]
        tool = Path(cmd[0]).name
        if "dflash_train/train.py" in cmd:
            args = train_args(cmd[cmd.index("dflash_train/train.py") + 1:])
            load_recipe(ROOT / args.recipe, args.overrides)  # raises UserError on a key the recipe rejects
            out = Path(next(a.split("=", 1)[1] for a in args.overrides if a.startswith("output_dir=")))
            out.mkdir(parents=True)
            (out / "summary.json").write_text("{}")  # so the evals after it run
            seen.append("train")
        elif tool == "dflash-eval":
            dflash_eval.parse_args(cmd[1:])
            seen.append("eval")
        elif tool == "dflash-prepare":
            prepare.parse_args(cmd[1:])
            seen.append("prepare")
        elif tool == "dflash-cache":
            hs_cache.parse_args(cmd[1:])
            seen.append("cache")
        else:
            assert cmd[1:3] == ["-m", "dflash_train.cli.real_target"], cmd
            fetch.parse_args(cmd[3:])
            seen.append("fetch")
        return 0.0

    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench.Bench, "select", lambda self: None)  # reads the fetched ShareGPT file
    monkeypatch.setattr(bench.Bench, "select_t1", lambda self: None)
    bench.Bench(tmp_path, mode).all(objectives=True, tree=True)
    objective_rows = 2 * len(bench.OBJECTIVES) - 1  # CE + D-PACE seed 0 is the dflash row
    fp32taps = mode == "full"  # the bf16-vs-fp32 taps row (and its cache): the full table's question
    rows = len(bench.ROWS) + fp32taps + len(bench.TREE_ROWS) + objective_rows
    assert seen.count("train") == 4 + rows  # the speed stage's 4 runs, then every row
    # the variant and tree rows at each temperature; fp32 taps and the objectives at T=0
    assert seen.count("eval") == (len(bench.ROWS) + len(bench.TREE_ROWS)) * len(bench.TEMPERATURES[mode]) \
        + fp32taps + objective_rows
    assert seen.count("prepare") == 2 and seen.count("cache") == 2 + fp32taps and seen.count("fetch") == 1


def test_teacher_forced_numbers_of_every_trained_run_are_kept(tmp_path):
    """The objectives' table reads the runs' own validation (summary.json); speed runs are not rows."""
    def summary(name, eal):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"steps": 300, "wall_s": 1380.0, "eval": {
            "eal": eal, "ddtree_tau": {"16": 1.5, "64": 1.7}, "acc_per_position": [0.2, 0.1],
            "alpha_per_position": [0.11, 0.05]}}))
    summary("obj-kl-s1", 1.215)
    summary("speed-cache-bf16-0", 1.01)
    (tmp_path / "runs" / "dflash").mkdir()  # not finished: no summary
    tf = bench.Bench(tmp_path, "full").teacher_forced()
    assert tf == {"obj-kl-s1": {"steps": 300, "wall_s": 1380.0, "eal": 1.215,
                                "ddtree_tau": {"16": 1.5, "64": 1.7}, "acc_slot1": 0.2, "alpha_slot1": 0.11}}
