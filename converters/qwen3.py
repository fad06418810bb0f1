"""Qwen3 (Qwen3ForCausalLM): per-head RMSNorm on q and k (q_norm/k_norm <-> q_layernorm/k_layernorm)."""

from __future__ import annotations

from reshard.converters.base import LLAMA_SIGNATURE, Family, embeddings_and_head, llama_attention, llama_dense_mlp


class Qwen3(Family):
    model_type = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    signature = {**LLAMA_SIGNATURE, "qk_layernorm": True}

    def adjust_from_hf(self, config, hf):
        return config.replace(qk_layernorm=True)

    def mappings(self, config):
        return [*embeddings_and_head(config), *llama_attention(config), *llama_dense_mlp()]

    def adjust_to_hf(self, out, config):
        out["attention_bias"] = False
        out["use_sliding_window"] = False
