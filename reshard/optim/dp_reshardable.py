"""Megatron's DistributedOptimizer state in its `dp_reshardable` form: torch_dist's flat buckets, read and written.

megatron-core (>= 0.15) saves the distributed optimizer's state by default as its buckets, and loads them only at the
layout they were saved at (any DP): per model-parallel rank I, model chunk g and bucket b, three 1-D fp32 tensors
`optimizer.distributed.dp_group_idx_<I>.gbuf_idx_<g>.dtype_(<param>,
<grad>).bucket_idx_<b>.<param|exp_avg|exp_avg_sq>` of the bucket's unpadded length (two with --optimizer lion: no
exp_avg_sq; `state.MOMENTS`), and the rank's ShardedObjects `...dp_group_idx_<I>.{optimizer, per_bucket_numel,
per_bucket_numel_unpadded}`; common.pt's `optimizer` entry only names the form (megatron-core 0.16's
`DistributedOptimizer.sharded_state_dict(... 'dp_reshardable')`). An MoE model at EP > 1 has megatron-core's
ChainedOptimizer: all of that per optimizer, keys prefixed `chained_0.` (dense) and `chained_1.` (experts, keyed by
the expert rank, buckets padded for the expert data-parallel size), common.pt's entry one per optimizer; at EP1 the
experts are in the one dense optimizer's buffer. Where each parameter lies in its rank's bucket is
`buffers.BufferLayout`'s derivation, in both directions.

Read (`DpReshardable`, the torch_dist reader's optimizer state): each bucket checked against the derived layout (its
saved `per_bucket_numel_unpadded` and stored length, else refused naming the bucket's last parameter), each read
touching only the spans of the parameter it needs.

Written (`DpReshardableSink`, which the torch_dist writer composes) for the target layout and data-parallel size: the
buckets the target run's DistributedOptimizer will build, in the Transformer-Engine spec's order where the output has
its names, and in buckets of the size the source run's args record (a target run with another bucket size refuses the
load: megatron-core checks `per_bucket_numel_unpadded`). Each target piece of a logical optimizer tensor
(`optimizer.state.<state>.<param>`, any source form) is one chunk of its rank's bucket tensor, written as its slab
streams by: memory stays one parameter's state, never a bucket. Every TP replica of a replicated parameter (a norm)
and the last stage's copy of a tied embedding get their own chunk, as each of those ranks keeps its own state. The
64-element alignment gaps between parameters are chunks of zeros, so that each bucket tensor is covered whole, as
Megatron's save covers it.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.layout import Layout, RankCoord
from reshard.logical import TensorSpec
from reshard.optim.buffers import EXPERT_CHAIN, BufferLayout, Gbuf, Placed, flat_span
from reshard.optim.common import fully_reshardable_common, param_groups
from reshard.optim.sink import OptimizerSink, Placement
from reshard.optim.state import OptimizerState, StoredForm, check_states
from reshard.records import StoredRecord
from reshard.sharding import Piece, Region, pieces, region_size
from reshard.torchfile.dcp_metadata import Chunk, TensorEntry

_OBJECT = "/shard_0_1"  # the storage key of a ShardedObject of global shape (1,) at offset (0,)
_DISTRIBUTED = re.compile(r"^(?:chained_\d+\.)?optimizer\.distributed\.")
_BUCKET = re.compile(
    r"^(?:chained_(?P<chain>\d+)\.)?optimizer\.distributed\.dp_group_idx_(?P<group>\d+)\.gbuf_idx_(?P<gbuf>\d+)"
    r"\.dtype_(?P<dtype>\(.*\))\.bucket_idx_(?P<bucket>\d+)\.(?P<key>[A-Za-z0-9_]+)$"
)


def is_dp_reshardable(key: str) -> bool:
    """Whether a stored key is this form's (a bucket tensor or one of its ShardedObjects)."""
    return _DISTRIBUTED.match(key) is not None


class DpReshardable(OptimizerState):
    """The logical optimizer tensors of a dp_reshardable save, read through `read_raw(key, region, out)` (the
    torch_dist reader's chunk reading of the bucket tensors; `run_at(key, first, count)` says where a run of one lies:
    its file, byte offset and dtype, or None where it is not one run of one chunk), each bucket checked against the
    derived `BufferLayout`."""

    from_buffers = True

    def __init__(
        self,
        tensors: dict[str, Any],  # dcp TensorEntry of every optimizer.distributed.* tensor, by key
        objects: Callable[[str], Any],  # an optimizer.distributed.* ShardedObject's value by its key prefix
        model_specs: dict[str, TensorSpec],
        config: ModelConfig,
        layout: Layout,
        args: dict[str, Any],
        read_raw: Callable[[str, Region, np.ndarray], None],
        run_at: Callable[[str, int, int], tuple[str, int, str] | None],
    ):
        self.read_raw, self.run_at = read_raw, run_at
        # (gbuf, bucket) -> state key -> tensor key
        self.bucket_keys: dict[tuple[Gbuf, int], dict[str, str]] = {}
        self.bucket_numel: dict[tuple[Gbuf, int], set[int]] = {}  # the stored lengths of its state tensors
        dtypes: dict[Gbuf, set[str]] = {}
        for key, entry in tensors.items():
            m = _BUCKET.match(key)
            if m is None:
                raise ReshardError(f"{key}: not a DistributedOptimizer bucket tensor reshard knows; the checkpoint is foreign or damaged")
            gbuf = Gbuf(None if m["chain"] is None else int(m["chain"]), int(m["group"]), int(m["gbuf"]))
            dtypes.setdefault(gbuf, set()).add(m["dtype"])
            self.bucket_keys.setdefault((gbuf, int(m["bucket"])), {})[m["key"]] = key
            self.bucket_numel.setdefault((gbuf, int(m["bucket"])), set()).add(int(entry.size[0]))
        for gbuf, found in dtypes.items():
            if len(found) > 1 or gbuf.index >= layout.vpp:
                raise ReshardError(
                    f"{gbuf}: DistributedOptimizer buffers of several parameter dtypes "
                    f"({', '.join(sorted(found))}), or more than one per model chunk, are not decoded yet"
                )
        for (gbuf, bucket), keys in self.bucket_keys.items():
            check_states(args, set(keys), f"bucket {bucket} of {gbuf}")
        self.buffer_layout = BufferLayout(model_specs, config, layout, args)
        self.dp = self.buffer_layout.dp
        self.placed = self.buffer_layout.placed
        for chain, group in self.buffer_layout.optimizers():
            self._check_rank(chain, group, objects)
        stray = sorted({str(gbuf) for gbuf, _ in self.bucket_keys if gbuf not in self.buffer_layout.buffers})
        if stray:
            raise ReshardError(
                f"{stray[0]}: the checkpoint holds DistributedOptimizer buckets where the layout derived from the model "
                "has none; the optimizer state cannot be decoded safely"
            )
        self.specs = self.buffer_layout.optimizer_specs()
        firsts = [Gbuf(chain, 0, 0) for chain in self.buffer_layout.chains]
        self.param_groups = {gbuf.chain: objects(f"{gbuf.prefix}.optimizer") for gbuf in firsts}

    def _check_rank(self, chain: int | None, group: int, objects: Callable[[str], Any]) -> None:
        """One rank's derived buckets against its saved per_bucket_numel_unpadded and stored tensor lengths."""
        gbufs = self.buffer_layout.rank_buffers(chain, group)
        prefix = gbufs[0].prefix
        saved = objects(f"{prefix}.per_bucket_numel_unpadded")
        if not (isinstance(saved, list) and len(saved) == len(gbufs) and all(isinstance(b, dict) and len(b) == 1 for b in saved)):
            raise ReshardError(
                f"{prefix}: per_bucket_numel_unpadded is not one buffer of one dtype per model chunk ({len(gbufs)}) "
                "as derived from the model: not decoded yet"
            )
        for gbuf, by_dtype in zip(gbufs, saved):
            saved_sizes = list(next(iter(by_dtype.values())))
            buffer = self.buffer_layout.buffers[gbuf]
            for b, (derived, label) in enumerate(zip(buffer.sizes, buffer.last)):
                stored = saved_sizes[b] if b < len(saved_sizes) else None
                stored_lengths = self.bucket_numel.get((gbuf, b), set())
                tensor = ", ".join(map(str, sorted(stored_lengths))) or "no tensor"
                if stored != derived or stored_lengths != {derived}:
                    raise ReshardError(
                        f"{label}: the DistributedOptimizer layout derived from the model puts bucket {b} of {gbuf} "
                        f"at {derived} elements, but the checkpoint records {stored} (per_bucket_numel_unpadded) and stores "
                        f"{tensor}; the optimizer state cannot be decoded safely"
                    )
            if len(saved_sizes) != len(buffer.sizes):
                raise ReshardError(
                    f"{gbuf}: the checkpoint records {len(saved_sizes)} buckets where the layout derived from "
                    f"the model has {len(buffer.sizes)}; the optimizer state cannot be decoded safely"
                )

    def _read_place(self, gbuf: Gbuf, place: Placed, state: str, first: int, out: np.ndarray) -> None:
        start = place.start + first
        self.read_raw(self.bucket_keys[(gbuf, place.bucket)][state], ((start, start + out.size),), out)

    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        self.buffer_layout.read_into(name, region, out, self._read_place)

    def spans(self, name: str) -> Iterator[tuple[Region, str, int, int]]:
        """Where each primary piece of logical tensor `name` lies in the buckets, as one run: (its region, the
        bucket tensor's key, its first element there, its count); a piece that is not one run ends the list early
        (a verification then reads the tensor back instead)."""
        state, model_name = name.split(".", 3)[2:]
        model = self.buffer_layout.model_specs[model_name]
        for piece in pieces(model, self.buffer_layout.config, self.buffer_layout.layout):
            if not piece.primary or piece.alias is not None:
                continue
            gbuf, place = self.buffer_layout.place_of(model, piece)
            span = flat_span(piece)
            if span is None:
                return
            yield piece.region, self.bucket_keys[(gbuf, place.bucket)][state], place.start + span[0], span[1]

    def stored_records(self, name: str) -> list[StoredRecord] | None:
        """Each piece's run in the bucket chunk that holds it whole; None where a run is split over chunks or a piece
        is not one run."""
        spans = list(self.spans(name))
        if sum(region_size(region) for region, *_ in spans) != self.specs[name].numel:
            return None
        records = []
        for region, key, start, n in spans:
            found = self.run_at(key, start, n)
            if found is None:
                return None
            file, offset, dtype = found
            records.append(StoredRecord(name, region, dtype, file, offset))
        return records

    @property
    def form(self) -> StoredForm:
        return StoredForm("dp_reshardable", self.dp, len(self.bucket_keys), len({(gbuf.chain, gbuf.group) for gbuf, _ in self.bucket_keys}))

    @property
    def described(self) -> str:
        return f"dp_reshardable buckets (DP {self.dp})"

    def common(self, extra: dict[str, Any]) -> dict[str, Any]:
        return dict(extra, optimizer=fully_reshardable_common(self.param_groups))


class DpReshardableSink(OptimizerSink):
    """Where the torch_dist writer puts the optimizer tensors' pieces: chunks of the target ranks'
    DistributedOptimizer bucket tensors, with the ShardedObjects and common state that describe them."""

    written_as = "as dp_reshardable"

    def __init__(
        self, specs: dict[str, TensorSpec], config: ModelConfig, layout: Layout, args: dict[str, Any], objects: Mapping[str, Any],
        extra: dict[str, Any], dp: int,
    ):
        super().__init__(specs, config, layout, args, objects, extra, dp)
        self._dtypes = f"(torch.{config.params_dtype}, torch.{self.grad_dtype})"  # as bucket tensor keys spell them
        # one optimizer's buffers per rank and model chunk; an MoE model at EP > 1 chains a dense and an expert one
        groups = param_groups(extra.get("optimizer"), None not in self.buffer_layout.chains)
        self.buckets: dict[str, int] = {}  # bucket tensor key prefix -> unpadded length
        objects = dict(objects)
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
        self.objects = objects
        self.extra = {**extra, "optimizer": form if None in groups else {chain: dict(form) for chain in groups}}

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
            for state in self.buffer_layout.state_keys:
                key = f"{prefix}.{state}"
                at = 0
                for start, end in [*sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks[key]), (size, size)]:
                    if start > at:
                        zeros(key, at, start - at)
                    at = max(at, end)
                entries[key] = TensorEntry("float32", (size,), sorted(chunks[key], key=lambda c: c.offsets))
        return entries
