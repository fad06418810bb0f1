"""The zip records a `torch.save` archive is made of, spelled once for the reader (`zip_reader`) and
the writer (`archive_writer`): each record's fields as a little-endian `struct`, in the order of PKWARE's
APPNOTE, and its signature."""

from __future__ import annotations

import struct

# signature, version needed, flags, method, time, date, CRC-32, compressed size, size, name length,
# extra length; then the name, the extra fields and the data
LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
LOCAL_HEADER_SIGNATURE = 0x04034B50
LOCAL_CRC_AT = 14  # where it holds the CRC-32

# signature, version made by, version needed, flags, method, time, date, CRC-32, compressed size, size,
# name length, extra length, comment length, disk, internal and external attributes, local header offset;
# then the name, the extra fields and the comment
CENTRAL_ENTRY = struct.Struct("<IHHHHHHIIIHHHHHII")
CENTRAL_ENTRY_SIGNATURE = 0x02014B50
CENTRAL_CRC_AT = 16  # where it holds the CRC-32

# signature, disk, the directory's disk, entries on this disk, entries, directory size and offset, comment length
END = struct.Struct("<IHHHHIIH")
END_SIGNATURE = 0x06054B50

# signature, size of the rest, version made by, version needed, disk, the directory's disk, entries on this
# disk, entries, directory size and offset
ZIP64_END = struct.Struct("<IQHHIIQQQQ")
ZIP64_END_SIGNATURE = 0x06064B50

# signature, the Zip64 end record's disk, its offset, disks; just before the end record
ZIP64_LOCATOR = struct.Struct("<IIQI")
ZIP64_LOCATOR_SIGNATURE = 0x07064B50

EXTRA_FIELD = struct.Struct("<HH")  # an extra field's tag and data size, its data following
ZIP64_EXTRA = 0x0001  # the Zip64 extra field: size, compressed size, local header offset, as 8 bytes each
PADDING_EXTRA = 0x4246  # "FB": the extra field torch pads with, so that a record's data starts aligned

# after a record's data when its flags say so (torch's miniz writes one after every non-empty record):
# signature, CRC-32, compressed size, size; the sizes in 8 bytes each for a record with a Zip64 extra field
DESCRIPTOR32 = struct.Struct("<IIII")
DESCRIPTOR64 = struct.Struct("<IIQQ")
DESCRIPTOR_SIGNATURE = 0x08074B50

ZIP32_MAX = 0xFFFFFFFF  # a size or offset holding this is in the Zip64 extra field (or end record)
COUNT_MAX = 0xFFFF  # an entry count holding this is in the Zip64 end record


def zip64_extra(values: list[int]) -> bytes:
    """A Zip64 extra field holding `values`: those of size, compressed size, offset that passed ZIP32_MAX."""
    return EXTRA_FIELD.pack(ZIP64_EXTRA, 8 * len(values)) + struct.pack(f"<{len(values)}Q", *values)
