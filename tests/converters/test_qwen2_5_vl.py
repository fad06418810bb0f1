"""Qwen2.5-VL: the language model under Megatron-Bridge's `language_model.` with MRoPE, the vision tower carried whole
(`visual.*`) on the first stage. Proven against transformers (the HF export of a converted model gives the original's
logits on an image-and-text input; its language model's logits equal megatron-core's GPTModel with MRoPE on the
converted weights at TP2 and PP2) and against Megatron-Bridge 0.6.2 (its own import equals reshard's tensor for
tensor; it loads reshard's checkpoint and exports the original HF weights bit for bit). Deliberate mapping errors
(q/k/v regrouped wrong, a vision block's qkv halves swapped, the MRoPE sections changed) fail the checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf_roundtrip import cli, hf_tensors

from reshard.converters.base import QKV, Rename
from reshard.converters.qwen2_5_vl import Qwen2_5_VL
from reshard.formats import open_checkpoint
from tests.bridge import bridge
from tests.cli import refused_cli, refused_config
from tests.launch import run

from hf_models import build, load

IMAGE = 240  # the tiny model's image token (hf_models)
# a prompt of 16 tokens around one image of 4 x 4 patches, merged 2 x 2 into 4 image tokens
PROMPT = [5, 6, 242, IMAGE, IMAGE, IMAGE, IMAGE, 243, 7, 8, 9, 10, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl") / "hf")


def image_inputs() -> dict[str, torch.Tensor]:
    """A synthetic image of 4 x 4 patches (one frame pair) with the prompt that holds it."""
    ids = torch.tensor([PROMPT])
    pixels = torch.Generator().manual_seed(1)
    return {"input_ids": ids, "pixel_values": torch.randn(16, 3 * 2 * 4 * 4, generator=pixels), "image_grid_thw": torch.tensor([[1, 4, 4]]),
            "mm_token_type_ids": (ids == IMAGE).int()}


def image_logits(directory: Path) -> torch.Tensor:
    with torch.no_grad():
        return load(directory)(**image_inputs()).logits


@pytest.mark.parametrize("layout", [["--to-tp", "2"], ["--to-pp", "2"]], ids=["tp2", "pp2"])
def test_round_trip_is_bit_identical(source, tmp_path, layout):
    """HF -> torch_dist -> HF: every tensor, config.json and the processor files as they came; the vision tower whole
    on every TP rank and on the first stage, the language model under language_model. as Bridge keys it."""
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", *layout, "-q")
    specs = open_checkpoint(tmp_path / "m").specs
    assert {name.split(".")[0] for name in specs} == {"language_model", "visual"}
    assert specs["visual.blocks.0.attn.qkv.weight"].tp_axis is None
    assert specs["language_model.decoder.layers.self_attention.linear_qkv.weight"].stacked
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    original, back = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    for name in ("config.json", "preprocessor_config.json", "chat_template.json"):
        assert json.loads((tmp_path / "back" / name).read_text()) == json.loads((source / name).read_text()), name


def test_the_vision_tower_is_in_every_view_on_the_first_stage(source, tmp_path):
    """zarr, a TP2 PP2 reshard of it, verify and inspect carry the vision tower like any tensor; its pieces lie on the
    first pipeline stage whole on each TP rank, the language model's output layer on the last."""
    from reshard.layout import Layout
    from reshard.sharding import pieces
    from reshard.verify import verify

    cli("convert", source, tmp_path / "z", "--to-format", "zarr", "-q")
    cli("convert", tmp_path / "z", tmp_path / "m", "--to-format", "torch_dist", "--to-tp", "2", "--to-pp", "2", "-q")
    assert verify(tmp_path / "m").comparison.ok and verify(tmp_path / "m", against=tmp_path / "z").comparison.ok
    assert "visual.merger.mlp.2.weight" in cli("inspect", tmp_path / "m")
    reader = open_checkpoint(tmp_path / "m")
    qkv = [p for p in pieces(reader.specs["visual.blocks.1.attn.qkv.weight"], reader.config, Layout(tp=2, pp=2))]
    assert {(p.rank.pp, p.rank.tp, p.local_shape) for p in qkv} == {(0, 0, (96, 32)), (0, 1, (96, 32))}
    head = pieces(reader.specs["language_model.output_layer.weight"], reader.config, Layout(tp=2, pp=2))
    assert {p.rank.pp for p in head} == {1}
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    original, back = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert all(torch.equal(original[k], back[k]) for k in original)


def test_torch_dist_for_bridge_names_its_vl_provider_and_reads_back(source, tmp_path):
    """`--for bridge` writes the run_config.yaml of Bridge's Qwen25VLModelProvider (MRoPE sections, the vision config,
    the image token ids); read back, it is the checkpoint's own architecture, vision tower included."""
    import yaml

    from reshard.config import ModelConfig
    from reshard.formats.model_args import QWEN2_5_VL_PROVIDER, bridge_args

    cli("convert", source, tmp_path / "out", "--to-format", "torch_dist", "--for", "bridge", "-q")
    run_config = tmp_path / "out" / "iter_0000000" / "run_config.yaml"
    model = yaml.safe_load(run_config.read_text())["model"]
    assert (model["_target_"], model["mrope_section"], model["vision_config"]["depth"], model["image_token_id"]) == \
        (QWEN2_5_VL_PROVIDER, [2, 3, 3], 2, IMAGE)
    with open_checkpoint(tmp_path / "out") as reader:
        assert ModelConfig.from_megatron_args(bridge_args(run_config)) == reader.config


def test_transformers_5_names_are_read_and_the_export_is_as_transformers_saves(source, tmp_path):
    """Files keyed as transformers >= 5 builds the model (model.language_model.*, model.visual.*) convert alike; the
    export names them as transformers 5.24 saves them (model.layers.*, visual.*), which Bridge reads too."""
    renamed = tmp_path / "v5"
    shutil.copytree(source, renamed)
    tensors = load_file(renamed / "model.safetensors")
    save_file({("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in tensors.items()}, renamed / "model.safetensors")
    cli("convert", renamed, tmp_path / "m", "--to-format", "torch_dist", "-q")
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    back = hf_tensors(tmp_path / "back")
    assert back.keys() == tensors.keys() and all(torch.equal(tensors[k], back[k]) for k in tensors)


class QKHalvesSwapped(Rename):
    """A vision block's fused qkv with its q and k thirds in each other's place, both ways (so that reshard's own
    read-back of the export agrees with it: only the logits can tell)."""

    stacks_rows = False  # the HF tensor is no longer the slab's bytes

    def to_megatron(self, tensors, config):
        q, k, v = np.split(tensors[0], 3)
        return np.concatenate([k, q, v])

    def to_hf(self, tensor, config):
        return [self.to_megatron([tensor], config)]


def test_the_export_gives_the_originals_logits_on_an_image_and_text(source, tmp_path, monkeypatch):
    """transformers on an image and text: the HF export of a converted model gives the original's logits exactly (the
    image moves them: the check sees the vision tower); with a vision block's qkv halves swapped it does not."""
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", "--to-tp", "2", "-q")
    cli("convert", tmp_path / "m", tmp_path / "back", "--to-format", "hf", "-q")
    original = image_logits(source)
    assert torch.equal(image_logits(tmp_path / "back"), original)
    right = Qwen2_5_VL.mappings
    monkeypatch.setattr(Qwen2_5_VL, "mappings", lambda self, config: [
        QKHalvesSwapped(m.megatron, m.hf[0]) if m.megatron == "visual.blocks.0.attn.qkv.weight" else m for m in right(self, config)])
    cli("convert", tmp_path / "m", tmp_path / "wrong", "--to-format", "hf", "-q")
    assert (image_logits(tmp_path / "wrong") - original).abs().max() > 1e-3


def megatron_logits_diff(source: Path, tmp_path: Path, layout: dict) -> float:
    """Max |megatron-core's GPTModel (MRoPE) on the converted language model - transformers' language model| on the
    prompt's tokens at the 3-D positions transformers gives the image prompt (its sections differ there)."""
    target = tmp_path / "megatron"
    cli("convert", source, target, "--to-format", "torch_dist", *[f"--to-{k}={v}" for k, v in layout.items()], "--naming", "local", "-q")
    model = load(source)
    tokens = torch.tensor([PROMPT + [15], PROMPT[::-1] + [16]])
    inputs = tokens[:, :-1]
    with torch.no_grad():
        positions = torch.cat([model.model.get_rope_index(row[None], (row[None] == IMAGE).int(), image_grid_thw=torch.tensor([[1, 4, 4]]))[0]
                               for row in inputs], dim=1)
        hidden = model.model.language_model(input_ids=inputs, position_ids=positions).last_hidden_state
        expected = model.lm_head(hidden)
    assert not torch.equal(positions[0], positions[1])  # the sections see different positions
    torch.save(tokens, tmp_path / "tokens.pt")
    torch.save(positions, tmp_path / "positions.pt")
    out = tmp_path / "oracle.pt"
    args = ["--load", target, "--out", out, "--tokens", tmp_path / "tokens.pt", "--positions", tmp_path / "positions.pt",
            *[a for k, v in layout.items() for a in (f"--{k}", v)]]
    run("fixtures.megatron_oracle", args, nproc=layout.get("tp", 1) * layout.get("pp", 1), timeout=300)
    got = torch.load(out, weights_only=False)["logits"]
    assert got.shape == expected.shape == (2, 16, 250)
    return (got - expected).abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_megatron_cores_mrope_language_model_gives_transformers_logits(source, tmp_path, layout):
    assert megatron_logits_diff(source, tmp_path, layout) <= 1e-4


class KVSwapped(QKV):
    """q/k/v grouped with each group's k and v in each other's place."""

    def to_megatron(self, tensors, config):
        q, k, v = tensors
        return super().to_megatron([q, v, k], config)


SABOTAGE = {
    "qkv_regrouped_wrong": ("mappings", lambda right: lambda self, config: [
        KVSwapped(m.megatron, *m.hf) if isinstance(m, QKV) and m.megatron.endswith("weight") else m for m in right(self, config)]),
    "mrope_section_changed": ("config_from_hf", lambda right: lambda self, hf: (lambda c, e: (c.replace(mrope_section=(3, 3, 2)), e))(
        *right(self, hf))),
}


@pytest.mark.slow
@pytest.mark.parametrize("sabotage", sorted(SABOTAGE))
def test_the_oracle_sees_a_wrong_qwen2_5_vl_mapping(source, tmp_path, monkeypatch, sabotage):
    """Got wrong in a way that still loads strictly, each moves megatron-core's logits far past the tolerance."""
    method, wrap = SABOTAGE[sabotage]
    monkeypatch.setattr(Qwen2_5_VL, method, wrap(getattr(Qwen2_5_VL, method)))
    assert megatron_logits_diff(source, tmp_path, dict(tp=2)) > 1e-3


def dist_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist iteration directory, read by torch's own checkpoint reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(directory))
    entries = reader.read_metadata().state_dict_metadata.items()
    out = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in entries if isinstance(m, TensorStorageMetadata)}
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


@pytest.mark.slow
def test_reshards_checkpoint_is_bridges_own_import_and_bridge_exports_it_back(source, tmp_path, monkeypatch, capsys):
    """Megatron-Bridge's import of the same HF model equals reshard's tensor for tensor (names, shapes, values), and
    reshard reads it (its run_config.yaml) and exports the original HF model; a --config that contradicts its vision
    tower is refused; Bridge loads reshard's checkpoint, exports
    the original HF weights bit for bit and, run forward on an image and text, gives transformers' logits."""
    cli("convert", source, tmp_path / "m", "--to-format", "torch_dist", "--for", "bridge", "-q")  # its vocabulary unpadded
    bridge(source, tmp_path / "bridge")
    ours, theirs = dist_tensors(tmp_path / "m" / "iter_0000000"), dist_tensors(tmp_path / "bridge" / "ckpt" / "iter_0000000")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # Bridge's own checkpoint read by reshard from its run_config.yaml, exported: the original weights and logits
    cli("convert", tmp_path / "bridge" / "ckpt", tmp_path / "from_bridge", "--to-format", "hf", "-q")
    original, back = hf_tensors(source), hf_tensors(tmp_path / "from_bridge")
    assert back.keys() == original.keys() and all(torch.equal(original[k], back[k]) for k in original)
    assert torch.equal(image_logits(tmp_path / "from_bridge"), image_logits(source))
    wrong = json.loads((source / "config.json").read_text())
    wrong["vision_config"]["intermediate_size"] = 40
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    refused_cli(monkeypatch, capsys, ["convert", tmp_path / "bridge" / "ckpt", tmp_path / "out", "--to-format", "hf", "--config",
                                      tmp_path / "wrong.json"], "visual.blocks.0.mlp.gate_proj.weight has shape [48, 32]", "visual tower",
                untouched=(tmp_path / "bridge",))
    assert not (tmp_path / "out").exists()
    torch.save(image_inputs(), tmp_path / "inputs.pt")
    bridge(source, tmp_path / "export", "--load", tmp_path / "m" / "iter_0000000", "--logits", tmp_path / "inputs.pt")
    exported = load_file(tmp_path / "export" / "export.safetensors")
    assert exported.keys() == original.keys() and all(torch.equal(original[k], exported[k]) for k in original)
    # Bridge's own Qwen25VLModel runs on the CPU: on reshard's checkpoint it computes transformers' image-and-text logits
    assert (torch.load(tmp_path / "export" / "logits.pt") - image_logits(source)).abs().max() <= 1e-4


@pytest.mark.parametrize("change,words", [
    ({"vision_config": {"intermediate_size": 40}}, ["visual.blocks.0.mlp.gate_proj.weight", "vision_config.intermediate_size"]),
    ({"vision_config": {"depth": 1}}, ["visual.blocks.1.", "not mapped"]),
    ({"vision_config": {"out_hidden_size": 32}}, ["vision_config.out_hidden_size=32", "hidden_size 64"]),
    ({"text_config": {"rope_parameters": {"rope_type": "default", "type": "mrope", "mrope_section": [2, 2, 2]}}},
     ["mrope_section=[2, 2, 2]", "8 rotary frequencies"]),
], ids=["vision_intermediate", "vision_depth", "vision_out", "mrope_sum"])
def test_a_config_that_contradicts_the_tensors_is_refused_naming_the_field(source, tmp_path, monkeypatch, capsys, change, words):
    config = json.loads((source / "config.json").read_text())
    nested = {key: {**config[key], **value} for key, value in change.items()}
    refused_config(monkeypatch, capsys, source, tmp_path, nested, *words)


def test_a_processor_file_leading_outside_the_checkpoint_is_refused(source, tmp_path, monkeypatch, capsys):
    """A preprocessor_config.json that is a link out of the model directory: one line, nothing written."""
    model = tmp_path / "hf"
    shutil.copytree(source, model)
    (tmp_path / "secret.json").write_text("{}\n")
    (model / "preprocessor_config.json").unlink()
    (model / "preprocessor_config.json").symlink_to(tmp_path / "secret.json")
    refused_cli(monkeypatch, capsys, ["convert", model, tmp_path / "out", "--to-format", "torch_dist", "-q"],
                "preprocessor_config.json", untouched=(model,))
    assert not (tmp_path / "out").exists()
