"""make real-target's command line, cli/real_target.py (tests/data/test_real_target.py runs it end to end
on wheels built there): its flags and bad input, each one `error:` line and exit 2 with nothing fetched,
and the spelling it was once run with, `python -m dflash_train.data.real_target`, which names the new one."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, error_line, run_main
from dflash_train.cli import real_target as cli
from dflash_train.data.real_target import DEFAULT_DEST


@pytest.fixture
def calls(monkeypatch):
    """setup replaced by a recorder: the CLI's handling is tested without fetching or converting."""
    seen = []
    monkeypatch.setattr(cli, "setup", lambda dest: seen.append(dest))
    return seen


def test_the_old_data_real_target_spelling_names_the_new_one(tmp_path):
    dest = tmp_path / "real"
    done = subprocess.run([sys.executable, "-m", "dflash_train.data.real_target", "--dest", str(dest)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert done.stderr == ("error: make real-target's command line is now python -m "
                           "dflash_train.cli.real_target (same flags)\n")
    assert not dest.exists()


def test_dest_reaches_setup_and_defaults_to_data_real(tmp_path, calls):
    assert run_main(cli.main, ["--dest", tmp_path / "real"])[0] == 0
    assert run_main(cli.main, [])[0] == 0
    assert calls == [tmp_path / "real", Path(DEFAULT_DEST)]
    assert not (tmp_path / "real").exists()  # the folder is setup's to make


@pytest.mark.parametrize("argv, says", [(["--dest"], "expected one argument"),
                                        (["--destination", "x"], "unrecognized arguments"),
                                        (["data/real"], "unrecognized arguments")])
def test_a_bad_command_line_is_one_line_and_exit_2(calls, argv, says):
    rc, out, err = run_main(cli.main, argv)
    assert rc == 2 and says in error_line(err) and out == ""
    assert calls == []


def test_dest_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as e:
        cli.main(["--dest", str(tmp_path / "f")])
    assert e.value.code == 2 and "is a file, not a folder" in error_line(capsys.readouterr().err)
    assert (tmp_path / "f").read_text() == "x"
