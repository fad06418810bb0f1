"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): Llama plus q/k/v biases (Megatron add_qkv_bias)."""

from __future__ import annotations

from reshard.converters.base import LLAMA_SIGNATURE, Family, embeddings_and_head, llama_attention, llama_dense_mlp


class Qwen2(Family):
    model_type = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    signature = {**LLAMA_SIGNATURE, "add_qkv_bias": True}

    def adjust_from_hf(self, config, hf):
        return config.replace(add_qkv_bias=True)  # Qwen2 always has q/k/v biases and no others

    def mappings(self, config):
        return [*embeddings_and_head(config), *llama_attention(config, qkv_bias=True), *llama_dense_mlp()]

    def adjust_to_hf(self, out, config):
        out["use_sliding_window"] = False
