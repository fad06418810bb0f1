"""slime (and miles) save with Megatron-LM's own save_checkpoint, with slime's arguments among Megatron-LM's in the
`args` of common.pt or each rank file: among them `eval_datasets`, a list of slime's `EvalDatasetConfig` objects
(slime/utils/arguments.py `_resolve_eval_datasets`). A class off the allow-list in an argument is the run's, not
the model's: the argument is dropped and said so, and the checkpoint converts (to HF: the original weights bit
for bit). The same class anywhere else is still refused.

Resharded in Megatron-LM's layout, a slime checkpoint resumes slime, which reads nothing of its own from it
(github:THUDM/slime at 624b824a898ab0ec1fcb4d373004c7f3852bf515): slime/backends/megatron_utils/checkpoint.py
`load_checkpoint` hands a directory holding Megatron-LM's tracker (or an iter_NNNNNNN) to Megatron-LM's own
`load_checkpoint`, under slime's command-line args (slime sets no --use-checkpoint-args), else loads it as HF weights;
model.py `initialize_model_and_optimizer` returns the iteration loaded, where actor.py resumes the rollouts (+1). Of the
common state, Megatron-LM's load_checkpoint (github:NVIDIA/Megatron-LM at d98e8a64ddf34856e74b24714e3bedb2f5a39553,
megatron/training/checkpointing.py) reads the iteration, the FLOPs so far, and of the args `check_checkpoint_args`'
fields and the samples consumed (`MEGATRON_LM_READS`); the model, optimizer and RNG state it loads as from any
Megatron-LM checkpoint, which test_golden.py's `test_megatron_lm_loads_reshards_torch_dist_at_tp2_pp2` proves of
reshard's torch_dist output."""

from __future__ import annotations

import dataclasses
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from megatron.core.safe_globals import register_safe_globals

from reshard import cli
from tests.cli import refused_by_every_command
from tests.reshard.formats.test_golden import GOLDEN, _same_as_original

# what Megatron-LM's load_checkpoint reads of a checkpoint's args on resume (check_checkpoint_args, the samples consumed)
MEGATRON_LM_READS = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding", "max_position_embeddings",
                     "make_vocab_size_divisible_by", "tokenizer_type", "consumed_train_samples", "skipped_train_samples",
                     "consumed_valid_samples")
COMMON = {"torch_dist": "iter_0000001/common.pt", "legacy": "iter_0000001/mp_rank_00/model_optim_rng.pt"}


@pytest.fixture
def slime_class(monkeypatch):
    """slime's EvalDatasetConfig, importable by its own name while the fixture pickles it (slime is not installed)."""

    @dataclasses.dataclass
    class EvalDatasetConfig:
        name: str
        path: str
        n_samples_per_eval_prompt: int = 16

    EvalDatasetConfig.__module__, EvalDatasetConfig.__qualname__ = "slime.utils.eval_config", "EvalDatasetConfig"
    for name in ("slime", "slime.utils", "slime.utils.eval_config"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["slime.utils.eval_config"].EvalDatasetConfig = EvalDatasetConfig
    return EvalDatasetConfig


def saved_by_slime(tmp_path, fmt, slime_class, where="args"):
    """The golden Megatron-LM checkpoint with slime's arguments added, as slime's save leaves them (`where`: or
    the same object beside the args, where no argument holds it)."""
    source = tmp_path / "slime"
    shutil.copytree(GOLDEN / f"mlm-core-{fmt}-tp1pp1", source)
    path = source / COMMON[fmt]
    state = torch.load(path, weights_only=False)  # the fixture's own copy of a golden file
    datasets = [slime_class("aime", "/data/aime.jsonl"), slime_class("gpqa", "/data/gpqa.jsonl", 4)]
    state["args"].rollout_batch_size, state["args"].hf_checkpoint = 32, "/models/Qwen3-4B"
    if where == "args":
        state["args"].eval_datasets = datasets
    else:
        state["eval_datasets"] = datasets
    torch.save(state, path)
    return source


def converted(monkeypatch, capsys, *args) -> str:
    """`reshard convert ARGS` run as a user runs it; what it printed."""
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["reshard", "convert", *map(str, args)])
    cli.run()
    return capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_a_slime_checkpoint_converts_without_the_runs_objects(tmp_path, monkeypatch, capsys, slime_class, fmt):
    source = saved_by_slime(tmp_path, fmt, slime_class)
    monkeypatch.delitem(sys.modules, "slime.utils.eval_config")  # what reshard reads must not need slime
    dropped = "args.eval_datasets (slime.utils.eval_config.EvalDatasetConfig)"
    assert dropped in converted(monkeypatch, capsys, source, tmp_path / "hf", "--to-format", "hf")
    _same_as_original(tmp_path / "hf")
    assert dropped in converted(monkeypatch, capsys, source, tmp_path / "dist", "--to-format", "torch_dist")
    register_safe_globals()  # as Megatron-LM 0.18+ loads it: no slime class is left
    args = torch.load(tmp_path / "dist" / "iter_0000001" / "common.pt", weights_only=True)["args"]
    assert not hasattr(args, "eval_datasets") and (args.rollout_batch_size, args.hf_checkpoint) == (32, "/models/Qwen3-4B")


def test_the_same_class_outside_the_args_is_refused(tmp_path, monkeypatch, capsys, slime_class):
    source = saved_by_slime(tmp_path, "torch_dist", slime_class, where="beside")
    refused_by_every_command(monkeypatch, capsys, source, tmp_path / "out", "slime.utils.eval_config.EvalDatasetConfig",
                             "not on reshard's list", to=("--to-format", "hf"))


class _Runs:
    """A class whose unpickling calls a function (REDUCE), as a hostile pickle runs `os.system`."""

    def __reduce__(self):
        return (sys.modules["slime.utils.eval_config"].launch, ("echo pwned",))


def test_a_function_called_in_an_argument_is_refused(tmp_path, monkeypatch, capsys, slime_class):
    """Only an instance built as pickle builds any object is dropped: an argument that calls a function off the
    list when unpickled is refused, as it was, and so is a function held as an argument's value."""
    module = sys.modules["slime.utils.eval_config"]

    def launch(command):
        return command

    launch.__module__, launch.__qualname__ = "slime.utils.eval_config", "launch"
    module.launch = launch
    for value, name in ((_Runs(), "calls"), (launch, "function")):
        source = saved_by_slime(tmp_path / name, "torch_dist", slime_class)
        path = source / COMMON["torch_dist"]
        state = torch.load(path, weights_only=False)
        state["args"].on_rollout = value
        torch.save(state, path)
        refused_by_every_command(monkeypatch, capsys, source, tmp_path / name / "out", "slime.utils.eval_config.launch",
                                 "not on reshard's list", to=("--to-format", "hf"))


def _is_megatron_checkpoint(path: Path) -> bool:
    """slime/backends/megatron_utils/checkpoint.py's `_is_megatron_checkpoint`, to the letter: else slime loads HF weights."""
    return (Path(path) / "latest_checkpointed_iteration.txt").is_file() or bool(re.fullmatch(r"iter_\d{7}", Path(path).name))


def test_a_resharded_slime_checkpoint_holds_what_slimes_resume_reads(tmp_path, monkeypatch, capsys, slime_class):
    """At TP2, the output is what slime hands Megatron-LM's load_checkpoint, with the source's iteration (where slime's
    rollouts resume), FLOPs and every argument that load reads, as torch loads both. The control: without the tracker,
    slime would take the same directory for HF weights."""
    source = saved_by_slime(tmp_path, "torch_dist", slime_class)
    converted(monkeypatch, capsys, source, tmp_path / "out", "--to-tp", "2")
    assert _is_megatron_checkpoint(tmp_path / "out")
    register_safe_globals()  # as Megatron-LM 0.18+ loads it
    ours = torch.load(tmp_path / "out" / COMMON["torch_dist"], weights_only=True)
    theirs = torch.load(source / COMMON["torch_dist"], weights_only=False)
    assert ours["iteration"] == theirs["iteration"] == 1 and ours["args"].tensor_model_parallel_size == 2
    assert ours.get("num_floating_point_operations_so_far") == theirs.get("num_floating_point_operations_so_far")
    assert all(hasattr(theirs["args"], name) for name in MEGATRON_LM_READS)
    assert [getattr(ours["args"], name, None) for name in MEGATRON_LM_READS] == [getattr(theirs["args"], name) for name in MEGATRON_LM_READS]
    (tmp_path / "out" / "latest_checkpointed_iteration.txt").unlink()
    assert not _is_megatron_checkpoint(tmp_path / "out")
