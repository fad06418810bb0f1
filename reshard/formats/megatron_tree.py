"""The directory tree Megatron-LM saves into: `latest_checkpointed_iteration.txt` and `iter_NNNNNNN/`."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.errors import ReshardError
from reshard.formats import ms_swift, nemo_rl
from reshard.paths import confined

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


@dataclass(frozen=True)
class MegatronTree:
    root: Path  # the --save directory
    iteration_dir: Path  # the one checkpoint inside it
    iteration: int | str  # int, or "release"


# Megatron-LM 0.18+ (`--save-tokenizer-assets`) saves the tokenizer's files in the iteration, beside its weights.
TOKENIZER_ASSETS = "tokenizer"


def tokenizer_dir(tree: MegatronTree) -> Path:
    """Where the tokenizer these weights were trained with lies: the iteration's own assets, else the save
    directory (where reshard's trainer keeps tokenizer.json)."""
    assets = tree.iteration_dir / TOKENIZER_ASSETS
    return confined(tree.iteration_dir, TOKENIZER_ASSETS) if assets.is_dir() else tree.root


def iteration_dirname(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def locate(path: Path) -> MegatronTree | None:
    """Find the checkpoint in a save directory (via its tracker file) or an iteration directory, or a NeMo-RL or ms-swift run's."""
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text != "release" and not text.isdigit():
            raise ReshardError(f"{tracker} holds {text!r}, not an iteration number: the tracker file is damaged")
        iteration: int | str = text if text == "release" else int(text)
        directory = path / iteration_dirname(iteration)
        if not directory.is_dir():
            raise ReshardError(f"{tracker} points at {directory.name}, which does not exist: the checkpoint is incomplete")
        return MegatronTree(path, directory, iteration)
    match = _ITER_DIR.match(path.name)
    if match or path.name == "release":
        return MegatronTree(path.parent, path, int(match.group(1)) if match else "release")
    candidates = sorted(p for p in path.iterdir() if p.is_dir() and _ITER_DIR.match(p.name)) if path.is_dir() else []
    if candidates:
        newest = candidates[-1]
        return MegatronTree(path, newest, int(newest.name[5:]))
    if (path / ".metadata").is_file():  # a bare dist_checkpointing.save directory: no tracker, no iteration
        return MegatronTree(path, path, 0)
    # last: they list the directory, which an iteration's holds thousands of files
    inside = next((found for found in (nemo_rl.weights_dir(path), ms_swift.checkpoint_dir(path)) if found != path), None)
    return locate(inside) if inside is not None else None


def stored_iteration(iteration: int | str) -> int:
    """The int a checkpoint's files hold: 0 for a release checkpoint (what Megatron-LM's read_metadata makes of
    a `release` tracker; its tools/checkpoint loaders take the int from the files)."""
    return 0 if iteration == "release" else int(iteration)


def found_iteration(tree: MegatronTree, stored: Any) -> int | str:
    """The iteration of a checkpoint: its files' int, or "release" for a `release` directory (whatever it stores)."""
    return "release" if tree.iteration == "release" else stored


def write_tracker(root: Path, iteration: int | str) -> None:
    (root / TRACKER).write_text(f"{iteration}\n")


def args_dict(args: Any) -> dict[str, Any]:
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    if isinstance(args, dict):
        return dict(args)
    raise ReshardError("checkpoint has no Megatron `args`; cannot tell the model's architecture")


def args_namespace(args: dict[str, Any]) -> argparse.Namespace:
    return argparse.Namespace(**args)
