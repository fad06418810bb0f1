"""A DistributedOptimizer run stopped at iteration K under dp_reshardable (TP2 DP2), converted by `reshard convert
--optimizer-form dp_reshardable` to the buckets of another layout, resumes there in Megatron-Core's own
DistributedOptimizer (torchrun + gloo on CPU) with the uninterrupted run's losses, within 1e-5 relative per step;
without the optimizer state it does not (control). The reference run and helpers are test_resume's."""

from __future__ import annotations

import pytest

from tests.trainer.test_resume import REL, TOTAL, K, _optimizer_keys, assert_continues, converted, corpus, distopt, resume  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow  # every test trains with the trainer (Megatron-Core)

DP_RESHARDABLE = ("--optimizer-form", "dp_reshardable")


@pytest.mark.parametrize("to,layout", [
    (("--to-tp", 1, "--to-pp", 2), ["--pp", 2]),
    (("--to-tp", 1, "--to-dp", 4), []),
], ids=["tp2dp2->tp1pp2dp2", "tp2dp2->dp4"])
def test_converted_buckets_resume_the_run(distopt, tmp_path, corpus, to, layout):  # noqa: F811
    src, ref = distopt
    load = converted(src, tmp_path / "converted", *map(str, to), *DP_RESHARDABLE)
    keys = _optimizer_keys(load / f"iter_{K:07d}")
    assert keys and all(k.startswith("optimizer.distributed.") for k in keys), sorted(keys)[:3]
    assert_continues(resume(tmp_path, corpus, load, 4, layout, ["--use-distributed-optimizer"]), ref)


def test_converted_buckets_without_the_optimizer_state_break_continuity(distopt, tmp_path, corpus):  # noqa: F811
    """Control: the same resume without the optimizer state does not continue the run."""
    src, ref = distopt
    load = converted(src, tmp_path / "converted", "--to-tp", "1", "--to-pp", "2", *DP_RESHARDABLE)
    resumed = resume(tmp_path, corpus, load, 4, ["--pp", 2], ["--use-distributed-optimizer", "--no-load-optim"])
    assert resumed[K + 1] == pytest.approx(ref[K + 1], rel=REL)  # same weights, same data
    worst = max(abs(resumed[i] - ref[i]) / abs(ref[i]) for i in range(K + 2, TOTAL + 1))
    assert worst > 100 * REL, f"losses still agree ({worst:.2e}): the continuity check would not notice"
