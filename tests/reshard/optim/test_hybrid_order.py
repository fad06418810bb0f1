"""DistributedOptimizer state of hybrid models, decoded and written by reshard/optim/order.py's entries for a layer's
other mixers, against megatron-core's own saves of the same state (fixture `distrib_optim`: its DistributedOptimizer
trains two steps on 4 CPU ranks at TP2 DP2, on the CPU stand-ins of trainer/gated_delta_net.py and trainer/mamba.py
for the fla / mamba_ssm kernels; megatron-core builds these mixers in the Transformer-Engine spec only, so the runs lay
their buffers out in its order and their args say transformer_engine).

tiny-qwen3-next: megatron-core's GPTModel with Gated DeltaNet on layers 0 and 2 (experimental_attention_variant,
linear_attention_freq 2), gated attention with q/k norms on 1 and 3, a dense MLP on layer 0 and MoE with a gated
shared expert on the others. tiny-nemotron-h: its MambaModel of pattern "M*M-" (Mamba-2 mixers, attention, a
squared-ReLU MLP layer). A mixer's own parameters (dt_bias, A_log, D) come before its submodules'; torch_dist keys
in_proj's and conv1d's parts apart, which lie in one parameter of the buffers. Converted to TP1 PP2, the first stage
ends with a layer of one kind and the second begins with another."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.optim.order import LAYER_ORDERS, MULTI_HEAD
from reshard.request import LayoutChange, Target
from tests.reshard.optim.test_dp_reshardable import assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.optim.test_dp_reshardable_writer import Case, resaved  # noqa: F401  (the fixture)
from tests.reshard.optim.test_dp_reshardable_writer import test_written_buckets_are_megatrons_own_at_the_new_layout as written_as_megatrons
from tests.reshard.test_cli import reshard

pytestmark = pytest.mark.slow  # every test reads a DistributedOptimizer run trained by Megatron-Core on 4 ranks (distrib_optim)

TE = ("transformer_engine", MULTI_HEAD)
GDN, MIXER = "decoder.layers.{}.self_attention.", "decoder.layers.{}.mixer."
# preset, parameters, tensors of its other layer kinds it must have, two parameters of one size (each layer's) to swap
CASES = {
    "tiny-qwen3-next": (65, [GDN.format(0) + "in_proj.weight.alpha", GDN.format(2) + "conv1d.weight.value", GDN.format(2) + "A_log",
                             "decoder.layers.3.mlp.shared_experts.gate_weight", "decoder.layers.0.mlp.linear_fc1.weight"],
                        ("self_attention.A_log", "self_attention.dt_bias")),
    "tiny-nemotron-h": (43, [MIXER.format(0) + "in_proj.weight.dt", MIXER.format(2) + "conv1d.bias.C", MIXER.format(2) + "D",
                             "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", "decoder.final_norm.weight"],
                        ("mixer.A_log", "mixer.D")),
}
LAYOUT = {"tp": 2, "te_order": True}


@pytest.mark.parametrize("preset", CASES)
def test_hybrid_buffers_read_bit_for_bit_as_megatrons_fully_reshardable(distrib_optim, tmp_path, preset):
    """dp_reshardable decodes to every optimizer tensor of Megatron's own fully_reshardable save, bit for bit, each part
    of in_proj and conv1d apart; the decoded master weights are the saved weights; converted to TP1 PP2 (a stage
    boundary between layers of different kinds), the dp_reshardable source gives what converting the fully_reshardable
    one gives."""
    params, tensors, _ = CASES[preset]
    made = distrib_optim(preset, **LAYOUT)
    dp, dp_common = optimizer_tensors(made["dp"])
    full, full_common = optimizer_tensors(made["full"])
    assert len(dp) == 3 * params and all(f"optimizer.state.exp_avg.{name}" in dp for name in tensors)
    assert_same(dp, full)
    assert dp_common == full_common
    assert master_weights_are_the_model(made["dp"], dp) == []
    assert all(np.any(dp[f"optimizer.state.exp_avg.{name}"] != 0) for name in tensors)  # two real Adam steps trained them
    for form in ("dp", "full"):
        out = reshard("convert", made[form], tmp_path / form, "--to-tp", "1", "--to-pp", "2")
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert len(assert_converted_alike(tmp_path / "dp", tmp_path / "full")) == 3 * params


@pytest.mark.parametrize("preset", CASES)
def test_hybrid_written_buckets_are_megatrons_own_at_the_new_layout(distrib_optim, resaved, tmp_path, preset):  # noqa: F811
    """`--optimizer-form dp_reshardable` at TP1 PP2 DP2 equals megatron-core's own save of the same state at that layout
    (its DistributedOptimizer loading the fully_reshardable save), bucket for bucket."""
    written_as_megatrons(distrib_optim, resaved, tmp_path, Case(preset, tp=2, te_order=True, to_pp=2, dp=2))


@pytest.mark.parametrize("preset", CASES)
def test_a_swap_in_a_mixers_order_is_caught(distrib_optim, tmp_path, monkeypatch, preset):
    """Two of a mixer's parameters of one size (Gated DeltaNet's A_log and dt_bias, the Mamba mixer's A_log and D) in
    each other's place in reshard's order leave every bucket length right: the decode then differs from Megatron's
    fully_reshardable save in exactly those, and the master-weight check refuses the conversion, writing nothing."""
    first, second = CASES[preset][2]
    order = list(LAYER_ORDERS[TE])
    a, b = order.index(first), order.index(second)
    order[a], order[b] = order[b], order[a]
    monkeypatch.setitem(LAYER_ORDERS, TE, tuple(order))
    made = distrib_optim(preset, **LAYOUT)
    dp, _ = optimizer_tensors(made["dp"])
    full, _ = optimizer_tensors(made["full"])
    differ = {name.split(".", 3)[3] for name in dp if dp[name].tobytes() != full[name].tobytes()}
    layers = {int(name.split(".")[2]) for name in differ}
    assert differ == {f"decoder.layers.{layer}.{tail}" for layer in layers for tail in (first, second)} and layers == {0, 2}
    with pytest.raises(ReshardError) as refused:
        convert(made["dp"], tmp_path / "out", Target(layout=LayoutChange(tp=1)))
    assert "4 parameter(s) disagree" in str(refused.value) and str(refused.value).split(":")[0] in differ
    assert not (tmp_path / "out").exists()
