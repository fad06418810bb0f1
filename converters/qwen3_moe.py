"""Qwen3-MoE (Qwen3MoeForCausalLM): q/k norms and an MoE block `mlp` (gate; experts.N.gate/up/down_proj) on every layer.

Qwen3-MoE has no shared experts. Routing is Qwen2-MoE's (`qwen2_moe`): a softmax over all experts, top-k, and
with `norm_topk_prob` the k weights renormalised; Megatron-Core's default router computes the renormalised
form and `moe_router_pre_softmax` the other. Dense layers between MoE ones are mapped as in Qwen2-MoE.
"""

from __future__ import annotations

from reshard.converters.base import (
    LLAMA_SIGNATURE,
    Family,
    by_layer_kind,
    embeddings_and_head,
    expert_count,
    llama_attention,
    llama_dense_mlp,
    moe_mlp,
    qwen_moe_layer_freq,
    qwen_moe_layers_to_hf,
)


class Qwen3Moe(Family):
    model_type = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    signature = {**LLAMA_SIGNATURE, "qk_layernorm": True, "moe": True, "shared_experts": False}

    def check_hf(self, hf):
        super().check_hf(hf)
        qwen_moe_layer_freq(hf)

    def adjust_from_hf(self, config, hf):
        return config.replace(
            qk_layernorm=True,
            num_experts=expert_count(hf),
            moe_router_topk=int(hf.get("num_experts_per_tok", 8)),
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            moe_router_pre_softmax=not hf.get("norm_topk_prob", False),  # transformers' default: false
            moe_layer_freq=qwen_moe_layer_freq(hf),
        )

    def mappings(self, config):
        attention = llama_attention(config)
        moe = moe_mlp(config, "mlp", "gate", "gate_proj", "up_proj", "down_proj")
        return [*embeddings_and_head(config), *by_layer_kind(config, [*attention, *llama_dense_mlp()], [*attention, *moe])]

    def adjust_to_hf(self, out, config):
        key = "num_local_experts" if "num_local_experts" in out and "num_experts" not in out else "num_experts"
        out[key] = config.num_experts
        out["num_experts_per_tok"] = config.moe_router_topk
        out["moe_intermediate_size"] = config.moe_ffn_hidden_size or config.ffn_hidden_size
        out["norm_topk_prob"] = not config.moe_router_pre_softmax
        qwen_moe_layers_to_hf(out, config)
        out["attention_bias"] = False
        out["use_sliding_window"] = False
