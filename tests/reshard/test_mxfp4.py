"""MXFP4 (`reshard.mxfp4`), gpt-oss's released form, read dequantized: every value as transformers' own dequantization
gives it (`_convert_moe_packed_tensors`, the oracle), one expert's blocks and scales read at a time, and blocks,
scales or a quantization_config that do not say one thing refused naming them, nothing written."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard import mxfp4
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.torchfile.archive_reader import RecordFile
from tests.cli import refused_cli, run_cli
from tests.converters.hf_models import build
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


def _edited(released, tmp_path, edit):
    bad = tmp_path / "bad"
    shutil.copytree(released, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return bad


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
    bad = _edited(released, tmp_path, edit)
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
