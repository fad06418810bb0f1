"""torch_dist output whose optimizer state is Megatron's DistributedOptimizer `dp_reshardable` form for the target
layout and data-parallel size: what megatron-core (≥ 0.15) saves by default, and loads only at the layout it was
saved at (any DP), so the conversion writes the buckets the target run's DistributedOptimizer will build.

Per model-parallel rank I, model chunk g and bucket b, three 1-D fp32 tensors
`optimizer.distributed.dp_group_idx_<I>.gbuf_idx_<g>.dtype_(<param>, <grad>).bucket_idx_<b>.<param|exp_avg|exp_avg_sq>`
of the bucket's unpadded length, and the rank's ShardedObjects `...dp_group_idx_<I>.{optimizer, per_bucket_numel,
per_bucket_numel_unpadded}`; common.pt's `optimizer` entry only names the form (megatron-core 0.16's
`DistributedOptimizer.sharded_state_dict(... 'dp_reshardable')`). An MoE model at EP > 1 has megatron-core's
ChainedOptimizer: all of that per optimizer, keys prefixed `chained_0.` (dense) and `chained_1.` (experts, keyed by the
expert rank, buckets padded for the expert data-parallel size), common.pt's entry one per optimizer; at EP1 the experts
are in the one dense optimizer's buffer. Where each parameter lies in its rank's bucket is
the reader's derivation (`buffers.BufferLayout`), so what is written here is decoded back by the same rules
and checked there against the saved bucket sizes: in the Transformer-Engine spec's order where the output has its
names, and in buckets of the size the source run's args record (a target run with another bucket size refuses the
load: megatron-core checks `per_bucket_numel_unpadded`).

Each target piece of a logical optimizer tensor (`optimizer.state.<state>.<param>`, any source form) is one chunk
of its rank's bucket tensor, written as its slab streams by: memory stays one parameter's state, never a bucket.
Every TP replica of a replicated parameter (a norm) and the last stage's copy of a tied embedding get their own
chunk, as each of those ranks keeps its own state. The 64-element alignment gaps between parameters are chunks of
zeros, so that each bucket tensor is covered whole, as Megatron's save covers it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from reshard.config import ModelConfig
from reshard.layout import Layout, RankCoord
from reshard.logical import TensorSpec
from reshard.optim.buffers import EXPERT_CHAIN, STATE_KEYS, Gbuf
from reshard.optim.common import param_groups
from reshard.optim.sink import OptimizerSink, Placement
from reshard.sharding import Piece, region_size
from reshard.torchfile.dcp_metadata import Chunk, TensorEntry

if TYPE_CHECKING:
    from reshard.formats.base import CommonState

_OBJECT = "/shard_0_1"  # the storage key of a ShardedObject of global shape (1,) at offset (0,)


class DpReshardableSink(OptimizerSink):
    """Where the torch_dist writer puts the optimizer tensors' pieces: chunks of the target ranks'
    DistributedOptimizer bucket tensors, with the ShardedObjects and common state that describe them."""

    written_as = "as dp_reshardable"

    def __init__(self, specs: dict[str, TensorSpec], config: ModelConfig, layout: Layout, args: dict[str, Any], common: CommonState, dp: int):
        super().__init__(specs, config, layout, args, common, dp)
        self._dtypes = f"(torch.{config.params_dtype}, torch.{self.grad_dtype})"  # as bucket tensor keys spell them
        # one optimizer's buffers per rank and model chunk; an MoE model at EP > 1 chains a dense and an expert one
        groups = param_groups(common.extra.get("optimizer"), None not in self.buffer_layout.chains)
        self.buckets: dict[str, int] = {}  # bucket tensor key prefix -> unpadded length
        objects = dict(common.objects)
        for chain, group in self.buffer_layout.optimizers():
            dp = self.buffer_layout.expert_dp if chain == EXPERT_CHAIN else self.buffer_layout.dp
            unpadded, padded = [], []
            for gbuf in self.buffer_layout.rank_buffers(chain, group):
                sizes = list(self.buffer_layout.buffers[gbuf].sizes)
                self.buckets.update((self._bucket_key(gbuf, b), size) for b, size in enumerate(sizes))
                unpadded.append({self.dtype_key: sizes})
                padded.append({self.dtype_key: [self.buffer_layout.pad_bucket(size, dp) for size in sizes]})
            group_key = Gbuf(chain, group, 0).prefix
            objects[f"{group_key}.optimizer{_OBJECT}"] = groups[chain]
            objects[f"{group_key}.per_bucket_numel{_OBJECT}"] = padded
            objects[f"{group_key}.per_bucket_numel_unpadded{_OBJECT}"] = unpadded
        form = {"param_state_sharding_type": "dp_reshardable"}
        extra = {**common.extra, "optimizer": form if None in groups else {chain: dict(form) for chain in groups}}
        self.common = replace(common, objects=objects, extra=extra)

    @staticmethod
    def run_args(dp: int, layout: Layout) -> dict[str, Any]:
        """A run at data-parallel size `dp` whose DistributedOptimizer saves its default form."""
        return OptimizerSink.run_args(dp, layout) | {"dist_ckpt_optim_fully_reshardable": False}

    def _bucket_key(self, gbuf: Gbuf, bucket: int) -> str:
        return f"{gbuf}.dtype_{self._dtypes}.bucket_idx_{bucket}"

    def placements(self, spec: TensorSpec, pieces: list[Piece]) -> list[Placement]:
        """Each piece with a place of its own as a chunk of its rank's bucket tensor, flattened (row-major, as the
        rank's parameter is). The checksums of the copies the reader decodes (primary pieces) are vouched for as
        written, as the reader finds them in the buckets."""
        out = []
        for piece in self.own_pieces(spec, pieces):
            gbuf, place, first = self.place(spec, piece)
            key = f"{self._bucket_key(gbuf, place.bucket)}.{spec.name.split('.')[2]}"
            rank = RankCoord(pp=piece.rank.pp, tp=piece.rank.tp, ep=piece.rank.ep)
            out.append(Placement(piece, rank, key, (place.start + first,), (region_size(piece.region),), piece.primary and piece.alias is None))
        return out

    def entries(self, chunks: dict[str, list[Chunk]], zeros: Callable[[str, int, int], None]) -> dict[str, TensorEntry]:
        """The bucket tensors, once every rank's chunks are known (`chunks`, by tensor key): each covered whole, its gaps
        (parameter alignment) written as chunks of zeros by `zeros(key, first element, count)`, as Megatron's save
        covers them."""
        entries = {}
        for prefix, size in self.buckets.items():
            for state in STATE_KEYS:
                key = f"{prefix}.{state}"
                at = 0
                for start, end in [*sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks[key]), (size, size)]:
                    if start > at:
                        zeros(key, at, start - at)
                    at = max(at, end)
                entries[key] = TensorEntry("float32", (size,), sorted(chunks[key], key=lambda c: c.offsets))
        return entries
