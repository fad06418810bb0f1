"""Qwen2-MoE (Qwen2MoeForCausalLM, Qwen1.5-MoE): Qwen2's q/k/v biases, and on every layer an MoE block `mlp`
(gate; experts.N.gate/up/down_proj) plus a shared expert (`shared_expert`) scaled by sigmoid(`shared_expert_gate`).

Routing is a softmax over all experts, then top-k; `norm_topk_prob` renormalises the k weights. Megatron-Core's
default router (top-k of the logits, softmax over those) computes the renormalised form; `moe_router_pre_softmax`
computes the other (softmax, then top-k), so both map exactly. Layers named in `mlp_only_layers` (or skipped by
`decoder_sparse_step`) are dense MLPs of `intermediate_size`, Megatron's dense layers of a list moe_layer_freq.
"""

from __future__ import annotations

from typing import Any

from reshard.config import ModelConfig
from reshard.converters.base import (
    LLAMA_SIGNATURE,
    Family,
    Mapping,
    by_layer_kind,
    embeddings_and_head,
    expert_count,
    llama_attention,
    llama_dense_mlp,
    moe_mlp,
    qwen_moe_layer_freq,
    qwen_moe_layers_to_hf,
    refuse,
    shared_expert_mlp,
)


def moe_from_hf(hf: dict[str, Any], topk: int, norm_topk_prob: bool) -> dict[str, Any]:
    """Megatron's fields of the MoE block (Qwen3-Next's too): experts, top-k, the gated shared expert, the routing,
    which layers are dense; `topk` and `norm_topk_prob` where config.json does not say them (the family's defaults)."""
    return dict(
        num_experts=expert_count(hf),
        moe_router_topk=int(hf.get("num_experts_per_tok", topk)),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        moe_shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]),
        moe_shared_expert_gate=True,
        moe_router_pre_softmax=not hf.get("norm_topk_prob", norm_topk_prob),
        moe_layer_freq=qwen_moe_layer_freq(hf),
    )


def moe_block(config: ModelConfig, prefix: str = "model.") -> list[Mapping]:
    """The MoE layer's MLP: router, experts, and the shared expert with its gate; HF names under `prefix`."""
    return [*moe_mlp(config, "mlp", "gate", "gate_proj", "up_proj", "down_proj", prefix),
            *shared_expert_mlp(config, "mlp.shared_expert", "mlp.shared_expert_gate", prefix)]


def moe_to_hf(out: dict[str, Any], config: ModelConfig) -> None:
    """The inverse of `moe_from_hf`."""
    out["num_experts"] = config.num_experts
    out["num_experts_per_tok"] = config.moe_router_topk
    out["moe_intermediate_size"] = config.moe_ffn_hidden_size or config.ffn_hidden_size
    out["shared_expert_intermediate_size"] = config.moe_shared_expert_intermediate_size
    out["norm_topk_prob"] = not config.moe_router_pre_softmax
    qwen_moe_layers_to_hf(out, config)


class Qwen2Moe(Family):
    model_type = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    signature = {**LLAMA_SIGNATURE, "add_qkv_bias": True, "moe": True, "shared_experts": True, "shared_expert_gate": True}

    def check_hf(self, hf):
        super().check_hf(hf)
        if not hf.get("qkv_bias", True):  # transformers before v5 had no such option: the biases were always there
            raise refuse("qkv_bias=false", "only Qwen2-MoE models with q/k/v biases are mapped")
        qwen_moe_layer_freq(hf)

    def adjust_from_hf(self, config, hf):
        return config.replace(
            add_qkv_bias=True,
            **moe_from_hf(hf, topk=4, norm_topk_prob=False),  # transformers' Qwen2MoeConfig defaults
        )

    def mappings(self, config):
        attention = llama_attention(config, qkv_bias=True)
        return [*embeddings_and_head(config), *by_layer_kind(config, [*attention, *llama_dense_mlp()], [*attention, *moe_block(config)])]

    def adjust_to_hf(self, out, config):
        moe_to_hf(out, config)
        if out.get("head_dim") == config.hidden_size // config.num_attention_heads:
            del out["head_dim"]  # not a Qwen2MoeConfig field: transformers derives it so
        out["qkv_bias"] = True
        out["use_sliding_window"] = False
