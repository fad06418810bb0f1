"""Which target format takes which optimizer form (`reshard.optim.forms`): what cannot be written is refused when
planning, in one line that names what to do, nothing written and the source untouched. The source is Megatron-LM's
own dp_reshardable save (golden `mlm-distopt-tp2dp2`, TP2 DP2)."""

from __future__ import annotations

import pytest

from fixtures.torchrun import REPO
from reshard.errors import ReshardError
from reshard.request import Target
from tests.cli import run_cli
from tests.reshard.test_cli import _digest, reshard

SOURCE = REPO / "fixtures" / "golden" / "mlm-distopt-tp2dp2" / "checkpoint"
DP = ["--optimizer-form", "dp_reshardable"]


@pytest.mark.parametrize("flags, words, not_words", [
    ([*DP, "--to-dp", "0"], ["--to-dp 0", "at least 1"], ["add --optimizer-form"]),  # issue #33: it was given
    ([*DP, "--to-dp", "-2"], ["--to-dp -2", "at least 1"], ["add --optimizer-form"]),
    (["--to-dp", "4"], ["--to-dp", "add --optimizer-form dp_reshardable"], []),  # per-parameter tensors: no DP size
    (["--to-format", "zarr", "--to-dp", "4"], ["--to-dp", "add --optimizer-form dp_reshardable"], []),
    (["--to-format", "zarr", *DP], ["torch_dist or verl form", "zarr"], []),
    (["--to-format", "legacy", *DP], ["torch_dist or verl form", "legacy"], []),
    ([*DP, "--no-optimizer"], ["drop --no-optimizer"], []),
    (["--to-format", "hf"], ["HF format holds no optimizer state", "--no-optimizer"], []),
])
def test_a_form_the_target_does_not_take_is_refused_in_one_line(tmp_path, monkeypatch, capsys, flags, words, not_words):
    before = _digest(SOURCE)
    for dry_run in ([], ["--dry-run"]):  # refused when planning: a dry run says so too
        code, lines = run_cli(monkeypatch, capsys, "convert", SOURCE, tmp_path / "out", *flags, *dry_run)
        assert code == 1 and len(lines) == 1 and lines[0].startswith("reshard: error:"), lines
        assert all(word in lines[0] for word in words) and not any(word in lines[0] for word in not_words), lines[0]
    assert not (tmp_path / "out").exists() and _digest(SOURCE) == before


def test_a_data_parallel_size_below_one_is_refused_by_the_request_itself():
    with pytest.raises(ReshardError, match="--to-dp 0: a data-parallel size is at least 1"):
        Target(optimizer_form="dp_reshardable", dp=0)


def test_a_legacy_source_takes_to_dp_without_naming_its_own_format(tmp_path, monkeypatch, capsys):
    """Legacy output holds distrib_optim.pt, which is bound to a data-parallel size: --to-dp applies whether the format
    is named or the source's (before, only `--to-format legacy` was taken for it)."""
    legacy = tmp_path / "legacy"
    assert run_cli(monkeypatch, capsys, "convert", SOURCE, legacy, "--to-format", "legacy", "-q")[0] == 0
    out = reshard("convert", legacy, tmp_path / "out", "--to-tp", "1", "--to-dp", "4", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "-> distrib_optim.pt buffers (DP 4)" in out.stdout, out.stdout
