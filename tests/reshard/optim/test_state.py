"""An optimizer state reshard does not decode is refused by the optimizer's name, not misread: Megatron-LM 0.18+
saves Lion's (one moment) and Muon's (layer-wise, reloads at its own DP size) under `--optimizer lion|muon`."""

from __future__ import annotations

import pytest

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import rewrite_args, write_synthetic
from reshard.formats import open_checkpoint
from reshard.layout import Layout
from tests.cli import run_cli


@pytest.mark.parametrize("kind,why", [("lion", "Lion keeps one moment"), ("muon", "reloads only at the data-parallel size"),
                                      ("sgd", "decodes Adam's state only")])
def test_the_state_of_another_optimizer_is_refused_by_its_name(tmp_path, monkeypatch, capsys, kind, why):
    source = tmp_path / "src"
    write_synthetic(source, TINY_LLAMA, Layout(tp=2), "torch_dist", dtype="float32", optimizer=True)
    assert run_cli(monkeypatch, capsys, "convert", source, tmp_path / "adam", "--to-tp", 1, "-q")[0] == 0  # Adam's: carried
    rewrite_args(source, optimizer=kind)
    out = tmp_path / "out"
    code, lines = run_cli(monkeypatch, capsys, "convert", source, out, "--to-tp", 1, "-q")
    assert code == 1 and len(lines) == 1 and f"--optimizer {kind}: " in lines[0] and why in lines[0] and "--no-optimizer" in lines[0]
    assert not out.exists()
    assert run_cli(monkeypatch, capsys, "convert", source, out, "--to-tp", 1, "--no-optimizer", "-q")[0] == 0
    assert not [s for s in open_checkpoint(out).specs.values() if s.is_optimizer]
