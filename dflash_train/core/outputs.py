"""Paths out: what an output may replace, and how it is written.

Every folder this toolkit writes (a training run, an eval report, an export, a prepared dataset,
a hidden-state cache, a drafter) carries a marker file, `.dflash-train.json`, naming the tool and
the kind of folder. `--overwrite` / `overwrite=true` only ever replaces a folder with that marker
and of the same kind; any other non-empty folder is refused. An output is written beside the old
one (a temporary sibling) and swapped in at the very end, so a failure leaves the old output as it
was. An output may not be, hold or lie inside one of the command's inputs (core/paths.py finds them).
One process at a time writes an output (output_lock): a second one is refused on one line. Its lock
file is never followed through a link nor written over a file that is not a lock of ours.
"""

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash_train import __version__
from dflash_train.core.errors import UserError, say
# (the layers above import them from here too)
from dflash_train.core.markers import KINDS, MARKER, marker_kind
from dflash_train.core.paths import resolve_input


def _read_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; done once, at import
    os.umask(mask)
    return mask


UMASK = _read_umask()


def _local(value) -> Path | None:
    if value is None:
        return None
    path = Path(resolve_input(str(value)))
    return path if path.exists() else None


Inputs = list[tuple[str, str | None]]  # (flag or key, value as given) of a command's inputs


def refuse_overlap(out: Path, inputs: Inputs, flag: str) -> None:
    """An output must not be an input, hold one, or lie inside one (replacing it would delete it)."""
    target = Path(out).expanduser().resolve()
    for name, value in inputs:
        path = _local(value)
        if path is None:
            continue
        if target == path:
            relation = "is"
        elif path.is_relative_to(target):
            relation = "holds"
        elif target.is_relative_to(path):
            relation = "is inside"
        else:
            continue
        raise UserError(f"{flag} '{out}' {relation} the {name} '{value}': write the output somewhere else")


# --- outputs ---------------------------------------------------------------------------------------

def write_marker(folder: Path, kind: str) -> None:
    (Path(folder) / MARKER).write_text(json.dumps({"tool": "dflash-train", "kind": kind,
                                                   "version": __version__}) + "\n")


def check_folder_path(out: Path, flag: str) -> None:
    """`out` can be a folder: it is not a file, and no file stands where one of its parents should be."""
    out = Path(out)
    for p in [out.absolute(), *out.absolute().parents]:  # exists() is False through a loop or a dangling link
        if os.path.islink(p) and not os.path.exists(p):
            raise UserError(f"{flag} '{out}' cannot be created: '{p}' is a symbolic link that leads nowhere "
                            "(to a missing path, or in a loop)")
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} '{out}' is a file, not a folder")
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{flag} '{out}' cannot be created: '{parent}' is a file")
            return


def check_writable(out: Path, flag: str) -> None:
    """A folder can be made where `out` goes (its temporary sibling, then the swap, are made in its
    parent, or the nearest existing folder above), tried with an empty folder made and removed at
    once: /proc/x, a read-only file system or a folder without write permission give one line
    before the work, not a traceback after it."""
    parent = Path(os.path.abspath(out)).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dflash-probe-", dir=parent))
    except OSError as e:
        raise UserError(f"{flag} '{out}' cannot be written: no folder can be made in '{parent}' "
                        f"({e.strerror or type(e).__name__})") from None


LOCK_TRIES = 5  # a lock file removed by its holder as we opened it is opened again, this many times
LOCK_MAX = 32  # bytes: our lock files hold a pid and a newline


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p `folder`, -> the folders made, outermost first (removed again if left empty)."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for f in reversed(missing):
        f.mkdir(exist_ok=True)
    return missing[::-1]


def _remove_empty(made: list[Path]) -> None:
    for f in reversed(made):
        try:
            f.rmdir()
        except OSError:  # not empty: the output, or someone else's, is in it
            return


def _lock_error(path: Path, out: Path, flag: str, what: str) -> UserError:
    return UserError(f"{flag} '{out}': its lock file '{path}' {what}: move it away or write somewhere else")


def _open_lock(path: Path, out: Path, flag: str) -> int:
    """Open `path` (made if missing) -> its fd. Never through a symbolic link (O_NOFOLLOW: a link
    planted there, or left by a user, would have us truncate the file it points to), and only a
    regular file (a folder or a FIFO in the way is refused, O_NONBLOCK so a FIFO does not hang us)."""
    nofollow = os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | nofollow, 0o666)
        except PermissionError:  # another user's file: flock needs no write access
            fd = os.open(path, os.O_RDONLY | nofollow)
    except OSError as e:
        what = {errno.ELOOP: "is a symbolic link, which dflash-train does not follow (it would write over "
                             "the file it points to)",
                errno.EISDIR: "is a folder"}.get(e.errno, f"cannot be opened ({e.strerror})")
        raise _lock_error(path, out, flag, what) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder opened read-only, a FIFO, a device
        os.close(fd)
        raise _lock_error(path, out, flag, "is not a regular file")
    return fd


def _not_our_lock(fd: int) -> str | None:
    """Why the file is not a lock file of ours to write over, or None: ours hold nothing or a pid line and
    have no other name (a hard link to a user's file would be truncated through it)."""
    if re.fullmatch(rb"(\d+\n)?", os.pread(fd, LOCK_MAX + 1, 0)) is None:
        return "is not a lock file of dflash-train (it holds something else)"
    if os.fstat(fd).st_nlink != 1:  # ours in content, but a copy made with `cp -al` links it too
        return ("has another name too (a hard link, as `cp -al` of a run folder makes), so dflash-train does "
                "not write it")
    return None


def _take_lock(path: Path, out: Path, flag: str) -> int:
    """flock `path` (made if missing) without waiting -> its fd, with our pid written in it. Held
    by another process: a UserError naming that process's pid (which it wrote there). A file there
    that is not a lock file of ours (a link, a folder, a file with other contents) is refused, untouched."""
    for _ in range(LOCK_TRIES):
        fd = _open_lock(path, out, flag)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UserError(f"{flag} '{out}' is in use by another dflash-train process (pid {pid}): wait for "
                            "it to finish, or write somewhere else") from None
        try:
            ours = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            ours = False
        if ours:
            why = _not_our_lock(fd)
            if why:
                os.close(fd)
                raise _lock_error(path, out, flag, why)
            try:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
            except OSError:  # a read-only fd: the lock holds all the same, without a pid to name
                pass
            return fd
        os.close(fd)  # its holder released and removed it while we opened it: lock the new one
    raise UserError(f"{flag} '{out}': its lock file '{path}' was replaced {LOCK_TRIES} times as it was "
                    "opened: another process keeps taking and releasing it")


def _release_lock(path: Path, fd: int, out: Path, flag: str) -> None:
    """Remove the lock file while still holding it (a process that opened it meanwhile is refused),
    then release it. A file that cannot be removed (its folder made read-only during the run) is
    harmless, and the work is done: a warning, not a failure (flock ends with the process; the next
    run reuses the file). Only our own file is removed, should another have taken its name."""
    try:
        if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        say(f"warning: {flag} '{out}': the lock file '{path}' could not be removed ({e.strerror}); it is "
            "harmless (the lock ends with this process) and the next run reuses it")
    finally:
        os.close(fd)


@contextmanager
def output_lock(out: Path, flag: str) -> Iterator[None]:
    """Hold `out` for this process while the block runs: another dflash-train process on the same
    output (two runs started together, or one started while this one works) is refused on one line,
    and this one goes on unharmed. An flock on `.NAME.lock` beside `out` (parents made for it, removed
    again if left empty): the kernel drops it when a process dies, so a killed run blocks nothing;
    the file is removed when the lock is released. Beside, not inside: `out` itself is swapped."""
    given, out = out, Path(os.path.abspath(out))
    check_folder_path(given, flag)
    check_writable(given, flag)
    if not out.name:
        raise UserError(f"{flag} '{given}' is the root folder: choose a folder to write")
    made = _make_parents(out.parent)
    path = out.parent.resolve() / f".{out.name}.lock"  # one file whichever symlinked path names it
    try:
        fd = _take_lock(path, given, flag)
    except BaseException:
        _remove_empty(made)
        raise
    try:
        yield
    finally:
        _release_lock(path, fd, given, flag)
        _remove_empty(made)


def is_empty(out: Path) -> bool:
    return not out.exists() or not any(out.iterdir())


def check_cwd_outside(out: Path, flag: str) -> None:
    """Replacing `out` moves it aside and deletes it: refused when it holds the current folder (the
    user's shell would be left in a deleted folder). `out` being the current folder itself is fine:
    it keeps its place and its entries are moved (move_aside)."""
    cwd, target = Path.cwd().resolve(), Path(out).resolve()
    if cwd != target and cwd.is_relative_to(target):
        raise UserError(f"{flag} '{out}' holds the current folder '{cwd}': replacing it would delete the "
                        "folder you are in; run the command from outside it")


def require_free_output(out: Path, overwrite: bool, kind: str, inputs: Inputs,
                        flag: str = "--output", resumable: bool = False) -> None:
    """Before any work: `out` is absent or empty, or (with --overwrite) an output of this kind that
    this toolkit wrote, not holding the current folder; it is not one of the inputs, nor inside one,
    nor around one. `resumable`: an output of this kind is also taken without --overwrite (the
    command resumes or keeps it: dflash-cache)."""
    out = Path(out)
    check_folder_path(out, flag)
    refuse_overlap(out, inputs, flag)
    check_writable(out, flag)
    if is_empty(out):
        return
    found = marker_kind(out)
    if found is None:
        raise UserError(f"{flag} '{out}' is not empty and was not written by dflash-train (no {MARKER}): "
                        "choose another folder, or empty it yourself")
    if found != kind:
        raise UserError(f"{flag} '{out}' holds {KINDS.get(found, found)}, not {KINDS[kind]}: choose another "
                        "folder")
    if not overwrite and not resumable:
        raise UserError(f"{flag} '{out}' is not empty: it holds {KINDS[kind]} (pass --overwrite to replace "
                        "it)")
    if overwrite:
        check_cwd_outside(out, flag)


def sibling(out: Path, tag: str) -> Path:
    """A hidden folder next to `out` (same file system, so a rename is atomic). `out` may be `.`."""
    out = Path(os.path.abspath(out))
    return out.with_name(f".{out.name}.{tag}-{os.getpid()}")


def match_umask(path: Path) -> None:
    """safetensors writes its files with mode 0600; give every file the mode the user's umask gives
    (0644 usually), so a server running as another user can read the weights."""
    path = Path(path)
    for f in [path] if path.is_file() else path.rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~UMASK)


def move_aside(out: Path) -> Path:
    """Move the folder at `out` out of the way of a new output -> where it went (a hidden sibling, for
    the caller to delete once the new output is in). The current folder (`--output .`) keeps its
    place, since the user's shell is in it: its entries move instead."""
    old = sibling(out, "old")
    if os.path.samefile(out, os.getcwd()):
        old.mkdir()
        for entry in list(Path(out).iterdir()):
            os.replace(entry, old / entry.name)
    else:
        os.replace(out, old)
    return old


def replace_folder(new: Path, out: Path) -> None:
    """Swap `new` in at `out`. An old `out` is moved aside first and deleted after the swap. An empty
    `out`, or the current folder (`--output .`, which must not be renamed: the user's shell is in it),
    is kept: its old entries are moved aside, then `new`'s moved in, marker first (a failure half-way
    leaves an output of ours, which --overwrite replaces)."""
    out, new = Path(out), Path(new)
    if not out.exists():
        os.replace(new, out)
        return
    if out.is_dir() and (not any(out.iterdir()) or os.path.samefile(out, os.getcwd())):
        old = move_aside(out) if any(out.iterdir()) else None
        for entry in sorted(new.iterdir(), key=lambda p: p.name != MARKER):
            os.replace(entry, out / entry.name)
        new.rmdir()
        if old is not None:
            shutil.rmtree(old)
        return
    old = move_aside(out)
    os.replace(new, out)
    shutil.rmtree(old)


def write_atomically(out: Path, write: Callable[[Path], None], kind: str) -> None:
    """Run write(tmp) on a temporary sibling folder, mark it as `kind`, then swap it in at `out`.
    The caller has checked that `out` may be replaced (require_free_output)."""
    out = Path(out)
    tmp = sibling(out, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        write_marker(tmp, kind)
        match_umask(tmp)
        replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def file_sha256(path: Path) -> str:
    """SHA-256 of one file, read in 1 MiB pieces (wheels, cache shards)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
