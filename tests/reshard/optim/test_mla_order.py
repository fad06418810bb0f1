"""DistributedOptimizer state of multi-latent-attention models (DeepSeek-V3's attention), decoded and written by the MLA
parameter order of reshard/optim/order.py, against Megatron-Core's own saves of the same state (fixture
`distrib_optim`: its DistributedOptimizer trains two steps on 4 CPU ranks, local spec).

tiny-mla at TP2 DP2: the query latent (linear_q_down_proj, q_layernorm, linear_q_up_proj), LayerNorm latent norms with
biases, a biased linear_proj; the down projections column-parallel (the local spec's), the up projections split by
heads, the norms replicated: each TP rank keeps its own buffer slot of them. tiny-mla-moe at EP2 DP4: DeepSeek-V3's
layer kinds in small (no q_lora_rank: linear_q_proj; the first layer dense, the second MoE with a shared expert, keyed
per layer; megatron-core's chained expert optimizer). The Transformer-Engine spec's MLA order is read from source only
(no TE here): refused at TP > 1 (its down projections are whole on every TP rank); at TP1 proven only as test_te_order.py
proves the GPT one (megatron-core's buffers laid out in the order we read, not TE's own), the master-weight check
guarding a real TE save."""

from __future__ import annotations

import json

import numpy as np
import pytest

from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.formats.megatron_legacy import LegacyReader
from reshard.optim.order import LAYER_ORDERS, MULTI_LATENT
from reshard.optim.state import state_keys
from reshard.request import LayoutChange, Target
from tests.reshard.optim.test_distrib_optim_pt import legacy_resaved  # noqa: F401  (the fixture)
from tests.reshard.optim.test_distrib_optim_pt import (
    test_written_distrib_optim_is_megatrons_own_legacy_save_at_the_new_layout as written_as_megatrons_legacy,
)
from tests.reshard.optim.test_dp_reshardable import ITER, assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.optim.test_dp_reshardable_writer import Case, differences, saved_state
from tests.reshard.optim.test_dp_reshardable_writer import test_written_buckets_are_megatrons_own_at_the_new_layout as written_as_megatrons
from tests.reshard.optim.test_te_order import _start, _with_args
from tests.reshard.test_cli import _digest, _one_line_error, reshard

pytestmark = pytest.mark.slow  # every test reads a DistributedOptimizer run trained by Megatron-Core on 4 ranks (distrib_optim)

ATTENTION = "decoder.layers.self_attention."
CASES = [  # preset, source layout, parameters, MLA tensors it must have, conversion target
    ("tiny-mla", {"tp": 2}, 22, ["linear_q_down_proj.weight", "linear_q_up_proj.layer_norm_bias", "linear_kv_up_proj.layer_norm_bias",
                                 "linear_proj.bias"], ["--to-tp", "1", "--to-pp", "2"]),
    ("tiny-mla-moe", {"tp": 1, "ep": 2}, 24, ["linear_q_proj.weight", "linear_kv_up_proj.layer_norm_weight"], ["--to-ep", "1", "--to-tp", "2"]),
]


def _named(preset: str, tail: str) -> str:
    """A layer tensor's name in `preset`'s checkpoint (the MoE preset keys each layer apart: its MoE layer 1's)."""
    return ATTENTION.replace("layers.", "layers.1.") + tail if preset == "tiny-mla-moe" else ATTENTION + tail


@pytest.mark.parametrize("preset, layout, params, mla, target", CASES, ids=["tiny-mla-tp2dp2", "tiny-mla-moe-ep2dp4"])
def test_mla_buffers_read_bit_for_bit_as_megatrons_fully_reshardable(distrib_optim, tmp_path, preset, layout, params, mla, target):
    """dp_reshardable and the legacy distrib_optim.pt (the same buffer layout, coalesced) decode to every optimizer tensor
    of Megatron's own fully_reshardable save, bit for bit; the decoded master weights are the saved weights; converted to
    another layout, the dp_reshardable source gives what converting the fully_reshardable one gives."""
    made = distrib_optim(preset, **layout)
    dp, dp_common = optimizer_tensors(made["dp"])
    full, full_common = optimizer_tensors(made["full"])
    legacy, legacy_common = optimizer_tensors(made["legacy"], LegacyReader)
    assert len(dp) == 3 * params and all(f"optimizer.state.exp_avg.{_named(preset, tail)}" in dp for tail in mla)
    assert_same(dp, full)
    assert_same(legacy, full)
    assert dp_common == full_common == legacy_common
    assert master_weights_are_the_model(made["dp"], dp) == []
    assert all(np.any(t != 0) for name, t in dp.items() if ".exp_avg" in name)  # two real Adam steps
    for form in ("dp", "full"):
        out = reshard("convert", made[form], tmp_path / form, *target)
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert len(assert_converted_alike(tmp_path / "dp", tmp_path / "full")) == 3 * params


def test_te_ordered_mla_buffers_decode_bit_for_bit_as_megatrons_fully_reshardable(distrib_optim):
    """The Transformer-Engine spec's MLA order at TP1 DP4, its latent norms owned by the up projections (each right
    before its projection's weight): megatron-core's DDP laying its buffers out in that order (fixture `te_order`) saves
    state that decodes to its own fully_reshardable save bit for bit, the norm on the other side of the weight than in
    the local spec's buffer."""
    te = distrib_optim("tiny-mla", tp=1, te_order=True)
    dp, dp_common = optimizer_tensors(te["dp"])
    full, full_common = optimizer_tensors(te["full"])
    assert len(dp) == 3 * 22
    assert_same(dp, full)
    assert dp_common == full_common
    assert master_weights_are_the_model(te["dp"], dp) == []
    local = distrib_optim("tiny-mla", tp=2)["dp"]
    for up in ("linear_q_up_proj", "linear_kv_up_proj"):
        norm, weight = f"{ATTENTION}{up}.layer_norm_weight", f"{ATTENTION}{up}.weight"
        assert _start(local, norm) < _start(local, weight) and _start(te["dp"], norm) > _start(te["dp"], weight)


MLA_WRITE = Case("tiny-mla", tp=2, to_tp=1, to_pp=2, dp=2)  # TP2 DP2 -> TP1 PP2 DP2


@pytest.fixture(scope="module")
def resaved(legacy_resaved):  # noqa: F811
    """test_dp_reshardable_writer's `resaved` of tiny-mla TP2 at TP1 PP2 DP2, from the one megatron-core resave that also
    writes the legacy form (`legacy_resaved`): its dp_reshardable iteration directory and where it put each parameter."""

    def made(case: Case):
        assert case == MLA_WRITE
        out = legacy_resaved(case.preset, case.bf16, case.to_tp, case.to_pp).parent.parent / "dp"
        return out / ITER, {k: v for path in sorted(out.glob("param_ranges_*.json")) for k, v in json.loads(path.read_text()).items()}

    return made


def test_mla_written_buckets_are_megatrons_own_at_the_new_layout(distrib_optim, resaved, legacy_resaved, tmp_path):  # noqa: F811
    """`--optimizer-form dp_reshardable` and `--to-format legacy` (distrib_optim.pt) of tiny-mla TP2 DP2 at TP1 PP2 DP2 equal
    megatron-core's own saves of the same state at that layout (its DistributedOptimizer loading the fully_reshardable
    save), bucket for bucket (a shifted buffer fails the legacy comparison, its test's own control; a swap in the MLA
    order fails the dp_reshardable one, below)."""
    written_as_megatrons(distrib_optim, resaved, tmp_path / "dp", MLA_WRITE)
    written_as_megatrons_legacy(distrib_optim, legacy_resaved, tmp_path / "legacy", "tiny-mla", False, "dp", 1, 2)


def test_a_swap_in_the_mla_order_is_caught(distrib_optim, resaved, tmp_path, monkeypatch):
    """A deliberate error in reshard's MLA order (q_layernorm's weight and bias, one size, in each other's place) leaves
    every bucket length right: the decode then differs from Megatron's fully_reshardable save, the master-weight check
    refuses the conversion naming both, writing nothing, and buckets written by that order differ from Megatron's."""
    order = list(LAYER_ORDERS[("local", MULTI_LATENT)])
    weight, bias = (order.index(f"self_attention.linear_q_up_proj.layer_norm_{kind}") for kind in ("weight", "bias"))
    order[weight], order[bias] = order[bias], order[weight]
    monkeypatch.setitem(LAYER_ORDERS, ("local", MULTI_LATENT), tuple(order))
    made = distrib_optim("tiny-mla", tp=2)
    dp, _ = optimizer_tensors(made["dp"])
    full, _ = optimizer_tensors(made["full"])
    swapped = {f"{ATTENTION}linear_q_up_proj.layer_norm_{kind}" for kind in ("weight", "bias")}
    assert {name.split(".", 3)[3] for name in dp if dp[name].tobytes() != full[name].tobytes()} == swapped
    with pytest.raises(ReshardError) as refused:
        convert(made["dp"], tmp_path / "out", Target(layout=LayoutChange(tp=1)))
    assert "2 parameter(s) disagree" in str(refused.value) and str(refused.value).split(":")[0] in swapped
    assert not (tmp_path / "out").exists()
    convert(made["full"], tmp_path / "written", Target(layout=LayoutChange(tp=1, pp=2), optimizer_form="dp_reshardable", dp=2))
    resaved_dir, ranges = resaved(MLA_WRITE)
    wrong = differences(saved_state(tmp_path / "written" / ITER)[0], saved_state(resaved_dir)[0], ranges)
    assert {line.split(":")[0].rsplit(".", 1)[1] for line in wrong} == set(state_keys({}))  # on both stages (Adam's states)
    assert {line.split(".dp_group_idx_")[1][0] for line in wrong} == {"0", "1"}


@pytest.mark.parametrize(
    "changes, words",
    [({"transformer_impl": "transformer_engine"}, ["multi-latent attention", "Transformer-Engine", "TP > 1", "--no-optimizer"]),
     ({"mla_down_proj_fusion": True}, ["fused q/kv down projection", "mla_down_proj_fusion", "--no-optimizer"])],
    ids=["te-spec-tp2", "fused-down-projection"],
)
def test_mla_buffers_it_cannot_place_are_refused_in_one_line(distrib_optim, tmp_path, changes, words):
    """The TE spec at TP > 1 keeps the down projections whole on every TP rank, where the local spec splits them;
    megatron-core 0.17+'s fused q/kv down projection is another module: neither is decoded, nothing is written."""
    _with_args(distrib_optim("tiny-mla", tp=2)["dp"], tmp_path / "src", **changes)
    before = _digest(tmp_path / "src")
    result = reshard("convert", tmp_path / "src", tmp_path / "out", "--to-tp", "1")
    _one_line_error(result, *words)
    assert not (tmp_path / "out").exists() and _digest(tmp_path / "src") == before
