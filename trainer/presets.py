"""Tiny model presets (plain ModelConfig constants) for the trainer, tests and fixture checkpoints."""

from __future__ import annotations

from reshard.config import ModelConfig

# vocab 250 is deliberately not a multiple of 128*tp: padded to 256 at TP1, 256 at TP2, 512 at TP4.
TINY_LLAMA = ModelConfig(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=128,
    vocab_size=250,
    padded_vocab_size=256,
    make_vocab_size_divisible_by=128,
    max_position_embeddings=128,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    untie_embeddings_and_output_weights=True,
)

TINY_TIED = TINY_LLAMA.replace(untie_embeddings_and_output_weights=False)

TINY_MOE = TINY_LLAMA.replace(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)

# eight heads in four query groups: the smallest GQA model that splits over TP=4; padding to a
# multiple of 64 * TP keeps 256 vocabulary rows at TP 1, 2 and 4
TINY_GQA4 = TINY_LLAMA.replace(num_attention_heads=8, num_query_groups=4, kv_channels=8, make_vocab_size_divisible_by=64)

# the same padded like tiny-llama: 256 rows at TP 1 and 2, 512 at TP 4
TINY_GQA4_PAD128 = TINY_GQA4.replace(make_vocab_size_divisible_by=128)

# ~12M parameters (a ~150 MB checkpoint with Adam state): for trainer benchmarks on a CPU.
SMALL_LLAMA = TINY_LLAMA.replace(hidden_size=512, num_attention_heads=8, num_query_groups=4, kv_channels=64,
                                 ffn_hidden_size=1408, max_position_embeddings=512)

# sizes that are not multiples of 64, LayerNorm, biases, q/k norms and learned positions: every parameter
# kind of the local spec, with DistributedOptimizer alignment gaps between them
TINY_ODD = TINY_LLAMA.replace(hidden_size=40, kv_channels=10, ffn_hidden_size=72, normalization="LayerNorm",
                              add_bias_linear=True, qk_layernorm=True, position_embedding_type="learned_absolute")
TINY_ODD_TIED = TINY_ODD.replace(untie_embeddings_and_output_weights=False)

# multi-latent attention (DeepSeek-V3's, in small) with every parameter kind it has: the query latent (q_lora_rank),
# LayerNorm latent norms with biases (qk_layernorm), a biased output projection; sizes unlike each other so that a
# mix-up shows in the shapes, and not multiples of 64 (DistributedOptimizer alignment gaps). Splits over TP 1, 2, 4.
TINY_MLA = TINY_ODD.replace(hidden_size=64, num_attention_heads=4, num_query_groups=None, kv_channels=None,
                            position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=20,
                            qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10)
# DeepSeek-V3's layer kinds in small: the query straight from the hidden state (no q_lora_rank), RMSNorm, the first
# layer dense and the next MoE with a shared expert (Megatron keys each layer apart)
TINY_MLA_MOE = TINY_MLA.replace(num_layers=2, q_lora_rank=None, normalization="RMSNorm", add_bias_linear=False,
                                num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                                moe_shared_expert_intermediate_size=40, moe_layer_freq=(0, 1))

# MiniMax-M2's layer in small: q/k norms over every head of the projection (split over TP by head), half of each head's
# dims rotating, every layer MoE with a sigmoid router and its expert bias (a buffer: never optimizer state)
TINY_MINIMAX = TINY_MOE.replace(num_layers=2, qk_layernorm=True, qk_layernorm_full_width=True, rotary_percent=0.5,
                                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
# GLM-4.5's layer kinds in small: q/k/v biases, per-head q/k norms, half of each head's dims rotated, a dense layer
# then an MoE one (sigmoid router with an expert bias, a shared expert), and one MTP layer
TINY_GLM4_MOE = TINY_LLAMA.replace(num_layers=2, add_qkv_bias=True, qk_layernorm=True, rotary_percent=0.5, norm_epsilon=1e-5,
                                   num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=48,
                                   moe_layer_freq=(0, 1), moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                   moe_router_topk_scaling_factor=2.5, mtp_num_layers=1)
# gpt-oss's layer in small: attention sinks (softmax_offset, split by head), a window of 8 on every other layer, biases
# on every linear (the router's and the experts' too: parameters in the DistributedOptimizer's buffers, the experts'
# at ETP1 only), the clamped SwiGLU, YaRN with its correction range unrounded
TINY_GPT_OSS = TINY_MOE.replace(num_layers=2, add_bias_linear=True, add_qkv_bias=True, norm_epsilon=1e-5, moe_ffn_hidden_size=48,
                                softmax_type="learnable", window_size=(7, 0), window_attn_skip_freq=2, quick_geglu=True,
                                activation_func_clamp_value=7.0, glu_linear_offset=1.0, position_embedding_type="yarn",
                                rotary_base=150000.0, rotary_scaling_factor=32.0, yarn_correction_range_round_to_int=False)
# Qwen3-Next's layer kinds in small (tests/converters/hf_models.py's "qwen3_next"): Gated DeltaNet on layers 0 and 2 (2
# key heads of 16, 4 value heads of 8), gated attention with per-head q/k norms on 1 and 3, a quarter of the head dims
# rotated, zero-centred norms, layer 0's MLP dense and the others MoE with a gated shared expert
TINY_QWEN3_NEXT = TINY_LLAMA.replace(ffn_hidden_size=96, rotary_percent=0.25, norm_epsilon=1e-6, qk_layernorm=True,
                                     layernorm_zero_centered_gamma=True, attention_output_gate=True, num_experts=4,
                                     moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=40,
                                     moe_shared_expert_gate=True, moe_layer_freq=(0, 1, 1, 1),
                                     experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
                                     linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
# Nemotron-H's dense layer kinds in small (hf_models.py's "nemotron_h"): Mamba-2, attention, Mamba-2, squared-ReLU MLP;
# 8 Mamba heads of 8 in 2 groups of B/C of state 16 (TP2 splits both)
TINY_NEMOTRON_H = TINY_LLAMA.replace(ffn_hidden_size=96, position_embedding_type="none", swiglu=False, squared_relu=True,
                                     hybrid_override_pattern="M*M-", mamba_state_dim=16, mamba_head_dim=8, mamba_num_groups=2,
                                     mamba_num_heads=8)
# its MoE layer kinds (hf_models.py's "nemotron_h_moe"): Mamba-2, MoE, attention, MoE; 4 squared-ReLU experts of 48
# routed DeepSeek-V3's way (sigmoid scores, the expert_bias buffer, 2 groups of which 1 is taken, scaled by 2.5) and a
# shared expert of 40
TINY_NEMOTRON_H_MOE = TINY_NEMOTRON_H.replace(hybrid_override_pattern="ME*E", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                                             moe_shared_expert_intermediate_size=40, moe_router_score_function="sigmoid",
                                             moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
                                             moe_router_topk_scaling_factor=2.5)
# Nemotron 3's latent MoE in small (hf_models.py's "nemotron_h_latent"): the routed experts compute in a latent of 32
TINY_NEMOTRON_H_LATENT = TINY_NEMOTRON_H_MOE.replace(moe_latent_size=32)

PRESETS = {
    "tiny-llama": TINY_LLAMA,
    "tiny-tied": TINY_TIED,
    "tiny-moe": TINY_MOE,
    "tiny-gqa4": TINY_GQA4,
    "tiny-gqa4-pad128": TINY_GQA4_PAD128,
    "small-llama": SMALL_LLAMA,
    "tiny-odd": TINY_ODD,
    "tiny-odd-tied": TINY_ODD_TIED,
    "tiny-mla": TINY_MLA,
    "tiny-mla-moe": TINY_MLA_MOE,
    "tiny-minimax": TINY_MINIMAX,
    "tiny-glm4-moe": TINY_GLM4_MOE,
    "tiny-gpt-oss": TINY_GPT_OSS,
    "tiny-qwen3-next": TINY_QWEN3_NEXT,
    "tiny-nemotron-h": TINY_NEMOTRON_H,
    "tiny-nemotron-h-moe": TINY_NEMOTRON_H_MOE,
    "tiny-nemotron-h-latent": TINY_NEMOTRON_H_LATENT,
}
