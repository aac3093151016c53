"""Unwritable outputs (issue 30): `--output /proc/x` (and a path under it) for dflash-prepare,
dflash-cache, dflash-export and dflash-eval is one `error:` line and exit 2, before any input is
loaded (the inputs named here do not exist: reaching them would say so), not a FileNotFoundError /
PermissionError traceback after the work."""

import pytest

from conftest import ROOT, TINY_TARGET, error_line, run_main
from dflash_train.cli import cache, eval as dflash_eval, export, locked_main, prepare

TINY_DATA = ROOT / "data" / "tiny" / "train.jsonl"
COMMANDS = {
    "prepare": (prepare.main, ["--input", TINY_DATA, "--format", "messages", "--target", TINY_TARGET]),
    "cache": (cache.main, ["--data", TINY_DATA, "--target", TINY_TARGET]),
    "export": (export.main, ["--format", "speculators", "--checkpoint", "no-checkpoint", "--verifier",
                             "no-verifier"]),
    "eval": (dflash_eval.main, ["--drafter", "no-drafter", "--target", "no-target"]),
}


@pytest.mark.parametrize("where", ["/proc/x", "/proc/x/y"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_unwritable_output_is_one_line(command, where):
    main, argv = COMMANDS[command]
    code, _, stderr = run_main(main, [*argv, "--output", where])
    line = error_line(stderr)
    assert (code == 2 and f"--output '{where}' cannot be written: no folder can be made in "
                          f"'/proc'" in line), line


def test_an_unwritable_output_dir_is_one_line_for_training():
    from dflash_train.cli.train import main as train_main

    code, _, stderr = run_main(train_main, ["output_dir=/proc/x", f"data.train={TINY_DATA}", "max_steps=1"])
    line = error_line(stderr)
    assert (code == 2 and "output_dir '/proc/x' cannot be written: no folder can be made in "
                          "'/proc'" in line), line


# --- a lock file in the way (issue 42) ---------------------------------------------------------------

def in_the_way(tmp_path, what: str):
    """A `.out.lock` beside tmp_path/out that is not a lock of ours: a folder, or a link to a user's file."""
    lock = tmp_path / ".out.lock"
    if what == "folder":
        lock.mkdir()
        (lock / "inside.txt").write_text("kept")
    else:
        (tmp_path / "precious.txt").write_text("the user's work\n")
        lock.symlink_to(tmp_path / "precious.txt")
    return lock, {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}


@pytest.mark.parametrize("what, message", [("folder", "is a folder"),
                                           ("link", "is a symbolic link, which "
                                                    "dflash-train does not follow")])
@pytest.mark.parametrize("command", ["eval", "cache", "train"])
def test_a_lock_file_in_the_way_is_one_line_and_touched_not(command, what, message, tmp_path):
    """A folder was a traceback; a link to a user's file was truncated and given our pid."""
    lock, before = in_the_way(tmp_path, what)
    out = tmp_path / "out"
    if command == "train":
        from dflash_train.cli.train import main as train_main

        code, _, stderr = run_main(train_main,
                                   [f"output_dir={out}", f"data.train={TINY_DATA}", "max_steps=1"])
        flag = "output_dir"
    else:
        main, argv = COMMANDS[command]
        code, _, stderr = run_main(main, [*argv, "--output", out])
        flag = "--output"
    line = error_line(stderr)
    assert code == 2 and line.startswith(f"error: {flag} '{out}': its lock file '{lock}' {message}"), line
    assert {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")} == before


def test_a_lock_file_that_cannot_be_removed_after_the_work_is_a_warning_and_exit_0(tmp_path, monkeypatch):
    """The eval finished, then its lock file could not be removed (its folder made read-only during the
    run): that was a PermissionError traceback and exit 1 after the whole eval. The work is done and the
    lock harmless (flock ends with the process): one warning line, exit 0."""
    import os

    out, lock = tmp_path / "out", tmp_path / ".out.lock"
    real_unlink = os.unlink

    def work(settings):  # the eval's work, done; then the folder turns read-only (as root chmod would not
        def read_only(path, *a, **k):  # stop an unlink: refuse it here instead)
            if str(path) == str(lock):
                raise PermissionError(13, "Permission denied", str(path))
            return real_unlink(path, *a, **k)

        monkeypatch.setattr(os, "unlink", read_only)

    # dflash-eval's main as cli/eval.py builds it, with the work replaced (main binds run when built)
    main = locked_main(dflash_eval.parse_args, work)
    code, _, stderr = run_main(main, ["--drafter", "d", "--output", out])
    assert code == 0 and stderr.splitlines() == [
        f"warning: --output '{out}': the lock file '{lock}' could not be removed (Permission denied); it is "
        "harmless (the lock ends with this process) and the next run reuses it"], stderr
