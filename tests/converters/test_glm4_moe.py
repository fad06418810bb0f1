"""GLM-4.5 (Glm4MoeForCausalLM) through reshard: HF -> torch_dist at two layouts -> HF bit for bit (config.json too), as
transformers saves it (no MTP tensors) converted without its MTP layer and saying so, and what it cannot map refused
by name. (Megatron-Core computing transformers' logits from the import, and a wrong mapping failing that:
tests/converters/test_hf_logits.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from test_hf_roundtrip import assert_loads_cleanly, hf_tensors

from reshard.cli import main
from reshard.converters import family_for_hf
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from tests.arrays import same
from tests.cli import run_cli

from hf_models import build


def convert(*args) -> str:
    result = CliRunner().invoke(main, ["convert", *map(str, args)], standalone_mode=False)
    assert result.exception is None, result.exception
    return result.output


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build("glm4_moe", tmp_path_factory.mktemp("hf") / "glm")


@pytest.mark.parametrize("layout", [["--to-tp", "2", "--to-ep", "2"], ["--to-pp", "2", "--to-ep", "2"]], ids=["tp2ep2", "pp2ep2"])
def test_round_trip_is_bit_identical(source, tmp_path, layout):
    convert(source, tmp_path / "m", "--to-format", "torch_dist", *layout, "-q")
    with open_checkpoint(tmp_path / "m") as reader:
        config, specs = reader.config, reader.specs
    assert (config.rotary_percent, config.add_qkv_bias, config.qk_layernorm, config.moe_layer_freq, config.mtp_num_layers) == \
        (0.5, True, True, (0, 1), 1)
    assert {"decoder.layers.1.mlp.router.expert_bias", "decoder.layers.0.mlp.linear_fc1.weight",
            "mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc1.weight"} <= specs.keys()
    assert yaml.safe_load((tmp_path / "m" / "release" / "run_config.yaml").read_text())["model"]["mtp_num_layers"] == 1
    convert(tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    original, exported = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert "model.layers.2.eh_proj.weight" in original and exported.keys() == original.keys()
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and same(exported[key], value), key
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((source / "config.json").read_text())


def test_as_transformers_saves_it_the_mtp_layer_is_not_carried(tmp_path):
    """transformers' save_pretrained keeps num_nextn_predict_layers and writes no MTP tensor: converted without it, said
    on the output line; the export loads into transformers with nothing missing."""
    saved = tmp_path / "saved"
    build("glm4_moe", tmp_path / "full")
    from safetensors.torch import load_file, save_file

    shutil.copytree(tmp_path / "full", saved)
    tensors = {k: v for k, v in load_file(saved / "model.safetensors").items() if not k.startswith("model.layers.2.")}
    save_file(tensors, str(saved / "model.safetensors"), metadata={"format": "pt"})
    said = convert(saved, tmp_path / "m", "--to-format", "torch_dist", "--to-tp", "2")
    assert "not carried: 1 x MTP layers (1 named by num_nextn_predict_layers, none in the files)" in said, said
    convert(tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    exported = hf_tensors(tmp_path / "back")
    assert exported.keys() == tensors.keys() and all(same(exported[k], v) for k, v in tensors.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert_loads_cleanly(tmp_path / "back")


def _with_copies(source: Path, out: Path, change: bool = False) -> dict:
    """`source` as GLM-4.5's release stores its MTP layer: with copies of the embedding and head (one bit of the head's
    copy flipped with `change`); its tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    if change:
        tensors["model.layers.2.shared_head.head.weight"].view(-1).view(torch.int32)[7] ^= 1
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def test_glm45s_mtp_copies_are_checked_and_said_not_carried(source, tmp_path):
    """GLM-4.5's release keeps copies of the embedding and head in its MTP layer; GLM-4.6's and Megatron-Bridge's do not.
    Each copy must equal the model's; the export is GLM-4.6's form, which the conversion says."""
    tensors = _with_copies(source, tmp_path / "glm45")
    said = convert(tmp_path / "glm45", tmp_path / "m", "--to-format", "torch_dist", "--to-ep", "2")
    assert "not carried: 1 x MTP layers' copies of the embedding and head (2, equal to the model's)" in said, said
    convert(tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    exported, original = hf_tensors(tmp_path / "back"), hf_tensors(source)
    assert exported.keys() == original.keys() == tensors.keys() - {"model.layers.2.embed_tokens.weight",
                                                                  "model.layers.2.shared_head.head.weight"}
    assert all(same(exported[k], v) for k, v in original.items())


def test_an_mtp_copy_that_differs_is_refused_by_name(source, tmp_path, monkeypatch, capsys):
    _with_copies(source, tmp_path / "changed", change=True)
    code, err = run_cli(monkeypatch, capsys, "convert", tmp_path / "changed", tmp_path / "out", "--to-format", "torch_dist")
    assert code != 0 and len(err) == 1 and "model.layers.2.shared_head.head.weight differs from lm_head.weight" in err[0], err
    assert not (tmp_path / "out").exists()


CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "vocab_size": 250,
    "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
    "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "attention_bias": True, "use_qk_norm": True,
    "partial_rotary_factor": 0.5, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0}


def test_the_partial_rotary_factor_is_read_where_transformers_reads_it():
    family = family_for_hf(CONFIG)
    assert family.config_from_hf(CONFIG)[0].rotary_percent == 0.5
    v5 = {k: v for k, v in CONFIG.items() if k != "partial_rotary_factor"}
    assert family.config_from_hf(dict(v5, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25}))[0].rotary_percent == 0.25
    assert family.config_from_hf(v5)[0].rotary_percent == 0.5  # transformers' GLM default


@pytest.mark.parametrize("extra, match", [
    ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),  # 9.6 rotated dims
    ({"first_k_dense_replace": 2}, "every layer is dense"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"n_shared_experts": 0}, "n_shared_experts"),
    ({"use_qk_norm": "yes"}, "use_qk_norm"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
])
def test_what_it_cannot_map_is_refused_by_name(extra, match):
    with pytest.raises(ReshardError, match=match):
        family_for_hf(dict(CONFIG, **extra)).config_from_hf(dict(CONFIG, **extra))
