"""DistributedOptimizer state of gpt-oss's layer (preset tiny-gpt-oss: attention sinks, a sliding window on every other
layer, biases on every linear with the router's and the experts', the clamped SwiGLU, YaRN), decoded by
reshard/optim/order.py against Megatron-Core's own saves of the same state (fixture `distrib_optim`: its
DistributedOptimizer trains two steps on 4 CPU ranks, local spec).

The sinks (`core_attention.softmax_offset`, registered before linear_proj) and the router's bias (after its weight) are
parameters: each has its place in the buffers and its Adam state. At TP2 DP2 (ETP1: megatron-core has expert biases
only so) each TP rank keeps its own heads' sinks; at EP2 DP4 the experts and their biases sit in the expert optimizer.
Megatron-Core trains the experts' biases with reshard.trainer.expert_bias's linear_fc2."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.formats.megatron_legacy import LegacyReader
from tests.reshard.optim.test_dp_reshardable import assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.test_cli import reshard

pytestmark = pytest.mark.slow  # every test reads a DistributedOptimizer run trained by Megatron-Core on 4 ranks (distrib_optim)

# embedding, final norm, output layer, and 13 stacked per layer: input norm, sinks, qkv and proj with biases, pre-MLP norm,
# router weight and bias, the experts' fc1 and fc2 with biases
PARAMS = 16
NEW = {"decoder.layers.self_attention.core_attention.softmax_offset", "decoder.layers.mlp.router.bias"}


@pytest.mark.parametrize("layout, target", [({"tp": 2, "etp": 1}, ["--to-tp", "1", "--to-ep", "2"]),
                                            ({"tp": 1, "ep": 2}, ["--to-ep", "1", "--to-tp", "2", "--to-etp", "1"])],
                         ids=["tp2dp2", "ep2dp4"])
def test_gpt_oss_buffers_read_bit_for_bit_as_megatrons_fully_reshardable(distrib_optim, tmp_path, layout, target):
    """dp_reshardable (and, at EP2, the legacy distrib_optim.pt) decode to every optimizer tensor of Megatron's own fully_reshardable
    save, bit for bit, the sinks and the router's bias included (real Adam state: they are trained); the decoded master
    weights are the saved weights; converted to another layout, both forms give the same state."""
    made = distrib_optim("tiny-gpt-oss", **layout)
    dp, dp_common = optimizer_tensors(made["dp"])
    full, full_common = optimizer_tensors(made["full"])
    assert len(dp) == 3 * PARAMS and {f"optimizer.state.exp_avg.{n}" for n in NEW} <= set(dp)
    assert_same(dp, full)
    assert dp_common == full_common
    if layout.get("etp") is None:  # the fixture's legacy save writes a TP rank's file from expert DP rank 0: none at ETP1 TP2
        legacy, legacy_common = optimizer_tensors(made["legacy"], LegacyReader)
        assert_same(legacy, full)
        assert legacy_common == full_common
    assert master_weights_are_the_model(made["dp"], dp) == []
    assert all(np.any(t != 0) for name, t in dp.items() if ".exp_avg" in name)  # two real Adam steps
    for form in ("dp", "full"):
        out = reshard("convert", made[form], tmp_path / form, *target)
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert len(assert_converted_alike(tmp_path / "dp", tmp_path / "full")) == 3 * PARAMS
