"""Qwen3.5, its text model (Qwen3_5ForCausalLM, model_type qwen3_5_text): Qwen3-Next's hybrid of Gated DeltaNet and
gated attention layers (`converters/qwen3_next.py`) with a dense MLP on every layer, and the Gated DeltaNet's input
projection split in four HF tensors instead of two fused ones.

- `linear_attn.in_proj_qkv [q (all key heads); k; v (all value heads)]`: megatron-core's query, key and value parts
  are its row bands in turn (`Rows`); `in_proj_z`, `in_proj_b`, `in_proj_a` are its z, beta and alpha parts as they are.
- RoPE: Qwen3.5's multimodal RoPE (`mrope_section`, `mrope_interleaved`) gives every section a text token's one
  position, so on text it is the plain partial RoPE megatron-core computes; the fields are kept for the export.

Its MoE is `converters/qwen3_5_moe.py`, the model with its vision tower (Qwen3_5ForConditionalGeneration)
`converters/qwen3_5_vl.py`. The MTP layer (`mtp.*`, a dense one) is mapped as Qwen3-Next's.
"""

from __future__ import annotations

from reshard.config import LayerKind, ModelConfig
from reshard.converters.base import LLAMA_SIGNATURE, L, Mapping, Rename, at_index, llama_dense_mlp, refuse
from reshard.converters.qwen3_next import Qwen3Next, Rows, conv_rows


def split_in_proj(config: ModelConfig, prefix: str = "model.") -> list[Mapping]:
    """Qwen3.5's in_proj_qkv (the convolution's channels in order: `conv_rows`), in_proj_z, in_proj_b, in_proj_a."""
    a, p = "decoder.layers.self_attention.in_proj.weight.", f"{prefix}layers.{L}.linear_attn."
    qkv = [Rows(f"{a}{part}", [at_index(f"{p}in_proj_qkv.weight", str(row)) for row in rows]) for part, rows in conv_rows(config).items()]
    return [*qkv, Rename(f"{a}z", f"{p}in_proj_z.weight"), Rename(f"{a}beta", f"{p}in_proj_b.weight"),
            Rename(f"{a}alpha", f"{p}in_proj_a.weight")]


class Qwen3_5(Qwen3Next):
    model_type = "qwen3_5_text"
    architectures = ("Qwen3_5ForCausalLM",)
    name = "Qwen3.5"
    signature = {**{k: v for k, v in LLAMA_SIGNATURE.items() if k != "experimental_attention_variant"},
                 "qk_layernorm": True, "layernorm_zero_centered_gamma": True, "attention_output_gate": True}

    def check_mlp(self, hf):
        if hf.get("num_experts"):
            raise refuse(f"num_experts={hf['num_experts']} in a Qwen3.5 text model", "Qwen3.5's MoE models are not mapped yet")

    def mlp_from_hf(self, hf):
        return {}

    def in_proj(self, config):
        return split_in_proj(config, self.text_prefix)

    def mlp(self, config: ModelConfig, kind: LayerKind, prefix: str) -> list[Mapping]:
        return llama_dense_mlp(prefix)

    def mlp_to_hf(self, out, config):
        return None

    def config_to_hf(self, config, saved=None, extras=None):
        out = super().config_to_hf(config, saved, extras)
        if saved and saved.get("model_type") == self.model_type and isinstance(out.get("rope_parameters"), dict):
            sections = saved.get("rope_parameters") or {}  # the multimodal RoPE's, which megatron-core does not hold
            out["rope_parameters"].update({k: v for k, v in sections.items() if k.startswith("mrope_")})
        return out
