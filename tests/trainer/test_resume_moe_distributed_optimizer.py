"""An MoE run with Megatron's DistributedOptimizer (its ChainedOptimizer: dense `chained_0.`, experts `chained_1.`),
saved in the default dp_reshardable form, resumes from what `reshard convert` decodes of it (torchrun + gloo on CPU).

The oracle is the uninterrupted run's losses (tests/trainer/test_resume.py). Found on the way, and megatron-core's or
the trainer's to answer, not reshard's: the trainer resuming the dp_reshardable MoE checkpoint itself (Megatron
loading its own buckets) does not continue the run (iteration 5 off by 2%), where its fully_reshardable save does.
"""

from __future__ import annotations

import pytest

from reshard.torchfile import dcp_metadata
from tests.trainer.test_resume import K, _optimizer_keys, assert_continues, converted, corpus, reference, resume  # noqa: F401

MOE = ["--model", "tiny-moe", "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def moe_distopt(tmp_path_factory, corpus):  # noqa: F811
    """tiny-moe EP2 DP4 (expert DP2) with the DistributedOptimizer, saved dp_reshardable."""
    return reference(tmp_path_factory, corpus, "moe_distopt", 4, ["--ep", 2], MOE)


def test_moe_dp_reshardable_decoded_by_reshard_resumes_the_run(moe_distopt, tmp_path, corpus):  # noqa: F811
    src, ref = moe_distopt
    saved = dcp_metadata.load(src / f"iter_{K:07d}" / ".metadata").tensors
    assert {k.split(".optimizer.distributed.")[0] for k in saved if ".optimizer." in k} == {"chained_0", "chained_1"}
    load = converted(src, tmp_path / "converted")  # the same layout: the buckets become per-parameter tensors
    assert any(k.startswith("optimizer.state.exp_avg.decoder.layers.mlp.experts.") for k in _optimizer_keys(load / f"iter_{K:07d}"))
    assert_continues(resume(tmp_path, corpus, load, 4, ["--ep", 2], MOE), ref)
