"""Keep memory-mapped reads from piling up in the resident set.

Readers map checkpoint files and copy each slab out of the map. The pages they touched would stay in
this process's resident set until the file is unmapped (for a whole conversion), so peak RSS would
grow to the size of the model. After a copy, `release` tells the kernel we no longer need those pages
(MADV_DONTNEED): they leave our resident set, stay in the page cache, and fault back in from the file
if read again. That is only safe for read-only file mappings (on anonymous memory it would zero the
data), so a range is released only when it lies inside a mapping of a file we opened read-only.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path
from typing import NamedTuple

_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE
_LIBC = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None
_LOCK = threading.Lock()


class Mapping(NamedTuple):
    start: int  # address range [start, end) of this process
    end: int
    offset: int  # the file offset mapped at `start`


def file_mappings(path: Path) -> list[Mapping]:
    """Where this process maps `path` (Linux /proc/self/maps; empty elsewhere)."""
    target = str(path.resolve())
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == target:
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    ranges.append(Mapping(start, end, int(parts[2], 16)))
    except OSError:
        return []
    return ranges


def release(address: int, length: int, mappings: list[Mapping]) -> None:
    """Drop the pages of [address, address+length) from the resident set, if wholly inside `mappings`."""
    if _LIBC is None or length <= 0:
        return
    first = address - address % _PAGE
    last = address + length
    if not any(m.start <= first and last <= m.end for m in mappings):
        return
    with _LOCK:
        _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def release_tensor(tensor, mappings: list[Mapping]) -> None:
    """Release the bytes a (memory-mapped) tensor views."""
    release(tensor.data_ptr(), tensor.numel() * tensor.element_size(), mappings)
