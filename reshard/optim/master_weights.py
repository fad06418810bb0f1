"""Optimizer state that does not belong to its parameters, found by the fp32 master weights.

Megatron keeps fp32 master weights in the optimizer state (`optimizer.state.param.<X>` in the
DistributedOptimizer's forms, `optimizer.state.fp32_param.<X>` in the plain optimizer's) and copies them into
the model after every step, so a checkpoint's weights are its master weights rounded to the model's dtype.
Two things break that, and a conversion refuses either, naming the tensors:

- megatron-core 0.15-0.19 in a `fully_reshardable` save of a DistributedOptimizer buffer in two or more
  buckets: past the first bucket they read the state at offsets shifted by the earlier buckets' padding and
  zero-fill the overrun (fixed upstream by Megatron-LM #5077, after 0.19). Such state loads without error and
  resumes a run with moments for the wrong elements. Checked where the args say the run had several buckets.
- a wrong buffer layout of reshard's own: the `dp_reshardable` and `distrib_optim.pt` forms hold flat buckets
  whose parameter order reshard derives (`optim.buffers.BufferLayout`). The bucket lengths catch most
  errors, not two parameters of one size in each other's place; the master weights catch those, whatever the
  spec, so every conversion of those forms checks them.

Where the shifted saves can occur the check reads the model and its master weights once more, a unit of at most
UNIT_BYTES at a time, each unit whole pieces of the source's layout (so a decoded read touches each rank's parameter
once). A decoded layout is checked on a sample instead: the first and last rows of every rank's piece of every
parameter, each layer and expert of a stacked tensor its own parameter. A parameter in another's place, or a shift
anywhere in its bucket, moves all of its elements, so the edges show it, at a few rows per parameter rather than a
second read of the whole state (which cost 0.4-0.75 of the conversion's time, and 2.65 GB more read for a 7.09 GB
source while the sample took each layer's piece whole).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np

from reshard.collective import Collective, shares
from reshard.dtypes import itemsize, numpy_dtype
from reshard.errors import ReshardError
from reshard.formats.base import CheckpointReader
from reshard.logical import OPTIMIZER_PREFIX, TensorSpec
from reshard.optim.state import MASTER_STATES
from reshard.plan import UNIT_BYTES, TensorMove
from reshard.sharding import Region, intersect, pieces, slabs, units


def master_of(name: str) -> str | None:
    """The model tensor whose fp32 master weights logical tensor `name` holds, if it holds any."""
    match = OPTIMIZER_PREFIX.match(name)
    return match.group("param") if match and match.group("state") in MASTER_STATES else None


def at_risk(reader: CheckpointReader) -> bool:
    """Whether the checkpoint's optimizer state is a DistributedOptimizer's per-parameter save from a run with
    several buckets per buffer (bucketed for overlapping the gradient reduce, or the shared embedding's own)."""
    args = reader.common.args
    if not args.get("use_distributed_optimizer") or decoded_from_buffers(reader):
        return False
    tied = reader.config is not None and reader.config.tied_embeddings
    return bool(args.get("overlap_grad_reduce")) or (reader.layout.pp > 1 and tied)


def decoded_from_buffers(reader: CheckpointReader) -> bool:
    """Whether the checkpoint's optimizer state is decoded from DistributedOptimizer buffers by the layout reshard
    derives (dp_reshardable buckets, or the legacy format's distrib_optim.pt)."""
    return reader.optimizer is not None and reader.optimizer.from_buffers


def check(reader: CheckpointReader, moves: list[TensorMove], team: Collective) -> None:
    """Refuse the conversion if, among the tensors `moves` carry, the master weights of a checkpoint at risk or
    decoded from buffers are not its weights (each rank of `team` reads its share)."""
    masters = [m for m in moves if master_of(m.source.name)]
    decoded, risky = decoded_from_buffers(reader), at_risk(reader)
    if masters and (decoded or risky):
        regions = _units if risky else _edges
        bad = sorted(n for part in team.together(lambda: mismatched(reader, shares(masters, team.size)[team.rank], regions)) for n in part)
        if bad:
            raise layout_refusal(bad) if decoded else refusal(bad)


def mismatched(
    reader: CheckpointReader, moves: list[TensorMove], regions: Callable[[CheckpointReader, TensorSpec], Iterator[Region]] | None = None
) -> list[str]:
    """The model tensors, among the master-weight `moves`, whose saved weights are not their master weights in
    the model's dtype, compared over `regions` of each (all of it, a unit at a time, by default)."""
    bad = []
    for move in moves:
        name = master_of(move.source.name)
        assert name is not None
        if not all(_agree(reader, move.source.name, name, region) for region in (regions or _units)(reader, reader.specs[name])):
            bad.append(name)
    return bad


def _units(reader: CheckpointReader, model: TensorSpec) -> Iterator[Region]:
    """`model` in units of at most UNIT_BYTES of its fp32 master weights, never through one of its pieces at the
    source's layout (a decoded master tensor is read a rank's parameter at a time)."""
    whole = [p.region for p in pieces(model, reader.config, reader.layout) if p.primary and p.alias is None]
    for slab in slabs(model):
        yield from units(slab, [r for r in whole if intersect(r, slab) is not None], UNIT_BYTES // max(4, itemsize(model.dtype)))


EDGE_ELEMENTS = 1024  # of a 1-D piece, at either end


def _edges(reader: CheckpointReader, model: TensorSpec) -> Iterator[Region]:
    """The first and last rows (of a 1-D parameter, EDGE_ELEMENTS) of each piece of `model` at the source's layout,
    for every layer and expert a stacked piece holds: each is a parameter of its own in the buffers."""
    prefix = model.prefix_axes
    for piece in pieces(model, reader.config, reader.layout):
        if not piece.primary or piece.alias is not None:
            continue
        if len(piece.region) == prefix:  # no axes of its own: the whole of it
            yield piece.region
            continue
        (start, stop), *rest = piece.region[prefix:]
        for index in itertools.product(*(range(a, b) for a, b in piece.region[:prefix])):
            at = tuple((i, i + 1) for i in index)
            if rest:
                yield (*at, (start, start + 1), *rest)
                if stop - start > 1:
                    yield (*at, (stop - 1, stop), *rest)
            else:
                yield (*at, (start, min(stop, start + EDGE_ELEMENTS)))
                if stop - start > EDGE_ELEMENTS:
                    yield (*at, (max(start + EDGE_ELEMENTS, stop - EDGE_ELEMENTS), stop))


def _agree(reader: CheckpointReader, master: str, name: str, region: Region) -> bool:
    weights = reader.read(name, region)
    master_weights = np.empty(weights.shape, np.float32)
    reader.read_into(master, region, master_weights)
    dtype = numpy_dtype(reader.specs[name].dtype)
    rounded = master_weights if dtype == master_weights.dtype else master_weights.astype(dtype)
    bits = np.dtype(f"u{dtype.itemsize}")  # compared as bits: a NaN or -0.0 must be the very same value
    return bool(np.array_equal(rounded.view(bits), weights.view(bits)))


def layout_refusal(bad: list[str]) -> ReshardError:
    return ReshardError(
        f"{bad[0]}: the fp32 master weights decoded from the checkpoint's DistributedOptimizer buffers are not its saved "
        f"weights ({len(bad)} parameter(s) disagree): the buffer layout reshard derived from the model is not the saving "
        "run's, so its optimizer state cannot be decoded safely (convert with --no-optimizer)"
    )


def refusal(bad: list[str]) -> ReshardError:
    shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    return ReshardError(
        f"the optimizer state of {len(bad)} parameter(s) does not belong to them ({shown}: the fp32 master weights are not "
        "the saved weights), as megatron-core 0.15-0.19 write a multi-bucket fully_reshardable DistributedOptimizer save; "
        "convert the run's dp_reshardable checkpoint instead, or pass --no-optimizer"
    )
