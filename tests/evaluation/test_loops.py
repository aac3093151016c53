"""The repetition-loop detector on crafted replies, and dflash-eval's loop counts and tau without loops."""

import json

import pytest
from transformers import AutoTokenizer

from conftest import TINY_TARGET
from dflash_train.evaluation import speed
from dflash_train.evaluation.loops import Loop, MIN_LOOP_TOKENS, MIN_REPEATS, find_loop
from dflash_train.evaluation.run import EvalSettings
from dflash_train.evaluation.summary import summarize
from dflash_train.evaluation.sweep import Sample


@pytest.fixture(scope="module")
def ids():
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


SENTENCE = " The cat sat on the mat and looked at the door."


def test_clean_replies_and_lists_do_not_loop(ids):
    assert find_loop(ids("12 + 30 = 42. To see it, add the tens (10 + 30 = 40) and then the ones (2), "
                         "which gives 40 + 2 = 42. Let me know if you want another example!")) is None
    # a long list whose items share their openings ("1. The ") is not periodic
    items = ["cat sat", "dog ran", "bird sang", "fish swam", "cow slept", "fox hid", "owl woke", "bee flew"]
    assert find_loop(ids("\n".join(f"{i}. The {x} in the garden." for i, x in enumerate(items, 1)))) is None
    assert find_loop([]) is None and find_loop([7]) is None


def test_a_sentence_three_times_loops_anywhere_in_the_reply(ids):
    lead, block = ids("Yes!"), ids(SENTENCE)
    assert len(block) * MIN_REPEATS >= MIN_LOOP_TOKENS  # long enough to count three times
    reply = ids("Yes!" + SENTENCE * 3)
    assert find_loop(reply) == Loop(len(lead), len(block), 3 * len(block))
    # a loop the reply escapes from still counts
    assert (find_loop(ids("Sure." + SENTENCE * 3 + " Then it went to sleep, and so did "
                                                   "I.")).period == len(block))
    # the last copy may be cut short (a reply cut by max_new_tokens)
    loop = find_loop(reply + block[:3])
    assert loop.length == 3 * len(block) + 3 and loop.repeats > 3


def test_one_token_repeated_loops_from_the_minimum_length():
    assert find_loop([5, 6] + [9] * MIN_LOOP_TOKENS) == Loop(2, 1, MIN_LOOP_TOKENS)
    assert find_loop([5, 6] + [9] * (MIN_LOOP_TOKENS - 1)) is None  # too short to matter


def test_near_misses_do_not_loop(ids):
    block = ids(SENTENCE)
    assert find_loop(ids("Sure." + SENTENCE * 2)) is None  # said twice: a restatement
    changed = block[:4] + [block[4] + 1] + block[5:]
    assert find_loop(ids("Yes!") + block + changed + block) is None  # three copies, one differs
    assert find_loop(ids("| a | b | c | d |\n|---|---|---|---|\n| 1 | 2 | 3 | 4 |")) is None  # a table's rule
    # a short block repeated below the token minimum, then the reply moves on
    assert find_loop([1, 2, 3] * 10 + [4]) is None and find_loop([1, 2, 3] * 11) == Loop(0, 3, 33)


def sample(prompt: int, method: str, budget: int, accept: int, outputs) -> Sample:
    return Sample(0, prompt, 0, method, budget, accept_lengths=[accept] * 4, outputs=outputs,
                  decoded=4 * accept, stage_s={"draft": 0.1, "tree": 0.0, "verify": 0.4, "commit": 0.0})


def test_summary_counts_looping_replies_and_reports_tau_without_them():
    """Prompt 1's second reply loops: it counts as one looping reply of six, and tau without loops
    is over prompts 0 and 2 only (the chain's high tau on the loop is left out)."""
    clean, loop = list(range(40)), [3, 4] * 20
    outputs = {0: [clean, clean], 1: [clean, loop], 2: [clean, clean]}
    chain_accept = {0: 2, 1: 6, 2: 3}  # the loop is easy to draft
    ar = [sample(i, "ar", 0, 1, outputs[i]) for i in range(3)]
    chain = [sample(i, "dflash", 7, chain_accept[i], outputs[i]) for i in range(3)]
    settings = EvalSettings(drafter="d", output="o", temperature=0.0, max_new_tokens=40, repeats=1)
    row, _ = summarize(chain, ar, "s", 3, settings, 8, speed.resample(3))
    assert (row["replies"], row["looping_replies"]) == (6, 1)
    assert row["tau"] == pytest.approx((2 + 6 + 3) / 3, abs=1e-4)
    assert row["tau_without_loops"] == pytest.approx((2 + 3) / 2)
    ar_row, _ = summarize(ar, ar, "s", 3, settings, 8, speed.resample(3))
    assert ar_row["looping_replies"] == 1 and ar_row["tau_without_loops"] == 1.0
    # every reply loops: no tau is left to report
    row, _ = summarize([sample(0, "dflash", 7, 5, [loop])], [sample(0, "ar", 0, 1, [loop])], "s", 1,
                       settings, 8, speed.resample(1))
    assert row["looping_replies"] == 1 and row["tau_without_loops"] is None


def test_eval_reports_loops_per_suite(trained_drafter_dir, tmp_path, monkeypatch):
    """dflash-eval in process, with every method's reply to one prompt replaced by a loop (the same
    for all methods, so the run stays lossless): report.json and report.md count it per suite."""
    import dflash_train.evaluation.sweep as ev
    from dflash_train.cli.eval import main

    questions = ["What is 2 + 2?", "Hello!", "Tell me about Oakgate."]
    suite = tmp_path / "three.jsonl"
    suite.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                             for q in questions))
    real_decode = ev.decode

    def looping_decode(target, drafter, prompt_ids, *rest):
        r = real_decode(target, drafter, prompt_ids, *rest)
        if "Hello!" in target.tokenizer.decode(prompt_ids[0]):
            r.tokens = [7, 8] * MIN_LOOP_TOKENS
        return r

    monkeypatch.setattr(ev, "decode", looping_decode)
    out = tmp_path / "out"
    main(["--drafter", str(trained_drafter_dir), "--suite", str(suite), "--budgets", "4", "--max-new-tokens",
          "8",
             "--concurrency", "1", "--output", str(out)])
    rows = json.loads((out / "report.json").read_text())["results"]
    assert [(r["method"], r["replies"], r["looping_replies"]) for r in rows] == [
        ("ar", 3, 1), ("dflash", 3, 1), ("ddtree", 3, 1)]
    assert all(r["lossless"] for r in rows)
    md = (out / "report.md").read_text()
    chain = rows[1]
    assert "| loops | tau without loops |" in md
    assert f"| 1/3 | {chain['tau_without_loops']:.2f} |" in md
