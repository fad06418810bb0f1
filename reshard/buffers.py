"""Reusable buffers.

A fresh large allocation costs a page fault per 4 KiB the first time it is touched, which makes copying
into fresh memory several times slower than into reused memory (benchmarks/README.md, "Measurements behind defaults"). Hot paths therefore
reuse memory: slabs come from a `Pool` and go back once written; a chunk read, a staged piece or a
block converted for the checksum uses a `Scratch` per writer or per thread. Both start on a page, so
that what is written from them can go to the disk directly (`reshard.direct_io`).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from reshard.direct_io import ALIGN
from reshard.dtypes import bits


def copy(dest: np.ndarray, src: np.ndarray) -> None:
    """`dest[...] = src` for strided slices of the same dtype, copied as bits (numpy copies unsigned
    integers without the GIL, faster than torch's copy for bf16 column slices: benchmarks/README.md)."""
    if dest.dtype != src.dtype:
        dest[...] = src
        return
    np.copyto(bits(dest), bits(src))


def empty(nbytes: int) -> np.ndarray:
    """`nbytes` uninitialised bytes starting on a page."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes]


def _view(buffer: np.ndarray, shape: tuple[int, ...] | list[int], dtype: np.dtype) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    return buffer[:nbytes].view(dtype).reshape(tuple(shape))


class Scratch:
    """A byte buffer that grows to the largest request and is then reused."""

    def __init__(self) -> None:
        self.buffer = empty(0)

    def take(self, size: int, dtype: type = np.uint8) -> np.ndarray:
        """`size` elements of `dtype`, valid until the next `take`."""
        nbytes = size * np.dtype(dtype).itemsize
        if self.buffer.size < nbytes:
            self.buffer = empty(nbytes)
        return self.buffer[:nbytes].view(dtype)

    def array(self, shape: tuple[int, ...] | list[int], dtype: np.dtype) -> np.ndarray:
        """An array over the buffer, valid until the next `take` or `array`."""
        return _view(self.take(math.prod(shape) * dtype.itemsize), shape, dtype)

    def array_for(self, offset: int, shape: tuple[int, ...] | list[int], dtype: np.dtype) -> np.ndarray:
        """An array over the buffer whose address lies as far past a page as file offset `offset` does:
        written there, its page-aligned middle can go to the disk directly (`reshard.direct_io`)."""
        phase = offset % ALIGN
        return _view(self.take(math.prod(shape) * dtype.itemsize + ALIGN)[phase:], shape, dtype)


class PerThread(threading.local):
    """One `Scratch` per thread, for code that worker threads run concurrently."""

    def __init__(self) -> None:
        self.scratch = Scratch()

    def take(self, size: int, dtype: type = np.uint8) -> np.ndarray:
        return self.scratch.take(size, dtype)

    def array(self, shape: tuple[int, ...] | list[int], dtype: np.dtype) -> np.ndarray:
        return self.scratch.array(shape, dtype)


class Pool:
    """Slab buffers lent to reader threads and given back once written. It never holds more buffers
    than were out at once: a request no free buffer fits drops a too-small one before allocating."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lent: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def array(self, shape: tuple[int, ...] | list[int], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.size >= nbytes]
            if fits:
                buffer = self._free.pop(min(fits, key=lambda i: self._free[i].size))
            else:
                if self._free:
                    self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].size))
                buffer = empty(max(nbytes, 1))
            out = _view(buffer, shape, dtype)
            self._lent[out.ctypes.data] = buffer
        return out

    def give(self, array: np.ndarray) -> None:
        """Take back an array `array()` lent; its memory is reused from now on."""
        with self._lock:
            buffer = self._lent.pop(array.ctypes.data, None)
            if buffer is not None:
                self._free.append(buffer)

    def shrink(self, keep: int) -> None:
        """Free all but the `keep` largest idle buffers, before a phase that holds fewer slabs at once."""
        with self._lock:
            self._free.sort(key=lambda b: b.size, reverse=True)
            del self._free[keep:]
