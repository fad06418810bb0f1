"""Reading tensors inside `torch.save` archives without loading them (writing: `torch_archive`).

Reading: a `torch.save` blob is an uncompressed zip whose `data/<key>` records hold raw storage
bytes. We parse only the pickle's tensor header (never executing it) and `pread` just the bytes of
the slice asked for, into its destination.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reshard.buffers import PerThread, copy
from reshard.direct_io import DirectFile
from reshard.errors import ReshardError
from reshard.formats.torch_archive import StorageRef
from reshard.sharding import Region, cut, long_axis, shift, to_slices


@dataclass(frozen=True)
class TensorHeader:
    dtype: torch.dtype
    key: str
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


# torch pickles a storage by the name of its legacy typed class, e.g. "BFloat16Storage".
_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


def _rebuild_stub(storage: StorageRef, offset: int, size: Any, stride: Any, *rest: Any) -> TensorHeader:
    return TensorHeader(storage.dtype, storage.key, int(offset), tuple(size), tuple(stride))


class _HeaderUnpickler(pickle.Unpickler):
    """Reads the structure of a tensor pickle without constructing anything but the header."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_stub
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch" and name == "Size":
            return tuple
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a tensor record")

    def persistent_load(self, pid: Any) -> StorageRef:
        _, dtype, key, _location, numel = pid
        return StorageRef(dtype, str(key), int(numel))


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


@dataclass(frozen=True)
class TensorRecord:
    """Where a saved tensor's elements lie in its file: row-major from `offset`."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    loaded: torch.Tensor | None = None  # a record torch.load had to decode (not a plain dense one)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


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

    def _pread(self, buffer: memoryview, offset: int) -> None:
        if self.file.pread(buffer, offset) < len(buffer):
            raise ReshardError(f"{self.path} is truncated: the checkpoint is damaged")

    def _records(self, start: int, length: int) -> dict[str, tuple[int, int]]:
        """name -> (absolute data offset, size) of the zip records of the blob at [start, start+length)."""
        with zipfile.ZipFile(_FileWindow(self.fd, start, length)) as zf:
            out = {}
            for info in zf.infolist():
                if info.compress_type != zipfile.ZIP_STORED:
                    raise ReshardError("compressed torch.save records are not supported")
                header = bytearray(4)
                self._pread(memoryview(header), start + info.header_offset + 26)
                name_len, extra_len = struct.unpack("<HH", header)
                out[info.filename.split("/", 1)[1]] = (start + info.header_offset + 30 + name_len + extra_len, info.file_size)
            return out

    def record(self, start: int, length: int) -> TensorRecord:
        """The tensor that `torch.save` wrote at [start, start+length)."""
        records = self._records(start, length)
        pkl_offset, pkl_size = records["data.pkl"]
        pickled = bytearray(pkl_size)
        self._pread(memoryview(pickled), pkl_offset)
        header = _HeaderUnpickler(io.BytesIO(pickled)).load()
        if not isinstance(header, TensorHeader):
            raise ReshardError(f"{self.path}: expected a tensor record at offset {start}")
        data_offset, data_size = records[f"data/{header.key}"]
        itemsize = header.dtype.itemsize
        if not header.contiguous or data_size < (header.storage_offset + _numel(header.shape)) * itemsize:
            blob = bytearray(length)
            self._pread(memoryview(blob), start)
            loaded = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            return TensorRecord(loaded.dtype, tuple(loaded.shape), -1, loaded)
        return TensorRecord(header.dtype, header.shape, data_offset + header.storage_offset * itemsize)

    def read_into(self, record: TensorRecord, region: Region, dest: torch.Tensor) -> None:
        """Copy `region` (in the record's own coordinates) of the record's tensor into `dest`."""
        if dest.numel() == 0:
            return
        if record.loaded is not None:
            dest.copy_(record.loaded[tuple(slice(a, b) for a, b in region)])
            return
        if not region:
            region, dest = ((0, 1),), dest.reshape(1)
        shape = record.shape or (1,)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        first, count = _span(region, strides)
        if dest.is_contiguous() and count == dest.numel():
            self._pread(memoryview(dest.view(torch.uint8).numpy()).cast("B"), record.offset + first * record.itemsize)
            return
        # strided: through the scratch buffer, a block of at most READ_BLOCK bytes at a time
        for block in _blocks(region, strides, record.itemsize):
            first, count = _span(block, strides)
            flat = _scratch.tensor([count], record.dtype)
            self._pread(memoryview(flat.view(torch.uint8).numpy()), record.offset + first * record.itemsize)
            copy(dest[to_slices(shift(block, region))], flat.as_strided([b - a for a, b in block], strides))

    def tensor(self, start: int, length: int) -> torch.Tensor:
        """The whole tensor saved at [start, start+length), read into memory."""
        record = self.record(start, length)
        out = torch.empty(record.shape, dtype=record.dtype)
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


def tensor_in_blob(path: Path, start: int, length: int) -> torch.Tensor:
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
