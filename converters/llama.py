"""Llama 2/3 (LlamaForCausalLM), including llama3 RoPE scaling (Megatron's rope_scaling/rope_scaling_factor)."""

from __future__ import annotations

from reshard.converters.base import LLAMA_SIGNATURE, Family, embeddings_and_head, llama_attention, llama_dense_mlp


class Llama(Family):
    model_type = "llama"
    architectures = ("LlamaForCausalLM",)
    signature = {**LLAMA_SIGNATURE}

    def mappings(self, config):
        return [*embeddings_and_head(config), *llama_attention(config), *llama_dense_mlp()]

    def adjust_to_hf(self, out, config):
        out.setdefault("attention_bias", False)
        out.setdefault("mlp_bias", False)
