"""INT4 pack-quantized (`reshard.int4_pack`), Kimi-K2-Thinking's released form, read dequantized: every value as
compressed-tensors' own decompression gives it (the oracle), the model as transformers loads the release, and parts or
a quantization_config that do not say one thing refused naming them, nothing written."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from reshard import int4_pack
from reshard.dtypes import from_torch
from tests.cli import refused_cli, run_cli
from tests.converters.hf_models import build, edited_copy, load
from tests.int4_models import decompressed, make_int4, scheme

pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_word_and_scale_dequantizes_as_compressed_tensors_does(dtype):
    """Random words (every nibble, so every q in [-8, 7]) under random scales: bit for bit, rounded to the scale's dtype
    as compressed-tensors' product is."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(-(1 << 31), 1 << 31, (24, 12), generator=gen, dtype=torch.int64).to(torch.int32)
    scale = (torch.rand(24, 3, generator=gen) * 0.01 + 1e-4).to(dtype)
    theirs = PackedQuantizationCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([24, 96])}, scheme())["weight"]
    ours = int4_pack.dequantize(packed.numpy(), from_torch(scale), 96, 32, "w")
    assert ours.dtype == np.float32 and np.array_equal(ours, theirs.float().numpy())


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    return make_int4(build("kimi_k2", root / "bf16"), root / "int4")


def test_the_release_converts_to_what_compressed_tensors_and_transformers_make_of_it(released, tmp_path, monkeypatch, capsys):
    """INT4 Kimi-K2 -> torch_dist EP2 -> HF: the routed experts are compressed-tensors' decompression bit for bit,
    every other tensor as stored, the export unquantized; transformers' own load of the release (through
    compressed-tensors) and its load of the export hold the same weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    for args in ([released, tmp_path / "m", "--to-format", "torch_dist", "--to-ep", "2"], [tmp_path / "m", tmp_path / "back", "--to-format", "hf"]):
        assert run_cli(monkeypatch, capsys, "convert", *args, "-q") == (0, [])
    want, got = decompressed(released), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert got.keys() == want.keys() and "model.layers.1.mlp.experts.3.down_proj.weight" in got
    assert all(got[name].dtype == value.dtype == torch.bfloat16 and torch.equal(got[name], value) for name, value in want.items())
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "kimi_k2"
    hf_config = DeepseekV3Config.from_pretrained(released)
    hf_config.model_type = "deepseek_v3"
    theirs = DeepseekV3ForCausalLM.from_pretrained(released, config=hf_config, dtype=torch.bfloat16,
                                                   quantization_config=CompressedTensorsConfig(run_compressed=False)).state_dict()
    ours = load(tmp_path / "back").to(torch.bfloat16).state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)


WEIGHT = "model.layers.1.mlp.experts.2.up_proj"


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.pop(f"{WEIGHT}.weight_scale"), [f"is without its {WEIGHT}.weight_scale"]),
    (lambda t: t.pop(f"{WEIGHT}.weight_packed"), [f"is without its {WEIGHT}.weight_packed"]),
    (lambda t: t.update({f"{WEIGHT}.weight_packed": t[f"{WEIGHT}.weight_packed"].to(torch.int64)}), [f"{WEIGHT}.weight_packed is I64, not I32"]),
    (lambda t: t.update({f"{WEIGHT}.weight_shape": torch.tensor([32, 96])}), [f"INT4 tensor {WEIGHT}.weight", "do not fit weight_shape [32, 96]"]),
    (lambda t: t[f"{WEIGHT}.weight_scale"].__setitem__((3, 1), 0.0), [f"{WEIGHT}.weight_scale holds a scale that is not a positive number"]),
], ids=["scale_missing", "packed_missing", "packed_not_int32", "shape_contradicts", "zero_scale"])
def test_parts_that_do_not_say_one_thing_are_refused(released, tmp_path, monkeypatch, capsys, edit, words):
    bad = edited_copy(released, tmp_path / "bad", edit)
    refused_cli(monkeypatch, capsys, ["convert", bad, tmp_path / "out", "--to-format", "torch_dist", "-q"], *words, untouched=(bad,))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path,value,words", [
    (("config_groups", "group_0", "weights", "symmetric"), False, "config_groups.group_0.weights.symmetric"),
    (("config_groups", "group_0", "weights", "num_bits"), 8, "config_groups.group_0.weights.num_bits"),
    (("config_groups", "group_0", "weights", "strategy"), "channel", "config_groups.group_0.weights.strategy"),
    (("config_groups", "group_0", "input_activations"), {"num_bits": 8}, "config_groups.group_0.input_activations"),
    (("format",), "int-quantized", "quantization_config.format"),
    (("kv_cache_scheme",), {"num_bits": 8}, "quantization_config.kv_cache_scheme"),
    (("sparsity",), True, "quantization_config.sparsity"),
])
def test_a_quantization_config_reshard_does_not_read_is_refused_by_field(released, tmp_path, monkeypatch, capsys, path, value, words):
    bad = tmp_path / "bad"
    shutil.copytree(released, bad)
    config = json.loads((bad / "config.json").read_text())
    where = config["quantization_config"]
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    (bad / "config.json").write_text(json.dumps(config))
    refused_cli(monkeypatch, capsys, ["convert", bad, tmp_path / "out", "--to-format", "torch_dist", "-q"], words, untouched=(bad,))
    assert not (tmp_path / "out").exists()


def test_an_int4_import_exports_as_fp8_blocks(released, tmp_path, monkeypatch, capsys):
    """The release's own quantization_config (compressed-tensors) is not taken for the fp8 blocks' (DeepSeek-V3's form,
    128 x 128 then)."""
    for args in ([released, tmp_path / "m", "--to-format", "torch_dist"], [tmp_path / "m", tmp_path / "fp8", "--to-format", "hf", "--to-fp8-blocks"]):
        assert run_cli(monkeypatch, capsys, "convert", *args, "-q") == (0, [])
    quantization = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "fp8" and quantization["weight_block_size"] == [128, 128]
