"""Qwen3-VL-MoE: Qwen3-VL's vision model and MRoPE beside an MoE language model whose experts the release stores fused
and transposed (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`). Round trips prove the mapping is a bijection at
TP2, EP2 and PP2; transformers' image-and-text logits prove the export right (gate and up swapped in the fused tensor
fail them); megatron-core's GPTModel on the converted language model at EP2 gives transformers' logits (two experts
swapped fail it)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from test_hf_roundtrip import cli, hf_tensors
from test_qwen2_5_vl import megatron_logits_diff
from test_qwen3_vl import bridge_both_ways, image_logits, spell_sections_out

from reshard.converters.base import Transposed
from reshard.converters.qwen3_vl_moe import Qwen3VLMoe
from reshard.formats import open_checkpoint
from tests.cli import refused_cli

from hf_models import build

FC1 = "language_model.decoder.layers.0.mlp.experts.experts.linear_fc1.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build("qwen3_vl_moe", tmp_path_factory.mktemp("qwen3_vl_moe") / "hf")


def assert_round_trip(source, tmp_path, *layout):
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", *layout, "-q")
    specs = open_checkpoint(tmp_path / "m").specs
    assert specs[FC1].shape == (4, 96, 64)  # layer 0's four experts, [gate; up] rows
    assert "language_model.decoder.layers.1.mlp.linear_fc1.weight" in specs  # layer 1 dense (mlp_only_layers)
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    original, back = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert original["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 96)  # as released
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    for name in ("config.json", "preprocessor_config.json", "chat_template.json"):
        assert json.loads((tmp_path / "back" / name).read_text()) == json.loads((source / name).read_text()), name


@pytest.mark.fast
def test_round_trip_at_ep2_is_bit_identical(source, tmp_path):
    """HF -> torch_dist at EP2 -> HF: every tensor (the fused experts in the release's orientation), config.json and the
    processor files as they came."""
    assert_round_trip(source, tmp_path, "--to-ep", "2")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--to-tp", "2"], ["--to-pp", "2"]], ids=["tp2", "pp2"])
def test_round_trip_is_bit_identical(source, tmp_path, layout):
    assert_round_trip(source, tmp_path, *layout)


def fused_in_transformers_orientation(source, directory):
    """A copy whose fused experts are stored as transformers 5.24 saves them ([E, 2I, H]), not as released."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    tensors = load_file(directory / "model.safetensors")
    tensors = {k: t.transpose(1, 2).contiguous() if ".mlp.experts." in k else t for k, t in tensors.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("case", ["norm_topk_prob", "moe_intermediate_size", "orientation"])
def test_what_it_cannot_read_as_released_is_refused(source, tmp_path, monkeypatch, capsys, case):
    """A router told not to renormalise (transformers' always does), experts whose two orientations look alike, and
    experts in the other orientation: one line naming the field or tensor, nothing written."""
    if case != "orientation":
        bad = tmp_path / "bad"
        shutil.copytree(source, bad)
        config = json.loads((source / "config.json").read_text())
        config["text_config"][case] = {"norm_topk_prob": False, "moe_intermediate_size": 32}[case]
        (bad / "config.json").write_text(json.dumps(config))
        words = {"norm_topk_prob": ("text_config.norm_topk_prob",), "moe_intermediate_size": ("twice moe_intermediate_size",)}[case]
    else:
        bad = fused_in_transformers_orientation(source, tmp_path / "bad")
        words = ("model.language_model.layers.0.mlp.experts.", "has shape")
    refused_cli(monkeypatch, capsys, ["convert", str(bad), str(tmp_path / "m"), "--to-format", "torch_dist"], *words)
    assert not (tmp_path / "m").exists()


class GateUpSwapped(Transposed):
    """An expert's fc1 with its up rows where gate's go (the fused tensor's halves swapped), both ways."""

    def to_megatron(self, tensors, config):
        return np.concatenate(np.split(tensors[0].T, 2, axis=0)[::-1], axis=0)

    def to_hf(self, tensor, config):
        return [np.concatenate(np.split(tensor, 2, axis=0)[::-1], axis=0).T]


class ExpertsSwapped(Transposed):
    """Experts 0 and 1 read each other's slice of the fused tensor."""

    def hf_names(self, layer=None, expert=None):
        return [t.format(layer=layer, expert={0: 1, 1: 0}.get(expert, expert)) for t in self.hf]


def sabotaged(cls):
    right = Qwen3VLMoe.mappings

    def mappings(self, config):
        return [cls(m.megatron, m.hf[0]) if "experts.experts.linear_fc" in m.megatron else m for m in right(self, config)]

    return mappings


@pytest.mark.slow
def test_the_export_gives_the_originals_logits_on_an_image_and_text(source, tmp_path, monkeypatch):
    """transformers on an image and text: the HF export of an EP2 checkpoint gives the original's logits exactly; with
    gate and up swapped in the fused gate_up_proj it does not."""
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", "--to-ep", "2", "-q")
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    original = image_logits(source)
    assert torch.equal(image_logits(tmp_path / "back"), original)
    monkeypatch.setattr(Qwen3VLMoe, "mappings", sabotaged(GateUpSwapped))
    cli("convert", tmp_path / "m", tmp_path / "wrong", "--to-format", "hf", "-q")
    assert (image_logits(tmp_path / "wrong") - original).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["right", "swapped"])
def test_megatron_cores_language_model_at_ep2_gives_transformers_logits(source, tmp_path, monkeypatch, experts):
    """megatron-core 0.16.1's GPTModel (MRoPE, its sections spelling Qwen3-VL's interleaving out as test_qwen3_vl does)
    on the language model converted at EP2 gives transformers' logits at the image prompt's 3-D positions; with two
    experts' fused slices swapped on import it does not."""
    spell_sections_out(monkeypatch, Qwen3VLMoe)
    if experts == "swapped":
        monkeypatch.setattr(Qwen3VLMoe, "mappings", sabotaged(ExpertsSwapped))
        assert megatron_logits_diff(source, tmp_path, dict(ep=2)) > 1e-3
    else:
        assert megatron_logits_diff(source, tmp_path, dict(ep=2)) <= 1e-4


@pytest.mark.slow
def test_reshards_checkpoint_is_bridges_own_import_and_bridge_exports_it_back(tmp_path):
    """Megatron-Bridge 0.6.2's import of the same HF model at TP2 EP2 on four ranks (every layer MoE: Bridge builds no
    other) equals reshard's `--to-tp 2 --to-ep 2` torch_dist tensor for tensor (the vision model split over TP as
    Bridge splits it, the experts SequentialMLP's, stacked, each rank's two in their global place); reshard reads
    Bridge's checkpoint (its run_config.yaml's Qwen3VLMoEModelProvider) and exports the original HF weights; Bridge at
    TP2 EP2 loads reshard's checkpoint with megatron-core's loader and exports the original HF weights bit for bit (its
    fused experts in the release's orientation, gathered from the ranks): the EP > 1 export failures users report do
    not show with Bridge 0.6.2 here (SequentialMLP experts; TEGroupedMLP's need a GPU)."""
    ours = bridge_both_ways(build("qwen3_vl_moe_all", tmp_path / "hf"), tmp_path, tp=2, ep=2)
    assert ours[FC1.replace("layers.0.", "layers.")].shape == (2, 4, 96, 64)  # every layer MoE, stacked


def test_the_run_config_says_nothing_is_frozen(source, tmp_path):
    """`--for bridge` spells out what the run trained: Bridge's Qwen3VLMoEModelProvider freezes the language and vision
    models when run_config.yaml says nothing, which would have a Bridge run resumed from the checkpoint train the mergers
    only."""
    import yaml

    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", "--for", "bridge", "-q")
    model = yaml.safe_load((tmp_path / "m" / "iter_0000000" / "run_config.yaml").read_text())["model"]
    assert model["_target_"].endswith(".Qwen3VLMoEModelProvider")
    assert {key: value for key, value in model.items() if key.startswith("freeze_")} == {
        "freeze_language_model": False, "freeze_vision_model": False, "freeze_vision_projection": False}
