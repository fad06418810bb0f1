"""The logical tensors a GPT model of a given config has, by canonical (torch_dist) name and shape.

Used to check that a source holds every tensor the model needs (no silently missing weights), to
build synthetic checkpoints, and by importers that must produce the Megatron-Core tensor set.
"""

from __future__ import annotations

from reshard.config import LayerKind, ModelConfig
from reshard.errors import ReshardError

# The Mamba mixer's convolution width: megatron-core's MambaMixer default (d_conv), which no option changes
MAMBA_CONV_KERNEL = 4


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
    """Canonical name -> global shape, with every decoder layer stacked on a leading layer axis; where layers of
    different kinds mix (`per_layer_names`), each layer's tensors under `decoder.layers.{i}.` without it, as its
    kind has them; each multi-token-prediction layer's under `mtp.layers.{i}.`, unstacked (Megatron-Core keys them so).
    A model of several towers has the language model's under its prefix and each other tower's as the tower says."""
    language = {config.language_model_prefix + name: shape for name, shape in _language_model(config).items()}
    return {**language, **{name: shape for tower in config.towers for name, shape in tower.tensors}}


def _language_model(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    kinds = config.layer_kinds
    if not config.per_layer_names:
        return {**_embeddings(config), **_layer(config, kinds[0], [config.num_layers]), **_head(config), **_mtp(config)}
    out = {**_embeddings(config), **_head(config)}
    for i, kind in enumerate(kinds):
        out.update({name.replace("decoder.layers.", f"decoder.layers.{i}.", 1): shape for name, shape in _layer(config, kind, []).items()})
    return {**out, **_mtp(config)}


def _mtp(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Megatron-Core's MultiTokenPredictionLayer: norms of the next token's embedding and of the hidden state, their
    concatenation's projection, a transformer layer of the decoder's last layer's kind, and the norm before the
    (shared) output layer."""
    if not config.mtp_num_layers:
        return {}
    h = config.hidden_size
    layer = _layer(config, config.layer_kinds[-1], [])
    out: dict[str, tuple[int, ...]] = {}
    for i in range(config.mtp_num_layers):
        m = f"mtp.layers.{i}."
        out.update(_norm(f"{m}enorm.", config, h, []))
        out.update(_norm(f"{m}hnorm.", config, h, []))
        out[f"{m}eh_proj.weight"] = (h, 2 * h)
        out.update({name.replace("decoder.layers.", f"{m}transformer_layer.", 1): shape for name, shape in layer.items()})
        out.update(_norm(f"{m}final_layernorm.", config, h, []))
    return out


def _embeddings(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (c.padded_vocab_size, c.hidden_size)}
    if c.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = (c.max_position_embeddings, c.hidden_size)
    return out


def _head(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The final norm (a hybrid model's MambaStack names it final_norm) and the output layer (absent when tied to the
    embedding)."""
    out = _norm("decoder.final_norm." if c.hybrid_override_pattern else "decoder.final_layernorm.", c, c.hidden_size, [])
    if not c.tied_embeddings:
        out["output_layer.weight"] = (c.padded_vocab_size, c.hidden_size)
    return out


def _layer(c: ModelConfig, kind: LayerKind, L: list[int]) -> dict[str, tuple[int, ...]]:
    """A decoder layer of `kind`, on the leading axes `L` (the layer axis, or none)."""
    if kind.mixer is None:
        out = {}
    elif kind.mixer == "gated_delta_net":
        out = _gated_delta_net(c, L)
    elif kind.mixer == "mamba":
        out = _mamba(c, L)
    elif c.multi_latent_attention:
        out = _mla(c, L)
    else:
        out = _attention(c, L)
    if kind.mlp:
        out.update(_moe(c, L) if kind.moe else _dense_mlp(c, L))
    return out


def _attention(c: ModelConfig, L: list[int]) -> dict[str, tuple[int, ...]]:
    attn, h = "decoder.layers.self_attention.", c.hidden_size
    out = _norm(f"{attn}linear_qkv.layer_norm_", c, h, L)
    gates = c.num_attention_heads if c.attention_output_gate else 0
    qkv_rows = (c.num_attention_heads + gates + 2 * c.groups) * c.head_dim
    out.update(_linear(f"{attn}linear_qkv.", qkv_rows, h, c.add_qkv_bias or c.add_bias_linear, L))
    if c.qk_layernorm:
        full = c.qk_layernorm_full_width  # over every head of the projection, not one head
        out.update(_norm(f"{attn}q_layernorm.", c, c.head_dim * (c.num_attention_heads if full else 1), L))
        out.update(_norm(f"{attn}k_layernorm.", c, c.head_dim * (c.groups if full else 1), L))
    out.update(_linear(f"{attn}linear_proj.", h, c.num_attention_heads * c.head_dim, c.add_bias_linear, L))
    if c.softmax_type == "learnable":  # attention sinks: a logit per head
        out[f"{attn}core_attention.softmax_offset"] = (*L, c.num_attention_heads)
    return out


def _gated_delta_net(c: ModelConfig, L: list[int]) -> dict[str, tuple[int, ...]]:
    """Megatron-Core's GatedDeltaNet. torch_dist keys its fused input projection's six parts and its depthwise
    convolution's three apart (`in_proj.weight.query`, ...), each split over TP on its own, so each is a tensor here."""
    attn, h = "decoder.layers.self_attention.", c.hidden_size
    qk, v, heads = c.linear_key_head_dim * c.linear_num_key_heads, c.linear_value_head_dim * c.linear_num_value_heads, c.linear_num_value_heads
    out = _norm(f"{attn}in_proj.layer_norm_", c, h, L)
    for part, rows in (("query", qk), ("key", qk), ("value", v), ("z", v), ("beta", heads), ("alpha", heads)):
        out[f"{attn}in_proj.weight.{part}"] = (*L, rows, h)
    for part, rows in (("query", qk), ("key", qk), ("value", v)):
        out[f"{attn}conv1d.weight.{part}"] = (*L, rows, 1, c.linear_conv_kernel_dim)
    out[f"{attn}A_log"] = (*L, heads)
    out[f"{attn}dt_bias"] = (*L, heads)
    out.update(_norm(f"{attn}out_norm.", c, c.linear_value_head_dim, L))
    out.update(_linear(f"{attn}out_proj.", h, v, False, L))
    return out


def _mamba(c: ModelConfig, L: list[int]) -> dict[str, tuple[int, ...]]:
    """Megatron-Core's MambaMixer (Mamba-2). torch_dist keys its fused input projection's five parts (z, x, B, C, dt)
    and its depthwise convolution's three (x, B, C channels) apart, each split over TP on its own."""
    m, h, heads = "decoder.layers.mixer.", c.hidden_size, c.mamba_heads
    inner, bc = heads * c.mamba_head_dim, c.mamba_num_groups * c.mamba_state_dim
    out = _norm(f"{m}in_proj.layer_norm_", c, h, L)
    for part, rows in (("z", inner), ("x", inner), ("B", bc), ("C", bc), ("dt", heads)):
        out[f"{m}in_proj.weight.{part}"] = (*L, rows, h)
    for part, rows in (("x", inner), ("B", bc), ("C", bc)):
        out[f"{m}conv1d.weight.{part}"] = (*L, rows, 1, MAMBA_CONV_KERNEL)
        out[f"{m}conv1d.bias.{part}"] = (*L, rows)
    for name in ("A_log", "D", "dt_bias"):
        out[f"{m}{name}"] = (*L, heads)
    out[f"{m}norm.weight"] = (*L, inner)
    out.update(_linear(f"{m}out_proj.", h, inner, False, L))
    return out


def _moe(c: ModelConfig, L: list[int]) -> dict[str, tuple[int, ...]]:
    assert c.num_experts is not None
    mlp, h, gate = "decoder.layers.mlp.", c.hidden_size, 2 if c.swiglu else 1
    ffn = c.moe_ffn_hidden_size or c.ffn_hidden_size
    out = _norm("decoder.layers.pre_mlp_layernorm.", c, h, L)
    out[f"{mlp}router.weight"] = (*L, c.num_experts, h)
    if c.add_bias_linear:  # gpt-oss's
        out[f"{mlp}router.bias"] = (*L, c.num_experts)
    if c.moe_router_enable_expert_bias:
        out[f"{mlp}router.expert_bias"] = (*L, c.num_experts)
    lead, width = [*L, c.num_experts], c.moe_latent_size or h  # the experts' input and output width
    if c.moe_latent_size:
        out.update(_linear(f"{mlp}fc1_latent_proj.", width, h, c.add_bias_linear, L))
        out.update(_linear(f"{mlp}fc2_latent_proj.", h, width, c.add_bias_linear, L))
    out.update(_linear(f"{mlp}experts.experts.linear_fc1.", gate * ffn, width, c.add_bias_linear, lead))
    out.update(_linear(f"{mlp}experts.experts.linear_fc2.", width, ffn, c.add_bias_linear, lead))
    if c.moe_shared_expert_intermediate_size:
        shared = c.moe_shared_expert_intermediate_size
        out.update(_linear(f"{mlp}shared_experts.linear_fc1.", gate * shared, h, c.add_bias_linear, L))
        out.update(_linear(f"{mlp}shared_experts.linear_fc2.", h, shared, c.add_bias_linear, L))
        if c.moe_shared_expert_gate:
            out[f"{mlp}shared_experts.gate_weight"] = (*L, 1, h)
    return out


def _dense_mlp(c: ModelConfig, L: list[int]) -> dict[str, tuple[int, ...]]:
    mlp, h, gate = "decoder.layers.mlp.", c.hidden_size, 2 if c.swiglu else 1
    out = _norm(f"{mlp}linear_fc1.layer_norm_", c, h, L)
    out.update(_linear(f"{mlp}linear_fc1.", gate * c.ffn_hidden_size, h, c.add_bias_linear, L))
    out.update(_linear(f"{mlp}linear_fc2.", h, c.ffn_hidden_size, c.add_bias_linear, L))
    return out


_LINEAR_ROWS = "linear_num_key_heads, linear_key_head_dim, linear_num_value_heads, linear_value_head_dim"
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
    ("fc1_latent_proj.", ("moe_latent_size", "hidden_size")),
    ("fc2_latent_proj.", ("hidden_size", "moe_latent_size")),
    ("eh_proj.", ("hidden_size", "hidden_size (x 2)")),
    ("position_embeddings.", ("max_position_embeddings", "hidden_size")),
    ("in_proj.weight.", (_LINEAR_ROWS, "hidden_size")),
    ("conv1d.", (_LINEAR_ROWS, "1", "linear_conv_kernel_dim")),
    ("out_proj.", ("hidden_size", "linear_num_value_heads, linear_value_head_dim")),
    ("out_norm.", ("linear_value_head_dim",)),
    ("A_log", ("linear_num_value_heads",)),
    ("dt_bias", ("linear_num_value_heads",)),
)
_MAMBA_ROWS = "mamba_num_heads, mamba_head_dim, mamba_num_groups, mamba_state_dim"
# A Mamba mixer's, which share fragments with Gated DeltaNet's (checked first for names under `mixer.`)
_MAMBA_AXIS_FIELDS = (
    ("in_proj.weight.", (_MAMBA_ROWS, "hidden_size")),
    ("conv1d.weight.", (_MAMBA_ROWS, "1", "the convolution width 4")),
    ("conv1d.bias.", (_MAMBA_ROWS,)),
    ("out_proj.", ("hidden_size", "mamba_num_heads, mamba_head_dim")),
    ("norm.", ("mamba_num_heads, mamba_head_dim",)),
    ("A_log", ("mamba_num_heads",)),
    ("dt_bias", ("mamba_num_heads",)),
    (".D", ("mamba_num_heads",)),
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
        table = _MAMBA_AXIS_FIELDS + _AXIS_FIELDS if ".mixer." in name else _AXIS_FIELDS
        linear = next((f for fragment, f in table if fragment in name and "layer_norm" not in name), None)
        core = len(linear) if linear and (".weight" in name or len(linear) == 1) else 1  # a matrix (a kernel), or a vector
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
