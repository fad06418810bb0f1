"""Where each part of a logical tensor lives under a layout.

`pieces()` is the single source of truth for sharding: readers use it to reassemble logical tensors
from rank files, writers to cut them. A piece maps a region of the global tensor onto a region of
one rank's local tensor; the `primary` pieces partition the logical tensor exactly (replicas are
not primary), which is what torch_dist stores and what checksums count.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from reshard.config import ModelConfig
from reshard.layout import Layout, RankCoord
from reshard.logical import Split, TensorSpec

Region = tuple[tuple[int, int], ...]  # (start, stop) per axis of the global tensor


@dataclass(frozen=True)
class Piece:
    rank: RankCoord  # includes the virtual stage holding the piece
    region: Region  # in the global tensor
    local_layer: int | None  # stage-local layer index, for per-rank (legacy) names
    local_expert: int | None  # rank-local expert index
    local_shape: tuple[int, ...]  # the rank's tensor (layer/expert axes removed)
    local_region: Region  # where the piece sits in the rank's tensor
    primary: bool
    alias: str | None = None  # a different local name (tied output layer on the last stage)


def region_size(region: Region) -> int:
    n = 1
    for start, stop in region:
        n *= stop - start
    return n


def to_slices(region: Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def full_region(shape: tuple[int, ...]) -> Region:
    return tuple((0, d) for d in shape)


def _owning_chunks(spec: TensorSpec, config: ModelConfig | None, layout: Layout) -> list[tuple[int, int, int | None, int | None]]:
    """(pp, vstage, global layer or None, local layer or None) for every copy of the tensor. Without an
    architecture (`config` None) a plan keeps one stage (`plan.make_plan`), which holds every layer."""
    if config is None:
        assert layout.pp * layout.vpp == 1, "a layout of several stages without an architecture"
        return [(0, 0, layer, layer) for layer in (range(spec.shape[0]) if spec.stacked else [spec.layer])]
    if config.tower_of(spec.param) is not None:  # a tower is on the first stage, its blocks (if stacked) all there (`config.Tower`)
        return [(0, 0, layer, layer) for layer in (range(spec.shape[0]) if spec.stacked else [None])]
    stages = layout.stage_layers(config.num_layers)
    last = len(stages) - 1
    if spec.stacked:
        return [
            (c % layout.pp, c // layout.pp, layer, layer - layers.start)
            for c, layers in enumerate(stages)
            for layer in layers
        ]
    if spec.layer is not None:
        pp, vstage, local = layout.chunk_of_layer(config.num_layers, spec.layer)
        return [(pp, vstage, spec.layer, local)]
    param = config.language_name(spec.param)
    if param.startswith("embedding."):
        return [(0, 0, None, None)]
    # Multi-token-prediction layers live on the last stage, beside the output layer (Megatron-Core's default placement)
    if param.startswith(("output_layer.", "decoder.final_layernorm.", "decoder.final_norm.", "mtp.")):
        return [(last % layout.pp, last // layout.pp, None, None)]
    return [(0, 0, None, None)]


def _tp_parts(spec: TensorSpec, dims: tuple[int, ...], degree: int, rank: int) -> list[tuple[int, int, int, int]]:
    """For the TP-split axis: (global start, global stop, local start, local stop) of a rank's share."""
    axis = spec.tp_axis
    assert axis is not None
    size = dims[axis - spec.prefix_axes]
    if spec.gated:
        half = size // 2
        share = half // degree
        return [
            (rank * share, (rank + 1) * share, 0, share),
            (half + rank * share, half + (rank + 1) * share, share, 2 * share),
        ]
    share = size // degree
    return [(rank * share, (rank + 1) * share, 0, share)]


def pieces(spec: TensorSpec, config: ModelConfig | None, layout: Layout) -> list[Piece]:
    """Every piece of `spec` under `layout`, replicas included (`config` None: a checkpoint that records no
    architecture, at one stage)."""
    dims = spec.shape[spec.prefix_axes :]
    n_experts = spec.shape[int(spec.stacked)] if spec.experts else 1
    ep = layout.ep if spec.experts else 1
    tp_degree = layout.expert_tp if spec.experts else layout.tp
    local_experts = n_experts // ep
    out: list[Piece] = []
    for pp, vstage, layer, local_layer in _owning_chunks(spec, config, layout):
        for tp in range(layout.tp):
            tp_part_rank, tp_replica = tp % tp_degree, tp // tp_degree
            for ep_rank in range(layout.ep):
                rank = RankCoord(pp=pp, tp=tp, ep=ep_rank, vstage=vstage)
                if spec.experts:
                    expert_range = range(ep_rank * local_experts, (ep_rank + 1) * local_experts)
                    ep_primary = True
                else:
                    expert_range = range(1)
                    ep_primary = ep_rank == 0
                for local_expert, expert in enumerate(expert_range):
                    prefix: list[tuple[int, int]] = []
                    if spec.stacked:
                        prefix.append((layer, layer + 1))
                    if spec.experts:
                        prefix.append((expert, expert + 1))
                    if spec.split is Split.NONE or spec.tp_axis is None:
                        parts = None
                        tp_primary = tp == 0
                    else:
                        parts = _tp_parts(spec, dims, tp_degree, tp_part_rank)
                        tp_primary = tp_replica == 0
                    local_shape = list(dims)
                    if parts is not None:
                        local_shape[spec.tp_axis - spec.prefix_axes] = sum(p[1] - p[0] for p in parts)
                    for g0, g1, l0, l1 in parts or [(None, None, None, None)]:
                        region = prefix + [(0, d) for d in dims]
                        local_region = [(0, d) for d in local_shape]
                        if g0 is not None:
                            axis = spec.tp_axis
                            region[axis] = (g0, g1)
                            local_region[axis - spec.prefix_axes] = (l0, l1)
                        out.append(
                            Piece(
                                rank=rank,
                                region=tuple(region),
                                local_layer=local_layer,
                                local_expert=local_expert if spec.experts else None,
                                local_shape=tuple(local_shape),
                                local_region=tuple(local_region),
                                primary=tp_primary and ep_primary,
                            )
                        )
    out.extend(_last_stage_embedding_copies(spec, config, layout, out))
    return out


def _last_stage_embedding_copies(spec: TensorSpec, config: ModelConfig | None, layout: Layout, embedding: list[Piece]) -> list[Piece]:
    """With several pipeline stages the last one keeps its own copy of the word embeddings where it needs them: as
    its embedding for multi-token-prediction layers (Megatron-Core's `mtp_process`; its output layer stays its own,
    or is none where tied), else as the output layer of tied embeddings."""
    chunks = layout.pp * layout.vpp
    if not (chunks > 1 and spec.param == "embedding.word_embeddings.weight" and (config.tied_embeddings or config.mtp_num_layers)):
        return []
    mtp = bool(config.mtp_num_layers)
    last = chunks - 1
    last_rank = dict(pp=last % layout.pp, vstage=last // layout.pp)
    alias = None if mtp else "output_layer.weight" if not spec.is_optimizer else spec.name.replace(spec.param, "output_layer.weight")
    return [
        Piece(
            rank=RankCoord(pp=last_rank["pp"], tp=p.rank.tp, ep=p.rank.ep, vstage=last_rank["vstage"]),
            region=p.region,
            local_layer=None,
            local_expert=None,
            local_shape=p.local_shape,
            local_region=p.local_region,
            primary=False,
            alias=alias,
        )
        for p in embedding
    ]


def slab_of(spec: TensorSpec, region: Region) -> tuple[int | None, int | None]:
    """The (layer, expert) slab a region lies in: the unit of streaming work."""
    layer = region[0][0] if spec.stacked else None
    expert = region[int(spec.stacked)][0] if spec.experts else None
    return layer, expert


def slabs(spec: TensorSpec) -> Iterator[Region]:
    """Regions that stream a tensor one layer (and one expert) at a time."""
    layers = range(spec.shape[0]) if spec.stacked else [None]
    n_experts = spec.shape[int(spec.stacked)] if spec.experts else None
    for layer in layers:
        for expert in range(n_experts) if n_experts is not None else [None]:
            region: list[tuple[int, int]] = []
            if layer is not None:
                region.append((layer, layer + 1))
            if expert is not None:
                region.append((expert, expert + 1))
            region.extend((0, d) for d in spec.shape[len(region) :])
            yield tuple(region)


def split_by_slab(spec: TensorSpec, region: Region) -> Iterator[Region]:
    """`region` cut into its parts in each slab (one layer and expert each)."""
    lead = int(spec.stacked) + int(spec.experts)
    for index in itertools.product(*(range(a, b) for a, b in region[:lead])):
        yield (*((i, i + 1) for i in index), *region[lead:])


def pieces_by_slab(all_pieces: list[Piece], spec: TensorSpec) -> dict[tuple[int | None, int | None], list[Piece]]:
    grouped: dict[tuple[int | None, int | None], list[Piece]] = defaultdict(list)
    for piece in all_pieces:
        grouped[slab_of(spec, piece.region)].append(piece)
    return grouped


def intersect(a: Region, b: Region) -> Region | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


_Value = TypeVar("_Value")


class RegionIndex(Generic[_Value]):
    """Regions, each with a value, found by overlap with a query by bisecting on one axis instead of
    testing every one: a MoE tensor of thousands of chunks is read in hundreds of units. The axis is the
    one the regions are cut most along (experts rather than layers): a query for one expert's record
    then tests that expert's chunks, not every chunk of its layer."""

    def __init__(self, items: Iterable[tuple[Region, _Value]]):
        items = list(items)
        self.axis = _most_cut_axis([region for region, _ in items])
        self.items = sorted(items, key=lambda item: self._span(item[0])[0])
        self.starts = [self._span(region)[0] for region, _ in self.items]
        self.reach = max((b - a for a, b in (self._span(r) for r, _ in self.items)), default=0)

    def _span(self, region: Region) -> tuple[int, int]:
        return region[self.axis] if region else (0, 1)

    def overlapping(self, region: Region) -> Iterator[tuple[Region, Region, _Value]]:
        """(item's region, its intersection with `region`, item's value) for each item overlapping `region`."""
        a, b = self._span(region)
        lo = bisect.bisect_left(self.starts, a - self.reach + 1)
        for item_region, value in self.items[lo : bisect.bisect_left(self.starts, b)]:
            inside = intersect(item_region, region)
            if inside is not None:
                yield item_region, inside, value


def _most_cut_axis(regions: list[Region]) -> int:
    """The axis along which the regions start at the most distinct positions (0 for scalars)."""
    ndim = len(regions[0]) if regions else 0
    return max(range(ndim), key=lambda axis: len({r[axis][0] for r in regions}), default=0)


def shift(region: Region, origin: Region) -> Region:
    """Express `region` relative to the start of `origin`."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(region, origin))


def long_axis(region: Region) -> int | None:
    """The first axis of `region` longer than one: cutting along it leaves each band of a row-major
    buffer over `region` contiguous."""
    return next((i for i, (a, b) in enumerate(region) if b - a > 1), None)


def cut(region: Region, axis: int, cuts: list[int]) -> list[Region]:
    """`region` cut along `axis` at the ascending positions `cuts` (its start and stop included)."""
    return [(*region[:axis], (lo, hi), *region[axis + 1 :]) for lo, hi in zip(cuts, cuts[1:]) if lo < hi]


def bands(region: Region, parts: int) -> list[Region]:
    """`region` cut into at most `parts` contiguous bands of near-equal length along its `long_axis`."""
    axis = long_axis(region)
    if axis is None or parts <= 1:
        return [region]
    start, stop = region[axis]
    return cut(region, axis, [start + (stop - start) * k // parts for k in range(parts + 1)])


def units(slab: Region, whole: list[Region], max_elements: int) -> list[Region]:
    """`slab` cut along its `long_axis` into consecutive units of at most `max_elements` where it can be,
    never through one of the `whole` regions (each ends up inside one unit); a unit is larger only where
    one region alone is."""
    axis = long_axis(slab)
    if axis is None or region_size(slab) <= max_elements:
        return [slab]
    start, stop = slab[axis]
    per_line = region_size(slab) // (stop - start)
    spans = [(r[axis][0], r[axis][1]) for r in whole]
    allowed = sorted({p for span in spans for p in span if start < p < stop and not any(a < p < b for a, b in spans)})
    points, previous = [start], start
    for point in [*allowed, stop]:
        if (point - points[-1]) * per_line > max_elements and previous > points[-1]:
            points.append(previous)
        previous = point
    return cut(slab, axis, [*points, stop])


def contiguous_offset(shape: tuple[int, ...], region: Region) -> int | None:
    """Where `region` starts in a row-major tensor of `shape`, in elements, if its elements are one
    contiguous run there (every axis after its `long_axis` whole); None otherwise."""
    axis = long_axis(region)
    if axis is not None and any((a, b) != (0, d) for (a, b), d in zip(region[axis + 1 :], shape[axis + 1 :])):
        return None
    offset = 0
    for (a, _), d in zip(region, shape):
        offset = offset * d + a
    return offset
