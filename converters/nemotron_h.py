"""Nemotron-H (NemotronHForCausalLM) <-> megatron-core's hybrid (Mamba) model: one layer per symbol of a pattern,
a Mamba-2 mixer ("M"), self-attention without positional embeddings ("*"), a squared-ReLU MLP ("-") or a mixture of
squared-ReLU experts ("E"), each after its own RMSNorm (`backbone.layers.{i}.norm`, fused into the first linear of
the layer in megatron-core's TE spec; an MoE layer's is its `pre_mlp_layernorm`).

- Mamba-2 (`mixer`): HF's `in_proj` rows are [z; x; B; C; dt] over all heads (groups for B, C) in order; megatron-core
  keeps per TP rank that rank's z, x, B, C, dt and torch_dist keys the five apart (`in_proj.weight.z`, ...), each
  column-split, so each whole part is one run of HF rows (`in_proj_rows`). `conv1d` (weight and bias) alike over the
  x, B, C channels (`conv_rows`). `A_log`, `D`, `dt_bias` (per head), the gated RMSNorm `norm` (grouped by B/C
  group, split with the heads) and `out_proj` as they are.
- MoE layers (`mixer`): DeepSeek-V3's routing (`deepseek_moe`: sigmoid scores, `gate.e_score_correction_bias` as
  the router's expert_bias buffer, n_group/topk_group, routed_scaling_factor), routed experts of one up and one down
  projection (not gated: each `up_proj` is its expert's linear_fc1 as it is), and one shared expert of
  moe_shared_expert_intermediate_size that every token also passes through (transformers ignores n_shared_experts).
  Nemotron 3's latent MoE (moe_latent_size): the routed experts compute in the latent, between `fc1_latent_proj`
  (hidden -> latent, before dispatch) and `fc2_latent_proj` (back, after combine), megatron-core's same-named
  projections, whole on every TP rank; the router and the shared expert see the hidden state.
- The layer pattern is config.json's `layers_block_type` (transformers 5: "linear_attention" is Mamba) or the Hub's
  `hybrid_override_pattern` string, megatron-core's `hybrid_override_pattern` (Megatron-LM >= 0.18:
  `hybrid_layer_pattern`); an export writes it back in the spelling it came in.

Refused by name: MTP layers (num_nextn_predict_layers),
biases, a convolution width other than megatron-core's 4, a norm epsilon other than its Mamba norm's 1e-5, a time-step
limit, fp32 residuals, other activations.
"""

from __future__ import annotations

import math
from typing import Any

from reshard.architecture import MAMBA_CONV_KERNEL
from reshard.config import ModelConfig, pad_vocab
from reshard.converters.base import QKV, E, Family, L, Mapping, Rename, at_index, bad_value, by_layer, check_values, hf_dtype, refuse
from reshard.converters.deepseek_moe import check_hf_routing, check_megatron_routing, routing_from_hf, routing_to_hf
from reshard.converters.qwen3_next import Rows

# transformers 5's layers_block_type names <-> megatron-core's pattern symbols
_SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_NAMES = {symbol: name for name, symbol in _SYMBOLS.items()}
# config.json settings megatron-core's MambaModel has no option for: the value it computes with
_FIXED = {"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_conv_bias": True, "conv_kernel": MAMBA_CONV_KERNEL,
          "mamba_proj_bias": False, "use_bias": False, "attention_bias": False, "mlp_bias": False, "residual_in_fp32": False,
          "num_nextn_predict_layers": 0}
MAMBA_NORM_EPSILON = 1e-5  # megatron-core's MambaMixer builds its gated norm with this epsilon, no option
_MAMBA_SIZES = {"mamba_num_heads": "mamba_num_heads", "mamba_head_dim": "mamba_head_dim", "n_groups": "mamba_num_groups",
                "ssm_state_size": "mamba_state_dim"}  # HF -> Megatron


# --------------------------------------------------------------------------------------------------
# Pure tables
# --------------------------------------------------------------------------------------------------


def in_proj_rows(config: ModelConfig) -> dict[str, range]:
    """Each part of megatron-core's Mamba in_proj (torch_dist's `in_proj.weight.<part>`) -> its HF in_proj rows."""
    inner, bc = config.mamba_heads * config.mamba_head_dim, config.mamba_num_groups * config.mamba_state_dim
    return _runs((("z", inner), ("x", inner), ("B", bc), ("C", bc), ("dt", config.mamba_heads)))


def conv_rows(config: ModelConfig) -> dict[str, range]:
    """Each part of the depthwise convolution (`conv1d.weight.<part>`, `conv1d.bias.<part>`) -> its HF channels."""
    inner, bc = config.mamba_heads * config.mamba_head_dim, config.mamba_num_groups * config.mamba_state_dim
    return _runs((("x", inner), ("B", bc), ("C", bc)))


def _runs(sizes: tuple[tuple[str, int], ...]) -> dict[str, range]:
    out, start = {}, 0
    for part, size in sizes:
        out[part] = range(start, start + size)
        start += size
    return out


def pattern_from_hf(hf: dict[str, Any]) -> str:
    """megatron-core's hybrid_override_pattern for config.json's layers_block_type (or the Hub's pattern string)."""
    kinds = hf.get("layers_block_type")
    if kinds is None:
        pattern = hf.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(_NAMES):
            raise bad_value("hybrid_override_pattern", pattern, f"a string of {''.join(_NAMES)}, one per layer")
        kinds = [_NAMES[symbol] for symbol in pattern]
    if not isinstance(kinds, list) or not kinds or any(kind not in _SYMBOLS for kind in kinds):
        raise bad_value("layers_block_type", kinds, f"a list of {', '.join(_SYMBOLS)}, one per layer")
    layers = hf.get("num_hidden_layers")
    if layers is not None and layers != len(kinds):
        raise bad_value("num_hidden_layers", layers, f"the {len(kinds)} layers the layer pattern lists")
    return "".join(_SYMBOLS[kind] for kind in kinds)


# --------------------------------------------------------------------------------------------------
# Mappings
# --------------------------------------------------------------------------------------------------


def mamba_mixer(config: ModelConfig) -> list[Mapping]:
    m, p = "decoder.layers.mixer.", f"backbone.layers.{L}.mixer."
    out: list[Mapping] = [Rename(f"{m}in_proj.layer_norm_weight", f"backbone.layers.{L}.norm.weight")]
    out += [Rows(f"{m}in_proj.weight.{part}", [at_index(f"{p}in_proj.weight", str(r)) for r in rows])
            for part, rows in in_proj_rows(config).items()]
    out += [Rows(f"{m}conv1d.{kind}.{part}", [at_index(f"{p}conv1d.{kind}", str(r)) for r in rows])
            for kind in ("weight", "bias") for part, rows in conv_rows(config).items()]
    return [*out, *(Rename(f"{m}{name}", f"{p}{name}") for name in ("A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"))]


def attention() -> list[Mapping]:
    a, p = "decoder.layers.self_attention.", f"backbone.layers.{L}."
    return [Rename(f"{a}linear_qkv.layer_norm_weight", f"{p}norm.weight"),
            QKV(f"{a}linear_qkv.weight", f"{p}mixer.q_proj.weight", f"{p}mixer.k_proj.weight", f"{p}mixer.v_proj.weight"),
            Rename(f"{a}linear_proj.weight", f"{p}mixer.o_proj.weight")]


def moe(latent: bool = False) -> list[Mapping]:
    """An MoE layer: its norm, the router and its correction bias, the routed experts (up, down), the shared expert, and
    (`latent`) the projections into and out of the experts' latent."""
    m, p = "decoder.layers.mlp.", f"backbone.layers.{L}."
    x, ex = f"{p}mixer.", f"{p}mixer.experts.{E}."
    return [Rename("decoder.layers.pre_mlp_layernorm.weight", f"{p}norm.weight"), Rename(f"{m}router.weight", f"{x}gate.weight"),
            Rename(f"{m}router.expert_bias", f"{x}gate.e_score_correction_bias"),
            Rename(f"{m}experts.experts.linear_fc1.weight", f"{ex}up_proj.weight"),
            Rename(f"{m}experts.experts.linear_fc2.weight", f"{ex}down_proj.weight"),
            Rename(f"{m}shared_experts.linear_fc1.weight", f"{x}shared_experts.up_proj.weight"),
            Rename(f"{m}shared_experts.linear_fc2.weight", f"{x}shared_experts.down_proj.weight"),
            *(Rename(f"{m}{proj}.weight", f"{x}{proj}.weight") for proj in ("fc1_latent_proj", "fc2_latent_proj") if latent)]


def squared_relu_mlp() -> list[Mapping]:
    m, p = "decoder.layers.mlp.", f"backbone.layers.{L}."
    return [Rename(f"{m}linear_fc1.layer_norm_weight", f"{p}norm.weight"), Rename(f"{m}linear_fc1.weight", f"{p}mixer.up_proj.weight"),
            Rename(f"{m}linear_fc2.weight", f"{p}mixer.down_proj.weight")]


# --------------------------------------------------------------------------------------------------
# Family
# --------------------------------------------------------------------------------------------------


class NemotronH(Family):
    model_type = "nemotron_h"
    architectures = ("NemotronHForCausalLM",)
    name = "Nemotron-H"
    prefix = "backbone."
    signature = {"normalization": "RMSNorm", "swiglu": False, "squared_relu": True, "add_bias_linear": False, "add_qkv_bias": False,
                 "qk_layernorm": False, "position_embedding_type": "none", "hybrid": True, "shared_expert_gate": False,
                 "router_pre_softmax": False}

    def check_hf(self, hf):
        if hf.get("quantization_config"):
            raise refuse("quantization_config", "dequantize the model (save it unquantized) first")
        for field, want in _FIXED.items():
            if field in hf and hf[field] != want:
                raise refuse(f"{field}={hf[field]!r}", f"megatron-core's hybrid model computes with {want!r} only")
        limit = hf.get("time_step_limit", [0.0, math.inf])
        if not isinstance(limit, list | tuple) or len(limit) != 2 or limit[0] != 0.0 or limit[1] not in (math.inf, {"__float__": "Infinity"}):
            raise refuse(f"time_step_limit={limit!r}", "megatron-core's Mamba mixer clamps no time step (0, inf)")
        if hf.get("sliding_window") is not None:
            raise refuse(f"sliding_window={hf['sliding_window']}", "megatron-core's hybrid attention is full causal attention")
        for field in _MAMBA_SIZES:
            if type(hf.get(field)) is not int or hf[field] < 1:
                raise bad_value(field, hf.get(field), "a whole number from 1")
        if hf["mamba_num_heads"] % hf["n_groups"]:
            raise bad_value("mamba_num_heads", hf["mamba_num_heads"], f"a multiple of n_groups={hf['n_groups']}")
        pattern = pattern_from_hf(hf)
        if "M" in pattern and hf.get("layer_norm_epsilon", MAMBA_NORM_EPSILON) != MAMBA_NORM_EPSILON:
            raise refuse(f"layer_norm_epsilon={hf['layer_norm_epsilon']} with Mamba layers",
                         f"megatron-core's Mamba mixer normalises with epsilon {MAMBA_NORM_EPSILON} whatever the model's")
        if "E" in pattern:
            _check_hf_moe(hf)

    def config_from_hf(self, hf):
        check_values(hf)
        self.check_hf(hf)
        pattern = pattern_from_hf(hf)
        heads, vocab = int(hf["num_attention_heads"]), int(hf["vocab_size"])
        kv = int(hf.get("num_key_value_heads") or heads)
        config = ModelConfig(
            num_layers=len(pattern), hidden_size=int(hf["hidden_size"]), num_attention_heads=heads,
            num_query_groups=kv if kv != heads else None, kv_channels=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            ffn_hidden_size=int(hf["intermediate_size"]), vocab_size=vocab, padded_vocab_size=pad_vocab(vocab, 128, 1),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)), position_embedding_type="none",
            norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)), swiglu=False, squared_relu=True,
            untie_embeddings_and_output_weights=not bool(hf.get("tie_word_embeddings", False)),
            params_dtype=hf_dtype(hf) or "float32", hybrid_override_pattern=pattern,
            **{megatron: int(hf[field]) for field, megatron in _MAMBA_SIZES.items()},
            **(_moe_from_hf(hf) if "E" in pattern else {}),
        )
        return config, {}

    def config_to_hf(self, config, saved=None, extras=None):
        out = self.hf_config_base(config, saved)
        kinds = [_NAMES[symbol] for symbol in config.hybrid_override_pattern]
        if "hybrid_override_pattern" in out and "layers_block_type" not in out:  # the Hub's spelling, kept
            out.update(hybrid_override_pattern=config.hybrid_override_pattern, num_hidden_layers=config.num_layers)
        else:
            out["layers_block_type"] = kinds
        out.update(
            architectures=[self.architectures[0]], model_type=self.model_type, hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads, num_key_value_heads=config.groups, head_dim=config.head_dim,
            intermediate_size=config.ffn_hidden_size, vocab_size=config.vocab_rows, max_position_embeddings=config.max_position_embeddings,
            layer_norm_epsilon=config.norm_epsilon, tie_word_embeddings=config.tied_embeddings,
            **{field: getattr(config, megatron) for field, megatron in _MAMBA_SIZES.items() if field != "mamba_num_heads"},
            mamba_num_heads=config.mamba_heads, **{k: v for k, v in _FIXED.items() if k not in out},
        )
        if config.is_moe:
            routing_to_hf(out, config)
            out.update(moe_intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
                       moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                       moe_latent_size=config.moe_latent_size)
        return out

    def check_megatron(self, config):
        super().check_megatron(config)
        if config.hybrid_override_pattern is None:
            raise bad_value("hybrid_override_pattern", None, "a layer pattern (a hybrid model)")
        if config.is_moe:
            check_megatron_routing(config, "Nemotron-H")
            if not config.moe_shared_expert_intermediate_size:
                raise refuse("MoE layers without a shared expert", "HF Nemotron-H's MoE layers always pass every token through one")

    def mappings(self, config):
        tables = {"mamba": mamba_mixer(config), "attention": attention(), None: squared_relu_mlp(), "moe": moe(bool(config.moe_latent_size))}
        head: list[Mapping] = [Rename("embedding.word_embeddings.weight", "backbone.embeddings.weight"),
                               Rename("decoder.final_norm.weight", "backbone.norm_f.weight")]
        if not config.tied_embeddings:
            head.append(Rename("output_layer.weight", "lm_head.weight"))
        return [*head, *by_layer(config, lambda kind: tables["moe" if kind.moe else kind.mixer])]


def _check_hf_moe(hf: dict[str, Any]) -> None:
    """Refuse the MoE fields of a config with MoE layers that megatron-core cannot compute alike."""
    check_hf_routing(hf)
    for field in ("moe_intermediate_size", "moe_shared_expert_intermediate_size"):
        if type(hf.get(field)) is not int or hf[field] < 1:
            raise bad_value(field, hf.get(field), "a whole number from 1")
    if hf.get("moe_latent_size") is not None and (type(hf["moe_latent_size"]) is not int or hf["moe_latent_size"] < 1):
        raise bad_value("moe_latent_size", hf["moe_latent_size"], "null or a whole number from 1")


def _moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of the MoE layers (transformers' NemotronHConfig's routed_scaling_factor default 1)."""
    return dict(routing_from_hf(hf, default_scaling=1.0), moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_shared_expert_intermediate_size=hf["moe_shared_expert_intermediate_size"], moe_latent_size=hf.get("moe_latent_size"))
