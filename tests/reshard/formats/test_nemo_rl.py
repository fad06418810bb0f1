"""A NeMo-RL run is a source without flags: the run's directory (its newest finished step), a step, or a step's
policy, each names the Megatron-Bridge save in `step_N/policy/weights/` (nemo_rl/utils/checkpoint.py and
megatron_policy_worker.save_checkpoint: Bridge's save_checkpoint into that directory). The save here is the one
Megatron-Bridge wrote itself (fixtures/golden/bridge-torch_dist-tp2); its HF export must be the HF model Bridge
imported, bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reshard.convert import convert
from reshard.request import Target
from tests.cli import refused_by_every_command
from tests.reshard.formats.test_golden import GOLDEN, _same_as_original


def step(run: Path, n: int, models=("policy",), prefix="step_") -> Path:
    """A step as NeMo-RL's CheckpointManager and Megatron policy worker leave it."""
    directory = run / f"{prefix}{n}"
    directory.mkdir(parents=True)
    (directory / "training_info.json").write_text(json.dumps({"step": n, "consumed_samples": 8 * n}))
    (directory / "config.yaml").write_text("policy:\n  megatron_cfg:\n    enabled: true\n")
    for model in models:
        shutil.copytree(GOLDEN / "bridge-torch_dist-tp2", directory / model / "weights")
    return directory


@pytest.mark.parametrize("given", ["run", "step", "policy"])
def test_a_nemo_rl_run_exports_the_weights_bridge_saved(tmp_path, given):
    run = tmp_path / "run"
    step(run, 1)
    newest = step(run, 12)
    step(run, 20, prefix="tmp_step_")  # a save in progress: not the newest finished step
    for other in ("step_1", "tmp_step_20"):  # never read: a damaged file in either would fail the conversion
        (run / other / "policy" / "weights" / "iter_0000000" / "__0_0.distcp").unlink()
    source = {"run": run, "step": newest, "policy": newest / "policy"}[given]
    convert(source, tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")


def test_a_save_in_progress_or_two_models_are_refused(tmp_path, monkeypatch, capsys):
    unfinished = step(tmp_path / "run", 4, prefix="tmp_step_")
    refused_by_every_command(monkeypatch, capsys, unfinished, tmp_path / "out", "NeMo-RL save still in progress", "step_4",
                             to=("--to-format", "hf"))
    ppo = step(tmp_path / "ppo", 2, models=("policy", "value"))
    refused_by_every_command(monkeypatch, capsys, ppo, tmp_path / "out", "policy and value", str(ppo / "policy"), to=("--to-format", "hf"))
