"""dflash-cache's command line, cli/cache.py: the real entry point end to end and its bad flags, each
one line before the target loads (the cache itself: tests/data/test_hs_cache.py)."""

import json
import subprocess
import sys

import pytest

import dflash_train.cli.cache as hs_cli
from conftest import ROOT, TINY_TARGET, broken_target, error_line


def test_cli(tmp_path, small_data):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "dflash_train.cli.cache", "--data",
                        str(small_data / "val.jsonl"), "--target", str(TINY_TARGET), "--output", str(out),
                        "--dtype", "fp8"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("bytes/token "
            "(fp8)" in r.stderr and json.loads((out / "manifest.json").read_text())["dtype"] == "fp8")
    bad = subprocess.run([sys.executable, "-m", "dflash_train.cli.cache", "--data",
                          str(tmp_path / "none.jsonl"), "--target", str(TINY_TARGET), "--output",
                          str(tmp_path / "o")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: data file '{tmp_path / 'none.jsonl'}' not found"]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flags, message", [(["--shard-rows", "0"], "--shard-rows must be >= 1"),
                                            (["--batch-size", "0"], "--batch-size must be >= 1"),
                                            (["--target-layer-ids", "1,x"], "--target-layer-ids must be")])
def test_bad_flags_and_missing_data_are_found_before_the_target_is_loaded(flags, message, small_data,
                                                                          tmp_path, capsys):
    broken = broken_target(tmp_path / "broken", "garbage")  # loading it would fail: it is never loaded
    for data, expected in [(small_data / "val.jsonl", message), (tmp_path / "none.jsonl", "not found")]:
        with pytest.raises(SystemExit) as e:
            hs_cli.main(["--data", str(data), "--target", str(broken), "--output", str(tmp_path / "o"),
                     *(flags if expected == message else [])])
        assert e.value.code == 2 and expected in error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()
