"""Qwen3.5-VL (dense and MoE): Qwen3.5's hybrid language model under Megatron-Bridge's `language_model.` (interleaved
MRoPE over a quarter of each head's dims) beside Qwen3-VL's vision model without DeepStack mergers in Bridge's
Megatron form. Round trips prove the mapping a bijection (TP2, PP2; EP2 for the MoE, experts per expert and fused as
released; the release's MTP layer, on the last stage); transformers' image-and-text logits prove the export right (the
vision qkv left in Megatron's order, the Gated DeltaNet's b and a swapped, two experts' gate and up swapped: each fails);
megatron-core's GPTModel on the converted language model gives transformers' logits at the image prompt's 3-D positions;
Megatron-Bridge's own import (MTP layer included) equals reshard's tensor for tensor."""

from __future__ import annotations

import json

import pytest
import torch
from test_hf_roundtrip import cli, hf_tensors
from test_qwen2_5_vl import bridge, dist_tensors, megatron_logits_diff
from test_qwen3_vl import QKV, export_is_the_source, image_logits, in_megatron_order, spell_sections_out

from reshard.config import ModelConfig
from reshard.converters import families_for_model
from reshard.converters.base import GatedMLP, Rename
from reshard.converters.qwen3_5_vl import Qwen3_5VL, Qwen3_5VLMoe
from reshard.formats import open_checkpoint
from reshard.layout import Layout
from reshard.sharding import pieces

from hf_models import build

FAMILY = {"qwen3_5_vl": Qwen3_5VL, "qwen3_5_vl_moe": Qwen3_5VLMoe, "qwen3_5_vl_moe_fused": Qwen3_5VLMoe, "qwen3_5_vl_mtp": Qwen3_5VL,
          "qwen3_5_vl_moe_mtp": Qwen3_5VLMoe}
BETA = "language_model.decoder.layers.0.self_attention.in_proj.weight.beta"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each tiny model, built once for the module."""
    root, out = tmp_path_factory.mktemp("qwen3_5_vl"), {}

    def get(name):
        if name not in out:
            out[name] = build(name, root / name)
        return out[name]

    return get


@pytest.fixture(scope="module")
def bridge_imports(models, tmp_path_factory):
    """Megatron-Bridge 0.6.2's own import of each tiny model (`fixtures/bridge_qwen3_5_vl.py`), run once for the module."""
    root = tmp_path_factory.mktemp("bridge")

    def get(name):
        if not (root / name).is_dir():
            bridge(models(name), root / name, script="bridge_qwen3_5_vl.py")
        return root / name / "ckpt"

    return get


def assert_round_trip(source, tmp_path, *layout) -> None:
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", *layout, "-q")
    specs = open_checkpoint(tmp_path / "m").specs
    assert {name.split(".")[0] for name in specs} == {"language_model", "vision_model"}
    assert specs[BETA].shape == (4, 64) and specs[QKV].shape == (3, 72, 24)
    assert not any("deepstack" in name for name in specs)
    export_is_the_source(source, tmp_path)


@pytest.mark.fast
def test_tp2_pp2_round_trip_keeps_the_vision_model_on_the_first_stage(models, tmp_path):
    """HF -> torch_dist at TP2 PP2 -> HF bit for bit, config.json and processor files too; the vision model (one head's
    q, k, v per rank) on stage 0, the Gated DeltaNet's parts split by heads; the Megatron model is no text family's."""
    source = models("qwen3_5_vl")
    assert_round_trip(source, tmp_path, "--to-tp", "2", "--to-pp", "2")
    reader = open_checkpoint(tmp_path / "m")
    layout = Layout(tp=2, pp=2)
    local = {(p.rank.pp, p.rank.tp, p.local_shape) for p in pieces(reader.specs[QKV], reader.config, layout) if p.region[0][0] in (0, None)}
    assert local == {(0, 0, (36, 24)), (0, 1, (36, 24))}
    assert {(p.rank.pp, p.local_shape) for p in pieces(reader.specs[BETA], reader.config, layout)} == {(0, (2, 64))}
    assert [type(f) for f in families_for_model(reader.config)] == [Qwen3_5VL]


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [("qwen3_5_vl", ["--to-tp", "2"]), ("qwen3_5_vl", ["--to-pp", "2"]),
                                          ("qwen3_5_vl_moe", ["--to-ep", "2"]), ("qwen3_5_vl_moe_fused", ["--to-ep", "2", "--to-tp", "2"]),
                                          ("qwen3_5_vl_moe_mtp", ["--to-pp", "2", "--to-ep", "2"])])
def test_round_trip_is_bit_identical(models, tmp_path, name, layout):
    assert_round_trip(models(name), tmp_path, *layout)
    if name.endswith("_mtp"):  # the release's MTP layer (mtp.*, top-level in HF), Megatron's on the last stage
        reader = open_checkpoint(tmp_path / "m")
        mtp = [p for p in pieces(reader.specs["language_model.mtp.layers.0.eh_proj.weight"], reader.config, Layout(pp=2, ep=2))]
        assert reader.config.mtp_num_layers == 1 and {p.rank.pp for p in mtp} == {1}
    if "moe" in name:
        config: ModelConfig = open_checkpoint(tmp_path / "m").config
        assert config.num_experts == 4 and [type(f) for f in families_for_model(config)] == [Qwen3_5VLMoe]


def ba_swapped(m):
    """The Gated DeltaNet's in_proj_b read as its alpha part and in_proj_a as its beta part."""
    swap = {"in_proj_b": "in_proj_a", "in_proj_a": "in_proj_b"}
    hf = m.hf[0]
    for a, b in swap.items():
        if f".{a}." in hf:
            return Rename(m.megatron, hf.replace(f".{a}.", f".{b}."))
    return m


def gate_up_swapped(m):
    """Each routed expert's gate and up rows in each other's place."""
    return GatedMLP(m.megatron, m.hf[1], m.hf[0]) if isinstance(m, GatedMLP) and ".experts." in m.megatron else m


SABOTAGE = {"qwen3_5_vl": {"vision qkv": in_megatron_order, "in_proj b/a": ba_swapped}, "qwen3_5_vl_moe": {"experts' gate/up": gate_up_swapped}}


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [("qwen3_5_vl", "--to-tp"), ("qwen3_5_vl_moe", "--to-ep")])
def test_the_export_gives_the_originals_logits_on_an_image_and_text(models, tmp_path, monkeypatch, name, layout):
    """transformers on an image and text: the HF export of a TP2 (EP2) checkpoint gives the original's logits exactly;
    exported with one deliberate mapping error, they move past 1e-3."""
    source, family = models(name), FAMILY[name]
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", layout, "2", "-q")
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    original = image_logits(source)
    assert torch.equal(image_logits(tmp_path / "back"), original)
    right = family.mappings
    for wrong, sabotage in SABOTAGE[name].items():
        monkeypatch.setattr(family, "mappings", lambda self, config, f=sabotage: [f(m) for m in right(self, config)])
        out = tmp_path / wrong.replace(" ", "_").replace("/", "_").replace("'", "")
        cli("convert", tmp_path / "m", out, "--to-format", "hf", "-q")
        assert (image_logits(out) - original).abs().max() > 1e-3, wrong


@pytest.mark.slow
@pytest.mark.parametrize("sections", ["interleaved", "contiguous"])
def test_megatron_cores_language_model_gives_transformers_text_logits(models, tmp_path, monkeypatch, sections):
    """megatron-core 0.16.1's GPTModel (Gated DeltaNet with the trainer's CPU stand-ins, MRoPE over the rotating quarter
    of each head) on the language model converted at TP2 gives transformers' logits at the image prompt's 3-D positions
    when its sections spell the interleaving out (as for Qwen3-VL, `megatron_sections`); with Qwen3.5's own sections
    read contiguously, as megatron-core reads them, it does not."""
    if sections == "interleaved":
        spell_sections_out(monkeypatch, Qwen3_5VL)
        assert megatron_logits_diff(models("qwen3_5_vl"), tmp_path, dict(tp=2)) <= 1e-4
    else:
        assert megatron_logits_diff(models("qwen3_5_vl"), tmp_path, dict(tp=2)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_5_vl_mtp", "qwen3_5_vl_moe_mtp"])
def test_reshards_checkpoint_is_bridges_own_import(models, bridge_imports, tmp_path, name):
    """Megatron-Bridge 0.6.2's own import of the same HF model (`fixtures/bridge_qwen3_5_vl.py`) equals reshard's
    torch_dist (`--for bridge`) tensor for tensor: names, shapes and values of the hybrid language model (in_proj and conv1d parts,
    zero-centred output norm, gated q/k/v, experts), of the release's MTP layer (Bridge's qwen35_vl tables map it under
    `language_model.mtp.`) and of the vision model; reshard reads Bridge's checkpoint by its run_config.yaml alone and
    exports the original HF weights bit for bit, mtp.* included."""
    source = models(name)
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", "--for", "bridge", "-q")  # the vocabulary unpadded
    ours, theirs = dist_tensors(tmp_path / "m" / "iter_0000000"), dist_tensors(bridge_imports(name) / "iter_0000000")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(".in_proj.weight.beta" in k for k in ours) and any(k.startswith("vision_model.") for k in ours)
    assert {"language_model.mtp.layers.0.eh_proj.weight", "language_model.mtp.layers.0.enorm.weight",
            "language_model.mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight"} <= ours.keys()
    # Bridge's checkpoint read by its run_config.yaml alone (its Qwen35VL[MoE]ModelProvider: the hybrid layers, the MTP
    # layer, the vision model, the token ids; no --config) and exported as the original HF weights bit for bit
    cli("convert", bridge_imports(name), tmp_path / "from_bridge", "--to-format", "hf", "-q")
    original, back = hf_tensors(source), hf_tensors(tmp_path / "from_bridge")
    assert back.keys() == original.keys() and all(torch.equal(original[k], back[k]) for k in original)
    assert json.loads((tmp_path / "from_bridge" / "config.json").read_text())["architectures"] == [FAMILY[name].architectures[0]]


@pytest.mark.slow
def test_the_comparison_with_bridges_import_fails_on_swapped_mtp_norms(models, bridge_imports, tmp_path, monkeypatch):
    """The same comparison can fail: reshard's import with the MTP layer's pre_fc_norm_embedding and pre_fc_norm_hidden
    swapped differs from Bridge's in exactly its enorm and hnorm."""
    import reshard.converters.qwen3_next as qwen3_next

    right, swap = qwen3_next.release_mtp_layer, {"mtp.layers.0.enorm.weight": "mtp.layers.0.hnorm.weight"}
    swap.update({v: k for k, v in swap.items()})

    def swapped(config, layer):
        return [Rename(swap[m.megatron], *m.hf) if m.megatron in swap else m for m in right(config, layer)]

    monkeypatch.setattr(qwen3_next, "release_mtp_layer", swapped)
    cli("convert", models("qwen3_5_vl_mtp"), tmp_path / "m", "--to-format", "torch_dist", "--for", "bridge", "-q")
    ours, theirs = dist_tensors(tmp_path / "m" / "iter_0000000"), dist_tensors(bridge_imports("qwen3_5_vl_mtp") / "iter_0000000")
    assert sorted(k for k in ours if not torch.equal(ours[k], theirs[k])) == [
        "language_model.mtp.layers.0.enorm.weight", "language_model.mtp.layers.0.hnorm.weight"]
