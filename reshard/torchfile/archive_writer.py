"""Writing `torch.save` archives ourselves, so tensor bytes go to the file straight from our buffers.

`torch.save` of a slice clones it first (it writes a view's whole storage otherwise) and computes its
CRC-32 in the same thread; together that was a fifth of a conversion's time. An archive is a plain
uncompressed zip: `<archive>/data.pkl` (the pickled object, tensors as persistent storage ids), one
`<archive>/data/<key>` record per storage, aligned to 64 bytes as torch aligns them (to a page for a
large one, so that it can be written past the page cache: `reshard.direct_io`), and a few small
records `torch.load` checks, `.storage_alignment` among them. Zip64 fields are written when a record
or the archive passes 4 GiB.

`save_tensor` writes one tensor (a DCP chunk); `archive_size` gives its size from the shape alone, so
records can be placed before their values are read and written by several threads (`At`).
`StreamingTorchSave` writes a whole state dict: each storage record placed in order (`reserve`),
written by any thread (`fill`), and the pickle last.
"""

from __future__ import annotations

import functools
import io
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from isal.isal_zlib import crc32 as _crc32  # zlib's CRC-32, several times faster than zlib's (benchmarks/README.md)

from reshard import direct_io
from reshard.buffers import Scratch, copy
from reshard.dtypes import dtype_name, itemsize
from reshard.torchfile.pickles import LEGACY_STORAGE_TYPES, Call, Named, Pickler, named
from reshard.torchfile.zip_structs import (
    CENTRAL_CRC_AT,
    CENTRAL_ENTRY,
    CENTRAL_ENTRY_SIGNATURE,
    COUNT_MAX,
    END,
    END_SIGNATURE,
    EXTRA_FIELD,
    LOCAL_CRC_AT,
    LOCAL_HEADER,
    LOCAL_HEADER_SIGNATURE,
    PADDING_EXTRA,
    ZIP32_MAX,
    ZIP64_END,
    ZIP64_END_SIGNATURE,
    ZIP64_LOCATOR,
    ZIP64_LOCATOR_SIGNATURE,
    zip64_extra,
)

_ALIGNMENT = 64


def storage_alignment(nbytes: int) -> int:
    """Where a storage of `nbytes` starts in its archive: a large one on a page (its archive starting on
    one too), so its bytes can go to the disk directly."""
    return direct_io.ALIGN if nbytes >= direct_io.DIRECT_FROM else _ALIGNMENT


@dataclass(frozen=True)
class _Entry:
    name: bytes
    offset: int  # of the local header, from the archive's start
    data_offset: int  # of the record's data, from the archive's start
    size: int
    extra: bytes  # the local header's extra fields (Zip64 sizes, alignment padding)
    crc: int | None = None  # known once the data is


class ZipWriter:
    """An uncompressed zip written from the current position of `f`; offsets are relative to that start.
    A record can be placed first and its header and data written later, from any thread (`place`)."""

    def __init__(self, f: BinaryIO, zip64_from: int = ZIP32_MAX):
        self.f = f
        self.size = 0  # bytes placed so far; kept here because f.tell() is a syscall per record
        self.zip64_from = zip64_from  # lowered by tests to exercise the Zip64 path on small data
        self.entries: list[_Entry] = []

    def place(self, name: str, size: int, alignment: int = _ALIGNMENT) -> int:
        """Reserve the next record, of `size` bytes of data starting on a multiple of `alignment`, without
        writing it; returns its index (see `header`)."""
        encoded = name.encode()
        offset = self.size
        extra = zip64_extra([size, size]) if size >= self.zip64_from else b""
        # pad with an extra field so the data starts on the alignment torch uses (for mmap loading)
        pad = -(offset + LOCAL_HEADER.size + len(encoded) + len(extra) + EXTRA_FIELD.size) % alignment
        extra += EXTRA_FIELD.pack(PADDING_EXTRA, pad) + b"Z" * pad
        data_offset = offset + LOCAL_HEADER.size + len(encoded) + len(extra)
        self.entries.append(_Entry(encoded, offset, data_offset, size, extra))
        self.size = data_offset + size
        return len(self.entries) - 1

    def header(self, index: int, crc: int) -> bytes:
        """The local header of placed record `index`, whose data has CRC-32 `crc` (kept for the directory)."""
        entry = self.entries[index] = replace(self.entries[index], crc=crc)
        zip64 = entry.size >= self.zip64_from
        stored = ZIP32_MAX if zip64 else entry.size
        return LOCAL_HEADER.pack(
            LOCAL_HEADER_SIGNATURE, 45 if zip64 else 20, 0x0800, 0, 0, 0x21, crc, stored, stored, len(entry.name), len(entry.extra)
        ) + entry.name + entry.extra

    def add(self, name: str, data: Any, alignment: int = _ALIGNMENT) -> None:
        """Append a record and write it now (see `write`)."""
        self.write(self.place(name, data if isinstance(data, int) else memoryview(data).nbytes, alignment), data)

    def write(self, index: int, data: Any) -> None:
        """Write placed record `index` at the file's current position, which is where it was placed when
        records are written in the order placed. `data` is any C-contiguous buffer (bytes, a numpy array's
        memory); an int `data` only counts that many bytes (`archive_size`)."""
        view = None if isinstance(data, int) else memoryview(data).cast("B")
        size = data if view is None else len(view)
        if size != self.entries[index].size:
            raise AssertionError(f"{size} bytes for a zip record of {self.entries[index].size}")
        self.f.write(self.header(index, 0 if view is None else _crc32(view)))
        if view is not None:
            self.f.write(view)

    def close(self) -> None:
        """Write the central directory (and the Zip64 end records when they are needed)."""
        directory_offset = self.size
        directory = bytearray()
        for e in self.entries:
            if e.crc is None:
                raise AssertionError(f"zip record {e.name!r} was placed but never written")
            fields = []
            size = e.size
            if e.size >= self.zip64_from:
                fields += [e.size, e.size]
                size = ZIP32_MAX
            offset = e.offset
            if e.offset >= self.zip64_from:
                fields.append(e.offset)
                offset = ZIP32_MAX
            extra = zip64_extra(fields) if fields else b""
            version = 45 if fields else 20
            directory += CENTRAL_ENTRY.pack(
                CENTRAL_ENTRY_SIGNATURE, version, version, 0x0800, 0, 0, 0x21, e.crc, size, size,
                len(e.name), len(extra), 0, 0, 0, 0, offset,
            )
            directory += e.name + extra
        count = len(self.entries)
        end = directory_offset + len(directory)
        if directory_offset >= self.zip64_from or end >= self.zip64_from or count >= COUNT_MAX:
            rest = ZIP64_END.size - 12  # the record's size, counting neither its signature nor this field
            directory += ZIP64_END.pack(ZIP64_END_SIGNATURE, rest, 45, 45, 0, 0, count, count, end - directory_offset, directory_offset)
            directory += ZIP64_LOCATOR.pack(ZIP64_LOCATOR_SIGNATURE, 0, end, 1)
            directory += END.pack(END_SIGNATURE, 0, 0, COUNT_MAX, COUNT_MAX, ZIP32_MAX, ZIP32_MAX, 0)
        else:
            directory += END.pack(END_SIGNATURE, 0, 0, count, count, end - directory_offset, directory_offset, 0)
        self.f.write(directory)
        self.size += len(directory)


@dataclass(frozen=True)
class StorageRef:
    """A storage record of the archive, as its pickle refers to it."""

    dtype: str
    key: str
    numel: int


@dataclass(eq=False)
class Stored:
    """A storage of an archive `archive_reader.load_archive` read (a tensor in Megatron's common state, a
    per-module object or a legacy rank file): `save_archive` writes its bytes as a record of its own."""

    storage_type: Named  # torch's class for it, as the pickle names it
    location: str
    numel: int
    read: Callable[[], bytes]  # its bytes
    offset: int | None  # where they start in the archive's file (None: read from memory)
    nbytes: int


def tensor_call(key: str, dtype: str, shape: tuple[int, ...]) -> Call:
    """What `torch.save` pickles for a dense tensor over storage record `key`, built with stand-ins."""
    stride, step = [], 1
    for d in reversed(shape):
        stride.append(step)
        step *= d
    args = (StorageRef(dtype, key, math.prod(shape)), 0, named("torch", "Size")(tuple(shape)), tuple(reversed(stride)), False, OrderedDict())
    if dtype in LEGACY_STORAGE_TYPES:
        return named("torch._utils", "_rebuild_tensor_v2")(*args)
    return named("torch._utils", "_rebuild_tensor_v3")(*args, named("torch", dtype))  # torch's own pickle for these


class _ArchivePickler(Pickler):
    """Pickles storages as persistent ids: those placed in the archive, and `Stored` ones, which it
    numbers from `next_key` and collects for the archive to write after the pickle."""

    def __init__(self, f: BinaryIO, next_key: int):
        super().__init__(f, protocol=2)
        self.next_key = next_key
        self.stored: dict[int, tuple[str, Stored]] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Stored):
            if id(obj) not in self.stored:
                self.stored[id(obj)] = (str(self.next_key), obj)
                self.next_key += 1
            return ("storage", obj.storage_type, self.stored[id(obj)][0], obj.location, obj.numel)
        if not isinstance(obj, StorageRef):
            return None
        if obj.dtype in LEGACY_STORAGE_TYPES:
            return ("storage", named("torch", LEGACY_STORAGE_TYPES[obj.dtype]), obj.key, "cpu", obj.numel)
        return ("storage", named("torch.storage", "UntypedStorage"), obj.key, "cpu", obj.numel * itemsize(obj.dtype))


def tensor_bytes(array: np.ndarray, scratch: Scratch | None = None) -> np.ndarray:
    """The array's values as contiguous bytes: its own memory when it is C-contiguous, else a copy into
    `scratch` (which the caller reuses: see `reshard.buffers`)."""
    if not array.flags.c_contiguous:
        staged = (scratch or Scratch()).array(array.shape, array.dtype)
        copy(staged, array)
        array = staged
    return array.reshape(-1).view(np.uint8)


class _Archive:
    """The parts every `torch.save` archive shares: records under one prefix, small records, pickle last."""

    def __init__(self, f: BinaryIO, prefix: str, zip64_from: int, alignment: int = _ALIGNMENT):
        self.zip = ZipWriter(f, zip64_from)
        self.prefix = prefix
        self.alignment = alignment  # of the storages
        self.count = 0

    def place(self, tensor: TensorShape) -> tuple[int, Call]:
        """The next storage record, for `tensor`, placed but not written: its zip index, and what the pickle
        holds in the tensor's place. A large one starts on a page, which is also a multiple of the
        archive's alignment."""
        key = str(self.count)
        self.count += 1
        alignment = max(self.alignment, storage_alignment(tensor.nbytes))
        index = self.zip.place(f"{self.prefix}/data/{key}", tensor.nbytes, alignment)
        return index, tensor_call(key, tensor.dtype, tensor.shape)

    def storage(self, tensor: TensorShape, data: np.ndarray | int) -> Call:
        """A storage record for `tensor` written now, holding `data` (its `tensor_bytes`); for a
        `TensorShape`, `data` is its size, which is only counted."""
        index, stub = self.place(tensor)
        self.zip.write(index, data)
        return stub

    def finish(self, obj: Any) -> None:
        buf = io.BytesIO()
        pickler = _ArchivePickler(buf, self.count)
        pickler.dump(obj)
        for key, stored in pickler.stored.values():
            self.zip.add(f"{self.prefix}/data/{key}", stored.read())
        records = (  # the small records torch writes after the pickle
            (".format_version", b"1"),
            (".storage_alignment", str(self.alignment).encode()),
            ("byteorder", b"little"),
            ("version", b"3\n"),
        )
        for name, data in (("data.pkl", buf.getvalue()), *records):
            self.zip.add(f"{self.prefix}/{name}", data)
        self.zip.close()


class _Recording:
    """A file that keeps what is written to it, write by write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: Any) -> int:
        self.writes.append(bytes(data))
        return len(data)


@dataclass(frozen=True)
class TensorShape:
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class _Template:
    """A `save_tensor` archive but for its tensor's bytes and their CRC-32: all else depends on the shape
    and dtype alone, so it is built once per shape (a MoE checkpoint has thousands of records of a few)."""

    head: bytes  # everything before the tensor's bytes: the storage record's local header
    nbytes: int  # the tensor's
    tail: bytes  # everything after: the pickle, the small records, the central directory
    tail_crc_at: int  # where `tail` holds the storage record's CRC-32 (its central directory entry)

    @property
    def size(self) -> int:
        return len(self.head) + self.nbytes + len(self.tail)

    def filled(self, crc: int) -> tuple[bytes, bytes]:
        """`head` and `tail` with `crc` in their CRC fields."""
        value = struct.pack("<I", crc)
        head = self.head[:LOCAL_CRC_AT] + value + self.head[LOCAL_CRC_AT + 4 :]
        return head, self.tail[: self.tail_crc_at] + value + self.tail[self.tail_crc_at + 4 :]


def _template(shape: tuple[int, ...], dtype: str, zip64_from: int) -> _Template:
    return _built_template(shape, dtype, zip64_from, storage_alignment(math.prod(shape) * itemsize(dtype)))


@functools.lru_cache(maxsize=1024)
def _built_template(shape: tuple[int, ...], dtype: str, zip64_from: int, alignment: int) -> _Template:
    """The template, cached with the alignment it was built for (`direct_io.DIRECT_FROM` decides it)."""
    tensor = TensorShape(shape, dtype)
    recording = _Recording()
    archive = _Archive(recording, "archive", zip64_from, alignment)
    archive.finish(archive.storage(tensor, tensor.nbytes))  # sizes only: the storage's header is the first write
    storage, last = archive.zip.entries[0], archive.zip.entries[-1]
    head, tail = recording.writes[0], b"".join(recording.writes[1:])
    assert len(head) == storage.data_offset
    # the central directory follows the last record, and its first entry is the storage's
    directory = last.data_offset + last.size - (storage.data_offset + storage.size)
    return _Template(head, storage.size, tail, directory + CENTRAL_CRC_AT)


@dataclass(frozen=True)
class SavedTensor:
    """What `save_tensor` wrote: `size` bytes of archive, the tensor's own bytes among them at
    `data_offset` from its start. `data` is those bytes as they were handed to the file (staged in the
    caller's scratch when the tensor was strided: valid until that scratch is used again)."""

    size: int
    data_offset: int
    data: np.ndarray


def save_tensor(tensor: np.ndarray, f: BinaryIO, scratch: Scratch | None = None, zip64_from: int = ZIP32_MAX) -> SavedTensor:
    """`torch.save(tensor, f)` without the clone: the tensor's bytes are written from where they are (a
    strided one staged in `scratch`), at its `storage_alignment` from the archive's start, between the
    parts of the archive that its shape alone decides (`_Template`)."""
    data = tensor_bytes(tensor, scratch)
    template = _template(tuple(tensor.shape), dtype_name(tensor.dtype), zip64_from)
    if data.nbytes != template.nbytes:
        raise AssertionError(f"{data.nbytes} bytes for a tensor of {template.nbytes}")
    head, tail = template.filled(_crc32(memoryview(data)))
    for part in (head, data, tail):
        f.write(part)
    return SavedTensor(template.size, len(head), data)


def archive_size(shape: tuple[int, ...], dtype: str, zip64_from: int = ZIP32_MAX) -> int:
    """The bytes `save_tensor` writes for a tensor of this shape and dtype, known before its values: a
    file's records can be placed at planned offsets and written in any order."""
    return _template(tuple(shape), dtype, zip64_from).size


class At:
    """A write-only file at a fixed offset of `file` (positional writes), so threads can write disjoint
    ranges of one file at once."""

    def __init__(self, file: direct_io.DirectFile, offset: int):
        self.file, self.offset = file, offset

    def write(self, data: Any) -> int:
        done = self.file.pwrite(data, self.offset)
        self.offset += done
        return done


@dataclass(frozen=True)
class Slot:
    """A storage record placed in a `StreamingTorchSave` file, written later by `fill`."""

    index: int  # in the zip
    stub: Call  # what the pickle holds in the tensor's place
    data_offset: int  # of its values in the file


class StreamingTorchSave:
    """Builds a `torch.save` file tensor by tensor. `reserve` places each storage record in order (a large
    one on a page), `fill` writes one from any thread (`pwrite`, its page-aligned middle past the page
    cache), `finish(obj)` pickles `obj` with its stubs after the last record.

    Records are placed before any is written, so several processes that reserve alike can fill one file
    (none truncates it on opening) and one of them finish it, given the CRC-32s of the others' records."""

    def __init__(self, path: Path, zip64_from: int = ZIP32_MAX):
        self._file = direct_io.DirectFile(path, os.O_RDWR | os.O_CREAT)
        self._end = At(self._file, 0)  # where `finish` appends
        self._archive = _Archive(self._end, path.stem, zip64_from)

    def reserve(self, shape: tuple[int, ...], dtype: str) -> Slot:
        index, stub = self._archive.place(TensorShape(tuple(shape), dtype))
        return Slot(index, stub, self._archive.zip.entries[index].data_offset)

    def fill(self, slot: Slot, tensor: np.ndarray, scratch: Scratch | None = None) -> np.ndarray:
        """Write a reserved record: its header and `tensor`'s bytes. Returns those bytes as they were handed
        to the file (staged in `scratch` when the tensor is strided)."""
        data = tensor_bytes(tensor, scratch)
        zip_writer = self._archive.zip
        entry = zip_writer.entries[slot.index]
        if data.nbytes != entry.size:
            raise AssertionError(f"{data.nbytes} bytes for a record of {entry.size}")
        self._file.pwrite(zip_writer.header(slot.index, _crc32(memoryview(data))), entry.offset)
        self._file.pwrite(data, entry.data_offset)
        return data

    def write_part(self, slot: Slot, start: int, data: np.ndarray) -> None:
        """Write `data`'s bytes `start` bytes into a reserved record whose values come in parts (from any thread);
        its header is written by `seal`, once the CRC-32 of all of them is known."""
        self._file.pwrite(memoryview(data).cast("B"), slot.data_offset + start)

    def seal(self, slot: Slot, crc: int) -> None:
        """Write the header of a record written in parts (`write_part`), whose values have CRC-32 `crc`."""
        self._file.pwrite(self._archive.zip.header(slot.index, crc), self._archive.zip.entries[slot.index].offset)

    def crc(self, slot: Slot) -> int | None:
        """The CRC-32 of a filled record (what the zip's directory needs); None before `fill`."""
        return self._archive.zip.entries[slot.index].crc

    def restore(self, slot: Slot, crc: int) -> None:
        """Take a record written by another process, or an earlier run, as written."""
        entries = self._archive.zip.entries
        entries[slot.index] = replace(entries[slot.index], crc=crc)

    def sync(self) -> None:
        os.fsync(self._file.fd)

    def close(self) -> None:
        """Stop writing without finishing (another process finishes the file)."""
        os.fsync(self._file.fd)
        self._file.close()

    def finish(self, obj: Any) -> None:
        self._end.offset = self._archive.zip.size  # after every reserved record
        self._archive.finish(obj)
        os.ftruncate(self._file.fd, self._end.offset)  # nothing of an earlier, longer file after the end
        os.fsync(self._file.fd)
        self._file.close()


def save_archive(obj: Any, f: BinaryIO) -> None:
    """`torch.save(obj, f)` for plain values and what `archive_reader.load_archive` read (stand-ins, `Stored`
    storages), without torch."""
    _Archive(f, "archive", ZIP32_MAX).finish(obj)
