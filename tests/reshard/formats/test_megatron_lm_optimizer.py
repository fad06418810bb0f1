"""Megatron-LM resumes reshard's conversion of a DistributedOptimizer run at a new layout, in both optimizer forms.

The run: megatron-core's own DistributedOptimizer (reshard's venv, megatron-core 0.16.1) trains tiny-llama two Adam
steps at TP2 DP2 and saves the same state twice, dp_reshardable (what reshard converts) and fully_reshardable (the
oracle; `distrib_optim` in tests/conftest.py). reshard converts the first to TP1 PP2; Megatron-LM (core_v0.17.1, its
own `get_model`, `get_megatron_optimizer` with --use-distributed-optimizer, `load_checkpoint`, 4 gloo processes:
fixtures/megatron_lm_resume.py) resumes it at TP1 PP2 DP2, choosing the optimizer form to ask for from the
checkpoint's content metadata, and saves what it loaded with `save_checkpoint` as fully_reshardable. torch's own DCP
reader then finds every tensor of that save (model, fp32 master weights, exp_avg, exp_avg_sq) equal to the run's own
fully_reshardable save bit for bit, and its optimizer param groups (the step included) equal too.

Skipped where Megatron-LM's peer install is absent (CI), with the reason. The same proof is
`fixtures/golden/make_golden.py --only peers-optim`.

Then Megatron-LM's own training run is the source (fixtures/megatron_lm_train.py: its setup_model_and_optimizer,
mock data, train_step): it trains TP2 DP2 (fp32) to iteration 6, saving iteration 3 in its default form
(dp_reshardable) and as fully_reshardable, and records each iteration's loss. Resumed from reshard's conversion at
TP2 DP2 and at TP1 PP2 DP2 it must train iterations 4-6 as the uninterrupted run did, as Megatron-LM's resume of its
own fully_reshardable save at TP1 PP2 does, within 1e-5 relative (measured: equal at TP2, 7e-8 at TP1 PP2).
"""

from __future__ import annotations

import pytest
import torch

from tests.reshard.formats.test_golden import megatron_lm_peer
from tests.reshard.test_cli import reshard

pytestmark = pytest.mark.slow  # every test reads a DistributedOptimizer run trained by Megatron-Core on 4 ranks (distrib_optim)

DP_RESHARDABLE = ["--optimizer-form", "dp_reshardable", "--to-dp", "2"]
RESUMED = 6  # the last iteration of the uninterrupted run; resumed runs train from its save (make_golden.MLM_TRAIN_SAVED)


@pytest.fixture(scope="module")
def megatron_lm():
    """(Megatron-LM's venv, its tree, make_golden as a module), or the test is skipped with the reason."""
    return megatron_lm_peer()


def _resumed(megatron_lm, tmp_path, source, flags, damage=None):
    """reshard's TP1 PP2 conversion of `source` (a dp_reshardable save), resumed and saved again by Megatron-LM."""
    venv, tree, make_golden = megatron_lm
    proc = reshard("convert", source, tmp_path / "converted", "--to-tp", 1, "--to-pp", 2, *flags)
    assert proc.returncode == 0, proc.stderr
    if damage is not None:
        make_golden.damage(tmp_path / "converted" / make_golden.OPTIM_ITER, damage)
    return make_golden.mlm_resume(venv, tree, tmp_path, "converted", 1, 2, 4) / make_golden.OPTIM_ITER


@pytest.mark.parametrize("bf16, flags", [(False, []), (True, DP_RESHARDABLE)], ids=["fully_reshardable-fp32", "dp_reshardable-bf16"])
def test_megatron_lm_resumes_reshards_optimizer_state_at_a_new_layout(megatron_lm, distrib_optim, tmp_path, bf16, flags):
    """fully_reshardable (reshard's default) from an fp32 run, dp_reshardable for DP2 from a bf16 run (fp32 master
    weights, grads reduced in fp32). An fp32 run's dp_reshardable form is not loadable by Megatron-LM at all, its own
    included: see make_golden.PEERS_OPTIM."""
    make_golden = megatron_lm[2]
    run = distrib_optim("tiny-llama", tp=2, bf16=bf16)
    saved = _resumed(megatron_lm, tmp_path, run["dp"], flags)
    both, differ = make_golden.differing_tensors(run["full"] / make_golden.OPTIM_ITER, saved)
    assert differ == []
    assert len(both) == 36 and sum(k.startswith("optimizer.state.") for k in both) == 27  # 9 parameters: model + 3 optimizer tensors each
    theirs, mine = (torch.load(d / "common.pt", weights_only=False) for d in (run["full"] / make_golden.OPTIM_ITER, saved))
    assert mine["optimizer"] == theirs["optimizer"]  # param groups, their Adam step (2) included
    assert mine["iteration"] == 2 and mine["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"


def test_a_damaged_conversion_shows_in_megatron_lms_resumed_state(megatron_lm, distrib_optim, tmp_path):
    """The control: one bit of one exp_avg_sq value changed in reshard's output. Megatron-LM loads it without a
    complaint, and its save then differs from the run's own in exactly that tensor, so the comparison above can fail."""
    make_golden = megatron_lm[2]
    run = distrib_optim("tiny-llama", tp=2)
    saved = _resumed(megatron_lm, tmp_path, run["dp"], [], damage=make_golden.DAMAGED)
    both, differ = make_golden.differing_tensors(run["full"] / make_golden.OPTIM_ITER, saved)
    assert len(both) == 36 and differ == [make_golden.DAMAGED]


@pytest.mark.parametrize("flags, form", [([], "fully_reshardable"), (DP_RESHARDABLE, "dp_reshardable")])
def test_the_checkpoint_tells_megatron_lm_what_to_load(distrib_optim, tmp_path, flags, form):
    """What Megatron-LM's `load_checkpoint` decides from (runs in CI, without the peer): the optimizer form it asks
    for is megatron-core's `load_content_metadata` of the checkpoint (none: a pre-0.13 form reshard does not write),
    and it asks for the RNG state at an unchanged TP/PP and for the optimizer state unless the args say they were not
    saved. reshard's conversion to another layout carries no RNG state (it belongs to the old ranks)."""
    from megatron.core import dist_checkpointing

    proc = reshard("convert", distrib_optim("tiny-llama", tp=2)["dp"], tmp_path / "out", "--to-tp", 1, "--to-pp", 2, *flags)
    assert proc.returncode == 0, proc.stderr
    iter_dir = tmp_path / "out" / "iter_0000002"
    assert dist_checkpointing.load_content_metadata(str(iter_dir))["distrib_optim_sharding_type"] == form
    args = torch.load(iter_dir / "common.pt", weights_only=False)["args"]
    assert (args.no_save_rng, args.no_save_optim) == (True, None)
    proc = reshard("convert", tmp_path / "out", tmp_path / "model-only", "--no-optimizer")
    assert proc.returncode == 0, proc.stderr
    args = torch.load(tmp_path / "model-only" / "iter_0000002" / "common.pt", weights_only=False)["args"]
    assert (args.no_save_rng, args.no_save_optim) == (True, True)


@pytest.fixture(scope="module")
def megatron_lm_run(megatron_lm, tmp_path_factory):
    """Megatron-LM's uninterrupted training run at TP2 DP2: (its directory, each iteration's loss); `run/checkpoint`
    holds its default save (dp_reshardable) of make_golden.MLM_TRAIN_SAVED, `run/oracle` the same as fully_reshardable."""
    venv, tree, make_golden = megatron_lm
    work = tmp_path_factory.mktemp("megatron-lm-run")
    saved = make_golden.MLM_TRAIN_SAVED
    losses = make_golden.mlm_train(venv, tree, work, "run", 2, 1, RESUMED, "--save", "run/checkpoint", "--save-at", saved,
                                   "--oracle", "run/oracle")
    assert sorted(losses) == list(range(1, RESUMED + 1))
    return work, losses


def _converted(work, name, tp, pp) -> str:
    """reshard's conversion of the run's dp_reshardable save to TP`tp` PP`pp` (its default form), as `work/name`."""
    proc = reshard("convert", work / "run" / "checkpoint", work / name, "--to-tp", tp, "--to-pp", pp)
    assert proc.returncode == 0, proc.stderr
    return name


def _resumed_losses(megatron_lm, work, load, tp, pp, *flags, name=None):
    """Megatron-LM resumes `work/load` (its load_checkpoint at TP`tp` PP`pp`) and trains to RESUMED: each resumed
    iteration's loss."""
    venv, tree, make_golden = megatron_lm
    losses = make_golden.mlm_train(venv, tree, work, name or f"{load.replace('/', '-')}-resumed", tp, pp, RESUMED,
                                   "--load", load, *flags)
    assert sorted(losses) == list(range(make_golden.MLM_TRAIN_SAVED + 1, RESUMED + 1))
    return losses


def _worst_relative(losses: dict[int, float], reference: dict[int, float]) -> float:
    return max(abs(loss - reference[i]) / abs(reference[i]) for i, loss in losses.items())


def test_megatron_lm_resumes_reshards_conversion_of_its_own_run_as_if_uninterrupted(megatron_lm, megatron_lm_run):
    """reshard converts Megatron-LM's dp_reshardable save (TP2 DP2) to fully_reshardable, the form Megatron-LM loads
    of an fp32 run (make_golden.PEERS_OPTIM); Megatron-LM resumes it and trains iterations 4-6 with the uninterrupted
    run's losses (1e-5 relative; measured: equal). The control: the same resume without the optimizer state
    (--no-load-optim, Adam restarted) misses them (measured: by 7.5e-3 at iteration 5)."""
    work, uninterrupted = megatron_lm_run
    converted = _converted(work, "converted-tp2", 2, 1)
    assert _worst_relative(_resumed_losses(megatron_lm, work, converted, 2, 1), uninterrupted) <= 1e-5
    control = _resumed_losses(megatron_lm, work, converted, 2, 1, "--no-load-optim", name="no-load-optim")
    assert _worst_relative(control, uninterrupted) > 1e-3


def test_megatron_lm_resumes_reshards_new_layout_as_it_resumes_its_own_fully_reshardable_save(megatron_lm, megatron_lm_run):
    """At a new layout (TP1 PP2 DP2) Megatron-LM resumes reshard's conversion as it resumes its own fully_reshardable
    save of the same iteration, and both continue as the uninterrupted TP2 run did (1e-5 relative; measured: 7e-8);
    without the optimizer state (the control) they do not (measured: by 7.5e-3 at iteration 5)."""
    work, uninterrupted = megatron_lm_run
    converted = _converted(work, "converted-tp1pp2", 1, 2)
    theirs = _resumed_losses(megatron_lm, work, "run/oracle", 1, 2)
    assert _worst_relative(theirs, uninterrupted) <= 1e-5
    assert _worst_relative(_resumed_losses(megatron_lm, work, converted, 1, 2), uninterrupted) <= 1e-5
    control = _resumed_losses(megatron_lm, work, converted, 1, 2, "--no-load-optim", name="tp1pp2-no-load-optim")
    assert _worst_relative(control, uninterrupted) > 1e-3
