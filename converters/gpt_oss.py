"""gpt-oss (GptOssForCausalLM): every layer a top-k MoE whose experts transformers stores fused, attention sinks,
sliding-window attention on alternate layers, biases everywhere, the clamped SwiGLU and YaRN.

- Experts: `mlp.experts.gate_up_proj [E, H, 2I]` holds each expert's gate and up columns interleaved (gate at
  [::2], up at [1::2]) and transposed against Megatron's linear_fc1 [2I, H] ([gate; up] rows); `down_proj
  [E, I, H]` is linear_fc2 transposed; `gate_up_proj_bias [E, 2I]` interleaved alike, `down_proj_bias [E, H]` as
  it is. Each expert is one slice of the fused tensor (`at_index`): read and written alone.
- Sinks: `self_attn.sinks [heads]` is Megatron-Core's `core_attention.softmax_offset` (softmax_type "learnable"),
  a logit per head in every softmax's denominator, split over TP by head (`reshard.logical`).
- Sliding window: HF's `sliding_window` W lets a token see itself and the W-1 before it, Megatron-Core's
  window_size (W-1, 0); `layer_types` says which layers, Megatron's window_attn_skip_freq (every Nth layer full, or
  a 0/1 per layer).
- The MLP: transformers computes (clamp(up, -L, L) + 1) * g * sigmoid(1.702 g), g = clamp(gate, max=L) with L
  swiglu_limit: Megatron-Core's quick_geglu with glu_linear_offset 1 and activation_func_clamp_value L, as
  Megatron-Bridge builds it. Megatron's add_bias_linear gives every linear a bias: q/k/v, o_proj, the router
  (`router.bias`, a parameter) and the experts.
- YaRN (rope_parameters rope_type "yarn") is Megatron-Core's GPT YaRN (position_embedding_type "yarn"), its
  `truncate` the rounding of the correction range (yarn_correction_range_round_to_int).

What transformers' gpt-oss computes whatever config.json says is refused where config.json says otherwise
(swiglu_alpha, attention_bias); a layer kind other than sliding or full attention is refused by name.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

from reshard.config import ModelConfig
from reshard.converters.base import (
    LLAMA_SIGNATURE,
    E,
    Family,
    L,
    Mapping,
    Rename,
    Tensor,
    Transposed,
    at_index,
    bad_value,
    embeddings_and_head,
    expert_count,
    llama_attention,
    megatron_frequency,
    number,
    refuse,
    rope_from_hf,
)
from reshard.converters.deepseek_v3 import yarn_from_hf
from reshard.errors import ReshardError

SWIGLU_ALPHA = 1.702  # quick_gelu's constant in Megatron-Core; transformers reads swiglu_alpha
_KINDS = {"sliding_attention": 1, "full_attention": 0}  # HF layer kind -> windowed, as a window_attn_skip_freq list says


def deinterleave_gated(t: Tensor) -> Tensor:
    """Rows [g0, u0, g1, u1, ...] (gpt-oss's gate/up interleaved) -> Megatron's linear_fc1 rows [gate; up]."""
    if t.shape[0] % 2:
        raise ReshardError(f"interleaved gate/up has an odd number of rows ({t.shape[0]})")
    return np.concatenate([t[0::2], t[1::2]], axis=0)


def interleave_gated(fc1: Tensor) -> Tensor:
    """Inverse of `deinterleave_gated`."""
    gate, up = np.split(fc1, 2, axis=0)
    return np.stack([gate, up], axis=1).reshape(fc1.shape)


@dataclass(frozen=True)
class InterleavedGated(Mapping):
    """gpt-oss's gate_up_proj of one expert ([H, 2I], columns interleaved: `transposed`) or its bias ([2I]) <->
    linear_fc1 [gate; up]."""

    transposed: bool = False

    def __init__(self, megatron: str, hf: str, transposed: bool = False):
        object.__setattr__(self, "megatron", megatron)
        object.__setattr__(self, "hf", (hf,))
        object.__setattr__(self, "transposed", transposed)

    def to_megatron(self, tensors, config):
        return deinterleave_gated(tensors[0].T if self.transposed else tensors[0])

    def to_hf(self, tensor, config):
        t = interleave_gated(tensor)
        return [t.T if self.transposed else t]


def window_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """window_size and window_attn_skip_freq for config.json's layer_types and sliding_window."""
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or ["full_attention"] * layers
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise bad_value("layer_types", kinds, f"a list of the {layers} layers' attention kinds")
    if unknown := sorted(set(kinds) - set(_KINDS)):
        raise refuse(f"layer_types {unknown[0]!r}", "Megatron-Core's gpt-oss layers are sliding_attention or full_attention")
    windowed = [_KINDS[kind] for kind in kinds]
    if not any(windowed):
        return {"window_size": None, "window_attn_skip_freq": None}
    width = hf.get("sliding_window")
    if type(width) is not int or width < 1:
        raise bad_value("sliding_window", width, "a whole number of positions from 1 (layer_types has sliding layers)")
    if all(windowed):
        skip: int | tuple[int, ...] | None = None
    else:  # Megatron-Core: layer n (from 1) is windowed unless n % N == 0; any other pattern as a 0/1 per layer
        skip = megatron_frequency(windowed)
    return {"window_size": (width - 1, 0), "window_attn_skip_freq": skip}


def window_to_hf(config: ModelConfig) -> list[str]:
    """layer_types of a model (window_attn_skip_freq read as Megatron-Core's is_layer_window_attention reads it)."""
    skip = config.window_attn_skip_freq
    windowed = [bool(config.window_size) and (skip is None or (bool(skip[n - 1]) if isinstance(skip, tuple) else n % skip != 0))
                for n in range(1, config.num_layers + 1)]
    return ["sliding_attention" if w else "full_attention" for w in windowed]


class GptOss(Family):
    model_type = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    signature = {
        **{k: v for k, v in LLAMA_SIGNATURE.items() if k not in ("position_embedding_type", "window_size", "activation_func_clamp_value")},
        "add_bias_linear": True,
        "add_qkv_bias": True,
        "moe": True,
        "moe_dense_layers": False,
        "shared_experts": False,
        "router_pre_softmax": False,
        "softmax_type": "learnable",
        "quick_geglu": True,
        "glu_linear_offset": 1.0,
    }
    mxfp4_tensors = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # the experts' weights, not their biases
    mxfp4_unconverted = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")

    def allowed_flags(self):
        return {"attention_bias"}

    def check_hf(self, hf):
        super().check_hf({k: v for k, v in hf.items() if k not in ("sliding_window", "layer_types")})  # read below
        if hf.get("attention_bias", True) is not True:
            raise refuse(f"attention_bias={hf['attention_bias']!r}", "Megatron-Core's add_bias_linear gives o_proj a bias "
                         "as it gives gpt-oss's router and experts theirs")
        if number(hf.get("swiglu_alpha", SWIGLU_ALPHA), "swiglu_alpha") != SWIGLU_ALPHA:
            raise refuse(f"swiglu_alpha={hf['swiglu_alpha']}", f"Megatron-Core's quick_geglu fixes it at {SWIGLU_ALPHA}")
        limit = number(hf.get("swiglu_limit", 7.0), "swiglu_limit")
        if not limit > 0:
            raise bad_value("swiglu_limit", hf["swiglu_limit"], "a positive number")
        experts, topk = expert_count(hf), hf.get("num_experts_per_tok", 4)
        if type(topk) is not int or not 0 < topk <= experts:
            raise bad_value("num_experts_per_tok", topk, f"a whole number from 1 to the {experts} experts")
        window_from_hf(hf)

    def rope_scaling_from_hf(self, scaling, hf):
        if not scaling:
            return {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "yarn":
            raise refuse(f"rope_scaling type {kind!r}", "gpt-oss maps YaRN (or no scaling) onto Megatron-Core")
        truncate = scaling.get("truncate", True)
        if not isinstance(truncate, bool):
            raise bad_value("rope_parameters.truncate", truncate, "true or false")
        fields = yarn_from_hf({**scaling, "truncate": True})  # its other keys as MLA reads them; truncate is GPT YaRN's own
        del fields["rope_type"]
        return {**fields, "yarn_correction_range_round_to_int": truncate}

    def adjust_from_hf(self, config, hf):
        return config.replace(
            add_bias_linear=True,
            add_qkv_bias=True,
            position_embedding_type="rope" if rope_from_hf(hf)[1] is None else "yarn",
            num_experts=expert_count(hf),
            moe_router_topk=int(hf.get("num_experts_per_tok", 4)),
            moe_ffn_hidden_size=int(hf["intermediate_size"]),
            softmax_type="learnable",
            quick_geglu=True,
            glu_linear_offset=1.0,
            activation_func_clamp_value=number(hf.get("swiglu_limit", 7.0), "swiglu_limit"),
            **window_from_hf(hf),
        )

    def check_megatron(self, config: ModelConfig) -> None:
        super().check_megatron(config)
        if config.activation_func_clamp_value is None:
            raise ReshardError("the model's quick_geglu is not clamped (activation_func_clamp_value), which HF gpt-oss always does")
        if config.window_size and (config.window_size[1] != 0 or config.window_size[0] < 0):
            raise ReshardError(f"window_size={list(config.window_size)} looks ahead; HF gpt-oss's sliding window is causal (W-1, 0)")
        if config.position_embedding_type not in ("rope", "yarn"):
            raise ReshardError(f"position_embedding_type={config.position_embedding_type} has no HF gpt-oss equivalent")

    def mappings(self, config):
        a, m, x = "decoder.layers.self_attention.", "decoder.layers.mlp.", "decoder.layers.mlp.experts.experts."
        p = f"model.layers.{L}."
        fused = f"{p}mlp.experts."
        return [
            *embeddings_and_head(config),
            *llama_attention(config, qkv_bias=True),
            Rename(f"{a}linear_proj.bias", f"{p}self_attn.o_proj.bias"),
            Rename(f"{a}core_attention.softmax_offset", f"{p}self_attn.sinks"),
            Rename("decoder.layers.pre_mlp_layernorm.weight", f"{p}post_attention_layernorm.weight"),
            Rename(f"{m}router.weight", f"{p}mlp.router.weight"),
            Rename(f"{m}router.bias", f"{p}mlp.router.bias"),
            InterleavedGated(f"{x}linear_fc1.weight", at_index(f"{fused}gate_up_proj", E), transposed=True),
            InterleavedGated(f"{x}linear_fc1.bias", at_index(f"{fused}gate_up_proj_bias", E)),
            Transposed(f"{x}linear_fc2.weight", at_index(f"{fused}down_proj", E)),
            Rename(f"{x}linear_fc2.bias", at_index(f"{fused}down_proj_bias", E)),
        ]

    def rope_scaling_to_hf(self, config, saved_scaling):
        if config.position_embedding_type != "yarn":
            return None
        fields = {name: getattr(config, name) for name in ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
                                                             "beta_slow", "mscale", "mscale_all_dim", "yarn_correction_range_round_to_int")}
        if saved_scaling and saved_scaling.get("rope_type", saved_scaling.get("type")) == "yarn":
            try:
                if self.rope_scaling_from_hf(saved_scaling, {}) == fields:
                    return copy.deepcopy(saved_scaling)
            except ReshardError:
                pass  # a saved dict this model no longer agrees with is rewritten
        out = {"rope_type": "yarn", "factor": config.rotary_scaling_factor, "original_max_position_embeddings":
               config.original_max_position_embeddings, "beta_fast": config.beta_fast, "beta_slow": config.beta_slow,
               "truncate": config.yarn_correction_range_round_to_int}
        if config.mscale_all_dim:
            out.update(mscale=config.mscale, mscale_all_dim=config.mscale_all_dim)
        return out

    def adjust_to_hf(self, out, config):
        out.update(num_local_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                   intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size, attention_bias=True,
                   swiglu_limit=config.activation_func_clamp_value, swiglu_alpha=SWIGLU_ALPHA,
                   layer_types=window_to_hf(config))
        if config.window_size:
            out["sliding_window"] = config.window_size[0] + 1

