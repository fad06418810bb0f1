"""MiniMax-M2's config translation and its partition rule: the full-width q/k norms split over TP by head (where
per-head norms of the same name are whole on every rank), the rotary fraction read from either spelling, and configs
that say something transformers' MiniMaxM2 does not compute, or that contradict the tensors, refused naming the field
with nothing written. The logits proof is test_hf_logits.py's; fp8 blocks, test_fp8.py's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_hf_roundtrip import cli

from reshard.config import ModelConfig
from reshard.converters import families_for_model, family_by_name, family_for_hf
from reshard.converters.partial_rotary import rotary_fraction
from reshard.errors import ReshardError
from reshard.layout import Layout
from reshard.logical import Split, describe
from reshard.sharding import pieces
from tests.cli import refused_cli, refused_config

from hf_models import build

MINIMAX = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=32,
                      padded_vocab_size=256, vocab_size=250, qk_layernorm=True, qk_layernorm_full_width=True, rotary_percent=0.5,
                      num_experts=4, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
NORM = "decoder.layers.self_attention.{}_layernorm.weight"


@pytest.mark.parametrize("which,heads", [("q", 4), ("k", 2)])
def test_full_width_norms_split_by_head_and_per_head_ones_stay_whole(which, heads):
    """At TP2 each rank holds its own heads' part of a full-width norm (its linear_qkv rows' heads, in order); Qwen3's
    per-head norm of the same name and shape [head_dim] is the same on every rank."""
    full = describe(NORM.format(which), (2, heads * 16), "float32", MINIMAX)
    assert full.split is Split.COLUMN and full.tp_axis == 1
    regions = {(p.rank.tp, p.region) for p in pieces(full, MINIMAX, Layout(tp=2)) if p.primary}
    assert regions == {(tp, ((layer, layer + 1), (tp * heads * 8, (tp + 1) * heads * 8))) for tp in (0, 1) for layer in (0, 1)}
    per_head = describe(NORM.format(which), (2, 16), "float32", MINIMAX.replace(qk_layernorm_full_width=False))
    assert per_head.split is Split.NONE
    assert describe(NORM.format(which), (2, heads * 16), "float32", None).split is Split.NONE  # no architecture: never split


def test_the_family_is_the_only_one_holding_full_width_norms():
    """Export picks MiniMax-M2 for such a model, and no per-head family claims it (nor MiniMax-M2 a per-head one)."""
    assert [f.model_type for f in families_for_model(MINIMAX)] == ["minimax_m2"]
    assert "minimax_m2" not in [f.model_type for f in families_for_model(MINIMAX.replace(qk_layernorm_full_width=False))]
    with pytest.raises(ReshardError, match="qk_layernorm_full_width=False where HF minimax_m2 needs True"):
        family_by_name("minimax_m2").check_megatron(MINIMAX.replace(qk_layernorm_full_width=False))


BASE = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}


@pytest.mark.parametrize("fields,fraction", [
    ({}, 1.0),
    ({"rotary_dim": 8}, 0.5),  # the released configs' spelling
    ({"rope_parameters": {"rope_theta": 5e6, "partial_rotary_factor": 0.25}}, 0.25),  # transformers 5's
    ({"rotary_dim": 4, "rope_parameters": {"partial_rotary_factor": 0.25}}, 0.25),  # both, agreeing
    ({"partial_rotary_factor": 0.5}, 0.5),
])
def test_the_rotary_fraction_is_read_from_either_spelling(fields, fraction):
    assert rotary_fraction({**BASE, **fields}) == fraction


@pytest.mark.parametrize("fields,message", [
    ({"rotary_dim": 4, "rope_parameters": {"partial_rotary_factor": 0.5}}, "rotary_dim=4 is not rope_parameters.partial_rotary_factor=0.5"),
    ({"rotary_dim": 7}, "rotary_dim=7 is not an even number"),
    ({"rotary_dim": 32}, "rotary_dim=32 is not a whole number of dims from 1 to head_dim=16"),
    ({"partial_rotary_factor": 0.3}, "partial_rotary_factor=0.3 is not an even number"),
])
def test_a_rotary_fraction_that_contradicts_itself_is_refused(fields, message):
    with pytest.raises(ReshardError, match=message):
        rotary_fraction({**BASE, **fields})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build("minimax_m2", tmp_path_factory.mktemp("minimax") / "hf")


@pytest.mark.parametrize("change,words", [
    ({"scoring_func": "softmax"}, ["scoring_func='softmax'", "always computes scoring_func='sigmoid'"]),
    ({"use_routing_bias": False}, ["use_routing_bias=False"]),
    ({"use_qk_norm": False}, ["use_qk_norm=False"]),
    ({"qk_norm_type": "per_head"}, ["qk_norm_type='per_head'"]),
    ({"attn_type_list": [0, 1]}, ["attn_type_list=[0, 1]", "lightning attention"]),
    ({"shared_intermediate_size": 64}, ["shared_intermediate_size=64", "no shared experts"]),
    ({"num_experts_per_tok": 5}, ["num_experts_per_tok=5", "the 4 experts"]),
    ({"rotary_dim": 4}, ["rotary_dim=4 is not rope_parameters.partial_rotary_factor=0.5 of head_dim=16"]),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "float8_e5m2"}}, ["quantization_config.fmt='float8_e5m2'"]),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_a_config_transformers_would_not_compute_is_refused_naming_the_field(source, tmp_path, monkeypatch, capsys, change, words):
    refused_config(monkeypatch, capsys, source, tmp_path, change, *words)


@pytest.mark.slow  # over 5 s here (the args unpickled and pickled again with torch)
def test_args_that_contradict_the_full_width_norms_are_refused_naming_the_field(source, tmp_path, monkeypatch, capsys):
    """A torch_dist checkpoint whose args say per-head q/k norms while its tensors are full-width: read at the wrong
    width, they would be resharded as whole on every rank and exported as another family; refused naming the fields."""
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", "--to-tp", "2", "-q")
    common = torch.load(tmp_path / "m" / "release" / "common.pt", weights_only=False)
    common["args"].qk_layernorm_full_width = False
    torch.save(common, tmp_path / "m" / "release" / "common.pt")
    line = refused_cli(monkeypatch, capsys, ["convert", tmp_path / "m", tmp_path / "out", "--to-tp", "1"],
                       "layernorm.weight has shape [2, ", "(check kv_channels, qk_layernorm_full_width)", untouched=(tmp_path / "m",))
    assert not (tmp_path / "out").exists(), line


def test_the_family_is_found_by_architecture_and_keeps_its_names(source):
    config = json.loads((source / "config.json").read_text())
    family = family_for_hf(config)
    imported, _ = family.config_from_hf(config)
    assert (imported.qk_layernorm_full_width, imported.rotary_percent, imported.moe_ffn_hidden_size) == (True, 0.5, 32)
    names = {hf for m in family.mappings(imported) for hf in m.hf_names(0, 0)}
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.block_sparse_moe.e_score_correction_bias",
            "model.layers.0.block_sparse_moe.experts.0.w3.weight"} <= names
    assert np.all([n.startswith(("model.", "lm_head.")) for n in names])


def test_torch_dist_for_bridge_names_bridges_minimax_layer_spec_and_reads_back(source, tmp_path):
    """Megatron-Bridge has no field for full-width q/k norms: its MiniMax-M2 provider names its own layer spec. reshard
    writes that name into run_config.yaml and reads it back as qk_layernorm_full_width (a Bridge-trained MiniMax-M2's
    run config reads so too), the whole architecture as the checkpoint's own args say it."""
    from reshard.formats import open_checkpoint
    from reshard.formats.model_args import MINIMAX_M2_SPEC, bridge_args

    cli("convert", source, tmp_path / "out", "--to-format", "torch_dist", "--to-tp", "2", "--for", "bridge", "-q")
    run_config = tmp_path / "out" / "iter_0000000" / "run_config.yaml"
    assert f"_target_: {MINIMAX_M2_SPEC}" in run_config.read_text()
    with open_checkpoint(tmp_path / "out") as reader:
        assert ModelConfig.from_megatron_args(bridge_args(run_config)) == reader.config
        assert reader.config.qk_layernorm_full_width and reader.config.rotary_percent == 0.5


def test_a_megatron_model_of_its_kind_exports_as_minimax_m2(tmp_path):
    """A model trained in Megatron (no HF config of its own) with full-width q/k norms, partial rotary and the sigmoid
    router with its bias is exported as MiniMax-M2, in the configuration transformers reads back: its partial rotary,
    every weight loaded."""
    from test_hf_roundtrip import assert_loads_cleanly
    from transformers import AutoConfig

    from fixtures.models import PRESETS
    from fixtures.synthetic import write_synthetic

    write_synthetic(tmp_path / "m", PRESETS["tiny-minimax"], Layout(tp=2), "torch_dist")
    cli("convert", tmp_path / "m", tmp_path / "hf", "--to-format", "hf", "-q")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["rotary_dim"], config["num_local_experts"]) == (["MiniMaxM2ForCausalLM"], 8, 4)
    assert AutoConfig.from_pretrained(tmp_path / "hf").rope_parameters["partial_rotary_factor"] == 0.5
    assert_loads_cleanly(tmp_path / "hf")


# MiniMax-M2's released config.json (MiniMaxAI/MiniMax-M2), the fields that bear on conversion
RELEASED = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attn_type_list": [1] * 62, "head_dim": 128,
            "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608,
            "mtp_transformer_layers": 1, "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62,
            "num_key_value_heads": 8, "num_local_experts": 256, "num_mtp_modules": 3, "qk_norm_type": "per_layer",
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                                    "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
            "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True,
            "vocab_size": 200064}


def test_the_released_config_reads_and_splits_as_it_is_served():
    """The release's architecture, at the TP8 EP8 it is commonly served at (8 KV heads: one per TP rank)."""
    config, _ = family_for_hf(RELEASED).config_from_hf(RELEASED)
    assert (config.qk_layernorm_full_width, config.rotary_percent, config.rotary_base) == (True, 0.5, 5000000.0)
    assert (config.num_experts, config.moe_router_topk, config.moe_ffn_hidden_size, config.groups) == (256, 8, 1536, 8)
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias, config.params_dtype) == ("sigmoid", True, "bfloat16")
    Layout(tp=8, ep=8).validate(config)
    with pytest.raises(ReshardError, match="query groups"):
        Layout(tp=16).validate(config)  # its 8 k-norm groups cannot be cut in 16
