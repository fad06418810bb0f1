"""Tiny HF models of every supported family, built with transformers' own classes (shared by the tests)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 250  # not a multiple of 128 * tp: padding must be added on import and cut on export
COMMON = dict(hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)

# Multi-latent attention, all layers dense: distinct sizes for every MLA dim so a mix-up shows in the shapes
DEEPSEEK = dict(COMMON, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=4, first_k_dense_replace=2,
                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                moe_intermediate_size=32, num_experts_per_tok=2, n_group=2, topk_group=1, num_nextn_predict_layers=0,
                tie_word_embeddings=False)


def _configs():
    import transformers as tf

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    qwen2_moe = dict(COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_hidden_layers=2,
                     num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False)
    qwen3_moe = dict(COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                     num_experts=4, num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False)
    # DeepSeek-V3's YaRN, scaled down: factor 4 over 128 original positions (the test sequences are shorter,
    # but YaRN changes the frequencies and the attention scale at every position)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    lite = dict(rms_norm_eps=1e-5, num_nextn_predict_layers=1)

    qwen3_5_moe = tf.Qwen3_5MoeTextConfig(**COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=48,
                                          shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                                          max_position_embeddings=128, tie_word_embeddings=False, linear_num_key_heads=2,
                                          linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                          layer_types=["linear_attention", "full_attention"] * 2,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                                           "mrope_section": [1, 1, 0], "mrope_interleaved": True})

    # Qwen3.5-VL in small: Qwen3.5's text model as below with heads of 32 (a quarter rotating: 4 frequencies, cut 2, 1, 1
    # by the interleaved MRoPE) beside Qwen3-VL's tiny vision model without DeepStack mergers; `moe`: Qwen3.5-MoE's layers
    def qwen3_5_vl(moe: bool):
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                "mrope_interleaved": True}
        text = dict(COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128, tie_word_embeddings=False,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2, rope_parameters=rope)
        text.update(dict(moe_intermediate_size=48, shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2)
                    if moe else dict(intermediate_size=96))
        return (tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config)(
            text_config=text, vision_config=dict(depth=3, hidden_size=24, intermediate_size=40, num_heads=2, out_hidden_size=64,
                                                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                                                  num_position_embeddings=16),
            image_token_id=240, video_token_id=241, vision_start_token_id=242, vision_end_token_id=243, tie_word_embeddings=False)

    def qwen3_vl_moe(**text):
        return tf.Qwen3VLMoeConfig(
            text_config=dict(COMMON, intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                             num_hidden_layers=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                             tie_word_embeddings=False, **text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                                 "mrope_interleaved": True, "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=3, hidden_size=24, intermediate_size=40, num_heads=2, out_hidden_size=64, patch_size=4,
                               temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16,
                               deepstack_visual_indexes=[0, 1]),
            image_token_id=240, video_token_id=241, vision_start_token_id=242, vision_end_token_id=243, tie_word_embeddings=False)
    def qwen3_next(mlp_only_layers):
        return tf.Qwen3NextConfig(**COMMON, intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=40,
                                  num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                  norm_topk_prob=True, max_position_embeddings=128, tie_word_embeddings=False,
                                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                  linear_value_head_dim=8, linear_conv_kernel_dim=4, mlp_only_layers=mlp_only_layers,
                                  layer_types=["linear_attention", "full_attention"] * 2)
    def nemotron_h(layers_block_type, **moe):
        return tf.NemotronHConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                                  layers_block_type=layers_block_type, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8,
                                  n_groups=2, ssm_state_size=16, chunk_size=8, layer_norm_epsilon=1e-5, max_position_embeddings=128,
                                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0, **moe)
    nemotron_moe_layers = ["linear_attention", "moe", "full_attention", "moe"]
    nemotron_moe = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=48,
                        moe_shared_expert_intermediate_size=40, routed_scaling_factor=2.5)
    return {
        "llama": tf.LlamaConfig(**COMMON, intermediate_size=128, num_hidden_layers=4, num_key_value_heads=2,
                                max_position_embeddings=16384, rope_theta=500000.0, rope_scaling=llama3),
        "llama_tied": tf.LlamaConfig(**COMMON, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=4,
                                     max_position_embeddings=128, tie_word_embeddings=True),
        "mistral": tf.MistralConfig(**COMMON, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2,
                                    head_dim=32, sliding_window=None, max_position_embeddings=128),
        "qwen2": tf.Qwen2Config(**COMMON, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2,
                                max_position_embeddings=128, rope_theta=1e6, tie_word_embeddings=False),
        "qwen3": tf.Qwen3Config(**COMMON, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2,
                                head_dim=32, max_position_embeddings=128, tie_word_embeddings=False),
        "mixtral": tf.MixtralConfig(**COMMON, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
                                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128),
        "qwen3_moe": tf.Qwen3MoeConfig(**qwen3_moe, norm_topk_prob=True),
        "qwen3_moe_softmax": tf.Qwen3MoeConfig(**qwen3_moe),  # norm_topk_prob false, as transformers defaults it
        "qwen2_moe": tf.Qwen2MoeConfig(**qwen2_moe),  # norm_topk_prob false, as transformers defaults it
        "qwen2_moe_topk_norm": tf.Qwen2MoeConfig(**qwen2_moe, norm_topk_prob=True),
        # dense MLPs of intermediate_size between MoE layers (Megatron keys each layer apart): layer 1 dense,
        # and in Qwen3-MoE every other layer, the first dense
        "qwen2_moe_mixed": tf.Qwen2MoeConfig(**qwen2_moe, mlp_only_layers=[1]),
        "qwen3_moe_mixed": tf.Qwen3MoeConfig(**qwen3_moe, norm_topk_prob=True, decoder_sparse_step=2),
        "deepseek_v3": tf.DeepseekV3Config(**DEEPSEEK, q_lora_rank=24, max_position_embeddings=512, rope_parameters=yarn),
        "deepseek_v3_q": tf.DeepseekV3Config(**DEEPSEEK, q_lora_rank=None, max_position_embeddings=128),
        # every layer MoE: 4 routed experts in 2 groups (1 chosen), top-2, a shared expert, scaled weights
        "deepseek_v3_moe": tf.DeepseekV3Config(**dict(DEEPSEEK, first_k_dense_replace=0), q_lora_rank=24,
                                               max_position_embeddings=128, routed_scaling_factor=2.5),
        # DeepSeek-V3's layout in small: the first layer dense, the next MoE (Megatron keys each layer apart)
        "deepseek_v3_mixed": tf.DeepseekV3Config(**dict(DEEPSEEK, first_k_dense_replace=1), q_lora_rank=24,
                                                 max_position_embeddings=128),
        # DeepSeek-V3's multi-token prediction in small: a dense layer, an MoE one, then one MTP layer (model.layers.2)
        "deepseek_v3_mtp": tf.DeepseekV3Config(**dict(DEEPSEEK, first_k_dense_replace=1, num_nextn_predict_layers=1), q_lora_rank=24,
                                               max_position_embeddings=128, rope_parameters=yarn),
        # full-width q/k norms (over 4 and 2 heads of 16), half the head dims rotating, sigmoid routing with a bias
        "minimax_m2": tf.MiniMaxM2Config(**COMMON, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                                         rotary_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                                         use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True),
        # Kimi-K2: DeepSeek-V3's classes under model_type kimi_k2 (`SAVED_AS`), with rms_norm_eps 1e-5, one routing group
        "kimi_k2": tf.DeepseekV3Config(**dict(DEEPSEEK, first_k_dense_replace=1, rms_norm_eps=1e-5, n_group=1), q_lora_rank=24,
                                       max_position_embeddings=512, rope_parameters=dict(yarn, beta_fast=1.0, beta_slow=1.0)),
        # GLM-4.5 in small: q/k/v biases, per-head q/k norms, half the head dims rotated, a dense layer then an MoE
        # one (sigmoid router with its correction bias, a shared expert, scaled weights), and one MTP layer
        "glm4_moe": tf.Glm4MoeConfig(**dict(COMMON, rms_norm_eps=1e-5), intermediate_size=96, num_hidden_layers=2,
                                     num_key_value_heads=2, head_dim=32, max_position_embeddings=128, attention_bias=True,
                                     use_qk_norm=True, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32,
                                     num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                     num_nextn_predict_layers=1, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        # gpt-oss in small: fused experts with biases, sinks, a window of 8 (the tests' 16 tokens see past it) on the
        # first layer and full attention on the second, the clamped SwiGLU, YaRN unrounded (truncate false) as
        # released; hidden 64 and expert width 48 (neither 2x nor 1x the other: a transposition shows in the shapes)
        "gpt_oss": tf.GptOssConfig(**dict(COMMON, rms_norm_eps=1e-5), intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2,
                                   head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128,
                                   swiglu_limit=7.0, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
        # the same with experts of 96 (MXFP4 groups 32 input columns: down_proj's 96, gate_up_proj's 64)
        "gpt_oss_mxfp4": tf.GptOssConfig(**dict(COMMON, rms_norm_eps=1e-5), intermediate_size=96, num_hidden_layers=2,
                                         num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                         max_position_embeddings=128, tie_word_embeddings=False),
        # GLM-4.7-Flash: DeepSeek-V3's MLA and MoE under GLM's config (mlp_layer_types, rms_norm_eps 1e-5), a dense layer
        # then an MoE one and an MTP layer keeping copies of the embedding and head, as the release does
        "glm4_moe_lite": tf.Glm4MoeLiteConfig(**{k: v for k, v in DEEPSEEK.items() if k != "first_k_dense_replace"} | lite,
                                              mlp_layer_types=["dense", "sparse"], q_lora_rank=24,
                                              max_position_embeddings=128, routed_scaling_factor=1.8),
        # Qwen2.5-VL in small: Qwen2's language model (q/k/v biases) with MRoPE sections 2, 3, 3 of the 8 rotary
        # frequencies, beside a two-block vision tower (window attention in block 0, full in block 1) whose merger
        # feeds the language model's width; image tokens inside the 250-token vocabulary
        "qwen2_5_vl": tf.Qwen2_5_VLConfig(
            text_config=dict(COMMON, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=128,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                               temporal_patch_size=2, spatial_merge_size=2, in_channels=3, window_size=16, fullatt_block_indexes=[1]),
            image_token_id=240, video_token_id=241, vision_start_token_id=242, vision_end_token_id=243, tie_word_embeddings=False),
        # Qwen3-VL in small: Qwen3's language model (q/k norms, no biases) with interleaved MRoPE sections 2, 3, 3 of the 8
        # rotary frequencies, beside a three-block vision tower in Megatron form at Bridge (widths 24, 40, merged 96: none
        # square, none twice another) whose blocks 0 and 1 feed DeepStack mergers; a 4 x 4 grid of position embeddings
        "qwen3_vl": tf.Qwen3VLConfig(
            text_config=dict(COMMON, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=128, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                                              "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=3, hidden_size=24, intermediate_size=40, num_heads=2, out_hidden_size=64, patch_size=4,
                               temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16,
                               deepstack_visual_indexes=[0, 1]),
            image_token_id=240, video_token_id=241, vision_start_token_id=242, vision_end_token_id=243, tie_word_embeddings=False),
        # Qwen3-VL-MoE in small: Qwen3-VL's vision tower and MRoPE beside Qwen3-MoE's language model, layer 0 MoE and
        # layer 1 dense (mlp_only_layers), 4 experts of 48 (top-2), the dense MLP 96; experts stored fused as the release
        # stores them (`RELEASE_FORMS`)
        "qwen3_vl_moe": qwen3_vl_moe(mlp_only_layers=[1]),
        # every layer MoE, as released (Megatron-Bridge 0.6.2's Qwen3-VL-MoE builds every layer so whatever config.json says)
        "qwen3_vl_moe_all": qwen3_vl_moe(mlp_only_layers=[]),
        # Qwen3-Next in small: Gated DeltaNet on layers 0 and 2 (2 key heads of 16, 4 value heads of 8: two value heads per
        # key head), gated attention with per-head q/k norms on 1 and 3, a quarter of the head dims rotated, zero-centred
        # norms, layer 0's MLP dense and the others MoE with a gated shared expert (widths 96, 48, 40: none square, none
        # twice the hidden size 64)
        "qwen3_next": qwen3_next(mlp_only_layers=[0]),
        # every MLP MoE, as in the released Qwen3-Next (Megatron-Bridge 0.6.2 does not read mlp_only_layers)
        "qwen3_next_all_moe": qwen3_next(mlp_only_layers=[]),
        # Qwen3.5's text model in small: Qwen3-Next's layers with dense MLPs and in_proj split four ways; its multimodal
        # RoPE's sections over the two rotating frequencies
        "qwen3_5": tf.Qwen3_5TextConfig(**COMMON, intermediate_size=96, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=128, tie_word_embeddings=False, linear_num_key_heads=2,
                                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                                        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                                         "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
        # Qwen3.5-MoE's text model in small: Qwen3.5's layers (as above) with Qwen3-Next's MoE block on every one, 4 experts of
        # 48 (top-2) and a gated shared expert of 40; experts per expert as transformers saves them, or (`_fused`) fused as
        # the Hub's release stores them (`FUSED_FORMS`)
        "qwen3_5_moe": qwen3_5_moe,
        "qwen3_5_moe_fused": qwen3_5_moe,
        "qwen3_5_vl": qwen3_5_vl(moe=False),
        "qwen3_5_vl_moe": qwen3_5_vl(moe=True),
        "qwen3_5_vl_moe_fused": qwen3_5_vl(moe=True),
        # Nemotron-H in small: Mamba-2, attention, Mamba-2, squared-ReLU MLP (pattern "M*M-"); 8 Mamba heads of 8 in 2
        # groups of B/C of state 16 (TP2 splits both), attention with 2 KV groups, an MLP of 96
        "nemotron_h": nemotron_h(["linear_attention", "full_attention", "linear_attention", "mlp"]),
        # its MoE layers: Mamba-2, MoE, attention, MoE (pattern "ME*E"; two stages cut between an MoE layer and the
        # attention layer); 4 squared-ReLU experts of 48 in 2 routing groups (1 chosen), top-2 renormalised and scaled by
        # 2.5, the router's correction bias, a shared expert of 40 (none square, none twice the hidden size 64)
        "nemotron_h_moe": nemotron_h(nemotron_moe_layers, **nemotron_moe),
        # Nemotron 3's latent MoE: the same, the routed experts computing in a latent of 32
        "nemotron_h_latent": nemotron_h(nemotron_moe_layers, **nemotron_moe, moe_latent_size=32),
        "gpt2": tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB,
                              activation_function="gelu_new", bos_token_id=0, eos_token_id=1),
    }


# config.json fields a family's release writes where transformers writes others
SAVED_AS = {"kimi_k2": {"model_type": "kimi_k2"}}
# fused expert tensors a family's release stores transposed against transformers' in-memory form (which it saves):
# Qwen3-VL-MoE's gate_up_proj [E, H, 2I] and down_proj [E, I, H]; transformers reads either (Transpose(check_dims))
FUSED_FORMS = {"qwen3_5_moe_fused", "qwen3_5_vl_moe_fused"}  # per-expert tensors a family's release stores fused in transformers' in-memory form
RELEASE_FORMS = {name: (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj") for name in ("qwen3_vl_moe", "qwen3_vl_moe_all")}

# Qwen3-Next's and Qwen3.5's releases store one MTP layer apart, under `mtp.`, which transformers neither builds nor saves:
# these are their base models (the name less `_mtp`) with one added as the release names it (`_add_release_mtp`)
RELEASE_MTP = {"qwen3_next_mtp", "qwen3_next_all_moe_mtp", "qwen3_5_mtp", "qwen3_5_moe_mtp", "qwen3_5_vl_mtp", "qwen3_5_vl_moe_mtp"}

MOE = {"mixtral", "qwen3_moe", "qwen2_moe", "qwen2_moe_mixed", "qwen3_moe_mixed", "deepseek_v3_moe", "deepseek_v3_mixed", "minimax_m2",
       "gpt_oss", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_fused", "nemotron_h_moe", "nemotron_h_latent"}
NAMES = ["llama", "llama_tied", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "qwen2_moe_mixed", "qwen3_moe_mixed",
         "deepseek_v3", "deepseek_v3_q",
         "deepseek_v3_moe", "deepseek_v3_mixed", "gpt2", "minimax_m2", "gpt_oss", "qwen3_next", "qwen3_5", "qwen3_5_moe",
         "qwen3_5_moe_fused", "nemotron_h", "nemotron_h_moe", "nemotron_h_latent"]


def build(name: str, directory: Path, seed: int = 0, **save_kwargs) -> Path:
    """Save a randomly initialised tiny `name` model (every parameter, norms included, randomised)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = _configs()[name.removesuffix("_mtp") if name in RELEASE_MTP else name]
    layers, mtp = config.get_text_config().num_hidden_layers, getattr(config, "num_nextn_predict_layers", 0)
    config.get_text_config().num_hidden_layers = layers + mtp  # transformers builds no MTP layers: their decoder layers are built past the last
    if name in RELEASE_MTP:  # the MTP layer is built as one more decoder layer, a full-attention one, and moved
        text = config.get_text_config()
        text.layer_types = [*text.layer_types, "full_attention"]
        text.num_hidden_layers = layers + 1
    if mtp and getattr(config, "mlp_layer_types", None):  # GLM-4.7-Flash's MTP layers are MoE, as its last layer
        config.mlp_layer_types = config.mlp_layer_types + config.mlp_layer_types[-1:] * mtp
    model = (AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM).from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "ln_" in pname:
                p.copy_((1.0 if pname.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # DeepSeek's routing bias, saved like a weight
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(directory, **save_kwargs)
    if mtp:
        _add_mtp_heads(directory, layers, mtp, copies=config.model_type in ("deepseek_v3", "glm4_moe_lite"))
    if name in RELEASE_MTP:
        _add_release_mtp(directory, layers, "model.language_model." if hasattr(config, "vision_config") else "model.")
    if name in SAVED_AS:
        _edit_config(directory, **SAVED_AS[name])
    if name in RELEASE_FORMS:
        _transpose_fused(directory, RELEASE_FORMS[name])
    if name in FUSED_FORMS:
        _fuse_experts(directory)
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')  # stands in for tokenizer files
    if hasattr(config, "vision_config"):  # and for a multimodal model's processor files
        (directory / "preprocessor_config.json").write_text('{"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2}\n')
        (directory / "chat_template.json").write_text('{"chat_template": "{{ messages }}"}\n')
    return directory


def _add_mtp_heads(directory: Path, layers: int, mtp: int, copies: bool) -> None:
    """Turn the last `mtp` decoder layers of a saved model into its MTP layers, as DeepSeek-V3's (GLM-4.6's) release
    stores them: each with its enorm, hnorm, eh_proj, shared_head.norm, and (`copies`: DeepSeek-V3's) copies of the
    embedding and output head."""
    from safetensors.torch import load_file, save_file

    file = directory / "model.safetensors"
    tensors = load_file(file)
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    for layer in range(layers, layers + mtp):
        p = f"model.layers.{layer}."
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{p}{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden)
        tensors[f"{p}eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden)
        if not copies:
            continue
        tensors[f"{p}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"{p}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    kinds = {"mlp_layer_types": config["mlp_layer_types"][:layers]} if "mlp_layer_types" in config else {}
    _edit_config(directory, num_hidden_layers=layers, **kinds)


def _add_release_mtp(directory: Path, layers: int, text: str) -> None:
    """Turn the last decoder layer of a saved Qwen3-Next or Qwen3.5 (its language model's tensors under `text`) into its
    MTP layer as the release stores it: `mtp.layers.0.*` (top-level, a VL model's too), with `mtp.fc` (the projection of
    [normed embedding; normed hidden state]), its two norms `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden` and
    the final `mtp.norm` (weights near 1, deterministic)."""
    from safetensors.torch import load_file, save_file

    file = directory / "model.safetensors"
    tensors, p = load_file(file), f"{text}layers.{layers}."
    tensors = {(f"mtp.layers.0.{k.removeprefix(p)}" if k.startswith(p) else k): t for k, t in tensors.items()}
    hidden = tensors[f"{text}embed_tokens.weight"].shape[1]
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden)
    tensors["mtp.fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden)
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    nested = "text_config" in config
    fields = config["text_config"] if nested else config
    fields.update(num_hidden_layers=layers, layer_types=fields["layer_types"][:layers], mtp_num_hidden_layers=1)
    _edit_config(directory, **({"text_config": fields} if nested else fields))


def _transpose_fused(directory: Path, endings: tuple[str, ...]) -> None:
    """Store the fused expert tensors ending so as their release does: each expert's matrix transposed."""
    from safetensors.torch import load_file, save_file

    file = directory / "model.safetensors"
    tensors = load_file(file)
    tensors.update({k: t.transpose(1, 2).contiguous() for k, t in tensors.items() if k.endswith(endings)})
    save_file(tensors, str(file), metadata={"format": "pt"})


def _fuse_experts(directory: Path) -> None:
    """Store the per-expert tensors transformers saved fused, as transformers' own qwen2_moe conversion fuses them on
    loading: gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows), down_proj [E, H, I]."""
    import re

    from safetensors.torch import load_file, save_file

    file = directory / "model.safetensors"
    tensors, per_expert = load_file(file), re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name in [n for n in tensors if per_expert.match(n)]:
        module, index, kind = per_expert.match(name).groups()
        experts.setdefault(module, {}).setdefault(kind, {})[int(index)] = tensors.pop(name)
    for module, kinds in experts.items():
        stack = {kind: torch.stack([by_index[i] for i in sorted(by_index)]) for kind, by_index in kinds.items()}
        tensors[f"{module}.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
        tensors[f"{module}.down_proj"] = stack["down"]
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(directory: Path, **fields) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, **fields), indent=2))


def load(source: Path):
    """The saved model, built by transformers' class its config.json names (AutoModel knows no kimi_k2), read as that
    class's model_type (transformers picks the per-expert -> fused weight conversion by model_type)."""
    import transformers

    cls = getattr(transformers, json.loads((source / "config.json").read_text())["architectures"][0])
    config = cls.config_class.from_pretrained(source)
    config.model_type = cls.config_class.model_type
    return cls.from_pretrained(source, config=config, attn_implementation="eager").eval()


def edited_copy(source: Path, directory: Path, edit) -> Path:
    """A copy of saved model `source` in `directory`, its model.safetensors' tensors (a dict) changed by `edit`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
