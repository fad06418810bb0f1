"""Megatron's DistributedOptimizer buffers, derived: where each parameter's state lies in them.

The DistributedOptimizer keeps each model-parallel rank's parameters in flat buffers, cut into buckets; its state
(fp32 master weights, and the optimizer's moments: Adam's two, Lion's one, `state.MOMENTS`) is saved in that layout by
the `dp_reshardable` form (`optim.dp_reshardable`: one tensor per bucket) and the legacy `distrib_optim.pt`
(`optim.distrib_optim_pt`: each buffer's buckets end to end).
`BufferLayout` derives the layout from the checkpoint's own model tensors and args, after megatron-core 0.16's
param_and_grad_buffer.py:

1. the rank's parameters in `named_parameters()` order (GPTModel with the local or the Transformer-Engine spec, its
   attention multi-head or multi-latent: `optim.order`), laid out in **reverse** order;
2. each parameter starts on a multiple of 64 elements, as its local (TP-sharded) tensor, row-major;
3. a bucket closes when it reaches `bucket_size` (only with `overlap_grad_reduce`, never on pipeline
   stages > 0); with tied embeddings and PP > 1 the embedding (first stage) and its output-layer copy (last
   stage) each get a bucket of their own, the bucket before ending after the parameter's 64-alignment;
   every bucket is padded to `lcm(dp, 128)` (`lcm(dp, 128, 2**16)` with
   `pad_buckets_for_high_nccl_busbw`); the saved tensor stops before that padding;
4. the derived bucket lengths must equal the saved ones, else the checkpoint is refused naming the bucket's last
   parameter (each form's reader checks its own record of them).

The state is read and written as Megatron's `fully_reshardable` form names it: `optimizer.state.<param|exp_avg|
exp_avg_sq>.<model key>` with the model tensor's global shape (`optimizer_specs`), so that everything downstream
(resharding, writing, checksums) treats every form alike. Each read touches only the spans of the parameter it
needs (streaming per parameter, never a whole bucket).

With virtual pipeline stages each model chunk is its own buffer (`gbuf_idx_<chunk>`, never bucketed past the
first chunk). An MoE model's state at EP > 1 is a chain of two optimizers (keys prefixed `chained_0.` dense,
`chained_1.` experts; see `BufferLayout`). Not yet decoded (refused by name): several parameter dtypes in one chunk, a
chain per model chunk (`overlap_param_gather_with_optimizer_step`), MoE stages without experts, Transformer-Engine's
fused-op MLP (`use_te_op_fuser`), FP8 parameters (`fp8_param_gather`), the legacy GroupedMLP, multi-latent attention's
fused q/kv down projection (`mla_down_proj_fusion`), and multi-latent attention with the Transformer-Engine spec at
TP > 1 (its down projections whole on every TP rank, where `sharding.pieces` splits them as the local spec does). The
Transformer-Engine order is derived from TE's and megatron-core's source (no TE-written save exists here to prove
it against): `master_weights` checks every decode against the saved weights.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any

import numpy as np

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.layout import Layout, RankCoord
from reshard.logical import TensorSpec, describe
from reshard.optim.order import MULTI_LATENT, ParamOrder, attention_of, parameter_of
from reshard.optim.state import state_keys
from reshard.sharding import Piece, Region, intersect, pieces, region_size, shift, to_slices

PREFIX = "optimizer.distributed."
PARAM_ALIGN = 64

# megatron-core's ChainedOptimizer of an MoE model: the dense optimizer, then the expert one
DENSE_CHAIN, EXPERT_CHAIN = 0, 1


def _chain_key(chain: int | None) -> int:
    return -1 if chain is None else chain


@dataclass(frozen=True)
class Gbuf:
    """One gradient buffer of one model-parallel rank's DistributedOptimizer: where its tensors are keyed."""

    chain: int | None  # the optimizer's index in Megatron's ChainedOptimizer (`chained_<i>.` prefix); None: unchained
    group: int  # dp_group_idx: the rank in the optimizer's model-parallel group (tp-pp, or etp-ep-pp for experts)
    index: int  # gbuf_idx: the optimizer's buffers over the model chunks that have parameters of its kind

    @property
    def prefix(self) -> str:
        return f"{'' if self.chain is None else f'chained_{self.chain}.'}{PREFIX}dp_group_idx_{self.group}"

    def __str__(self) -> str:
        return f"{self.prefix}.gbuf_idx_{self.index}"


@dataclass(frozen=True)
class Placed:
    """One parameter's local tensor in a rank's bucket."""

    name: str  # model tensor (canonical) name
    layer: int | None  # global layer of a stacked tensor
    pieces: tuple[Piece, ...]  # the rank's pieces of it (two for a gated fc1)
    bucket: int
    start: int  # in the bucket
    numel: int
    expert: int | None = None  # global expert of an expert tensor


def _row_major(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def _run(region: Region, strides: list[int]) -> tuple[int, int]:
    """First element and element count of the row-major range that holds `region`."""
    first = sum(a * s for (a, _), s in zip(region, strides))
    return first, sum((b - 1) * s for (_, b), s in zip(region, strides)) + 1 - first


def flat_span(piece: Piece) -> tuple[int, int] | None:
    """Where a piece lies in its rank's parameter flattened row-major, as the bucket holds it: (first element,
    count), or None where it is not one run (then it has no place of its own in a bucket)."""
    first, count = _run(piece.local_region, _row_major(piece.local_shape))
    return (first, count) if count == region_size(piece.local_region) else None


@dataclass(frozen=True)
class Buffer:
    """One derived gradient buffer: where its parameters lie and how long its buckets are (unpadded)."""

    places: tuple[Placed, ...]
    sizes: tuple[int, ...]  # each bucket's unpadded length
    last: tuple[str, ...]  # each bucket's last parameter, to name in a refusal

    def coalesced_start(self, place: Placed) -> int:
        """Where `place` starts in the buffer's buckets laid end to end without their padding (the legacy
        `distrib_optim.pt` form)."""
        return sum(self.sizes[: place.bucket]) + place.start


class BufferLayout:
    """Megatron's DistributedOptimizer buffers of every model-parallel rank, derived from the model's tensors,
    layout and the saving run's args (megatron-core 0.16: distributed_data_parallel.py, param_and_grad_buffer.py,
    optimizer/__init__.py).

    An MoE model's optimizer is megatron-core's ChainedOptimizer: the dense optimizer (keys prefixed
    `chained_0.`), then the expert one (`chained_1.`), where EP > 1 (at EP1 megatron-core marks no parameter
    expert-parallel: the experts lie in the dense buffer, after the router, one optimizer). The expert parameters lie in buffers of their own (one
    per model chunk that has experts), keyed by the rank in the expert tensor-, expert- and pipeline-parallel
    group (`etp + ETP * (ep + EP * pp)`), their buckets padded for the expert data-parallel size
    (`DP * TP / (ETP * EP)`); a rank without experts has an unchained dense optimizer."""

    def __init__(self, model_specs: dict[str, TensorSpec], config: ModelConfig, layout: Layout, args: dict[str, Any]):
        self.config, self.layout, self.args = config, layout, args
        self._refuse_unsupported(args)
        self.state_keys = state_keys(args)  # what each parameter's place holds in each state's buckets
        self.order = ParamOrder.of(args, attention_of(config), config)
        if self.order.transformer_engine and self.order.attention == MULTI_LATENT and layout.tp > 1:
            raise ReshardError(
                "DistributedOptimizer state of multi-latent attention with the Transformer-Engine spec at TP > 1 is not decoded "
                "yet: its linear_q_down_proj/linear_kv_down_proj are whole on every TP rank (convert with --no-optimizer)"
            )
        self.dp = int(args.get("data_parallel_size") or 0)
        if self.dp < 1:
            raise ReshardError("the checkpoint's args record no data_parallel_size: its DistributedOptimizer state cannot be decoded")
        expert_ranks = layout.expert_tp * layout.ep
        if (self.dp * layout.tp) % expert_ranks:
            raise ReshardError(
                f"DP {self.dp} x TP {layout.tp} does not divide into ETP {layout.expert_tp} x EP {layout.ep}: "
                "the checkpoint's args are inconsistent; its DistributedOptimizer state cannot be decoded"
            )
        self.expert_dp = self.dp * layout.tp // expert_ranks
        self.model_specs = {n: s for n, s in model_specs.items() if not s.is_optimizer and self.order.trains(n)}
        self.buffers: dict[Gbuf, Buffer] = {}
        # (name, layer, expert, tp, ep, pp) of a primary piece -> its buffer and place
        self.placed: dict[tuple[str, int | None, int | None, int, int, int], tuple[Gbuf, Placed]] = {}
        chains: set[int | None] = set()
        for pp in range(layout.pp):
            # megatron-core chains the optimizers only where the rank holds expert-parallel parameters
            chained = layout.ep > 1 and any(self._local_params(0, 0, pp, vstage, experts=True) for vstage in range(layout.vpp))
            for tp in range(layout.tp):
                dense = DENSE_CHAIN if chained else None
                self._place_rank(dense, tp + layout.tp * pp, tp, 0, pp, False, self.dp)
                chains.add(dense)
            for ep in range(layout.ep if chained else 0):
                for etp in range(layout.expert_tp):
                    group = etp + layout.expert_tp * (ep + layout.ep * pp)
                    self._place_rank(EXPERT_CHAIN, group, etp, ep, pp, True, self.expert_dp)
                    chains.add(EXPERT_CHAIN)
        if None in chains and len(chains) > 1:
            raise ReshardError(
                "DistributedOptimizer state of an MoE model with pipeline stages without experts (chained and "
                "unchained optimizers side by side) is not decoded yet (convert with --no-optimizer)"
            )
        self.chains: list[int | None] = sorted(chains, key=_chain_key)  # [None] (one optimizer) or [dense, experts]

    @staticmethod
    def _refuse_unsupported(args: dict[str, Any]) -> None:
        if args.get("use_distributed_optimizer") is False:
            raise ReshardError("the checkpoint holds DistributedOptimizer buckets but its args say use_distributed_optimizer=False")
        if args.get("overlap_param_gather_with_optimizer_step"):
            raise ReshardError(
                "DistributedOptimizer state saved with overlap_param_gather_with_optimizer_step (a chained optimizer "
                "per model chunk) is not decoded yet (convert with --no-optimizer)"
            )

    def _place_rank(self, chain: int | None, group: int, tp: int, ep: int, pp: int, experts: bool, dp: int) -> None:
        """Derive the buffers of one rank's dense (or expert) optimizer, one per model chunk with such parameters;
        Megatron-LM buckets only the first pipeline stage's first chunk."""
        chunks = [(vstage, params) for vstage in range(self.layout.vpp) if (params := self._local_params(tp, ep, pp, vstage, experts))]
        for index, (vstage, params) in enumerate(chunks):
            gbuf = Gbuf(chain, group, index)
            self.buffers[gbuf] = self._layout_of(params, dp, bucketed=pp == 0 and vstage == 0)
            for place in self.buffers[gbuf].places:
                self.placed[(place.name, place.layer, place.expert, tp, ep, pp)] = (gbuf, place)

    def rank_buffers(self, chain: int | None, group: int) -> list[Gbuf]:
        """One rank's optimizer's buffers, in gbuf_idx order."""
        return sorted((g for g in self.buffers if g.chain == chain and g.group == group), key=lambda g: g.index)

    def optimizers(self) -> list[tuple[int | None, int]]:
        """Every rank's optimizers as (chain, dp_group_idx): the dense (or only) ones first."""
        return sorted({(g.chain, g.group) for g in self.buffers}, key=lambda cg: (_chain_key(cg[0]), cg[1]))

    def holder(self, chain: int | None, group: int) -> RankCoord:
        """The rank whose legacy directory holds the `distrib_optim.pt` state of optimizer `chain` of dp_group_idx
        `group`: that optimizer's data-parallel rank 0, which writes it in megatron-core's `save_parameter_state`.
        megatron-core numbers a pipeline stage's ranks tp + TP * dp for the dense groups and etp + ETP * (ep + EP * edp)
        for the expert ones (its default order tp-cp-ep-dp-pp, CP 1), and Megatron-LM names a rank's directory by its
        TP and EP ranks: the dense optimizer of (tp, pp) is stage rank tp's, of EP rank (tp // ETP) % EP; the expert one
        of (etp, ep, pp) stage rank etp + ETP * ep's, of TP rank (etp + ETP * ep) % TP (ETP = TP: tp and ep themselves)."""
        etp_size, layout = self.layout.expert_tp, self.layout
        if chain == EXPERT_CHAIN:
            etp, ep, pp = group % etp_size, group // etp_size % layout.ep, group // (etp_size * layout.ep)
            return RankCoord(pp=pp, tp=(etp + etp_size * ep) % layout.tp, ep=ep)
        tp, pp = group % layout.tp, group // layout.tp
        return RankCoord(pp=pp, tp=tp, ep=tp // etp_size % layout.ep)

    def own_pieces(self, model: TensorSpec, candidates: list[Piece]) -> list[Piece]:
        """The pieces of `model` that have a place of their own in a buffer: a dense parameter's EP ranks are
        data-parallel replicas in one dense optimizer (its dp_group_idx has no EP), so only EP rank 0's copy; an
        expert parameter in the expert optimizer (EP > 1) is keyed by its expert TP rank, so the TP ranks past ETP
        (which hold the same parts again) have none."""
        if model.experts and self.layout.ep > 1:
            return [piece for piece in candidates if piece.rank.tp < self.layout.expert_tp]
        return [piece for piece in candidates if piece.rank.ep == 0]

    def _local_params(
        self, tp: int, ep: int, pp: int, vstage: int, experts: bool
    ) -> list[tuple[str, int | None, int | None, tuple[Piece, ...], bool]]:
        """The rank's dense (or expert) parameters in named_parameters() order: (name, global layer, global
        expert, its pieces, shared embedding). With tied embeddings and PP > 1 the last stage's output layer is
        its copy of the word embeddings (stored under the embedding's name; it and the first stage's embedding
        are `shared_embedding`)."""
        found: dict[tuple[str, int | None, int | None], list[Piece]] = {}
        order: dict[tuple[str, int | None, int | None], tuple[int, ...]] = {}
        for name, spec in self.model_specs.items():
            if spec.experts != experts and (experts or self.layout.ep > 1):  # at EP1 the dense buffer holds the experts
                continue
            for piece in pieces(spec, self.config, self.layout):
                if (piece.rank.tp, piece.rank.ep, piece.rank.pp, piece.rank.vstage) == (tp, ep, pp, vstage):
                    layer = piece.region[0][0] if spec.stacked else None
                    expert = piece.region[int(spec.stacked)][0] if spec.experts else None
                    found.setdefault((name, layer, expert), []).append(piece)
                    ordered_as = spec if piece.alias is None else replace(spec, param=piece.alias)
                    order[(name, layer, expert)] = self.order.key(ordered_as, layer, expert)
        shared = self.layout.pp > 1 and (self.config.tied_embeddings or bool(self.config.mtp_num_layers))
        return [
            (name, layer, expert, tuple(found[(name, layer, expert)]), shared and name == "embedding.word_embeddings.weight")
            for name, layer, expert in sorted(found, key=order.__getitem__)
        ]

    def _layout_of(self, params: list, dp: int, bucketed: bool) -> Buffer:
        """Megatron's bucket layout of one buffer (`params` from `_local_params`, its data-parallel size `dp`)."""
        bucket_size = None
        if self.args.get("overlap_grad_reduce") and bucketed:
            bucket_size = self.args.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * self.dp)
        placed: list[Placed] = []
        start = bucket_start = bucket = 0
        sizes: list[int] = []
        last_name: list[str] = []
        pending = None  # the last parameter of the bucket still open
        for tensors in reversed(_parameters(params)):
            name, layer, expert, _, shared = tensors[-1]
            start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
            if shared and pending is not None:  # the shared embedding gets a bucket of its own
                sizes.append(start - bucket_start)  # (the previous one ends after this parameter's alignment)
                last_name.append(pending)
                start = bucket_start = self.pad_bucket(start, dp)
                bucket += 1
            end = start
            for part, part_layer, part_expert, parts, _ in tensors:  # a parameter's parts lie in it in order
                numel = math.prod(parts[0].local_shape)
                placed.append(Placed(part, part_layer, parts, bucket, end - bucket_start, numel, part_expert))
                end += numel
            pending = name + "".join(f" ({what} {i})" for what, i in (("layer", layer), ("expert", expert)) if i is not None)
            if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
                sizes.append(end - bucket_start)
                last_name.append(pending)
                start = bucket_start = self.pad_bucket(end, dp)
                bucket += 1
                pending = None
            else:
                start = end
        if pending is not None:
            sizes.append(start - bucket_start)
            last_name.append(pending)
        return Buffer(tuple(placed), tuple(sizes), tuple(last_name))

    def pad_bucket(self, end: int, dp: int) -> int:
        """A bucket's padded end (`per_bucket_numel`), for a buffer of data-parallel size `dp`."""
        divisor = math.lcm(dp, 128, 2**16) if self.args.get("pad_buckets_for_high_nccl_busbw") else math.lcm(dp, 128)
        return -(-end // divisor) * divisor

    def place_of(self, model: TensorSpec, piece: Piece) -> tuple[Gbuf, Placed]:
        """The buffer and place of a piece of model tensor `model` (any TP replica or tied-embedding copy: each of
        those ranks keeps its own)."""
        layer = piece.region[0][0] if model.stacked else None
        expert = piece.region[int(model.stacked)][0] if model.experts else None
        return self.placed[(model.name, layer, expert, piece.rank.tp, piece.rank.ep, piece.rank.pp)]

    def optimizer_specs(self) -> dict[str, TensorSpec]:
        """The logical optimizer tensors, named as Megatron's fully_reshardable form names them:
        `optimizer.state.<param|exp_avg|exp_avg_sq>.<model key>` (the moments the run's optimizer keeps), with the
        model tensor's global shape."""
        return {
            f"optimizer.state.{k}.{name}": describe(f"optimizer.state.{k}.{name}", spec.shape, "float32", self.config)
            for name, spec in self.model_specs.items()
            for k in self.state_keys
        }

    def read_into(self, name: str, region: Region, out: np.ndarray, read_place: Callable[[Gbuf, Placed, str, int, np.ndarray], None]) -> None:
        """Fill `out` with `region` of the logical optimizer tensor `name`, each rank's part read by
        `read_place(buffer, place, state key, first element in the place, flat float32 out)`: only the run of
        the local tensor that holds the part (a unit of work cut across a piece would otherwise read the
        whole piece once per unit), straight into `out` where that run is the part and `out` holds it in order."""
        state, model_name = name.split(".", 3)[2:]
        model = self.model_specs[model_name]
        prefix = model.prefix_axes
        filled = 0
        for piece in pieces(model, self.config, self.layout):
            if not piece.primary or piece.alias is not None:
                continue
            inside = intersect(region, piece.region)
            if inside is None:
                continue
            gbuf, place = self.place_of(model, piece)
            local = tuple((lo + a - g0, lo + b - g0) for (a, b), (g0, _), (lo, _) in zip(inside[prefix:], piece.region[prefix:], piece.local_region))
            strides = _row_major(piece.local_shape)
            first, count = _run(local, strides)
            target = out[to_slices(shift(inside, region))]
            if count == target.size and target.flags.c_contiguous and target.dtype == np.float32:
                read_place(gbuf, place, state, first, target.reshape(-1))
            else:
                run = np.empty(count, dtype=np.float32)
                read_place(gbuf, place, state, first, run)
                sizes = [b - a for a, b in local]
                laid = np.lib.stride_tricks.as_strided(run, sizes, [s * run.itemsize for s in strides], writeable=False)
                target[...] = laid.reshape(target.shape)
            filled += region_size(inside)
        if filled != region_size(region):
            raise ReshardError(f"{name}: the DistributedOptimizer buffers do not cover the tensor; the checkpoint is damaged")


def _parameters(params: list) -> list[list]:
    """`BufferLayout._local_params`' tensors grouped by the megatron-core parameter they are or are parts of
    (`order.parameter_of`; a parameter's parts come one after the other in that order)."""
    return [list(group) for _, group in groupby(params, key=lambda tensor: (parameter_of(tensor[0]), *tensor[1:3]))]


def run_args(dp: int, layout: Layout) -> dict[str, Any]:
    """The args that make a target a DistributedOptimizer run at data-parallel size `dp` (what Megatron-LM records, and
    what `BufferLayout` pads buckets by)."""
    return {"data_parallel_size": dp, "world_size": dp * layout.tp * layout.pp, "use_distributed_optimizer": True}
