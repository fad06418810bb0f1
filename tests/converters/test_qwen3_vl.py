"""Qwen3-VL: the language model under Megatron-Bridge's `language_model.` with interleaved MRoPE, the vision model in
Bridge's Megatron form (`vision_model.*`: blocks and DeepStack mergers stacked, linear layers split over TP as
megatron-core splits them) on the first stage. Round trips prove the mapping is a bijection; transformers' logits on an
image and text prove it is the right one (a vision qkv split at the wrong place, a DeepStack merger index shifted:
both fail)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_hf_roundtrip import cli, hf_tensors
from test_qwen2_5_vl import bridge, dist_tensors, megatron_logits_diff

from reshard.converters.base import Rename
from reshard.converters.qwen3_vl import Qwen3VL
from reshard.formats import open_checkpoint
from reshard.layout import Layout
from reshard.sharding import pieces
from tests.cli import refused_cli

from hf_models import build, load

IMAGE = 240  # the tiny model's image token (hf_models)
# a prompt of 16 tokens around one image of 4 x 4 patches, merged 2 x 2 into 4 image tokens
PROMPT = [5, 6, 242, IMAGE, IMAGE, IMAGE, IMAGE, 243, 7, 8, 9, 10, 11, 12, 13, 14]
QKV = "vision_model.decoder.layers.self_attention.linear_qkv.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl") / "hf")


def image_logits(directory: Path) -> torch.Tensor:
    """transformers' logits on a synthetic image of 4 x 4 patches (one frame pair) inside the prompt."""
    ids = torch.tensor([PROMPT])
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return load(directory)(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]]),
                               mm_token_type_ids=(ids == IMAGE).int()).logits


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--to-tp", "2"], ["--to-pp", "2"]], ids=["tp2", "pp2"])
def test_round_trip_is_bit_identical(source, tmp_path, layout):
    """HF -> torch_dist -> HF: every tensor, config.json and the processor files as they came; the vision model under
    Bridge's names, its blocks and DeepStack mergers stacked, the language model under language_model."""
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", *layout, "-q")
    specs = open_checkpoint(tmp_path / "m").specs
    assert {name.split(".")[0] for name in specs} == {"language_model", "vision_model"}
    assert specs[QKV].stacked and specs[QKV].shape == (3, 72, 24) and specs[QKV].tp_axis == 1
    assert specs["vision_model.decoder.deepstack_merger_list.linear_fc2.weight"].shape == (2, 64, 96)
    export_is_the_source(source, tmp_path)


def export_is_the_source(source: Path, tmp_path: Path) -> None:
    """The HF export of tmp_path/m is `source` bit for bit: every tensor, config.json and the processor files."""
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    original, back = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    for name in ("config.json", "preprocessor_config.json", "chat_template.json"):
        assert json.loads((tmp_path / "back" / name).read_text()) == json.loads((source / name).read_text()), name


@pytest.mark.fast
def test_the_vision_model_splits_over_tp_where_megatron_core_splits_it(source, tmp_path):
    """At TP2 PP2 the vision model lies on the first stage: q/k/v by heads (one whole head's q, k, v per rank), fc1 and
    the mergers' fc1 by output rows with their biases, proj and fc2 by input columns with their biases whole, norms,
    the patch and position embeddings whole; the HF export of the resharded zarr view is the source bit for bit."""
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", "--to-tp", "2", "--to-pp", "2", "-q")
    reader = open_checkpoint(tmp_path / "m")
    layout = Layout(tp=2, pp=2)

    def local(name):
        return {(p.rank.pp, p.rank.tp, p.local_shape) for p in pieces(reader.specs[name], reader.config, layout) if p.region[0][0] in (0, None)}

    v = "vision_model."
    assert local(QKV) == {(0, 0, (36, 24)), (0, 1, (36, 24))}
    assert local(f"{v}decoder.layers.self_attention.linear_proj.weight") == {(0, 0, (24, 12)), (0, 1, (24, 12))}
    assert local(f"{v}decoder.layers.self_attention.linear_proj.bias") == {(0, 0, (24,)), (0, 1, (24,))}
    assert local(f"{v}decoder.layers.mlp.linear_fc1.bias") == {(0, 0, (20,)), (0, 1, (20,))}
    assert local(f"{v}decoder.deepstack_merger_list.linear_fc1.weight") == {(0, 0, (48, 96)), (0, 1, (48, 96))}
    assert local(f"{v}merger.linear_fc2.weight") == {(0, 0, (64, 48)), (0, 1, (64, 48))}
    assert local(f"{v}pos_embed.weight") == {(0, 0, (16, 24)), (0, 1, (16, 24))}
    assert {p.rank.pp for p in pieces(reader.specs["language_model.output_layer.weight"], reader.config, layout)} == {1}
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    original, back = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("field, value, words", [("hidden_size", 20, "vision_config"), ("deepstack_visual_indexes", [0, 3], "vision_config"),
                                                 ("out_hidden_size", 48, "vision_config"), ("num_heads", 3, "vision attention heads")])
def test_a_vision_config_that_contradicts_the_tensors_is_refused(source, tmp_path, monkeypatch, capsys, field, value, words):
    """One line naming the vision_config field, nothing written; TP2 would cut one of three vision heads (the tensors
    do not show the heads), refused so."""
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    config = json.loads((source / "config.json").read_text())
    config["vision_config"][field] = value
    (bad / "config.json").write_text(json.dumps(config))
    refused_cli(monkeypatch, capsys, ["convert", str(bad), str(tmp_path / "m"), "--to-format", "torch_dist", "--to-tp", "2"], words)
    assert not (tmp_path / "m").exists()


def test_an_mtp_layer_qwen3_vl_has_none_of_is_refused(source, tmp_path, monkeypatch, capsys):
    """Qwen3-VL has no MTP layer (Qwen3.5-VL's text family carries one): text_config.mtp_num_hidden_layers refused by
    name, nothing written."""
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    config = json.loads((source / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (bad / "config.json").write_text(json.dumps(config))
    refused_cli(monkeypatch, capsys, ["convert", str(bad), str(tmp_path / "m"), "--to-format", "torch_dist"], "mtp_num_hidden_layers=1",
                "Qwen3-VL has no MTP layer")
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_reshards_checkpoint_is_bridges_own_import_and_bridge_exports_it_back(source, tmp_path):
    """Megatron-Bridge's import of the same HF model equals reshard's tensor for tensor (names, shapes, values: the
    vision model's q/k/v fused per head as Bridge fuses them, its blocks and DeepStack mergers stacked as Bridge saves
    them); reshard reads Bridge's checkpoint (its run_config.yaml) and exports the original HF weights; Bridge loads
    reshard's checkpoint with megatron-core's loader and exports the original HF weights bit for bit."""
    ours = bridge_both_ways(source, tmp_path)
    assert any(k.startswith("vision_model.decoder.deepstack_merger_list.") for k in ours)


def bridge_both_ways(source, tmp_path, tp: int = 1, ep: int = 1) -> dict[str, torch.Tensor]:
    """Bridge's import of `source` at TP `tp` EP `ep` equals reshard's `--for bridge` one at that layout (its global
    tensors, returned); reshard exports Bridge's checkpoint, Bridge (at that layout) reshard's, each to the original HF
    weights bit for bit."""
    layout = ("--tp", str(tp), "--ep", str(ep))
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", "--for", "bridge", "--to-tp", str(tp), "--to-ep", str(ep), "-q")
    bridge(source, tmp_path / "bridge", *layout, script="bridge_qwen3_vl.py")
    ours, theirs = dist_tensors(tmp_path / "m" / "iter_0000000"), dist_tensors(tmp_path / "bridge" / "ckpt" / "iter_0000000")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    cli("convert", tmp_path / "bridge" / "ckpt", tmp_path / "from_bridge", "--to-format", "hf", "-q")
    original, back = hf_tensors(source), hf_tensors(tmp_path / "from_bridge")
    assert back.keys() == original.keys() and all(torch.equal(original[k], back[k]) for k in original)
    bridge(source, tmp_path / "export", "--load", tmp_path / "m" / "iter_0000000", *layout, script="bridge_qwen3_vl.py")
    exported = load_file(tmp_path / "export" / "export.safetensors")
    assert exported.keys() == original.keys() and all(torch.equal(original[k], exported[k]) for k in original)
    return ours


class DeepStackShifted(Rename):
    """A DeepStack merger's tensor under the next merger's HF name (the stack read one place off)."""

    def hf_names(self, layer=None, expert=None):
        return [t.format(layer=(layer + 1) % 2, expert=expert) for t in self.hf]


def in_megatron_order(m):
    """The vision blocks' qkv written in Megatron's per-head order, as if HF's [q; k; v] were the same."""
    return Rename(m.megatron, m.hf[0]) if m.megatron.startswith(QKV.removesuffix("weight")) else m


def deepstack_shifted(m):
    return DeepStackShifted(m.megatron, m.hf[0]) if m.megatron.startswith("vision_model.decoder.deepstack_merger_list.") else m


@pytest.mark.slow
def test_the_export_gives_the_originals_logits_on_an_image_and_text(source, tmp_path, monkeypatch):
    """transformers on an image and text: the HF export of a TP2 checkpoint gives the original's logits exactly (the
    image moves them: the check sees the vision model and its DeepStack mergers); exported with the vision qkv left in
    Megatron's per-head order, or with the DeepStack mergers shifted by one, it does not."""
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", "--to-tp", "2", "-q")
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    original = image_logits(source)
    assert torch.equal(image_logits(tmp_path / "back"), original)
    right = Qwen3VL.mappings
    for wrong, sabotage in (("qkv", in_megatron_order), ("deepstack", deepstack_shifted)):
        monkeypatch.setattr(Qwen3VL, "mappings", lambda self, config, f=sabotage: [f(m) for m in right(self, config)])
        cli("convert", tmp_path / "m", tmp_path / wrong, "--to-format", "hf", "-q")
        assert (image_logits(tmp_path / wrong) - original).abs().max() > 1e-3, wrong


def megatron_sections(section: tuple[int, ...]) -> tuple[int, ...]:
    """Qwen3-VL's interleaved sections (t, h, w) as megatron-core's contiguous ones: transformers rotates frequency j by
    the height position where j = 1 mod 3 below 3h, the width one where j = 2 mod 3 below 3w, the temporal one
    elsewhere; megatron-core's i-th section by the position i mod 3 says (empty sections skip a position)."""
    t, h, w = section
    out: list[int] = []
    for j in range(t + h + w):
        axis = 1 if j % 3 == 1 and j < 3 * h else 2 if j % 3 == 2 and j < 3 * w else 0
        if out and (len(out) - 1) % 3 == axis:
            out[-1] += 1
        else:
            out += [0] * ((axis - len(out)) % 3) + [1]
    return tuple(out + [0] * (-len(out) % 3))  # megatron-core counts on over the rotary's second half: whole triples


def spell_sections_out(monkeypatch, family) -> None:
    """`family` imports with its MRoPE sections spelled out as megatron-core reads them (`megatron_sections`), which
    its own check of them refuses (switched off)."""
    right = family.config_from_hf

    def expanded(self, hf):
        config, extras = right(self, hf)
        return config.replace(mrope_section=megatron_sections(config.mrope_section)), extras

    monkeypatch.setattr(family, "config_from_hf", expanded)
    monkeypatch.setattr(family, "check_megatron", lambda self, config: None)


@pytest.mark.slow
@pytest.mark.parametrize("sections", ["interleaved", "contiguous"])
def test_megatron_cores_mrope_gives_transformers_text_logits_with_the_sections_interleaved(source, tmp_path, monkeypatch, sections):
    """megatron-core 0.16.1's GPTModel (MRoPE) on the converted language model at TP2 gives transformers' logits at the
    3-D positions of the image prompt when its sections spell the interleaving out (one frequency each); with
    Qwen3-VL's own sections read contiguously, as megatron-core reads them, it does not."""
    if sections == "interleaved":
        spell_sections_out(monkeypatch, Qwen3VL)
        assert megatron_logits_diff(source, tmp_path, dict(tp=2)) <= 1e-4
    else:
        assert megatron_logits_diff(source, tmp_path, dict(tp=2)) > 1e-3
