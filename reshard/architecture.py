"""The logical tensors a GPT model of a given config has, by canonical (torch_dist) name and shape.

Used to check that a source holds every tensor the model needs (no silently missing weights), to
build synthetic checkpoints, and by importers that must produce the Megatron-Core tensor set.
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.errors import ReshardError


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


def _mla(c: ModelConfig, L: list[int]) -> dict[str, tuple[int, ...]]:
    """Multi-latent attention: queries through an optional low-rank latent, keys and values through one shared
    latent plus the decoupled rotary key dims."""
    attn, h, heads = "decoder.layers.self_attention.", c.hidden_size, c.num_attention_heads
    q_rows = heads * (c.qk_head_dim + c.qk_pos_emb_head_dim)
    out = _norm("decoder.layers.input_layernorm.", c, h, L)
    if c.q_lora_rank:
        out.update(_linear(f"{attn}linear_q_down_proj.", c.q_lora_rank, h, False, L))
        if c.qk_layernorm:
            out.update(_norm(f"{attn}linear_q_up_proj.layer_norm_", c, c.q_lora_rank, L))
        out.update(_linear(f"{attn}linear_q_up_proj.", q_rows, c.q_lora_rank, False, L))
    else:
        out.update(_linear(f"{attn}linear_q_proj.", q_rows, h, False, L))
    out.update(_linear(f"{attn}linear_kv_down_proj.", c.kv_lora_rank + c.qk_pos_emb_head_dim, h, False, L))
    if c.qk_layernorm:  # Megatron's MLA normalises the latents only with qk_layernorm (DeepSeek sets it)
        out.update(_norm(f"{attn}linear_kv_up_proj.layer_norm_", c, c.kv_lora_rank, L))
    out.update(_linear(f"{attn}linear_kv_up_proj.", heads * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank, False, L))
    out.update(_linear(f"{attn}linear_proj.", h, heads * c.v_head_dim, c.add_bias_linear, L))
    return out


def model_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> global shape, with every decoder layer stacked on a leading layer axis; where MoE and
    dense layers mix (`per_layer_names`), each layer's tensors under `decoder.layers.{i}.` without it; each
    multi-token-prediction layer's under `mtp.layers.{i}.`, unstacked (Megatron-Core keys them so). A model of
    several towers has the language model's under its prefix and each other tower's as the tower says."""
    language = {config.language_model_prefix + name: shape for name, shape in _language_model(config).items()}
    return {**language, **{name: shape for tower in config.towers for name, shape in tower.tensors}}


def _language_model(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    if not config.per_layer_names:
        return {**_stacked(config), **_mtp(config)}
    kinds = {moe: _one_layer(config, moe) for moe in (False, True)}
    out = {name: shape for name, shape in kinds[True].items() if not name.startswith("decoder.layers.")}
    for layer, moe in enumerate(config.moe_layers):
        for name, shape in kinds[moe].items():
            if name.startswith("decoder.layers."):
                out[name.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)] = shape[1:]
    return {**out, **_mtp(config)}


def _one_layer(config: ModelConfig, moe: bool) -> dict[str, tuple[int, ...]]:
    """The tensors of a one-layer model whose layer is an MoE (or a dense) layer of `config`."""
    return _stacked(config.replace(num_layers=1, moe_layer_freq=1, **({} if moe else {"num_experts": None})))


def _mtp(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Megatron-Core's MultiTokenPredictionLayer: norms of the next token's embedding and of the hidden state, their
    concatenation's projection, a transformer layer of the decoder's last layer's kind, and the norm before the
    (shared) output layer."""
    if not config.mtp_num_layers:
        return {}
    h = config.hidden_size
    layer = {name: shape[1:] for name, shape in _one_layer(config, config.moe_layers[-1]).items() if name.startswith("decoder.layers.")}
    out: dict[str, tuple[int, ...]] = {}
    for i in range(config.mtp_num_layers):
        m = f"mtp.layers.{i}."
        out.update(_norm(f"{m}enorm.", config, h, []))
        out.update(_norm(f"{m}hnorm.", config, h, []))
        out[f"{m}eh_proj.weight"] = (h, 2 * h)
        out.update({name.replace("decoder.layers.", f"{m}transformer_layer.", 1): shape for name, shape in layer.items()})
        out.update(_norm(f"{m}final_layernorm.", config, h, []))
    return out


def _stacked(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    c = config
    h, L = c.hidden_size, [c.num_layers]
    gate = 2 if c.swiglu else 1
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (c.padded_vocab_size, h)}
    if c.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = (c.max_position_embeddings, h)
    attn = "decoder.layers.self_attention."
    if c.multi_latent_attention:
        out.update(_mla(c, L))
    else:
        out.update(_norm(f"{attn}linear_qkv.layer_norm_", c, h, L))
        qkv_rows = (c.num_attention_heads + 2 * c.groups) * c.head_dim
        out.update(_linear(f"{attn}linear_qkv.", qkv_rows, h, c.add_qkv_bias or c.add_bias_linear, L))
        if c.qk_layernorm:
            full = c.qk_layernorm_full_width  # over every head of the projection, not one head
            out.update(_norm(f"{attn}q_layernorm.", c, c.head_dim * (c.num_attention_heads if full else 1), L))
            out.update(_norm(f"{attn}k_layernorm.", c, c.head_dim * (c.groups if full else 1), L))
        out.update(_linear(f"{attn}linear_proj.", h, c.num_attention_heads * c.head_dim, c.add_bias_linear, L))
        if c.softmax_type == "learnable":  # attention sinks: a logit per head
            out[f"{attn}core_attention.softmax_offset"] = (c.num_layers, c.num_attention_heads)
    mlp = "decoder.layers.mlp."
    if c.is_moe:
        assert c.num_experts is not None
        ffn = c.moe_ffn_hidden_size or c.ffn_hidden_size
        out.update(_norm("decoder.layers.pre_mlp_layernorm.", c, h, L))
        out[f"{mlp}router.weight"] = (c.num_layers, c.num_experts, h)
        if c.add_bias_linear:  # gpt-oss's
            out[f"{mlp}router.bias"] = (c.num_layers, c.num_experts)
        if c.moe_router_enable_expert_bias:
            out[f"{mlp}router.expert_bias"] = (c.num_layers, c.num_experts)
        lead = [c.num_layers, c.num_experts]
        out.update(_linear(f"{mlp}experts.experts.linear_fc1.", gate * ffn, h, c.add_bias_linear, lead))
        out.update(_linear(f"{mlp}experts.experts.linear_fc2.", h, ffn, c.add_bias_linear, lead))
        if c.moe_shared_expert_intermediate_size:
            shared = c.moe_shared_expert_intermediate_size
            out.update(_linear(f"{mlp}shared_experts.linear_fc1.", gate * shared, h, c.add_bias_linear, L))
            out.update(_linear(f"{mlp}shared_experts.linear_fc2.", h, shared, c.add_bias_linear, L))
            if c.moe_shared_expert_gate:
                out[f"{mlp}shared_experts.gate_weight"] = (c.num_layers, 1, h)
    else:
        out.update(_norm(f"{mlp}linear_fc1.layer_norm_", c, h, L))
        out.update(_linear(f"{mlp}linear_fc1.", gate * c.ffn_hidden_size, h, c.add_bias_linear, L))
        out.update(_linear(f"{mlp}linear_fc2.", h, c.ffn_hidden_size, c.add_bias_linear, L))
    out.update(_norm("decoder.final_layernorm.", c, h, []))
    if not c.tied_embeddings:
        out["output_layer.weight"] = (c.padded_vocab_size, h)
    return out


# The arguments behind each axis of a tensor's shape, by a fragment of its name (first match).
_AXIS_FIELDS = (
    ("linear_q_down_proj.", ("q_lora_rank", "hidden_size")),
    ("linear_q_up_proj.", ("num_attention_heads, qk_head_dim, qk_pos_emb_head_dim", "q_lora_rank")),
    ("linear_q_proj.", ("num_attention_heads, qk_head_dim, qk_pos_emb_head_dim", "hidden_size")),
    ("linear_kv_down_proj.", ("kv_lora_rank, qk_pos_emb_head_dim", "hidden_size")),
    ("linear_kv_up_proj.", ("num_attention_heads, qk_head_dim, v_head_dim", "kv_lora_rank")),
    ("linear_qkv.", ("num_attention_heads, num_query_groups, kv_channels", "hidden_size")),
    ("linear_proj.", ("hidden_size", "num_attention_heads, kv_channels")),
    ("linear_fc1.", ("ffn_hidden_size (or moe_ffn_hidden_size), swiglu", "hidden_size")),
    ("linear_fc2.", ("hidden_size", "ffn_hidden_size (or moe_ffn_hidden_size)")),
    ("word_embeddings.", ("padded_vocab_size", "hidden_size")),
    ("output_layer.", ("padded_vocab_size", "hidden_size")),
    ("router.", ("num_experts", "hidden_size")),
    ("eh_proj.", ("hidden_size", "hidden_size (x 2)")),
    ("position_embeddings.", ("max_position_embeddings", "hidden_size")),
)


def check_shapes(config: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse, naming the argument, a checkpoint whose recorded architecture contradicts its tensors' shapes
    (a resharded or exported copy would be cut by the wrong sizes). Tensors the config does not imply are
    left to the completeness checks."""
    implied = model_tensors(config)
    for name, shape in shapes.items():
        expected = implied.get(name)
        if expected is None or tuple(shape) == tuple(expected):
            continue
        if (tower := config.tower_of(name)) is not None:
            raise ReshardError(f"{where}: {name} has shape {list(shape)}, but the recorded architecture implies {list(expected)} "
                               f"(check the {tower.prefix.rstrip('.')} tower's config): the architecture contradicts the tensors")
        linear = next((f for fragment, f in _AXIS_FIELDS if fragment in name and "layer_norm" not in name), None)
        core = 2 if linear and name.endswith(".weight") else 1  # a matrix, or a vector (norm, bias)
        if len(shape) != len(expected):
            fields = "num_layers, num_experts"
        else:
            axis = next(i for i, (a, b) in enumerate(zip(shape, expected)) if a != b)
            lead = len(expected) - core
            if axis < lead:
                fields = "num_layers" if axis == 0 and config.language_name(name).startswith("decoder.layers.") else "num_experts"
            elif linear:
                fields = linear[axis - lead]
            else:
                fields = "kv_channels, qk_layernorm_full_width" if "q_layernorm" in name or "k_layernorm" in name else "hidden_size"
                if config.qk_layernorm_full_width and "kv_channels" in fields:  # a norm over every head of the projection
                    fields = f"{'num_attention_heads' if 'q_layernorm' in name else 'num_query_groups'}, {fields}"
        raise ReshardError(
            f"{where}: {name} has shape {list(shape)}, but the recorded architecture implies {list(expected)} "
            f"(check {fields}): the architecture contradicts the tensors"
        )
