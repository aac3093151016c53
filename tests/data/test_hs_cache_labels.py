"""The hidden-state cache's stored labels (labels.<row>: the target's greedy token after each position)
against a fresh per-row target forward, in every cache dtype; HiddenStateCache.labels; older caches."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dflash_train.cli.cache as cache_cli
import dflash_train.data.hs_cache as hs
from conftest import TINY_TARGET, error_line, run_main
from dflash_train.core.errors import UserError
from dflash_train.data.dataset import load_conversations
from dflash_train.model.target import target_forward

TAPS = [1, 5]
ROWS = 20


@pytest.fixture(scope="module")
def ds(tiny_target, small_data):
    return load_conversations(str(small_data / "train.jsonl"), tiny_target.tokenizer, 256).select(range(ROWS))


@pytest.fixture(scope="module")
def caches(tiny_target, ds, tmp_path_factory):
    base = tmp_path_factory.mktemp("labels-cache")
    for dtype in ["float32", "bfloat16", "fp8"]:
        hs.build_cache(tiny_target, ds, TAPS, base / dtype, dtype, shard_rows=8)
    return {dtype: base / dtype for dtype in ["float32", "bfloat16", "fp8"]}


def stored_labels(path, row) -> torch.Tensor:
    m = json.loads((path / "manifest.json").read_text())
    shard = next(s for s in m["shards"] if s["rows"][0] <= row < s["rows"][1])
    with safe_open(str(path / shard["file"]), framework="pt") as f:
        return f.get_tensor(f"labels.{row}")


@torch.no_grad()
def test_labels_are_the_targets_argmax_of_its_fp32_states(caches, tiny_target, ds):
    """labels.<row> int32 [T] = argmax of the target's LM head over a fresh fp32 forward of the row
    alone (a flip only where the top two logits are within float32 noise of each other); the bf16
    and fp8 caches store the very same labels (taken before the states are rounded)."""
    assert json.loads((caches["float32"] / "manifest.json").read_text())["labels"] is True
    near_ties = 0
    for row in range(ROWS):
        ids = torch.tensor([ds[row]["input_ids"]])
        _, last = target_forward(tiny_target, ids, torch.ones_like(ids), TAPS)
        logits = tiny_target.lm_head(last[0])
        ref = logits.argmax(-1)
        got = stored_labels(caches["float32"], row)
        assert got.dtype == torch.int32 and got.shape == (ids.shape[1],)
        top2 = logits.topk(2, -1).values
        flips = got.long() != ref
        assert bool((top2[flips, 0] - top2[flips, 1] < 1e-4).all()), row
        near_ties += int(flips.sum())
        for dtype in ["bfloat16", "fp8"]:
            assert torch.equal(stored_labels(caches[dtype], row), got), (dtype, row)
    assert near_ties <= 2


def test_labels_of_a_batch_pad_with_minus_one(caches, tiny_target, ds):
    cache = hs.open_cache(caches["float32"], tiny_target, TAPS, ds)
    rows = [17, 3, 9]  # three shards of 8 rows
    lengths = [len(ds[r]["input_ids"]) for r in rows]
    T = max(lengths) + 3
    labels = cache.labels(rows, T, "cpu")
    assert labels.shape == (3, T) and labels.dtype == torch.long
    for i, (r, n) in enumerate(zip(rows, lengths)):
        assert torch.equal(labels[i, :n], stored_labels(caches["float32"], r).long())
        assert bool((labels[i, n:] == -1).all())
    # the cached fp32 states give the same argmax as the stored labels (same numbers, same head)
    _, last = cache.batch(rows, T, "cpu", torch.float32)
    with torch.no_grad():
        for i, n in enumerate(lengths):
            assert torch.equal(tiny_target.lm_head(last[i, :n]).argmax(-1), labels[i, :n])


def _rewrite_manifest(path, change) -> None:
    m = json.loads((path / "manifest.json").read_text())
    change(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_a_cache_without_labels_reads_as_none_and_one_missing_them_is_refused(caches, tiny_target, ds,
                                                                              tmp_path):
    old = tmp_path / "old"
    shutil.copytree(caches["bfloat16"], old)
    _rewrite_manifest(old, lambda m: m.pop("labels"))  # as written before labels were stored
    assert hs.open_cache(old, tiny_target, TAPS, ds).labels([0, 1], 300, "cpu") is None
    # a manifest that says labels, over a shard that has none for a row, is refused (one line)
    bad = tmp_path / "bad"
    shutil.copytree(caches["bfloat16"], bad)
    m = json.loads((bad / "manifest.json").read_text())
    shard = m["shards"][1]
    tensors = load_file(bad / shard["file"])
    del tensors[f"labels.{shard['rows'][0]}"]
    save_file(tensors, bad / shard["file"])
    size = (bad / shard["file"]).stat().st_size

    def fix(m):
        m["bytes_on_disk"] += size - m["shards"][1]["bytes"]
        m["shards"][1].update(bytes=size, sha256=hs.file_sha256(bad / shard["file"]))

    _rewrite_manifest(bad, fix)
    with pytest.raises(UserError, match=rf"{shard['file']} does not hold rows {shard['rows'][0]}\.\."):
        hs.check_complete(bad)


def test_dflash_cache_over_a_cache_without_labels_says_so(small_data, tmp_path):
    """A complete cache written before labels were stored is not taken as complete for these settings:
    one line naming labels, exit 2, the cache left as it was (--overwrite rebuilds it)."""
    out = tmp_path / "c"
    argv = ["--data", small_data / "val.jsonl", "--target", TINY_TARGET, "--output", out, "--dtype", "fp8"]
    code, _, stderr = run_main(cache_cli.main, argv)
    assert code == 0, stderr[-2000:]
    _rewrite_manifest(out, lambda m: m.pop("labels"))
    before = (out / "manifest.json").read_text()
    code, _, stderr = run_main(cache_cli.main, argv)
    assert code == 2 and "labels" in error_line(stderr) and "--overwrite" in error_line(stderr)
    assert (out / "manifest.json").read_text() == before
    code, _, stderr = run_main(cache_cli.main, [*argv, "--overwrite"])
    assert code == 0, stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["labels"] is True
