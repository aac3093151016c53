"""Bad inputs to training and to dflash-cache, one row each: exit code 2, one `error:` line naming
the file or flag, no traceback, and nothing deleted or half-written (issue 21, train side).

The first row is the data loss a user met: overwrite=true on a finished run with a hidden-state
cache whose shard was deleted removed final/, the checkpoints and summary.json, then died at the
first batch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dflash_train.cli.cache as hs_cli
import dflash_train.data.hs_cache as hs
from conftest import ROOT, TINY_TARGET, error_line
from dflash_train.cli.train import main as train_main
from dflash_train.core.paths import ROOT as PACKAGE_ROOT  # the checkout whose dflash_train is under test
from dflash_train.data.dataset import load_conversations

TAPS = [4]  # the default tap of a 1-layer drafter on the 8-layer tiny target


def quick(out, small_data, *extra) -> list[str]:
    """A run of a few seconds on the small data (as in test_trainer.py)."""
    return [f"output_dir={out}", f"data.train={small_data / 'train.jsonl'}",
            f"data.val={small_data / 'val.jsonl'}", "max_steps=2", "train.batch_size=4", "data.num_anchors=4",
            "eval.max_samples=4", "model.num_layers=1", *extra]


def snapshot(folder: Path) -> dict:
    """Every file and folder under `folder`, with the files' bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def cache(tiny_target, small_data, tmp_path_factory):
    """A complete bf16 cache of small_data's train set in 3 shards."""
    ds = load_conversations(str(small_data / "train.jsonl"), tiny_target.tokenizer, 256)
    path = tmp_path_factory.mktemp("cache") / "c"
    hs.build_cache(tiny_target, ds, TAPS, path, "bfloat16", shard_rows=24)
    return path


@pytest.fixture(scope="module")
def finished(small_data, tmp_path_factory):
    """A finished run with a checkpoint at step 1: final/, checkpoints/, metrics.jsonl, summary.json."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train_main(quick(out, small_data, "checkpoint_every=1"))
    return out


# --- the cases: each builds its inputs under tmp and returns (entry, argv, words of the line) -----

def _cache_copy(cache, tmp):
    shutil.copytree(cache, tmp / "cache")
    return tmp / "cache"


def _run_copy(finished, tmp, interrupted=False):
    """A copy of the finished run; `interrupted`: as if stopped after its checkpoint (resumable)."""
    shutil.copytree(finished, tmp / "run")
    if interrupted:
        (tmp / "run" / "summary.json").unlink()
        shutil.rmtree(tmp / "run" / "final")
    return tmp / "run"


def deleted_shard_overwrite(tmp, small_data, cache, finished):
    c = _cache_copy(cache, tmp)
    (c / "shard_00001.safetensors").unlink()
    run = _run_copy(finished, tmp)
    return train_main, quick(run, small_data, "overwrite=true", f"data.hidden_state_cache={c}"), \
        "is missing shard_00001.safetensors"


def deleted_shard_new_run(tmp, small_data, cache, finished):
    c = _cache_copy(cache, tmp)
    (c / "shard_00002.safetensors").unlink()
    return train_main, quick(tmp / "new", small_data, f"data.hidden_state_cache={c}"), \
        "is missing shard_00002.safetensors"


def truncated_shard(tmp, small_data, cache, finished):
    c = _cache_copy(cache, tmp)
    shard = c / "shard_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return train_main, quick(tmp / "new", small_data, f"data.hidden_state_cache={c}"), \
        "shard_00000.safetensors is"


def corrupted_shard(tmp, small_data, cache, finished):
    c = _cache_copy(cache, tmp)
    shard = c / "shard_00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, one stored value changed
    shard.write_bytes(bytes(data))
    return train_main, quick(tmp / "new", small_data, f"data.hidden_state_cache={c}"), \
        "shard_00002.safetensors does not match the SHA-256 in its manifest"


def truncated_manifest(tmp, small_data, cache, finished):
    c = _cache_copy(cache, tmp)
    text = (c / hs.MANIFEST).read_text()
    (c / hs.MANIFEST).write_text(text[: len(text) // 2])
    run = _run_copy(finished, tmp)
    return train_main, quick(run, small_data, "overwrite=true", f"data.hidden_state_cache={c}"), \
        f"'{c / hs.MANIFEST}' is not valid JSON"


def manifest_field(tmp, small_data, cache, finished):
    c = _cache_copy(cache, tmp)
    m = json.loads((c / hs.MANIFEST).read_text())
    m["shards"][1]["rows"] = "all"
    (c / hs.MANIFEST).write_text(json.dumps(m))
    return train_main, quick(tmp / "new", small_data, f"data.hidden_state_cache={c}"), \
        f"'{c / hs.MANIFEST}': field 'shards.1.rows'"


def resume_state_field(tmp, small_data, cache, finished):
    run = _run_copy(finished, tmp, interrupted=True)
    pt = run / "checkpoints" / "step_000001" / "trainer_state.pt"
    state = torch.load(pt, weights_only=True)
    del state["epoch"]
    torch.save(state, pt)
    return train_main, quick(run, small_data, "checkpoint_every=1"), f"'{pt}': field 'epoch' is missing"


def resume_marker_field(tmp, small_data, cache, finished):
    run = _run_copy(finished, tmp, interrupted=True)
    marker = run / "checkpoints" / "step_000001" / "trainer_state.json"
    marker.write_text('{"step": "one"}\n')
    return train_main, quick(run, small_data, "checkpoint_every=1"), f"'{marker}': field 'step'"


def infinite_weight(tmp, small_data, cache, finished):
    return train_main, quick(tmp / "new", small_data, "loss.terms.ce=.inf"), \
        "'loss.terms.ce': Input should be a finite number"


def markov_rank(tmp, small_data, cache, finished):
    return train_main, quick(tmp / "new", small_data, "model.variant=dspark",
                             "model.markov_rank=1000000000"), \
        "model.markov_rank 1000000000 exceeds the target's vocabulary"


def selector_rank(tmp, small_data, cache, finished):
    return train_main, quick(tmp / "new", small_data, "model.variant=dflash2",
                             "model.selector_rank=1000000000"), \
        "model.selector_rank 1000000000 exceeds the target's vocabulary"


def max_length_past_positions(tmp, small_data, cache, finished):
    return train_main, quick(tmp / "new", small_data, "data.max_length=1000"), \
        "data.max_length 1000 is past the 512 positions of target"


def cache_max_length_past_positions(tmp, small_data, cache, finished):
    return hs_cli.main, ["--data", str(small_data / "val.jsonl"), "--target", str(TINY_TARGET),
                         "--output", str(tmp / "c"), "--max-length", "513"], \
        f"--max-length 513 is past the 512 positions of target '{TINY_TARGET}' (its max_position_embeddings)"


def cache_batch_size(tmp, small_data, cache, finished):
    return hs_cli.main, ["--data", str(small_data / "val.jsonl"), "--target", str(TINY_TARGET),
                         "--output", str(tmp / "c"), "--batch-size", "5000"], \
        "--batch-size must be at most 4096"


def cache_device(tmp, small_data, cache, finished):
    return hs_cli.main, ["--data", str(small_data / "val.jsonl"), "--target", str(TINY_TARGET),
                     "--output", str(tmp / "c"), "--device", "bogus"], "--device 'bogus' is not a device"


def cache_taps(tmp, small_data, cache, finished):
    return hs_cli.main, ["--data", str(small_data / "val.jsonl"), "--target", str(TINY_TARGET),
                     "--output", str(tmp / "c"), "--target-layer-ids",
                         "1,99"], "--target-layer-ids [99] out of range"


CASES = [deleted_shard_overwrite, deleted_shard_new_run, truncated_shard, corrupted_shard, truncated_manifest,
         manifest_field, resume_state_field, resume_marker_field, infinite_weight, markov_rank, selector_rank,
         cache_device, cache_taps, max_length_past_positions, cache_max_length_past_positions,
         cache_batch_size]


@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__)
def test_bad_input_is_one_line_exit_2_and_nothing_is_touched(case, tmp_path, small_data, cache, finished,
                                                             capsys):
    entry, argv, words = case(tmp_path, small_data, cache, finished)
    before = snapshot(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        entry(argv)
    assert e.value.code == 2
    line = error_line(capsys.readouterr().err)
    assert words in line, line
    assert snapshot(tmp_path) == before  # nothing deleted, moved aside, created or half-written


def test_the_data_loss_command_line(tmp_path, small_data, cache, finished):
    """The user's command, as a real process: the finished run keeps final/, checkpoints/ and summary.json."""
    _, argv, words = deleted_shard_overwrite(tmp_path, small_data, cache, finished)
    before = snapshot(tmp_path)
    r = subprocess.run([sys.executable, "-m", "dflash_train.train", *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)})
    assert r.returncode == 2 and words in error_line(r.stderr)
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")
    assert snapshot(tmp_path) == before
    assert {"final", "checkpoints", "summary.json"} <= {p.name for p in (tmp_path / "run").iterdir()}


def test_a_non_finite_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(tmp_path, small_data, capsys):
    """lr=1e30 is a legal recipe whose step 1 overflows the weights: step 2's loss is NaN. Before, it
    ran on and ended "done" with an all-NaN final/."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train_main(quick(out, small_data, "max_steps=3", "checkpoint_every=1", "train.lr=1e30"))
    assert e.value.code == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith("error: step 2: the loss is nan: training stopped and nothing of this "
                           f"step is saved; its newest checkpoint "
                           f"{out / 'checkpoints' / 'step_000001'} is kept"), line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001"]
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_copy_beside_a_checkpoint_is_not_a_checkpoint(tmp_path, small_data, finished, capsys):
    """checkpoints/step_000001.bak (a user's copy) is ignored: the run resumes from step_000001."""
    run = _run_copy(finished, tmp_path, interrupted=True)
    shutil.copytree(run / "checkpoints" / "step_000001", run / "checkpoints" / "step_000001.bak")
    train_main(quick(run, small_data, "checkpoint_every=1"))
    assert f"resuming from {run / 'checkpoints' / 'step_000001'}" in capsys.readouterr().out
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 1


