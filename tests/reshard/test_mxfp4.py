"""MXFP4 (`reshard.mxfp4`), gpt-oss's released form, read dequantized: every value as transformers' own dequantization
gives it (`_convert_moe_packed_tensors`, the oracle), one expert's blocks and scales read at a time, and blocks,
scales or a quantization_config that do not say one thing refused naming them, nothing written. Written (`--to-mxfp4`):
a release comes back byte for byte, and transformers loads an MXFP4 export to values within MXFP4's bound."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from reshard import mxfp4
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.torchfile.archive_reader import RecordFile
from tests.cli import refused_cli, run_cli
from tests.converters.hf_models import build, edited_copy
from tests.mxfp4_models import dequantized, make_mxfp4


def test_every_code_and_scale_dequantizes_as_transformers_does():
    """All 256 byte values (both nibbles, -0 included) under scales from 2^-127 to 2^125: bit for bit in float32."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    gen = np.random.default_rng(0)
    blocks = np.concatenate([np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16),
                             gen.integers(0, 256, (1, 1, 16, 16), dtype=np.uint8)], axis=1).reshape(2, 2, 8, 16)
    scales = gen.integers(0, 253, (2, 2, 8), dtype=np.uint8)
    scales[0, 0, :2] = (0, 252)
    ours = mxfp4.dequantize(blocks, scales, "w")
    theirs = _convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
    assert ours.shape == theirs.shape == (2, 256, 2) and ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # the sign of -0 too


@pytest.mark.parametrize("blocks,scales,words", [
    ((4, 96, 2, 16), (4, 96, 3), "do not pair"),
    ((4, 96, 2, 8), (4, 96, 2), "do not pair"),
    ((96, 16), (96,), "do not pair"),
])
def test_blocks_and_scales_that_do_not_pair_are_refused(blocks, scales, words):
    with pytest.raises(ReshardError, match=f"MXFP4 tensor w: blocks {list(blocks)} .*{words}".replace("[", r"\[")):
        mxfp4.shape("w", blocks, scales)


@pytest.mark.parametrize("scale,words", [(255, "w_scales holds the NaN scale 255"), (253, "w_scales scales values past float32's range")])
def test_a_scale_past_float32_is_refused(scale, words):
    """255 is E8M0's NaN; 2^126 takes E2M1's 6 past float32 (transformers would give inf)."""
    with pytest.raises(ReshardError, match=words):
        mxfp4.dequantize(np.full((1, 1, 1, 16), 0x77, np.uint8), np.full((1, 1, 1), scale, np.uint8), "w")


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    return make_mxfp4(build("gpt_oss_mxfp4", root / "bf16"), root / "mxfp4")


def test_the_release_form_converts_to_transformers_dequantized_values(released, tmp_path, monkeypatch, capsys):
    """MXFP4 gpt-oss -> torch_dist EP2 (bfloat16 unless told: float32 here) -> HF: the experts are transformers' own
    dequantization of the blocks, bit for bit, every other tensor as stored; the export is unquantized."""
    for args in ([released, tmp_path / "m", "--to-format", "torch_dist", "--to-ep", "2", "--dtype", "float32"],
                 [tmp_path / "m", tmp_path / "back", "--to-format", "hf"]):
        assert run_cli(monkeypatch, capsys, "convert", *args, "-q") == (0, [])
    want, got = dequantized(released), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert got.keys() == want.keys() and "model.layers.1.mlp.experts.down_proj" in got
    for name, value in want.items():
        assert torch.equal(got[name], value.float()), name
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())


def test_one_experts_slab_reads_that_experts_blocks_and_scales_only(released, monkeypatch):
    reads = []
    read_exact = RecordFile.read_exact
    monkeypatch.setattr(RecordFile, "read_exact", lambda self, view, offset: (reads.append(len(view)), read_exact(self, view, offset))[1])
    with open_checkpoint(released) as reader:
        assert reader.default_dtype == "bfloat16"
        out = np.empty((1, 1, 64, 96), np.float32)
        reader.read_into("decoder.layers.mlp.experts.experts.linear_fc2.weight", ((0, 1), (3, 4), (0, 64), (0, 96)), out)
    assert sorted(reads) == [64 * 3, 64 * 3 * 16]  # expert 3's scales [64, 3] and blocks [64, 3, 16], nothing else


BLOCKS = "model.layers.0.mlp.experts.down_proj_blocks"
SCALES = "model.layers.0.mlp.experts.down_proj_scales"


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.pop(SCALES), [f"MXFP4 tensor {BLOCKS} is without its {SCALES}"]),
    (lambda t: t.update({SCALES: t[SCALES][:, :, :2].contiguous()}), ["MXFP4 tensor model.layers.0.mlp.experts.down_proj:",
                                                                       "do not pair"]),
    (lambda t: t.update({SCALES: t[SCALES].to(torch.int16)}), [f"MXFP4 tensor {SCALES} is I16, not U8"]),
    (lambda t: t[SCALES].__setitem__((1, 5, 0), 255), [f"{SCALES} holds the NaN scale 255"]),
], ids=["scales_missing", "scales_of_another_shape", "scales_not_bytes", "nan_scale"])
def test_blocks_and_scales_that_do_not_say_one_thing_are_refused(released, tmp_path, monkeypatch, capsys, edit, words):
    bad = edited_copy(released, tmp_path / "bad", edit)
    refused_cli(monkeypatch, capsys, ["convert", bad, tmp_path / "out", "--to-format", "torch_dist", "-q"], *words, untouched=(bad,))
    assert not (tmp_path / "out").exists()


def test_an_unknown_quantization_key_is_refused(released, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(released, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64
    (bad / "config.json").write_text(json.dumps(config))
    refused_cli(monkeypatch, capsys, ["convert", bad, tmp_path / "out", "--to-format", "torch_dist", "-q"],
                "quantization_config.group_size", untouched=(bad,))
    assert not (tmp_path / "out").exists()


def _reference_groups(gen, shape):
    """Random blocks whose every group holds a +-6 (code 7): as the reference quantizer makes every group (its scale
    is the power of two that takes the group's largest magnitude into (3, 6])."""
    blocks = gen.integers(0, 256, shape, dtype=np.uint8)
    blocks[..., 5] = (blocks[..., 5] & 0xF0) | 0x7 | (blocks[..., 5] & 0x8)
    return blocks


def test_a_release_quantized_again_comes_back_byte_for_byte():
    gen = np.random.default_rng(1)
    blocks, scales = _reference_groups(gen, (2, 24, 3, 16)), gen.integers(100, 140, (2, 24, 3), dtype=np.uint8)
    again = mxfp4.quantize(mxfp4.dequantize(blocks, scales, "w"), "w")
    assert np.array_equal(again[0], blocks) and np.array_equal(again[1], scales)
    # any released group (here: any bytes) comes back as the same values, if not always the same bytes
    anything = gen.integers(0, 256, (2, 24, 3, 16), dtype=np.uint8)
    values = mxfp4.dequantize(anything, scales, "w")
    assert np.array_equal(mxfp4.dequantize(*mxfp4.quantize(values, "w"), "w"), values)


def test_written_values_are_what_transformers_dequantizes_within_the_bound():
    """Normal values: transformers' dequantization of the written blocks is the values `check_error` holds, bit for bit;
    each group's scale is the least power of two that takes its largest magnitude to 6 or under; every value is
    within one unit of its group's scale."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    x = (np.random.default_rng(2).standard_normal((3, 64, 40)) * np.float32(0.05)).astype(np.float32)
    blocks, scales = mxfp4.quantize(x, "w")
    held = mxfp4.check_error(x, blocks, scales, "w")
    theirs = _convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
    assert np.array_equal(held, theirs)
    largest = np.abs(np.swapaxes(x, -1, -2)).reshape(3, 40, 2, 32).max(-1)
    unit = np.ldexp(np.float32(1), scales.astype(np.int32) - 127)
    assert (largest <= 6 * unit).all() and (largest > 3 * unit).all()
    assert (np.abs(held - x) <= np.repeat(np.swapaxes(unit, -1, -2), 32, axis=-2)).all()


def test_rounding_is_to_the_nearest_value_ties_away_from_zero():
    """As the reference quantizer rounds (its `+ 1 >> 1` on the magnitude's bits): 5 -> 6, 2.5 -> 3, 0.25 -> 0.5."""
    x = np.zeros((32, 1), np.float32)
    x[:9, 0] = [6, 5, 2.5, 0.25, 0.75, -5, -0.25, 1.25, 0.2]
    blocks, scales = mxfp4.quantize(x, "w")
    assert scales.tolist() == [[127]]
    assert mxfp4.dequantize(blocks, scales, "w")[:9, 0].tolist() == [6, 6, 3, 0.5, 1, -6, -0.5, 1.5, 0]
    zeros = mxfp4.quantize(np.zeros((32, 2), np.float32), "w")
    assert not zeros[0].any() and not zeros[1].any()


def test_every_scaled_value_rounds_to_the_nearest_e2m1_value():
    """A dense sweep of [-6, 6] under scale 1 (a 6 in each group fixes it): each value becomes the E2M1 value nearest
    it, the one of larger magnitude at a tie, found here by brute force over the 8 magnitudes."""
    grid = np.abs(mxfp4.FP4[:8])
    sweep = np.linspace(-6, 6, 31 * 1024, dtype=np.float32).reshape(1024, 31)
    x = np.concatenate([np.full((1024, 1), 6, np.float32), sweep], axis=1).reshape(-1)  # groups of [6, 31 values]
    held = mxfp4.dequantize(*mxfp4.quantize(x[:, None], "w"), "w")[:, 0]
    distance = np.abs(np.abs(x)[:, None] - grid)  # [values, 8]
    nearest = grid[7 - np.argmin(distance[:, ::-1], axis=1)]  # of two at one distance, the larger (the last)
    assert np.array_equal(np.abs(held), nearest) and (np.signbit(held) == np.signbit(x)).all()


@pytest.mark.parametrize("x,words", [
    (np.full((32, 2), np.nan, np.float32), "w holds a value that is not finite"),
    (np.zeros((48, 2), np.float32), "w has 48 input columns, not a multiple of MXFP4's group of 32"),
])
def test_what_mxfp4_cannot_hold_is_refused(x, words):
    with pytest.raises(ReshardError, match=words):
        mxfp4.quantize(x, "w")


def test_the_release_comes_back_byte_for_byte_through_megatron(released, tmp_path, monkeypatch, capsys):
    """MXFP4 gpt-oss -> torch_dist EP2 -> HF --to-mxfp4: every tensor, blocks and scales included, and
    quantization_config as released (the fixture's random groups each hold a code of magnitude 4 or 6, as the reference
    quantizer makes a release)."""
    stored = load_file(str(released / "model.safetensors"))
    codes = torch.stack([stored[BLOCKS] & 0x7, (stored[BLOCKS] >> 4) & 0x7], -1).flatten(-2)
    assert (codes.amax(-1) >= 6).all()
    for args in ([released, tmp_path / "m", "--to-format", "torch_dist", "--to-ep", "2"],
                 [tmp_path / "m", tmp_path / "back", "--to-format", "hf", "--to-mxfp4"]):
        assert run_cli(monkeypatch, capsys, "convert", *args, "-q") == (0, [])
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == stored.keys() and all(torch.equal(back[k], v) for k, v in stored.items())
    config, source = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "back", released))
    assert config["quantization_config"] == source["quantization_config"]


def test_transformers_loads_an_mxfp4_export_within_the_bound(tmp_path, monkeypatch, capsys):
    """An unquantized gpt-oss exported --to-mxfp4: transformers loads it (dequantizing on the CPU) with every expert
    weight within MXFP4's bound of the source's, and each other tensor as it was."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    source = build("gpt_oss_mxfp4", tmp_path / "hf")
    for args in ([source, tmp_path / "m", "--to-format", "torch_dist", "--to-tp", "2", "--to-ep", "2", "--to-etp", "1"],
                 [tmp_path / "m", tmp_path / "back", "--to-format", "hf", "--to-mxfp4"]):
        assert run_cli(monkeypatch, capsys, "convert", *args, "-q") == (0, [])
    loaded = GptOssForCausalLM.from_pretrained(tmp_path / "back", quantization_config=Mxfp4Config(dequantize=True),
                                               dtype=torch.float32).state_dict()
    original = load_file(str(source / "model.safetensors"))
    assert loaded.keys() >= original.keys()
    for name, value in original.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            groups = value.transpose(-1, -2).reshape(*value.shape[:-2], value.shape[-1], -1, 32)
            unit = 2.0 ** torch.ceil(torch.log2(groups.abs().amax(-1) / 6))  # the reference's scale, for this bound
            bound = unit.repeat_interleave(32, -1).transpose(-1, -2)
            assert not torch.equal(loaded[name], value) and ((loaded[name] - value).abs() <= bound).all(), name
        else:
            assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize("family,flags,words", [
    ("llama", ["--to-format", "hf", "--to-mxfp4"], "HF llama is not released in MXFP4 (gpt-oss is)"),
    ("gpt_oss_mxfp4", ["--to-format", "torch_dist", "--to-mxfp4"], "--to-mxfp4 writes HF safetensors, not torch_dist"),
    ("gpt_oss_mxfp4", ["--to-format", "hf", "--to-mxfp4", "--to-fp8-blocks"], "choose one"),
])
def test_mxfp4_where_it_cannot_be_written_is_refused(tmp_path, monkeypatch, capsys, family, flags, words):
    source = build(family, tmp_path / "hf")
    refused_cli(monkeypatch, capsys, ["convert", source, tmp_path / "out", *flags], words, untouched=(source,))
    assert not (tmp_path / "out").exists()
