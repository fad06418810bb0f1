"""Reading tensors inside `torch.save` archives without loading them (writing: `archive_writer`).

Reading: a `torch.save` blob is an uncompressed zip whose `data/<key>` records hold raw storage
bytes. We parse only the pickle's tensor header (never executing it) and `pread` just the bytes of
the slice asked for, into its destination.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import struct
import zipfile
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
from reshard.torchfile import PARSE_ERRORS
from reshard.torchfile.archive_writer import Stored
from reshard.torchfile.payloads import screen_payloads
from reshard.torchfile.pickles import LEGACY_STORAGE_TYPES, Call, Named, Unpickler, named, nonnegative_ints
from reshard.torchfile.zip_structs import (
    CENTRAL_ENTRY,
    CENTRAL_ENTRY_SIGNATURE,
    COUNT_MAX,
    END,
    END_SIGNATURE,
    LOCAL_HEADER,
    LOCAL_HEADER_SIGNATURE,
    ZIP32_MAX,
    ZIP64_END,
    ZIP64_END_SIGNATURE,
    ZIP64_LOCATOR,
    ZIP64_LOCATOR_SIGNATURE,
    zip64_values,
)


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


class _FileWindow(io.RawIOBase):
    """A seekable read-only file over [start, start+length) of a descriptor (zipfile needs one)."""

    def __init__(self, fd: int, start: int, length: int):
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + offset))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.length - self.pos)
        n = os.preadv(self.fd, [memoryview(buffer)[:n]], self.start + self.pos) if n > 0 else 0
        self.pos += n
        return n


WINDOW = 4096  # bytes read at each end of a record: a torch.save archive keeps its headers and pickle there


class _Windows:
    """The first and last WINDOW bytes of a record, read once (two `pread`s in place of zipfile's dozen);
    a read outside them goes to the file."""

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


def zip_entries(read: Callable[[int, int], bytes], length: int) -> dict[str, tuple[int, int]] | None:
    """name -> (data offset, size) of the stored entries of a zip of `length` bytes, `read(offset, size)`
    giving its bytes: the central directory found at the very end (no comment, one disk), Zip64 included,
    every offset counted from the zip's start and inside it. None for anything else, which `zipfile` is
    left to read (or to refuse); compressed entries are refused."""
    try:
        return _stored_entries(read, length)
    except (struct.error, StopIteration, UnicodeDecodeError):
        return None


def _stored_entries(read: Callable[[int, int], bytes], length: int) -> dict[str, tuple[int, int]] | None:
    if length < END.size:
        return None
    sig, disk, cd_disk, _, count, cd_size, cd_offset, comment = END.unpack(read(length - END.size, END.size))
    if sig != END_SIGNATURE or comment or disk or cd_disk:
        return None
    if count == COUNT_MAX or ZIP32_MAX in (cd_size, cd_offset):
        at = length - END.size - ZIP64_LOCATOR.size
        if at < 0:
            return None
        sig, _, eocd64, _ = ZIP64_LOCATOR.unpack(read(at, ZIP64_LOCATOR.size))
        if sig != ZIP64_LOCATOR_SIGNATURE or eocd64 + ZIP64_END.size > at:
            return None
        sig, *_, count, cd_size, cd_offset = ZIP64_END.unpack(read(eocd64, ZIP64_END.size))
        if sig != ZIP64_END_SIGNATURE:
            return None
    if cd_offset + cd_size > length:  # offsets counted from elsewhere (a zip inside a larger file)
        return None
    directory = read(cd_offset, cd_size)
    entries, pos = {}, 0
    for _ in range(count):
        sig, _, _, _, method, _, _, _, compressed, size, name_len, extra_len, comment_len, _, _, _, local = CENTRAL_ENTRY.unpack_from(directory, pos)
        if sig != CENTRAL_ENTRY_SIGNATURE:
            return None
        name_at = pos + CENTRAL_ENTRY.size
        name = directory[name_at : name_at + name_len].decode("utf-8")
        size, compressed, local = _zip64_sizes(directory[name_at + name_len : name_at + name_len + extra_len], size, compressed, local)
        pos = name_at + name_len + extra_len + comment_len
        if method != 0 or compressed != size:
            raise ReshardError("compressed torch.save records are not supported")
        if local + LOCAL_HEADER.size > length:
            return None
        sig, *_, local_name, local_extra = LOCAL_HEADER.unpack(read(local, LOCAL_HEADER.size))
        data = local + LOCAL_HEADER.size + local_name + local_extra
        if sig != LOCAL_HEADER_SIGNATURE or data + size > length:
            return None
        entries[name] = (data, size)
    return entries


def _zip64_sizes(extra: bytes, size: int, compressed: int, local: int) -> tuple[int, int, int]:
    """The fields a central directory entry left at ZIP32_MAX, from its Zip64 extra field (in this order)."""
    found = zip64_values(extra)
    if found is not None:
        values = iter(found)
        size = next(values) if size == ZIP32_MAX else size
        compressed = next(values) if compressed == ZIP32_MAX else compressed
        local = next(values) if local == ZIP32_MAX else local
    return size, compressed, local


def _zipfile_entries(window: _FileWindow) -> dict[str, tuple[int, int]]:
    """`zip_entries` by `zipfile`, for a zip laid out any other way."""
    with zipfile.ZipFile(window) as zf:
        out = {}
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise ReshardError("compressed torch.save records are not supported")
            window.seek(info.header_offset)
            *_, name_len, extra_len = LOCAL_HEADER.unpack(window.read(LOCAL_HEADER.size))
            out[info.filename] = (info.header_offset + LOCAL_HEADER.size + name_len + extra_len, info.file_size)
        return out


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
        entries = zip_entries(ends.read, length)
        if entries is None:  # not laid out as torch.save writes: let zipfile make sense of it
            entries = _zipfile_entries(_FileWindow(self.fd, start, length))
        return {name.split("/", 1)[1]: (start + offset, size) for name, (offset, size) in entries.items()}, ends

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
            self.storages[key] = Stored(storage_type, location, numel, *self.storage(str(key)))
        return self.storages[key]


def load_archive(source: Path | BinaryIO, what: str) -> Any:
    """What `torch.save` wrote to `source`, as stand-ins: without torch, and without running anything in
    it. From a file object, storages are read into memory; from a path (a legacy rank file of several GB),
    only where they lie is noted, and a storage is read when it is pickled again (`Stored.read`).
    `what` names the source in the error for a damaged or foreign one. The pickles it holds inside (a
    BytesIO's, a `_extra_state` tensor's) are screened too (`payloads`)."""
    value = _load(source, what)
    screen_payloads(value, what)
    return value


def _load(source: Path | BinaryIO, what: str) -> Any:
    try:
        if isinstance(source, Path):
            return _load_file(source)
        with zipfile.ZipFile(source) as archive:
            pickled = [name for name in archive.namelist() if name.endswith("/data.pkl") and name.count("/") == 1]
            if len(pickled) != 1:
                raise ReshardError(f"{what} is not a torch.save archive: the checkpoint is damaged")
            prefix = pickled[0].split("/")[0]

            def storage(key: str) -> tuple[Callable[[], bytes], None, int]:
                data = archive.read(f"{prefix}/data/{key}")
                return (lambda: data), None, len(data)

            return _ArchiveUnpickler(archive.read(pickled[0]), storage, what).load()
    except PARSE_ERRORS as exc:  # a truncated, foreign or damaged file
        raise ReshardError(f"{what} cannot be loaded ({exc.__class__.__name__}): the checkpoint is damaged") from None


def _load_file(path: Path) -> Any:
    with open(path, "rb") as f:
        if f.read(2) != b"PK":  # torch.save has written zip archives since torch 1.6
            raise ReshardError(f"{path} is not a zip-format torch.save file (saved before torch 1.6?): load and save it again with a newer torch")
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
