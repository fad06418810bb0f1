"""pieces(): the primary pieces of every tensor partition it exactly, under any layout."""

import random

import pytest
import torch

from fixtures.models import TINY_LLAMA, TINY_MOE
from fixtures.synthetic import SyntheticReader
from reshard.layout import Layout
from reshard.sharding import RegionIndex, bands, contiguous_offset, intersect, pieces, region_size, shift, to_slices, units

LAYOUTS = [Layout(), Layout(tp=2), Layout(pp=2, vpp=2), Layout(tp=2, pp=2), Layout(pp=2, first_stage_layers=1)]
MOE_LAYOUTS = [Layout(ep=2), Layout(ep=4, tp=2, etp=1), Layout(ep=2, tp=2), Layout(ep=2, pp=2)]


def _cells(region):
    """Every index of a region (tiny tensors only)."""
    out = [()]
    for a, b in region:
        out = [c + (i,) for c in out for i in range(a, b)]
    return out


@pytest.mark.parametrize("config, layout", [(TINY_LLAMA, lay) for lay in LAYOUTS] + [(TINY_MOE, lay) for lay in MOE_LAYOUTS])
def test_primary_pieces_partition_every_tensor(config, layout):
    for name, spec in SyntheticReader(config).specs.items():
        seen = set()
        for piece in pieces(spec, config, layout):
            assert region_size(piece.region) == region_size(piece.local_region)
            if piece.primary:
                cells = _cells(piece.region)
                assert seen.isdisjoint(cells), name
                seen.update(cells)
        assert len(seen) == spec.numel, name


def test_expert_tensor_parallel_one_keeps_whole_experts_on_every_tp_rank():
    spec = SyntheticReader(TINY_MOE).specs["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    layout = Layout(tp=2, ep=2, etp=1)
    by_rank = {}
    for piece in pieces(spec, TINY_MOE, layout):
        if piece.local_layer == 0 and piece.local_expert == 0:
            by_rank[(piece.rank.tp, piece.rank.ep)] = piece
    # expert 0 of EP rank 0 and expert 2 of EP rank 1, unsplit (ETP=1), on both TP ranks; one copy primary
    assert {k: p.region[1] for k, p in by_rank.items()} == {(0, 0): (0, 1), (1, 0): (0, 1), (0, 1): (2, 3), (1, 1): (2, 3)}
    assert all(p.local_shape == (128, 64) for p in by_rank.values())
    assert [k for k, p in by_rank.items() if p.primary] == [(0, 0), (0, 1)]


def test_dense_tensors_replicate_over_expert_ranks_once_primary():
    spec = SyntheticReader(TINY_MOE).specs["decoder.layers.self_attention.linear_qkv.weight"]
    copies = [p for p in pieces(spec, TINY_MOE, Layout(ep=2)) if p.local_layer == 0]
    assert len(copies) == 2 and [p.primary for p in copies] == [True, False]


def test_bands_cover_the_region_in_contiguous_bands():
    region = ((3, 4), (0, 10), (0, 6))  # one layer of a stacked tensor: bands split its rows
    cut = bands(region, 3)
    assert cut == [((3, 4), (0, 3), (0, 6)), ((3, 4), (3, 6), (0, 6)), ((3, 4), (6, 10), (0, 6))]
    buffer = torch.arange(60).reshape(1, 10, 6)
    assert all(buffer[to_slices(shift(b, region))].is_contiguous() for b in cut)
    assert bands(((0, 2), (0, 5)), 8) == [((0, 1), (0, 5)), ((1, 2), (0, 5))]  # never an empty band
    assert bands(((0, 1), (0, 1)), 4) == [((0, 1), (0, 1))]


def test_contiguous_offset_agrees_with_torch_views():
    """Torch's own view arithmetic is the oracle: a region is one run exactly when its view is contiguous."""
    import itertools

    shape = (3, 4, 5)
    t = torch.arange(60).view(shape)
    spans = {d: [(a, b) for a in range(d) for b in range(a + 1, d + 1)] for d in set(shape)}
    for region in itertools.product(*(spans[d] for d in shape)):
        view = t[to_slices(region)]
        expected = view.storage_offset() if view.is_contiguous() else None
        assert contiguous_offset(shape, region) == expected, region


def test_units_never_cut_a_whole_region_and_stay_within_the_size_where_they_can():
    slab = ((3, 4), (0, 100), (0, 4))  # one layer: 100 rows of 4
    whole = [((3, 4), (r, r + 10), (0, 4)) for r in range(0, 100, 10)]  # records of 10 rows
    cut = units(slab, whole, 25 * 4)
    assert [u[1] for u in cut] == [(0, 20), (20, 40), (40, 60), (60, 80), (80, 100)]
    assert all(u[0] == (3, 4) and u[2] == (0, 4) for u in cut)
    # a region spanning others (a gated MLP's gate and up rows on one rank) keeps them together
    spanning = [*whole, ((3, 4), (5, 55), (0, 4))]
    assert [u[1] for u in units(slab, spanning, 25 * 4)] == [(0, 60), (60, 80), (80, 100)]
    assert units(slab, [slab], 4) == [slab] and units(slab, whole, 400) == [slab]


def test_region_index_finds_what_testing_every_region_finds():
    """Chunks of a MoE-like tensor (layer, expert, column halves), and a 0-dim one, against brute force."""
    rng = random.Random(0)
    chunks = [(((n, n + 1), (e, e + 1), (c, c + 4)), (n, e, c)) for n in range(3) for e in range(5) for c in (0, 4)]
    rng.shuffle(chunks)
    index = RegionIndex(chunks)
    for _ in range(200):
        query = tuple(tuple(sorted(rng.sample(range(n + 1), 2))) for n in (3, 5, 8))
        expected = {(region, intersect(region, query), value) for region, value in chunks if intersect(region, query) is not None}
        assert set(index.overlapping(query)) == expected
    assert list(RegionIndex([((), "scalar")]).overlapping(())) == [((), (), "scalar")]

