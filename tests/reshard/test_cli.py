"""The command line: one-line errors, non-zero exits, sources untouched, no half-written output."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import SyntheticReader, write_synthetic
from fixtures.torchrun import pythonpath
from reshard.layout import Layout
from tests.cli import tree_digest as _digest  # also what the optimizer tests import from here

REPO = Path(__file__).resolve().parents[2]
QKV = "decoder.layers.self_attention.linear_qkv.weight"


def reshard(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=pythonpath())
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "src"
    write_synthetic(path, TINY_LLAMA, Layout(tp=2), "torch_dist", optimizer=True)
    return path


def _one_line_error(result, *words):
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error:"), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_inspect_and_json(ckpt):
    out = reshard("inspect", ckpt, "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["format"] == "torch_dist" and info["layout"] == "TP2PP1EP1" and info["has_checksums"]
    assert "linear_qkv" in reshard("inspect", ckpt).stdout


@pytest.mark.parametrize("reread", [[], ["--reread"]], ids=["written-records", "reread"])
def test_convert_then_verify(ckpt, tmp_path, reread):
    out = reshard("convert", ckpt, tmp_path / "tp4", "--tp", 2, "--to-tp", 1, "--to-pp", 2, *reread)
    assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert reshard("verify", tmp_path / "tp4").returncode == 0
    assert reshard("verify", tmp_path / "tp4", "--against", ckpt).returncode == 0


@pytest.mark.parametrize(
    "args, words",
    [
        (["convert", "{missing}", "{out}"], ["does not exist"]),
        (["convert", "{empty}", "{out}"], ["not a checkpoint"]),
        (["convert", "{src}", "{out}", "--to-tp", "3"], ["does not divide", "attention heads"]),
        (["convert", "{src}", "{out}", "--to-tp", "4"], ["2 query groups"]),
        (["convert", "{src}", "{out}", "--to-pp", "3"], ["layers"]),
        # stages that cannot exist (Megatron-Core's TransformerConfig refuses each: tests/reshard/test_layout.py)
        (["convert", "{src}", "{out}", "--to-pp", "2", "--first-stage-layers", "-1"], ["first pipeline stage of -1 layers"]),
        (["convert", "{src}", "{out}", "--to-pp", "2", "--first-stage-layers", "0"], ["--first-stage-layers", "at least one layer"]),
        (["convert", "{src}", "{out}", "--to-pp", "2", "--last-stage-layers", "0"], ["--last-stage-layers", "at least one layer"]),
        (["convert", "{src}", "{out}", "--to-pp", "4", "--first-stage-layers", "2", "--last-stage-layers", "2"],
         ["4 layers cannot be split as first=2, last=2 over PP=4", "the middle ones alike"]),
        (["convert", "{src}", "{out}", "--to-ep", "2"], ["mixture-of-experts"]),
        (["convert", "{src}", "{out}", "--tp", "4"], ["TP=2, not 4"]),
        (["convert", "{src}", "{out}", "--to-format", "legacy"], ["--no-optimizer"]),
        (["convert", "{src}", "{src}"], ["same directory"]),
        (["convert", "{src}", "{src}/out"], ["inside the source"]),
        (["convert", "{src}", "{out}", "--vocab-size", "200"], ["records a vocabulary of 250", "drop --vocab-size"]),
        (["convert", "{src}", "{parent}", "--overwrite"], ["contains the source"]),  # replacing it would delete the source
        (["verify", "{empty}"], ["not a checkpoint"]),
    ],
)
def test_bad_input_gets_one_line_and_nothing_written(ckpt, tmp_path, args, words):
    (tmp_path / "empty").mkdir()
    names = {"src": ckpt, "out": tmp_path / "out", "missing": tmp_path / "nope", "empty": tmp_path / "empty",
             "parent": ckpt.parent}
    before = _digest(ckpt)
    result = reshard(*[a.format(**names) for a in args])
    _one_line_error(result, *words)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.reshard-*"))
    assert _digest(ckpt) == before


def test_existing_destination_needs_overwrite(ckpt, tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_text("precious")
    _one_line_error(reshard("convert", ckpt, dest, "--to-tp", 1), "--overwrite")
    assert (dest / "keep.txt").read_text() == "precious"
    assert reshard("convert", ckpt, dest, "--to-tp", 1, "--overwrite").returncode == 0
    assert not (dest / "keep.txt").exists() and (dest / "latest_checkpointed_iteration.txt").exists()


def _flip_a_bit_in_data(path: Path, values) -> None:
    """Flip one bit inside the stored bytes of `values` (found by content, not by our own offsets)."""
    data = bytearray(path.read_bytes())
    at = data.find(values.tobytes())
    assert at >= 0
    data[at + 5] ^= 0x10
    path.write_bytes(bytes(data))


def test_flipped_bit_is_found_by_verify_and_refused_by_convert(ckpt, tmp_path):
    copy = tmp_path / "copy"
    assert reshard("convert", ckpt, copy).returncode == 0
    layer = SyntheticReader(TINY_LLAMA, Layout(tp=2), optimizer=True).read(QKV, ((2, 3), (64, 128), (0, 64)))
    _flip_a_bit_in_data(copy / "iter_0000010" / "__1_0.distcp", layer)  # TP rank 1's share of layer 2
    result = reshard("verify", copy)
    assert result.returncode == 1 and f"differ (first: {QKV})" in result.stdout
    _one_line_error(reshard("convert", copy, tmp_path / "out", "--to-tp", 1), "does not match the checksums recorded")
    assert not (tmp_path / "out").exists()


def test_truncated_shard_is_reported(ckpt, tmp_path):
    copy = tmp_path / "copy"
    assert reshard("convert", ckpt, copy).returncode == 0
    shard = copy / "iter_0000010" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    _one_line_error(reshard("convert", copy, tmp_path / "out"), "truncated")
    assert not (tmp_path / "out").exists()


def test_missing_legacy_rank_file_is_reported(tmp_path):
    write_synthetic(tmp_path / "leg", TINY_LLAMA, Layout(tp=2), "legacy")
    (tmp_path / "leg" / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    _one_line_error(reshard("inspect", tmp_path / "leg"), "mp_rank_01", "missing")


@pytest.mark.parametrize("damage, words", [
    (lambda blob: blob[: len(blob) // 2], ("model_optim_rng.pt", "the checkpoint is damaged")),  # truncated: no zip directory
    (lambda blob: pickle.dumps({"args": None}), ("not a zip-format torch.save file", "newer torch")),  # torch < 1.6's format
], ids=["truncated", "pre-zip"])
def test_a_damaged_or_old_legacy_rank_file_is_reported(tmp_path, damage, words):
    write_synthetic(tmp_path / "leg", TINY_LLAMA, Layout(tp=2), "legacy")
    rank_file = tmp_path / "leg" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    rank_file.write_bytes(damage(rank_file.read_bytes()))
    _one_line_error(reshard("convert", tmp_path / "leg", tmp_path / "out", "--to-tp", 1), *words)
    assert not (tmp_path / "out").exists()


def test_a_full_disk_is_the_users_to_fix_not_an_internal_error(ckpt, tmp_path, monkeypatch, capsys):
    import errno
    import sys

    from reshard import cli

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / ".out.reshard-partial" / "__0_0.distcp"))

    monkeypatch.setattr("reshard.convert.convert", full)
    monkeypatch.setattr(sys, "argv", ["reshard", "convert", str(ckpt), str(tmp_path / "out"), "-q"])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("reshard: error: No space left on device:") and "free space" in lines[0]
