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

from dataclasses import replace
from typing import Any

import numpy as np

from reshard.checksum import HashedParts
from reshard.errors import ReshardError
from reshard.formats.base import CheckpointReader, CheckpointWriter, CommonState
from reshard.formats.megatron_dist import TorchDistWriter, _Record
from reshard.layout import Layout, RankCoord
from reshard.logical import TensorSpec
from reshard.optim.buffers import DENSE_CHAIN, EXPERT_CHAIN, STATE_KEYS, BufferLayout, Gbuf, flat_span
from reshard.request import Target
from reshard.sharding import Piece, Region, region_size, shift, to_slices
from reshard.torchfile.archive_writer import At, save_tensor
from reshard.torchfile.dcp_metadata import TensorEntry
from reshard.torchfile.pickles import named

_OBJECT = "/shard_0_1"  # the storage key of a ShardedObject of global shape (1,) at offset (0,)


def param_groups(recorded: Any, chained: bool, output: str = "--optimizer-form dp_reshardable") -> dict[int | None, Any]:
    """Each target optimizer's saved state (its param_groups, by chain index; None: unchained) from common.pt's
    `optimizer` entry as the source records it (one optimizer's, or one per chained optimizer). The dense optimizer's
    is either form's dense one; the expert optimizer's only a chained source records (else refused, naming `output`)."""
    if not isinstance(recorded, dict):
        recorded = {}
    by_chain = {None: recorded["optimizer"]} if "optimizer" in recorded else {
        chain: entry["optimizer"] for chain, entry in recorded.items() if isinstance(entry, dict) and "optimizer" in entry
    }
    dense = by_chain.get(DENSE_CHAIN, by_chain.get(None))
    if not isinstance(dense, dict):
        raise ReshardError("the source records no DistributedOptimizer param_groups: its optimizer state cannot be written as dp_reshardable")
    if not chained:
        return {None: dense}
    if not isinstance(by_chain.get(EXPERT_CHAIN), dict):
        raise ReshardError(
            f"{output} at EP > 1 writes megatron-core's chained expert optimizer, whose param_groups "
            "the source (one optimizer, an EP1 run's) does not record: write torch_dist's fully_reshardable form"
        )
    return {DENSE_CHAIN: dense, EXPERT_CHAIN: by_chain[EXPERT_CHAIN]}


def prepare_target(
    reader: CheckpointReader, target_format: str, specs: dict[str, TensorSpec], common: CommonState, target: Target, layout: Layout
) -> type[DpReshardableWriter]:
    """The writer of `--optimizer-form dp_reshardable` output with the target's data-parallel size recorded in
    `common`'s args (the source's unless `target.dp`); a request it cannot write is refused in one line."""
    if target_format != "torch_dist":
        raise ReshardError(f"--optimizer-form dp_reshardable is a torch_dist form; it cannot be written as {target_format}")
    if not target.optimizer:
        raise ReshardError("--optimizer-form dp_reshardable writes optimizer state: drop --no-optimizer")
    models = [name for name, spec in specs.items() if not spec.is_optimizer]
    missing = [f"optimizer.state.{k}.{name}" for name in models for k in STATE_KEYS if f"optimizer.state.{k}.{name}" not in specs]
    if missing:
        raise ReshardError(
            f"{missing[0]} is not in the source: the DistributedOptimizer's dp_reshardable state needs fp32 master weights "
            "and both Adam moments of every parameter (a DistributedOptimizer checkpoint's state); pass --no-optimizer"
        )
    if reader.config is None:
        raise ReshardError("--optimizer-form dp_reshardable places parameters by the architecture, which the source does not record: pass --config")
    param_groups(common.extra.get("optimizer"), reader.config.is_moe and layout.ep > 1)
    dp = target.dp or int(reader.common.args.get("data_parallel_size") or 1)
    if reader.config.is_moe and (dp * layout.tp) % (layout.expert_tp * layout.ep):
        raise ReshardError(
            f"data-parallel size {dp} x TP {layout.tp} is not a multiple of ETP {layout.expert_tp} x EP {layout.ep}, as "
            "megatron-core's expert data-parallel size needs: choose another --to-dp"
        )
    common.args["data_parallel_size"] = dp
    return DpReshardableWriter


def forms(reader: CheckpointReader, writer: type[CheckpointWriter], args: dict[str, Any]) -> tuple[str, str]:
    """The optimizer state's form as `reader` holds it and as `writer` will write it (args: the target's), in words."""
    decoded = getattr(reader, "dp_reshardable", None)
    read = f"dp_reshardable buckets (DP {decoded.dp})" if decoded is not None else "per-parameter tensors"
    if issubclass(writer, DpReshardableWriter):
        return read, f"dp_reshardable buckets (DP {args['data_parallel_size']})"
    if writer.format_name == "legacy":  # optimizer state in the legacy format is always distrib_optim.pt's
        return read, f"distrib_optim.pt buffers (DP {args['data_parallel_size']})"
    return read, "per-parameter tensors (fully_reshardable)" if writer.format_name == "torch_dist" else "per-parameter tensors"


class DpReshardableWriter(TorchDistWriter):
    """TorchDistWriter whose optimizer tensors go into the target ranks' DistributedOptimizer buckets."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        args = self._target_args()
        grad = "float32" if args.get("grad_reduce_in_fp32") else self.config.params_dtype
        self._dtypes = f"(torch.{self.config.params_dtype}, torch.{grad})"  # as bucket tensor keys spell them
        dtype_key = (named("torch", self.config.params_dtype), named("torch", grad))
        # one optimizer's buffers per rank and model chunk; an MoE model at EP > 1 chains a dense and an expert one
        self.buffer_layout = BufferLayout(self.specs, self.config, self.layout, args)
        groups = param_groups(self.common.extra.get("optimizer"), None not in self.buffer_layout.chains)
        self.buckets: dict[str, int] = {}  # bucket tensor key prefix -> unpadded length
        objects = dict(self.common.objects)
        for chain, group in self.buffer_layout.optimizers():
            dp = self.buffer_layout.expert_dp if chain == EXPERT_CHAIN else self.buffer_layout.dp
            unpadded, padded = [], []
            for gbuf in self.buffer_layout.rank_buffers(chain, group):
                sizes = list(self.buffer_layout.buffers[gbuf].sizes)
                self.buckets.update((self._bucket_key(gbuf, b), size) for b, size in enumerate(sizes))
                unpadded.append({dtype_key: sizes})
                padded.append({dtype_key: [self.buffer_layout.pad_bucket(size, dp) for size in sizes]})
            group_key = Gbuf(chain, group, 0).prefix
            objects[f"{group_key}.optimizer{_OBJECT}"] = groups[chain]
            objects[f"{group_key}.per_bucket_numel{_OBJECT}"] = padded
            objects[f"{group_key}.per_bucket_numel_unpadded{_OBJECT}"] = unpadded
        form = {"param_state_sharding_type": "dp_reshardable"}
        extra = {**self.common.extra, "optimizer": form if None in groups else {chain: dict(form) for chain in groups}}
        self.common = replace(self.common, objects=objects, extra=extra)

    def _target_args(self) -> dict[str, Any]:
        """A run at the recorded data-parallel size whose DistributedOptimizer saves its default form."""
        dp = int(self.common.args["data_parallel_size"])
        return {
            **super()._target_args(),
            "data_parallel_size": dp,
            "world_size": dp * self.layout.tp * self.layout.pp,
            "use_distributed_optimizer": True,
            "dist_ckpt_optim_fully_reshardable": False,
        }

    @classmethod
    def whole_regions(cls, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> list[Region]:
        if not spec.is_optimizer:
            return super().whole_regions(spec, slab, pieces)
        return list(dict.fromkeys(p.region for p in pieces))  # every rank's copy is a chunk of its own bucket

    def _bucket_key(self, gbuf: Gbuf, bucket: int) -> str:
        return f"{gbuf}.dtype_{self._dtypes}.bucket_idx_{bucket}"

    def _place(self, spec: TensorSpec, piece: Piece) -> tuple[str, int]:
        """The bucket tensor a piece of an optimizer tensor goes to, and its offset there."""
        gbuf, place = self.buffer_layout.place_of(self.buffer_layout.model_specs[spec.param], piece)
        span = flat_span(piece)
        if span is None:
            raise ReshardError(f"{spec.name}: a target piece is not one run of its rank's parameter; not written as dp_reshardable")
        return f"{self._bucket_key(gbuf, place.bucket)}.{spec.name.split('.')[2]}", place.start + span[0]

    def _bucket_pieces(self, spec: TensorSpec, pieces: list[Piece]) -> list[Piece]:
        return self.buffer_layout.own_pieces(self.buffer_layout.model_specs[spec.param], pieces)

    def reserve(self, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> list[_Record]:
        if not spec.is_optimizer:
            return super().reserve(spec, slab, pieces)
        records = []
        for piece in self._bucket_pieces(spec, pieces):
            key, offset = self._place(spec, piece)
            index = self._file_index[RankCoord(pp=piece.rank.pp, tp=piece.rank.tp, ep=piece.rank.ep)]
            records.append(self._reserve_record(index, (offset,), (region_size(piece.region),), spec.dtype, key))
        return records

    def prepare(
        self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], reserved: Any = None, hashed: HashedParts | None = None
    ) -> list[_Record]:
        """Each piece flattened (row-major, as the rank's parameter is) into its record. The checksums of the copies
        the reader decodes (primary pieces) are vouched for as written, as the reader finds them in the buckets."""
        if not spec.is_optimizer:
            return super().prepare(spec, slab, data, pieces, reserved, hashed)
        for piece, record in zip(self._bucket_pieces(spec, pieces), reserved, strict=True):
            flat = data[to_slices(shift(piece.region, slab))].reshape(-1)  # a copy only of a strided (TP-split) piece
            saved = save_tensor(flat, At(self._files[record.index], record.storage.offset), self._scratch.scratch)
            if saved.size != record.storage.length:
                raise AssertionError(f"{spec.name}: archive of {saved.size} bytes where {record.storage.length} were planned")
            if piece.primary and piece.alias is None:
                values = saved.data.view(data.dtype).reshape([b - a for a, b in piece.region])
                self.vouch(spec, piece.region, record.storage.relative_path, record.storage.offset + saved.data_offset, values, hashed)
        return reserved

    def _tensor_entries(self) -> dict[str, TensorEntry]:
        """The model's tensors and the bucket tensors, once every rank's chunks are known (rank 0's `finish`): zeros fill
        each bucket's gaps (parameter alignment) first, in the first file, as its objects are written."""
        if 0 not in self._files:  # closed by `part`
            path = self.directory / self._name(0)
            self._open(0, path.stat().st_size if path.exists() else 0)
        entries = {k: v for k, v in super()._tensor_entries().items() if not k.startswith("optimizer.")}
        for prefix, size in self.buckets.items():
            for state in STATE_KEYS:
                key = f"{prefix}.{state}"
                at = 0
                for start, end in [*sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in self._chunks[key]), (size, size)]:
                    if start > at:
                        record = self._reserve_record(0, (at,), (start - at,), "float32", key)
                        save_tensor(np.zeros(start - at, np.float32), At(self._files[0], record.storage.offset))
                        self._add(key, record)
                    at = max(at, end)
                entries[key] = TensorEntry("float32", (size,), sorted(self._chunks[key], key=lambda c: c.offsets))
        return entries
