"""DistributedOptimizer state of MiniMax-M2's layer (preset tiny-minimax: full-width q/k norms, partial rotary, a sigmoid
router with its expert bias), decoded by reshard/optim/order.py against Megatron-Core's own saves of the same state
(fixture `distrib_optim`: its DistributedOptimizer trains two steps on 4 CPU ranks, local spec, the full-width norms
built by reshard.trainer.full_width_norm).

At TP2 DP2 each TP rank keeps its own heads' part of the q/k norms in its buffer (split by head, where a per-head norm is
whole on every rank); at EP2 DP4 the experts sit in megatron-core's expert optimizer. The router's expert bias is a
buffer megatron-core moves by token counts: in the checkpoint, never in the optimizer's state."""

from __future__ import annotations

import numpy as np
import pytest

from reshard import logical
from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.formats.megatron_legacy import LegacyReader
from reshard.request import LayoutChange, Target
from reshard.sharding import full_region
from tests.reshard.optim.test_dp_reshardable import ITER, assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.test_cli import reshard

pytestmark = pytest.mark.slow  # every test reads a DistributedOptimizer run trained by Megatron-Core on 4 ranks (distrib_optim)

PARAMS = 12  # embedding, final norm, output layer and 9 stacked per layer (q/k norms among them, the expert bias not)
NORMS = {f"decoder.layers.self_attention.{w}_layernorm.weight" for w in "qk"}
BIAS = "decoder.layers.mlp.router.expert_bias"


@pytest.mark.parametrize("layout, target", [({"tp": 2}, ["--to-tp", "1", "--to-ep", "2"]), ({"tp": 1, "ep": 2}, ["--to-ep", "1", "--to-tp", "2"])],
                         ids=["tp2dp2", "ep2dp4"])
def test_minimax_buffers_read_bit_for_bit_as_megatrons_fully_reshardable(distrib_optim, tmp_path, layout, target):
    """dp_reshardable and the legacy distrib_optim.pt decode to every optimizer tensor of Megatron's own fully_reshardable
    save, bit for bit, the full-width norms included; the decoded master weights are the saved weights; the expert bias
    Megatron moved is saved and has no optimizer state; converted to another layout, both forms give the same state."""
    made = distrib_optim("tiny-minimax", **layout)
    dp, dp_common = optimizer_tensors(made["dp"])
    full, full_common = optimizer_tensors(made["full"])
    legacy, legacy_common = optimizer_tensors(made["legacy"], LegacyReader)
    assert len(dp) == 3 * PARAMS and {f"optimizer.state.exp_avg.{n}" for n in NORMS} <= set(dp)
    assert not any(name.endswith(BIAS) for name in dp)
    assert_same(dp, full)
    assert_same(legacy, full)
    assert dp_common == full_common == legacy_common
    assert master_weights_are_the_model(made["dp"], dp) == []
    assert all(np.any(t != 0) for name, t in dp.items() if ".exp_avg" in name)  # two real Adam steps
    with open_checkpoint(made["dp"] / ITER) as reader:
        bias = np.empty(reader.specs[BIAS].shape, np.float32)
        reader.read_into(BIAS, full_region(bias.shape), bias)
    assert np.any(bias != 0)  # moved by megatron-core's bias update, not by the optimizer
    for form in ("dp", "full"):
        out = reshard("convert", made[form], tmp_path / form, *target)
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert len(assert_converted_alike(tmp_path / "dp", tmp_path / "full")) == 3 * PARAMS


def test_full_width_norms_taken_as_whole_on_every_rank_are_caught(distrib_optim, tmp_path, monkeypatch):
    """Without the full-width rule the q/k norms are read as per-head ones (whole on every TP rank): the buffers still
    decode, but the norms' state differs from Megatron's fully_reshardable save, and the master-weight check refuses the
    conversion naming one of them, writing nothing."""
    made = distrib_optim("tiny-minimax", tp=2)
    monkeypatch.setattr(logical, "PARTITION_RULES", tuple(rule for rule in logical.PARTITION_RULES if rule[1].when is None))
    dp, _ = optimizer_tensors(made["dp"])
    full, _ = optimizer_tensors(made["full"])
    assert {name.split(".", 3)[3] for name in dp if dp[name].tobytes() != full[name].tobytes()} == NORMS
    with pytest.raises(ReshardError, match="master weights decoded .* are not its saved weights") as refused:
        convert(made["dp"], tmp_path / "out", Target(layout=LayoutChange(tp=1)))
    assert str(refused.value).split(":")[0] in NORMS and not (tmp_path / "out").exists()
