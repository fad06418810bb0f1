"""CRC-32 of a record written in parts, in any order: a zip header needs the CRC of the whole record, and the
parts (one parameter's state each) are written by reader threads as they come, never the whole record at once.
The parts' own CRCs are combined as zlib's `crc32_combine` does (not in Python's zlib module): appending n zero
bytes to a CRC is a linear operator over GF(2), kept for each power of two."""

from __future__ import annotations

import functools

_POLY = 0xEDB88320


def _times(matrix: tuple[int, ...], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, row) for row in matrix)


@functools.cache
def _zeros(k: int) -> tuple[int, ...]:
    """The operator that appends 2**k zero bytes to a CRC-32's register."""
    if k == 0:
        matrix = (_POLY, *(1 << n for n in range(31)))  # one zero bit
        for _ in range(3):
            matrix = _square(matrix)
        return matrix
    return _square(_zeros(k - 1))


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of A + B from A's CRC `crc1`, B's `crc2` and B's length in bytes."""
    k = 0
    while length2:
        if length2 & 1:
            crc1 = _times(_zeros(k), crc1)
        length2 >>= 1
        k += 1
    return crc1 ^ crc2


def crc32_of_parts(parts: dict[int, tuple[int, int]], size: int, what: str) -> int:
    """The CRC-32 of `size` bytes made of `parts` ({byte offset: (length, CRC-32)}), which must cover them once,
    in any order; `what` names the record in the error raised otherwise."""
    crc = at = 0
    for offset, (length, part) in sorted(parts.items()):
        if offset != at:
            raise AssertionError(f"{what}: bytes {min(at, offset)}-{max(at, offset)} written {'twice' if offset < at else 'never'}")
        crc = crc32_combine(crc, part, length)
        at += length
    if at != size:
        raise AssertionError(f"{what}: {at} bytes written of {size}")
    return crc
