"""Mixtral (MixtralForCausalLM): every layer a top-k MoE in `block_sparse_moe` (gate; experts.N.w1/w3/w2)."""

from __future__ import annotations

from reshard.converters.base import LLAMA_SIGNATURE, Family, embeddings_and_head, expert_count, llama_attention, moe_mlp


class Mixtral(Family):
    model_type = "mixtral"
    architectures = ("MixtralForCausalLM",)
    # every layer MoE: config.json cannot say that one is dense
    signature = {**LLAMA_SIGNATURE, "moe": True, "moe_dense_layers": False, "shared_experts": False, "router_pre_softmax": False}

    def adjust_from_hf(self, config, hf):
        return config.replace(
            num_experts=expert_count(hf),
            moe_router_topk=int(hf.get("num_experts_per_tok", 2)),
            moe_ffn_hidden_size=int(hf["intermediate_size"]),
        )

    def mappings(self, config):
        return [
            *embeddings_and_head(config),
            *llama_attention(config),
            *moe_mlp(config, "block_sparse_moe", "gate", "w1", "w3", "w2"),
        ]

    def adjust_to_hf(self, out, config):
        out["num_local_experts"] = config.num_experts
        out["num_experts_per_tok"] = config.moe_router_topk
        out["intermediate_size"] = config.moe_ffn_hidden_size or config.ffn_hidden_size
        out["sliding_window"] = None
