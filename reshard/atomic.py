"""Durable updates: a file written beside its place and renamed into it, a directory swapped into place, and
fsync by path."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Make a file's bytes, or a directory's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by a file holding `text`: a crash leaves the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def _aside(target: Path) -> Path:
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
        old = _aside(target)
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old)


def put_back(target: Path) -> None:
    """Undo a `replace_dir` stopped between its two renames: the old directory goes back to `target`. Several
    processes may try at once (a job's ranks): one moves it, the others find it moved."""
    old = _aside(target)
    if old.is_dir() and not target.exists():
        try:
            old.rename(target)
        except FileNotFoundError:  # another process put it back first
            pass
