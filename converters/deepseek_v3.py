"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-latent attention (MLA) with YaRN on the decoupled rotary dims.

Every MLA tensor keeps its layout: HF's q_b_proj and kv_b_proj rows are [heads x (nope; rope)] and
[heads x (nope; v)], kv_a_proj_with_mqa's are [kv latent; rotary key], as Megatron-Core's up and down
projections hold them. HF's `rope_interleave` (pairs (x0, x1), (x2, x3), ... rotated together, the result
laid out as [evens; odds]) is what Megatron-Core's MLA computes with `rotary_interleaved` off: it
de-interleaves the rotary dims itself before rotating halves. HF's YaRN dict maps onto MLA's own YaRN
fields (rotary_scaling_factor, mscale, mscale_all_dim, beta_fast/slow, original_max_position_embeddings).

Mixture-of-experts layers map onto Megatron-Core's sigmoid router: `e_score_correction_bias` is its
`expert_bias` (added for the choice only), n_group/topk_group its group-limited top-k (transformers ranks a
group by its top two scores, Megatron by its top topk/group_topk: they agree when topk = 2 * topk_group),
routed_scaling_factor its topk scaling factor; Megatron renormalises the chosen sigmoid weights whenever
top-k > 1, so norm_topk_prob must say the same. The shared experts are one shared-expert MLP of
n_shared_experts * moe_intermediate_size. The first first_k_dense_replace layers are dense (Megatron's
moe_layer_freq as a list); a model that mixes them is keyed layer by layer (`decoder.layers.{i}.`), as
Megatron-Core's torch_dist keys it.

Multi-token-prediction (MTP) layer i is HF's `model.layers.{num_hidden_layers + i}` and Megatron-Core's
`mtp.layers.{i}`: enorm, hnorm and eh_proj by name (both concatenate [normed embedding; normed hidden state]),
shared_head.norm is its final_layernorm, and the rest is a decoder layer of the decoder's last layer's kind
(`transformer_layer.*`). HF stores its own copy of the embedding (`embed_tokens`) and of the output head
(`shared_head.head`) in every MTP layer, where Megatron-Core shares the model's: the copies are read only when
equal to the model's (refused otherwise, never dropped) and written back as copies.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from reshard.config import ModelConfig
from reshard.converters.base import (
    LLAMA_SIGNATURE,
    Family,
    GatedMLP,
    L,
    Mapping,
    Rename,
    Tensor,
    at_layer,
    bad_value,
    by_layer_kind,
    embeddings_and_head,
    llama_dense_mlp,
    moe_mlp,
    number,
    refuse,
)
from reshard.errors import ReshardError

# transformers builds q_a_layernorm and kv_a_layernorm with this epsilon whatever rms_norm_eps says; Megatron
# uses its one layernorm_epsilon for every norm.
HF_LATENT_NORM_EPS = 1e-6
# The keys of an HF yarn dict that reshard reads or checks; any other is refused.
_YARN_KEYS = {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "truncate", "attention_factor", "rope_theta"}
# HF yarn key -> MLA field.
_YARN_TO_HF = {"factor": "rotary_scaling_factor", "original_max_position_embeddings": "original_max_position_embeddings",
               "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}


def yarn_fields(config: ModelConfig) -> dict[str, Any]:
    """A model's MLA YaRN fields, as `yarn_from_hf` gives them."""
    return {"rope_type": "yarn", **{field: getattr(config, field) for field in _YARN_TO_HF.values()}}


def yarn_from_hf(scaling: dict[str, Any]) -> dict[str, Any]:
    """MLA's YaRN fields for an HF yarn dict, refusing what they cannot express."""
    unknown = sorted(set(scaling) - _YARN_KEYS)
    if unknown:
        raise refuse(f"rope_scaling key {unknown[0]!r}", "reshard maps YaRN's factor, betas, mscales and original length only")
    if scaling.get("attention_factor") is not None:
        raise refuse("rope_scaling.attention_factor", "Megatron-Core's MLA derives it from mscale/mscale_all_dim")
    if scaling.get("truncate", True) is not True:
        raise refuse("rope_scaling.truncate=false", "Megatron-Core's MLA rounds YaRN's correction range to whole dims")
    if "original_max_position_embeddings" not in scaling:
        raise refuse("yarn rope_scaling without original_max_position_embeddings", "config.json must give it")
    original = scaling["original_max_position_embeddings"]
    if type(original) is not int or original < 1:
        raise bad_value("rope_scaling.original_max_position_embeddings", original, "a positive whole number")
    factor = number(scaling.get("factor"), "rope_scaling.factor")
    if not factor > 0:
        raise bad_value("rope_scaling.factor", factor, "a positive number")
    mscale = number(scaling.get("mscale") or 0.0, "rope_scaling.mscale")
    mscale_all_dim = number(scaling.get("mscale_all_dim") or 0.0, "rope_scaling.mscale_all_dim")
    if mscale_all_dim and not mscale:
        # transformers then scales cos/sin by yarn's default mscale but the softmax by mscale_all_dim's
        raise refuse("rope_scaling.mscale_all_dim without mscale", "Megatron-Core's MLA cannot scale the two apart")
    if not mscale_all_dim:
        mscale = 1.0  # transformers ignores mscale without mscale_all_dim
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": number(scaling.get("beta_fast") or 32, "rope_scaling.beta_fast"),
        "beta_slow": number(scaling.get("beta_slow") or 1, "rope_scaling.beta_slow"),
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


def mla_attention(config: ModelConfig, prefix: str = "model.") -> list[Mapping]:
    """Multi-latent attention block of decoder layer {layer}: names differ, layouts do not."""
    a, p = "decoder.layers.self_attention.", f"{prefix}layers.{L}.self_attn."
    out: list[Mapping] = [Rename("decoder.layers.input_layernorm.weight", f"{prefix}layers.{L}.input_layernorm.weight")]
    if config.q_lora_rank:
        out += [
            Rename(f"{a}linear_q_down_proj.weight", f"{p}q_a_proj.weight"),
            Rename(f"{a}linear_q_up_proj.layer_norm_weight", f"{p}q_a_layernorm.weight"),
            Rename(f"{a}linear_q_up_proj.weight", f"{p}q_b_proj.weight"),
        ]
    else:
        out.append(Rename(f"{a}linear_q_proj.weight", f"{p}q_proj.weight"))
    return [
        *out,
        Rename(f"{a}linear_kv_down_proj.weight", f"{p}kv_a_proj_with_mqa.weight"),
        Rename(f"{a}linear_kv_up_proj.layer_norm_weight", f"{p}kv_a_layernorm.weight"),
        Rename(f"{a}linear_kv_up_proj.weight", f"{p}kv_b_proj.weight"),
        Rename(f"{a}linear_proj.weight", f"{p}o_proj.weight"),
    ]


def deepseek_moe(config: ModelConfig, prefix: str = "model.") -> list[Mapping]:
    """Routed experts, the router's correction bias, and the shared experts of MoE layer {layer}."""
    m, p = "decoder.layers.mlp.", f"{prefix}layers.{L}.mlp."
    return [
        *moe_mlp(config, "mlp", "gate", "gate_proj", "up_proj", "down_proj", prefix),
        Rename(f"{m}router.expert_bias", f"{p}gate.e_score_correction_bias"),
        GatedMLP(f"{m}shared_experts.linear_fc1.weight", f"{p}shared_experts.gate_proj.weight", f"{p}shared_experts.up_proj.weight"),
        Rename(f"{m}shared_experts.linear_fc2.weight", f"{p}shared_experts.down_proj.weight"),
    ]


def _same_bytes(a: Tensor, b: Tensor, step: int = 1 << 26) -> bool:
    """Whether two arrays hold the same bytes, compared a bounded run at a time (an embedding is gigabytes)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = (np.ascontiguousarray(t).reshape(-1).view(np.uint8) for t in (a, b))
    return all(np.array_equal(a[i : i + step], b[i : i + step]) for i in range(0, a.size, step))


class Copies(Mapping):
    """One Megatron tensor that HF stores several times (the model's, then each MTP layer's copy): read, every
    copy must hold the model's bytes; written, each gets them."""

    def __init__(self, megatron: str, *hf: str):
        object.__setattr__(self, "megatron", megatron)
        object.__setattr__(self, "hf", hf)

    def to_megatron(self, tensors: list[Tensor], config: ModelConfig) -> Tensor:
        for name, other in zip(self.hf[1:], tensors[1:]):
            if not _same_bytes(tensors[0], other):
                raise ReshardError(
                    f"HF tensor {name} differs from {self.hf[0]}: Megatron-Core's MTP layers share the model's "
                    "embedding and output layer, so a model whose MTP copies differ cannot be converted without losing one"
                )
        return tensors[0]

    def to_hf(self, tensor: Tensor, config: ModelConfig) -> list[Tensor]:
        return [tensor] * len(self.hf)


def mtp_layers(config: ModelConfig, layer: list[Mapping]) -> list[Mapping]:
    """The MTP layers' own tensors, `layer` being the decoder layer mappings of their transformer layers' kind."""
    out: list[Mapping] = []
    for i in range(config.mtp_num_layers or 0):
        m, p = f"mtp.layers.{i}.", f"model.layers.{config.num_layers + i}."
        out += [
            Rename(f"{m}enorm.weight", f"{p}enorm.weight"),
            Rename(f"{m}hnorm.weight", f"{p}hnorm.weight"),
            Rename(f"{m}eh_proj.weight", f"{p}eh_proj.weight"),
            Rename(f"{m}final_layernorm.weight", f"{p}shared_head.norm.weight"),
            *(at_layer(mapping, config.num_layers + i, f"{m}transformer_layer.") for mapping in layer),
        ]
    return out


def embeddings_and_heads(config: ModelConfig) -> list[Mapping]:
    """The embedding, final norm and output layer, with the copies of the embedding and head each MTP layer keeps."""
    table = embeddings_and_head(config)
    if not config.mtp_num_layers:
        return table
    mtp = [f"model.layers.{config.num_layers + i}." for i in range(config.mtp_num_layers)]
    embeds, heads = [f"{p}embed_tokens.weight" for p in mtp], [f"{p}shared_head.head.weight" for p in mtp]
    if config.tied_embeddings:
        return [Copies("embedding.word_embeddings.weight", "model.embed_tokens.weight", *embeds, *heads), *table[1:]]
    return [Copies("embedding.word_embeddings.weight", "model.embed_tokens.weight", *embeds), table[1],
            Copies("output_layer.weight", "lm_head.weight", *heads)]


def dense_layers(config: ModelConfig) -> int | None:
    """HF's first_k_dense_replace of a model: its leading dense layers, all others MoE (None: not so laid out)."""
    kinds = config.moe_layers
    first = kinds.index(True) if True in kinds else len(kinds)
    return first if all(kinds[first:]) else None


# Megatron's router settings a DeepSeek-V3 MoE model fixes (the rest is checked in check_megatron).
_MOE_ROUTER = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}


class DeepseekV3(Family):
    model_type = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    # dense or MoE, with or without routing groups and scaling: check_megatron looks at those together
    signature = {
        **{k: v for k, v in LLAMA_SIGNATURE.items() if not k.startswith("moe")},
        "qk_layernorm": True,
        "multi_latent_attention": True,
    }
    holds_mtp = True

    def check_hf(self, hf):
        super().check_hf(hf)
        layers = int(hf["num_hidden_layers"])
        dense = hf.get("first_k_dense_replace")
        if type(dense) is not int or dense < 0:
            raise bad_value("first_k_dense_replace", dense, "a whole number of leading dense layers")
        if dense < layers:
            self._check_hf_moe(hf)
        mtp = hf.get("num_nextn_predict_layers") or 0
        if type(mtp) is not int or not 0 <= mtp < 1 << 16:
            raise bad_value("num_nextn_predict_layers", mtp, "a whole number of MTP layers")
        if mtp and dense >= layers:
            raise refuse(
                "MTP layers in a model without MoE layers",
                "transformers' DeepSeek-V3 makes an MTP layer MoE (its index is past first_k_dense_replace) where "
                "Megatron-Core repeats the decoder's last (dense) layer",
            )
        if hf.get("rope_interleave", True) is not True:
            raise refuse("rope_interleave=false", "Megatron-Core's MLA rotates the rotary dims as interleaved pairs")
        heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads")
        if kv not in (None, heads):
            raise bad_value("num_key_value_heads", kv, f"num_attention_heads={heads} (MLA has a key and value per head)")
        if float(hf.get("rms_norm_eps", 1e-6)) != HF_LATENT_NORM_EPS:
            raise refuse(
                f"rms_norm_eps={hf['rms_norm_eps']}",
                f"transformers normalises the q/kv latents with eps {HF_LATENT_NORM_EPS} whatever it says, Megatron with it",
            )

    @staticmethod
    def _check_hf_moe(hf):
        experts, topk = hf.get("n_routed_experts"), hf.get("num_experts_per_tok")
        for field in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group"):
            if type(hf.get(field)) is not int or not 0 < hf[field] < 1 << 31:
                raise bad_value(field, hf.get(field), "a whole number from 1")
        if topk > experts:
            raise bad_value("num_experts_per_tok", topk, f"at most the {experts} experts")
        groups, group_topk = hf["n_group"], hf["topk_group"]
        if experts % groups or group_topk > groups:
            raise bad_value("n_group", groups, f"a divisor of n_routed_experts={experts} of at least topk_group={group_topk}")
        if groups > 1 and topk != 2 * group_topk:
            raise refuse(
                f"num_experts_per_tok={topk} with topk_group={group_topk}",
                "transformers ranks a group by its best two experts, Megatron-Core by its best topk/topk_group: "
                "only topk = 2 * topk_group maps exactly",
            )
        if bool(hf.get("norm_topk_prob", True)) != (topk > 1):
            raise refuse(
                f"norm_topk_prob={hf.get('norm_topk_prob')} with num_experts_per_tok={topk}",
                "Megatron-Core renormalises the chosen sigmoid weights exactly when top-k > 1",
            )

    def rope_scaling_from_hf(self, scaling, hf):
        if not scaling:
            return {"rope_type": "rope"}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "yarn":
            raise refuse(f"rope_scaling type {kind!r}", "Megatron-Core's multi-latent attention implements YaRN only")
        return yarn_from_hf(scaling)

    def adjust_from_hf(self, config, hf):
        return config.replace(
            multi_latent_attention=True,
            qk_layernorm=True,
            num_query_groups=None,
            kv_channels=int(hf["v_head_dim"]),
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_head_dim=int(hf["qk_nope_head_dim"]),
            qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            mtp_num_layers=hf.get("num_nextn_predict_layers") or None,
            **(self._moe_from_hf(hf) if hf["first_k_dense_replace"] < hf["num_hidden_layers"] else {}),
        )

    @staticmethod
    def _moe_from_hf(hf):
        ffn, dense, layers = int(hf["moe_intermediate_size"]), hf["first_k_dense_replace"], hf["num_hidden_layers"]
        return dict(
            _MOE_ROUTER,
            moe_layer_freq=(0,) * dense + (1,) * (layers - dense) if dense else 1,
            num_experts=hf["n_routed_experts"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=ffn,
            moe_shared_expert_intermediate_size=ffn * hf["n_shared_experts"],
            moe_router_num_groups=hf["n_group"] if hf["n_group"] > 1 else None,
            moe_router_group_topk=hf["topk_group"] if hf["n_group"] > 1 else None,
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
        )

    def check_megatron(self, config):
        super().check_megatron(config)
        if config.norm_epsilon != HF_LATENT_NORM_EPS:
            raise refuse(f"norm_epsilon={config.norm_epsilon}", f"HF DeepSeek-V3 normalises the q/kv latents with eps {HF_LATENT_NORM_EPS}")
        if config.mtp_num_layers and not config.is_moe:
            raise ReshardError("HF DeepSeek-V3 makes every MTP layer an MoE layer, and this model has none: keep it in a Megatron format")
        if not config.is_moe:
            return
        routing = {key: getattr(config, key) for key in _MOE_ROUTER}
        shared, ffn = config.moe_shared_expert_intermediate_size, config.moe_ffn_hidden_size or config.ffn_hidden_size
        if routing != _MOE_ROUTER or dense_layers(config) is None or not shared or shared % ffn:
            raise refuse(
                f"a MoE model with {routing}, moe_layer_freq={config.moe_layer_freq}, shared experts of {shared}",
                "HF DeepSeek-V3 routes by sigmoid with an expert bias on every layer, with shared experts of a multiple of "
                "moe_ffn_hidden_size",
            )
        groups, group_topk = config.moe_router_num_groups or 1, config.moe_router_group_topk or 1
        if groups > 1 and config.moe_router_topk != 2 * group_topk:
            raise refuse(f"moe_router_topk={config.moe_router_topk} with moe_router_group_topk={group_topk}",
                         "HF DeepSeek-V3 ranks a group by its best two experts")

    def mappings(self, config):
        dense, moe = [*mla_attention(config), *llama_dense_mlp()], [*mla_attention(config), *deepseek_moe(config)]
        mtp = mtp_layers(config, moe if config.moe_layers[-1] else dense)
        return [*embeddings_and_heads(config), *by_layer_kind(config, dense, moe), *mtp]

    def rope_scaling_to_hf(self, config, saved_scaling):
        if config.mla_rope_type != "yarn":
            return None
        fields = yarn_fields(config)
        if saved_scaling and saved_scaling.get("rope_type", saved_scaling.get("type")) == "yarn":
            try:
                if yarn_from_hf(saved_scaling) == fields:
                    return copy.deepcopy(saved_scaling)
            except ReshardError:
                pass  # a saved dict this model no longer agrees with is rewritten
        return {"rope_type": "yarn", **{hf: fields[megatron] for hf, megatron in _YARN_TO_HF.items()}}

    def adjust_to_hf(self, out, config):
        out.update(
            num_key_value_heads=config.num_attention_heads,
            head_dim=config.qk_pos_emb_head_dim,  # transformers' DeepSeek-V3 sets it so: its rotary width
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_head_dim,
            qk_rope_head_dim=config.qk_pos_emb_head_dim,
            qk_head_dim=config.qk_head_dim + config.qk_pos_emb_head_dim,
            v_head_dim=config.v_head_dim,
            rope_interleave=True,
            attention_bias=False,
            first_k_dense_replace=dense_layers(config),
        )
        if config.is_moe:
            ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
            out.update(
                n_routed_experts=config.num_experts,
                num_experts_per_tok=config.moe_router_topk,
                moe_intermediate_size=ffn,
                n_shared_experts=config.moe_shared_expert_intermediate_size // ffn,
                n_group=config.moe_router_num_groups or 1,
                topk_group=config.moe_router_group_topk or 1,
                routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
                norm_topk_prob=config.moe_router_topk > 1,
            )
        out["num_nextn_predict_layers"] = config.mtp_num_layers or 0

