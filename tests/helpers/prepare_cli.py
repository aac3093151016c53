"""dflash-prepare --regenerate on a few bundled rows, and its refusals: what the tests of its command line
(tests/cli/test_prepare_cli.py) and of its work folder (tests/cli/test_bad_inputs_prepare.py) share."""

import pytest

from conftest import ROOT, TINY_TARGET, error_line
from dflash_train.cli import prepare

TINY_DATA = ROOT / "data" / "tiny" / "train.jsonl"


def rows(path, n=4):
    path.write_text("".join(TINY_DATA.read_text().splitlines(keepends=True)[:n]))
    return path


def argv(src, out, *extra):
    return ["--input", str(src), "--format", "messages", "--target", str(TINY_TARGET), "--output", str(out),
            "--regenerate", "--max-new-tokens", "8", "--batch-size", "2", "--min-supervised-tokens", "1",
            "--keep-truncated", *extra]


def refused(capsys, args) -> str:
    with pytest.raises(SystemExit) as e:
        prepare.main(args)
    assert e.value.code == 2
    return error_line(capsys.readouterr().err)
