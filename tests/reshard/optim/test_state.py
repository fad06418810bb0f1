"""Which moments an optimizer keeps is read from the checkpoint's args (`state.MOMENTS`): Adam's two, Lion's one, carried;
an optimizer state reshard does not decode is refused by the optimizer's name, not misread (Megatron-LM 0.18+ saves
Muon's, layer-wise, reloading at its own DP size, under `--optimizer muon`); a state holding another optimizer's
moments than its args name is refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import rewrite_args, write_synthetic
from reshard import cli
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.formats.model_args import bridge_args
from reshard.layout import Layout
from reshard.optim.state import check_states, described, state_keys
from tests.cli import run_cli


def printed(monkeypatch, capsys, *args) -> str:
    """What `reshard ARGS` prints (run in this process), having exited 0."""
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["reshard", *map(str, args)])
    try:
        cli.run()
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr().err
    return capsys.readouterr().out


def test_the_moments_are_the_optimizers_the_args_name():
    assert state_keys({}) == state_keys({"optimizer": "adam"}) == ("param", "exp_avg", "exp_avg_sq")
    assert state_keys({"optimizer": "lion"}) == ("param", "exp_avg")
    assert described({"optimizer": "lion"}) == "lion (exp_avg)"


def test_bridges_run_config_names_the_optimizer(tmp_path):
    """Megatron-Bridge records its optimizer in run_config.yaml's `optimizer:` section, which its args lack."""
    golden = Path(__file__).resolve().parents[3] / "fixtures/golden/bridge-torch_dist-tp1/iter_0000000/run_config.yaml"
    assert bridge_args(golden)["optimizer"] == "adam"
    (tmp_path / "run_config.yaml").write_text(golden.read_text().replace("\n  optimizer: adam\n", "\n  optimizer: lion\n"))
    assert state_keys(bridge_args(tmp_path / "run_config.yaml")) == ("param", "exp_avg")


@pytest.mark.parametrize("args, found, complete, said", [
    ({"optimizer": "lion"}, {"param", "exp_avg", "exp_avg_sq"}, True, "holds exp_avg_sq, which the args' --optimizer lion (exp_avg) does not keep"),
    ({"optimizer": "lion"}, {"fp32_param", "exp_avg", "exp_avg_sq"}, False, "holds exp_avg_sq, which"),
    ({"optimizer": "adam"}, {"param", "exp_avg"}, True, "holds no exp_avg_sq, which the args' --optimizer adam (exp_avg, exp_avg_sq) keeps"),
])
def test_another_optimizers_moments_are_refused_in_one_line(args, found, complete, said):
    with pytest.raises(ReshardError) as refused:
        check_states(args, found, "bucket 0", complete)
    assert said in str(refused.value) and "\n" not in str(refused.value)
    check_states(args, found - {"exp_avg_sq"} if "lion" in str(args) else found | {"exp_avg_sq"}, "bucket 0", complete)  # its own


def test_lions_state_converts_with_its_one_moment(tmp_path, monkeypatch, capsys):
    """Lion's plain per-parameter state (master weights, exp_avg) converts; `inspect` and the plan name its moment."""
    source = tmp_path / "src"
    write_synthetic(source, TINY_LLAMA, Layout(tp=2), "torch_dist", dtype="float32", optimizer=True, args={"optimizer": "lion"})
    assert "optimizer: plain, DP 1; lion (exp_avg)" in printed(monkeypatch, capsys, "inspect", source)
    plan = printed(monkeypatch, capsys, "convert", source, tmp_path / "out", "--to-tp", 1, "--dry-run").splitlines()
    assert any(line.startswith("optimizer state: ") and line.endswith("; lion (exp_avg)") for line in plan), plan
    assert run_cli(monkeypatch, capsys, "convert", source, tmp_path / "out", "--to-tp", 1, "-q")[0] == 0
    with open_checkpoint(tmp_path / "out") as out:
        states = {name.split(".")[2] for name, spec in out.specs.items() if spec.is_optimizer}
        assert states == {"fp32_param", "exp_avg"} and out.common.args["optimizer"] == "lion"


@pytest.mark.parametrize("kind", ["lion", "adam"])
def test_a_state_whose_args_name_another_optimizer_is_refused_writing_nothing(tmp_path, monkeypatch, capsys, kind):
    """Adam's state under args that say lion, and Lion's under args that say adam: one line naming the moment."""
    source = tmp_path / "src"
    saved = "adam" if kind == "lion" else "lion"
    write_synthetic(source, TINY_LLAMA, Layout(tp=2), "torch_dist", dtype="float32", optimizer=True, args={"optimizer": saved})
    rewrite_args(source, optimizer=kind)
    out = tmp_path / "out"
    code, lines = run_cli(monkeypatch, capsys, "convert", source, out, "--to-tp", 1, "--optimizer-form", "dp_reshardable", "-q")
    assert code == 1 and len(lines) == 1 and f"--optimizer {kind} (" in lines[0] and "exp_avg_sq" in lines[0], lines
    assert "--no-optimizer" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("kind,why,layer_wise", [("muon", "reloads only at the data-parallel size", False),
                                                   ("sgd", "decodes adam and lion state only", False),
                                                   ("adam --use-layer-wise-distributed-optimizer", "reloads only at the data-parallel size", True)])
def test_the_state_of_another_optimizer_is_refused_by_its_name(tmp_path, monkeypatch, capsys, kind, why, layer_wise):
    """Another optimizer's, or a decoded one's kept by megatron-core 0.19's layer-wise distributed optimizer."""
    source = tmp_path / "src"
    write_synthetic(source, TINY_LLAMA, Layout(tp=2), "torch_dist", dtype="float32", optimizer=True)
    assert run_cli(monkeypatch, capsys, "convert", source, tmp_path / "adam", "--to-tp", 1, "-q")[0] == 0  # Adam's: carried
    rewrite_args(source, optimizer=kind.split()[0], use_layer_wise_distributed_optimizer=layer_wise)
    out = tmp_path / "out"
    code, lines = run_cli(monkeypatch, capsys, "convert", source, out, "--to-tp", 1, "-q")
    assert code == 1 and len(lines) == 1 and f"--optimizer {kind}: " in lines[0] and why in lines[0] and "--no-optimizer" in lines[0]
    assert not out.exists()
    assert run_cli(monkeypatch, capsys, "convert", source, out, "--to-tp", 1, "--no-optimizer", "-q")[0] == 0
    assert not [s for s in open_checkpoint(out).specs.values() if s.is_optimizer]
