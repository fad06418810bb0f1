"""A converted NeMo-RL step written back in NeMo-RL's layout, for NeMo-RL to resume the run at the new size: what a
conversion of a NeMo-RL run, step or step's model writes unless --to-format names another format.

What NeMo-RL's resume reads, from its source (github:NVIDIA-NeMo/RL at 7ea279abfbeb698b092856d0dab61e7cf39bc909):
- nemo_rl/utils/checkpoint.py `CheckpointManager.get_latest_checkpoint_path`: the highest `step_N` of the run's
  checkpoint directory; `load_training_info`: its `training_info.json`; `get_resume_paths`: the model's weights at
  `step_N/<policy|value>/weights`, its optimizer state embedded there when megatron-core's
  `load_common_state_dict(weights/iter_0000000)` holds an `optimizer` (NeMo-RL drives the training itself: Bridge's
  own step, hence the iteration, stays 0).
- nemo_rl/models/megatron/setup.py `_create_checkpoint_config`: Megatron-Bridge's `CheckpointConfig(load=weights,
  load_optim=<the optimizer found above>, load_rng=False, fully_parallel_load=True)`, so Bridge's `load_checkpoint`
  resolves the iteration from the weights' trackers and loads it; `_apply_parallelism_config`: the parallel sizes are
  the resumed run's own config's (`policy.megatron_cfg`), never the step's.
- Megatron-Bridge 0.6.2 training/checkpointing.py `_load_checkpoint_from_path`: the iteration's `run_config.yaml`
  says the (TP, PP) it was saved at, which must be the run's for the RNG and rerun state and a dp_reshardable
  optimizer state to load, and whether the optimizer and RNG state were saved (`checkpoint.save_optim`, `save_rng`).
- nemo_rl/data/utils.py `load_dataloader_state`: the step's `train_dataloader.pt`, and the `data` section of its
  `config.yaml` (was the dataset swapped?): the only part of config.yaml a resume reads.

So the step is written as `step_N/<model>/weights/` (`TorchDistWriter`'s Megatron tree at the target layout) with the
source iteration's `run_config.yaml` carried, its model's parallel sizes and vocabulary and its checkpoint's
save_optim and save_rng made the output's; every other file of the step (training_info.json, config.yaml untouched
since no resume reads its parallel sizes, the dataloader's state, Bridge's train-state files) copied as it is.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from reshard.config import ModelConfig
from reshard.documents import read_yaml
from reshard.errors import ReshardError
from reshard.formats import integrity
from reshard.formats.base import CommonState, Manifest, WriteOptions
from reshard.formats.megatron_dist import TorchDistWriter
from reshard.formats.megatron_tree import TRACKER, iteration_dirname
from reshard.formats.model_args import RUN_CONFIG, bridge_fields
from reshard.formats.nemo_rl import MODELS, NemoRlStep, step_of
from reshard.layout import Layout
from reshard.logical import TensorSpec
from reshard.naming import is_layout_bound
from reshard.paths import confined_tree

TRAIN_STATE = "train_state.pt"  # Megatron-Bridge's TrainState of the iteration (its step, samples, FLOPs): no layout in it
# the model section's vocabulary fields, from the run_config.yaml TorchDistWriter wrote (the rows as stored at the target TP)
_VOCABULARY = ("vocab_size", "should_pad_vocab")


def source_step(tokenizer_dir: Path | None) -> NemoRlStep | None:
    """The NeMo-RL step a conversion reads, found from its reader's `tokenizer_dir` (its iteration's tokenizer assets,
    or the weights directory), or None when the source is no NeMo-RL step's model."""
    return next((found for p in ([tokenizer_dir, *tokenizer_dir.parents] if tokenizer_dir else []) if (found := step_of(p))), None)


class NemoRlWriter(TorchDistWriter):
    """`TorchDistWriter`'s checkpoint in `step_N/<model>/weights/` of the destination, the rest of the source step
    carried beside it (see the module's docstring)."""

    def __init__(self, path: Path, config: ModelConfig, layout: Layout, specs: dict[str, TensorSpec], common: CommonState,
                 options: WriteOptions = WriteOptions(), rank: int = 0):
        source = source_step(options.tokenizer_from)
        if source is None:
            raise ReshardError("the NeMo-RL writer writes a step back from a NeMo-RL step: convert from one")
        confined_tree(source.directory)  # before a byte is written: every file carried stays in the step
        others = [name for name in MODELS if name != source.model and (source.directory / name / "weights").is_dir()]
        if others:  # carried as they are, they would stay at the old layout beside a model at the new one
            raise ReshardError(f"{source.directory} also holds NeMo-RL's {others[0]} model, which a write-back of its {source.model} "
                               f"would leave at the old layout: convert each model with --to-format torch_dist instead")
        self.source, self.run = source, path
        super().__init__(path / source.directory.name / source.model / "weights", config, layout, specs, common, options, rank)

    def finish(self, manifest: Manifest, parts: list[Any] | None = None) -> None:
        super().finish(manifest, parts)
        self._carry(self.source.directory, self.run / self.source.directory.name, {self.source.model})
        self._carry(self.source.directory / self.source.model, self.path.parent, {"weights"})
        source_weights = self.source.weights
        self._carry(source_weights, self.path, {TRACKER, *(p.name for p in source_weights.glob("iter_*"))})
        iteration = source_weights / iteration_dirname(self.common.iteration)
        if (iteration / TRAIN_STATE).is_file():
            shutil.copyfile(iteration / TRAIN_STATE, self.directory / TRAIN_STATE)
        if (iteration / RUN_CONFIG).is_file():
            self._run_config(iteration / RUN_CONFIG)
        if self.common.integrity:  # Megatron-LM's file digests, again: the two files above changed after TorchDistWriter listed them
            integrity.write(self.directory)

    @staticmethod
    def _carry(source: Path, into: Path, leave: set[str]) -> None:
        """Every entry of `source` but `leave`'s copied into `into` (links followed: `confined_tree` saw them stay in the step)."""
        into.mkdir(parents=True, exist_ok=True)
        for entry in sorted(source.iterdir()):
            if entry.name in leave:
                continue
            if entry.is_dir():  # a resumed run finishes again, over what its first try copied
                shutil.copytree(entry, into / entry.name, symlinks=False, dirs_exist_ok=True)
            else:
                shutil.copyfile(entry, into / entry.name)

    def _run_config(self, source: Path) -> None:
        """The source's run_config.yaml (Bridge's whole ConfigContainer) with what this output changed: the model's
        parallel sizes and vocabulary as `TorchDistWriter` wrote them for Bridge, and whether it holds optimizer and
        RNG state."""
        config = read_yaml(source)
        if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
            raise ReshardError(f"{source} has no model section: not the Megatron-Bridge run config NeMo-RL saves")
        written = self.directory / RUN_CONFIG
        model = read_yaml(written)["model"] if written.is_file() else {}
        config["model"].update(bridge_fields(self.layout.megatron_args()))
        config["model"].update({key: model[key] for key in _VOCABULARY if key in model})
        if isinstance(config.get("checkpoint"), dict):
            config["checkpoint"]["save_optim"] = any(spec.is_optimizer for spec in self.specs.values())
            config["checkpoint"]["save_rng"] = any(is_layout_bound(key) for key in self.common.objects)
        written.write_text(yaml.safe_dump(config, sort_keys=False))
