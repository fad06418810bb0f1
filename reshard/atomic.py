"""Durable updates: a file written beside its place and renamed into it, a directory swapped into place, and
fsync by path."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Make a file's bytes, or a directory's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by a file holding `text`: a crash leaves the old file or the new one, never a part. The
    temporary sibling is made afresh (a link or file left under its name is removed, never written through)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def foreign(path: Path, directory: bool = False) -> str | None:
    """Why `path`, a sibling reshard names and makes (a lock, a partial output, a directory moved aside), is not
    one it made (`unlike_ours`); None when nothing is there, or what is there could be its own leftover."""
    try:
        return unlike_ours(os.lstat(path), directory)
    except FileNotFoundError:
        return None


def unlike_ours(found: os.stat_result, directory: bool = False) -> str | None:
    """Why a file with this `lstat` (or `fstat`) is not one reshard made: a symbolic link, something else than
    a plain file (or a `directory`), a hard link, another user's; None if it could be."""
    if stat.S_ISLNK(found.st_mode):
        return "a symbolic link"
    if not (stat.S_ISDIR(found.st_mode) if directory else stat.S_ISREG(found.st_mode)):
        return "not a directory" if directory else "not a plain file"
    if not directory and found.st_nlink != 1:
        return "a hard link"
    if found.st_uid != os.geteuid():
        return "another user's"
    return None


def link_inside(directory: Path) -> Path | None:
    """The first symbolic link under `directory` (walked without following any), None if there is none."""
    for root, dirs, files in os.walk(directory):
        for name in (*dirs, *files):
            if os.path.islink(os.path.join(root, name)):
                return Path(root, name)
    return None


def aside(target: Path) -> Path:
    """Where a replaced directory waits, on filesystems without an atomic exchange, until the new one is in
    place: a fixed name, so that `put_back` finds it after a stop between the two renames."""
    return target.with_name(f".{target.name}.reshard-old")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux renameat2 RENAME_EXCHANGE); False where the system or the
    filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def replace_dir(tmp: Path, target: Path) -> None:
    """Move directory `tmp` to `target`. An old `target` is swapped out in one step and removed only after, so a
    stop at any point leaves the old directory or the new one at `target` (or, between the two renames of a
    filesystem that cannot exchange, the old one where `put_back` finds it), never neither."""
    if not target.exists():
        tmp.rename(target)
    elif _exchange(tmp, target):
        shutil.rmtree(tmp)  # the old directory, now under the new one's temporary name
    else:
        old = aside(target)
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old)


def put_back(target: Path, pending: Path) -> None:
    """Undo a `replace_dir(pending, target)` stopped between its two renames: the old directory goes back to
    `target`. Only such a stop is undone: nothing at `target`, the new directory still `pending` beside it, and
    the one moved aside a real directory of this user's; a stray one (another's, a link, one without a pending
    replacement) is not moved into `target`. Several processes may try at once (a job's ranks): one moves it,
    the others find it moved."""
    old = aside(target)
    if os.path.lexists(target) or not pending.is_dir() or not old.is_dir() or foreign(old, directory=True):
        return
    try:
        old.rename(target)
    except FileNotFoundError:  # another process put it back first
        pass
