"""Optimizer state that does not belong to its parameters, found by the fp32 master weights.

Megatron keeps fp32 master weights in the optimizer state (`optimizer.state.param.<X>` in the
DistributedOptimizer's forms, `optimizer.state.fp32_param.<X>` in the plain optimizer's) and copies them into
the model after every step, so a checkpoint's weights are its master weights rounded to the model's dtype.
megatron-core 0.15-0.19 break that in a `fully_reshardable` save of a DistributedOptimizer buffer in two or
more buckets: past the first bucket they read the state at offsets shifted by the earlier buckets' padding
and zero-fill the overrun (fixed upstream by Megatron-LM #5077, after 0.19). Such state loads without error
and resumes a run with moments for the wrong elements, so a conversion refuses it, naming the tensors.

Only checkpoints that can hold that damage are checked (it reads the model and its master weights once
more): the DistributedOptimizer's per-parameter form as saved (a dp_reshardable save is decoded from the
buckets themselves, whose sizes are checked), from a run whose buffers had several buckets.
"""

from __future__ import annotations

import numpy as np

from reshard.collective import Collective, shares
from reshard.dtypes import itemsize, numpy_dtype
from reshard.errors import ReshardError
from reshard.formats.base import CheckpointReader
from reshard.logical import OPTIMIZER_PREFIX
from reshard.plan import UNIT_BYTES, TensorMove
from reshard.sharding import Region, bands, region_size, slabs

MASTER_STATES = ("param", "fp32_param")


def master_of(name: str) -> str | None:
    """The model tensor whose fp32 master weights logical tensor `name` holds, if it holds any."""
    match = OPTIMIZER_PREFIX.match(name)
    return match.group("param") if match and match.group("state") in MASTER_STATES else None


def at_risk(reader: CheckpointReader) -> bool:
    """Whether the checkpoint's optimizer state is a DistributedOptimizer's per-parameter save from a run with
    several buckets per buffer (bucketed for overlapping the gradient reduce, or the shared embedding's own)."""
    args = reader.common.args
    if not args.get("use_distributed_optimizer") or getattr(reader, "dp_reshardable", None) is not None:
        return False
    tied = reader.config is not None and reader.config.tied_embeddings
    return bool(args.get("overlap_grad_reduce")) or (reader.layout.pp > 1 and tied)


def check(reader: CheckpointReader, moves: list[TensorMove], team: Collective) -> None:
    """Refuse the conversion if, among the tensors `moves` carry, the master weights of a checkpoint at risk are not
    its weights (each rank of `team` reads its share)."""
    masters = [m for m in moves if master_of(m.source.name)]
    if masters and at_risk(reader):
        bad = sorted(n for part in team.together(lambda: mismatched(reader, shares(masters, team.size)[team.rank])) for n in part)
        if bad:
            raise refusal(bad)


def mismatched(reader: CheckpointReader, moves: list[TensorMove]) -> list[str]:
    """The model tensors, among the master-weight `moves`, whose saved weights are not their master weights in
    the model's dtype; read a band of at most UNIT_BYTES of both at a time."""
    bad = []
    for move in moves:
        name = master_of(move.source.name)
        assert name is not None
        model = reader.specs[name]
        if not all(_agree(reader, move.source.name, name, region) for slab in slabs(model) for region in _bands(slab, model.dtype)):
            bad.append(name)
    return bad


def _bands(slab: Region, dtype: str) -> list[Region]:
    return bands(slab, -(-region_size(slab) * max(4, itemsize(dtype)) // UNIT_BYTES))


def _agree(reader: CheckpointReader, master: str, name: str, region: Region) -> bool:
    weights = reader.read(name, region)
    master_weights = np.empty(weights.shape, np.float32)
    reader.read_into(master, region, master_weights)
    return bool(np.array_equal(master_weights.astype(numpy_dtype(reader.specs[name].dtype)).view(np.uint8), weights.view(np.uint8)))


def refusal(bad: list[str]) -> ReshardError:
    shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    return ReshardError(
        f"the optimizer state of {len(bad)} parameter(s) does not belong to them ({shown}: the fp32 master weights are not "
        "the saved weights), as megatron-core 0.15-0.19 write a multi-bucket fully_reshardable DistributedOptimizer save; "
        "convert the run's dp_reshardable checkpoint instead, or pass --no-optimizer"
    )
