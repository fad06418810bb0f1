"""Build a real Megatron-Core GPTModel for a ModelConfig at a Layout (CPU or GPU)."""

from __future__ import annotations

import dataclasses
import datetime
import os
from functools import partial

import torch
import torch.nn.functional as F

from reshard.config import LINEAR_ATTENTION_FIELDS, MLA_FIELDS, ModelConfig
from reshard.layout import Layout
from reshard.trainer import cpu_compat, expert_bias, full_width_norm, gated_delta_net, mamba, zero_centred_norm


def parallel_sizes(layout: Layout) -> dict[str, int | None]:
    """The layout's parallel degrees by their Megatron names, as initialize_model_parallel and
    TransformerConfig take them: its Megatron-LM arguments but the stage sizes, which those name otherwise."""
    sizes = layout.megatron_args()
    del sizes["decoder_first_pipeline_num_layers"], sizes["decoder_last_pipeline_num_layers"]
    return sizes


def init_parallel(layout: Layout, seed: int = 1234) -> None:
    """Initialise torch.distributed from torchrun's env vars and Megatron's parallel groups."""
    from megatron.core import parallel_state, tensor_parallel

    cpu_compat.apply()
    on_gpu = torch.cuda.is_available()
    if not torch.distributed.is_initialized():
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(
            backend="nccl" if on_gpu else "gloo", timeout=datetime.timedelta(minutes=5)
        )
    world = torch.distributed.get_world_size()
    model_parallel = layout.tp * layout.pp
    if world % model_parallel:
        raise RuntimeError(f"world size {world} is not a multiple of TP*PP={model_parallel} for {layout}")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(**parallel_sizes(layout))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's quick_gelu (fusions/fused_bias_geglu.py), without its torch.compile: each rank would compile it
    with inductor into one shared cache, a C++ build per rank on the CPU."""
    return x * torch.sigmoid(1.702 * x)


def activation(config: ModelConfig):
    """SiLU for gated MLPs (quick GELU with `quick_geglu`: gpt-oss's); GELU otherwise, tanh-approximated when
    Megatron's `openai_gelu` is set."""
    if config.quick_geglu:
        return quick_gelu
    if config.squared_relu:  # Nemotron-H's MLPs
        from megatron.core.activations import squared_relu

        return squared_relu
    if config.swiglu:
        return F.silu
    return partial(F.gelu, approximate="tanh") if config.openai_gelu else F.gelu


def sequence_parallel(config: ModelConfig, layout: Layout) -> bool:
    return config.is_moe and layout.tp > 1


def _torch_norms_under_sequence_parallel() -> None:
    """Let the local spec's torch norms (megatron-core's WrappedTorchNorm, what it builds without Apex or
    Transformer Engine) run under sequence parallel, which WrappedTorchNorm refuses.

    Under sequence parallel each TP rank normalises its own part of the sequence, so a norm's weight gradient is
    a partial sum that `finalize_model_grads` must all-reduce over TP; it does so for parameters marked
    `sequence_parallel`, as Apex's and Transformer Engine's norms mark theirs and the torch norm does not. Built
    here with the same marking; with sequence parallel off nothing changes. Idempotent.
    """
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls, "_reshard_sequence_parallel", False):
        return
    build = cls.__new__

    def new(cls_, config, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls_, config, *args, **kwargs)
        norm = build(cls_, dataclasses.replace(config, sequence_parallel=False), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    cls.__new__ = staticmethod(new)
    cls._reshard_sequence_parallel = True


def transformer_config(config: ModelConfig, layout: Layout, dtype: torch.dtype = torch.float32):
    """Megatron's TransformerConfig for `config` at `layout` (no dropout, no fusions)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.groups,
        kv_channels=config.head_dim,
        ffn_hidden_size=config.ffn_hidden_size,
        normalization=config.normalization,
        layernorm_epsilon=config.norm_epsilon,
        gated_linear_unit=config.swiglu,
        activation_func=activation(config),
        add_bias_linear=config.add_bias_linear,
        add_qkv_bias=config.add_qkv_bias,
        qk_layernorm=config.qk_layernorm,
        softmax_type=config.softmax_type,
        window_size=config.window_size,
        window_attn_skip_freq=list(skip) if isinstance(skip := config.window_attn_skip_freq, tuple) else skip,
        activation_func_clamp_value=config.activation_func_clamp_value,
        glu_linear_offset=config.glu_linear_offset,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **parallel_sizes(layout),
        # megatron-core refuses MoE with TP > 1 without sequence parallel; dense models keep it off
        sequence_parallel=sequence_parallel(config, layout),
        use_cpu_initialization=not on_gpu,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Batched p2p posts send_prev, recv_prev, send_next, recv_next at once; gloo matches sends and
        # receives per peer in posting order, and at PP=2 the previous and next stage are one rank, so
        # with VPP a gradient was received as an activation of the same shape (wrong losses, no error).
        batch_p2p_comm=on_gpu,
    )
    if config.mtp_num_layers:
        kwargs["mtp_num_layers"] = config.mtp_num_layers
    if config.mrope_section:
        kwargs["mrope_section"] = list(config.mrope_section)
    if config.attention_output_gate:
        kwargs["attention_output_gate"] = True
    if config.experimental_attention_variant:
        freq = config.linear_attention_freq
        kwargs.update(experimental_attention_variant=config.experimental_attention_variant,
                      linear_attention_freq=list(freq) if isinstance(freq, tuple) else freq,
                      **{key: getattr(config, key) for key in LINEAR_ATTENTION_FIELDS})
    if config.hybrid_override_pattern is not None:  # megatron-core's MambaModel (`mamba`: its mixer's CPU path)
        kwargs.update(is_hybrid_model=True, mamba_state_dim=config.mamba_state_dim, mamba_head_dim=config.mamba_head_dim,
                      mamba_num_groups=config.mamba_num_groups, mamba_num_heads=config.mamba_heads, use_mamba_mem_eff_path=False)
    if layout.first_stage_layers is not None:
        kwargs["num_layers_in_first_pipeline_stage"] = layout.first_stage_layers
    if layout.last_stage_layers is not None:
        kwargs["num_layers_in_last_pipeline_stage"] = layout.last_stage_layers
    if config.is_moe:
        kwargs.update(
            num_moe_experts=config.num_experts,
            moe_router_topk=config.moe_router_topk,
            moe_ffn_hidden_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
            moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=config.moe_shared_expert_gate,
            moe_router_pre_softmax=config.moe_router_pre_softmax,
            moe_layer_freq=list(config.moe_layer_freq) if isinstance(config.moe_layer_freq, tuple) else config.moe_layer_freq,
            moe_router_score_function=config.moe_router_score_function,
            moe_router_enable_expert_bias=config.moe_router_enable_expert_bias,
            moe_router_num_groups=config.moe_router_num_groups,
            moe_router_group_topk=config.moe_router_group_topk,
            moe_router_topk_scaling_factor=config.moe_router_topk_scaling_factor,
            moe_latent_size=config.moe_latent_size,
            # gloo cannot run the all-to-all dispatcher (see the shared doc); GPUs use Megatron's default.
            moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
            moe_grouped_gemm=False,
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
        )
    if config.multi_latent_attention:
        # The local core attention's output width is heads * kv_channels: the value head dim under MLA.
        kwargs.update({key: getattr(config, key) for key in MLA_FIELDS}, rope_type=config.mla_rope_type,
                      kv_channels=config.v_head_dim, rotary_base=config.rotary_base,
                      rotary_percent=config.rotary_percent)
        return MLATransformerConfig(**kwargs)
    tconfig = TransformerConfig(**kwargs)
    if config.position_embedding_type == "yarn":  # GPTModel reads these attributes, which TransformerConfig lacks
        for field in ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                      "mscale_all_dim"):
            setattr(tconfig, f"yarn_{field}", getattr(config, field))
        tconfig.yarn_correction_range_round_to_int = config.yarn_correction_range_round_to_int
    return tconfig


def layer_spec(config: ModelConfig, tconfig, vp_stage: int | None):
    """Megatron-Core's local layer spec for the model; where MoE and dense layers mix, its block spec (one per
    layer of the stage)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if config.per_layer_names:
        spec = get_gpt_decoder_block_spec(tconfig, use_transformer_engine=False, normalization=config.normalization,
                                          vp_stage=vp_stage)
        layers = spec.layer_specs
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=config.num_experts if config.is_moe else None,
            moe_grouped_gemm=False,
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention,
            normalization=config.normalization,
        )
        layers = [spec]
    if config.multi_latent_attention:
        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = cpu_compat.local_mla_core_attention()
    if config.is_moe and config.add_bias_linear:  # gpt-oss's expert biases, trainable
        for layer in layers:
            if hasattr(layer.submodules.mlp.submodules, "experts"):
                expert_bias.use_in(layer)
    if config.layernorm_zero_centered_gamma or any(config.linear_attention_layers):  # Qwen3-Next's, modules megatron-core has in TE only
        spec.layer_specs = layers = qwen3_next_layers(config, tconfig, spec, vp_stage)
    if config.qk_layernorm_full_width:  # MiniMax-M2's q/k norms: over every head, a module megatron-core lacks
        for layer in layers:
            attention = layer.submodules.self_attention.submodules
            attention.q_layernorm, attention.k_layernorm = full_width_norm.FullWidthQNorm, full_width_norm.FullWidthKNorm
    return spec


def qwen3_next_layers(config: ModelConfig, tconfig, spec, vp_stage: int | None) -> list:
    """The stage's layer specs with Gated DeltaNet on its layers (`gated_delta_net`) and every norm zero-centred
    (`zero_centred_norm`); each layer's its own copy (the block spec shares one per kind)."""
    import copy

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if not config.per_layer_names or not config.layernorm_zero_centered_gamma:
        raise NotImplementedError("the trainer builds Gated DeltaNet layers only as Qwen3-Next has them: zero-centred norms, mixed layers")
    offset = get_transformer_layer_offset(tconfig, vp_stage=vp_stage)
    spec.layer_norm = zero_centred_norm.ZeroCentredRMSNorm
    layers = [copy.deepcopy(layer) for layer in spec.layer_specs]
    for index, layer in enumerate(layers, start=offset):
        parts = layer.submodules
        parts.pre_mlp_layernorm = zero_centred_norm.ZeroCentredRMSNorm
        if config.linear_attention_layers[index]:
            parts.input_layernorm, parts.self_attention = IdentityOp, gated_delta_net.gated_delta_net_spec()
        else:
            parts.input_layernorm = zero_centred_norm.ZeroCentredRMSNorm
            attention = parts.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = zero_centred_norm.ZeroCentredRMSNorm
    return layers


def build_model(config: ModelConfig, layout: Layout, dtype: torch.dtype = torch.float32) -> list:
    """One GPTModel per virtual pipeline stage of this rank (init_parallel must have run)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    tconfig = transformer_config(config, layout, dtype)
    if tconfig.sequence_parallel:
        _torch_norms_under_sequence_parallel()
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    models = []
    for vstage in range(layout.vpp):
        vp = vstage if layout.vpp > 1 else None
        if config.hybrid_override_pattern is not None:
            models.append(_hybrid_model(config, layout, tconfig, vp).to(device))
            continue
        spec = layer_spec(config, tconfig, vp)
        # Multi-token prediction: Megatron-Core builds its layers (the decoder's last layer spec) on the last stage only
        mtp = get_gpt_mtp_block_spec(tconfig, spec, use_transformer_engine=False, vp_stage=vp) if config.mtp_num_layers else None
        if mtp is not None and config.layernorm_zero_centered_gamma:  # TE's norms would be: the local spec's are not
            for layer in mtp.layer_specs:
                layer.submodules.enorm = layer.submodules.hnorm = layer.submodules.layer_norm = zero_centred_norm.ZeroCentredRMSNorm
        model = GPTModel(
            config=tconfig,
            transformer_layer_spec=spec,
            mtp_block_spec=mtp,
            vocab_size=config.padded_vocab_for(layout.tp),
            max_sequence_length=config.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=config.tied_embeddings,
            position_embedding_type=config.position_embedding_type,
            rotary_percent=config.rotary_percent,
            rotary_base=config.rotary_base,
            rope_scaling=config.rope_scaling,
            rope_scaling_factor=config.rope_scaling_factor,
            vp_stage=vp,
        )
        # As Megatron-LM's Float16Module: every parameter in the training dtype (the local spec's torch
        # norms are created in fp32, which Megatron's mixed-precision optimizer cannot checkpoint).
        models.append(model.to(device=device, dtype=dtype) if dtype != torch.float32 else model.to(device))
    return models


def _hybrid_model(config: ModelConfig, layout: Layout, tconfig, vp: int | None):
    """megatron-core's MambaModel (a hybrid model: Nemotron-H) on the CPU stand-ins of `mamba`."""
    from megatron.core import parallel_state
    from megatron.core.models.mamba import MambaModel

    if vp is not None:
        raise NotImplementedError("megatron-core's MambaModel has no virtual pipeline stages")
    return MambaModel(
        config=tconfig,
        mamba_stack_spec=mamba.hybrid_stack_spec(),
        vocab_size=config.padded_vocab_for(layout.tp),
        max_sequence_length=config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False),
        hybrid_override_pattern=config.hybrid_override_pattern,
        share_embeddings_and_output_weights=config.tied_embeddings,
        position_embedding_type=config.position_embedding_type,
    )
