"""Megatron's DistributedOptimizer state in its `dp_reshardable` form, read as logical per-parameter tensors.

megatron-core ≥ 0.15 saves the distributed optimizer's state (by default) as its flat buckets: per
model-parallel rank I, gradient buffer g, dtype pair and bucket b, one 1-D tensor
`optimizer.distributed.dp_group_idx_<I>.gbuf_idx_<g>.dtype_(<p>, <g>).bucket_idx_<b>.<param|exp_avg|exp_avg_sq>`
of the bucket's unpadded length. This module derives where each parameter lies in those buckets
from the checkpoint's own model tensors and args (megatron-core 0.16's param_and_grad_buffer.py):

1. the rank's parameters in `named_parameters()` order (GPTModel with the local spec), laid out in
   **reverse** order;
2. each parameter starts on a multiple of 64 elements, as its local (TP-sharded) tensor, row-major;
3. a bucket closes when it reaches `bucket_size` (only with `overlap_grad_reduce`, never on pipeline
   stages > 0); with tied embeddings and PP > 1 the embedding (first stage) and its output-layer copy (last
   stage) each get a bucket of their own, the bucket before ending after the parameter's 64-alignment;
   every bucket is padded to `lcm(dp, 128)` (`lcm(dp, 128, 2**16)` with
   `pad_buckets_for_high_nccl_busbw`); the saved tensor stops before that padding;
4. the derived bucket lengths must equal the saved `per_bucket_numel_unpadded`, else the checkpoint is
   refused naming the bucket's last parameter.

It names the result as Megatron's `fully_reshardable` form does: `optimizer.state.<param|exp_avg|
exp_avg_sq>.<model key>` with the model tensor's global shape, so that everything downstream
(resharding, writing, checksums) treats both forms alike. Each read touches only the spans of the
parameter it needs (streaming per parameter, never a whole bucket).

With virtual pipeline stages each model chunk is its own buffer (`gbuf_idx_<chunk>`, never bucketed past the
first chunk). Not yet decoded (refused by name): expert (MoE) optimizers and chained prefixes, several
parameter dtypes in one chunk, Transformer-Engine module
order (`transformer_impl=transformer_engine`: not yet verified against megatron-core).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.layout import Layout
from reshard.logical import TensorSpec, describe
from reshard.sharding import Piece, Region, intersect, pieces, region_size, shift, to_slices

PREFIX = "optimizer.distributed."
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
PARAM_ALIGN = 64
_BUCKET = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(?P<group>\d+)\.gbuf_idx_(?P<gbuf>\d+)\.dtype_(?P<dtype>\(.*\))"
    r"\.bucket_idx_(?P<bucket>\d+)\.(?P<key>[A-Za-z0-9_]+)$"
)
_OBJECT = re.compile(r"^optimizer\.distributed\.dp_group_idx_(?P<group>\d+)\.(?P<what>[A-Za-z_]+)/")

# A transformer layer's parameters in megatron-core's module order (local spec: input_layernorm,
# self_attention.{linear_proj, linear_qkv, q_layernorm, k_layernorm}, pre_mlp_layernorm, mlp.{fc1, fc2}),
# by their checkpoint (canonical) names.
_LAYER_ORDER = (
    "self_attention.linear_qkv.layer_norm_weight",  # input_layernorm.weight
    "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight",
    "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight",
    "self_attention.k_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight",  # pre_mlp_layernorm.weight
    "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
)
_TOP_ORDER = (
    "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight",
    None,  # the decoder's layers
    "decoder.final_layernorm.weight",
    "decoder.final_layernorm.bias",
    "output_layer.weight",
)


def is_dp_reshardable(key: str) -> bool:
    return key.startswith(PREFIX)


@dataclass(frozen=True)
class Placed:
    """One parameter's local tensor in a rank's bucket."""

    name: str  # model tensor (canonical) name
    layer: int | None  # global layer of a stacked tensor
    pieces: tuple[Piece, ...]  # the rank's pieces of it (two for a gated fc1)
    bucket: int
    start: int  # in the bucket
    numel: int


def _order_key(spec: TensorSpec, layer: int | None) -> tuple[int, int, int]:
    param = spec.param
    if param.startswith("decoder.layers."):
        tail = re.sub(r"^decoder\.layers\.(\d+\.)?", "", param)
        if tail not in _LAYER_ORDER:
            raise ReshardError(
                f"{param}: where megatron-core places this parameter in the DistributedOptimizer's buffer is not "
                "known to reshard; its dp_reshardable optimizer state cannot be decoded (convert with --no-optimizer)"
            )
        return (_TOP_ORDER.index(None), layer if layer is not None else spec.layer, _LAYER_ORDER.index(tail))
    if param not in _TOP_ORDER:
        raise ReshardError(
            f"{param}: where megatron-core places this parameter in the DistributedOptimizer's buffer is not "
            "known to reshard; its dp_reshardable optimizer state cannot be decoded (convert with --no-optimizer)"
        )
    return (_TOP_ORDER.index(param), 0, 0)


class BucketLayout:
    """Where megatron-core's DistributedOptimizer places each parameter of each model-parallel rank in its
    buckets, derived from the model alone (steps 1-3 above): what the reader checks a save against and the
    dp_reshardable writer (`dp_reshardable_writer.py`) writes to."""

    def __init__(self, model_specs: dict[str, TensorSpec], config: ModelConfig, layout: Layout, dp: int):
        self.model_specs = {n: s for n, s in model_specs.items() if not s.is_optimizer}
        self.config, self.layout, self.dp = config, layout, dp

    @staticmethod
    def group(tp: int, pp: int, layout: Layout) -> int:
        """The rank's `dp_group_idx`: its rank in the model-parallel group (order tp-..-pp)."""
        return tp + layout.tp * pp

    @staticmethod
    def flat_span(piece: Piece) -> tuple[int, int] | None:
        """Where a piece lies in its rank's parameter flattened row-major, as the bucket holds it: (first element,
        count), or None where it is not one run (then it has no place of its own in a bucket)."""
        strides = [math.prod(piece.local_shape[i + 1 :]) for i in range(len(piece.local_shape))]
        first = sum(a * s for (a, _), s in zip(piece.local_region, strides))
        last = sum((b - 1) * s for (_, b), s in zip(piece.local_region, strides))
        n = region_size(piece.local_region)
        return (first, n) if last - first + 1 == n else None

    def _local_params(self, tp: int, pp: int, vstage: int) -> list[tuple[str, int | None, tuple[Piece, ...], bool]]:
        """The rank's parameters in named_parameters() order: (name, global layer, its pieces, shared embedding).
        With tied embeddings and PP > 1 the last stage's output layer is its copy of the word embeddings
        (stored under the embedding's name; it and the first stage's embedding are `shared_embedding`)."""
        found: dict[tuple[str, int | None], list[Piece]] = {}
        order: dict[tuple[str, int | None], tuple[int, int, int]] = {}
        for name, spec in self.model_specs.items():
            for piece in pieces(spec, self.config, self.layout):
                if piece.rank.tp == tp and piece.rank.pp == pp and piece.rank.vstage == vstage:
                    layer = piece.region[0][0] if spec.stacked else None
                    found.setdefault((name, layer), []).append(piece)
                    ordered_as = spec if piece.alias is None else replace(spec, param=piece.alias)
                    order[(name, layer)] = _order_key(ordered_as, layer)
        shared = self.layout.pp > 1 and not self.config.untie_embeddings_and_output_weights
        return [
            (name, layer, tuple(found[(name, layer)]), shared and name == "embedding.word_embeddings.weight")
            for name, layer in sorted(found, key=order.__getitem__)
        ]

    def derive(self, tp: int, pp: int, gbuf: int, args: dict[str, Any]) -> tuple[list[Placed], list[int], list[str]]:
        """Megatron's bucket layout of one model-parallel rank's model chunk `gbuf`: its parameters' places, each
        bucket's unpadded length and last parameter (to name in a refusal)."""
        bucket_size = None
        if args.get("overlap_grad_reduce") and pp == 0 and gbuf == 0:  # Megatron-LM disables bucketing on later chunks
            bucket_size = args.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * self.dp)
        placed: list[Placed] = []
        start = bucket_start = bucket = 0
        sizes: list[int] = []
        last_name: list[str] = []  # each bucket's last parameter, to name in a refusal
        pending = None  # the last parameter of the bucket still open
        for name, layer, parts, shared in reversed(self._local_params(tp, pp, gbuf)):
            numel = math.prod(parts[0].local_shape)
            start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
            if shared and pending is not None:  # the shared embedding gets a bucket of its own
                sizes.append(start - bucket_start)  # (the previous one ends after this parameter's alignment)
                last_name.append(pending)
                start = bucket_start = self.pad_bucket(start, args)
                bucket += 1
            placed.append(Placed(name, layer, parts, bucket, start - bucket_start, numel))
            end = start + numel
            pending = name if layer is None else f"{name} (layer {layer})"
            if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
                sizes.append(end - bucket_start)
                last_name.append(pending)
                start = bucket_start = self.pad_bucket(end, args)
                bucket += 1
                pending = None
            else:
                start = end
        if pending is not None:
            sizes.append(start - bucket_start)
            last_name.append(pending)
        return placed, sizes, last_name

    def pad_bucket(self, end: int, args: dict[str, Any]) -> int:
        divisor = math.lcm(self.dp, 128, 2**16) if args.get("pad_buckets_for_high_nccl_busbw") else math.lcm(self.dp, 128)
        return -(-end // divisor) * divisor


class DpReshardable(BucketLayout):
    """The logical optimizer tensors of a dp_reshardable save, read through `read_raw(key, region, out)`
    (the torch_dist reader's chunk reading of the bucket tensors)."""

    def __init__(
        self,
        tensors: dict[str, Any],  # dcp TensorEntry of every optimizer.distributed.* tensor, by key
        objects: Callable[[str], Any],  # an optimizer.distributed.* ShardedObject's value by its key prefix
        object_keys: list[str],
        model_specs: dict[str, TensorSpec],
        config: ModelConfig,
        layout: Layout,
        args: dict[str, Any],
        read_raw: Callable[[str, Region, np.ndarray], None],
    ):
        self.read_raw = read_raw
        self._refuse_unsupported(tensors, object_keys, config, layout, args)
        dp = int(args.get("data_parallel_size") or 0)
        if dp < 1:
            raise ReshardError("the checkpoint's args record no data_parallel_size: its dp_reshardable optimizer state cannot be decoded")
        super().__init__(model_specs, config, layout, dp)
        # (group, gbuf, bucket) -> state key -> tensor key; gbuf: the model chunk's buffer (one dtype each)
        self.bucket_keys: dict[tuple[int, int, int], dict[str, str]] = {}
        self.bucket_numel: dict[tuple[int, int, int], set[int]] = {}  # the stored lengths of its state tensors
        dtypes: dict[tuple[int, int], set[str]] = {}
        for key, entry in tensors.items():
            m = _BUCKET.match(key)
            if m is None:
                raise ReshardError(f"{key}: not a DistributedOptimizer bucket tensor reshard knows; the checkpoint is foreign or damaged")
            dtypes.setdefault((int(m["group"]), int(m["gbuf"])), set()).add(m["dtype"])
            where = (int(m["group"]), int(m["gbuf"]), int(m["bucket"]))
            self.bucket_keys.setdefault(where, {})[m["key"]] = key
            self.bucket_numel.setdefault(where, set()).add(int(entry.size[0]))
        for (group, gbuf), found in dtypes.items():
            if len(found) > 1 or gbuf >= layout.vpp:
                raise ReshardError(
                    f"dp_group_idx_{group} gbuf_idx_{gbuf}: DistributedOptimizer buffers of several parameter dtypes "
                    f"({', '.join(sorted(found))}), or more than one per model chunk, are not decoded yet"
                )
        for (group, gbuf, bucket), keys in self.bucket_keys.items():
            missing = [k for k in STATE_KEYS if k not in keys]
            if missing:
                raise ReshardError(
                    f"bucket {bucket} of dp_group_idx_{group} gbuf_idx_{gbuf} lacks {', '.join(missing)}: the checkpoint is damaged"
                )
        # (name, layer, tp, pp) -> (group, gbuf, place)
        self.placed: dict[tuple[str, int | None, int, int], tuple[int, int, Placed]] = {}
        for pp in range(layout.pp):
            for tp in range(layout.tp):
                group = self.group(tp, pp, layout)
                saved = objects(f"{PREFIX}dp_group_idx_{group}.per_bucket_numel_unpadded")
                if not (isinstance(saved, list) and len(saved) == layout.vpp
                        and all(isinstance(b, dict) and len(b) == 1 for b in saved)):
                    raise ReshardError(
                        f"dp_group_idx_{group}: per_bucket_numel_unpadded is not one buffer of one dtype per model chunk "
                        f"({layout.vpp}): not decoded yet"
                    )
                for vstage in range(layout.vpp):
                    sizes = list(next(iter(saved[vstage].values())))
                    for place in self._layout_of(group, vstage, tp, pp, args, sizes):
                        self.placed[(place.name, place.layer, tp, pp)] = (group, vstage, place)
        self.specs: dict[str, TensorSpec] = {}
        for name, spec in self.model_specs.items():
            for k in STATE_KEYS:
                opt = f"optimizer.state.{k}.{name}"
                self.specs[opt] = describe(opt, spec.shape, "float32", config)
        self.param_groups = objects(f"{PREFIX}dp_group_idx_0.optimizer")

    @staticmethod
    def _refuse_unsupported(tensors, object_keys, config, layout, args) -> None:
        if any(k.startswith("chained_") for k in list(tensors) + object_keys) or config.is_moe:
            raise ReshardError("dp_reshardable optimizer state of a MoE model (chained expert optimizer) is not decoded yet")
        if args.get("transformer_impl", "transformer_engine") != "local":
            raise ReshardError(
                "dp_reshardable optimizer state of a Transformer-Engine model: its buffer order is not yet verified "
                "against megatron-core, so reshard refuses to decode it (convert with --no-optimizer)"
            )
        if args.get("use_distributed_optimizer") is False:
            raise ReshardError("the checkpoint holds DistributedOptimizer buckets but its args say use_distributed_optimizer=False")

    def _layout_of(self, group: int, gbuf: int, tp: int, pp: int, args: dict[str, Any], saved_sizes: list[int]) -> list[Placed]:
        """Megatron's bucket layout of one model-parallel rank's model chunk `gbuf`, checked against its saved
        bucket sizes."""
        placed, sizes, last_name = self.derive(tp, pp, gbuf, args)
        where = f" gbuf_idx_{gbuf}" if gbuf else ""
        for b, (derived, label) in enumerate(zip(sizes, last_name)):
            stored = saved_sizes[b] if b < len(saved_sizes) else None
            stored_lengths = self.bucket_numel.get((group, gbuf, b), set())
            tensor = ", ".join(map(str, sorted(stored_lengths))) or "no tensor"
            if stored != derived or stored_lengths != {derived}:
                raise ReshardError(
                    f"{label}: the DistributedOptimizer layout derived from the model puts bucket {b} of dp_group_idx_{group}{where} "
                    f"at {derived} elements, but the checkpoint records {stored} (per_bucket_numel_unpadded) and stores "
                    f"{tensor}; the optimizer state cannot be decoded safely"
                )
        if len(saved_sizes) != len(sizes):
            raise ReshardError(
                f"dp_group_idx_{group}{where}: the checkpoint records {len(saved_sizes)} buckets where the layout derived from "
                f"the model has {len(sizes)}; the optimizer state cannot be decoded safely"
            )
        return placed

    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        spec = self.specs[name]
        state = name.split(".")[2]
        model = self.model_specs[spec.param]
        filled = 0
        for piece in pieces(model, self.config, self.layout):
            if not piece.primary or piece.alias is not None:
                continue
            inside = intersect(region, piece.region)
            if inside is None:
                continue
            layer = piece.region[0][0] if model.stacked else None
            group, gbuf, place = self.placed[(model.name, layer, piece.rank.tp, piece.rank.pp)]
            local = np.empty(place.numel, dtype=np.float32)
            key = self.bucket_keys[(group, gbuf, place.bucket)][state]
            self.read_raw(key, ((place.start, place.start + place.numel),), local)
            local = local.reshape(piece.local_shape)
            prefix = model.prefix_axes
            slices = tuple(
                slice(lo + a - g0, lo + b - g0)
                for (a, b), (g0, _), (lo, _) in zip(inside[prefix:], piece.region[prefix:], piece.local_region)
            )
            target = out[to_slices(shift(inside, region))]
            target[...] = local[slices].reshape(target.shape)
            filled += region_size(inside)
        if filled != region_size(region):
            raise ReshardError(f"{name}: the DistributedOptimizer buckets do not cover the tensor; the checkpoint is damaged")

    def spans(self, name: str) -> Iterator[tuple[Region, str, int, int]]:
        """Where each primary piece of logical tensor `name` lies in the buckets, as one run: (its region, the
        bucket tensor's key, its first element there, its count); a piece that is not one run ends the list early
        (a verification then reads the tensor back instead)."""
        spec = self.specs[name]
        model = self.model_specs[spec.param]
        for piece in pieces(model, self.config, self.layout):
            if not piece.primary or piece.alias is not None:
                continue
            layer = piece.region[0][0] if model.stacked else None
            group, gbuf, place = self.placed[(model.name, layer, piece.rank.tp, piece.rank.pp)]
            span = self.flat_span(piece)
            if span is None:
                return
            yield piece.region, self.bucket_keys[(group, gbuf, place.bucket)][name.split(".")[2]], place.start + span[0], span[1]

    def common_optimizer(self) -> dict[str, Any]:
        """common.pt's `optimizer` entry as Megatron's fully_reshardable save writes it."""
        return {"optimizer": self.param_groups, "param_state_sharding_type": "fully_reshardable"}
