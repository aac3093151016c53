"""Training with model.draft_vocab_size: the vocabulary it builds (recomputed from the data), the frozen
head, exact resume, init_from, refusals, and the cheap ce step (no full LM head between log steps when a
hidden-state cache stores the target's labels)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import dflash_train.cli.cache as cache_cli
from conftest import TINY_TARGET, error_line, run_main
from helpers.draft_vocab_run import DRAFT_VOCAB, draft_vocab_run, reference_vocab, run_args
from dflash_train.checkpoint.folders import load_drafter
from dflash_train.cli.train import main

V = 1024  # the tiny target's vocabulary


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_data):
    return draft_vocab_run(tmp_path_factory, small_data)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_final_holds_the_vocabulary_of_the_data_and_the_targets_rows(run, small_data, tiny_target):
    out, stdout = run
    kept, counts = reference_vocab(small_data, DRAFT_VOCAB)
    assert len(counts) > DRAFT_VOCAB  # the ranking decided, not the padding
    saved = load_file(out / "final" / "model.safetensors")
    assert (saved["lm_head.weight"].shape == (DRAFT_VOCAB, 128) and saved["lm_head.weight"].dtype
            == torch.float32)
    assert saved["d2t"].dtype == torch.int64 and saved["d2t"].shape == (DRAFT_VOCAB,)
    assert saved["t2d"].dtype == torch.bool and saved["t2d"].shape == (V,)
    assert (saved["d2t"] + torch.arange(DRAFT_VOCAB)).tolist() == kept
    assert saved["t2d"].nonzero().flatten().tolist() == kept
    # the frozen head is the target's rows of the kept ids, untouched by 40 steps of training
    assert torch.equal(saved["lm_head.weight"], tiny_target.lm_head.weight[kept])
    assert (json.loads((out / "final"
                        / "config.json").read_text())["drafter"]["draft_vocab_size"] == DRAFT_VOCAB)
    drafter, _ = load_drafter(out / "final")
    assert drafter.config.draft_vocab_size == DRAFT_VOCAB and drafter.draft_vocab.kept.tolist() == kept
    covered = sum(counts[t] for t in kept) / sum(counts.values())
    assert (f"draft vocabulary: {DRAFT_VOCAB} of {V} tokens, covering {covered:.1%} of data.train's "
            "supervised tokens" in stdout)
    ckpt = load_file(out / "checkpoints" / "step_000020" / "model.safetensors")
    assert (torch.equal(ckpt["d2t"], saved["d2t"]) and torch.equal(ckpt["lm_head.weight"],
                                                                   saved["lm_head.weight"]))


def test_alpha_is_recorded_on_log_steps_only(run):
    out, _ = run
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 41))
    for r in rows:
        assert ("alpha_per_position" in r) == (r["step"] % 5 == 0), r
        assert set(r["terms"]) == {"ce"} and r["loss"] > 0
    assert all(0 < a <= 1 for r in rows[4::5] for a in r["alpha_per_position"])
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval"]["eal"] >= 1.0 and len(summary["eval"]["alpha_per_position"]) == 7


def test_a_run_stopped_after_its_checkpoint_resumes_to_the_same_weights(run, small_data, tmp_path):
    """As if killed after step 20's checkpoint (final/ and summary.json not yet written): the same
    command resumes from step 20 and ends with the uninterrupted run's weights and losses."""
    out, _ = run
    moved = tmp_path / "run"
    shutil.copytree(out, moved)
    shutil.rmtree(moved / "final")
    (moved / "summary.json").unlink()
    code, stdout, stderr = run_main(main, run_args(moved, small_data))
    assert code == 0, stderr[-3000:]
    assert f"resuming from {moved / 'checkpoints' / 'step_000020'}" in stdout
    assert [r["loss"] for r in metrics(moved)] == pytest.approx([r["loss"] for r in metrics(out)], rel=1e-6)
    a, b = load_file(moved / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in ("d2t", "t2d", "lm_head.weight"):
        assert torch.equal(a[k], b[k]), k
    for k, v in b.items():
        torch.testing.assert_close(a[k], v, rtol=1e-6, atol=1e-7, msg=k)


def test_init_from_keeps_its_vocabulary_on_other_data(run, small_data, tmp_path):
    """model.init_from a draft-vocabulary drafter, trained on other data (val.jsonl): its vocabulary
    and head stay the drafter's, not rebuilt from the new data; a recipe whose size differs is refused."""
    out, _ = run
    kept, _ = reference_vocab(small_data, DRAFT_VOCAB)
    assert reference_vocab(small_data, DRAFT_VOCAB, "val")[0] != kept  # val.jsonl would build another one
    argv = [f"output_dir={tmp_path / 'ft'}", f"model.init_from={out / 'final'}", "model.num_layers=1",
            f"model.draft_vocab_size={DRAFT_VOCAB}", "max_steps=1", "train.lr=1e-12", "train.batch_size=4",
            "data.num_anchors=4", "eval.max_samples=2", f"data.train={small_data / 'val.jsonl'}",
            f"data.val={small_data / 'val.jsonl'}"]
    code, stdout, stderr = run_main(main, argv)
    assert code == 0, stderr[-3000:]
    start = load_file(out / "final" / "model.safetensors")
    end = load_file(tmp_path / "ft" / "final" / "model.safetensors")
    for k in ("d2t", "t2d", "lm_head.weight"):
        assert torch.equal(end[k], start[k]), k
    assert (end["d2t"] + torch.arange(DRAFT_VOCAB)).tolist() == kept
    code, _, stderr = run_main(main, [f"output_dir={tmp_path / 'ft1'}", *argv[1:3],
                                      "model.draft_vocab_size=64", *argv[4:]])
    assert code == 2
    assert "model.init_from drafter has draft_vocab_size 128 but the recipe gives 64" in error_line(stderr)
    code, _, stderr = run_main(main, [f"output_dir={tmp_path / 'ft2'}",
                                      *(a for a in argv[1:] if "draft_vocab" not in a)])
    assert code == 2 and "draft_vocab_size 128 but the recipe gives None" in error_line(stderr)
    code, _, stderr = run_main(main, [f"output_dir={tmp_path / 'ft3'}", *argv[1:],
                                      "model.variant=dspark", "model.markov_rank=8"])
    assert code == 0, stderr[-3000:]  # DSpark keeps it: W2 over it
    assert load_drafter(tmp_path / "ft3" / "final")[0].markov_head.markov_w2.weight.shape == (DRAFT_VOCAB, 8)


def test_dflash2_grows_from_a_draft_vocabulary_drafter_on_the_whole_vocabulary(run, small_data, tmp_path,
                                                                                 tiny_target):
    """DFlash2 has no draft vocabulary: model.init_from a drafter with one keeps its backbone, drops its
    head and maps (said in one line) and drafts over the target's whole head."""
    out, _ = run
    code, stdout, stderr = run_main(main, [
        f"output_dir={tmp_path / 'd2'}", f"model.init_from={out / 'final'}", "model.num_layers=1",
        "model.variant=dflash2", "model.selector_rank=8", "max_steps=1", "train.lr=1e-12",
        "train.batch_size=4", "data.num_anchors=4", "eval.max_samples=2",
        f"data.train={small_data / 'val.jsonl'}", f"data.val={small_data / 'val.jsonl'}"])
    assert code == 0, stderr[-3000:]
    assert f"its {DRAFT_VOCAB}-token draft vocabulary is dropped" in stdout
    start = load_file(out / "final" / "model.safetensors")
    end_drafter = load_drafter(tmp_path / "d2" / "final")[0]
    end = end_drafter.state_dict()
    assert end_drafter.config.draft_vocab_size is None and end_drafter.lm_head is None
    assert not {"d2t", "t2d", "lm_head.weight"} & set(end)
    for k, v in start.items():
        if k not in ("d2t", "t2d", "lm_head.weight"):
            torch.testing.assert_close(end[k], v, rtol=0, atol=1e-8, msg=k)
    assert end_drafter.logits_head(tiny_target.lm_head) is tiny_target.lm_head
    assert not (tmp_path / "ft1").exists() and not (tmp_path / "ft2").exists()


@pytest.mark.parametrize("extra, message", [
    (["model.draft_vocab_size=1"], "'model.draft_vocab_size': Input should be greater than or "
                                   "equal to 2 (got 1)"),
    ([f"model.draft_vocab_size={V + 1}"], f"model.draft_vocab_size {V + 1} must be in 2..{V - 1}"),
    (["model.draft_vocab_size=64", "model.variant=dspark", "model.markov_rank=8", "tree_distill.weight=0.5"],
     "tree_distill scores nodes over the full vocabulary: it does not run with model.draft_vocab_size"),
    (["model.draft_vocab_size=64", "model.variant=dflash2"],
     "model.draft_vocab_size is for variants dflash, dspark, xpress: model.variant=dflash2"),
])
def test_bad_draft_vocab_sizes_are_one_line_exit_2(extra, message, small_data, tmp_path):
    out = tmp_path / "o"
    code, _, stderr = run_main(main, [f"output_dir={out}", "max_steps=1",
                                      f"data.train={small_data / 'train.jsonl'}",
                                      f"data.val={small_data / 'val.jsonl'}", *extra])
    assert code == 2
    assert message in error_line(stderr)
    assert not out.exists()


# --- the cheap step: labels from the hidden-state cache ------------------------------------------

@pytest.fixture(scope="module")
def labels_cache(small_data, tmp_path_factory):
    """dflash-cache of data.train (fp32, the 1-layer drafter's taps), and a copy whose manifest says
    it has no labels (a cache written before they were stored)."""
    base = tmp_path_factory.mktemp("dv-cache")
    code, _, stderr = run_main(cache_cli.main, ["--data", small_data / "train.jsonl", "--target", TINY_TARGET,
                                                "--output", base / "new", "--dtype", "float32",
                                                "--num-draft-layers", "1", "--shard-rows", "24"])
    assert code == 0, stderr[-3000:]
    manifest = json.loads((base / "new" / "manifest.json").read_text())
    assert manifest["labels"] is True
    shutil.copytree(base / "new", base / "old")
    del manifest["labels"]
    (base / "old" / "manifest.json").write_text(json.dumps(manifest))
    return base


def counted_run(out, small_data, monkeypatch, *extra) -> tuple[list[dict], dict[int, int]]:
    """A 6-step draft-vocabulary run (log_every=3) -> (metrics, calls of the target's LM head per
    training step, validation left out)."""
    import dflash_train.training.setup as setup
    import dflash_train.training.trainer as trainer

    calls, step_now = {}, {"step": None}
    real_load, real_step = setup.load_target, trainer.optimizer_step

    def count(*_):  # a forward hook: returns None, the output is kept
        if step_now["step"] is not None:
            calls[step_now["step"]] = calls.get(step_now["step"], 0) + 1

    def load_target(*a, **k):
        target = real_load(*a, **k)
        target.lm_head.register_forward_hook(count)
        return target

    def optimizer_step(run_, step, stop):
        step_now["step"] = step
        try:
            return real_step(run_, step, stop)
        finally:
            step_now["step"] = None

    monkeypatch.setattr(setup, "load_target", load_target)
    monkeypatch.setattr(trainer, "optimizer_step", optimizer_step)
    code, _, stderr = run_main(main, [f"output_dir={out}", "seed=4", "max_steps=6", "log_every=3",
                                      f"model.draft_vocab_size={DRAFT_VOCAB}", "model.num_layers=1",
                                      "train.batch_size=4", "data.num_anchors=8", "eval.max_samples=4",
                                      f"data.train={small_data / 'train.jsonl'}",
                                      f"data.val={small_data / 'val.jsonl'}", *extra])
    assert code == 0, stderr[-3000:]
    return metrics(out), calls


def test_a_ce_step_on_a_labels_cache_never_calls_the_full_lm_head(labels_cache, small_data, tmp_path,
                                                                  monkeypatch):
    """With the cache's labels, no training step applies the target's [V, H] head (alpha on log steps
    comes from the N-row head); the losses are those of labels taken from the full head (a cache
    without labels) and of online training."""
    cached, calls = counted_run(tmp_path / "new", small_data, monkeypatch,
                                f"data.hidden_state_cache={labels_cache / 'new'}")
    assert calls == {}, calls
    full_head, calls_old = counted_run(tmp_path / "old", small_data, monkeypatch,
                                       f"data.hidden_state_cache={labels_cache / 'old'}")
    assert sorted(calls_old) == list(range(1, 7))  # the counter sees the full head when it is used
    online, calls_online = counted_run(tmp_path / "online", small_data, monkeypatch)
    assert sorted(calls_online) == list(range(1, 7))
    assert [r["loss"] for r in cached] == pytest.approx([r["loss"] for r in full_head], rel=1e-6)
    assert [r["loss"] for r in cached] == pytest.approx([r["loss"] for r in online], rel=1e-5)
    for rows in (cached, full_head, online):
        assert [("alpha_per_position" in r) for r in rows] == [False, False, True, False, False, True]
    for a, b in zip(cached[2::3], online[2::3]):
        assert a["alpha_per_position"] == pytest.approx(b["alpha_per_position"], rel=1e-4, abs=1e-5)
