"""Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration): Qwen3-VL (`converters/qwen3_vl.py`: the vision model in
Megatron-Bridge's form, DeepStack mergers, interleaved MRoPE) with Qwen3-MoE's language model (q/k norms, a top-k
softmax router whose k weights are always renormalised, no shared expert; `mlp_only_layers` / `decoder_sparse_step`
layers dense).

- Experts as the release stores them: fused 3-D tensors, `mlp.experts.gate_up_proj [E, H, 2I]` (per expert the
  transpose of Megatron's linear_fc1 [gate; up]: gate in the first I columns, up in the last, not interleaved) and
  `down_proj [E, I, H]` (linear_fc2 transposed). Each expert is one slice (`at_index`), read and written alone, and
  written back in the same form. transformers 5.24 builds them as [E, 2I, H] / [E, H, I] in memory and reads either
  orientation (its conversion's `Transpose(check_dims=True)`); a file in that other orientation is refused by shape, and
  a model whose hidden_size is twice moe_intermediate_size (the two orientations alike) is refused by name.
- Megatron side: Bridge's Qwen3VLModel as for Qwen3-VL, its language model a GPTModel with MoE layers.
"""

from __future__ import annotations

from typing import Any

from reshard.config import ModelConfig
from reshard.converters import qwen3_vl
from reshard.converters.base import (
    E,
    L,
    Mapping,
    Rename,
    Transposed,
    at_index,
    bad_value,
    by_layer_kind,
    embeddings_and_head,
    expert_count,
    llama_attention,
    llama_dense_mlp,
    qwen_moe_layer_freq,
    qwen_moe_layers_to_hf,
    refuse,
)
from reshard.converters.qwen3_vl import Qwen3VL

_VISION_CLASS = "transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe.Qwen3VLMoeVisionConfig"  # Bridge's provider's


def fused_experts(prefix: str) -> list[Mapping]:
    """An MoE layer's MLP with the experts fused and transposed as Qwen3-VL-MoE's release stores them."""
    m, p = "decoder.layers.mlp.", f"{prefix}layers.{L}."
    fused = f"{p}mlp.experts."
    return [
        Rename("decoder.layers.pre_mlp_layernorm.weight", f"{p}post_attention_layernorm.weight"),
        Rename(f"{m}router.weight", f"{p}mlp.gate.weight"),
        Transposed(f"{m}experts.experts.linear_fc1.weight", at_index(f"{fused}gate_up_proj", E)),
        Transposed(f"{m}experts.experts.linear_fc2.weight", at_index(f"{fused}down_proj", E)),
    ]


def from_bridge(model: dict[str, Any]) -> dict[str, Any]:
    """The Megatron args of a Bridge Qwen3VLMoEModelProvider beyond a GPT provider's: Qwen3-VL's (`qwen3_vl.from_bridge`)."""
    return qwen3_vl.from_bridge(model, Qwen3VLMoe.model_type)


def to_bridge(config: ModelConfig, hf: dict[str, Any] | None) -> dict[str, Any]:
    return qwen3_vl.to_bridge(config, hf, _VISION_CLASS)


class Qwen3VLMoe(Qwen3VL):
    model_type = "qwen3_vl_moe"
    architectures = ("Qwen3VLMoeForConditionalGeneration",)
    signature = {**Qwen3VL.signature, "moe": True, "shared_experts": False, "router_pre_softmax": False}
    text_type = "qwen3_vl_moe_text"

    def check_hf(self, hf):
        super().check_hf(hf)
        qwen_moe_layer_freq(hf)
        if int(hf["hidden_size"]) == 2 * int(hf["moe_intermediate_size"]):  # [E, H, 2I] square per expert: either way round
            raise refuse(f"hidden_size={hf['hidden_size']}, twice moe_intermediate_size", "the fused gate_up_proj's orientation "
                         "cannot be told from its shape (transformers reads it untransposed then, the release stores it transposed)")
        if hf.get("norm_topk_prob", True) is not True:  # transformers' router renormalises whatever config.json says
            raise bad_value("text_config.norm_topk_prob", hf["norm_topk_prob"], "true (Qwen3-VL-MoE's router renormalises its top-k)")

    def adjust_from_hf(self, config, hf):
        return super().adjust_from_hf(config, hf).replace(
            num_experts=expert_count(hf), moe_router_topk=int(hf.get("num_experts_per_tok", 4)),
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]), moe_router_pre_softmax=False, moe_layer_freq=qwen_moe_layer_freq(hf))

    def text_mappings(self, config):
        attention = llama_attention(config, self.text_prefix)
        dense, moe = [*attention, *llama_dense_mlp(self.text_prefix)], [*attention, *fused_experts(self.text_prefix)]
        return [*embeddings_and_head(config, self.text_prefix), *by_layer_kind(config, dense, moe)]

    def adjust_to_hf(self, out, config):
        super().adjust_to_hf(out, config)
        # transformers 5.24 saves num_experts as num_local_experts (its attribute_map); either is read back
        out["num_local_experts" if "num_experts" not in out else "num_experts"] = config.num_experts
        out.update(num_experts_per_tok=config.moe_router_topk, moe_intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size)
        qwen_moe_layers_to_hf(out, config)
