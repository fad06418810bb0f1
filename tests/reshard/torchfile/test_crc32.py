"""A record's CRC-32 from its parts' (torchfile/crc32.py) against zlib's CRC-32 of the whole record."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from reshard.torchfile.crc32 import crc32_combine, crc32_of_parts


@pytest.mark.parametrize("a, b", [(0, 0), (1, 7), (100, 1), (4096, 12345), (3, 1 << 20)])
def test_combined_crc_is_zlibs_of_the_concatenation(a, b):
    rng = np.random.default_rng(a + b)
    first, second = rng.bytes(a), rng.bytes(b)
    assert crc32_combine(zlib.crc32(first), zlib.crc32(second), b) == zlib.crc32(first + second)


def test_parts_in_any_order_give_the_records_crc_and_a_gap_or_overlap_is_refused():
    data = np.random.default_rng(0).bytes(10_000)
    cuts = [(6000, 4000), (0, 256), (256, 5744)]
    parts = {at: (n, zlib.crc32(data[at : at + n])) for at, n in cuts}
    assert crc32_of_parts(parts, len(data), "r") == zlib.crc32(data)
    with pytest.raises(AssertionError, match="never"):
        crc32_of_parts({k: v for k, v in parts.items() if k != 256}, len(data), "r")
    with pytest.raises(AssertionError, match="twice"):
        crc32_of_parts({**parts, 100: (10, 0)}, len(data), "r")
    with pytest.raises(AssertionError, match="of 10001"):
        crc32_of_parts(parts, len(data) + 1, "r")
