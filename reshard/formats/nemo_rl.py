"""Where NeMo-RL keeps a Megatron model it trained: `<checkpoint_dir>/step_N/<policy|value>/weights/`, a Megatron-Bridge
save directory (`iter_*/` with `run_config.yaml`), beside the step's `training_info.json` and `config.yaml`
(nemo_rl/utils/checkpoint.py). A save in progress is `tmp_step_N`, renamed to `step_N` once complete.

Any of the run's directory, a step or a step's model names the Bridge save inside, which is read as any other; a
conversion writes the step back in NeMo-RL's layout unless told another format (`reshard.formats.nemo_rl_writer`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from reshard.errors import ReshardError

TRAINING_INFO = "training_info.json"  # what NeMo-RL's CheckpointManager writes first in every step
_STEP = re.compile(r"step_(\d+)")
MODELS = ("policy", "value")  # value: PPO's critic


def _finished(step: Path) -> None:
    if step.name.startswith("tmp_step_"):
        raise ReshardError(f"{step} is a NeMo-RL save still in progress (renamed to {step.name[4:]} once complete); "
                           "convert a finished step_N")


def weights_dir(path: Path) -> Path:
    """The Bridge save directory `path` names as a NeMo-RL run, step or step's model; `path` itself otherwise."""
    if not path.is_dir():
        return path
    if path.name in MODELS and (path.parent / TRAINING_INFO).is_file() and (path / "weights").is_dir():
        _finished(path.parent)
        return path / "weights"
    if (path / TRAINING_INFO).is_file():
        _finished(path)
        models = [name for name in MODELS if (path / name / "weights").is_dir()]
        if len(models) > 1:
            raise ReshardError(f"{path} holds NeMo-RL's {' and '.join(models)} models; give {path / models[0]} or {path / models[1]}")
        if not models:
            raise ReshardError(f"{path} is a NeMo-RL step without Megatron weights (no policy/weights/): it was saved by another backend")
        return path / models[0] / "weights"
    steps = [(int(m.group(1)), p) for p in path.iterdir() if (m := _STEP.fullmatch(p.name)) and (p / TRAINING_INFO).is_file()]
    return weights_dir(max(steps)[1]) if steps else path  # the run: its newest step, as NeMo-RL resumes from


@dataclass(frozen=True)
class NemoRlStep:
    """A finished NeMo-RL step holding one Megatron model's Bridge save."""

    directory: Path  # step_N
    model: str  # policy, or value

    @property
    def weights(self) -> Path:
        return self.directory / self.model / "weights"


def step_of(weights: Path) -> NemoRlStep | None:
    """The finished NeMo-RL step whose model's Bridge save is `weights`, or None."""
    model, directory = weights.parent, weights.parent.parent
    if weights.name == "weights" and model.name in MODELS and _STEP.fullmatch(directory.name) and (directory / TRAINING_INFO).is_file():
        return NemoRlStep(directory, model.name)
    return None
