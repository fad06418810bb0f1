"""The tokenizer a checkpoint was trained with goes with it through `reshard convert` (the trainer saves
tokenizer.json beside its iterations; a resumed run without it trains another, with other token ids). A file
that leads outside the checkpoint through a symlink is refused."""

import shutil

import pytest
import torch

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import write_synthetic
from reshard.layout import Layout
from tests.cli import run_cli


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "ckpt"
    write_synthetic(path, TINY_LLAMA, Layout(tp=2), "torch_dist")
    (path / "tokenizer.json").write_text('{"model": "ours"}')
    (path / "kept").mkdir()
    (path / "kept" / "config.json").write_text('{"inside": true}')
    (path / "tokenizer_config.json").symlink_to("kept/config.json")  # inside the checkpoint: followed
    return path


def _convert(monkeypatch, capsys, *args) -> tuple[int, list[str]]:
    return run_cli(monkeypatch, capsys, "convert", *args, "-q")


def test_tokenizer_files_go_with_every_format(source, tmp_path, monkeypatch, capsys):
    """torch_dist -> zarr -> legacy -> torch_dist at another layout: each output holds the same files."""
    steps = [("zarr", ["--to-format", "zarr"]), ("legacy", ["--to-format", "legacy", "--to-tp", 1]),
             ("dist", ["--to-format", "torch_dist", "--to-pp", 2])]
    previous = source
    for name, flags in steps:
        code, lines = _convert(monkeypatch, capsys, previous, tmp_path / name, *flags)
        assert code == 0, lines
        assert (tmp_path / name / "tokenizer.json").read_text() == '{"model": "ours"}'
        assert (tmp_path / name / "tokenizer_config.json").read_text() == '{"inside": true}'
        assert not (tmp_path / name / "tokenizer_config.json").is_symlink()
        previous = tmp_path / name


def test_a_tokenizer_file_leading_outside_the_checkpoint_is_refused(source, tmp_path, monkeypatch, capsys):
    ckpt = shutil.copytree(source, tmp_path / "ckpt", symlinks=True)
    (tmp_path / "secret").write_text("not the checkpoint's")
    (ckpt / "tokenizer_config.json").unlink()
    (ckpt / "tokenizer_config.json").symlink_to(tmp_path / "secret")
    code, lines = _convert(monkeypatch, capsys, ckpt, tmp_path / "out")
    assert code == 1 and len(lines) == 1 and "leads outside the checkpoint" in lines[0], lines
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_an_export_takes_tokenizer_files_from_the_checkpoint_never_from_a_directory_its_args_name(source, tmp_path, monkeypatch, capsys):
    """A checkpoint's args name directories (`tokenizer_model`, `hf_source`: where an import came from); a hostile
    one names another model's. The HF export carries the checkpoint's own tokenizer files and nothing from there."""
    elsewhere = tmp_path / "other-model"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    (elsewhere / "tokenizer.model").write_text("someone else's")
    (elsewhere / "special_tokens_map.json").write_text("{}")
    ckpt = shutil.copytree(source, tmp_path / "ckpt", symlinks=True)
    code, lines = _convert(monkeypatch, capsys, ckpt, tmp_path / "named", "--to-format", "torch_dist")
    assert code == 0, lines
    common = next((tmp_path / "named").glob("iter_*/common.pt"))
    state = torch.load(common, weights_only=False)
    state["args"].tokenizer_model = state["args"].hf_source = str(elsewhere)
    torch.save(state, common)
    code, lines = _convert(monkeypatch, capsys, tmp_path / "named", tmp_path / "hf", "--to-format", "hf")
    assert code == 0, lines
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == '{"model": "ours"}'
    assert not (tmp_path / "hf" / "tokenizer.model").exists() and not (tmp_path / "hf" / "special_tokens_map.json").exists()
