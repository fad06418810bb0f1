"""DeepSeek-V3's multi-token-prediction (MTP) layers through reshard: carried HF -> Megatron -> HF bit for bit
(config.json too), placed and cut like decoder layers, a flipped bit in one named by `verify`, and every export
that cannot hold them refused in one line. (Megatron-Core loading them strictly and computing transformers'
logits with them: tests/converters/test_hf_logits.py.)"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from test_hf_roundtrip import hf_tensors

from fixtures.models import TINY_MOE
from fixtures.synthetic import write_synthetic
from reshard.cli import main
from reshard.formats import open_checkpoint
from reshard.layout import Layout
from reshard.sharding import pieces
from tests.arrays import same
from tests.cli import run_cli
from tests.fp8_models import dequantized, load, make_fp8

from hf_models import build


def convert(*args) -> None:
    result = CliRunner().invoke(main, ["convert", *map(str, args), "-q"], standalone_mode=False)
    assert result.exception is None, result.exception


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build("deepseek_v3_mtp", tmp_path_factory.mktemp("hf") / "mtp")


@pytest.fixture(scope="module")
def megatron(source, tmp_path_factory) -> Path:
    """The model imported at TP2 PP2 EP2 (its MTP layer on the second stage, its experts split)."""
    target = tmp_path_factory.mktemp("megatron") / "m"
    convert(source, target, "--to-format", "torch_dist", "--to-tp", "2", "--to-pp", "2", "--to-ep", "2", "--naming", "local")
    return target


MTP_HF = (
    "model.layers.2.eh_proj.weight",
    "model.layers.2.enorm.weight",
    "model.layers.2.hnorm.weight",
    "model.layers.2.shared_head.norm.weight",
    "model.layers.2.shared_head.head.weight",
    "model.layers.2.embed_tokens.weight",
    "model.layers.2.self_attn.kv_b_proj.weight",
    "model.layers.2.mlp.experts.3.down_proj.weight",
)


def test_round_trip_keeps_mtp_layers_and_config_bit_identical(source, megatron, tmp_path):
    with open_checkpoint(megatron) as reader:
        assert reader.config.mtp_num_layers == 1
        assert reader.specs["mtp.layers.0.eh_proj.weight"].shape == (64, 128)
        assert reader.specs["mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"].shape == (4, 64, 64)
    said = CliRunner().invoke(main, ["inspect", str(megatron)]).output
    assert "4 experts top-2, 1 MTP layers" in said and "mtp.layers.0.eh_proj.weight" in said
    # Megatron-Bridge's run config says so too, or Bridge would build the model without them
    assert yaml.safe_load((megatron / "release" / "run_config.yaml").read_text())["model"]["mtp_num_layers"] == 1
    back = tmp_path / "back"
    convert(megatron, back, "--to-format", "hf")
    original, exported = hf_tensors(source), hf_tensors(back)
    assert set(MTP_HF) <= original.keys() and exported.keys() == original.keys()
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and same(exported[key], value), key
    assert json.loads((back / "config.json").read_text()) == json.loads((source / "config.json").read_text())


def test_zarr_carries_mtp_layers(source, tmp_path):
    convert(source, tmp_path / "zarr", "--to-format", "zarr", "--to-ep", "2")
    convert(tmp_path / "zarr", tmp_path / "back", "--to-format", "hf")
    original, exported = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert exported.keys() == original.keys() and all(same(exported[k], v) for k, v in original.items())


def test_mtp_tensors_are_cut_like_decoder_layers(megatron):
    """On the last pipeline stage with the output layer; eh_proj split by rows over TP; experts over EP."""
    with open_checkpoint(megatron) as reader:
        config, specs = reader.config, reader.specs
    layout = Layout(tp=2, pp=2, ep=2)
    mtp = [name for name in specs if name.startswith("mtp.")]
    assert len(mtp) == 19
    for name in mtp:
        assert {p.rank.pp for p in pieces(specs[name], config, layout)} == {1}, name
    eh_proj = [p for p in pieces(specs["mtp.layers.0.eh_proj.weight"], config, layout) if p.primary]
    assert sorted(p.region for p in eh_proj) == [((0, 32), (0, 128)), ((32, 64), (0, 128))]
    experts = pieces(specs["mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2.weight"], config, layout)
    assert {(p.rank.ep, p.region[0]) for p in experts} == {(0, (0, 1)), (0, (1, 2)), (1, (2, 3)), (1, (3, 4))}


def _flip_bit(directory: Path, tensor: str, element: int = 70) -> None:
    """One bit of one value of `tensor` in an HF directory's safetensors file, flipped in place."""
    for file in directory.glob("*.safetensors"):
        raw = bytearray(file.read_bytes())
        size = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + size])
        if tensor in header:
            raw[8 + size + header[tensor]["data_offsets"][0] + 4 * element] ^= 1
            file.write_bytes(bytes(raw))
            return
    raise AssertionError(f"{tensor} not found")


@pytest.mark.parametrize(
    "hf_name,logical",
    [
        ("model.layers.2.eh_proj.weight", "mtp.layers.0.eh_proj.weight"),
        ("model.layers.2.mlp.experts.3.down_proj.weight", "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2.weight"),
    ],
)
def test_verify_names_an_mtp_tensor_changed_by_one_bit(source, megatron, tmp_path, hf_name, logical):
    changed = tmp_path / "changed"
    shutil.copytree(source, changed)
    _flip_bit(changed, hf_name)
    assert CliRunner().invoke(main, ["verify", str(source), "--against", str(megatron)]).exit_code == 0
    result = CliRunner().invoke(main, ["verify", str(changed), "--against", str(megatron)])
    assert result.exit_code == 1 and f"1 tensor(s) differ (first: {logical})" in result.output, result.output


def test_mtp_copies_that_differ_are_refused_by_name(source, tmp_path, monkeypatch, capsys):
    """HF's per-MTP-layer copy of the output head changed by one bit: Megatron shares one head, so the import refuses
    (one line, naming the copy) rather than keep one and drop the other."""
    changed = tmp_path / "changed"
    shutil.copytree(source, changed)
    _flip_bit(changed, "model.layers.2.shared_head.head.weight")
    code, err = run_cli(monkeypatch, capsys, "convert", changed, tmp_path / "out", "--to-format", "torch_dist")
    assert code != 0 and len(err) == 1 and "model.layers.2.shared_head.head.weight differs from lm_head.weight" in err[0], err
    assert not (tmp_path / "out").exists()


def test_an_mtp_model_in_the_legacy_format_is_refused(source, tmp_path, monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "convert", source, tmp_path / "out", "--to-format", "legacy")
    assert code != 0 and len(err) == 1 and "multi-token-prediction" in err[0] and "legacy" in err[0], err


def test_an_hf_family_without_mtp_refuses_the_export(tmp_path, monkeypatch, capsys):
    """A Mixtral-shaped Megatron model with an MTP layer: resharded with it, but HF Mixtral has no place for it."""
    model = tmp_path / "moe"
    write_synthetic(model, TINY_MOE.replace(mtp_num_layers=1, vocab_size=250), Layout(), "torch_dist")
    convert(model, tmp_path / "ep2", "--to-format", "torch_dist", "--to-ep", "2")
    with open_checkpoint(tmp_path / "ep2") as reader:
        assert reader.config.mtp_num_layers == 1 and "mtp.layers.0.eh_proj.weight" in reader.specs
    code, err = run_cli(monkeypatch, capsys, "convert", tmp_path / "ep2", tmp_path / "hf", "--to-format", "hf")
    assert code != 0 and len(err) == 1 and "HF mixtral cannot hold" in err[0], err


def test_fp8_mtp_layers_are_imported_dequantized(source, tmp_path):
    """DeepSeek-V3's release quantizes its MTP layer's projections too: they come in dequantized (`weight.float() *
    scale`, the tests' own recipe) like the decoder's, and go back out with every tensor."""
    fp8 = make_fp8(source, tmp_path / "fp8", (16, 24))
    assert load(fp8)["model.layers.2.eh_proj.weight"].dtype == torch.float8_e4m3fn
    convert(fp8, tmp_path / "megatron", "--to-format", "torch_dist", "--dtype", "fp32", "--to-ep", "2")
    convert(tmp_path / "megatron", tmp_path / "back", "--to-format", "hf")
    expected, exported = dequantized(fp8, (16, 24)), load(tmp_path / "back")
    assert exported.keys() == expected.keys() and {n for n in expected if n.startswith("model.layers.2.")} >= set(MTP_HF)
    for name, value in expected.items():
        assert same(exported[name], value), name


def _without(directory: Path, out: Path, drop) -> Path:
    """A copy of HF model `directory` at `out` with the tensors `drop(name)` says removed from its file."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(directory, out)
    file = out / "model.safetensors"
    save_file({k: v for k, v in load_file(file).items() if not drop(k)}, str(file), metadata={"format": "pt"})
    return out


def test_mtp_named_by_the_config_but_absent_is_not_carried(source, tmp_path):
    """As transformers saves a DeepSeek-V3: config.json keeps num_nextn_predict_layers 1, the files hold no
    model.layers.2.*. The conversion says so on its output line, writes mtp_num_layers 0, and the export carries
    every tensor there was, saying num_nextn_predict_layers 0."""
    saved = _without(source, tmp_path / "saved", lambda name: name.startswith("model.layers.2."))
    result = CliRunner().invoke(main, ["convert", str(saved), str(tmp_path / "m"), "--to-format", "torch_dist", "--to-ep", "2"],
                                standalone_mode=False)
    assert result.exception is None, result.exception
    assert "not carried: 1 x MTP layers (1 named by num_nextn_predict_layers, none in the files)" in result.output, result.output
    assert yaml.safe_load((tmp_path / "m" / "release" / "run_config.yaml").read_text())["model"]["mtp_num_layers"] == 0
    with open_checkpoint(tmp_path / "m") as reader:
        assert reader.config.mtp_num_layers == 0 and not any(name.startswith("mtp.") for name in reader.specs)
    convert(tmp_path / "m", tmp_path / "back", "--to-format", "hf")
    original, exported = hf_tensors(saved), hf_tensors(tmp_path / "back")
    assert exported.keys() == original.keys() and all(same(exported[k], v) for k, v in original.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize("missing", ["model.layers.2.eh_proj.weight", "model.layers.2.mlp.experts.1.up_proj.weight"])
def test_mtp_layers_held_in_part_are_refused_naming_the_first_missing(source, tmp_path, monkeypatch, capsys, missing):
    partial = _without(source, tmp_path / "partial", lambda name: name == missing)
    code, err = run_cli(monkeypatch, capsys, "convert", partial, tmp_path / "out", "--to-format", "torch_dist")
    assert code != 0 and len(err) == 1 and f"tensor {missing} is missing" in err[0] and "num_nextn_predict_layers" in err[0], err
    assert not (tmp_path / "out").exists()
