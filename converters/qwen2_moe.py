"""Qwen2-MoE (Qwen2MoeForCausalLM, Qwen1.5-MoE): Qwen2's q/k/v biases, and on every layer an MoE block `mlp`
(gate; experts.N.gate/up/down_proj) plus a shared expert (`shared_expert`) scaled by sigmoid(`shared_expert_gate`).

Routing is a softmax over all experts, then top-k; `norm_topk_prob` renormalises the k weights. Megatron-Core's
default router (top-k of the logits, softmax over those) computes the renormalised form; `moe_router_pre_softmax`
computes the other (softmax, then top-k), so both map exactly.
"""

from __future__ import annotations

from reshard.converters.base import (
    LLAMA_SIGNATURE,
    Family,
    check_all_moe,
    embeddings_and_head,
    expert_count,
    llama_attention,
    moe_mlp,
    refuse,
    shared_expert_mlp,
)


class Qwen2Moe(Family):
    model_type = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    signature = {**LLAMA_SIGNATURE, "add_qkv_bias": True, "moe": True, "shared_experts": True, "shared_expert_gate": True}

    def check_hf(self, hf):
        super().check_hf(hf)
        if not hf.get("qkv_bias", True):  # transformers before v5 had no such option: the biases were always there
            raise refuse("qkv_bias=false", "only Qwen2-MoE models with q/k/v biases are mapped")
        check_all_moe(hf, "Qwen2-MoE")

    def adjust_from_hf(self, config, hf):
        return config.replace(
            add_qkv_bias=True,
            num_experts=expert_count(hf),
            moe_router_topk=int(hf.get("num_experts_per_tok", 4)),
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            moe_shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]),
            moe_shared_expert_gate=True,
            moe_router_pre_softmax=not hf.get("norm_topk_prob", False),  # transformers' default: false
        )

    def mappings(self, config):
        return [
            *embeddings_and_head(config),
            *llama_attention(config, qkv_bias=True),
            *moe_mlp(config, "mlp", "gate", "gate_proj", "up_proj", "down_proj"),
            *shared_expert_mlp(config, "mlp.shared_expert", "mlp.shared_expert_gate"),
        ]

    def adjust_to_hf(self, out, config):
        out["num_experts"] = config.num_experts
        out["num_experts_per_tok"] = config.moe_router_topk
        out["moe_intermediate_size"] = config.moe_ffn_hidden_size or config.ffn_hidden_size
        out["shared_expert_intermediate_size"] = config.moe_shared_expert_intermediate_size
        out["norm_topk_prob"] = not config.moe_router_pre_softmax
        out["decoder_sparse_step"] = 1
        out["mlp_only_layers"] = []
        out["qkv_bias"] = True
        out["use_sliding_window"] = False
