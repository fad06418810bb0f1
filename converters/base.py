"""Declarative HuggingFace <-> Megatron-Core mappings (in the spirit of Megatron-Bridge's param_mapping.py).

A `Mapping` ties one canonical logical tensor (`reshard.logical`, decoder layers stacked) to the one
or more HF tensors it is made of, for ONE slab: one layer (and one expert) at a time. HF names are
templates with `{layer}` and `{expert}`. Its `to_megatron`/`to_hf` are pure functions on numpy
arrays, returning views where they can (callers copy or stage what they write). `to_hf` also works
on a broadcast array that holds no values, which is how the HF writer learns every output shape
before any data arrives.

A `Family` holds the HF architecture names, the mapping table for a config, and the HF config.json
<-> `ModelConfig` functions. Anything in an HF config we do not map is refused with a one-line,
actionable `ReshardError`: a conversion that silently drops a feature produces a model that loads
and is wrong.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from reshard import fp8_blocks, int4_pack, mxfp4
from reshard.config import LayerKind, ModelConfig, pad_vocab
from reshard.errors import ReshardError
from reshard.logical import PRECISIONS

Tensor = np.ndarray

# --------------------------------------------------------------------------------------------------
# Pure transforms
# --------------------------------------------------------------------------------------------------


def group_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int, groups: int, head_dim: int) -> Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> Megatron's linear_qkv rows, grouped per KV group:
    [q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]."""
    if heads % groups:
        raise ReshardError(f"{heads} attention heads are not a multiple of {groups} KV groups")
    rest = tuple(q.shape[1:])
    per = heads // groups
    _expect(q, heads * head_dim, "q")
    _expect(k, groups * head_dim, "k")
    _expect(v, groups * head_dim, "v")
    qg = q.reshape(groups, per * head_dim, *rest)
    kg = k.reshape(groups, head_dim, *rest)
    vg = v.reshape(groups, head_dim, *rest)
    return np.concatenate([qg, kg, vg], axis=1).reshape((heads + 2 * groups) * head_dim, *rest)


def split_qkv(qkv: Tensor, heads: int, groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `group_qkv`."""
    per = heads // groups
    _expect(qkv, (heads + 2 * groups) * head_dim, "linear_qkv")
    rest = tuple(qkv.shape[1:])
    x = qkv.reshape(groups, (per + 2) * head_dim, *rest)
    q = x[:, : per * head_dim].reshape(heads * head_dim, *rest)
    k = x[:, per * head_dim : (per + 1) * head_dim].reshape(groups * head_dim, *rest)
    v = x[:, (per + 1) * head_dim :].reshape(groups * head_dim, *rest)
    return q, k, v


def fuse_gated(gate: Tensor, up: Tensor) -> Tensor:
    """HF gate_proj, up_proj -> Megatron linear_fc1 = [all gate rows; all up rows] (the global, layout-free form)."""
    if gate.shape != up.shape:
        raise ReshardError(f"gate and up projections differ in shape: {tuple(gate.shape)} vs {tuple(up.shape)}")
    return np.concatenate([gate, up], axis=0)


def split_gated(fc1: Tensor) -> tuple[Tensor, Tensor]:
    if fc1.shape[0] % 2:
        raise ReshardError(f"gated linear_fc1 has an odd number of rows ({fc1.shape[0]})")
    gate, up = np.split(fc1, 2, axis=0)
    return gate, up


def conv1d_to_linear(t: Tensor) -> Tensor:
    """GPT-2's Conv1D stores [in, out]; a Linear (and Megatron) stores [out, in]. Biases pass through."""
    return t.T if t.ndim == 2 else t


linear_to_conv1d = conv1d_to_linear  # a transpose is its own inverse


def at_index(name: str, index: str) -> str:
    """The HF address of one slice of tensor `name` along its leading axis, e.g. an expert of experts fused into one
    [E, ...] tensor (`at_index(f"{p}experts.down_proj", E)`): the HF format reads and writes that slice alone."""
    return f"{name}[{index}]"


def _expect(t: Tensor, rows: int, what: str) -> None:
    if t.shape[0] != rows:
        raise ReshardError(f"{what} has {t.shape[0]} rows, the config implies {rows}: config.json does not match the weights")


# --------------------------------------------------------------------------------------------------
# Mappings
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mapping:
    """One canonical tensor <-> HF tensors, per slab. Subclasses define the two transforms."""

    megatron: str
    hf: tuple[str, ...]
    # The slab is its HF tensors stacked along the first axis, values as they are: each HF tensor's bytes
    # are one run of the slab's, so a writer can vouch for them and a reader find them (`stored_records`).
    stacks_rows: ClassVar[bool] = False

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> list[str]:
        """The HF tensors of one slab: names, or a fused tensor's slice (`at_index`)."""
        return [t.format(layer=layer, expert=expert) for t in self.hf]

    def to_megatron(self, tensors: Sequence[Tensor], config: ModelConfig) -> Tensor:
        raise NotImplementedError

    def to_hf(self, tensor: Tensor, config: ModelConfig) -> list[Tensor]:
        raise NotImplementedError

    def hf_shapes(self, slab_shape: Sequence[int], config: ModelConfig) -> list[tuple[int, ...]]:
        """HF shapes for a canonical slab of `slab_shape`, computed on an array of that shape whose every
        element is one byte (strides of 0): reshapes and slices of it allocate nothing."""
        return [tuple(t.shape) for t in self.to_hf(np.broadcast_to(np.zeros((), np.uint8), tuple(slab_shape)), config)]


@dataclass(frozen=True)
class Rename(Mapping):
    """Same values under another name."""

    stacks_rows: ClassVar[bool] = True

    def __init__(self, megatron: str, hf: str):
        object.__setattr__(self, "megatron", megatron)
        object.__setattr__(self, "hf", (hf,))

    def to_megatron(self, tensors, config):
        return tensors[0]

    def to_hf(self, tensor, config):
        return [tensor]


@dataclass(frozen=True)
class Transposed(Mapping):
    """GPT-2 Conv1D weight ([in, out]) <-> Megatron linear weight ([out, in])."""

    def __init__(self, megatron: str, hf: str):
        object.__setattr__(self, "megatron", megatron)
        object.__setattr__(self, "hf", (hf,))

    def to_megatron(self, tensors, config):
        return conv1d_to_linear(tensors[0])

    def to_hf(self, tensor, config):
        return [linear_to_conv1d(tensor)]


@dataclass(frozen=True)
class QKV(Mapping):
    """Separate q_proj, k_proj, v_proj (weights or biases) <-> grouped linear_qkv."""

    def __init__(self, megatron: str, q: str, k: str, v: str):
        object.__setattr__(self, "megatron", megatron)
        object.__setattr__(self, "hf", (q, k, v))

    def to_megatron(self, tensors, config):
        q, k, v = tensors
        return group_qkv(q, k, v, config.num_attention_heads, config.groups, config.head_dim)

    def to_hf(self, tensor, config):
        return list(split_qkv(tensor, config.num_attention_heads, config.groups, config.head_dim))


@dataclass(frozen=True)
class FusedQKV(Mapping):
    """One HF tensor holding [all q; all k; all v] (GPT-2 c_attn, a Conv1D when `conv1d`) <-> grouped linear_qkv.
    `heads` of `head_dim` (multi-head: one group per head) for a tower's attention, the language model's otherwise."""

    conv1d: bool = True
    heads: tuple[int, int] | None = None  # (heads, head_dim)

    def __init__(self, megatron: str, hf: str, conv1d: bool = True, heads: tuple[int, int] | None = None):
        object.__setattr__(self, "megatron", megatron)
        object.__setattr__(self, "hf", (hf,))
        object.__setattr__(self, "conv1d", conv1d)
        object.__setattr__(self, "heads", heads)

    def _sizes(self, config: ModelConfig) -> tuple[int, int, int]:
        if self.heads is not None:
            return self.heads[0], self.heads[0], self.heads[1]
        return config.num_attention_heads, config.groups, config.head_dim

    def to_megatron(self, tensors, config):
        t = conv1d_to_linear(tensors[0]) if self.conv1d else tensors[0]
        heads, groups, head_dim = self._sizes(config)
        q_rows, kv_rows = heads * head_dim, groups * head_dim
        _expect(t, q_rows + 2 * kv_rows, "fused qkv")
        q, k, v = np.split(t, [q_rows, q_rows + kv_rows], axis=0)
        return group_qkv(q, k, v, heads, groups, head_dim)

    def to_hf(self, tensor, config):
        fused = np.concatenate(split_qkv(tensor, *self._sizes(config)), axis=0)
        return [linear_to_conv1d(fused) if self.conv1d else fused]


@dataclass(frozen=True)
class GatedMLP(Mapping):
    """HF gate_proj + up_proj (Mixtral: w1 + w3) <-> linear_fc1 [gate; up]."""

    stacks_rows: ClassVar[bool] = True

    def __init__(self, megatron: str, gate: str, up: str):
        object.__setattr__(self, "megatron", megatron)
        object.__setattr__(self, "hf", (gate, up))

    def to_megatron(self, tensors, config):
        return fuse_gated(*tensors)

    def to_hf(self, tensor, config):
        return list(split_gated(tensor))


# --------------------------------------------------------------------------------------------------
# HF config helpers
# --------------------------------------------------------------------------------------------------

# Megatron-Core's llama3 RoPE scaling has these fixed (RotaryEmbedding._apply_scaling defaults).
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# Which config.json fields size each axis of an HF tensor (rows, then columns; a vector's one axis), for the refusal
# of a config that contradicts the weights; first match wins. Families name alike where they share a module.
_HF_AXIS_FIELDS = tuple((re.compile(pattern), fields) for pattern, fields in (
    # a vision tower's (Qwen2.5-VL's `visual.*`), sized by vision_config
    (r"visual\..*\.(gate|up)_proj\.", ("vision_config.intermediate_size", "vision_config.hidden_size")),
    (r"visual\..*\.down_proj\.", ("vision_config.hidden_size", "vision_config.intermediate_size")),
    (r"visual\.merger\.mlp\.2\.", ("vision_config.out_hidden_size", "vision_config.hidden_size, spatial_merge_size")),
    (r"visual\.merger\.mlp\.0\.", ("vision_config.hidden_size, spatial_merge_size",)),
    (r"visual\.patch_embed\.", ("vision_config.hidden_size", "vision_config.in_channels", "vision_config.temporal_patch_size",
                                "vision_config.patch_size")),
    (r"visual\.", ("vision_config.hidden_size",)),
    (r"\.q_proj\.", ("num_attention_heads, head_dim", "hidden_size")),
    (r"\.[kv]_proj\.", ("num_key_value_heads, head_dim", "hidden_size")),
    (r"\.o_proj\.", ("hidden_size", "num_attention_heads, head_dim")),
    (r"\.q_a_proj\.", ("q_lora_rank", "hidden_size")),
    (r"\.q_b_proj\.", ("num_attention_heads, qk_nope_head_dim, qk_rope_head_dim", "q_lora_rank")),
    (r"\.kv_a_proj_with_mqa\.", ("kv_lora_rank, qk_rope_head_dim", "hidden_size")),
    (r"\.kv_b_proj\.", ("num_attention_heads, qk_nope_head_dim, v_head_dim", "kv_lora_rank")),
    (r"\.shared_experts?\.(gate|up)_proj\.", ("shared_expert_intermediate_size (or moe_intermediate_size x n_shared_experts)", "hidden_size")),
    (r"\.shared_experts?\.down_proj\.", ("hidden_size", "shared_expert_intermediate_size (or moe_intermediate_size x n_shared_experts)")),
    (r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.", ("moe_intermediate_size (or intermediate_size)", "hidden_size")),
    (r"\.experts\.\d+\.(down_proj|w2)\.", ("hidden_size", "moe_intermediate_size (or intermediate_size)")),
    (r"\.(gate|up)_proj\.", ("intermediate_size", "hidden_size")),
    (r"\.down_proj\.", ("hidden_size", "intermediate_size")),
    (r"(embed_tokens|lm_head)\.", ("vocab_size", "hidden_size")),
    (r"\.(gate|router)\.weight", ("num_experts (n_routed_experts, num_local_experts)", "hidden_size")),
    (r"\.[qk]_norm\.", ("head_dim",)),
    (r"\.sinks", ("num_attention_heads",)),
))


def hf_axis_fields(hf_name: str, stored: tuple[int, ...], implied: tuple[int, ...]) -> str:
    """The config.json fields behind the first axis where an HF tensor's stored shape and the config's differ."""
    if len(stored) != len(implied):
        return "num_experts (a fused experts tensor), or the tensor's kind"
    axis = next(i for i, (a, b) in enumerate(zip(stored, implied, strict=True)) if a != b)
    # a fused [experts, ...] tensor's leading axis; a vision tower has none (its patch embedding is a 5-D convolution)
    lead = 0 if "visual." in hf_name else max(0, len(implied) - 2)
    if axis < lead:
        return "num_experts (n_routed_experts, num_local_experts)"
    fields = next((f for pattern, f in _HF_AXIS_FIELDS if pattern.search(hf_name)), ("hidden_size",))
    return fields[min(axis - lead, len(fields) - 1)]


def refuse(what: str, hint: str) -> ReshardError:
    return ReshardError(f"HF config: {what} is not supported by reshard's converter; {hint}")


# The numbers a config.json of any family gives, and their range; None is allowed where the converter has a
# default for a missing value (the field is read as `hf.get(...) or default`).
HF_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
           "moe_intermediate_size", "vocab_size", "max_position_embeddings", "num_local_experts", "num_experts",
           "num_experts_per_tok", "decoder_sparse_step", "shared_expert_intermediate_size", "n_embd", "n_layer", "n_head", "n_inner",
           "n_positions", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
HF_NULLABLE = ("num_key_value_heads", "head_dim", "n_inner", "num_local_experts", "num_experts", "q_lora_rank")
HF_POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta", "routed_scaling_factor")
HF_BOOLS = ("tie_word_embeddings", "norm_topk_prob", "qkv_bias")
MAX_INT = 1 << 31  # far past any model's sizes; a product of a few stays within numpy's int64 shapes


def bad_value(field: str, value: Any, want: str) -> ReshardError:
    return ReshardError(f"HF config: {field}={json.dumps(value)[:40]} is not {want}; fix config.json")


def check_values(hf: dict[str, Any]) -> None:
    """Refuse config.json numbers the converter cannot use: not numbers, out of range, or sizes that do not
    divide as attention needs (heads into hidden_size, KV heads into heads, routed experts into experts)."""
    for field in HF_INTS:
        value = hf.get(field)
        if field not in hf or (value is None and field in HF_NULLABLE):
            continue
        if type(value) is not int or not 0 < value < MAX_INT:
            raise bad_value(field, value, f"a whole number from 1 to {MAX_INT - 1}")
    for field in HF_POSITIVE_FLOATS:
        value = hf.get(field)
        if field in hf and (type(value) not in (int, float) or not 0 < value < math.inf):
            raise bad_value(field, value, "a positive number")
    for field in HF_BOOLS:
        if field in hf and not isinstance(hf[field], bool):
            raise bad_value(field, hf[field], "true or false")
    for field in ("rms_norm_eps", "layer_norm_epsilon"):
        if field in hf and hf[field] >= 1:
            raise bad_value(field, hf[field], "an epsilon below 1")
    heads, hidden = hf.get("num_attention_heads", hf.get("n_head")), hf.get("hidden_size", hf.get("n_embd"))
    if heads and hidden and not hf.get("head_dim") and hidden % heads:
        name = "num_attention_heads" if "num_attention_heads" in hf else "n_head"
        raise bad_value(name, heads, f"a divisor of the hidden size {hidden} (config.json gives no head_dim)")
    kv = hf.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise bad_value("num_key_value_heads", kv, f"a divisor of num_attention_heads={heads}")
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if experts and hf.get("num_experts_per_tok", 0) > experts:
        raise bad_value("num_experts_per_tok", hf["num_experts_per_tok"], f"at most the {experts} experts")


def number(value: Any, field: str) -> float:
    """A config.json float (rope_scaling's factor, partial_rotary_factor), or a one-line refusal naming it."""
    if type(value) not in (int, float) or not -math.inf < value < math.inf:
        raise bad_value(field, value, "a number")
    return float(value)


def expert_count(hf: dict[str, Any]) -> int:
    """Experts per MoE layer, under either name HF families use for it."""
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise refuse("a MoE config without num_local_experts/num_experts", "the config.json must name its expert count")
    return int(experts)


def qwen_moe_layer_freq(hf: dict[str, Any]) -> int | tuple[int, ...]:
    """Megatron's moe_layer_freq for a Qwen-style MoE config. transformers makes layer i an MoE layer unless it is
    in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`; the others are dense MLPs of
    `intermediate_size`."""
    kinds = _qwen_moe_layers(hf)
    if not any(kinds):
        raise refuse("an MoE config whose every layer is dense (mlp_only_layers/decoder_sparse_step)", "convert it as its dense family")
    return 1 if all(kinds) else tuple(int(moe) for moe in kinds)


def _qwen_moe_layers(hf: dict[str, Any]) -> list[bool]:
    layers, step, dense = int(hf["num_hidden_layers"]), hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if type(step) is not int or step < 1:
        raise bad_value("decoder_sparse_step", step, "a whole number from 1")
    if not isinstance(dense, list) or any(type(i) is not int or not 0 <= i < layers for i in dense):
        raise bad_value("mlp_only_layers", dense, f"a list of layer numbers below num_hidden_layers={layers}")
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def qwen_moe_layers_to_hf(out: dict[str, Any], config: ModelConfig) -> None:
    """The inverse of qwen_moe_layer_freq (the dense MLP's width, intermediate_size, is Megatron's ffn_hidden_size):
    the imported config's own spelling where it still says which layers are dense, else each listed in mlp_only_layers."""
    try:
        if _qwen_moe_layers(out) == config.moe_layers:
            out.setdefault("decoder_sparse_step", 1)
            out.setdefault("mlp_only_layers", [])
            return
    except ReshardError:
        pass  # a saved spelling this model no longer agrees with is rewritten
    out["decoder_sparse_step"] = 1
    out["mlp_only_layers"] = [i for i, moe in enumerate(config.moe_layers) if not moe]


def by_layer(config: ModelConfig, table: Callable[[LayerKind], list[Mapping]]) -> list[Mapping]:
    """The decoder's mappings, `table` giving a layer's by its kind; where kinds mix, Megatron keys each layer apart
    (`ModelConfig.per_layer_names`), so each layer gets its own kind's mappings."""
    kinds = config.layer_kinds
    if not config.per_layer_names:
        return table(kinds[0])
    return [at_layer(m, i) for i, kind in enumerate(kinds) for m in table(kind)]


def by_layer_kind(config: ModelConfig, dense: list[Mapping], moe: list[Mapping]) -> list[Mapping]:
    """`by_layer` for a model whose layers are `dense` or `moe` ones."""
    return by_layer(config, lambda kind: moe if kind.moe else dense)


def megatron_frequency(flags: list[int]) -> int | tuple[int, ...]:
    """A per-layer 0/1 pattern as Megatron-Core's frequency options take it (window_attn_skip_freq,
    linear_attention_freq): N where layer n (from 1) is 1 unless n % N == 0, else the 0/1 per layer."""
    layers = len(flags)
    return next((n for n in range(2, layers + 1) if list(flags) == [int(i % n != 0) for i in range(1, layers + 1)]), tuple(flags))


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a v4 (`rope_theta`, `rope_scaling`) or v5 (`rope_parameters`) config."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    theta = hf.get("rope_theta")
    if isinstance(params, dict):
        if "full_attention" in params and isinstance(params["full_attention"], dict):  # per-layer-type form
            params = params["full_attention"]
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) not in (None, "default"):
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and not isinstance(scaling, dict):
        raise bad_value("rope_scaling", scaling, "an object or null")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
    theta = number(theta if theta is not None else 10000.0, "rope_theta")
    if theta <= 0:
        raise bad_value("rope_theta", theta, "a positive number")
    return theta, scaling


def check_rope_scaling(scaling: dict[str, Any] | None) -> tuple[bool, float]:
    """(Megatron rope_scaling, rope_scaling_factor) for an HF scaling dict, refusing what Megatron cannot express."""
    if not scaling:
        return False, 8.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise refuse(
            f"rope_scaling type {kind!r}",
            "Megatron-Core only implements llama3-style scaling (rope_scaling/rope_scaling_factor); convert a model without it",
        )
    for key, value in MEGATRON_LLAMA3_ROPE.items():
        if key in scaling and number(scaling[key], f"rope_scaling.{key}") != value:
            raise refuse(
                f"llama3 rope_scaling {key}={scaling[key]}",
                f"Megatron-Core fixes it at {value}; the converted model would compute different positions",
            )
    factor = number(scaling.get("factor", 8.0), "rope_scaling.factor")
    if factor <= 0:
        raise bad_value("rope_scaling.factor", factor, "a positive number")
    return True, factor


def hf_dtype(hf: dict[str, Any]) -> str | None:
    value = hf.get("dtype") or hf.get("torch_dtype")
    if value is None:
        return None
    value = str(value).removeprefix("torch.")
    if value not in PRECISIONS:
        raise refuse(f"dtype {value!r}", "only float32, bfloat16 and float16 checkpoints can be converted")
    return PRECISIONS[value]


# --------------------------------------------------------------------------------------------------
# Families
# --------------------------------------------------------------------------------------------------

L = "{layer}"
E = "{expert}"


def at_layer(mapping: Mapping, layer: int, megatron: str | None = None) -> Mapping:
    """`mapping` for one layer of a model keyed per layer (`ModelConfig.per_layer_names`): the Megatron name
    under `decoder.layers.{layer}.` (or the module `megatron` names, e.g. an MTP layer's transformer layer), the
    HF names with the layer filled in."""
    out = copy.copy(mapping)
    object.__setattr__(out, "megatron", mapping.megatron.replace("decoder.layers.", megatron or f"decoder.layers.{layer}.", 1))
    object.__setattr__(out, "hf", tuple(name.replace(L, str(layer)) for name in mapping.hf))
    return out


def under(prefix: str, mapping: Mapping) -> Mapping:
    """`mapping` with its Megatron name under `prefix` (a language model beside other towers: `config.Tower`)."""
    out = copy.copy(mapping)
    object.__setattr__(out, "megatron", prefix + mapping.megatron)
    return out


# The Megatron features of a Llama-style decoder; families state how they differ from it.
LLAMA_SIGNATURE: dict[str, Any] = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "qk_layernorm_full_width": False,
    "layernorm_zero_centered_gamma": False,
    "attention_output_gate": False,
    "experimental_attention_variant": None,
    "hybrid": False,
    "squared_relu": False,
    "position_embedding_type": "rope",
    "moe": False,
    "multi_latent_attention": False,
    # Megatron's default router (softmax over the top-k logits), which Mixtral and Qwen-MoE use
    "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False,
    "moe_router_num_groups": None,
    "moe_router_topk_scaling_factor": None,
    "moe_latent_size": None,
    # gpt-oss's (`converters.gpt_oss`): attention sinks, sliding windows, the clamped SwiGLU
    "softmax_type": "vanilla",
    "window_size": None,
    "quick_geglu": False,
    "activation_func_clamp_value": None,
    "glu_linear_offset": 0.0,
}


class Family:
    """One HF model family: names, mapping table, and config translation. Subclass per family."""

    model_type: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    prefix: ClassVar[str] = "model."  # the base model's prefix inside the CausalLM's state dict
    tie_default: ClassVar[bool] = False  # transformers' default for tie_word_embeddings
    # HF keys that carry no weights we need (old non-persistent buffers saved by some versions).
    ignored: ClassVar[tuple[str, ...]] = (r"\.rotary_emb\.inv_freq$",)
    # ModelConfig fields this family's HF model fixes; a Megatron model that differs cannot be exported.
    signature: ClassVar[dict[str, Any]] = {}
    holds_mtp: ClassVar[bool] = False  # the HF model has multi-token-prediction layers (DeepSeek-V3's)
    # Where the family is released in MXFP4 (`reshard.mxfp4`): the HF tensors quantized (by their names' endings), and
    # the release's quantization_config.modules_to_not_convert
    mxfp4_tensors: ClassVar[tuple[str, ...]] = ()
    mxfp4_unconverted: ClassVar[tuple[str, ...]] = ()

    # ---- HF config -> ModelConfig ----------------------------------------------------------------
    def check_hf(self, hf: dict[str, Any]) -> None:
        """Refuse HF config features the mapping does not cover."""
        if quantization := hf.get("quantization_config"):  # fp8 blocks, MXFP4, INT4 are read dequantized; all else refused
            if mxfp4.is_config(quantization):
                mxfp4.check_config(quantization)
            elif int4_pack.is_config(quantization):
                int4_pack.group_size(quantization)
            else:
                fp8_blocks.block_size(quantization)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise refuse(f"hidden_act={act!r}", "this family converts SwiGLU (silu) MLPs only")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag) and flag not in self.allowed_flags():
                raise refuse(f"{flag}=true", f"{self.model_type} models with {flag} cannot be mapped; open an issue with the model name")
        if hf.get("use_sliding_window") or ("use_sliding_window" not in hf and hf.get("sliding_window") is not None):
            raise refuse(
                f"sliding_window={hf.get('sliding_window')}",
                "Megatron-Core here uses full causal attention; set sliding_window to null in config.json only if the model never relied on it",
            )
        layer_types = hf.get("layer_types") or ["full_attention"]
        if not isinstance(layer_types, list) or not all(isinstance(kind, str) for kind in layer_types):
            raise bad_value("layer_types", layer_types, "a list of attention kinds")
        kinds = set(layer_types)
        if kinds != {"full_attention"}:
            raise refuse(f"layer_types {sorted(kinds)}", "only full attention on every layer can be converted")
        if number(hf.get("partial_rotary_factor", 1.0) or 1.0, "partial_rotary_factor") != 1.0:
            raise refuse(f"partial_rotary_factor={hf['partial_rotary_factor']}", "only full-width rotary embeddings are mapped")

    def allowed_flags(self) -> set[str]:
        return set()

    def config_from_hf(self, hf: dict[str, Any]) -> tuple[ModelConfig, dict[str, Any]]:
        """(ModelConfig, extra Megatron args) for an HF config.json dict."""
        check_values(hf)
        self.check_hf(hf)
        heads = int(hf["num_attention_heads"])
        kv = int(hf.get("num_key_value_heads") or heads)
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // heads)
        theta, scaling = rope_from_hf(hf)
        vocab = int(hf["vocab_size"])
        config = ModelConfig(
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=kv if kv != heads else None,
            kv_channels=head_dim,
            ffn_hidden_size=int(hf["intermediate_size"]),
            vocab_size=vocab,
            padded_vocab_size=pad_vocab(vocab, 128, 1),
            make_vocab_size_divisible_by=128,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            position_embedding_type="rope",
            rotary_base=theta,
            **self.rope_scaling_from_hf(scaling, hf),
            normalization="RMSNorm",
            norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
            swiglu=True,
            untie_embeddings_and_output_weights=not bool(hf.get("tie_word_embeddings", self.tie_default)),
            params_dtype=hf_dtype(hf) or "float32",
        )
        config = self.adjust_from_hf(config, hf)
        extras = {"hf_rope_scaling": copy.deepcopy(scaling)} if scaling else {}
        return config, extras

    def rope_scaling_from_hf(self, scaling: dict[str, Any] | None, hf: dict[str, Any]) -> dict[str, Any]:
        """The ModelConfig fields of an HF rope scaling dict (None: no scaling) of config `hf`."""
        rope_scaling, factor = check_rope_scaling(scaling)
        return {"rope_scaling": rope_scaling, "rope_scaling_factor": factor}

    def adjust_from_hf(self, config: ModelConfig, hf: dict[str, Any]) -> ModelConfig:
        """Family-specific fields (biases, q/k norms, experts)."""
        return config

    def for_files(self, config: ModelConfig, stored: Collection[str]) -> tuple[Family, ModelConfig, list[str]]:
        """(family, config, what is not carried) to read files holding the HF tensors `stored` by: the family's form
        of those files (a release's own spelling), the config less what config.json names that the files hold none of
        by design (transformers' saved MTP layers); refusing what they hold part of."""
        return self, config, []

    def files_form(self) -> str | None:
        """Which of the family's HF forms this instance reads and writes (None: its one or default form). Recorded in
        the args (`hf_form`) so that an export writes the form imported (`in_form`)."""
        return None

    def in_form(self, form: str | None) -> Family:
        """The family writing HF form `form` (`files_form`)."""
        return self

    # ---- ModelConfig -> HF config ----------------------------------------------------------------
    def check_megatron(self, config: ModelConfig) -> None:
        """Refuse a Megatron model this family's HF classes cannot represent."""
        if (differs := self.mismatch(config)) is not None:
            from reshard.converters import families_for_model

            fits = [family.model_type for family in families_for_model(config)]
            raise ReshardError(f"the model has {differs}: it is not a {self.model_type} model; "
                               + (f"it fits HF {' and '.join(fits)}" if fits else "no HF family holds it: keep it in a Megatron format"))
        if config.rotary_percent != 1.0:
            raise ReshardError(f"rotary_percent={config.rotary_percent} has no HF {self.model_type} equivalent")
        if config.unmodeled:
            raise ReshardError(
                f"the model sets {', '.join(config.unmodeled)}, which HF {self.model_type} does not represent: "
                "its logits would differ; keep it in a Megatron format"
            )
        if config.vocab_size is None:
            raise ReshardError("the checkpoint does not record its true vocabulary size; pass --vocab-size so padding is not exported")
        if config.mtp_num_layers and not self.holds_mtp:
            raise ReshardError(
                f"the model has {config.mtp_num_layers} multi-token-prediction layers (mtp.layers.*), which HF {self.model_type} "
                "cannot hold: export it as deepseek_v3 or glm4_moe, or keep it in a Megatron format rather than lose them"
            )

    @staticmethod
    def megatron_features(config: ModelConfig) -> dict[str, Any]:
        return {
            "normalization": config.normalization,
            "swiglu": config.swiglu,
            "add_bias_linear": config.add_bias_linear,
            "add_qkv_bias": config.add_qkv_bias or config.add_bias_linear,
            "qk_layernorm": config.qk_layernorm,
            "qk_layernorm_full_width": config.qk_layernorm_full_width,
            "layernorm_zero_centered_gamma": config.layernorm_zero_centered_gamma,
            "attention_output_gate": config.attention_output_gate,
            "experimental_attention_variant": config.experimental_attention_variant,
            "hybrid": config.hybrid_override_pattern is not None,  # megatron-core's MambaModel (`converters.nemotron_h`)
            "squared_relu": config.squared_relu,
            "moe_dense_layers": config.is_moe and not all(config.moe_layers),  # dense MLPs between MoE layers
            "position_embedding_type": config.position_embedding_type,
            "moe": config.is_moe,
            "shared_experts": bool(config.moe_shared_expert_intermediate_size),
            "shared_expert_gate": config.moe_shared_expert_gate,
            "router_pre_softmax": config.moe_router_pre_softmax,
            "multi_latent_attention": config.multi_latent_attention,
            "moe_router_score_function": config.moe_router_score_function,
            "moe_router_enable_expert_bias": config.moe_router_enable_expert_bias,
            "moe_router_num_groups": config.moe_router_num_groups,
            "moe_router_topk_scaling_factor": config.moe_router_topk_scaling_factor,
            "moe_latent_size": config.moe_latent_size,
            "softmax_type": config.softmax_type,
            "window_size": config.window_size,
            "quick_geglu": config.quick_geglu,
            "activation_func_clamp_value": config.activation_func_clamp_value,
            "glu_linear_offset": config.glu_linear_offset,
        }

    def mismatches(self, config: ModelConfig) -> list[str]:
        """Each feature of the model this family's HF model cannot hold, said for a user."""
        features = self.megatron_features(config)
        return [f"{field}={features[field]!r} where HF {self.model_type} needs {want!r}"
                for field, want in self.signature.items() if features[field] != want]

    def mismatch(self, config: ModelConfig) -> str | None:
        """The first feature of the model this family's HF model cannot hold; None if it fits."""
        return next(iter(self.mismatches(config)), None)

    def matches(self, config: ModelConfig) -> bool:
        return self.mismatch(config) is None

    def hf_config_base(self, config: ModelConfig, saved: dict[str, Any] | None) -> dict[str, Any]:
        """Refuse what HF cannot express; start from the imported HF config when it is this family's."""
        self.check_megatron(config)
        return copy.deepcopy(saved) if saved and saved.get("model_type") == self.model_type else {}

    def config_to_hf(self, config: ModelConfig, saved: dict[str, Any] | None = None, extras: dict[str, Any] | None = None) -> dict[str, Any]:
        """config.json for `config`; `saved` is the HF config the model was imported from (kept where it agrees)."""
        extras = extras or {}
        out = self.hf_config_base(config, saved)
        out.update(
            architectures=[self.architectures[0]],
            model_type=self.model_type,
            hidden_size=config.hidden_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.groups,
            head_dim=config.head_dim,
            intermediate_size=config.ffn_hidden_size,
            vocab_size=config.vocab_rows,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.norm_epsilon,
            hidden_act="silu",
            tie_word_embeddings=config.tied_embeddings,
        )
        self._rope_to_hf(out, config, extras.get("hf_rope_scaling"))
        self.adjust_to_hf(out, config)
        return out

    def adjust_to_hf(self, out: dict[str, Any], config: ModelConfig) -> None:
        return None

    def rope_scaling_to_hf(self, config: ModelConfig, saved_scaling: dict[str, Any] | None) -> dict[str, Any] | None:
        """The HF rope scaling dict of `config` (None: none); `saved_scaling` is the imported one, kept where it agrees."""
        if not config.rope_scaling:
            return None
        if saved_scaling and float(saved_scaling.get("factor", 8.0)) == config.rope_scaling_factor:
            return copy.deepcopy(saved_scaling)
        return {"rope_type": "llama3", "factor": config.rope_scaling_factor, **MEGATRON_LLAMA3_ROPE}

    def _rope_to_hf(self, out: dict[str, Any], config: ModelConfig, saved_scaling: dict[str, Any] | None) -> None:
        scaling = self.rope_scaling_to_hf(config, saved_scaling)
        if isinstance(out.get("rope_parameters"), dict):  # transformers v5 style, kept as the source had it
            out["rope_parameters"] = {"rope_theta": config.rotary_base, **(scaling or {"rope_type": "default"})}
            out.pop("rope_scaling", None)
            out.pop("rope_theta", None)
        else:  # v4 style, read by every transformers version
            out["rope_theta"] = config.rotary_base
            out["rope_scaling"] = scaling

    # ---- tensors ---------------------------------------------------------------------------------
    def mappings(self, config: ModelConfig) -> list[Mapping]:
        raise NotImplementedError

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.search(p, hf_name) for p in self.ignored)


def llama_attention(config: ModelConfig, prefix: str = "model.", qkv_bias: bool = False) -> list[Mapping]:
    """Llama-style attention block of decoder layer {layer}."""
    a, p = "decoder.layers.self_attention.", f"{prefix}layers.{L}."
    out: list[Mapping] = [
        Rename(f"{a}linear_qkv.layer_norm_weight", f"{p}input_layernorm.weight"),
        QKV(f"{a}linear_qkv.weight", f"{p}self_attn.q_proj.weight", f"{p}self_attn.k_proj.weight", f"{p}self_attn.v_proj.weight"),
        Rename(f"{a}linear_proj.weight", f"{p}self_attn.o_proj.weight"),
    ]
    if qkv_bias:
        out.append(QKV(f"{a}linear_qkv.bias", f"{p}self_attn.q_proj.bias", f"{p}self_attn.k_proj.bias", f"{p}self_attn.v_proj.bias"))
    if config.qk_layernorm:
        out.append(Rename(f"{a}q_layernorm.weight", f"{p}self_attn.q_norm.weight"))
        out.append(Rename(f"{a}k_layernorm.weight", f"{p}self_attn.k_norm.weight"))
    return out


def llama_dense_mlp(prefix: str = "model.") -> list[Mapping]:
    m, p = "decoder.layers.mlp.", f"{prefix}layers.{L}."
    return [
        Rename(f"{m}linear_fc1.layer_norm_weight", f"{p}post_attention_layernorm.weight"),
        GatedMLP(f"{m}linear_fc1.weight", f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"),
        Rename(f"{m}linear_fc2.weight", f"{p}mlp.down_proj.weight"),
    ]


def embeddings_and_head(config: ModelConfig, prefix: str = "model.") -> list[Mapping]:
    out: list[Mapping] = [
        Rename("embedding.word_embeddings.weight", f"{prefix}embed_tokens.weight"),
        Rename("decoder.final_layernorm.weight", f"{prefix}norm.weight"),
    ]
    if not config.tied_embeddings:
        out.append(Rename("output_layer.weight", "lm_head.weight"))
    return out


def moe_mlp(config: ModelConfig, block: str, router: str, gate: str, up: str, down: str, prefix: str = "model.") -> list[Mapping]:
    """Mixture-of-experts block: `block` is the HF module (`block_sparse_moe`, `mlp`); names are relative to it."""
    m, p = "decoder.layers.mlp.", f"{prefix}layers.{L}."
    ex = f"{p}{block}.experts.{E}."
    return [
        Rename("decoder.layers.pre_mlp_layernorm.weight", f"{p}post_attention_layernorm.weight"),
        Rename(f"{m}router.weight", f"{p}{block}.{router}.weight"),
        GatedMLP(f"{m}experts.experts.linear_fc1.weight", f"{ex}{gate}.weight", f"{ex}{up}.weight"),
        Rename(f"{m}experts.experts.linear_fc2.weight", f"{ex}{down}.weight"),
    ]


def shared_expert_mlp(config: ModelConfig, module: str, gate: str, prefix: str = "model.") -> list[Mapping]:
    """The shared expert every token of a MoE layer also passes through: `module` is its HF MLP and `gate` the
    HF [1, hidden] linear whose sigmoid scales its output (Megatron's moe_shared_expert_gate), both relative to the layer."""
    m, p = "decoder.layers.mlp.shared_experts.", f"{prefix}layers.{L}."
    out: list[Mapping] = [
        GatedMLP(f"{m}linear_fc1.weight", f"{p}{module}.gate_proj.weight", f"{p}{module}.up_proj.weight"),
        Rename(f"{m}linear_fc2.weight", f"{p}{module}.down_proj.weight"),
    ]
    if config.moe_shared_expert_gate:
        out.append(Rename(f"{m}gate_weight", f"{p}{gate}.weight"))
    return out
