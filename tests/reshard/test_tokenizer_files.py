"""The tokenizer a checkpoint was trained with goes with it through `reshard convert` (the trainer saves
tokenizer.json beside its iterations; a resumed run without it trains another, with other token ids). A file
that leads outside the checkpoint through a symlink is refused."""

import shutil
import sys

import pytest

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import write_synthetic
from reshard import cli
from reshard.layout import Layout


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
    monkeypatch.setattr(sys, "argv", ["reshard", "convert", *map(str, args), "-q"])
    try:
        cli.run()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err.strip().splitlines()


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
