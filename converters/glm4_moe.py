"""GLM-4.5 / 4.6 / 4.7 (Glm4MoeForCausalLM): grouped-query attention with q/k/v biases (o_proj has none), optional
per-head q/k norms and partial RoPE, then DeepSeek-V3's mixture-of-experts block and MTP layers.

Attention is Llama's (`llama_attention`): q/k/v grouped into linear_qkv with their biases, q_norm/k_norm of one
head's width (replicated over TP). transformers' GLM rotates the first partial_rotary_factor of each head's dims
with rotate_half, as Megatron-Core's RoPE with rotary_percent does; the factor sits in `rope_parameters`
(transformers 5) or at the top level (the release's config.json), and is 0.5 where neither gives it, as in
transformers' GLM config. The MoE block is `deepseek_moe`'s: sigmoid router whose `e_score_correction_bias` is
Megatron-Core's `router.expert_bias` (a buffer, so never in optimizer state), shared experts, the first
first_k_dense_replace layers dense.

The MTP layers (`num_nextn_predict_layers`) are `mtp`'s. GLM-4.6 and later store no per-layer copy of the embedding
or output head, and Megatron-Bridge maps none; GLM-4.5's release keeps them: read (`Glm4Moe(mtp_copies=True)`, chosen
by the files), each must equal the model's (refused naming it otherwise), and the export is GLM-4.6's form, which the
conversion says. transformers saves no MTP layer: such a model converts without them and says so.
"""

from __future__ import annotations

from reshard.converters.base import (
    LLAMA_SIGNATURE,
    Family,
    bad_value,
    by_layer_kind,
    embeddings_and_head,
    llama_attention,
    llama_dense_mlp,
    refuse,
)
from reshard.converters.deepseek_moe import MOE_ROUTER, check_hf_moe, check_megatron_moe, deepseek_moe, moe_from_hf, moe_to_hf
from reshard.converters.mtp import copy_names, embeddings_and_heads, mtp_count, mtp_layers, without_absent_mtp
from reshard.converters.partial_rotary import check_rotary_dims, rotary_fraction

PARTIAL_ROTARY_DEFAULT = 0.5  # transformers' Glm4MoeConfig sets it where config.json does not


class Glm4Moe(Family):
    model_type = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    # q/k norms and q/k/v biases are each optional; the router, shared experts and plain attention are not
    signature = {
        **{k: v for k, v in LLAMA_SIGNATURE.items() if k not in ("add_qkv_bias", "qk_layernorm", "moe_router_num_groups",
                                                                 "moe_router_topk_scaling_factor")},
        **MOE_ROUTER,
        "moe": True,
        "shared_experts": True,
    }
    holds_mtp = True

    def __init__(self, mtp_copies: bool = False):
        self.mtp_copies = mtp_copies  # the MTP layers keep copies of the embedding and head (GLM-4.5's release)

    def allowed_flags(self):
        return {"attention_bias"}

    def check_hf(self, hf):
        # partial rotary is GLM's own: read by rotary_fraction(), not refused as in other families
        super().check_hf({k: v for k, v in hf.items() if k != "partial_rotary_factor"})
        mtp_count(hf)
        if check_hf_moe(hf) >= int(hf["num_hidden_layers"]):
            raise refuse("a GLM-4.5 config whose every layer is dense (first_k_dense_replace)", "convert it as its dense family")
        rotary_fraction(hf, PARTIAL_ROTARY_DEFAULT)
        if not isinstance(hf.get("use_qk_norm", False), bool):
            raise bad_value("use_qk_norm", hf["use_qk_norm"], "true or false")

    def adjust_from_hf(self, config, hf):
        return config.replace(
            add_qkv_bias=bool(hf.get("attention_bias", False)),
            qk_layernorm=hf.get("use_qk_norm", False),
            rotary_percent=rotary_fraction(hf, PARTIAL_ROTARY_DEFAULT),
            mtp_num_layers=hf.get("num_nextn_predict_layers") or None,
            **moe_from_hf(hf, default_scaling=1.0),
        )

    def for_files(self, config, stored):
        embeds, heads = copy_names(config)
        held = [name for name in (*embeds, *heads) if name in stored]
        family = Glm4Moe(mtp_copies=True) if held else self
        config, absent = without_absent_mtp(config, family.mappings(config), stored)
        if held:  # read to be checked equal to the model's, exported in GLM-4.6's form without them
            absent.append(f"MTP layers' copies of the embedding and head ({len(held)}, equal to the model's)")
        return family, config, absent

    def check_megatron(self, config):
        super().check_megatron(config.replace(rotary_percent=1.0))  # partial rotary maps: checked here
        check_rotary_dims(config, "GLM-4.5")
        check_megatron_moe(config, "GLM-4.5")

    def mappings(self, config):
        attention = llama_attention(config, qkv_bias=config.add_qkv_bias)
        dense, moe = [*attention, *llama_dense_mlp()], [*attention, *deepseek_moe(config)]
        mtp = mtp_layers(config, moe if config.moe_layers[-1] else dense)
        heads = embeddings_and_heads(config) if self.mtp_copies else embeddings_and_head(config)
        return [*heads, *by_layer_kind(config, dense, moe), *mtp]

    def adjust_to_hf(self, out, config):
        out.update(attention_bias=config.add_qkv_bias, use_qk_norm=config.qk_layernorm)
        if isinstance(out.get("rope_parameters"), dict):  # transformers 5 keeps it there
            out["rope_parameters"]["partial_rotary_factor"] = config.rotary_percent
        else:
            out["partial_rotary_factor"] = config.rotary_percent
        moe_to_hf(out, config)
        out["num_nextn_predict_layers"] = config.mtp_num_layers or 0
