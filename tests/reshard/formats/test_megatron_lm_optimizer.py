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
"""

from __future__ import annotations

import pytest
import torch

from tests.reshard.formats.test_golden import megatron_lm_peer
from tests.reshard.test_cli import reshard

DP_RESHARDABLE = ["--optimizer-form", "dp_reshardable", "--to-dp", "2"]


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
