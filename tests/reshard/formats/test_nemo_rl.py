"""A NeMo-RL run is a source without flags: the run's directory (its newest finished step), a step, or a step's
policy, each names the Megatron-Bridge save in `step_N/policy/weights/` (nemo_rl/utils/checkpoint.py and
megatron_policy_worker.save_checkpoint: Bridge's save_checkpoint into that directory). The save here is the one
Megatron-Bridge wrote itself (fixtures/golden/bridge-torch_dist-tp2); its HF export must be the HF model Bridge
imported, bit for bit. Converted without --to-format, a step is written back as a NeMo-RL step at the new layout
(`reshard.formats.nemo_rl_writer`), which Megatron-Bridge 0.6.2 resumes as NeMo-RL's Megatron policy resumes it
(fixtures/bridge_nemo_rl_resume.py), its DistributedOptimizer's state with it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.request import LayoutChange, Target
from tests.bridge import bridge
from tests.cli import refused_by_every_command
from tests.converters.hf_models import build
from tests.reshard.formats.test_golden import GOLDEN, HF, _same_as_original
from tests.reshard.optim.test_dp_reshardable import assert_same, optimizer_tensors


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


def carried_step(tmp_path: Path) -> tuple[Path, Path]:
    """A run whose newest step also holds the dataloader's state NeMo-RL saves beside the model (opaque bytes here), and
    that step's directory."""
    run = tmp_path / "run"
    step(run, 3)
    newest = step(run, 12)
    (newest / "train_dataloader.pt").write_bytes(bytes(range(256)))
    (newest / "policy" / "tokenizer").mkdir()  # what NeMo-RL's GRPO, DPO and PPO save beside the policy's weights
    (newest / "policy" / "tokenizer" / "tokenizer_config.json").write_text("{}")
    return run, newest


@pytest.mark.slow  # Megatron-Bridge's load, in its own venv
def test_a_resharded_nemo_rl_step_is_resumed_by_bridge_as_nemo_rl_resumes_it(tmp_path):
    """Written back at TP1 from Bridge's TP2 save, the step is the one NeMo-RL resumes, Bridge's load_checkpoint loads
    it into the TP1 model with the weights transformers saved, bit for bit, and its run_config.yaml records the run's
    (TP, PP), as Bridge checks on resume; the step's other files are the source's. The control: the same output with two
    embedding rows swapped in its files gives Bridge another model."""
    run, source = carried_step(tmp_path)
    convert(run, tmp_path / "out", Target(layout=LayoutChange(tp=1)))
    written = tmp_path / "out" / "step_12"
    swapped = tmp_path / "swapped"
    shutil.copytree(tmp_path / "out", swapped)
    _swap_embedding_rows(swapped / "step_12" / "policy" / "weights" / "iter_0000000")
    bridge(HF, tmp_path / "out", tmp_path / "resumed", swapped, tmp_path / "control", script="bridge_nemo_rl_resume.py")
    resumed = json.loads((tmp_path / "resumed" / "resume.json").read_text())
    assert resumed == {"step": "step_12", "iteration": 0, "train_state_step": 0, "optimizer": False, "recorded_tp_pp": [1, 1]}
    _same_as_original(tmp_path / "resumed")
    with pytest.raises(AssertionError, match="model.embed_tokens.weight"):
        _same_as_original(tmp_path / "control")
    for name in ("training_info.json", "config.yaml", "train_dataloader.pt"):
        assert (written / name).read_bytes() == (source / name).read_bytes(), name


def _swap_embedding_rows(iteration: Path) -> None:
    """Rows 0 and 1 of the embedding, found in the output's files by the bytes transformers saved them as, swapped."""
    from safetensors.numpy import load_file

    rows = load_file(HF / "model.safetensors")["model.embed_tokens.weight"][:2]
    first, second = rows[0].tobytes(), rows[1].tobytes()
    _replace_in_files(iteration, first + second, second + first)


def _replace_in_files(iteration: Path, old: bytes, new: bytes) -> None:
    """`old`, found whole in one of the iteration's files, replaced by `new` (as long)."""
    for path in iteration.glob("*.distcp"):
        data = bytearray(path.read_bytes())
        at = data.find(old)
        if at >= 0:
            data[at:at + len(old)] = new
            path.write_bytes(bytes(data))
            return
    raise AssertionError("the bytes are not stored whole in the output")


# Bridge's Qwen2.5-VL trained by megatron-core's DistributedOptimizer, saved in both forms (tests/reshard/optim/test_vl_order.py)
VL_OPTIM = GOLDEN / "bridge-qwen2_5_vl-distopt"
SHIFTED = "optimizer.state.exp_avg.language_model.decoder.final_layernorm.weight"  # the control's moment


@pytest.mark.slow  # Megatron-Bridge's save on 2 ranks and its load, in its own venv
def test_a_nemo_rl_steps_optimizer_state_written_back_at_dp1_is_resumed_by_bridge_as_saved(tmp_path):
    """NeMo-RL's Megatron policy saves the DistributedOptimizer's state in its step and resumes it. The state of Bridge's
    Qwen2.5-VL trained two Adam steps at TP1 DP2 (fixtures/bridge_vl_distrib_optim.py), saved as NeMo-RL's step_4 by
    megatron-core (dp_reshardable: buckets of the DP2 optimizer), is written back at DP1 in the same form; Bridge's
    load_checkpoint with NeMo-RL's settings loads model and optimizer into the DP1 run, and megatron-core's re-save of
    what it loaded is megatron-core's own fully_reshardable save of the trained state: all 120 tensors (moments and fp32
    master weights, which are the model's weights) bit for bit, and the param groups with their step count. The
    control: one moment of the output rolled by one element is loaded as such and differs there."""
    hf = build("qwen2_5_vl", tmp_path / "hf")
    source = step(tmp_path / "run", 4, models=())
    bridge(hf, "--place", VL_OPTIM / "dp" / "iter_0000002", source / "policy" / "weights", script="bridge_nemo_rl_resume.py")
    convert(tmp_path / "run", tmp_path / "out", Target(optimizer_form="dp_reshardable", dp=1))
    saved, saved_common = optimizer_tensors(VL_OPTIM / "full")
    shifted = tmp_path / "shifted"
    shutil.copytree(tmp_path / "out", shifted)
    moment = saved[SHIFTED].tobytes()
    _replace_in_files(shifted / "step_4" / "policy" / "weights" / "iter_0000000", moment, moment[4:] + moment[:4])
    bridge(hf, tmp_path / "out", tmp_path / "resumed", shifted, tmp_path / "control", "--optimizer", script="bridge_nemo_rl_resume.py")
    resumed = json.loads((tmp_path / "resumed" / "resume.json").read_text())
    assert resumed == {"step": "step_4", "iteration": 0, "train_state_step": 0, "optimizer": True, "recorded_tp_pp": [1, 1]}
    loaded, loaded_common = optimizer_tensors(tmp_path / "resumed" / "resaved")
    assert len(loaded) == 120
    assert_same(loaded, saved)
    assert loaded_common == saved_common
    with pytest.raises(AssertionError, match=f"{SHIFTED} differs"):
        assert_same(optimizer_tensors(tmp_path / "control" / "resaved")[0], saved)


def test_a_step_is_written_back_unless_a_format_is_named(tmp_path):
    run, source = carried_step(tmp_path)
    convert(run, tmp_path / "plain", Target(format="torch_dist"))
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    convert(source / "policy", tmp_path / "back", Target())
    weights = tmp_path / "back" / "step_12" / "policy" / "weights"
    assert sorted(p.name for p in (tmp_path / "back" / "step_12").iterdir()) == sorted(p.name for p in source.iterdir())
    for name in ("latest_train_state.pt", "iter_0000000/train_state.pt"):  # Bridge's train state, which holds no layout
        assert (weights / name).read_bytes() == (source / "policy" / "weights" / name).read_bytes(), name


def test_a_write_back_stopped_while_verifying_resumes(tmp_path, monkeypatch):
    """The rerun finishes the step again over what the first try carried (the policy's tokenizer directory included)."""
    import reshard.convert

    class Stop(Exception):
        pass

    run, source = carried_step(tmp_path)
    verify = reshard.convert.compute_checksums
    monkeypatch.setattr(reshard.convert, "compute_checksums", lambda *args, **kwargs: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        convert(run, tmp_path / "back", Target(layout=LayoutChange(tp=1)))
    monkeypatch.setattr(reshard.convert, "compute_checksums", verify)
    convert(run, tmp_path / "back", Target(layout=LayoutChange(tp=1)))
    tokenizer = tmp_path / "back" / "step_12" / "policy" / "tokenizer" / "tokenizer_config.json"
    assert tokenizer.read_text() == "{}"


def test_a_policy_beside_a_critic_or_of_an_unfinished_save_is_not_written_back(tmp_path):
    ppo = step(tmp_path / "ppo", 2, models=("policy", "value"))
    with pytest.raises(ReshardError, match="also holds NeMo-RL's value model"):
        convert(ppo / "policy", tmp_path / "out", Target(layout=LayoutChange(tp=1)))
    convert(ppo / "policy", tmp_path / "plain", Target(format="torch_dist", layout=LayoutChange(tp=1)))  # each model on its own
    unfinished = step(tmp_path / "run", 4, prefix="tmp_step_")
    with pytest.raises(ReshardError, match="NeMo-RL save still in progress"):
        convert(unfinished / "policy", tmp_path / "out", Target(format="hf"))
    assert not (tmp_path / "out").exists()


def test_a_link_out_of_the_step_is_refused_and_nothing_written(tmp_path):
    run, source = carried_step(tmp_path)
    (source / "elsewhere").symlink_to(tmp_path)
    with pytest.raises(ReshardError, match="leads outside the checkpoint"):
        convert(run, tmp_path / "out", Target(layout=LayoutChange(tp=1)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
