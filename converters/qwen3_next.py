"""Qwen3-Next (Qwen3NextForCausalLM): Gated DeltaNet (linear attention) layers between gated softmax-attention ones
(`layer_types`, Megatron-Core's linear_attention_freq), on every layer but `mlp_only_layers` an MoE block with a gated
shared expert, zero-centred RMSNorms and partial RoPE.

- Gated DeltaNet (`linear_attn`): HF's `in_proj_qkvz` holds per key head its q, k, v and z rows (the value heads of
  that key head's group), `in_proj_ba` per key head its b then a rows. Megatron-Core's `in_proj` holds per TP rank
  that rank's q, k, v, z, b, a, which torch_dist keys apart (`in_proj.weight.query`, ... each column-split): each is
  a chosen set of HF rows (`Rows`, rows addressed one by one, so a row is read and written where it lies).
  `conv1d [q|k|v channels, 1, kernel]` is split alike (`conv1d.weight.query`, ...). `A_log`, `dt_bias`,
  `out_proj` as they are; the gated output norm `norm` is a plain RMSNorm in HF (weight near 1), a zero-centred one
  in Megatron-Core (`out_norm`, weight less one: Megatron-Bridge's RMSNorm2ZeroCenteredRMSNormMapping).
- Attention: `q_proj` holds per head its queries then its output gate's rows; Megatron-Core's linear_qkv with
  attention_output_gate per query group [queries; gates; key; value] (`group_gated_qkv`). q/k norms per head.
- Every other norm is HF's (1 + weight) RMSNorm, Megatron-Core's layernorm_zero_centered_gamma (Megatron-LM's
  --apply-layernorm-1p): the same stored values.
- MoE: Qwen2-MoE's block (softmax router, top-k renormalised by norm_topk_prob, a shared expert scaled by
  sigmoid(shared_expert_gate)); `mlp_only_layers` dense, as in Qwen3-MoE.
- Partial RoPE: the first partial_rotary_factor (transformers' default 0.25) of each head's dims rotate.

- MTP: the release's one multi-token-prediction layer (`mtp.*`, `mtp_num_hidden_layers` 1; transformers never loads it)
  is Megatron-Core's `mtp.layers.0` (`converters.mtp.release_mtp_layer`): a gated attention layer with the MLP of the
  decoder's last layer, which must be such a layer (Megatron-Core repeats the last layer's kind); its norms are
  zero-centred as the decoder's, the same stored values. Files without `mtp.*` (as transformers saves the model)
  convert without it and say so; more than one MTP layer (one `fc` for several layers) is refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from reshard.config import LINEAR_ATTENTION_FIELDS, LayerKind, ModelConfig
from reshard.converters.base import (
    LLAMA_SIGNATURE,
    QKV,
    Family,
    L,
    Mapping,
    Rename,
    Tensor,
    _expect,
    at_index,
    bad_value,
    by_layer,
    embeddings_and_head,
    llama_dense_mlp,
    megatron_frequency,
    qwen_moe_layer_freq,
    refuse,
)
from reshard.converters.mtp import release_mtp_layer, without_absent_mtp
from reshard.converters.partial_rotary import check_rotary_dims, rotary_fraction
from reshard.converters.qwen2_moe import moe_block, moe_from_hf, moe_to_hf
from reshard.errors import ReshardError

PARTIAL_ROTARY_DEFAULT = 0.25  # transformers' Qwen3NextConfig sets it where config.json does not
_KINDS = {"linear_attention": 1, "full_attention": 0}  # HF layer kind -> linear, as a linear_attention_freq list says
# transformers' Qwen3NextConfig defaults of the Gated DeltaNet sizes (and megatron-core's), by their shared names
_LINEAR_DEFAULTS = {field.name: field.default for field in dataclasses.fields(ModelConfig) if field.name in LINEAR_ATTENTION_FIELDS}


# --------------------------------------------------------------------------------------------------
# Pure transforms
# --------------------------------------------------------------------------------------------------


def group_gated_qkv(q_gate: Tensor, k: Tensor, v: Tensor, heads: int, groups: int, head_dim: int) -> Tensor:
    """HF q_proj (each head's queries, then its gate's) with k_proj, v_proj -> Megatron-Core's linear_qkv with an output
    gate: per query group [its heads' queries; their gates; key; value]."""
    if heads % groups:
        raise ReshardError(f"{heads} attention heads are not a multiple of {groups} KV groups")
    rest, per = tuple(q_gate.shape[1:]), heads // groups
    _expect(q_gate, 2 * heads * head_dim, "q_proj (queries and gates)")
    _expect(k, groups * head_dim, "k")
    _expect(v, groups * head_dim, "v")
    x = q_gate.reshape(groups, per, 2, head_dim, *rest)
    parts = (x[:, :, 0].reshape(groups, per * head_dim, *rest), x[:, :, 1].reshape(groups, per * head_dim, *rest),
             k.reshape(groups, head_dim, *rest), v.reshape(groups, head_dim, *rest))
    return np.concatenate(parts, axis=1).reshape((2 * heads + 2 * groups) * head_dim, *rest)


def split_gated_qkv(qkv: Tensor, heads: int, groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `group_gated_qkv`."""
    rest, per = tuple(qkv.shape[1:]), heads // groups
    _expect(qkv, (2 * heads + 2 * groups) * head_dim, "linear_qkv (with output gates)")
    x = qkv.reshape(groups, (2 * per + 2) * head_dim, *rest)
    q = x[:, : per * head_dim].reshape(groups, per, 1, head_dim, *rest)
    gate = x[:, per * head_dim : 2 * per * head_dim].reshape(groups, per, 1, head_dim, *rest)
    k = x[:, 2 * per * head_dim : (2 * per + 1) * head_dim].reshape(groups * head_dim, *rest)
    v = x[:, (2 * per + 1) * head_dim :].reshape(groups * head_dim, *rest)
    return np.concatenate([q, gate], axis=2).reshape(2 * heads * head_dim, *rest), k, v


def in_proj_rows(config: ModelConfig) -> dict[str, tuple[str, list[int]]]:
    """Each part of Megatron-Core's Gated DeltaNet in_proj (torch_dist's `in_proj.weight.<part>`) -> (HF tensor, its
    rows in order). HF groups by key head: in_proj_qkvz's [q (dk); k (dk); v (r dv); z (r dv)], in_proj_ba's
    [b (r); a (r)] for each, r value heads per key head; Megatron's parts run over all heads in order."""
    nk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    r = config.linear_num_value_heads // nk
    per = 2 * dk + 2 * r * dv
    spans = {"query": ("in_proj_qkvz", per, 0, dk), "key": ("in_proj_qkvz", per, dk, dk),
             "value": ("in_proj_qkvz", per, 2 * dk, r * dv), "z": ("in_proj_qkvz", per, 2 * dk + r * dv, r * dv),
             "beta": ("in_proj_ba", 2 * r, 0, r), "alpha": ("in_proj_ba", 2 * r, r, r)}
    return {part: (hf, [head * stride + start + i for head in range(nk) for i in range(size)])
            for part, (hf, stride, start, size) in spans.items()}


def conv_rows(config: ModelConfig) -> dict[str, list[int]]:
    """Each part of the depthwise convolution (torch_dist's `conv1d.weight.<part>`) -> its HF channels: q, k, v in turn."""
    qk, v = config.linear_num_key_heads * config.linear_key_head_dim, config.linear_num_value_heads * config.linear_value_head_dim
    return {"query": list(range(qk)), "key": list(range(qk, 2 * qk)), "value": list(range(2 * qk, 2 * qk + v))}


def zero_centred(weight: Tensor, name: str) -> Tensor:
    """A plain norm weight -> Megatron-Core's zero-centred one (less one), refused where that is not exact (a weight
    below 0.5 with bits past the result's precision), so the round trip gives back the source's bits."""
    out = weight - np.ones((), weight.dtype)
    if not np.array_equal(out + np.ones((), weight.dtype), weight):
        raise ReshardError(f"{name}: a norm weight below 0.5 cannot be stored zero-centred exactly in {weight.dtype}")
    return out


# --------------------------------------------------------------------------------------------------
# Mappings
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rows(Mapping):
    """A Megatron tensor made of rows of HF tensors, each row addressed on its own (`at_index`), in order."""

    stacks_rows: ClassVar[bool] = True

    def __init__(self, megatron: str, rows: Sequence[str]):
        object.__setattr__(self, "megatron", megatron)
        object.__setattr__(self, "hf", tuple(rows))

    def to_megatron(self, tensors, config):
        return np.stack(tensors)

    def to_hf(self, tensor, config):
        return [tensor[i, ...] for i in range(len(tensor))]  # arrays, 0-d where the rows are a vector's (a bias's) elements


class GatedQKV(QKV):
    """q_proj holding queries and output gates, k_proj, v_proj <-> linear_qkv with attention_output_gate."""

    def to_megatron(self, tensors, config):
        return group_gated_qkv(*tensors, config.num_attention_heads, config.groups, config.head_dim)

    def to_hf(self, tensor, config):
        return list(split_gated_qkv(tensor, config.num_attention_heads, config.groups, config.head_dim))


class ZeroCentredNorm(Rename):
    """HF's plain RMSNorm weight <-> Megatron-Core's zero-centred one (`zero_centred`)."""

    stacks_rows: ClassVar[bool] = False  # the values change: the HF bytes are not the slab's

    def to_megatron(self, tensors, config):
        return zero_centred(tensors[0], self.hf[0])

    def to_hf(self, tensor, config):
        return [tensor + np.ones((), tensor.dtype)]


def gated_delta_net(config: ModelConfig, in_proj: list[Mapping], prefix: str = "model.") -> list[Mapping]:
    """A Gated DeltaNet layer's mappings, HF names under `prefix`; `in_proj`: those of its input projection's parts
    (the family's HF form)."""
    a, p = "decoder.layers.self_attention.", f"{prefix}layers.{L}.linear_attn."
    out: list[Mapping] = [Rename(f"{a}in_proj.layer_norm_weight", f"{prefix}layers.{L}.input_layernorm.weight"), *in_proj]
    for part, rows in conv_rows(config).items():
        out.append(Rows(f"{a}conv1d.weight.{part}", [at_index(f"{p}conv1d.weight", str(row)) for row in rows]))
    return [*out, Rename(f"{a}A_log", f"{p}A_log"), Rename(f"{a}dt_bias", f"{p}dt_bias"),
            ZeroCentredNorm(f"{a}out_norm.weight", f"{p}norm.weight"), Rename(f"{a}out_proj.weight", f"{p}out_proj.weight")]


def fused_in_proj(config: ModelConfig, prefix: str = "model.") -> list[Mapping]:
    """Qwen3-Next's in_proj_qkvz and in_proj_ba, grouped by key head (`in_proj_rows`)."""
    a, p = "decoder.layers.self_attention.", f"{prefix}layers.{L}.linear_attn."
    return [Rows(f"{a}in_proj.weight.{part}", [at_index(f"{p}{hf}.weight", str(row)) for row in rows])
            for part, (hf, rows) in in_proj_rows(config).items()]


def gated_attention(prefix: str = "model.") -> list[Mapping]:
    a, p = "decoder.layers.self_attention.", f"{prefix}layers.{L}."
    return [
        Rename(f"{a}linear_qkv.layer_norm_weight", f"{p}input_layernorm.weight"),
        GatedQKV(f"{a}linear_qkv.weight", f"{p}self_attn.q_proj.weight", f"{p}self_attn.k_proj.weight", f"{p}self_attn.v_proj.weight"),
        Rename(f"{a}q_layernorm.weight", f"{p}self_attn.q_norm.weight"),
        Rename(f"{a}k_layernorm.weight", f"{p}self_attn.k_norm.weight"),
        Rename(f"{a}linear_proj.weight", f"{p}self_attn.o_proj.weight"),
    ]


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's attention kind, as config.json's layer_types (or full_attention_interval, the release's spelling) say."""
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types")
    if kinds is None:
        interval = hf.get("full_attention_interval", 4)
        if type(interval) is not int or interval < 1:
            raise bad_value("full_attention_interval", interval, "a whole number of layers from 1")
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise bad_value("layer_types", kinds, f"a list of the {layers} layers' attention kinds")
    if unknown := sorted(set(kinds) - set(_KINDS)):
        raise refuse(f"layer_types {unknown[0]!r}", "Qwen3-Next's layers are linear_attention or full_attention")
    return kinds


def linear_attention_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Megatron-Core's Gated DeltaNet fields for config.json's `layer_types` and linear_* sizes."""
    kinds = layer_types(hf)
    sizes = {field: hf.get(field, default) for field, default in _LINEAR_DEFAULTS.items()}
    for field, value in sizes.items():
        if type(value) is not int or value < 1:
            raise bad_value(field, value, "a whole number from 1")
    if sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
        raise bad_value("linear_num_value_heads", sizes["linear_num_value_heads"],
                        f"a multiple of linear_num_key_heads={sizes['linear_num_key_heads']}")
    linear = [_KINDS[kind] for kind in kinds]
    if not any(linear):
        return {"experimental_attention_variant": None, "linear_attention_freq": None, **sizes}
    # Megatron-Core: layer n (from 1) is linear unless n % N == 0; any other pattern as a 0/1 per layer
    return {"experimental_attention_variant": "gated_delta_net", "linear_attention_freq": megatron_frequency(linear), **sizes}


class Qwen3Next(Family):
    """Qwen3-Next; its hooks (`check_mlp`, `mlp_from_hf`, `in_proj`, `mlp`, `mlp_to_hf`) are what Qwen3.5
    (`converters/qwen3_5.py`) does otherwise."""

    model_type = "qwen3_next"
    architectures = ("Qwen3NextForCausalLM",)
    name = "Qwen3-Next"
    text_prefix = "model."  # where HF keeps the language model (a VL model's: `converters.qwen3_5_vl`)
    signature = {**{k: v for k, v in LLAMA_SIGNATURE.items() if k != "experimental_attention_variant"},
                 "qk_layernorm": True, "layernorm_zero_centered_gamma": True, "attention_output_gate": True, "moe": True,
                 "shared_experts": True, "shared_expert_gate": True}
    holds_mtp = True

    def check_hf(self, hf):
        # layer_types and partial rotary are this family's own: read below, not refused as in other families
        super().check_hf({k: v for k, v in hf.items() if k not in ("layer_types", "partial_rotary_factor")})
        linear_attention_from_hf(hf)
        rotary_fraction(hf, PARTIAL_ROTARY_DEFAULT)
        self.check_mlp(hf)
        mtp = hf.get("mtp_num_hidden_layers") or 0
        if type(mtp) is not int or mtp not in (0, 1):
            raise bad_value("mtp_num_hidden_layers", mtp, f"0 or 1 ({self.name}'s release has one MTP layer behind one mtp.fc; "
                            "Megatron-Core's MTP layers each have their own)")
        if mtp and layer_types(hf)[-1] != "full_attention":
            raise refuse("mtp_num_hidden_layers=1 after a last layer of linear attention",
                         "Megatron-Core's MTP layer repeats the decoder's last layer, and the release's is full attention")

    def check_mlp(self, hf):
        if not hf.get("num_experts"):
            raise refuse("num_experts=0 (a Qwen3-Next whose every layer is dense)", "no such model is released; open an issue")
        qwen_moe_layer_freq(hf)

    def adjust_from_hf(self, config, hf):
        return config.replace(qk_layernorm=True, layernorm_zero_centered_gamma=True, attention_output_gate=True,
                              mtp_num_layers=hf.get("mtp_num_hidden_layers") or None,
                              rotary_percent=rotary_fraction(hf, PARTIAL_ROTARY_DEFAULT), **linear_attention_from_hf(hf),
                              **self.mlp_from_hf(hf))

    def mlp_from_hf(self, hf) -> dict[str, Any]:
        return moe_from_hf(hf, topk=10, norm_topk_prob=True)  # transformers' Qwen3NextConfig defaults

    def check_megatron(self, config):
        super().check_megatron(config.replace(rotary_percent=1.0))  # partial rotary maps: checked here
        check_rotary_dims(config, self.name)
        if (config.mtp_num_layers or 0) > 1:
            raise ReshardError(f"the model has {config.mtp_num_layers} MTP layers, HF {self.name} one (behind one mtp.fc): "
                               "keep it in a Megatron format")
        if config.mtp_num_layers and config.layer_kinds[-1].mixer != "attention":
            raise ReshardError(f"the model's MTP layer is of linear attention (its last layer's kind), HF {self.name}'s full attention")

    def for_files(self, config, stored):
        return self, *without_absent_mtp(config, self.mappings(config), stored, "mtp_num_hidden_layers", ("mtp.",))

    def in_proj(self, config: ModelConfig) -> list[Mapping]:
        return fused_in_proj(config, self.text_prefix)

    def mlp(self, config: ModelConfig, kind: LayerKind, prefix: str) -> list[Mapping]:
        return moe_block(config, prefix) if kind.moe else llama_dense_mlp(prefix)

    def mappings(self, config):
        mixers = {"attention": gated_attention(self.text_prefix),
                  "gated_delta_net": gated_delta_net(config, self.in_proj(config), self.text_prefix)}
        decoder = by_layer(config, lambda kind: [*mixers[kind.mixer], *self.mlp(config, kind, self.text_prefix)])
        mtp = release_mtp_layer(config, [*gated_attention("mtp."), *self.mlp(config, config.layer_kinds[-1], "mtp.")])
        return [*embeddings_and_head(config, self.text_prefix), *decoder, *mtp]

    def adjust_to_hf(self, out, config):
        out["layer_types"] = ["linear_attention" if linear else "full_attention" for linear in config.linear_attention_layers]
        out.pop("full_attention_interval", None)  # layer_types says it
        out.update({field: getattr(config, field) for field in _LINEAR_DEFAULTS})
        if isinstance(out.get("rope_parameters"), dict):  # transformers 5 keeps it there
            out["rope_parameters"]["partial_rotary_factor"] = config.rotary_percent
        else:
            out["partial_rotary_factor"] = config.rotary_percent
        out["attention_bias"] = False
        if config.mtp_num_layers or "mtp_num_hidden_layers" in out:
            out["mtp_num_hidden_layers"] = config.mtp_num_layers or 0
        self.mlp_to_hf(out, config)

    def mlp_to_hf(self, out: dict[str, Any], config: ModelConfig) -> None:
        moe_to_hf(out, config)
