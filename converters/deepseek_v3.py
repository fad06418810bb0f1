"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-latent attention (MLA) with YaRN on the decoupled rotary dims.

Every MLA tensor keeps its layout: HF's q_b_proj and kv_b_proj rows are [heads x (nope; rope)] and
[heads x (nope; v)], kv_a_proj_with_mqa's are [kv latent; rotary key], as Megatron-Core's up and down
projections hold them. HF's `rope_interleave` (pairs (x0, x1), (x2, x3), ... rotated together, the result
laid out as [evens; odds]) is what Megatron-Core's MLA computes with `rotary_interleaved` off: it
de-interleaves the rotary dims itself before rotating halves. HF's YaRN dict maps onto MLA's own YaRN
fields (rotary_scaling_factor, mscale, mscale_all_dim, beta_fast/slow, original_max_position_embeddings).

Megatron-Core normalises every norm with the one norm_epsilon (rms_norm_eps), the q/kv latents' too; transformers
normalises the latents with 1e-6 whatever rms_norm_eps says. A model with rms_norm_eps 1e-6 (DeepSeek-V3) is exact;
one with another (Kimi-K2's config.json says 1e-5) converts bit for bit, and Megatron-Core's latent norms add
1e-5 where transformers adds 1e-6 to a mean square of order one: logits within 1e-4 of transformers' in the tests.

Its mixture-of-experts layers (sigmoid router with expert bias, groups, shared experts, leading dense layers) are
`deepseek_moe`'s, its multi-token-prediction layers `mtp`'s: GLM-4.5 shares both.
"""

from __future__ import annotations

import copy
from typing import Any

from reshard.config import ModelConfig
from reshard.converters.base import (
    LLAMA_SIGNATURE,
    Family,
    L,
    Mapping,
    Rename,
    bad_value,
    by_layer_kind,
    llama_dense_mlp,
    number,
    refuse,
)
from reshard.converters.deepseek_moe import check_hf_moe, check_megatron_moe, deepseek_moe, moe_from_hf, moe_to_hf
from reshard.converters.mtp import embeddings_and_heads, mtp_count, mtp_layers, without_absent_mtp
from reshard.errors import ReshardError

# Kimi-K2 ships DeepSeek-V3's architecture (and `architectures`) under a model_type of its own, which its export keeps.
KIMI_K2 = "kimi_k2"
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
        dense, mtp = check_hf_moe(hf), mtp_count(hf)
        if mtp and dense >= int(hf["num_hidden_layers"]):
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
            **moe_from_hf(hf, default_scaling=2.5),
        )

    def for_files(self, config, stored):
        return self, *without_absent_mtp(config, self.mappings(config), stored)

    def check_megatron(self, config):
        super().check_megatron(config)
        if config.mtp_num_layers and not config.is_moe:
            raise ReshardError("HF DeepSeek-V3 makes every MTP layer an MoE layer, and this model has none: keep it in a Megatron format")
        if config.is_moe:
            check_megatron_moe(config, "DeepSeek-V3")

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

    def config_to_hf(self, config, saved=None, extras=None):
        kimi = bool(saved) and saved.get("model_type") == KIMI_K2
        out = super().config_to_hf(config, dict(saved, model_type=self.model_type) if kimi else saved, extras)
        return dict(out, model_type=KIMI_K2) if kimi else out

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
        )
        moe_to_hf(out, config)
        out["num_nextn_predict_layers"] = config.mtp_num_layers or 0
