"""DistributedOptimizer state of a GLM-4.5-shaped model (tiny-glm4-moe: q/k/v biases, q/k norms, partial RoPE, a dense
then an MoE layer with a sigmoid router, its expert bias and a shared expert, and one MTP layer), decoded and written
by reshard/optim/order.py's MTP order, against Megatron-Core's own fully_reshardable save of the same state (fixture
`distrib_optim`: its DistributedOptimizer trains two steps on 4 CPU ranks, local spec, TP2 EP2 DP2).

The MTP layer's parameters come between the decoder's final norm and the output layer (enorm, hnorm, eh_proj, its
transformer layer, final_layernorm); the router's expert_bias is a module buffer, in no optimizer state."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.optim import order
from reshard.request import LayoutChange, Target
from tests.reshard.optim.test_dp_reshardable import assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.test_cli import reshard

pytestmark = pytest.mark.slow  # every test reads a DistributedOptimizer run trained by Megatron-Core on 4 ranks (distrib_optim)

LAYOUT = {"tp": 2, "ep": 2}
PARAMS = 40  # model tensors with optimizer state: all 42 but the two routers' expert_bias (decoder layer 1, the MTP layer)


def test_glm_buffers_read_bit_for_bit_as_megatrons_fully_reshardable(distrib_optim, tmp_path):
    """dp_reshardable decodes to every optimizer tensor of Megatron's own fully_reshardable save, bit for bit, the MTP
    layer's included and no expert_bias; the decoded master weights are the saved weights; converted to TP1 EP1, the
    dp_reshardable source gives what converting the fully_reshardable one gives."""
    made = distrib_optim("tiny-glm4-moe", **LAYOUT)
    dp, dp_common = optimizer_tensors(made["dp"])
    full, full_common = optimizer_tensors(made["full"])
    assert len(dp) == 3 * PARAMS and not any("expert_bias" in name for name in dp)
    assert {"optimizer.state.exp_avg.mtp.layers.0.eh_proj.weight", "optimizer.state.exp_avg.mtp.layers.0.transformer_layer."
            "mlp.experts.experts.linear_fc1.weight", "optimizer.state.exp_avg.decoder.layers.1.self_attention.linear_qkv.bias"} <= dp.keys()
    assert_same(dp, full)
    assert dp_common == full_common
    assert master_weights_are_the_model(made["dp"], dp) == []
    assert all(np.any(t != 0) for name, t in dp.items() if ".exp_avg." in name and "mtp." in name)  # the MTP loss trained it
    for form in ("dp", "full"):
        out = reshard("convert", made[form], tmp_path / form, "--to-tp", "1", "--to-ep", "1")
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert len(assert_converted_alike(tmp_path / "dp", tmp_path / "full")) == 3 * PARAMS


def test_a_swap_in_the_mtp_order_is_caught(distrib_optim, tmp_path, monkeypatch):
    """enorm and hnorm (one size) in each other's place in reshard's MTP order leave every bucket length right: the
    decode then differs from Megatron's fully_reshardable save in exactly those two, and the master-weight check
    refuses the conversion naming one of them, writing nothing."""
    swapped = list(order._MTP_ORDER)
    e, h = swapped.index("enorm.weight"), swapped.index("hnorm.weight")
    swapped[e], swapped[h] = swapped[h], swapped[e]
    monkeypatch.setattr(order, "_MTP_ORDER", tuple(swapped))
    made = distrib_optim("tiny-glm4-moe", **LAYOUT)
    dp, _ = optimizer_tensors(made["dp"])
    full, _ = optimizer_tensors(made["full"])
    assert {name.split(".", 3)[3] for name in dp if dp[name].tobytes() != full[name].tobytes()} == \
        {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight"}
    with pytest.raises(ReshardError) as refused:
        convert(made["dp"], tmp_path / "out", Target(layout=LayoutChange(tp=1, ep=1)))
    assert "2 parameter(s) disagree" in str(refused.value) and "norm.weight" in str(refused.value).split(":")[0]
    assert not (tmp_path / "out").exists()


def test_mtp_buffers_over_pipeline_stages_read_as_megatrons_fully_reshardable(distrib_optim, tmp_path):
    """At PP2 Megatron-Core's last stage holds a second word embedding for its MTP layer (`mtp_process`), in a bucket of
    its own as the first stage's: its dp_reshardable buffers decode to the fully_reshardable save bit for bit, and a
    conversion to PP1 gives what converting the fully_reshardable one gives."""
    made = distrib_optim("tiny-glm4-moe", tp=1, pp=2)  # at EP1 (a stage of no experts is refused at EP > 1)
    dp, _ = optimizer_tensors(made["dp"])
    full, _ = optimizer_tensors(made["full"])
    assert len(dp) == 3 * PARAMS
    assert_same(dp, full)
    assert master_weights_are_the_model(made["dp"], dp) == []
    for form in ("dp", "full"):
        out = reshard("convert", made[form], tmp_path / form, "--to-pp", "1")
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert len(assert_converted_alike(tmp_path / "dp", tmp_path / "full")) == 3 * PARAMS
