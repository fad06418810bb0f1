"""Checksums: equal for every partition of a tensor, different after any single-bit change."""

import random

import pytest
import torch

from reshard.checksum import HashedParts, TensorChecksum
from reshard.checksum import checksum_tensor as checksum_array
from tests.arrays import as_numpy


def checksum_tensor(t, content_rows=None):
    return checksum_array(as_numpy(t), content_rows)


def _random_partition(shape, rng):
    """Cut every axis at random points: the pieces of an arbitrary layout."""
    cuts = []
    for d in shape:
        points = sorted(rng.sample(range(1, d), min(d - 1, rng.randint(0, 3)))) if d > 1 else []
        bounds = [0, *points, d]
        cuts.append(list(zip(bounds[:-1], bounds[1:])))
    regions = [()]
    for axis in cuts:
        regions = [r + (c,) for r in regions for c in axis]
    return regions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("shape", [(7,), (5, 9), (3, 4, 6), (2, 3, 4, 5)])
def test_any_partition_gives_the_same_checksum(dtype, shape):
    rng = random.Random(hash((str(dtype), shape)) & 0xFFFF)
    t = (torch.randn(shape) * 100).to(dtype)
    whole = checksum_tensor(t)
    for _ in range(3):
        acc = TensorChecksum(shape, whole.dtype)
        regions = _random_partition(shape, rng)
        rng.shuffle(regions)
        for region in regions:
            acc.add(region, as_numpy(t[tuple(slice(a, b) for a, b in region)]))
        assert acc.complete
        assert acc.result() == whole


def test_every_single_bit_flip_is_detected():
    t = torch.randn(6, 10).bfloat16()
    whole = checksum_tensor(t).digest
    bits = t.view(torch.int16).flatten()
    for index in range(bits.numel()):
        for bit in (0, 7, 15):
            flipped = bits.clone()
            flipped[index] ^= 1 << bit if bit < 15 else -(1 << 15)
            assert checksum_tensor(flipped.view(torch.bfloat16).reshape(6, 10)).digest != whole


def test_moved_values_are_detected():
    t = torch.randn(8, 16)
    whole = checksum_tensor(t).digest
    assert checksum_tensor(t[[1, 0, *range(2, 8)]]).digest != whole  # two rows swapped (e.g. heads)
    assert checksum_tensor(t.t().contiguous().t()).digest == whole  # same values, other memory order
    assert checksum_tensor(t.reshape(16, 8)).digest != whole


def test_vocabulary_padding_is_ignored():
    real = torch.randn(250, 8)
    padded_a = torch.cat([real, torch.zeros(6, 8)])
    padded_b = torch.cat([real, torch.randn(262, 8)])
    assert checksum_tensor(padded_a, content_rows=250).digest == checksum_tensor(padded_b, content_rows=250).digest
    assert checksum_tensor(padded_b, content_rows=250).digest != checksum_tensor(padded_b).digest


def test_incomplete_coverage_is_visible():
    acc = TensorChecksum((4, 4), "float32")
    acc.add(((0, 2), (0, 4)), as_numpy(torch.zeros(2, 4)))
    assert not acc.complete


def test_hashed_parts_vouch_only_for_their_own_memory():
    data = torch.randn(1, 6, 8).to(torch.bfloat16)
    top, bottom = ((2, 3), (0, 3), (0, 8)), ((2, 3), (3, 6), (0, 8))
    parts = {}
    for region, view in ((top, as_numpy(data[:, :3])), (bottom, as_numpy(data[:, 3:]))):
        acc = TensorChecksum((4, 6, 8), "bfloat16")
        acc.add(region, view)
        parts[region] = (view, acc)
    hashed = HashedParts(parts)
    reused = hashed.checksum_of(bottom, as_numpy(data[:, 3:].view(torch.int16)).view(as_numpy(data).dtype))
    assert reused is not None and reused.result() == parts[bottom][1].result()
    assert hashed.checksum_of(bottom, as_numpy(data[:, 3:].clone())) is None  # equal values elsewhere are hashed again
    assert hashed.checksum_of(top, as_numpy(data[:, 3:])) is None  # another part's memory under this part's name
    assert hashed.checksum_of(((2, 3), (0, 6), (0, 8)), as_numpy(data)) is None  # a region that is no part
