"""Reading tensors inside `torch.save` archives without loading them (writing: `archive_writer`).

Reading: a `torch.save` blob is an uncompressed zip whose `data/<key>` records hold raw storage
bytes, found where torch itself finds them (`zip_reader`: an archive laid out any other way is refused).
We parse only the pickle's tensor header (never executing it) and `pread` just the bytes of the slice
asked for, into its destination.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from reshard.buffers import PerThread, copy
from reshard.direct_io import DirectFile
from reshard.dtypes import bits, itemsize, numpy_dtype
from reshard.errors import ReshardError
from reshard.sharding import Region, cut, long_axis, shift, to_slices
from reshard.torchfile import PARSE_ERRORS, zip_reader
from reshard.torchfile.archive_writer import Stored
from reshard.torchfile.pickles import LEGACY_STORAGE_TYPES, Call, Named, Unpickler, named, nonnegative_ints


@dataclass(frozen=True)
class _Layout:
    """How a pickled tensor lies in its storage."""

    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        """Row-major and dense (the stride of a size-1 dimension does not matter)."""
        step = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != step:
                return False
            step *= size
        return True


_STORAGE_DTYPES = {name: dtype for dtype, name in LEGACY_STORAGE_TYPES.items()}
WINDOW = 4096  # bytes read at each end of a record: a torch.save archive keeps its headers and pickle there


class _Windows:
    """The first and last WINDOW bytes of a record, read once (two `pread`s in place of a dozen small
    ones); a read outside them goes to the file."""

    def __init__(self, file: RecordFile, start: int, length: int):
        self.file, self.start, self.length = file, start, length
        self.head = self._pread(0, min(length, WINDOW))
        self.tail_at = max(0, length - WINDOW)
        self.tail = self.head if self.tail_at == 0 else self._pread(self.tail_at, length - self.tail_at)

    def _pread(self, offset: int, size: int) -> bytes:
        buffer = bytearray(size)
        self.file.read_exact(memoryview(buffer), self.start + offset)
        return bytes(buffer)

    def read(self, offset: int, size: int) -> bytes:
        """`size` bytes at `offset` of the record."""
        if offset < 0 or offset + size > self.length:
            raise ReshardError(f"{self.file.path}: a zip header points outside its record at {self.start}; the file is damaged")
        if offset + size <= len(self.head):
            return self.head[offset : offset + size]
        if offset >= self.tail_at:
            return self.tail[offset - self.tail_at : offset - self.tail_at + size]
        return self._pread(offset, size)


@dataclass(frozen=True)
class TensorRecord:
    """Where a saved tensor's elements lie in its file: row-major from `offset`."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    loaded: np.ndarray | None = None  # a strided record's values, laid out from its storage (offset -1)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)


_scratch = PerThread()
READ_BLOCK = 16 << 20  # bytes staged per strided read: bounds each thread's scratch buffer


class RecordFile:
    """A file of `torch.save` records (a DCP `.distcp`), read with `pread`: a record's headers are parsed
    once, and a region of its tensor is read straight into the caller's tensor when it is contiguous
    there, else through one reused buffer. Nothing is mapped, so nothing piles up in the resident set."""

    def __init__(self, path: Path):
        self.path = path
        self.file = DirectFile(path, os.O_RDONLY)  # a page-aligned record (ours) is read past the page cache
        self.fd = self.file.fd
        if hasattr(os, "posix_fadvise"):  # larger read-ahead: chunks are read front to back
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def close(self) -> None:
        self.file.close()

    def read_exact(self, buffer: memoryview, offset: int) -> None:
        """Fill `buffer` from `offset`, or refuse the file as truncated."""
        if self.file.pread(buffer, offset) < len(buffer):
            raise ReshardError(f"{self.path} is truncated: the checkpoint is damaged")

    def _records(self, start: int, length: int) -> tuple[dict[str, tuple[int, int]], _Windows]:
        """name -> (absolute data offset, size) of the zip records of the blob at [start, start+length), and
        the blob's two ends as read (its headers and pickle lie there)."""
        ends = _Windows(self, start, length)
        entries = zip_reader.records(ends.read, length, f"{self.path} (the archive at byte {start})" if start else str(self.path))
        return {name: (start + offset, size) for name, (offset, size) in entries.items()}, ends

    def record(self, start: int, length: int) -> TensorRecord:
        """The tensor that `torch.save` wrote at [start, start+length)."""
        record = archive_tensor(self.unpickle(start, length))
        if record is None:
            raise ReshardError(f"{self.path}: expected a tensor record at offset {start}")
        return record

    def unpickle(self, start: int, length: int) -> Any:
        """What `torch.save` wrote at [start, start+length), as stand-ins (`pickles`): the pickle is read
        from the blob's ends, and each storage only noted where it lies (`Stored.read` reads it)."""
        records, ends = self._records(start, length)
        pkl_offset, pkl_size = records["data.pkl"]

        def storage(key: str) -> tuple[Callable[[], bytes], int, int]:
            offset, size = records[f"data/{key}"]
            return functools.partial(_read_range, self.path, offset, size), offset, size

        return _ArchiveUnpickler(ends.read(pkl_offset - start, pkl_size), storage, str(self.path)).load()

    def read_into(self, record: TensorRecord, region: Region, dest: np.ndarray) -> None:
        """Copy `region` (in the record's own coordinates) of the record's tensor into `dest`."""
        if dest.size == 0:
            return
        if record.loaded is not None:
            copy(dest, record.loaded[tuple(slice(a, b) for a, b in region)])
            return
        if not region:
            region, dest = ((0, 1),), dest.reshape(1)
        shape = record.shape or (1,)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        first, count = _span(region, strides)
        if dest.flags.c_contiguous and count == dest.size:
            self.read_exact(memoryview(dest.reshape(-1).view(np.uint8)), record.offset + first * record.itemsize)
            return
        # strided: through the scratch buffer, a block of at most READ_BLOCK bytes at a time
        for block in _blocks(region, strides, record.itemsize):
            first, count = _span(block, strides)
            flat = _scratch.array([count], numpy_dtype(record.dtype))
            self.read_exact(memoryview(flat.view(np.uint8)), record.offset + first * record.itemsize)
            # as bits: as_strided goes through the array interface, which cannot name ml_dtypes' float8
            laid = np.lib.stride_tricks.as_strided(bits(flat), [b - a for a, b in block], [s * record.itemsize for s in strides])
            copy(bits(dest[to_slices(shift(block, region))]), laid)

    def tensor(self, start: int, length: int) -> np.ndarray:
        """The whole tensor saved at [start, start+length), read into memory."""
        record = self.record(start, length)
        out = np.empty(record.shape, dtype=numpy_dtype(record.dtype))
        self.read_into(record, tuple((0, d) for d in record.shape), out)
        return out


def _span(region: Region, strides: list[int]) -> tuple[int, int]:
    """First element and element count of the row-major range that holds `region`."""
    first = sum(a * s for (a, _), s in zip(region, strides))
    return first, sum((b - 1) * s for (_, b), s in zip(region, strides)) + 1 - first


def _blocks(region: Region, strides: list[int], itemsize: int) -> list[Region]:
    """`region` cut along its `long_axis` into blocks spanning about READ_BLOCK bytes."""
    axis = long_axis(region)
    if axis is None:
        return [region]
    step = max(1, READ_BLOCK // (strides[axis] * itemsize))
    a, b = region[axis]
    return cut(region, axis, [*range(a, b, step), b])


def tensor_in_blob(path: Path, start: int, length: int) -> np.ndarray:
    """The tensor saved by `torch.save` at [start, start+length) of `path`."""
    f = RecordFile(path)
    try:
        return f.tensor(start, length)
    finally:
        f.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _ArchiveUnpickler(Unpickler):
    """Stand-ins for every object (`pickles`); each storage a `Stored` whose bytes `storage(key)` gives."""

    def __init__(self, data: bytes, storage: Callable[[str], tuple[Callable[[], bytes], int | None, int]], what: str):
        super().__init__(io.BytesIO(data), what)
        self.storage = storage
        self.storages: dict[str, Stored] = {}  # one per key: views of one storage stay views of one storage

    def persistent_load(self, pid: Any) -> Stored:
        # torch's: ("storage", its class, its record's key, location, element count)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], Named)):
            raise pickle.UnpicklingError(f"{pid!r:.80} is not a torch storage's persistent id")
        _, storage_type, key, location, numel = pid
        if key not in self.storages:
            read, offset, nbytes = self.storage(str(key))
            # torch gives the storage numel x its element size bytes, whatever the record holds
            (numel,) = nonnegative_ints((numel,))
            if numel * _element_size(storage_type) != nbytes:
                raise ValueError(f"a storage of {numel!r:.20} {storage_type} elements in a record of {nbytes} bytes")
            self.storages[key] = Stored(storage_type, location, numel, read, offset, nbytes)
        elif (storage_type, numel) != (self.storages[key].storage_type, self.storages[key].numel):
            raise ValueError(f"storage {key!r:.20} is pickled as two different storages")  # torch would keep either
        return self.storages[key]


def _element_size(storage_type: Named) -> int:
    return 1 if storage_type is _UNTYPED else itemsize(_STORAGE_DTYPES[storage_type.qualname])


_UNTYPED = named("torch.storage", "UntypedStorage")


def load_archive(source: Path | BinaryIO, what: str) -> Any:
    """What `torch.save` wrote to `source`, as stand-ins: without torch, and without running anything in
    it. From a file object, storages are read into memory; from a path (a legacy rank file of several GB),
    only where they lie is noted, and a storage is read when it is pickled again (`Stored.read`).
    `what` names the source in the error for a damaged or foreign one. The pickles it holds inside are
    left as they are (`payloads.load_screened` reads those too)."""
    try:
        if isinstance(source, Path):
            return _load_file(source)
        data = source.read()
        spans = zip_reader.records(lambda offset, size: data[offset : offset + size], len(data), what)

        def storage(key: str) -> tuple[Callable[[], bytes], None, int]:
            offset, size = spans[f"data/{key}"]
            return (lambda: data[offset : offset + size]), None, size

        offset, size = spans["data.pkl"]
        return _ArchiveUnpickler(data[offset : offset + size], storage, what).load()
    except PARSE_ERRORS as exc:  # a truncated, foreign or damaged file
        raise ReshardError(f"{what} cannot be loaded ({exc.__class__.__name__}): the checkpoint is damaged") from None


def _load_file(path: Path) -> Any:
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # torch.save has written zip archives since torch 1.6
            raise ReshardError(
                f"{path} is not a zip-format torch.save file (saved before torch 1.6, or tampered with: torch.load would "
                "run its first pickle as a pre-1.6 file's): load and save it again with a newer torch"
            )
    file = RecordFile(path)
    try:
        return file.unpickle(0, os.fstat(file.fd).st_size)
    finally:
        file.close()


def _read_range(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), size, offset)
    if len(data) != size:
        raise ReshardError(f"{path} is truncated: the checkpoint is damaged")
    return data


_REBUILDS = {named("torch._utils", "_rebuild_tensor_v2"), named("torch._utils", "_rebuild_tensor_v3")}


def archive_tensor(value: Any) -> TensorRecord | None:
    """Where the values of a pickled tensor (as `RecordFile.unpickle` or `load_archive` give it) lie, None
    for any other value: its record when it is dense in its file, else its values, laid out from its
    storage's bytes (rare: Megatron saves dense tensors)."""
    if not (isinstance(value, Call) and value.function in _REBUILDS and value.args and isinstance(value.args[0], Stored)):
        return None
    storage, storage_offset, size, stride = value.args[:4]
    if value.function.qualname == "_rebuild_tensor_v3":
        if not isinstance(value.args[6], Named):
            raise ValueError(f"{value.args[6]!r:.80} where a torch dtype was expected")
        dtype = value.args[6].qualname
    else:
        dtype = _STORAGE_DTYPES[storage.storage_type.qualname]
    shape, strides = nonnegative_ints(size.args[0] if isinstance(size, Call) else size), nonnegative_ints(stride)
    (offset,) = nonnegative_ints((storage_offset,))
    if len(strides) != len(shape):
        raise ValueError(f"a tensor of shape {shape} with strides {strides}")
    header = _Layout(offset, shape, strides)
    dense_end = (header.storage_offset + _numel(shape)) * itemsize(dtype)
    if header.contiguous and storage.offset is not None and dense_end <= storage.nbytes:
        return TensorRecord(dtype, shape, storage.offset + header.storage_offset * itemsize(dtype))
    values = np.frombuffer(storage.read(), dtype=bits(np.empty(0, numpy_dtype(dtype))).dtype)
    if min(shape, default=1) > 0 and header.storage_offset + sum((d - 1) * s for d, s in zip(shape, header.stride)) >= values.size:
        raise ReshardError("a tensor reaches past its storage: the checkpoint is damaged")
    laid = np.lib.stride_tricks.as_strided(values[header.storage_offset :], shape, [s * values.itemsize for s in header.stride])
    return TensorRecord(dtype, shape, -1, laid.copy().view(numpy_dtype(dtype)))
