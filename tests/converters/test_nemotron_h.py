"""Nemotron-H's config translation and tables: in_proj's and conv1d's parts as transformers' own Mamba-2 mixer splits
them, the layer pattern read from either spelling of config.json and of Megatron-LM's args into the same layer kinds,
the tensors megatron-core's MambaStack keys, a Megatron hybrid model exported as Nemotron-H only, and what the mapping
does not carry refused by name with nothing written. The round trip (TP2, PP2 across layer kinds) is
test_hf_roundtrip.py's."""

from __future__ import annotations

import argparse

import pytest
import torch
from test_qwen3_next import bridges_own_import

from reshard.architecture import model_tensors
from reshard.config import LayerKind, ModelConfig
from reshard.converters import families_for_model, family_for_hf
from reshard.converters.nemotron_h import conv_rows, in_proj_rows, pattern_from_hf
from reshard.errors import ReshardError
from reshard.layout import Layout
from tests.cli import refused_config

from hf_models import _configs, build

M, A, P = "linear_attention", "full_attention", "mlp"


@pytest.fixture(scope="module")
def hf_config():
    return _configs()["nemotron_h"]


@pytest.fixture(scope="module")
def config(hf_config) -> ModelConfig:
    hf = hf_config.to_dict()
    return family_for_hf(hf).config_from_hf(hf)[0]


def test_in_proj_and_conv_parts_are_the_rows_transformers_mamba2_mixer_splits_them_into(hf_config, config):
    """transformers' NemotronHMamba2Mixer, fed each row's index as its value through its own split sizes, says which
    in_proj rows are z (its gate), x, B, C, dt and which conv1d channels x, B, C."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    mixer = NemotronHMamba2Mixer(hf_config, layer_idx=0)
    rows = torch.arange(mixer.in_proj.out_features)
    gate, xbc, dt = rows.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads])
    x, b, c = xbc.split([mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size, mixer.n_groups * mixer.ssm_state_size])
    assert {part: list(r) for part, r in in_proj_rows(config).items()} == {
        "z": gate.tolist(), "x": x.tolist(), "B": b.tolist(), "C": c.tolist(), "dt": dt.tolist()}
    channels = {part: list(r) for part, r in conv_rows(config).items()}
    assert [i for part in ("x", "B", "C") for i in channels[part]] == list(range(mixer.conv_dim))
    assert len(channels["x"]) == mixer.intermediate_size == 64


def test_the_pattern_is_one_layer_kind_per_symbol_under_either_spelling(config):
    assert config.hybrid_override_pattern == "M*M-" and config.per_layer_names
    assert config.layer_kinds == [LayerKind("mamba", mlp=False), LayerKind("attention", mlp=False), LayerKind("mamba", mlp=False),
                                  LayerKind(None)]
    assert pattern_from_hf({"hybrid_override_pattern": "M*M-", "num_hidden_layers": 4}) == "M*M-"  # the Hub's configs
    tensors = model_tensors(config)
    assert "decoder.final_norm.weight" in tensors and "decoder.final_layernorm.weight" not in tensors
    assert tensors["decoder.layers.0.mixer.in_proj.weight.B"] == (32, 64)
    assert tensors["decoder.layers.2.mixer.conv1d.bias.x"] == (64,)
    assert not any(name.startswith(("decoder.layers.0.mlp", "decoder.layers.1.mlp", "decoder.layers.3.mixer")) for name in tensors)


@pytest.mark.parametrize("key", ["hybrid_override_pattern", "hybrid_layer_pattern"])
def test_megatron_lm_args_of_a_hybrid_model_read_into_the_same_layer_kinds(config, key):
    """Megatron-LM's hybrid checkpoints name the pattern hybrid_override_pattern (>= 0.18: hybrid_layer_pattern)."""
    args = {**config.megatron_args(), "hybrid_override_pattern": None, "hybrid_layer_pattern": None, key: "M*M-"}
    read = ModelConfig.from_megatron_args(argparse.Namespace(**args))
    assert read.layer_kinds == config.layer_kinds and read.mamba_heads == 8 and read.mamba_num_groups == 2
    assert model_tensors(read) == model_tensors(config)
    written = config.megatron_args()
    assert written["hybrid_layer_pattern"] == written["hybrid_override_pattern"] == "M*M-" and written["is_hybrid_model"]


def test_megatron_lm_args_it_cannot_read_a_pattern_from_are_refused_by_name(config):
    args = {**config.megatron_args(), "hybrid_override_pattern": None, "hybrid_layer_pattern": None, "hybrid_attention_ratio": 0.25}
    with pytest.raises(ReshardError, match="hybrid_attention_ratio"):
        ModelConfig.from_megatron_args(args)
    with pytest.raises(ReshardError, match="num_experts"):  # MoE layers of no experts
        config.replace(hybrid_override_pattern="M*ME")
    with pytest.raises(ReshardError, match="hybrid_override_pattern"):
        config.replace(hybrid_override_pattern="M*M")


def test_tensor_parallelism_must_split_mamba_heads_and_groups_whole(config):
    Layout(tp=2).validate(config)
    with pytest.raises(ReshardError, match="Mamba groups"):
        Layout(tp=4).validate(config.replace(num_attention_heads=4, num_query_groups=4))


def test_a_megatron_hybrid_model_exports_as_nemotron_h_and_no_other(config):
    assert [family.model_type for family in families_for_model(config)] == ["nemotron_h"]
    assert families_for_model(config.replace(squared_relu=False)) == []
    gpt = config.replace(hybrid_override_pattern=None, position_embedding_type="rope", swiglu=True, squared_relu=False)
    assert "nemotron_h" not in [family.model_type for family in families_for_model(gpt)]


def test_the_hubs_pattern_spelling_is_written_back_as_it_came(config):
    family = family_for_hf({"architectures": ["NemotronHForCausalLM"]})
    saved = {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M-", "num_hidden_layers": 4}
    out = family.config_to_hf(config, saved)
    assert out["hybrid_override_pattern"] == "M*M-" and out["num_hidden_layers"] == 4 and "layers_block_type" not in out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build("nemotron_h", tmp_path_factory.mktemp("nemotron_h") / "hf")


@pytest.mark.parametrize("change,words", [
    ({"layers_block_type": [M, "moe", A, P], "moe_latent_size": 0}, ("moe_latent_size", "null or a whole number")),
    ({"layers_block_type": [M, "moe", A, P], "n_group": 2, "topk_group": 2}, ("num_experts_per_tok=2 with topk_group=2",)),
    ({"layers_block_type": [M, "moe", A, P], "norm_topk_prob": False}, ("norm_topk_prob=False",)),
    ({"layers_block_type": [M, "moe", A, P], "moe_shared_expert_intermediate_size": None}, ("moe_shared_expert_intermediate_size",)),
    ({"layers_block_type": [M, "sliding", A, P]}, ("layers_block_type",)),
    ({"conv_kernel": 3}, ("conv_kernel=3",)),
    ({"mlp_hidden_act": "silu"}, ("mlp_hidden_act='silu'",)),
    ({"num_nextn_predict_layers": 1}, ("num_nextn_predict_layers=1",)),
    ({"time_step_limit": [0.0, 2.0]}, ("time_step_limit",)),
    ({"n_groups": 3}, ("mamba_num_heads=8", "n_groups=3")),
    ({"layer_norm_epsilon": 1e-6}, ("layer_norm_epsilon=1e-06", "epsilon 1e-05")),
])
def test_what_the_mapping_does_not_carry_is_refused_by_name(source, tmp_path, monkeypatch, capsys, change, words):
    refused_config(monkeypatch, capsys, source, tmp_path, change, *words)


@pytest.fixture(scope="module")
def moe_config() -> ModelConfig:
    hf = _configs()["nemotron_h_moe"].to_dict()
    return family_for_hf(hf).config_from_hf(hf)[0]


def test_moe_layers_are_megatron_cores_moe_layers_with_deepseeks_routing(moe_config):
    """An "E" layer is megatron-core's MoE layer under its own pre-MLP norm (no attention, no fused norm): a sigmoid
    router with its expert bias, routed experts of one (not gated) projection each way, one shared expert."""
    c = moe_config
    assert c.hybrid_override_pattern == "ME*E" and c.moe_layers == [False, True, False, True]
    assert (c.num_experts, c.moe_router_topk, c.moe_router_num_groups, c.moe_router_group_topk) == (4, 2, 2, 1)
    assert (c.moe_router_score_function, c.moe_router_enable_expert_bias, c.moe_router_topk_scaling_factor) == ("sigmoid", True, 2.5)
    tensors = {name: shape for name, shape in model_tensors(c).items() if name.startswith("decoder.layers.1.")}
    assert tensors == {"decoder.layers.1.pre_mlp_layernorm.weight": (64,), "decoder.layers.1.mlp.router.weight": (4, 64),
                       "decoder.layers.1.mlp.router.expert_bias": (4,),
                       "decoder.layers.1.mlp.experts.experts.linear_fc1.weight": (4, 48, 64),
                       "decoder.layers.1.mlp.experts.experts.linear_fc2.weight": (4, 64, 48),
                       "decoder.layers.1.mlp.shared_experts.linear_fc1.weight": (40, 64),
                       "decoder.layers.1.mlp.shared_experts.linear_fc2.weight": (64, 40)}


def test_latent_moe_projects_into_the_experts_latent_and_back(moe_config):
    """Nemotron 3's latent MoE: megatron-core's fc1_latent_proj / fc2_latent_proj around routed experts of the latent's
    width; the router and the shared expert keep the hidden width."""
    hf = _configs()["nemotron_h_latent"].to_dict()
    latent = family_for_hf(hf).config_from_hf(hf)[0]
    assert latent == moe_config.replace(moe_latent_size=32)
    tensors, plain = model_tensors(latent), model_tensors(moe_config)
    assert {name: shape for name, shape in tensors.items() if plain.get(name) != shape} == {
        "decoder.layers.1.mlp.fc1_latent_proj.weight": (32, 64), "decoder.layers.1.mlp.fc2_latent_proj.weight": (64, 32),
        "decoder.layers.1.mlp.experts.experts.linear_fc1.weight": (4, 48, 32),
        "decoder.layers.1.mlp.experts.experts.linear_fc2.weight": (4, 32, 48),
        "decoder.layers.3.mlp.fc1_latent_proj.weight": (32, 64), "decoder.layers.3.mlp.fc2_latent_proj.weight": (64, 32),
        "decoder.layers.3.mlp.experts.experts.linear_fc1.weight": (4, 48, 32),
        "decoder.layers.3.mlp.experts.experts.linear_fc2.weight": (4, 32, 48)}
    assert family_for_hf(hf).config_to_hf(latent)["moe_latent_size"] == 32


@pytest.mark.parametrize("change,words", [
    (dict(moe_router_score_function="softmax"), ("sigmoid with an expert bias",)),
    (dict(moe_shared_expert_intermediate_size=None), ("without a shared expert",)),
    (dict(moe_router_group_topk=2), ("moe_router_group_topk=2", "best two experts")),
])
def test_a_megatron_moe_hybrid_hf_nemotron_h_cannot_route_alike_is_refused_on_export(moe_config, change, words):
    family = family_for_hf({"architectures": ["NemotronHForCausalLM"]})
    family.config_to_hf(moe_config)
    with pytest.raises(ReshardError) as refused:
        family.config_to_hf(moe_config.replace(**change))
    assert all(word in str(refused.value) for word in words)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nemotron_h", "nemotron_h_moe", "nemotron_h_latent"])
def test_reshards_checkpoint_is_bridges_own_import_and_bridge_exports_it_back(bridge_hybrids, name):
    """fixtures/bridge_hybrid.py: Bridge's NemotronHBridge on megatron-core 0.19.2's HybridModel (the Mamba in_proj's z,
    x, B, C, dt and conv1d's x, B, C parts, A_log, D, dt_bias, the gated norm, attention, squared-ReLU MLP; the MoE
    layers' router and its expert bias, experts, shared expert; latent MoE's projections), its TE-only spec and
    mamba_ssm stood in for in that fixture only."""
    ours = bridges_own_import(bridge_hybrids, name)
    assert {"decoder.layers.0.mixer.in_proj.weight.dt", "decoder.layers.0.mixer.conv1d.bias.B", "decoder.layers.0.mixer.norm.weight"} <= ours.keys()
    if name != "nemotron_h":
        assert "decoder.layers.1.mlp.router.expert_bias" in ours
    assert ("decoder.layers.1.mlp.fc1_latent_proj.weight" in ours) == (name == "nemotron_h_latent")
