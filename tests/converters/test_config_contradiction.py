"""A config.json that contradicts its weights is refused naming the config field to check, in each family's own
terms (transformers' names: the models are transformers' own saves, one field then edited). Each case runs
inspect, verify and convert: one in the fast tier."""

from __future__ import annotations

import shutil

import pytest

from tests.cache import built
from tests.cli import refused_by_every_command
from tests.converters.hf_models import _edit_config, build


def _saved(folder, name):
    return build(name, folder)


@pytest.mark.parametrize("name,field,value,fields", [
    ("llama", "num_key_value_heads", 1, "num_key_value_heads, head_dim"),
    pytest.param("llama", "intermediate_size", 64, "(check intermediate_size)", marks=pytest.mark.slow),
    pytest.param("llama", "hidden_size", 32, "(check hidden_size)", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "moe_intermediate_size", 16, "moe_intermediate_size", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "head_dim", 8, "num_attention_heads, head_dim", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", "shared_expert_intermediate_size", 24, "shared_expert_intermediate_size", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "kv_lora_rank", 16, "kv_lora_rank", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "v_head_dim", 8, "v_head_dim", marks=pytest.mark.slow),
], ids=lambda v: str(v))
def test_a_config_contradicting_the_weights_names_the_field(tmp_path_factory, tmp_path, monkeypatch, capsys, name, field, value, fields):
    source = tmp_path / name
    shutil.copytree(built(tmp_path_factory, _saved, name), source)
    _edit_config(source, **{field: value})
    refused_by_every_command(monkeypatch, capsys, source, tmp_path / "out", fields, "config.json does not match the weights",
                             to=("--to-format", "torch_dist"))
