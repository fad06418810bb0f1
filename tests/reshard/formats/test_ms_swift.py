"""An ms-swift (Megatron-SWIFT) checkpoint is a source: the run directory (its newest checkpoint-N), or a checkpoint.
Its args hold the parallel sizes but not the architecture, which comes from the HF config.json swift saves beside
its weights or from --config; the HF model directory its args name is never followed. The oracle: the checkpoint's
weights are Megatron-LM's own save of the golden HF model (fixtures/golden), whose HF export must be that model bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fixtures.ms_swift import save_as_ms_swift
from reshard.convert import convert
from reshard.layout import Layout
from reshard.request import Target
from tests.cli import refused_cli, run_cli
from tests.reshard.formats.test_golden import GOLDEN, HF, _same_as_original

MEGATRON_LM = GOLDEN / "mlm-core-torch_dist-tp1pp1"  # Megatron-LM's save of HF (megatron-core's GPTModel names)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """The golden checkpoint at TP2: a layout only swift's args can tell the reader."""
    out = tmp_path_factory.mktemp("tp2") / "dist"
    convert(MEGATRON_LM, out, Target(format="torch_dist", layout=Layout(tp=2)))
    return out


@pytest.mark.parametrize("given", ["run", "checkpoint"])
def test_a_checkpoint_with_its_hf_config_exports_the_original_weights(tmp_path, given):
    run = tmp_path / "v0-20261127-101500"
    save_as_ms_swift(MEGATRON_LM, run, Layout(), step=1)  # older: never read
    newest = save_as_ms_swift(MEGATRON_LM, run, Layout(), step=12, hf_config=HF / "config.json")
    (run / "checkpoint-1" / "iter_0000001" / "__0_0.distcp").unlink()
    convert(run if given == "run" else newest, tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")


def test_its_layout_comes_from_swifts_args_and_its_architecture_from_config(tmp_path, monkeypatch, capsys, tp2):
    source = save_as_ms_swift(tp2, tmp_path / "run", Layout(tp=2))
    code, _ = run_cli(monkeypatch, capsys, "convert", source, tmp_path / "dist", "--to-tp", "1", "--config", HF / "config.json", "-q")
    assert code == 0
    args = torch.load(tmp_path / "dist" / "iter_0000001" / "common.pt", weights_only=False)["args"]
    assert (args.num_layers, args.tensor_model_parallel_size) == (2, 1)  # Megatron-LM's args: its loader needs them
    convert(tmp_path / "dist", tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")


def test_without_an_architecture_it_is_refused_naming_the_model(tmp_path, monkeypatch, capsys):
    """The HF model directory args.json names holds a config.json, outside the checkpoint: not followed."""
    base = tmp_path / "models" / "tiny"
    shutil.copytree(HF, base)
    source = save_as_ms_swift(MEGATRON_LM, tmp_path / "run", Layout(), model_dir=str(base))
    line = refused_cli(monkeypatch, capsys, ["convert", source, tmp_path / "hf", "--to-format", "hf", "-q"],
                       "ms-swift", str(base), "--config", untouched=(source,))
    assert "records no architecture" in line and not (tmp_path / "hf").exists()


def test_a_lora_save_is_refused_by_name(tmp_path, monkeypatch, capsys):
    source = save_as_ms_swift(MEGATRON_LM, tmp_path / "run", Layout(), tuner_type="lora", hf_config=HF / "config.json")
    refused_cli(monkeypatch, capsys, ["convert", source, tmp_path / "hf", "--to-format", "hf", "-q"],
                "ms-swift lora save", "--merge_lora", untouched=(source,))
    assert json.loads((source / "args.json").read_text())["tuner_type"] == "lora"
