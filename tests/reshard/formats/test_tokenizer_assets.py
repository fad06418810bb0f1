"""Megatron-LM 0.18+'s tokenizer assets (`--save-tokenizer-assets`: the tokenizer's files in `iter_N/tokenizer/`)
go with the weights: into an HF export, which transformers loads with the same token ids, and into the iteration
of a Megatron copy; a tokenizer directory that leads outside the checkpoint is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import AutoTokenizer

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import write_synthetic
from reshard.layout import Layout
from tests.cli import refused_by_every_command, run_cli

ITER = "iter_0000010"
TOKENIZER = Path(__file__).resolve().parents[3] / "fixtures" / "golden" / "hf-llama-tiny"
TEXT = "The quick brown fox jumps over the lazy dog."


def saved_with_assets(tmp_path: Path) -> Path:
    write_synthetic(tmp_path / "src", TINY_LLAMA, Layout(tp=2), "torch_dist", dtype="float32")
    assets = tmp_path / "src" / ITER / "tokenizer"
    assets.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, assets)
    return tmp_path / "src"


def test_the_iterations_tokenizer_goes_with_the_weights(tmp_path, monkeypatch, capsys):
    source = saved_with_assets(tmp_path)
    assert run_cli(monkeypatch, capsys, "convert", source, tmp_path / "hf", "--to-format", "hf", "-q")[0] == 0
    assert run_cli(monkeypatch, capsys, "convert", source, tmp_path / "dist", "--to-tp", 1, "-q")[0] == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (source / ITER / "tokenizer" / name).read_bytes()
        assert (tmp_path / "dist" / ITER / "tokenizer" / name).read_bytes() == (source / ITER / "tokenizer" / name).read_bytes()
    assert not (tmp_path / "dist" / "tokenizer.json").exists()
    ids = AutoTokenizer.from_pretrained(source / ITER / "tokenizer")(TEXT)["input_ids"]
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(TEXT)["input_ids"] == ids and len(ids) > 5


def test_a_tokenizer_directory_leading_outside_is_refused(tmp_path, monkeypatch, capsys):
    source = saved_with_assets(tmp_path)
    shutil.move(source / ITER / "tokenizer", tmp_path / "elsewhere")
    (source / ITER / "tokenizer").symlink_to(tmp_path / "elsewhere")
    refused_by_every_command(monkeypatch, capsys, source, tmp_path / "out", "leads outside the checkpoint", to=("--to-format", "hf"))
