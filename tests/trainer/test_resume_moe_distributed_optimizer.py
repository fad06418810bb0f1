"""An MoE run with Megatron's DistributedOptimizer (its ChainedOptimizer: dense `chained_0.`, experts `chained_1.`),
saved in the default dp_reshardable form, resumes from what `reshard convert` decodes of it (torchrun + gloo on CPU).

The oracle is the uninterrupted run's losses (tests/trainer/test_resume.py). Two trainer faults were found here:
it took an MoE checkpoint's buckets (`chained_0.optimizer.distributed.*`) for no optimizer state and resumed with a
fresh one (iteration 5 off by 2.3%); and resumed at another EP (one DistributedOptimizer at EP1 against a chain of
two at EP2) it kept the fresh optimizer's step 0 (iteration 5 off by 1.4%).
"""

from __future__ import annotations

import json

import pytest

from reshard.torchfile import dcp_metadata
from tests.trainer.test_resume import REL, TOTAL, K, _optimizer_keys, assert_continues, converted, corpus, reference, resume  # noqa: F401

pytestmark = pytest.mark.slow  # every test trains with the trainer (Megatron-Core)

MOE = ["--model", "tiny-moe", "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def moe_distopt(tmp_path_factory, corpus):  # noqa: F811
    """tiny-moe EP2 DP4 (expert DP2) with the DistributedOptimizer, saved dp_reshardable."""
    return reference(tmp_path_factory, corpus, 4, ["--ep", 2], MOE)


def test_moe_dp_reshardable_decoded_by_reshard_resumes_the_run(moe_distopt, tmp_path, corpus):  # noqa: F811
    src, ref = moe_distopt
    saved = dcp_metadata.load(src / f"iter_{K:07d}" / ".metadata").tensors
    assert {k.split(".optimizer.distributed.")[0] for k in saved if ".optimizer." in k} == {"chained_0", "chained_1"}
    load = converted(src, tmp_path / "converted")  # the same layout: the buckets become per-parameter tensors
    assert any(k.startswith("optimizer.state.exp_avg.decoder.layers.mlp.experts.") for k in _optimizer_keys(load / f"iter_{K:07d}"))
    assert_continues(resume(tmp_path, corpus, load, 4, ["--ep", 2], MOE), ref)


def _optimizer_loaded(tmp_path) -> bool:
    records = [json.loads(line) for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    return next(r for r in records if r.get("event") == "checkpoint_load")["optimizer_loaded"]


def test_the_trainer_resumes_its_own_moe_buckets(moe_distopt, tmp_path, corpus):  # noqa: F811
    """Megatron's DistributedOptimizer loads its chained buckets as saved."""
    src, ref = moe_distopt
    assert_continues(resume(tmp_path, corpus, src / f"iter_{K:07d}", 4, ["--ep", 2], MOE), ref)
    assert _optimizer_loaded(tmp_path)


def test_moe_resume_without_optimizer_state_breaks_continuity(moe_distopt, tmp_path, corpus):  # noqa: F811
    """Control: what the trainer did with those buckets before (a fresh optimizer) fails the continuity check."""
    src, ref = moe_distopt
    resumed = resume(tmp_path, corpus, src / f"iter_{K:07d}", 4, ["--ep", 2], [*MOE, "--no-load-optim"])
    assert not _optimizer_loaded(tmp_path)
    assert resumed[K + 1] == pytest.approx(ref[K + 1], rel=REL)  # same weights, same data
    worst = max(abs(resumed[i] - ref[i]) / abs(ref[i]) for i in range(K + 2, TOTAL + 1))
    assert worst > 100 * REL, f"losses still agree ({worst:.2e}): the continuity check would not notice"


def test_moe_distributed_optimizer_resumes_at_another_ep(moe_distopt, tmp_path, corpus):  # noqa: F811
    """EP2 (a chain: dense and expert optimizers) converted to EP1 DP4 (one optimizer) resumes the run: the
    checkpoint's step reaches the optimizer whose param groups do not match the checkpoint's chain."""
    src, ref = moe_distopt
    load = converted(src, tmp_path / "converted", "--to-ep", "1")
    assert_continues(resume(tmp_path, corpus, load, 4, [], MOE), ref)


def test_moe_resumes_at_tp2_under_sequence_parallel(moe_distopt, tmp_path, corpus):  # noqa: F811
    """megatron-core runs MoE at TP > 1 only with sequence parallel, whose local-spec (torch) norms it refuses: the
    trainer builds them marked for the TP all-reduce of their gradients (`model._torch_norms_under_sequence_parallel`).
    EP2 DP4 converted to TP2 EP2 (DP2) continues the run. Left unmarked (each TP rank's norm gradient from its
    half of the sequence only), a TP2 EP2 run from scratch was off the TP1 run by 2.4e-3 at iteration 4."""
    src, ref = moe_distopt
    load = converted(src, tmp_path / "converted", "--to-tp", "2")
    assert_continues(resume(tmp_path, corpus, load, 4, ["--tp", 2, "--ep", 2], MOE), ref)
