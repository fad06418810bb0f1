"""Mistral (MistralForCausalLM): Llama's tensors; sliding-window attention (Mistral 7B v0.1) is refused."""

from __future__ import annotations

from reshard.converters.llama import Llama


class Mistral(Llama):
    model_type = "mistral"
    architectures = ("MistralForCausalLM",)

    def adjust_to_hf(self, out, config):
        out["sliding_window"] = None
