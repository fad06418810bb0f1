"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM) through reshard: HF -> torch_dist at two layouts -> HF bit for bit (config.json
and the MTP layer's copies of the embedding and head too); which layers are dense read as transformers builds them;
what it cannot map refused by name. (Megatron-Core computing transformers' logits and MTP logits from the import:
tests/converters/test_hf_logits.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_hf_roundtrip import hf_tensors

from reshard.cli import main
from reshard.converters import family_for_hf
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from tests.arrays import same

from hf_models import build


def convert(*args) -> None:
    result = CliRunner().invoke(main, ["convert", *map(str, args), "-q"], standalone_mode=False)
    assert result.exception is None, result.exception


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build("glm4_moe_lite", tmp_path_factory.mktemp("hf") / "flash")


@pytest.mark.parametrize("layout", [["--to-tp", "2", "--to-ep", "2"], ["--to-pp", "2"]], ids=["tp2ep2", "pp2"])
def test_round_trip_is_bit_identical(source, tmp_path, layout):
    convert(source, tmp_path / "m", "--to-format", "torch_dist", *layout)
    with open_checkpoint(tmp_path / "m") as reader:
        config, specs = reader.config, reader.specs
        assert reader.common.args["hf_model_type"] == "glm4_moe_lite"
    assert (config.multi_latent_attention, config.q_lora_rank, config.moe_layer_freq, config.mtp_num_layers,
            config.norm_epsilon, config.moe_router_topk_scaling_factor) == (True, 24, (0, 1), 1, 1e-5, 1.8)
    assert {"decoder.layers.1.mlp.router.expert_bias", "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight"} <= specs.keys()
    convert(tmp_path / "m", tmp_path / "back", "--to-format", "hf")
    original, exported = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert "model.layers.2.shared_head.head.weight" in original and exported.keys() == original.keys()
    assert all(exported[k].dtype == v.dtype and same(exported[k], v) for k, v in original.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((source / "config.json").read_text())


CONFIG = {
    "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "hidden_size": 64, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96, "vocab_size": 250, "kv_lora_rank": 32,
    "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "moe_intermediate_size": 32,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 1.8, "mlp_layer_types": ["dense", "dense", "sparse"]}


def test_dense_layers_are_read_as_transformers_builds_them_and_written_back_so():
    import transformers

    family = family_for_hf(CONFIG)
    config = family.config_from_hf(CONFIG)[0]
    assert config.moe_layer_freq == (0, 0, 1)
    assert family.config_to_hf(config)["mlp_layer_types"] == ["dense", "dense", "sparse"]
    # without mlp_layer_types transformers makes the first layer dense, every other MoE
    default = {k: v for k, v in CONFIG.items() if k != "mlp_layer_types"}
    assert family.config_from_hf(default)[0].moe_layer_freq == (0, 1, 1)
    assert transformers.Glm4MoeLiteConfig(**default).mlp_layer_types == ["dense", "sparse", "sparse"]


def test_fields_left_out_take_transformers_defaults():
    """Where config.json leaves out a field DeepSeek-V3's translation reads with a default of its own, GLM-4.7-Flash's
    (transformers' Glm4MoeLiteConfig's) is taken."""
    import transformers

    defaults = transformers.Glm4MoeLiteConfig()
    short = {k: v for k, v in CONFIG.items() if k not in ("q_lora_rank", "routed_scaling_factor")}
    config = family_for_hf(short).config_from_hf(short)[0]
    assert (config.q_lora_rank, config.moe_router_topk_scaling_factor, config.norm_epsilon, config.max_position_embeddings) == \
        (defaults.q_lora_rank, defaults.routed_scaling_factor, defaults.rms_norm_eps, defaults.max_position_embeddings)


@pytest.mark.parametrize("extra, match", [
    ({"mlp_layer_types": ["dense", "sparse", "dense"]}, "dense layer at 2 after an MoE one"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ({"first_k_dense_replace": 1}, "first_k_dense_replace"),  # contradicts mlp_layer_types' two
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_interleave": False}, "rope_interleave"),
])
def test_what_it_cannot_map_is_refused_by_name(extra, match):
    with pytest.raises(ReshardError, match=match):
        family_for_hf(dict(CONFIG, **extra)).config_from_hf(dict(CONFIG, **extra))
