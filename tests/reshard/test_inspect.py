"""`reshard inspect` and `reshard verify` read every pickle of a torch_dist checkpoint through the allow-list: its
reader reads the .distcp objects only when a conversion carries them, and a hostile one must be refused in one
line, not described or vouched for."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import write_synthetic
from reshard.layout import Layout
from tests.cli import run_cli
from tests.reshard.torchfile.test_payloads import KEY, _digest, _System, te_tensor
from tests.trainer.test_hostile_pickles import _into_object


@pytest.fixture()
def checkpoint(tmp_path):
    write_synthetic(tmp_path / "ckpt", TINY_LLAMA, Layout(tp=2), "torch_dist")
    return tmp_path / "ckpt"


def _iteration(checkpoint: Path) -> Path:
    return next(p for p in checkpoint.iterdir() if p.is_dir())


PLANTS = {
    "object": lambda marker: _System(marker),
    "TE pickle in an object": lambda marker: te_tensor({"extra_fp8_variables": {"hook": _System(marker)}}),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_hostile_object_is_refused_in_one_line(checkpoint, tmp_path, monkeypatch, capsys, command, plant):
    marker = tmp_path / "ran"
    _into_object(_iteration(checkpoint), PLANTS[plant](marker), prefix=KEY)
    before = _digest(checkpoint)
    code, err = run_cli(monkeypatch, capsys, command, checkpoint)
    assert code == 1 and len(err) == 1 and err[0].startswith("reshard: error:"), err
    assert "pickles posix.system," in err[0] and "__0_0.distcp" in err[0]
    assert not marker.exists() and _digest(checkpoint) == before


def test_without_the_screen_both_pass_over_it_and_torch_would_run_it(checkpoint, tmp_path, monkeypatch, capsys):
    """The defence off: inspect and verify succeed on the hostile checkpoint, and DCP's way of reading the object
    (`torch.load(weights_only=False)` of its bytes) runs the payload."""
    marker = tmp_path / "ran"
    iteration = _iteration(checkpoint)
    _into_object(iteration, _System(marker), prefix=KEY)
    monkeypatch.setattr("reshard.inspect.screen", lambda directory: None)
    for command in ("inspect", "verify"):
        assert run_cli(monkeypatch, capsys, command, checkpoint)[0] == 0
    assert not marker.exists()
    with open(iteration / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file
    info = next(v for k, v in metadata.storage_data.items() if k.fqn.startswith(KEY))
    with open(iteration / info.relative_path, "rb") as f:
        blob = os.pread(f.fileno(), info.length, info.offset)
    torch.load(io.BytesIO(blob), weights_only=False)
    assert marker.exists()


def test_a_clean_checkpoint_still_inspects_and_verifies(checkpoint, monkeypatch, capsys):
    for command in ("inspect", "verify"):
        assert run_cli(monkeypatch, capsys, command, checkpoint)[0] == 0
