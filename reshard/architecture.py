"""The logical tensors a GPT model of a given config has, by canonical (torch_dist) name and shape.

Used to check that a source holds every tensor the model needs (no silently missing weights), to
build synthetic checkpoints, and by importers that must produce the Megatron-Core tensor set.
"""

from __future__ import annotations

from reshard.config import ModelConfig


def _norm(prefix: str, config: ModelConfig, width: int, layers: list[int]) -> dict[str, tuple[int, ...]]:
    out = {f"{prefix}weight": (*layers, width)}
    if config.normalization == "LayerNorm":
        out[f"{prefix}bias"] = (*layers, width)
    return out


def _linear(prefix: str, out_features: int, in_features: int, bias: bool, lead: list[int]) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}weight": (*lead, out_features, in_features)}
    if bias:
        shapes[f"{prefix}bias"] = (*lead, out_features)
    return shapes


def model_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> global shape, with every decoder layer stacked on a leading layer axis."""
    c = config
    h, L = c.hidden_size, [c.num_layers]
    gate = 2 if c.swiglu else 1
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (c.padded_vocab_size, h)}
    if c.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = (c.max_position_embeddings, h)
    attn = "decoder.layers.self_attention."
    out.update(_norm(f"{attn}linear_qkv.layer_norm_", c, h, L))
    qkv_rows = (c.num_attention_heads + 2 * c.groups) * c.head_dim
    out.update(_linear(f"{attn}linear_qkv.", qkv_rows, h, c.add_qkv_bias or c.add_bias_linear, L))
    if c.qk_layernorm:
        out.update(_norm(f"{attn}q_layernorm.", c, c.head_dim, L))
        out.update(_norm(f"{attn}k_layernorm.", c, c.head_dim, L))
    out.update(_linear(f"{attn}linear_proj.", h, c.num_attention_heads * c.head_dim, c.add_bias_linear, L))
    mlp = "decoder.layers.mlp."
    if c.is_moe:
        assert c.num_experts is not None
        ffn = c.moe_ffn_hidden_size or c.ffn_hidden_size
        out.update(_norm("decoder.layers.pre_mlp_layernorm.", c, h, L))
        out[f"{mlp}router.weight"] = (c.num_layers, c.num_experts, h)
        lead = [c.num_layers, c.num_experts]
        out.update(_linear(f"{mlp}experts.experts.linear_fc1.", gate * ffn, h, c.add_bias_linear, lead))
        out.update(_linear(f"{mlp}experts.experts.linear_fc2.", h, ffn, c.add_bias_linear, lead))
        if c.moe_shared_expert_intermediate_size:
            shared = c.moe_shared_expert_intermediate_size
            out.update(_linear(f"{mlp}shared_experts.linear_fc1.", gate * shared, h, c.add_bias_linear, L))
            out.update(_linear(f"{mlp}shared_experts.linear_fc2.", h, shared, c.add_bias_linear, L))
    else:
        out.update(_norm(f"{mlp}linear_fc1.layer_norm_", c, h, L))
        out.update(_linear(f"{mlp}linear_fc1.", gate * c.ffn_hidden_size, h, c.add_bias_linear, L))
        out.update(_linear(f"{mlp}linear_fc2.", h, c.ffn_hidden_size, c.add_bias_linear, L))
    out.update(_norm("decoder.final_layernorm.", c, h, []))
    if not c.tied_embeddings:
        out["output_layer.weight"] = (c.padded_vocab_size, h)
    return out
