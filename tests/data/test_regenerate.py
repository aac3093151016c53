"""Regeneration: turn-by-turn histories, drops, batched generation, resume after interruption."""

import json
from dataclasses import replace

import pytest
from datasets import load_from_disk

from conftest import ROOT, TINY_TARGET
from dflash_train.core.errors import UserError
from dflash_train.cli import prepare
from dflash_train.data import regenerate as regen
from dflash_train.data.chat import weights_key
from dflash_train.data.dataset import load_conversations, stop_token_ids
from dflash_train.data.regenerate import Generation, Sampling
from dflash_train.model.target import load_target, resolve_pin

TINY_DATA = ROOT / "data" / "tiny" / "train.jsonl"
GREEDY = Sampling(backend="transformers", temperature=0.0, top_p=1.0, max_new_tokens=24, seed=0, batch_size=2,
                  enable_thinking=False, keep_truncated=True)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_conversations(n: int) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in TINY_DATA.read_text().splitlines()[:n]]


def test_answer_points_split_at_assistant_turns():
    s, u1, a1, u2, a2 = ({"role": r, "content": c} for r, c in
                         [("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2"),
                          ("assistant", "A2")])
    assert regen.answer_points([s, u1, a1, u2, a2]) == [[s, u1], [u2]]
    assert regen.answer_points([s, u1]) == [[s, u1]]  # prompt-only rows get an answer
    assert regen.answer_points([u1, a1, a2, u2]) == [[u1], [u2]]  # consecutive replies count once
    assert regen.answer_points([a1]) == []


def fake_generate(tok, replies, prompts_seen):
    """Answers 'reply N.' and records each decoded prompt; `replies` maps N -> (text, stopped)."""

    def generate(prompts, seed):
        out = []
        for p in prompts:
            prompts_seen.append(tok.decode(p))
            text, stopped = replies.get(len(prompts_seen), (f"reply {len(prompts_seen)}.", True))
            out.append(Generation(tok(text, add_special_tokens=False)["input_ids"], stopped))
        return out

    return generate


def test_history_holds_the_targets_own_answers_and_drops_are_counted(tiny_target, tmp_path):
    tok = tiny_target.tokenizer
    convs = tiny_conversations(4)  # rows 0 and 1 have two user turns, rows 2 and 3 one
    # Prompt order (chunks of 2): row 0 turn 1, row 1 turn 1, row 0 turn 2, row 1 turn 2, row 2, row 3.
    seen = []
    replies = {5: ("", True), 6: ("cut off", False)}
    s = replace(GREEDY, keep_truncated=False)
    results, stats = regen.regenerate(convs, tok, fake_generate(tok, replies, seen), s, tmp_path / "w1", {})
    assert [m["content"] for m in results[0] if m["role"] == "assistant"] == ["reply 1.", "reply 3."]
    assert ([m for m in results[0] if m["role"] != "assistant"] == [m for m in convs[0] if m["role"]
                                                                    != "assistant"])
    # The prompt for row 0's second answer holds its first answer by the target, not the dataset's.
    assert "reply 1.<|im_end|>" in seen[2] and convs[0][2]["content"] not in seen[2]
    assert seen[2].endswith(convs[0][3]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert results[2:] == ["empty_generation", "hit_max_new_tokens"]
    assert stats["answered"] == 2 and stats["dropped"] == {"empty_generation": 1, "hit_max_new_tokens": 1}
    # --keep-truncated keeps the cut answer, marked as cut.
    results, _ = regen.regenerate(convs, tok, fake_generate(tok, replies, []), GREEDY, tmp_path / "w2", {})
    assert results[3][-1] == {"role": "assistant", "content": "cut off", "truncated": True}


def test_a_kept_truncated_answer_ends_the_conversation(tiny_target, tmp_path):
    tok = tiny_target.tokenizer
    convs = tiny_conversations(2)  # two user turns each
    seen = []
    results, stats = regen.regenerate(convs, tok, fake_generate(tok, {1: ("cut off", False)}, seen), GREEDY,
                                      tmp_path / "w", {})
    # row 0's first answer was cut: its second user turn is never asked, nor written
    assert results[0] == convs[0][:2] + [{"role": "assistant", "content": "cut off", "truncated": True}]
    assert len(seen) == 3 and convs[0][3]["content"] not in "".join(seen)
    assert [m.get("truncated") for m in results[1] if m["role"] == "assistant"] == [None, None]
    assert stats["answered"] == 2 and stats["ended_by_truncated_answer"] == 1


def test_batched_generation_matches_one_at_a_time(tiny_target):
    """Left padding is right: a prompt's greedy answer does not depend on its batch."""
    tok = tiny_target.tokenizer
    stops = sorted(stop_token_ids(None, tok, "<|im_end|>"))
    generate = regen.transformers_generate(tiny_target, stops, replace(GREEDY, max_new_tokens=16))
    prompts = [regen._prompt_ids(tok, [{"role": "user", "content": q}], False)
               for q in ["What is 23 + 59?", "Hi"]]
    batched = generate(prompts, 0)
    assert [generate([p], 0)[0] for p in prompts] == batched
    assert all(g.tokens and stops[0] not in g.tokens for g in batched)


class Interrupted(Exception):
    pass


def test_resume_after_interruption_equals_an_uninterrupted_run(qwen3_random_target_dir, tmp_path):
    # A randomly initialised target: its samples depend on the seed (the tiny target's barely do).
    target = load_target(str(qwen3_random_target_dir))
    tok, convs = target.tokenizer, tiny_conversations(6)
    s = replace(GREEDY, temperature=1.0, top_p=0.9, seed=7, max_new_tokens=12)
    # Its answers are all cut at 12 tokens: counted as finished here, so that every turn is asked.
    finished = lambda generate: lambda p, seed: [replace(g, stopped=True)  # noqa: E731
                                                 for g in generate(p, seed)]
    generate = finished(regen.transformers_generate(target, sorted(stop_token_ids(None, tok, "<|im_end|>")),
                                                    s))
    record = {"target": str(qwen3_random_target_dir)} | vars(s)
    calls = []

    def flaky(prompts, seed):
        calls.append(len(prompts))
        if len(calls) == 4:  # one call per turn of a chunk: this fails after a chunk or two are done
            raise Interrupted
        return generate(prompts, seed)

    work = tmp_path / "work"
    with pytest.raises(Interrupted):
        regen.regenerate(convs, tok, flaky, s, work, record)
    done = [json.loads(line)["i"] for line in (work / regen.DONE_FILE).read_text().splitlines()]
    assert done == list(range(len(done))) and 0 < len(done) < len(convs) and len(done) % s.batch_size == 0
    calls.clear()
    resumed, stats = regen.regenerate(convs, tok, flaky, s, work, record)
    assert stats["resumed"] == len(done) and sum(calls) < sum(len(regen.answer_points(c)) for c in convs)

    fresh, _ = regen.regenerate(convs, tok, generate, s, tmp_path / "fresh", record)
    assert resumed == fresh
    s8 = replace(s, seed=8)
    other, _ = regen.regenerate(convs, tok, finished(regen.transformers_generate(target, [2], s8)), s8,
                                tmp_path / "s8", record)
    assert other != fresh
    # Resuming with other settings is refused rather than mixing answers.
    with pytest.raises(UserError, match="other settings"):
        regen.regenerate(convs, tok, generate, s, work, record | {"temperature": 0.5})


def test_prepare_regenerate_cli(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(TINY_DATA.read_text().splitlines(keepends=True)[:4]))
    out = tmp_path / "out"
    prepare.main(["--input", str(src), "--format", "messages", "--target", str(TINY_TARGET), "--output",
                  str(out), "--regenerate", "--max-new-tokens", "48", "--batch-size", "4",
                  "--min-supervised-tokens", "2", "--keep-truncated"])
    info = json.loads((out / "prepare_info.json").read_text())
    r = info["regeneration"]
    assert (r["backend"], r["temperature"], r["max_new_tokens"], r["seed"]) == ("transformers", 0.0, 48, 0)
    # the resume key holds the target's weights by content: other weights at the same path never resume
    assert r["target_weights"] == weights_key(resolve_pin(str(TINY_TARGET), None))
    assert r["stats"]["answered"] == 4 and r["stats"]["generated_tokens"] > 0
    rows = [json.loads(line)["messages"] for line in (out / "regenerated.jsonl").read_text().splitlines()]
    source = tiny_conversations(4)
    users = lambda convs: [[m for m in c if m["role"] == "user"] for c in convs]  # noqa: E731
    assert users(rows) == users(source)
    assert info["counts"]["kept"] == 4 and not (tmp_path / "out.work").exists()


def test_kept_truncated_answer_is_supervised_to_the_cut_without_end_of_turn(tmp_path):
    """The tiny target's first answer (41 tokens) is cut at 12; the next rows' answers stop by
    themselves. The cut row ends with exactly the 12 generated tokens, all supervised, and no
    end-of-turn token; a stopped answer still has its end-of-turn token labelled. Training on
    regenerated.jsonl directly masks it the same way."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(TINY_DATA.read_text().splitlines(keepends=True)[:3]))
    out = tmp_path / "out"
    prepare.main(["--input", str(src), "--format", "messages", "--target", str(TINY_TARGET), "--output",
                  str(out), "--regenerate", "--max-new-tokens", "12", "--batch-size", "4",
                  "--min-supervised-tokens", "2", "--keep-truncated"])
    target = load_target(str(TINY_TARGET))
    tok = target.tokenizer
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    first = tiny_conversations(1)[0][:2]  # system + first user turn
    s = replace(GREEDY, max_new_tokens=12)
    cut = regen.transformers_generate(target, sorted(stop_token_ids(None, tok, "<|im_end|>")), s)(
        [regen._prompt_ids(tok, first, False)], 0)[0]
    assert not cut.stopped and len(cut.tokens) == 12

    regenerated = [json.loads(line)["messages"]
                   for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert (regenerated[0] == first + [{"role": "assistant", "content": tok.decode(cut.tokens),
                                        "truncated": True}])
    # row 1: the first answer stopped, the second (a long sum) was cut; row 2's answer stopped
    assert [m.get("truncated") for m in regenerated[1] if m["role"] == "assistant"] == [None, True]
    assert not any(m.get("truncated") for m in regenerated[2])
    info = json.loads((out / "prepare_info.json").read_text())
    assert info["regeneration"]["stats"]["ended_by_truncated_answer"] == 2
    rows = load_from_disk(str(out))
    ids, mask = rows[0]["input_ids"], rows[0]["loss_mask"]
    assert ids[-12:] == cut.tokens and mask[-12:] == [1] * 12 and sum(mask) == 12 and eot not in ids[-13:]

    def supervised(row):  # the decoded runs of supervised tokens
        runs, cur = [], []
        for t, m in zip(row["input_ids"], row["loss_mask"] + [0]):
            if m:
                cur.append(t)
            elif cur:
                runs, cur = runs + [tok.decode(cur)], []
        return runs + ([tok.decode(cur)] if cur else [])

    replies = lambda k: [m["content"] for m in regenerated[k] if m["role"] == "assistant"]  # noqa: E731
    # a stopped answer keeps its eot
    assert supervised(rows[1]) == [replies(1)[0] + "<|im_end|>", replies(1)[1]]
    assert rows[1]["input_ids"][-1] != eot and rows[1]["loss_mask"][-1] == 1
    assert supervised(rows[2]) == [replies(2)[0] + "<|im_end|>"]
    from_jsonl = load_conversations(str(out / "regenerated.jsonl"), tok, 4096)
    assert from_jsonl["input_ids"] == rows["input_ids"] and from_jsonl["loss_mask"] == rows["loss_mask"]


def test_vllm_backend_needs_vllm():
    with pytest.raises(UserError, match="needs the 'vllm' package"):
        regen.import_vllm()


def test_regenerate_writes_only_into_a_work_folder_of_its_own(tiny_target, tmp_path):
    """The library call checks the work folder too: one it did not write is refused, untouched."""
    tok, convs = tiny_target.tokenizer, tiny_conversations(2)
    work = tmp_path / "mine"
    work.mkdir()
    (work / "notes.txt").write_text("my notes")
    with pytest.raises(UserError, match="was not written by dflash-prepare --regenerate"):
        regen.regenerate(convs, tok, fake_generate(tok, {}, []), GREEDY, work, {})
    assert [p.name for p in work.iterdir()] == ["notes.txt"]
    ours = tmp_path / "ours"
    regen.regenerate(convs, tok, fake_generate(tok, {}, []), GREEDY, ours, {})
    assert (sorted(p.name for p in ours.iterdir()) == [".dflash-train.json", regen.DONE_FILE,
                                                       regen.SETTINGS_FILE])
    regen.check_work_folder(ours)  # ours: resumable
    assert regen.work_folder(tmp_path / "out") == tmp_path / "out.work"
    assert regen.work_folder(tmp_path / "out" / "..") == tmp_path.parent / f"{tmp_path.name}.work"


def test_an_unmarked_work_folder_holding_only_its_own_files_is_resumed(tiny_target, tmp_path):
    """A work folder from before the marker (older dflash-prepare, or seeded by data/corpus.py):
    only settings.json (a JSON object) and done.jsonl. It is resumed, and marked; one more file,
    or a settings.json that does not parse, and it is not ours."""
    tok, convs = tiny_target.tokenizer, tiny_conversations(2)
    work = tmp_path / "old"
    regen.regenerate(convs, tok, fake_generate(tok, {}, []), GREEDY, work, {})
    (work / ".dflash-train.json").unlink()
    _, stats = regen.regenerate(convs, tok, fake_generate(tok, {}, []), GREEDY, work, {})
    assert stats["resumed"] == 2 and (work / ".dflash-train.json").is_file()
    (work / ".dflash-train.json").unlink()
    (work / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not written by"):
        regen.check_work_folder(work)
    (work / "notes.txt").unlink()
    (work / regen.SETTINGS_FILE).write_text("{\"cut")
    with pytest.raises(UserError, match="not written by"):
        regen.check_work_folder(work)
