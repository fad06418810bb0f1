"""Layout-invariant checksums, computed piece by piece without gathering a tensor.

A tensor's bytes are read as 16-bit words along its last axis (a float32 element is two words),
giving a matrix W[row, col] indexed by *global* position. The checksum is the pair of sums

    sum_{row, col} W[row, col] * a(row) * b(col)   mod p      for two primes p

with pseudo-random weights a, b derived from the global indices. It is a sum over elements, so any
partition of the tensor into pieces (any TP/PP/EP layout) gives the same value; a flipped bit changes
one W by 2^k, which changes the sum (p is prime and the weights are non-zero mod p); moved or
swapped values change it with probability ~1 - 2^-62. The inner sums over columns are exact
float64 matrix-vector products (words < 2^16, b < 2^20, at most 2^16 columns per block). Blocks are
converted into a reused per-thread float64 buffer of 1 MiB, which stays in the core's cache; one
matrix-vector product per prime (BLAS dgemv) hashes faster than larger blocks or one matrix-matrix
product with both weight columns (dgemm packs the block first). The product is `np.dot`, which lets go
of the GIL (with `@` two threads hashed no faster than one). Figures: benchmarks/README.md, "Measurements behind defaults".

Vocabulary tensors are summed over the true vocabulary rows only, so padding that differs between
layouts does not change their checksum.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reshard.buffers import PerThread
from reshard.dtypes import bits, dtype_name
from reshard.sharding import Region, intersect, region_size, shift, to_slices

PRIMES = (2_147_483_647, 2_147_483_629)
_SEEDS = ((0x9E3779B97F4A7C15, 0xD1B54A32D192ED03), (0x8CB92BA72F3D8DD7, 0xABC98388FB8FAC03))
_COLUMN_BLOCK = 1 << 16
_BLOCK_WORDS = 1 << 17  # words per converted block: its float64 copy (1 MiB) stays in a core's cache
CHECKSUM_BLOCK_BYTES = 8 * _BLOCK_WORDS  # a worker's float64 buffer
_scratch = PerThread()


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 (wraps by design)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _row_weights(rows: np.ndarray, k: int) -> np.ndarray:
    p = np.uint64(PRIMES[k])
    return (_mix(rows.astype(np.uint64) ^ np.uint64(_SEEDS[k][0])) % (p - np.uint64(1)) + np.uint64(1)).astype(np.int64)


def _col_weights(cols: np.ndarray, k: int) -> np.ndarray:
    return ((_mix(cols.astype(np.uint64) ^ np.uint64(_SEEDS[k][1])) & np.uint64(0xFFFFF)) + np.uint64(1)).astype(np.float64)


def words(a: np.ndarray) -> np.ndarray:
    """The array's bits as uint16 words: shape (*a.shape[:-1], last * itemsize/2)."""
    if a.ndim == 0:
        a = a.reshape(1)
    if a.itemsize == 1:
        return bits(a).astype(np.uint16)
    if a.strides[-1] != a.itemsize:  # a strided view is hashed where it lies, unless its last axis is strided too
        a = np.ascontiguousarray(a)
    return a.view(np.uint16)


@dataclass(frozen=True)
class Checksum:
    digest: str
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict:
        return {"digest": self.digest, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: dict) -> Checksum:
        return cls(data["digest"], data["dtype"], tuple(data["shape"]))


class TensorChecksum:
    """Accumulates the checksum of one logical tensor from pieces given in any order."""

    def __init__(self, shape: tuple[int, ...], dtype: str, content_rows: int | None = None):
        self.shape = tuple(shape) if shape else (1,)
        self.dtype = dtype
        # Vocabulary tensors count only real rows; `content` is the region that is summed.
        content = [(0, d) for d in self.shape]
        if content_rows is not None:
            content[0] = (0, min(content_rows, self.shape[0]))
        self.content: Region = tuple(content)
        self.expected = region_size(self.content)
        self.covered = 0
        self.sums = [0, 0]

    def add(self, region: Region, data: np.ndarray) -> None:
        """Add a piece: `data` holds the values of `region` of the global tensor."""
        if not region:
            region = ((0, 1),)
            data = data.reshape(1)
        inside = intersect(region, self.content)
        if inside is None:
            return
        if inside != region:
            data = data[to_slices(shift(inside, region))]
        self.covered += region_size(inside)
        w = words(data)
        per_elem = w.shape[-1] // max(1, inside[-1][1] - inside[-1][0])
        col0 = inside[-1][0] * per_elem
        lead_shape = self.shape[:-1]
        lead_region = inside[:-1]
        if lead_shape:
            grids = np.meshgrid(*[np.arange(a, b, dtype=np.int64) for a, b in lead_region], indexing="ij")
            rows = np.ravel_multi_index(tuple(g.ravel() for g in grids), lead_shape)
        else:
            rows = np.zeros(1, dtype=np.int64)
        w2 = w.reshape(len(rows), -1)
        ncols = w2.shape[1]
        a = np.stack([_row_weights(rows, k) for k in range(2)], axis=1)
        # Inner sums y[row, k] = sum_col W * b_k(col): exact in float64 within one column block; added
        # up across column blocks in int64, reduced mod p once at the end. Column weights are made per
        # block, so a long row (a large 1-D tensor) needs no weight array of its own length.
        y = np.zeros((2, len(rows)), dtype=np.int64)
        block_sums = np.empty((2, len(rows)), dtype=np.float64)  # one column block's, written in place
        width = min(ncols, _COLUMN_BLOCK)
        rows_per_block = max(1, _BLOCK_WORDS // width)
        for c0 in range(0, ncols, width):
            cols = np.arange(col0 + c0, col0 + min(ncols, c0 + width), dtype=np.int64)
            weights = [_col_weights(cols, k) for k in range(2)]
            for r0 in range(0, len(rows), rows_per_block):
                part = w2[r0 : r0 + rows_per_block, c0 : c0 + width]
                converted = _scratch.take(part.size, np.float64).reshape(part.shape)
                np.copyto(converted, part, casting="unsafe")
                for k in range(2):  # np.dot, not `@`: numpy's matmul holds the GIL through the BLAS call
                    np.dot(converted, weights[k], out=block_sums[k, r0 : r0 + len(part)])
            y += block_sums.astype(np.int64)  # exact: each sum < 2^52
        y = y.T
        primes = np.array(PRIMES, dtype=np.int64)
        y %= primes
        partial = ((y * a) % primes).sum(axis=0) % primes
        self.sums = [(s + int(v)) % p for s, v, p in zip(self.sums, partial, PRIMES)]

    def merge(self, other: TensorChecksum) -> None:
        """Combine partial sums computed elsewhere (another worker or rank) over disjoint pieces."""
        self.covered += other.covered
        self.sums = [(a + b) % p for a, b, p in zip(self.sums, other.sums, PRIMES)]

    @property
    def complete(self) -> bool:
        return self.covered == self.expected

    def result(self) -> Checksum:
        return Checksum(f"{self.sums[0]:08x}{self.sums[1]:08x}", self.dtype, self.shape)


@dataclass(frozen=True)
class HashedParts:
    """A unit of work's values in memory, hashed by the regions its writer records whole. A record written
    from exactly one part's memory counts with that part's checksum instead of being hashed a second time:
    its bytes are the ones hashed as read, and nothing was cut between the two."""

    parts: dict[Region, tuple[np.ndarray, TensorChecksum]]

    def checksum_of(self, region: Region, values: np.ndarray) -> TensorChecksum | None:
        """The checksum of `values` (given as the values of `region`) if they are the memory of that part:
        the same elements at the same addresses, strided or not."""
        data, checksum = self.parts.get(region, (None, None))
        return copy.copy(checksum) if data is not None and _placement(values) == _placement(data) else None


def _placement(a: np.ndarray) -> tuple:
    """Where an array's elements lie: its dtype, shape, address and strides (but for size-1 axes, where a
    stride means nothing)."""
    return a.dtype, a.shape, a.ctypes.data, tuple(st for size, st in zip(a.shape, a.strides) if size != 1)


def checksum_tensor(t: np.ndarray, content_rows: int | None = None) -> Checksum:
    """Checksum of a whole in-memory tensor (tests and small tensors)."""
    acc = TensorChecksum(tuple(t.shape), dtype_name(t.dtype), content_rows)
    acc.add(tuple((0, d) for d in t.shape), t)
    return acc.result()


_FILE_BLOCK = 8 << 20


def file_sha256(path: Path) -> str:
    """A file's sha256 in hex, read in blocks (what Megatron-LM's integrity.json and the Hub's LFS record)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_FILE_BLOCK):
            h.update(block)
    return h.hexdigest()
