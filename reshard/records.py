"""Where a region of a logical tensor lies in a checkpoint's files, as its writer placed it or its reader finds it: what
a verification checksums in place instead of reading the values through a reader."""

from __future__ import annotations

from dataclasses import dataclass

from reshard.sharding import Region


@dataclass(frozen=True)
class StoredRecord:
    """A region of a logical tensor stored whole, contiguous, at `offset` of file `file` (relative to the
    checkpoint): as the writer placed it, or as a reader finds it from the metadata on disk."""

    name: str
    region: Region
    dtype: str
    file: str
    offset: int  # of the region's first value
