"""Pure HF <-> Megatron transforms: round trips and the GQA grouping against a hand-written reference."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.architecture import model_tensors
from reshard.config import ModelConfig
from reshard.converters import FAMILIES, family_by_name, family_for_hf
from reshard.converters.base import (
    QKV,
    FusedQKV,
    GatedMLP,
    Transposed,
    check_rope_scaling,
    fuse_gated,
    group_qkv,
    rope_from_hf,
    split_gated,
    split_qkv,
)
from reshard.converters.deepseek_v3 import yarn_from_hf
from reshard.errors import ReshardError
from reshard.logical import describe
from reshard.naming import ObjectKey, canonical, default_extra_state, layer_is_moe

_rng = np.random.default_rng(0)


def randn(*shape):
    return _rng.standard_normal(shape).astype(np.float32)


def reference_qkv(q, k, v, heads, groups, head_dim):
    """The doc's rule, with plain indexing: per KV group g, its heads/groups q heads, then k_g, then v_g."""
    per = heads // groups
    rows = []
    for g in range(groups):
        for h in range(g * per, (g + 1) * per):
            rows.append(q[h * head_dim : (h + 1) * head_dim])
        rows.append(k[g * head_dim : (g + 1) * head_dim])
        rows.append(v[g * head_dim : (g + 1) * head_dim])
    return np.concatenate(rows, axis=0)


@pytest.mark.parametrize("heads,groups,head_dim", [(4, 2, 16), (8, 1, 4), (6, 6, 8), (8, 4, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_group_qkv_matches_reference_and_round_trips(heads, groups, head_dim, bias):
    hidden = 10
    shape = () if bias else (hidden,)
    q = randn(heads * head_dim, *shape)
    k = randn(groups * head_dim, *shape)
    v = randn(groups * head_dim, *shape)
    fused = group_qkv(q, k, v, heads, groups, head_dim)
    assert np.array_equal(fused, reference_qkv(q, k, v, heads, groups, head_dim))
    q2, k2, v2 = split_qkv(fused, heads, groups, head_dim)
    assert np.array_equal(q2, q) and np.array_equal(k2, k) and np.array_equal(v2, v)


def test_group_qkv_is_not_plain_concatenation_for_gqa():
    q, k, v = randn(64, 8), randn(32, 8), randn(32, 8)
    assert not np.array_equal(group_qkv(q, k, v, 4, 2, 16), np.concatenate([q, k, v]))


def test_group_qkv_tp_split_takes_whole_groups():
    """A TP rank's contiguous share of linear_qkv holds exactly its own KV groups' q, k, v."""
    heads, groups, hd, tp = 8, 4, 2, 2
    q = np.arange(heads * hd, dtype=np.float32)[:, None]
    k = 100 + np.arange(groups * hd, dtype=np.float32)[:, None]
    v = 200 + np.arange(groups * hd, dtype=np.float32)[:, None]
    fused = group_qkv(q, k, v, heads, groups, hd)
    share = fused.shape[0] // tp
    rank1 = fused[share:]
    q1, k1, v1 = split_qkv(rank1, heads // tp, groups // tp, hd)
    assert np.array_equal(q1, q[heads * hd // 2 :]) and np.array_equal(k1, k[groups * hd // 2 :]) and np.array_equal(v1, v[groups * hd // 2 :])


def test_gated_round_trip_and_order():
    gate, up = randn(6, 4), randn(6, 4)
    fc1 = fuse_gated(gate, up)
    assert np.array_equal(fc1[:6], gate) and np.array_equal(fc1[6:], up)
    g2, u2 = split_gated(fc1)
    assert np.array_equal(g2, gate) and np.array_equal(u2, up)
    with pytest.raises(ReshardError):
        fuse_gated(gate, randn(5, 4))


CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                  ffn_hidden_size=96, padded_vocab_size=256, vocab_size=250)


def test_mapping_objects_round_trip():
    q, k, v = randn(64, 64), randn(32, 64), randn(32, 64)
    m = QKV("x", "q{layer}", "k{layer}", "v{layer}")
    assert m.hf_names(3) == ["q3", "k3", "v3"]
    for a, b in zip(m.to_hf(m.to_megatron([q, k, v], CFG), CFG), (q, k, v)):
        assert np.array_equal(a, b)
    assert m.hf_shapes((128, 64), CFG) == [(64, 64), (32, 64), (32, 64)]
    g = GatedMLP("x", "g", "u")
    w = randn(192, 64)
    assert np.array_equal(g.to_megatron(g.to_hf(w, CFG), CFG), w)
    t = Transposed("x", "c")
    conv = randn(64, 256)
    assert np.array_equal(t.to_megatron([conv], CFG), conv.T) and np.array_equal(t.to_hf(t.to_megatron([conv], CFG), CFG)[0], conv)


def test_fused_conv1d_qkv_matches_separate_projections():
    """GPT-2 c_attn ([in, 3*out] Conv1D) gives the same linear_qkv as separate q/k/v Linear weights."""
    mha = CFG.replace(num_query_groups=None)
    q, k, v = randn(64, 64), randn(64, 64), randn(64, 64)
    c_attn = np.concatenate([q, k, v], axis=0).T.copy()
    m = FusedQKV("x", "c", conv1d=True)
    assert np.array_equal(m.to_megatron([c_attn], mha), group_qkv(q, k, v, 4, 4, 16))
    assert np.array_equal(m.to_hf(m.to_megatron([c_attn], mha), mha)[0], c_attn)
    bias = randn(192)
    assert np.array_equal(m.to_hf(m.to_megatron([bias], mha), mha)[0], bias)


def test_rope_settings_v4_and_v5():
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    assert rope_from_hf({"rope_theta": 5e5, "rope_scaling": llama3}) == (5e5, llama3)
    theta, scaling = rope_from_hf({"rope_parameters": {"rope_theta": 5e5, **llama3}})
    assert theta == 5e5 and scaling == llama3
    assert rope_from_hf({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == (1e6, None)
    assert check_rope_scaling(llama3) == (True, 32.0)
    with pytest.raises(ReshardError, match="yarn"):
        check_rope_scaling({"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ReshardError, match="high_freq_factor"):
        check_rope_scaling(dict(llama3, high_freq_factor=2.0))


BASE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 250, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}


MROPE = {"type": "mrope", "mrope_section": [2, 3, 3]}  # 8 rotary frequencies of BASE's head_dim 16
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64, "patch_size": 4,
          "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "fullatt_block_indexes": [1]}
# Qwen3-VL's: interleaved MRoPE, a vision model of three blocks two of which feed DeepStack mergers
MROPE_INTERLEAVED = {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True, "mrope_section": [2, 3, 3]}
VISION3 = {"depth": 3, "hidden_size": 24, "intermediate_size": 40, "num_heads": 2, "out_hidden_size": 64, "patch_size": 4,
           "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "num_position_embeddings": 16,
           "deepstack_visual_indexes": [0, 1]}
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
DEEPSEEK = {"num_key_value_heads": 4, "first_k_dense_replace": 2, "q_lora_rank": 24, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "head_dim": 8}
DEEPSEEK_MOE = dict(DEEPSEEK, first_k_dense_replace=0, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                    n_group=2, topk_group=1, moe_intermediate_size=32, norm_topk_prob=True, routed_scaling_factor=2.5)


@pytest.mark.parametrize("arch,extra,match", [
    ("MistralForCausalLM", {"sliding_window": 4096}, "sliding_window"),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 64}, "sliding_window"),
    ("LlamaForCausalLM", {"attention_bias": True}, "attention_bias"),
    ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias"),
    ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization"),
    ("Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 32, "decoder_sparse_step": 3}, "every layer is dense"),
    ("Qwen2MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                             "qkv_bias": False}, "qkv_bias"),
    ("GPT2LMHeadModel", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "scale_attn_by_inverse_layer_idx": True}, "inverse_layer"),
    ("FalconForCausalLM", {}, "not supported"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, first_k_dense_replace=-1), "first_k_dense_replace"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK_MOE, num_experts_per_tok=3), "topk_group"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK_MOE, norm_topk_prob=False), "norm_topk_prob"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK_MOE, n_group=3), "n_group"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK_MOE, n_shared_experts=0), "n_shared_experts"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, rope_interleave=False), "rope_interleave"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, num_key_value_heads=2), "num_key_value_heads"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, num_nextn_predict_layers=1), "MTP layers in a model without MoE layers"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK_MOE, num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, rope_scaling=dict(YARN, attention_factor=1.2)), "attention_factor"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, rope_scaling=dict(YARN, truncate=False)), "truncate"),
    ("DeepseekV3ForCausalLM", dict(DEEPSEEK, rope_scaling=dict(YARN, mscale=0.0)), "mscale_all_dim without mscale"),
    ("Qwen2_5_VLForConditionalGeneration", {"vision_config": VISION}, "mrope_section"),
    ("Qwen2_5_VLForConditionalGeneration", {"vision_config": VISION, "rope_scaling": dict(MROPE, mrope_section=[2, 3, 2])},
     r"mrope_section=\[2, 3, 2\] is not sections of the 8 rotary frequencies"),
    ("Qwen2_5_VLForConditionalGeneration", {"rope_scaling": MROPE}, "vision_config=null"),
    ("Qwen2_5_VLForConditionalGeneration", {"vision_config": dict(VISION, out_hidden_size=32), "rope_scaling": MROPE},
     "vision_config.out_hidden_size=32 is not the language model's hidden_size 64"),
    ("Qwen2_5_VLForConditionalGeneration", {"vision_config": dict(VISION, num_heads=3), "rope_scaling": MROPE}, "vision_config.num_heads"),
    ("Qwen2_5_VLForConditionalGeneration", {"vision_config": dict(VISION, depth=0), "rope_scaling": MROPE}, "vision_config.depth"),
    ("Qwen3VLForConditionalGeneration", {"vision_config": dict(VISION3, deepstack_visual_indexes=[3]), "rope_parameters": MROPE_INTERLEAVED},
     "vision_config.deepstack_visual_indexes"),
    ("Qwen3VLForConditionalGeneration", {"vision_config": dict(VISION3, hidden_act="silu"), "rope_parameters": MROPE_INTERLEAVED},
     "vision_config.hidden_act"),
    ("Qwen3VLForConditionalGeneration", {"vision_config": VISION3, "rope_parameters": dict(MROPE_INTERLEAVED, mrope_interleaved=False)},
     "mrope_interleaved"),
])
def test_unmapped_hf_features_are_refused(arch, extra, match):
    hf = dict(BASE, architectures=[arch], **extra)
    with pytest.raises(ReshardError, match=match):
        family_for_hf(hf).config_from_hf(hf)


QWEN3_5_VL_TEXT = dict(BASE, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                       layer_types=["linear_attention", "full_attention"],
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                        "mrope_interleaved": True, "mrope_section": [2, 1, 1]})
HF_CONFIGS = {
    "llama": dict(BASE, architectures=["LlamaForCausalLM"], tie_word_embeddings=True),
    "mistral": dict(BASE, architectures=["MistralForCausalLM"]),
    "qwen2": dict(BASE, architectures=["Qwen2ForCausalLM"]),
    "qwen3": dict(BASE, architectures=["Qwen3ForCausalLM"], head_dim=32),
    "mixtral": dict(BASE, architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(BASE, architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(BASE, architectures=["Qwen2MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "deepseek_v3": dict(BASE, architectures=["DeepseekV3ForCausalLM"], **DEEPSEEK, rope_scaling=YARN),
    "minimax_m2": dict(BASE, architectures=["MiniMaxM2ForCausalLM"], num_local_experts=4, num_experts_per_tok=2, rotary_dim=8),
    "glm4_moe": dict(BASE, architectures=["Glm4MoeForCausalLM"], head_dim=32, n_routed_experts=4, n_shared_experts=1,
                     moe_intermediate_size=32, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0,
                     attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, num_nextn_predict_layers=1),
    "gpt_oss": dict(BASE, architectures=["GptOssForCausalLM"], num_local_experts=4, num_experts_per_tok=2, attention_bias=True,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                    swiglu_limit=7.0, rope_scaling=dict(YARN, truncate=False)),
    "glm4_moe_lite": dict(BASE, architectures=["Glm4MoeLiteForCausalLM"],
                          **{k: v for k, v in DEEPSEEK_MOE.items() if k not in ("first_k_dense_replace", "head_dim")},
                          mlp_layer_types=["sparse", "sparse"], num_nextn_predict_layers=1),
    "qwen3_next": dict(BASE, architectures=["Qwen3NextForCausalLM"], head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                       layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_text": dict(BASE, architectures=["Qwen3_5ForCausalLM"], head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                         layer_types=["linear_attention", "full_attention"]),
    # the Hub's spelling of the layer pattern (transformers 5 saves layers_block_type)
    "nemotron_h": dict(BASE, architectures=["NemotronHForCausalLM"], hybrid_override_pattern="M*M-", num_hidden_layers=4,
                       mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, layer_norm_epsilon=1e-5),
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "vocab_size": 250},
    # the older Hub layout: the text fields at the top, MRoPE in rope_scaling
    "qwen2_5_vl": dict(BASE, architectures=["Qwen2_5_VLForConditionalGeneration"], rope_scaling=MROPE, vision_config=VISION),
    "qwen3_vl": dict(BASE, architectures=["Qwen3VLForConditionalGeneration"], rope_parameters=MROPE_INTERLEAVED, vision_config=VISION3),
    "qwen3_vl_moe": dict(BASE, architectures=["Qwen3VLMoeForConditionalGeneration"], rope_parameters=MROPE_INTERLEAVED,
                         vision_config=VISION3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
    # no intermediate_size: transformers' Qwen3.5-MoE config has none (no dense MLP)
    "qwen3_5_moe_text": dict({k: v for k, v in BASE.items() if k != "intermediate_size"}, architectures=["Qwen3_5MoeForCausalLM"],
                             head_dim=16, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=48, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                             layer_types=["linear_attention", "full_attention"]),
    # Qwen3.5-VL: Qwen3.5's text model nested, MRoPE over the rotating quarter of heads of 32, Qwen3-VL's vision model
    # without DeepStack mergers
    "qwen3_5": dict(architectures=["Qwen3_5ForConditionalGeneration"], text_config=QWEN3_5_VL_TEXT,
                    vision_config={k: v for k, v in VISION3.items() if k != "deepstack_visual_indexes"}),
    "qwen3_5_moe": dict(architectures=["Qwen3_5MoeForConditionalGeneration"],
                        text_config=dict({k: v for k, v in QWEN3_5_VL_TEXT.items() if k != "intermediate_size"}, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=40),
                        vision_config={k: v for k, v in VISION3.items() if k != "deepstack_visual_indexes"}),
}


def test_every_family_maps_exactly_the_model_tensors():
    assert set(HF_CONFIGS) == set(FAMILIES)
    for name, hf in HF_CONFIGS.items():
        family = family_for_hf(hf)
        config, _ = family.config_from_hf(hf)
        assert {m.megatron for m in family.mappings(config)} == set(model_tensors(config)), name
        assert family.matches(config), name
        back = family.config_to_hf(config, None, {})
        again, _ = family.config_from_hf(back)
        assert again == config, name


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_stacks_rows_says_exactly_when_the_hf_tensors_are_the_slab_cut_in_row_bands(name):
    """The flag that lets a writer vouch for HF tensors without a read-back must agree with the transform."""
    family = family_for_hf(HF_CONFIGS[name])
    config, _ = family.config_from_hf(HF_CONFIGS[name])
    shapes = model_tensors(config)
    for mapping in family.mappings(config):
        slab = randn(*shapes[mapping.megatron][describe(mapping.megatron, shapes[mapping.megatron], "float32", config).prefix_axes:])
        parts = [t.reshape(-1, *slab.shape[1:]) for t in mapping.to_hf(slab, config)]
        stacked = np.concatenate(parts) if all(p.shape[1:] == slab.shape[1:] for p in parts) else None
        assert mapping.stacks_rows == (stacked is not None and stacked.shape == slab.shape and np.array_equal(stacked, slab)), mapping.megatron


def test_deepseek_yarn_maps_onto_mla_fields_as_transformers_reads_them():
    fields = dict(rope_type="yarn", rotary_scaling_factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                  beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    assert yarn_from_hf(YARN) == fields
    # transformers ignores mscale without mscale_all_dim (cos/sin get yarn's default scale): Megatron's mscale 1, all_dim 0
    alone = yarn_from_hf(dict(YARN, mscale=0.707, mscale_all_dim=0))
    assert (alone["mscale"], alone["mscale_all_dim"]) == (1.0, 0.0)


def test_deepseek_routing_is_no_other_family_s_and_the_other_routings_are_not_deepseek_s():
    deepseek, _ = family_for_hf(HF_CONFIGS["deepseek_v3"]).config_from_hf(dict(HF_CONFIGS["deepseek_v3"], **DEEPSEEK_MOE))
    mixtral, _ = family_for_hf(HF_CONFIGS["mixtral"]).config_from_hf(HF_CONFIGS["mixtral"])
    sigmoid = mixtral.replace(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    with pytest.raises(ReshardError, match="moe_router_score_function='sigmoid'"):
        family_by_name("mixtral").check_megatron(sigmoid)
    with pytest.raises(ReshardError, match="sigmoid with an expert bias"):
        family_by_name("deepseek_v3").check_megatron(deepseek.replace(moe_router_score_function="softmax"))
    with pytest.raises(ReshardError, match="moe_layer_freq"):
        family_by_name("deepseek_v3").check_megatron(deepseek.replace(moe_layer_freq=[1, 0]))  # MoE before dense


def test_a_model_of_mixed_layers_is_keyed_layer_by_layer_as_megatron_saves_it():
    """Names, shapes and object keys as a megatron-core 0.16.1 torch_dist save of a 3-layer MLA model with
    moe_layer_freq=[0, 1, 1] (local spec, 4 experts, a shared expert) listed them."""
    config, _ = family_for_hf(HF_CONFIGS["deepseek_v3"]).config_from_hf(
        dict(HF_CONFIGS["deepseek_v3"], **dict(DEEPSEEK_MOE, num_hidden_layers=3, first_k_dense_replace=1)))
    assert config.moe_layer_freq == (0, 1, 1) and config.per_layer_names and config.moe_layers == [False, True, True]
    shapes = model_tensors(config)
    assert not any(name.startswith("decoder.layers.") and not name[len("decoder.layers."):][0].isdigit() for name in shapes)
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (192, 64)
    assert shapes["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"] == (4, 64, 32)
    assert shapes["decoder.layers.2.mlp.router.expert_bias"] == (4,)
    assert "decoder.layers.0.mlp.router.weight" not in shapes and "decoder.layers.1.mlp.linear_fc1.weight" not in shapes
    family = family_by_name("deepseek_v3")
    assert {m.megatron for m in family.mappings(config)} == set(shapes)
    router = next(m for m in family.mappings(config) if m.megatron == "decoder.layers.2.mlp.router.expert_bias")
    assert router.hf_names() == ["model.layers.2.mlp.gate.e_score_correction_bias"]
    objects = default_extra_state(config, te=False)
    for key in ("decoder.layers.0.mlp.linear_fc1._extra_state/shard_0_1",
                "decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state/shard_3_4",
                "decoder.layers.2.mlp.shared_experts.linear_fc2._extra_state/shard_0_1",
                "decoder.layers.2.self_attention.linear_kv_up_proj._extra_state/shard_0_1"):
        assert key in objects, key
    key = ObjectKey.parse("decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state/shard_3_4")
    assert (key.layer, key.expert, key.num_experts) == (1, 3, 4)
    key = ObjectKey.parse("decoder.layers.2.self_attention.linear_proj._extra_state/shard_0_1")
    assert (key.layer, key.expert) == (2, None)
    # the local spec spells a dense layer's pre-MLP norm like an MoE layer's; each comes back to its own canonical name
    assert canonical("decoder.layers.0.pre_mlp_layernorm.weight", "dist", layer_is_moe(config, "decoder.layers.0.x"), True) \
        == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert canonical("decoder.layers.1.pre_mlp_layernorm.weight", "dist", layer_is_moe(config, "decoder.layers.1.x"), True) \
        == "decoder.layers.1.pre_mlp_layernorm.weight"


def test_a_megatron_model_with_multi_token_prediction_is_not_exported_without_it():
    """Only HF DeepSeek-V3 holds MTP layers, and only MoE ones: any other export refuses rather than drop them."""
    deepseek, _ = family_for_hf(HF_CONFIGS["deepseek_v3"]).config_from_hf(HF_CONFIGS["deepseek_v3"])
    dense = ModelConfig.from_megatron_args({**deepseek.megatron_args(), "mtp_num_layers": 1})
    with pytest.raises(ReshardError, match="every MTP layer an MoE layer"):
        family_by_name("deepseek_v3").check_megatron(dense)
    llama, _ = family_for_hf(HF_CONFIGS["llama"]).config_from_hf(HF_CONFIGS["llama"])
    with pytest.raises(ReshardError, match="1 multi-token-prediction layers .* HF llama cannot hold"):
        family_by_name("llama").check_megatron(llama.replace(mtp_num_layers=1))


def test_mtp_extra_states_are_megatron_cores():
    """The MTP layer's `_extra_state` keys as Megatron-Core 0.16's GPTModel (mtp_num_layers=1, local spec) names
    them in its sharded_state_dict (printed from it): its projection's, then its transformer layer's linears."""
    config, _ = family_for_hf(HF_CONFIGS["deepseek_v3"]).config_from_hf(dict(HF_CONFIGS["deepseek_v3"], **DEEPSEEK_MOE))
    keys = [k for k in default_extra_state(config.replace(mtp_num_layers=1), te=False) if k.startswith("mtp.")]
    assert "mtp.layers.0.eh_proj._extra_state/shard_0_1" in keys
    assert "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2._extra_state/shard_3_4" in keys
    assert "mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj._extra_state/shard_0_1" in keys
    assert len(keys) == 1 + 2 * 4 + 2 + 5
