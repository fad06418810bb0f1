"""Zero-copy access to tensors inside `torch.save` archives, and a writer that streams them.

Reading: a `torch.save` blob is an uncompressed zip whose `data/<key>` records hold raw storage
bytes. We parse only the pickle's tensor header (never executing it) and map the bytes with
`np.memmap`, so reading a slice of a chunk touches only that slice's pages.

Writing: `StreamingTorchSave` writes each tensor's storage as soon as it is given and the pickle
last, producing a file `torch.load` reads like any other, without holding the whole dict in memory.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reshard.errors import ReshardError
from reshard.formats.pages import release, release_tensor


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype
    key: str
    numel: int


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


def _rebuild_stub(storage: _StorageRef, offset: int, size: Any, stride: Any, *rest: Any) -> TensorHeader:
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

    def persistent_load(self, pid: Any) -> _StorageRef:
        _, dtype, key, _location, numel = pid
        return _StorageRef(dtype, str(key), int(numel))


class _Window(io.RawIOBase):
    """A seekable read-only file over a byte range of a memory map (zipfile needs one); no copies."""

    def __init__(self, data: memoryview):
        self.data, self.pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: len(self.data)}[whence]
        self.pos = max(0, min(len(self.data), base + offset))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self.data) - self.pos)
        buffer[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


class MappedFile:
    """A file of `torch.save` records (a DCP `.distcp`), mapped once; tensors are views into the map."""

    def __init__(self, path: Path):
        self.path = path
        # copy-on-write: torch wants writable buffers, and nothing we do writes through to the file
        self.map = np.memmap(path, dtype=np.uint8, mode="c") if path.stat().st_size else np.zeros(0, np.uint8)
        base = self.map.ctypes.data
        self.mappings = [(base, base + len(self.map))] if len(self.map) else []

    def release(self, tensor: torch.Tensor) -> None:
        """Drop a view's pages from the resident set once its values have been copied out."""
        release_tensor(tensor, self.mappings)

    def _records(self, start: int, length: int) -> dict[str, tuple[int, int]]:
        """name -> (absolute data offset, size) of the zip records of the blob at [start, start+length)."""
        view = memoryview(self.map)[start : start + length]
        with zipfile.ZipFile(_Window(view)) as zf:
            out = {}
            for info in zf.infolist():
                if info.compress_type != zipfile.ZIP_STORED:
                    raise ReshardError("compressed torch.save records are not supported")
                header = bytes(view[info.header_offset : info.header_offset + 30])
                name_len, extra_len = struct.unpack("<HH", header[26:30])
                out[info.filename.split("/", 1)[1]] = (start + info.header_offset + 30 + name_len + extra_len, info.file_size)
            return out

    def tensor(self, start: int, length: int) -> torch.Tensor:
        """The tensor that `torch.save` wrote at [start, start+length), as a view into the map."""
        records = self._records(start, length)
        pkl_offset, pkl_size = records["data.pkl"]
        header = _HeaderUnpickler(io.BytesIO(bytes(self.map[pkl_offset : pkl_offset + pkl_size]))).load()
        if not isinstance(header, TensorHeader):
            raise ReshardError(f"{self.path}: expected a tensor record at offset {start}")
        data_offset, data_size = records[f"data/{header.key}"]
        itemsize = torch.empty(0, dtype=header.dtype).element_size()
        count = _numel(header.shape)
        if not header.contiguous or data_size < (header.storage_offset + count) * itemsize:
            blob = bytes(self.map[start : start + length])
            release(self.map.ctypes.data + start, length, self.mappings)
            return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        if count == 0:
            return torch.empty(header.shape, dtype=header.dtype)
        first = data_offset + header.storage_offset * itemsize
        return torch.frombuffer(self.map, dtype=header.dtype, count=count, offset=first).reshape(header.shape)


def tensor_in_blob(path: Path, start: int, length: int) -> torch.Tensor:
    """The tensor saved by `torch.save` at [start, start+length) of `path`, memory-mapped."""
    return MappedFile(path).tensor(start, length)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its own bytes: `torch.save` writes a view's whole storage."""
    tensor = tensor.detach().contiguous()
    if tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


class _TensorStub:
    """Stands in for a tensor already written to the archive, when the pickle is written last."""

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]):
        self.ref = _StorageRef(dtype, key, _numel(shape))
        self.shape = shape

    def __reduce__(self) -> tuple:
        stride, step = [], 1
        for d in reversed(self.shape):
            stride.append(step)
            step *= d
        return (
            torch._utils._rebuild_tensor_v2,
            (self.ref, 0, torch.Size(self.shape), tuple(reversed(stride)), False, OrderedDict()),
        )


class _StubPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class StreamingTorchSave:
    """Builds a `torch.save` file tensor by tensor; `finish(obj)` pickles `obj` with its stubs."""

    def __init__(self, path: Path):
        self._ctx = torch.serialization._open_zipfile_writer(str(path))
        self._zip = self._ctx.__enter__()
        self._count = 0

    def add(self, tensor: torch.Tensor) -> _TensorStub:
        tensor = compact(tensor)
        key = str(self._count)
        self._count += 1
        storage = tensor.untyped_storage()
        self._zip.write_record(f"data/{key}", storage, storage.nbytes())
        return _TensorStub(key, tensor.dtype, tuple(tensor.shape))

    def finish(self, obj: Any) -> None:
        buf = io.BytesIO()
        _StubPickler(buf, protocol=2).dump(obj)
        data = buf.getvalue()
        self._zip.write_record("data.pkl", data, len(data))
        self._zip.write_record(".format_version", "1", 1)
        alignment = str(torch.serialization._get_storage_alignment())
        self._zip.write_record(".storage_alignment", alignment, len(alignment))
        self._zip.write_record("byteorder", "little", len("little"))
        self._ctx.__exit__(None, None, None)
