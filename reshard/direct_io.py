"""Large writes and reads straight between the disk and our buffers, past the page cache (`O_DIRECT`).

Through the page cache the kernel spends CPU copying into freshly faulted cache pages and the disk is
no faster; with `O_DIRECT` the CPU does nothing, so the cores stay free for reading and hashing.

Reading back what was just written then finds nothing in the page cache, so verification reads
directly into our buffers too, faster than through the cache. Figures: benchmarks/README.md, "Measurements behind defaults".

`O_DIRECT` wants the file offset, the length and the memory address aligned. A `DirectFile` moves the
aligned middle of a large transfer directly and its ragged ends through the page cache; the two never
share a page, so the cache stays coherent. Where the filesystem refuses `O_DIRECT` (tmpfs, at open or
at the first transfer), or the memory is not aligned, everything goes through the page cache as before.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np

ALIGN = 4096  # a page: the unit `O_DIRECT` and the page cache must not share
DIRECT_FROM = 1 << 20  # smaller writes are not worth the padding that aligns them


def round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


class DirectFile:
    """A file opened for reading and writing twice: once through the page cache, once direct."""

    def __init__(self, path: Path, flags: int = os.O_RDWR | os.O_CREAT):
        self.fd = os.open(path, flags, 0o644)
        self.direct: int | None = None
        if hasattr(os, "O_DIRECT"):  # Linux
            try:
                self.direct = os.open(path, (flags & ~os.O_CREAT) | os.O_DIRECT)
            except OSError:  # EINVAL: this filesystem has no direct I/O
                pass

    def _split(self, view: memoryview, offset: int) -> tuple[int, int] | None:
        """(start, length) of the part of a transfer of `view` at `offset` to do directly, if any."""
        start = (-offset) % ALIGN
        body = (len(view) - start) // ALIGN * ALIGN
        if self.direct is None or len(view) < DIRECT_FROM or body <= 0 or address(view[start:]) % ALIGN:
            return None
        return start, body

    def _refused(self, error: OSError) -> bool:
        """Whether `error` is a filesystem turning direct I/O down; if so, this file stops using it."""
        if error.errno != errno.EINVAL or self.direct is None:
            return False
        os.close(self.direct)
        self.direct = None
        return True

    def pwrite(self, data: Any, offset: int) -> int:
        """Write all of `data` at `offset`; its page-aligned middle directly when it is large."""
        view = memoryview(data).cast("B")
        split = self._split(view, offset)
        if split is not None:
            start, body = split
            try:
                _pwrite_all(self.direct, view[start : start + body], offset + start)
            except OSError as error:
                if not self._refused(error):
                    raise
                split = None
        if split is None:
            _pwrite_all(self.fd, view, offset)
        else:
            _pwrite_all(self.fd, view[:start], offset)
            _pwrite_all(self.fd, view[start + body :], offset + start + body)
        return len(view)

    def pread(self, view: memoryview, offset: int) -> int:
        """Fill `view` from `offset`; the bytes read, fewer only at the end of the file."""
        split = self._split(view, offset)
        if split is None:
            return _pread_all(self.fd, view, offset)
        start, body = split
        done = _pread_all(self.fd, view[:start], offset)
        if done == start:
            try:
                done += _pread_all(self.direct, view[start : start + body], offset + start)
            except OSError as error:
                if not self._refused(error):
                    raise
                return _pread_all(self.fd, view, offset)
        if done == start + body:
            done += _pread_all(self.fd, view[start + body :], offset + start + body)
        return done

    def close(self) -> None:
        for fd in (self.fd, self.direct):
            if fd is not None:
                os.close(fd)
        self.direct = None


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done
