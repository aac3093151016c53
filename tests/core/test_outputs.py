"""core/outputs.py: what an --output may replace, how it is replaced (where inputs are found:
test_paths.py)."""

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import TINY_TARGET, error_line
from dflash_train.core.errors import UserError
from dflash_train.core.outputs import MARKER, marker_kind, output_lock, require_free_output, write_atomically
from dflash_train.core.paths import ROOT


def made(tmp_path, kind) -> Path:
    out = tmp_path / "out"
    write_atomically(out, lambda d: (d / "old.txt").write_text("old"), kind)
    return out


def test_only_a_marked_folder_of_the_same_kind_is_replaced(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(UserError, match="was not written by dflash-train"):
            require_free_output(foreign, overwrite, "eval", [])
    run = made(tmp_path, "train")
    with pytest.raises(UserError, match="holds a training run, not an eval report"):
        require_free_output(run, True, "eval", [])
    with pytest.raises(UserError, match=r"pass --overwrite"):
        require_free_output(run, False, "train", [])
    require_free_output(run, True, "train", [])  # ours, same kind, asked for
    require_free_output(tmp_path / "new", False, "eval", [])
    (tmp_path / "empty").mkdir()
    require_free_output(tmp_path / "empty", False, "eval", [])
    assert (foreign / "precious").read_text() == "mine"


def test_an_output_that_is_a_file_or_under_one_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        require_free_output(f, True, "eval", [])
    with pytest.raises(UserError, match="cannot be created: .* is a file"):
        require_free_output(f / "sub" / "out", False, "eval", [])


@pytest.mark.parametrize("link", ["loop", "dangling"])
def test_an_output_under_a_link_to_nowhere_is_refused(tmp_path, link):
    """Path.exists() is False through a symlink loop or a dangling link, so the folder making walked past
    it and mkdir raised FileExistsError (a traceback, from the lock)."""
    a = tmp_path / "a"
    a.symlink_to(tmp_path / ("a" if link == "loop" else "missing"))
    for out in (a, a / "out", a / "sub" / "out"):
        with pytest.raises(UserError, match=f"'{a}' is a symbolic link that leads nowhere"):
            require_free_output(out, True, "eval", [])
        with pytest.raises(UserError, match=f"'{a}' is a symbolic link that leads nowhere"):
            with output_lock(out, "--output"):
                pytest.fail("the lock was taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"] and not (tmp_path / "missing").exists()


@pytest.mark.parametrize("out, relation", [("d", "is"), ("d/inner", "is inside"), (".", "holds")])
def test_an_output_that_overlaps_an_input_is_refused(tmp_path, out, relation, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model.safetensors").write_text("x")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=f"'{out}' {relation} the --drafter 'd'"):
        require_free_output(Path(out), True, "eval", [("--drafter", "d"), ("--target", "some/hub-id")])


def test_a_failed_write_leaves_the_old_output_intact(tmp_path):
    out = made(tmp_path, "export")

    def fails(d):
        (d / "half.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomically(out, fails, "export")
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "old.txt"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left
    write_atomically(out, lambda d: (d / "new.txt").write_text("new"), "export")
    assert (sorted(p.name for p in out.iterdir()) == sorted([MARKER, "new.txt"])
            and marker_kind(out) == "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_written_files_follow_the_umask_not_safetensors_0600(tmp_path):
    """vLLM in a container often runs as another user: the weights must be as readable as any file
    the user creates (umask), where safetensors alone writes 0600."""
    bare = tmp_path / "bare.safetensors"
    save_file({"w": torch.zeros(2)}, bare)
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    umask_mode = plain.stat().st_mode & 0o777
    assert bare.stat().st_mode & 0o777 == 0o600 != umask_mode  # what we correct (umask 022 here: 0644)
    out = tmp_path / "out"
    write_atomically(out, lambda d: save_file({"w": torch.zeros(2)}, d / "model.safetensors"), "drafter")
    assert (out / "model.safetensors").stat().st_mode & 0o777 == umask_mode


# --- every CLI with an --output: checked before any work, replaced only when ours ------------------

def cli(name):
    from dflash_train.cli import cache as hs_cache, eval, export, prepare

    return {"eval": eval.main, "export": export.main, "prepare": prepare.main, "cache": hs_cache.main}[name]


def argv(name, out, drafter, data) -> list[str]:
    """A good command for each CLI, writing to `out`."""
    return {"eval": ["--drafter", str(drafter), "--output", str(out)],
            "export": ["--format", "dflash", "--checkpoint", str(drafter), "--output", str(out)],
            "prepare": ["--input", str(data), "--format", "messages", "--target", str(TINY_TARGET),
                        "--output", str(out)],
            "cache": ["--data", str(data), "--target", str(TINY_TARGET), "--output", str(out)]}[name]


CLIS = ["eval", "export", "prepare", "cache"]  # also the kinds of output they write


def exits_2(command, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        command()
    assert e.value.code == 2
    return error_line(capsys.readouterr().err)


@pytest.mark.parametrize("name", CLIS)
def test_an_output_on_an_input_is_refused(name, fresh_drafter_dir, small_data, capsys):
    """`dflash-eval --drafter X --output X --overwrite` would delete the drafter."""
    inp = fresh_drafter_dir if name in ("eval", "export") else small_data / "val.jsonl"
    out = inp if name in ("eval", "export") else small_data
    before = snapshot(out)
    line = exits_2(lambda: cli(name)(argv(name, out, fresh_drafter_dir, small_data / "val.jsonl")
                                     + ["--overwrite"]),
                   capsys)
    assert f"--output '{out}' {'is' if out == inp else 'holds'} the --" in line
    assert snapshot(out) == before


@pytest.mark.parametrize("name", CLIS)
def test_a_bad_output_is_refused_before_any_work(name, fresh_drafter_dir, small_data, tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious").write_text("mine")
    run = made(tmp_path, "train")
    data = small_data / "val.jsonl"
    for out, message in [(file, "is a file, not a folder"), (foreign, "was not written by dflash-train"),
                         (run, "holds a training run, not")]:
        line = exits_2(lambda: cli(name)(argv(name, out, fresh_drafter_dir, data) + ["--overwrite"]), capsys)
        assert message in line
    assert (file.read_text() == "x" and (foreign / "precious").read_text() == "mine"
            and marker_kind(run) == "train")


@pytest.mark.parametrize("name", CLIS)
def test_overwrite_with_a_bad_input_leaves_the_old_output(name, fresh_drafter_dir, small_data, tmp_path,
                                                          capsys):
    out = made(tmp_path, name)
    before = snapshot(out)
    missing = tmp_path / "missing"
    exits_2(lambda: cli(name)(argv(name, out, missing, missing) + ["--overwrite"]), capsys)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["/proc/x", "/proc/x/y/z", "/sys/x"])
def test_an_unwritable_output_is_one_line_before_any_work(where, tmp_path):
    """Every command's --output goes through require_free_output: /proc and /sys take no new
    folder (for root too), so the line comes before the work, not as a traceback after it."""
    with pytest.raises(UserError, match=rf"--output '{where}' cannot be written: no folder "
                                        rf"can be made in '/"):
        require_free_output(Path(where), False, "eval", [])
    require_free_output(tmp_path / "x" / "y", False, "eval", [])  # writable: the probe leaves nothing behind
    assert list(tmp_path.iterdir()) == []


def test_output_dot_is_written_into_the_current_folder_and_replaced_in_place(tmp_path, monkeypatch):
    """`--output .` (issue 30): Path('.').with_name raised after the work; and the current folder must
    not be renamed away (the shell is in it). An empty one is filled, one of ours replaced in place."""
    here = tmp_path / "here"
    here.mkdir()
    inode = here.stat().st_ino
    monkeypatch.chdir(here)
    require_free_output(Path("."), False, "eval", [])
    write_atomically(Path("."), lambda d: (d / "a.txt").write_text("first"), "eval")
    assert sorted(p.name for p in here.iterdir()) == [MARKER, "a.txt"] and marker_kind(here) == "eval"
    with pytest.raises(UserError, match="pass --overwrite"):
        require_free_output(Path("."), False, "eval", [])
    require_free_output(Path("."), True, "eval", [])
    write_atomically(Path("."), lambda d: (d / "b.txt").write_text("second"), "eval")
    assert (sorted(p.name for p in here.iterdir()) == [MARKER, "b.txt"]
            and (here / "b.txt").read_text() == "second")
    assert (here.stat().st_ino == inode and Path.cwd() == here
            and sorted(p.name for p in tmp_path.iterdir()) == ["here"])


def test_an_output_holding_the_current_folder_is_not_replaced(tmp_path, monkeypatch):
    """Issue 30: replacing `..` from inside it (eval, export, prepare, cache) would delete the folder
    the shell is in; resuming a cache there replaces nothing and goes on."""
    out = made(tmp_path, "cache")
    (out / "sub").mkdir()
    monkeypatch.chdir(out / "sub")
    with pytest.raises(UserError, match=rf"^--output '\.\.' holds the current folder '{out / 'sub'}'"):
        require_free_output(Path(".."), True, "cache", [])
    require_free_output(Path(".."), False, "cache", [], resumable=True)
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "old.txt", "sub"])


# --- one process per output (output_lock) ---------------------------------------------------------

HOLDER = """
import sys
from pathlib import Path
from dflash_train.core.outputs import output_lock
with output_lock(Path(sys.argv[1]), sys.argv[2]):
    print("held", flush=True)
    sys.stdin.readline()  # works until the test lets it finish
    Path(sys.argv[1]).mkdir(parents=True)
    (Path(sys.argv[1]) / "result.txt").write_text("finished")
"""


@contextmanager
def first_process(out: Path, flag: str = "--output"):
    """A real process holding `out`'s lock (a training or dflash-cache run at work), killed at the end."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), flag], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline() == "held\n"
        yield p
    finally:
        p.kill()
        p.wait()


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def second_run(name, out, fresh_drafter_dir, small_data):
    if name == "train":
        from dflash_train.cli.train import main as train_main

        return lambda: train_main([f"output_dir={out}", f"data.train={small_data / 'train.jsonl'}",
                                   f"data.val={small_data / 'val.jsonl'}", "max_steps=2"])
    return lambda: cli(name)(argv(name, out, fresh_drafter_dir, small_data / "val.jsonl") + ["--overwrite"])


@pytest.mark.parametrize("name", ["train", *CLIS])
def test_a_second_process_on_an_output_in_use_is_refused_and_the_first_goes_on(name, fresh_drafter_dir,
                                                                              small_data, tmp_path, capsys):
    """Issue 30: two trainings, or two dflash-cache / dflash-prepare runs, on one output wrote into
    each other's files. The second is one line naming the first's pid, touches nothing, and the
    first finishes as if alone."""
    out, flag = tmp_path / "sub" / "out", "output_dir" if name == "train" else "--output"
    with first_process(out, flag) as first:
        before = tree(tmp_path)
        assert (tmp_path / "sub" / ".out.lock").read_text() == f"{first.pid}\n"
        line = exits_2(second_run(name, out, fresh_drafter_dir, small_data), capsys)
        assert line == (f"error: {flag} '{out}' is in use by another dflash-train process (pid {first.pid}): "
                        "wait for it to finish, or write somewhere else")
        assert tree(tmp_path) == before
        first.stdin.write("go\n")
        first.stdin.flush()
        assert first.wait(timeout=60) == 0
    assert (out / "result.txt").read_text() == "finished" and sorted(tree(tmp_path)) == ["sub", "sub/out",
                                                                                        "sub/out/result.txt"]


def test_two_real_processes_the_second_exits_2_with_one_line(small_data, tmp_path):
    out = tmp_path / "cache"
    with first_process(out) as first:
        command = ["-m", "dflash_train.cli.cache", "--data", small_data / "val.jsonl",
                   "--target", TINY_TARGET, "--output", out]
        r = subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            f"error: --output '{out}' is in use by another dflash-train process (pid {first.pid}): wait for "
            "it to finish, or write somewhere else"]
        assert not out.exists() and first.poll() is None


def test_a_killed_holder_blocks_nothing_and_made_folders_are_removed(tmp_path):
    """A process killed with the lock held leaves its file; the kernel dropped the lock, so the next
    run takes it (and removes the file at its end). Parent folders made for the lock and left empty
    go again, after a refusal too."""
    out = tmp_path / "a" / "b" / "out"
    with first_process(out) as first:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert (tmp_path / "a" / "b" / ".out.lock").is_file()  # stale
    with output_lock(out, "--output"):
        assert (tmp_path / "a" / "b" / ".out.lock").read_text() == f"{os.getpid()}\n"
    assert not (tmp_path / "a" / "b" / ".out.lock").exists()
    (tmp_path / "a" / "b").rmdir()
    (tmp_path / "a").rmdir()
    with pytest.raises(RuntimeError):
        with output_lock(out, "--output"):
            raise RuntimeError("the work failed")
    assert list(tmp_path.iterdir()) == []  # a/ and a/b/ were made for the lock: gone with it
    with output_lock(tmp_path / "x", "--output"):
        with pytest.raises(UserError, match="is in use by another dflash-train"):  # this process, again
            with output_lock(tmp_path / "x", "--output"):
                pass
    assert list(tmp_path.iterdir()) == []


# --- the lock file is never a user's file (issue 42) ------------------------------------------------

def planted(tmp_path: Path, what: str) -> Path:
    """A `.out.lock` beside tmp_path/out that dflash-train did not make; the user's file is precious.txt."""
    precious, lock = tmp_path / "precious.txt", tmp_path / ".out.lock"
    precious.write_text("the user's work\n")
    if what == "link":
        lock.symlink_to(precious)
    elif what == "dangling link":  # O_CREAT through it would make the file it names
        lock.symlink_to(tmp_path / "made.txt")
    elif what == "hard link":
        os.link(precious, lock)
    elif what == "linked copy of ours":  # `cp -al` of a run folder while it ran, or after a kill
        (tmp_path / "copy").mkdir()
        (tmp_path / "copy" / ".out.lock").write_text("12345\n")
        os.link(tmp_path / "copy" / ".out.lock", lock)
    elif what == "folder":
        lock.mkdir()
        (lock / "inside.txt").write_text("kept")
    else:  # a regular file of the user's under that name
        lock.write_text("notes\n")
    return lock


@pytest.mark.parametrize("what, message", [
    ("link", "is a symbolic link, which dflash-train does not follow"),
    ("dangling link", "is a symbolic link, which dflash-train does not follow"),
    ("hard link", "is not a lock file of dflash-train"), ("folder", "is a folder"),
    ("file", "is not a lock file of dflash-train"),
    ("linked copy of ours", "has another name too (a hard link, as `cp -al` of a run folder makes)")])
def test_a_lock_file_that_is_not_ours_is_refused_untouched(tmp_path, what, message):
    """A `.out.lock` that was a symlink to a user's file was opened through the link, truncated and
    given our pid; a folder there was a traceback. Now one line, and everything stays as it was."""
    lock = planted(tmp_path, what)
    before = tree(tmp_path)
    with pytest.raises(UserError) as e:
        with output_lock(tmp_path / "out", "--output"):
            pytest.fail("the lock was taken")
    line = str(e.value)
    assert line.startswith(f"--output '{tmp_path / 'out'}': its lock file '{lock}' {message}")
    assert line.endswith(": move it away or write somewhere else") and "\n" not in line
    assert tree(tmp_path) == before and (tmp_path / "precious.txt").read_text() == "the user's work\n"
    assert os.path.lexists(lock) and not (tmp_path / "made.txt").exists()


def test_a_lock_file_left_by_a_dead_run_is_reused(tmp_path):
    """Ours, stale: a pid line (a run killed), or empty (killed between open and write)."""
    for content in ("12345\n", ""):
        (tmp_path / ".out.lock").write_text(content)
        with output_lock(tmp_path / "out", "--output"):
            assert (tmp_path / ".out.lock").read_text() == f"{os.getpid()}\n"
        assert list(tmp_path.iterdir()) == []


def test_a_lock_file_that_cannot_be_removed_is_a_warning(tmp_path, monkeypatch, capsys):
    """The work is done when the lock is released: a lock file that cannot be removed then (its folder
    made read-only during the run) is harmless, not a traceback and exit 1 after the work."""
    real_unlink, lock = os.unlink, tmp_path / ".out.lock"

    def read_only_folder(path, *args, **kwargs):  # as root, chmod 555 would not stop an unlink
        if Path(path) == lock:
            raise PermissionError(13, "Permission denied", str(path))
        return real_unlink(path, *args, **kwargs)

    with output_lock(tmp_path / "out", "--output"):
        monkeypatch.setattr(os, "unlink", read_only_folder)
    assert capsys.readouterr().err == (
        f"warning: --output '{tmp_path / 'out'}': the lock file '{lock}' could not be removed (Permission "
        "denied); it is harmless (the lock ends with this process) and the next run reuses it\n")
    monkeypatch.undo()
    with output_lock(tmp_path / "out", "--output"):  # released: the next run takes the file left
        assert lock.read_text() == f"{os.getpid()}\n"
    assert list(tmp_path.iterdir()) == []
