"""A corpus that grows at its end: `dflash-prepare --append-to` keeps the earlier rows and val split,
`dflash-cache --append` keeps the earlier cache's full shards; both give what a fresh build of the grown
data gives."""

import json
import shutil
from pathlib import Path

import pytest
from datasets import load_from_disk
from safetensors.torch import load_file, save_file

import dflash_train.data.hs_cache as hs
from conftest import ROOT, TINY_TARGET, run_main
from dflash_train.cli import cache as cache_cli
from dflash_train.cli import prepare as prepare_cli
from dflash_train.core.errors import UserError
from dflash_train.data.dataset import load_conversations

TINY_DATA = ROOT / "data" / "tiny" / "train.jsonl"
TAPS = [1, 5]


def corpus(path: Path, n: int) -> Path:
    path.write_text("".join(TINY_DATA.read_text().splitlines(keepends=True)[:n]))
    return path


def prepare(tmp_path: Path, n: int, out: str, *extra) -> Path:
    args = ["--input", corpus(tmp_path / f"c{n}.jsonl", n), "--format", "messages", "--target", TINY_TARGET,
            "--min-supervised-tokens", "8", "--max-length", "128", "--output", tmp_path / out, *extra]
    code, _, err = run_main(prepare_cli.main, args)
    assert code == 0, err[-2000:]
    return tmp_path / out


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """40 conversations prepared with a val split of 6, then the same corpus grown to 70, appended."""
    d = tmp_path_factory.mktemp("grow")
    small = prepare(d, 40, "small", "--val-size", "6", "--seed", "1")
    big = prepare(d, 70, "big", "--append-to", small)
    return d, small, big


def rows(folder: Path) -> list:
    ds = load_from_disk(str(folder))
    return list(zip(ds["input_ids"], ds["loss_mask"]))


def test_appended_data_keeps_the_old_rows_first_and_the_old_val(grown, tiny_target):
    d, small, big = grown
    old_train, old_val, new_train = rows(small / "train"), rows(small / "val"), rows(big / "train")
    assert rows(big / "val") == old_val  # validation stays comparable across growth
    assert new_train[: len(old_train)] == old_train  # a cache of the old train rows is a prefix of the new
    # The rest are exactly the rows of conversations 41..70 a plain prepare keeps, in input order.
    tail = prepare(d, 70, "plain")
    plain = rows(tail)
    assert new_train[len(old_train):] == [r for r in plain if r not in old_train and r not in old_val]
    assert len(new_train) > len(old_train) and not set(map(str, new_train)) & set(map(str, old_val))
    info = json.loads((big / "prepare_info.json").read_text())
    assert info["appended_to"]["already_there"] == len(old_train) + len(old_val)
    assert info["splits"] == {"train": len(new_train), "val": len(old_val)}
    assert info["tokens"]["total"] == sum(len(r[0]) for r in new_train + old_val)
    assert (load_conversations(str(big / "train"), tiny_target.tokenizer, 128)["input_ids"]
            == [r[0] for r in new_train])


@pytest.mark.parametrize("case, extra, expected", [
    ("split_flags", ["--val-size", "3"], "--append-to keeps the earlier output's split"),
    ("other_length", ["--max-length", "96"], "other settings (max_length 128 vs 96)"),
    ("not_prepared", None, "is not a dflash-prepare output"),
    ("same_folder", None, "are the same folder"),
])
def test_bad_append_is_one_line_and_writes_nothing(grown, tmp_path, case, extra, expected):
    _, small, _ = grown
    target, out = small, tmp_path / "out"
    if case == "not_prepared":
        target = tmp_path / "notes"  # beside --output, not around it (that is refused first)
        target.mkdir()
    if case == "same_folder":
        out = small
    args = ["--input", corpus(tmp_path / "c.jsonl", 50), "--format", "messages", "--target", TINY_TARGET,
            "--min-supervised-tokens", "8", "--max-length", "128", "--output", out, "--append-to", target]
    args += extra or []  # a flag given twice: argparse keeps the last
    before = sorted(p.name for p in small.rglob("*"))
    code, _, err = run_main(prepare_cli.main, args)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1 and expected in errors[0], err[-2000:]
    assert not (tmp_path / "out").exists() and sorted(p.name for p in small.rglob("*")) == before


def other_target(tmp_path: Path, what: str) -> Path:
    """A copy of the tiny target with the same chat template: the same files, other weights (one value
    changed), or another tokenizer (its last 100 BPE merges gone: other ids for the same text)."""
    target = tmp_path / f"target-{what}"
    shutil.copytree(TINY_TARGET, target)
    if what == "weights":
        weights = load_file(target / "model.safetensors")
        name = sorted(weights)[0]
        weights[name].view(-1)[0] += 1.0
        save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    if what == "tokenizer":
        spec = json.loads((target / "tokenizer.json").read_text())
        spec["model"]["merges"] = spec["model"]["merges"][:-100]
        (target / "tokenizer.json").write_text(json.dumps(spec))
    return target


@pytest.mark.parametrize("what, expected", [
    ("tokenizer", "was prepared with another tokenizer (target "),
    ("weights", "was prepared from other target weights ("),
])
def test_append_from_another_tokenizer_or_other_weights_is_refused(grown, tmp_path, what, expected):
    """Same chat template, so only the tokenizer's or the weights' hash tells: appending mixed two
    tokenizations (and duplicated rows), or rewrote the info to name weights the old rows never saw."""
    _, small, _ = grown
    before = tree(small)
    args = ["--input", corpus(tmp_path / "c.jsonl", 50), "--format", "messages", "--target",
            other_target(tmp_path, what), "--min-supervised-tokens", "8", "--max-length", "128", "--output",
            tmp_path / "out", "--append-to", small]
    code, _, err = run_main(prepare_cli.main, args)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1 and expected in errors[0], err[-2000:]
    assert not (tmp_path / "out").exists() and tree(small) == before


@pytest.mark.parametrize("drop, expected", [("tokenizer", "records no tokenizer hash"),
                                            ("weights", "records no pin of its target's weights")])
def test_an_output_that_records_no_key_is_refused(grown, tmp_path, drop, expected):
    """An output from before the key: whether its rows match this target cannot be told."""
    _, small, _ = grown
    old = tmp_path / "old"
    shutil.copytree(small, old)
    info = json.loads((old / "prepare_info.json").read_text())
    del (info if drop == "tokenizer" else info["target"])[drop]
    (old / "prepare_info.json").write_text(json.dumps(info))
    args = ["--input", corpus(tmp_path / "c.jsonl", 50), "--format", "messages", "--target", TINY_TARGET,
            "--min-supervised-tokens", "8", "--max-length", "128", "--output", tmp_path / "out",
            "--append-to", old]
    code, _, err = run_main(prepare_cli.main, args)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and expected in errors[0], err[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["cut", "not_an_object", "split_elsewhere", "not_text", "template_null"])
def test_a_damaged_prepare_info_is_one_line(grown, tmp_path, damage):
    _, small, _ = grown
    old = tmp_path / "old"
    shutil.copytree(small, old)
    path = old / "prepare_info.json"
    info = json.loads(path.read_text())
    path.write_bytes({"cut": path.read_bytes()[:60], "not_an_object": b"[]", "not_text": b"\xff\xfe\x00",
                      "split_elsewhere": json.dumps(info | {"splits": {"../../x": 1}}).encode(),
                      "template_null": json.dumps(info | {"template": None}).encode()}[damage])
    before = tree(old)
    args = ["--input", corpus(tmp_path / "c.jsonl", 50), "--format", "messages", "--target", TINY_TARGET,
            "--min-supervised-tokens", "8", "--max-length", "128", "--output", tmp_path / "out",
            "--append-to", old]
    code, _, err = run_main(prepare_cli.main, args)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert (code == 2 and len(errors) == 1 and f"--append-to '{old}': its prepare_info.json is "
                                               f"damaged" in errors[0])
    assert not (tmp_path / "out").exists() and tree(old) == before


def test_a_copy_of_the_target_elsewhere_appends(grown, tmp_path):
    """The key is the content: the same weights and tokenizer at another path are the same target."""
    d, small, big = grown
    out = prepare(tmp_path, 70, "grown", "--append-to", small, "--target", other_target(tmp_path, "copy"))
    assert rows(out / "train") == rows(big / "train") and rows(out / "val") == rows(big / "val")
    info, old = (json.loads((f / "prepare_info.json").read_text()) for f in (out, small))
    assert info["tokenizer"] == old["tokenizer"] and info["target"]["weights"]["sha256"] == \
        old["target"]["weights"]["sha256"]


def tree(folder: Path) -> list:
    return sorted((p.relative_to(folder), p.read_bytes() if p.is_file() else None) for p in folder.rglob("*"))


@pytest.mark.parametrize("output, relation", [("outer", "holds"), ("outer/inner/grown", "is inside")])
def test_an_output_holding_or_inside_the_append_target_is_refused_and_it_is_kept(tmp_path, output, relation):
    """--append-to is an input: `--output P --append-to P/inner --overwrite` deleted P/inner."""
    outer = prepare(tmp_path, 12, "outer")
    inner = prepare(tmp_path, 12, "outer/inner")
    before = tree(outer)
    args = ["--input", corpus(tmp_path / "c.jsonl", 20), "--format", "messages", "--target", TINY_TARGET,
            "--min-supervised-tokens", "8", "--max-length", "128", "--output", tmp_path / output,
            "--append-to", inner, "--overwrite"]
    code, _, err = run_main(prepare_cli.main, args)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err[-2000:]
    assert f"{relation} the --append-to '{inner}'" in errors[0]
    assert tree(outer) == before


def test_cache_append_keeps_full_shards_and_equals_a_fresh_build(grown, tiny_target, tmp_path, monkeypatch):
    _, small, big = grown
    old_ds = load_conversations(str(small / "train"), tiny_target.tokenizer, 128)
    new_ds = load_conversations(str(big / "train"), tiny_target.tokenizer, 128)
    out = tmp_path / "cache"
    m0 = hs.build_cache(tiny_target, old_ds, TAPS, out, "float32", shard_rows=8)
    assert len(old_ds) % 8  # the old cache ends in a short shard, which extending must rebuild
    full = [s for s in m0["shards"] if s["rows"][1] - s["rows"][0] == 8]
    stamps = {s["file"]: (out / s["file"]).stat().st_mtime_ns for s in full}

    # Without --append: one line naming both ways out, nothing changed.
    with pytest.raises(UserError, match="cache of the first .* rows: pass --append to extend it"):
        hs.build_cache(tiny_target, new_ds, TAPS, out, "float32", shard_rows=8)
    assert json.loads((out / "manifest.json").read_text()) == m0

    # Extending runs the target only over rows it has not cached in a full shard.
    seen = []
    real = hs.target_forward
    monkeypatch.setattr(hs, "target_forward", lambda t, ids, *a: seen.append(len(ids)) or real(t, ids, *a))
    m1 = hs.build_cache(tiny_target, new_ds, TAPS, out, "float32", shard_rows=8, append=True)
    assert sum(seen) == len(new_ds) - 8 * len(full)
    assert {s["file"]: (out / s["file"]).stat().st_mtime_ns for s in full} == stamps
    monkeypatch.undo()

    fresh = hs.build_cache(tiny_target, new_ds, TAPS, tmp_path / "fresh", "float32", shard_rows=8)
    assert {k: v for k, v in m1.items() if k != "target"} == {k: v for k, v in fresh.items() if k != "target"}
    cache = hs.open_cache(out, tiny_target, TAPS, new_ds)
    last_row = len(new_ds) - 1
    assert cache.batch([last_row], 128, "cpu", None)[0].shape[1] == 128

    # Data that is not a continuation of the cached rows is another dataset: --append does not apply.
    with pytest.raises(UserError, match="dataset_sha256 differ"):
        hs.build_cache(tiny_target, new_ds.select(range(1, len(new_ds))), TAPS, out, "float32", shard_rows=8,
                       append=True)


def test_cache_cli_refuses_append_with_overwrite(grown, tmp_path):
    _, _, big = grown
    code, _, err = run_main(cache_cli.main, ["--data", big / "train", "--target", TINY_TARGET, "--output",
                                             tmp_path / "c", "--append", "--overwrite"])
    assert code == 2 and "pass one" in err and not (tmp_path / "c").exists()
