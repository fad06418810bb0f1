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
ends with a layer of one kind and the second begins with another.

tiny-nemotron-h-moe: its MambaModel of pattern "ME*E", trained at TP2 EP2 DP2: an MoE layer is a TransformerLayer of
pre_mlp_layernorm and an MoELayer (router, its expert_bias a buffer in no optimizer state, 4 experts, a shared
expert), placed by the layer table's MoE entries as a GPT layer's MLP is; the experts in the expert optimizer's own
buffers (megatron-core's ChainedOptimizer), grouped as TEGroupedMLP registers them. Converted to TP1 PP2, the first
stage ends with an MoE layer and the second begins with attention. tiny-nemotron-h-latent: the same with Nemotron 3's
latent MoE, its fc1_latent_proj and fc2_latent_proj (a plain linear in TELinear's place) between router and experts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.formats.megatron_legacy import LegacyReader
from reshard.optim.order import LAYER_ORDERS, MULTI_HEAD
from reshard.request import LayoutChange, Target
from tests.reshard.optim.test_dp_reshardable import assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.optim.test_dp_reshardable_writer import Case, resaved  # noqa: F401  (the fixture)
from tests.reshard.optim.test_dp_reshardable_writer import test_written_buckets_are_megatrons_own_at_the_new_layout as written_as_megatrons
from tests.reshard.test_cli import reshard

pytestmark = pytest.mark.slow  # every test reads a DistributedOptimizer run trained by Megatron-Core on 4 ranks (distrib_optim)

TE = ("transformer_engine", MULTI_HEAD)
GDN, MIXER, MOE = "decoder.layers.{}.self_attention.", "decoder.layers.{}.mixer.", "decoder.layers.{}.mlp."


@dataclass(frozen=True)
class Hybrid:
    """A preset's run: its parameters, tensors of its other layer kinds it must have, two parameters of one size (in
    each of `swapped_in` layers) to swap in reshard's order, and its expert parallelism."""

    params: int
    tensors: tuple[str, ...]
    swap: tuple[str, str]
    swapped_in: frozenset[int]
    ep: int = 1
    resaved: bool = True  # also written at TP1 PP2 against megatron-core's own resave (a third run of Megatron-Core)


CASES = {
    "tiny-qwen3-next": Hybrid(65, (GDN.format(0) + "in_proj.weight.alpha", GDN.format(2) + "conv1d.weight.value", GDN.format(2) + "A_log",
                                   "decoder.layers.3.mlp.shared_experts.gate_weight", "decoder.layers.0.mlp.linear_fc1.weight"),
                              ("self_attention.A_log", "self_attention.dt_bias"), frozenset({0, 2})),
    "tiny-nemotron-h": Hybrid(43, (MIXER.format(0) + "in_proj.weight.dt", MIXER.format(2) + "conv1d.bias.C", MIXER.format(2) + "D",
                                   "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", "decoder.final_norm.weight"),
                              ("mixer.A_log", "mixer.D"), frozenset({0, 2})),
    # all 37 model tensors but the MoE layers' two expert_bias buffers
    "tiny-nemotron-h-moe": Hybrid(35, (MIXER.format(0) + "D", "decoder.layers.1.pre_mlp_layernorm.weight", MOE.format(1) + "router.weight",
                                       MOE.format(3) + "experts.experts.linear_fc1.weight", MOE.format(3) + "shared_experts.linear_fc2.weight"),
                                  ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"), frozenset({1, 3}), ep=2),
    # Nemotron 3's latent MoE: its projections into and out of the experts' latent between the router and the experts
    # (its writing is the MoE case's, in the order this decode proves; not resaved, to keep the tier's time)
    "tiny-nemotron-h-latent": Hybrid(39, (MOE.format(1) + "fc1_latent_proj.weight", MOE.format(3) + "fc2_latent_proj.weight",
                                          MOE.format(3) + "router.weight", MOE.format(1) + "experts.experts.linear_fc2.weight"),
                                     ("mlp.fc1_latent_proj.weight", "mlp.fc2_latent_proj.weight"), frozenset({1, 3}), ep=2, resaved=False),
}


def layout(preset: str) -> dict:
    return {"tp": 2, "ep": CASES[preset].ep, "te_order": True}


@pytest.mark.parametrize("preset", CASES)
def test_hybrid_buffers_read_bit_for_bit_as_megatrons_fully_reshardable(distrib_optim, tmp_path, preset):
    """dp_reshardable decodes to every optimizer tensor of Megatron's own fully_reshardable save, bit for bit, each part
    of in_proj and conv1d apart; the decoded master weights are the saved weights; converted to TP1 PP2 (a stage
    boundary between layers of different kinds), the dp_reshardable source gives what converting the fully_reshardable
    one gives."""
    params, tensors = CASES[preset].params, CASES[preset].tensors
    made = distrib_optim(preset, **layout(preset))
    dp, dp_common = optimizer_tensors(made["dp"])
    full, full_common = optimizer_tensors(made["full"])
    assert len(dp) == 3 * params and all(f"optimizer.state.exp_avg.{name}" in dp for name in tensors)
    assert not any("expert_bias" in name for name in dp)
    assert_same(dp, full)
    assert dp_common == full_common
    assert master_weights_are_the_model(made["dp"], dp) == []
    assert all(np.any(dp[f"optimizer.state.exp_avg.{name}"] != 0) for name in tensors)  # two real Adam steps trained them
    for form in ("dp", "full"):
        out = reshard("convert", made[form], tmp_path / form, "--to-tp", "1", "--to-pp", "2")
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert len(assert_converted_alike(tmp_path / "dp", tmp_path / "full")) == 3 * params


@pytest.mark.parametrize("preset", CASES)
def test_hybrid_distrib_optim_pt_reads_bit_for_bit_as_megatrons_fully_reshardable(distrib_optim, preset):
    """Megatron-LM's legacy save of the same run (`mp_rank_*/model_optim_rng.pt` with the mixers' in_proj and conv1d
    parts fused per rank, and megatron-core's own `save_parameter_state` beside them) decodes to every optimizer tensor
    of the fully_reshardable save, bit for bit."""
    made = distrib_optim(preset, **layout(preset))
    legacy, legacy_common = optimizer_tensors(made["legacy"], LegacyReader)
    full, full_common = optimizer_tensors(made["full"])
    assert len(legacy) == 3 * CASES[preset].params
    assert_same(legacy, full)
    assert legacy_common == full_common


@pytest.mark.parametrize("preset", [preset for preset, case in CASES.items() if case.resaved])
def test_hybrid_written_buckets_are_megatrons_own_at_the_new_layout(distrib_optim, resaved, tmp_path, preset):  # noqa: F811
    """`--optimizer-form dp_reshardable` at TP1 PP2 DP2 equals megatron-core's own save of the same state at that layout
    (its DistributedOptimizer loading the fully_reshardable save), bucket for bucket."""
    ep = CASES[preset].ep
    written_as_megatrons(distrib_optim, resaved, tmp_path, Case(preset, tp=2, ep=ep, te_order=True, to_pp=2, to_ep=ep, dp=2))


@pytest.mark.parametrize("preset", CASES)
def test_a_swap_in_a_mixers_order_is_caught(distrib_optim, tmp_path, monkeypatch, preset):
    """Two of a layer's parameters of one size (Gated DeltaNet's A_log and dt_bias, the Mamba mixer's A_log and D, an MoE
    layer's shared expert's up and down projections) in each other's place in reshard's order leave every bucket length
    right: the decode then differs from Megatron's fully_reshardable save in exactly those, and the master-weight check
    refuses the conversion, writing nothing."""
    (first, second), swapped_in = CASES[preset].swap, CASES[preset].swapped_in
    order = list(LAYER_ORDERS[TE])
    a, b = order.index(first), order.index(second)
    order[a], order[b] = order[b], order[a]
    monkeypatch.setitem(LAYER_ORDERS, TE, tuple(order))
    made = distrib_optim(preset, **layout(preset))
    dp, _ = optimizer_tensors(made["dp"])
    full, _ = optimizer_tensors(made["full"])
    differ = {name.split(".", 3)[3] for name in dp if dp[name].tobytes() != full[name].tobytes()}
    layers = {int(name.split(".")[2]) for name in differ}
    assert differ == {f"decoder.layers.{layer}.{tail}" for layer in layers for tail in (first, second)} and layers == swapped_in
    with pytest.raises(ReshardError) as refused:
        convert(made["dp"], tmp_path / "out", Target(layout=LayoutChange(tp=1)))
    assert "4 parameter(s) disagree" in str(refused.value) and str(refused.value).split(":")[0] in differ
    assert not (tmp_path / "out").exists()
