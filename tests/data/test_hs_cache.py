"""Offline hidden-state cache: same losses as online training, resumable builds, refusals."""

import json
import os
from pathlib import Path

import pytest
import torch

import dflash_train.cli.cache as hs_cli
import dflash_train.data.hs_cache as hs
from conftest import TINY_TARGET, error_line
from dflash_train.cli.train import main as train_main
from dflash_train.core.errors import UserError
from dflash_train.data.dataset import load_conversations
from dflash_train.model.target import load_target, target_forward

TAPS = [1, 5]  # the default taps of a 2-layer drafter on the 8-layer tiny target


@pytest.fixture(scope="module")
def ds(tiny_target, small_data):
    return load_conversations(str(small_data / "train.jsonl"), tiny_target.tokenizer, 256)


@pytest.fixture(scope="module")
def caches(tiny_target, ds, tmp_path_factory):
    base = tmp_path_factory.mktemp("cache")
    return {dtype: (base / dtype, hs.build_cache(tiny_target, ds, TAPS, base / dtype, dtype, shard_rows=24))
            for dtype in ["float32", "bfloat16", "fp8"]}


def test_manifest_and_stored_states(caches, tiny_target, ds):
    path, m = caches["float32"]
    assert m["rows"] == len(ds) and m["tokens"] == sum(len(x) for x in ds["input_ids"])
    assert m["target_layer_ids"] == TAPS and m["target_pin"]["kind"] == "content_sha256"
    assert len(m["shards"]) == (len(ds) + 23) // 24 and not (path / hs.PARTIAL).exists()
    assert m["bytes_per_token"] == 3 * 128 * 4 + 4  # + the int32 label
    assert caches["bfloat16"][1]["bytes_per_token"] == 3 * 128 * 2 + 4
    assert caches["fp8"][1]["bytes_per_token"] == 3 * 128 + 8 + 4
    for s in m["shards"]:
        assert hs.file_sha256(path / s["file"]) == s["sha256"]
    # a stored row equals a fresh target forward of that row alone
    cache = hs.open_cache(path, tiny_target, TAPS, ds)
    row = 30
    ids = torch.tensor([ds[row]["input_ids"]])
    taps, last = target_forward(tiny_target, ids, torch.ones_like(ids), TAPS)
    c_taps, c_last = cache.batch([row], ids.shape[1], "cpu", torch.float32)
    torch.testing.assert_close(c_taps, taps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c_last, last, rtol=1e-5, atol=1e-5)
    # bf16 and fp8 are close to it (e4m3 keeps 3 mantissa bits: relative error <= 1/16 per element)
    for dtype, tol in [("bfloat16", 2 ** -8), ("fp8", 2 ** -4)]:
        lossy = hs.open_cache(caches[dtype][0], tiny_target, TAPS, ds).batch([row], ids.shape[1], "cpu",
                                                                             torch.float32)[0]
        assert ((lossy - taps).abs() <= tol * taps.abs().amax(-1, keepdim=True) + 1e-6).all(), dtype


def _train(out, small_data, extra=()):
    train_main([f"output_dir={out}", "max_steps=4", "seed=5", f"data.train={small_data / 'train.jsonl'}",
                f"data.val={small_data / 'val.jsonl'}", "train.batch_size=4", "eval.max_samples=4", *extra])
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_offline_training_gives_the_online_losses(caches, small_data, tmp_path):
    """Same seed, same data, same anchors: the only difference is where the taps come from.
    float32 cache: equal to 1e-5 relative (batched vs per-row forward rounding); bf16: 2e-2."""
    online = _train(tmp_path / "online", small_data)
    offline = _train(tmp_path / "f32", small_data, [f"data.hidden_state_cache={caches['float32'][0]}"])
    bf16 = _train(tmp_path / "bf16", small_data, [f"data.hidden_state_cache={caches['bfloat16'][0]}"])
    assert online == pytest.approx(offline, rel=1e-5)
    assert online == pytest.approx(bf16, rel=2e-2)
    assert online[-1] < online[0]


def test_interrupted_build_resumes(tiny_target, ds, caches, tmp_path, monkeypatch):
    real_save, calls = hs.save_file, {"n": 0}

    def crash_on_third(tensors, path):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        real_save(tensors, path)

    monkeypatch.setattr(hs, "save_file", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        hs.build_cache(tiny_target, ds, TAPS, tmp_path / "c", "float32", shard_rows=24)
    partial = json.loads((tmp_path / "c" / hs.PARTIAL).read_text())
    assert len(partial["shards"]) == 2 and not (tmp_path / "c" / hs.MANIFEST).exists()
    with pytest.raises(UserError, match="did not finish"):
        hs.open_cache(tmp_path / "c", tiny_target, TAPS, ds)
    monkeypatch.setattr(hs, "save_file", real_save)
    m = hs.build_cache(tiny_target, ds, TAPS, tmp_path / "c", "float32", shard_rows=24)
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in caches["float32"][1]["shards"]]


def test_cache_for_other_target_taps_or_data_is_refused(caches, ds, tiny_target, qwen3_random_target_dir):
    path = caches["bfloat16"][0]
    with pytest.raises(UserError, match="another target"):
        hs.open_cache(path, load_target(str(qwen3_random_target_dir)), TAPS, ds)
    with pytest.raises(UserError, match="has taps"):
        hs.open_cache(path, tiny_target, [1, 3], ds)
    with pytest.raises(UserError, match="other data"):
        hs.open_cache(path, tiny_target, TAPS, ds.select(range(len(ds) - 1)))


def test_ctrl_c_then_the_same_command_resumes_and_then_says_complete(small_data, tmp_path, monkeypatch,
                                                                     capsys):
    """Interrupted while writing its first shard (a half-written .tmp file and no partial manifest
    yet): one line, exit 130; the same command resumes; once more, it says the cache is complete."""
    out = tmp_path / "c"
    cmd = ["--data", str(small_data / "val.jsonl"), "--target", str(TINY_TARGET), "--output", str(out),
           "--shard-rows", "8", "--dtype", "float32"]
    real_save = hs.save_file

    def cut_off(tensors, path):
        path.write_bytes(b"half a shard")
        raise KeyboardInterrupt

    monkeypatch.setattr(hs, "save_file", cut_off)
    with pytest.raises(SystemExit) as e:
        hs_cli.main(cmd)
    assert e.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted with 0 of 2 shards done; rerun the same command to resume")
    assert list(out.glob(".shard_*.tmp")) and not (out / hs.PARTIAL).exists()
    monkeypatch.setattr(hs, "save_file", real_save)
    hs_cli.main(cmd)
    manifest = json.loads((out / hs.MANIFEST).read_text())
    assert len(manifest["shards"]) == 2 and not list(out.glob(".shard_*.tmp"))
    plain = tmp_path / "plain.txt"  # shards are as readable as any file the user writes
    plain.write_text("x")
    assert (out / "shard_00000.safetensors").stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    capsys.readouterr()
    hs_cli.main(cmd)
    assert f"hidden-state cache '{out}' is already complete (16 rows" in capsys.readouterr().err
    # a shard deleted since: the same command rebuilds it (and only it), instead of "complete"
    kept = (out / "shard_00000.safetensors").stat().st_mtime_ns
    (out / "shard_00001.safetensors").unlink()
    hs_cli.main(cmd)
    assert f"hidden-state cache '{out}' is missing shard_00001.safetensors" in capsys.readouterr().err
    assert json.loads((out / hs.MANIFEST).read_text()) == manifest and not (out / hs.PARTIAL).exists()
    assert (out / "shard_00000.safetensors").stat().st_mtime_ns == kept
    assert json.loads((out / hs.MANIFEST).read_text()) == manifest
    # other settings: refused, or (--overwrite) rebuilt
    with pytest.raises(SystemExit):
        hs_cli.main([*cmd[:-1], "bfloat16"])
    assert "holds a complete cache for other settings" in error_line(capsys.readouterr().err)
    hs_cli.main([*cmd[:-1], "bfloat16", "--overwrite"])
    assert json.loads((out / hs.MANIFEST).read_text())["dtype"] == "bfloat16"


def test_the_targets_dtype_is_recorded_and_part_of_the_resume_key(small_data, tmp_path, monkeypatch, capsys):
    """Issue 30: a build interrupted in fp32 (auto on a CPU) and resumed with --target-dtype bf16 mixed
    bf16 and fp32 states; now it is refused, untouched, and the manifest records the dtype."""
    out = tmp_path / "c"
    cmd = ["--data", str(small_data / "val.jsonl"), "--target", str(TINY_TARGET), "--output", str(out),
           "--shard-rows", "8", "--dtype", "float32"]
    real_save, calls = hs.save_file, []

    def second_cut_off(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_save(tensors, path)

    monkeypatch.setattr(hs, "save_file", second_cut_off)
    with pytest.raises(SystemExit):
        hs_cli.main(cmd)
    monkeypatch.setattr(hs, "save_file", real_save)
    assert json.loads((out / hs.PARTIAL).read_text())["target_dtype"] == "fp32"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        hs_cli.main([*cmd, "--target-dtype", "bf16"])
    line = error_line(capsys.readouterr().err)
    assert (e.value.code == 2 and "holds a partial cache for other settings (target_dtype "
                                  "differ)" in line), line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    hs_cli.main([*cmd, "--target-dtype", "fp32"])
    assert json.loads((out / hs.MANIFEST).read_text())["target_dtype"] == "fp32"


def test_a_damaged_cache_of_ours_is_replaced_with_overwrite(small_data, tmp_path, capsys):
    """Issue 30: a cache we wrote (marker present) whose manifest is cut short could not be replaced
    even with --overwrite; the user had to delete it by hand."""
    out = tmp_path / "c"
    cmd = ["--data", str(small_data / "val.jsonl"), "--target", str(TINY_TARGET), "--output", str(out),
           "--shard-rows", "8", "--dtype", "float32"]
    hs_cli.main(cmd)
    whole = (out / hs.MANIFEST).read_text()
    (out / hs.MANIFEST).write_text(whole[:50])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        hs_cli.main(cmd)
    line = error_line(capsys.readouterr().err)
    assert (e.value.code == 2 and "is not valid JSON" in line and "pass --overwrite to replace "
                                                                  "this cache" in line)
    assert (out / hs.MANIFEST).read_text() == whole[:50]
    hs_cli.main([*cmd, "--overwrite"])
    assert json.loads((out / hs.MANIFEST).read_text()) == json.loads(whole)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_overwrite_in_the_current_folder_keeps_it_and_a_folder_around_it_is_refused(small_data, tmp_path,
                                                                                   monkeypatch, capsys):
    """Issue 30: `dflash-cache --output . --overwrite` was a traceback (renaming '.': EBUSY), and the
    current folder named by its path was renamed away and deleted (the shell left in a deleted
    folder). Now the folder stays and only its entries are replaced; an output that holds the
    current folder (`--output ..` from inside it) is one line and nothing is touched."""
    out = tmp_path / "c"
    cmd = ["--data", str(small_data / "val.jsonl"), "--target", str(TINY_TARGET), "--shard-rows", "8",
           "--dtype", "float32"]
    hs_cli.main([*cmd, "--output", str(out)])
    inode = out.stat().st_ino
    monkeypatch.chdir(out)
    for given, dtype in [(".", "bfloat16"), (str(out), "fp8")]:  # other settings each time: replaced
        hs_cli.main([*cmd[:-1], dtype, "--output", given, "--overwrite"])
        assert out.stat().st_ino == inode and Path.cwd() == out and os.path.exists(os.getcwd())
        assert json.loads((out / hs.MANIFEST).read_text())["dtype"] == dtype
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no old sibling or lock file left
    (out / "notes").mkdir()
    monkeypatch.chdir(out / "notes")
    before = sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        hs_cli.main([*cmd, "--output", "..", "--overwrite"])
    assert e.value.code == 2 and error_line(capsys.readouterr().err) == (
        f"error: --output '..' holds the current folder '{out / 'notes'}': replacing it would delete the "
        "folder you are in; run the command from outside it")
    assert sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before
