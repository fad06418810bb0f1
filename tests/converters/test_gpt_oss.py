"""gpt-oss's config translation and transforms: gate/up de-interleaved, layer_types <-> Megatron-Core's sliding-window
settings both ways, YaRN's truncate carried, config.json back as it came, a Megatron model of its kind exported as
gpt-oss, and configs that say something transformers' gpt-oss does not compute (or Megatron-Core cannot) refused
naming the field with nothing written. The logits proof is test_hf_logits.py's; the round trip test_hf_roundtrip.py's;
optimizer state tests/reshard/optim/test_gpt_oss_order.py's; reading one expert of a fused tensor
tests/reshard/formats/test_hf_fused.py's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_hf_roundtrip import assert_loads_cleanly, cli

from reshard.converters import families_for_model, family_for_hf
from reshard.converters.gpt_oss import deinterleave_gated, interleave_gated, window_from_hf, window_to_hf
from reshard.errors import ReshardError
from reshard.layout import Layout
from tests.cli import refused_cli, refused_config

from hf_models import build

S, F = "sliding_attention", "full_attention"


def test_gate_and_up_are_deinterleaved_and_back():
    """Rows g0 u0 g1 u1 g2 u2 -> [g0 g1 g2; u0 u1 u2] (Megatron's [gate; up]), and back, for weights and biases."""
    rows = np.array(["g0", "u0", "g1", "u1", "g2", "u2"])
    assert list(deinterleave_gated(rows)) == ["g0", "g1", "g2", "u0", "u1", "u2"]
    weight = np.arange(6 * 5).reshape(6, 5)
    assert np.array_equal(deinterleave_gated(weight)[:3], weight[0::2]) and np.array_equal(interleave_gated(deinterleave_gated(weight)), weight)
    with pytest.raises(ReshardError, match="odd number of rows"):
        deinterleave_gated(rows[:5])


@pytest.mark.parametrize("kinds,window,skip", [
    ([S, F], (7, 0), 2),  # gpt-oss: every other layer full, the first windowed
    ([S, F, S, F], (7, 0), 2),
    ([S, S, F, S, S, F], (7, 0), 3),
    ([S, S], (7, 0), None),  # every layer windowed
    ([F, S], (7, 0), (0, 1)),  # no period Megatron-Core's int says: a 0/1 per layer
    ([F, F], None, None),
])
def test_layer_types_are_megatrons_window_settings_and_back(kinds, window, skip):
    hf = {"num_hidden_layers": len(kinds), "layer_types": kinds, "sliding_window": 8}
    fields = window_from_hf(hf)
    assert (fields["window_size"], fields["window_attn_skip_freq"]) == (window, skip)
    from reshard.trainer.presets import TINY_GPT_OSS

    assert window_to_hf(TINY_GPT_OSS.replace(num_layers=len(kinds), **fields)) == kinds


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "hf")


def test_the_config_reads_as_megatron_core_builds_gpt_oss_and_writes_back_as_it_came(source, tmp_path):
    config_json = json.loads((source / "config.json").read_text())
    family = family_for_hf(config_json)
    config, extras = family.config_from_hf(config_json)
    assert (config.softmax_type, config.window_size, config.window_attn_skip_freq, config.quick_geglu, config.glu_linear_offset,
            config.activation_func_clamp_value) == ("learnable", (7, 0), 2, True, 1.0, 7.0)
    assert (config.position_embedding_type, config.rotary_scaling_factor, config.original_max_position_embeddings,
            config.yarn_correction_range_round_to_int, config.rotary_base) == ("yarn", 32.0, 4096, False, 150000.0)
    assert (config.add_bias_linear, config.add_qkv_bias, config.num_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == \
        (True, True, 4, 2, 48)
    assert [f.model_type for f in families_for_model(config)] == ["gpt_oss"]
    assert family.config_to_hf(config, config_json, extras) == config_json
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", "--to-ep", "2", "-q")
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config_json


def test_torch_dist_for_bridge_describes_gpt_oss_and_reads_back(source, tmp_path):
    """The run_config.yaml Megatron-Bridge builds the model from names gpt-oss's sinks, windows, clamped SwiGLU (Bridge's
    quick_gelu) and GPT YaRN (its provider's yarn_* fields); read back, it is the checkpoint's own architecture."""
    import yaml

    from reshard.config import ModelConfig
    from reshard.formats import open_checkpoint
    from reshard.formats.model_args import QUICK_GELU, bridge_args

    cli("convert", source, tmp_path / "out", "--to-format", "torch_dist", "--to-ep", "2", "--for", "bridge", "-q")
    run_config = tmp_path / "out" / "iter_0000000" / "run_config.yaml"
    model = yaml.safe_load(run_config.read_text())["model"]
    assert (model["softmax_type"], model["window_size"], model["window_attn_skip_freq"], model["activation_func"]["_target_"],
            model["yarn_rotary_scaling_factor"], model["yarn_correction_range_round_to_int"]) == \
        ("learnable", [7, 0], 2, QUICK_GELU, 32.0, False)
    with open_checkpoint(tmp_path / "out") as reader:
        assert ModelConfig.from_megatron_args(bridge_args(run_config)) == reader.config


def test_a_megatron_model_of_its_kind_exports_as_gpt_oss(tmp_path):
    """A model trained in Megatron (no HF config of its own) with sinks, windows, biases, the clamped SwiGLU and YaRN is
    exported as gpt-oss, in the configuration transformers reads back, every weight loaded."""
    from transformers import AutoConfig

    from fixtures.models import PRESETS
    from fixtures.synthetic import write_synthetic

    write_synthetic(tmp_path / "m", PRESETS["tiny-gpt-oss"], Layout(tp=2, etp=1), "torch_dist")
    cli("convert", tmp_path / "m", tmp_path / "hf", "--to-format", "hf", "-q")
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    assert (config.architectures, config.sliding_window, config.layer_types, config.swiglu_limit) == \
        (["GptOssForCausalLM"], 8, [S, F], 7.0)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["truncate"] is False
    assert_loads_cleanly(tmp_path / "hf")


@pytest.mark.parametrize("change,words", [
    ({"swiglu_alpha": 1.5}, ["swiglu_alpha=1.5", "fixes it at 1.702"]),
    ({"attention_bias": False}, ["attention_bias=False"]),
    ({"layer_types": [S, "chunked_attention"]}, ["layer_types 'chunked_attention'"]),
    ({"layer_types": [S]}, ["layer_types=", "the 2 layers"]),
    ({"sliding_window": None}, ["sliding_window=null", "sliding layers"]),
    ({"swiglu_limit": -1}, ["swiglu_limit=-1 is not a positive number"]),
    ({"num_experts_per_tok": 5}, ["num_experts_per_tok=5", "the 4 experts"]),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, ["rope_scaling type 'llama3'"]),
    ({"quantization_config": {"quant_method": "awq"}}, ["quantization_config.quant_method", "awq"]),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_a_config_transformers_would_not_compute_is_refused_naming_the_field(source, tmp_path, monkeypatch, capsys, change, words):
    refused_config(monkeypatch, capsys, source, tmp_path, change, *words)


def test_expert_biases_at_expert_tensor_parallelism_are_refused(source, tmp_path, monkeypatch, capsys):
    """megatron-core builds experts with biases only at ETP1: a TP2 layout must say --to-etp 1, and nothing is written."""
    refused_cli(monkeypatch, capsys, ["convert", source, tmp_path / "out", "--to-format", "torch_dist", "--to-tp", "2", "-q"],
                "ETP=2", "--to-etp 1", untouched=(source,))
    assert not (tmp_path / "out").exists()
    config, _ = family_for_hf(json.loads((source / "config.json").read_text())).config_from_hf(json.loads((source / "config.json").read_text()))
    Layout(tp=2, etp=1, ep=2).validate(config)
