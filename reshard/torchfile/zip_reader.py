"""The records of a `torch.save` archive, read the one way that torch's own reader reads them too.

A checkpoint's archives are read twice: by reshard (to convert, verify or screen them) and later by torch
(`torch.load`; DCP's objects with `weights_only=False`). If the two readings of one file can differ, what
reshard screened is not what torch loads. So an archive is accepted only in the canonical form that
`torch.save` writes, where every reader finds the same records at the same bytes, and refused otherwise.
Each rule names the behaviour of torch's reader (`torch.load`, then caffe2's `PyTorchStreamReader` over
miniz 3.0.2) that it closes:

- The archive starts with a local header (`PK\\x03\\x04`): `torch.load` takes anything else for a pre-1.6
  stream of pickles, whose first pickle it runs before looking further (`_is_zipfile`, `_legacy_load`),
  while miniz would still find a zip at the end of the bytes.
- The end record is the last 22 bytes, without a comment: miniz takes the last end signature it finds in
  the final 64 KiB, which a comment or trailing bytes could hold.
- A Zip64 locator right before the end record makes miniz take every count, size and offset from the
  Zip64 end record instead: it must lie just before the locator, say the same as the end record (or hold
  what the end record leaves at its maximum), for one disk. Without a locator the end record is read as it is.
- The central directory starts at its recorded offset, counted from the archive's first byte, and ends
  where the (Zip64) end record begins: miniz counts offsets from the first byte, Python's `zipfile`
  from wherever the directory turns out to lie; with no bytes before or after, both agree.
- The local headers lie back to back from the first byte, in the directory's order, each entry's data and
  data descriptor ending where the next header starts and the last where the directory starts: no bytes
  between entries or before the first, so no second archive hides in them.
- Each local header repeats its directory entry's name, flags and method, and its CRC-32 and sizes (or,
  with a data descriptor, the descriptor does): miniz reads the name's length and extra fields from the
  local header but sizes and method from the directory, streaming unzippers the other way round.
- Stored only (method 0, both sizes equal), not encrypted, no flag but a data descriptor (bit 3, which
  torch's miniz writes after every non-empty record) and UTF-8 names (bit 11); extra fields tile their
  space and are only Zip64's and torch's alignment padding (`FB`); no entry comments.
- Every name is `<folder>/<record>` for the folder of the directory's first entry (`archive_name_`, which
  torch prefixes to every lookup), and each record is one `torch.save` writes: `data.pkl`, `data/<key>`,
  `byteorder`, `version` or `.data/version`, `.data/serialization_id`, `.format_version`,
  `.storage_alignment`. So no name appears twice (miniz's binary search over sorted names finds either
  of two, zipfile the last), none differs from another only by case (miniz looks names up without
  case), none holds a NUL (torch lists records as C strings), and there is no `constants.pkl` (which sends
  `torch.load` to `torch.jit.load`, running TorchScript) nor `.debug_pkl` (which torch hides).
- `data.pkl` and a version record are present, `byteorder` (if any) is `little` (`big` has torch swap the
  bytes of every storage) and `.storage_alignment` (if any) a number: what torch reads of them is what
  reshard reads.

torch does not check CRC-32s (its miniz is built without), so neither does this reader; that the
directory, the local headers and the descriptors agree on them is checked all the same.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import NamedTuple

from reshard.errors import ReshardError
from reshard.torchfile.zip_structs import (
    CENTRAL_ENTRY,
    CENTRAL_ENTRY_SIGNATURE,
    COUNT_MAX,
    DESCRIPTOR32,
    DESCRIPTOR64,
    DESCRIPTOR_SIGNATURE,
    END,
    END_SIGNATURE,
    EXTRA_FIELD,
    LOCAL_HEADER,
    LOCAL_HEADER_SIGNATURE,
    PADDING_EXTRA,
    ZIP32_MAX,
    ZIP64_END,
    ZIP64_END_SIGNATURE,
    ZIP64_EXTRA,
    ZIP64_LOCATOR,
    ZIP64_LOCATOR_SIGNATURE,
)

_DESCRIPTOR_FLAG, _UTF8_FLAG = 0x0008, 0x0800
_RECORDS = re.compile(rb"data\.pkl|data/[0-9]+|byteorder|version|\.data/version|\.data/serialization_id|\.format_version|\.storage_alignment")
_NUMBER = re.compile(rb"\s*[0-9]+\s*")
_SMALL = 64  # bytes of a record read to check its value: more is not a value torch.save writes
_LOCAL_EXTRAS, _CENTRAL_EXTRAS = frozenset({ZIP64_EXTRA, PADDING_EXTRA}), frozenset({ZIP64_EXTRA})


class NotCanonical(ReshardError):
    """An archive that is not laid out as `torch.save` lays one out: torch could read it otherwise."""

    def __init__(self, what: str, rule: str):
        super().__init__(
            f"{what} is not a torch.save archive as torch writes one ({rule}), so torch could read it otherwise than "
            "reshard checked it: the checkpoint is damaged or was tampered with; refusing it"
        )


class _Directory(NamedTuple):
    """An entry of the central directory, its Zip64 values applied."""

    name: bytes
    flags: int
    method: int
    crc: int
    compressed: int
    size: int
    local: int


def records(read: Callable[[int, int], bytes], length: int, what: str) -> dict[str, tuple[int, int]]:
    """record -> (data offset, size) of the `torch.save` archive of `length` bytes that `read(offset, size)`
    gives, its folder left out of the names; a `NotCanonical` refusal, naming `what` and the rule it breaks,
    for any other layout (see the module's docstring)."""
    refuse = lambda rule: NotCanonical(what, rule)  # noqa: E731
    if length < LOCAL_HEADER.size + END.size or read(0, 4) != LOCAL_HEADER_SIGNATURE.to_bytes(4, "little"):
        raise refuse("it does not start with a zip local header; torch.load would take it for a pre-1.6 pickle stream")
    count, cd_size, cd_offset, cd_end = _end_records(read, length, refuse)
    if cd_offset + cd_size != cd_end:
        raise refuse("its central directory does not end where its end record starts")
    entries = _directory(read(cd_offset, cd_size), count, refuse)
    spans, position = {}, 0
    folder = entries[0].name.split(b"/", 1)[0] if entries else b""
    for entry in entries:
        record = _record_name(entry.name, folder)
        if record is None:
            raise refuse(f"{entry.name!r} is not a record torch.save writes in the folder of its first record, {folder!r}")
        if record in spans:
            raise refuse(f"{entry.name!r} appears twice")
        if entry.local != position:
            raise refuse(f"the local header of {entry.name!r} is not where the previous record ends")
        data, position = _local(read, entry, length, refuse)
        spans[record] = (data, entry.size)
    if position != cd_offset:
        raise refuse("bytes lie between its last record and its central directory")
    _check_values(spans, read, refuse)
    return {name.decode(): span for name, span in spans.items()}


def _end_records(read: Callable[[int, int], bytes], length: int, refuse: Callable[[str], NotCanonical]) -> tuple[int, int, int, int]:
    """Entry count, directory size and offset, and where the directory must end, from the end record (and
    the Zip64 end record that a locator before it points at)."""
    end_at = length - END.size
    sig, disk, cd_disk, on_disk, count, cd_size, cd_offset, comment = END.unpack(read(end_at, END.size))
    if sig != END_SIGNATURE or comment:
        raise refuse("its last 22 bytes are not an end record without a comment")
    if disk or cd_disk or on_disk != count:
        raise refuse("its end record speaks of more than one disk")
    locator_at = end_at - ZIP64_LOCATOR.size
    if locator_at < 0 or read(locator_at, 4) != ZIP64_LOCATOR_SIGNATURE.to_bytes(4, "little"):
        return count, cd_size, cd_offset, end_at
    _, locator_disk, zip64_at, disks = ZIP64_LOCATOR.unpack(read(locator_at, ZIP64_LOCATOR.size))
    if zip64_at != locator_at - ZIP64_END.size or locator_disk or disks != 1:
        raise refuse("its Zip64 end record does not lie just before its locator, on one disk")
    sig, rest, _, _, disk, cd_disk, on_disk64, count64, cd_size64, cd_offset64 = ZIP64_END.unpack(read(zip64_at, ZIP64_END.size))
    if sig != ZIP64_END_SIGNATURE or rest != ZIP64_END.size - 12 or disk or cd_disk or on_disk64 != count64:
        raise refuse("its Zip64 end record is not one record of one disk")
    if (count, cd_size, cd_offset) != (count64, cd_size64, cd_offset64) and (
        count not in (count64, COUNT_MAX) or cd_size not in (cd_size64, ZIP32_MAX) or cd_offset not in (cd_offset64, ZIP32_MAX)
    ):
        raise refuse("its end record and its Zip64 end record disagree")
    return count64, cd_size64, cd_offset64, zip64_at


def _directory(directory: bytes, count: int, refuse: Callable[[str], NotCanonical]) -> list[_Directory]:
    """The `count` entries that fill `directory` exactly."""
    entries, pos = [], 0
    for _ in range(count):
        if pos + CENTRAL_ENTRY.size > len(directory):
            raise refuse("its central directory holds fewer entries than its end record counts")
        (sig, _, _, flags, method, _, _, crc, compressed, size,
         name_len, extra_len, comment_len, disk, _, _, local) = CENTRAL_ENTRY.unpack_from(directory, pos)
        name_at = pos + CENTRAL_ENTRY.size
        pos = name_at + name_len + extra_len + comment_len
        if sig != CENTRAL_ENTRY_SIGNATURE or pos > len(directory):
            raise refuse("an entry of its central directory is damaged")
        if comment_len or disk:
            raise refuse("an entry of its central directory has a comment or another disk")
        if extra_len or ZIP32_MAX in (size, compressed, local):
            found = _extra_fields(directory[name_at + name_len : name_at + name_len + extra_len], refuse, _CENTRAL_EXTRAS)
            values = list(_zip64_values(found.get(ZIP64_EXTRA, b""), (size, compressed, local).count(ZIP32_MAX), refuse))
            size, compressed, local = (values.pop(0) if v == ZIP32_MAX else v for v in (size, compressed, local))
        entries.append(_Directory(directory[name_at : name_at + name_len], flags, method, crc, compressed, size, local))
    if pos != len(directory):
        raise refuse("its central directory holds bytes past its last entry")
    return entries


@functools.lru_cache(maxsize=4096)  # every chunk of a checkpoint holds the same few names
def _record_name(name: bytes, folder: bytes) -> bytes | None:
    """The record `name` is under the archive's one `folder`; None for a name torch.save does not write there."""
    if not folder or b"\\" in folder or b"\0" in name or not name.startswith(folder + b"/"):
        return None
    record = name[len(folder) + 1 :]
    return record if _RECORDS.fullmatch(record) else None


def _local(read: Callable[[int, int], bytes], entry: _Directory, length: int, refuse: Callable[[str], NotCanonical]) -> tuple[int, int]:
    """Where the entry's data starts, and where its record (data descriptor included) ends, once its local
    header agrees with its directory entry."""
    if entry.local + LOCAL_HEADER.size > length:
        raise refuse(f"the local header of {entry.name!r} lies past the archive's end")
    sig, _, flags, method, _, _, crc, compressed, size, name_len, extra_len = LOCAL_HEADER.unpack(read(entry.local, LOCAL_HEADER.size))
    data = entry.local + LOCAL_HEADER.size + name_len + extra_len
    named = read(entry.local + LOCAL_HEADER.size, name_len + extra_len) if data <= length else b""
    if sig != LOCAL_HEADER_SIGNATURE or data > length or named[:name_len] != entry.name:
        raise refuse(f"the local header of {entry.name!r} does not carry its name")
    if (flags, method) != (entry.flags, entry.method) or flags & ~(_DESCRIPTOR_FLAG | _UTF8_FLAG):
        raise refuse(f"the flags or method of {entry.name!r} differ between its headers or are not torch.save's")
    if method != 0 or entry.compressed != entry.size:
        raise refuse(f"{entry.name!r} is compressed")
    extra = _extra_fields(named[name_len:], refuse, _LOCAL_EXTRAS)
    zip64 = ZIP64_EXTRA in extra
    if zip64:
        local64 = list(_zip64_values(extra[ZIP64_EXTRA], len(extra[ZIP64_EXTRA]) // 8, refuse))
        size, compressed = (local64.pop(0) if v == ZIP32_MAX and local64 else v for v in (size, compressed))
    end = data + entry.size
    if end > length:
        raise refuse(f"{entry.name!r} reaches past the archive's end")
    if not flags & _DESCRIPTOR_FLAG:
        if (crc, compressed, size) != (entry.crc, entry.size, entry.size):
            raise refuse(f"the CRC-32 or sizes of {entry.name!r} differ between its headers")
        return data, end
    descriptor = DESCRIPTOR64 if zip64 else DESCRIPTOR32
    if end + descriptor.size > length:
        raise refuse(f"the data descriptor of {entry.name!r} lies past the archive's end")
    if descriptor.unpack(read(end, descriptor.size)) != (DESCRIPTOR_SIGNATURE, entry.crc, entry.size, entry.size) or not (
        crc in (0, entry.crc) and compressed in (0, ZIP32_MAX, entry.size) and size in (0, ZIP32_MAX, entry.size)
    ):
        raise refuse(f"the CRC-32 or sizes of {entry.name!r} differ between its headers and its data descriptor")
    return data, end + descriptor.size


def _extra_fields(extra: bytes, refuse: Callable[[str], NotCanonical], allowed: frozenset[int]) -> dict[int, bytes]:
    """tag -> data of the extra fields that tile `extra`, each of a tag in `allowed`, none twice."""
    if not extra:
        return {}
    fields, pos = {}, 0
    while pos < len(extra):
        if pos + EXTRA_FIELD.size > len(extra):
            raise refuse("an extra field is cut short")
        tag, size = EXTRA_FIELD.unpack_from(extra, pos)
        pos += EXTRA_FIELD.size + size
        if pos > len(extra) or tag not in allowed or tag in fields:
            raise refuse(f"an extra field (tag {tag:#06x}) overruns its space, repeats, or is not one torch.save writes")
        fields[tag] = extra[pos - size : pos]
    return fields


def _zip64_values(data: bytes, count: int, refuse: Callable[[str], NotCanonical]) -> tuple[int, ...]:
    """The `count` 8-byte values a Zip64 extra field holds, and nothing else."""
    if len(data) != 8 * count:
        raise refuse("a Zip64 extra field does not hold exactly the values its header leaves out")
    return tuple(int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8))


def _check_values(spans: dict[bytes, tuple[int, int]], read: Callable[[int, int], bytes], refuse: Callable[[str], NotCanonical]) -> None:
    """The small records torch interprets hold what it accepts and reads as reshard does."""
    if b"data.pkl" not in spans:
        raise refuse("it has no data.pkl")
    if b"version" not in spans and b".data/version" not in spans:
        raise refuse("it has no version record")

    def value(name: bytes) -> bytes | None:
        if name not in spans:
            return None
        offset, size = spans[name]
        if size > _SMALL:
            raise refuse(f"its {name.decode()} record is too long")
        return read(offset, size)

    if value(b"byteorder") not in (None, b"little"):
        raise refuse("its byteorder is not little-endian")
    for name in (b"version", b".data/version", b".storage_alignment"):
        found = value(name)
        if found is not None and not _NUMBER.fullmatch(found):
            raise refuse(f"its {name.decode()} record is not a number")
