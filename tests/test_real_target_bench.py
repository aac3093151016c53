"""benchmarks/real_target.py's stage bookkeeping (its stages themselves are the toolkit's own
commands, tested elsewhere): --stages selects, two invocations sharing a cache folder keep each
other's stage times, and an eval whose drafter was never trained stops with one line."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
    assert set(json.loads((tmp_path / "timings.json").read_text())) == {"train-dflash", "eval-dflash-t0", "train-dspark"}
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
    Dataset.from_dict({"input_ids": [ids[1][:-2]]}).save_to_disk(str(prepared / "val"))  # a cut reply still matches
    (prepared / "regenerated.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))  # 3: dropped
    info = bench.Bench.t1_prompts(prepared, target, tmp_path / "prompts-t1.jsonl")
    got = [json.loads(line)["messages"] for line in (tmp_path / "prompts-t1.jsonl").read_text().splitlines()]
    assert got == [convs[0][:1], convs[2][:1]]
    assert info == {"rows": 4, "train_prompts": 2, "val_prompts_left_out": 1, "train_rows": 2}
