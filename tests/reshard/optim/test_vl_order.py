"""DistributedOptimizer state of Megatron-Bridge's Qwen2.5-VL (its HF vision tower `visual.*` beside the language
model under `language_model.`), Qwen3-VL (its vision model in Megatron form, blocks and DeepStack mergers stacked) and
Qwen3-VL-MoE (the same beside an MoE language model, trained at EP2: the experts in an optimizer of their own),
decoded and written by reshard/optim/order.py's tower order, against megatron-core's own fully_reshardable save of the
same state: fixtures/bridge_vl_distrib_optim.py trains Bridge 0.6.2's model two steps with megatron-core 0.19.2's
DistributedOptimizer on 2 CPU ranks (TP1 DP2) and saves it in both forms. Where Bridge's venv is, the run is made
afresh (and Qwen2.5-VL's must hold the committed golden's state); elsewhere (CI) Qwen2.5-VL's golden
fixtures/golden/bridge-qwen2_5_vl-distopt/, that run's saves as the fixture wrote them, is read instead; Qwen3-VL's
and Qwen3-VL-MoE's saves (6.4 MB) have no golden, so their tests need Bridge's venv.

Bridge registers the vision tower before the language model, so the buffers (laid out in reverse) hold the language
model first and the tower last. Loading reshard's output into Bridge's model, and the frozen run, need Bridge's venv:
without it those are skipped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.optim import order
from reshard.request import LayoutChange, Target
from tests.bridge import BRIDGE_PYTHON, bridge
from tests.cache import built
from tests.converters.hf_models import build
from tests.reshard.optim.test_dp_reshardable import assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.test_cli import reshard

pytestmark = pytest.mark.slow  # each reads a run trained by Megatron-Bridge's model on 2 ranks (about 90 s, once per test run)

PARAMS = 40  # Qwen2.5-VL's tiny model: 30 vision-tower tensors and 10 of the language model (stacked), every one trained
MERGER = 5  # the vision projection's tensors: with freeze_vision_model, the tower's only trained ones


# the tiny HF model of each family the fixture trains (Bridge's Qwen3-VL-MoE builds every layer MoE, whatever config.json says)
MODELS = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl_moe_all"}
# where the fixture trains each family (the experts' parallel size; the data-parallel size is 2 over both ranks)
EP = {"qwen3_vl_moe": 2}


def trained(out, family, *freeze):
    """The fixture's run on the tiny `family` model (Bridge's `freeze` parts frozen), saved under `out` ('dp', 'full');
    its args from reshard's own torch_dist of the same HF model (Bridge records no data-parallel size)."""
    hf = build(MODELS[family], out / "hf")
    assert reshard("convert", hf, out / "args", "--to-format", "torch_dist", "--for", "bridge", "-q").returncode == 0
    bridge(hf, out / "args" / "iter_0000000", out, "--family", family, "--ep", EP.get(family, 1),
           *(["--freeze", *freeze] if freeze else []), script="bridge_vl_distrib_optim.py")
    return {"hf": hf, "dp": out / "dp", "full": out / "full"}


GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "golden" / "bridge-qwen2_5_vl-distopt"
NO_BRIDGE = f"Megatron-Bridge's venv is not here ({BRIDGE_PYTHON}; BRIDGE_VENV, ../shared/peers/setup_bridge.sh)"


def _run(tmp_path_factory, family, *freeze):
    if not BRIDGE_PYTHON.is_file():
        pytest.skip(NO_BRIDGE)
    return built(tmp_path_factory, trained, family, *freeze)


@pytest.fixture(scope="session")
def vl_optim(tmp_path_factory):
    """Bridge's run made here, or its committed saves where Bridge's venv is absent (no HF model then)."""
    if not BRIDGE_PYTHON.is_file():
        return {"dp": GOLDEN / "dp", "full": GOLDEN / "full"}
    return _run(tmp_path_factory, "qwen2_5_vl")


@pytest.fixture(scope="session")
def frozen_vl_optim(tmp_path_factory):
    return _run(tmp_path_factory, "qwen2_5_vl", "vision_model")


@pytest.fixture(scope="session")
def qwen3_vl_optim(tmp_path_factory):
    """Bridge's Qwen3-VL run (no golden: its saves are 6.4 MB)."""
    return _run(tmp_path_factory, "qwen3_vl")


@pytest.fixture(scope="session")
def qwen3_vl_moe_optim(tmp_path_factory):
    """Bridge's Qwen3-VL-MoE run at EP2 (no golden, as Qwen3-VL's)."""
    return _run(tmp_path_factory, "qwen3_vl_moe")


def test_the_golden_holds_what_the_fixture_writes(vl_optim):
    """The committed saves hold the state the fixture's run saves here: every optimizer tensor, to the rounding of
    another CPU's kernels (two Adam steps amplify a last-bit difference in a gradient to ~2e-5 of a tensor's largest
    value; a tensor placed or ordered otherwise differs by its whole size)."""
    if not BRIDGE_PYTHON.is_file():
        pytest.skip(NO_BRIDGE)
    for form in ("dp", "full"):
        golden, fresh = optimizer_tensors(GOLDEN / form)[0], optimizer_tensors(vl_optim[form])[0]
        assert sorted(golden) == sorted(fresh)
        for name, want in golden.items():
            assert fresh[name].dtype == want.dtype and fresh[name].shape == want.shape, name
            np.testing.assert_allclose(fresh[name], want, rtol=0, atol=1e-4 * float(np.abs(want).max()), err_msg=name)


def test_vl_buffers_read_bit_for_bit_as_megatrons_fully_reshardable(vl_optim, tmp_path):
    """dp_reshardable decodes to every optimizer tensor of megatron-core's own fully_reshardable save, bit for bit, the
    vision tower's included; the decoded master weights are the saved weights; every moment was trained (non-zero)."""
    dp, dp_common = optimizer_tensors(vl_optim["dp"])
    full, full_common = optimizer_tensors(vl_optim["full"])
    assert len(dp) == 3 * PARAMS
    assert {"optimizer.state.exp_avg.visual.patch_embed.proj.weight", "optimizer.state.exp_avg_sq.visual.merger.mlp.2.bias",
            "optimizer.state.param.language_model.decoder.layers.self_attention.linear_qkv.bias"} <= dp.keys()
    assert_same(dp, full)
    assert dp_common == full_common
    assert master_weights_are_the_model(vl_optim["dp"], dp) == []
    assert all(np.any(t != 0) for name, t in dp.items() if ".exp_avg" in name)


@pytest.mark.parametrize("form", [[], ["--optimizer-form", "dp_reshardable"]], ids=["fully_reshardable", "dp_reshardable"])
def test_vl_state_converted_to_tp2_is_what_megatrons_own_save_converts_to(vl_optim, tmp_path, form):
    """TP1 DP2 -> TP2 (DP2), written in either form: the dp_reshardable source gives what converting megatron-core's
    fully_reshardable save gives, every tensor bit for bit, and the output verifies."""
    for source in ("dp", "full"):
        out = reshard("convert", vl_optim[source], tmp_path / source, "--to-tp", "2", *form)
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert len(assert_converted_alike(tmp_path / "dp", tmp_path / "full")) == 3 * PARAMS


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_megatron_loads_reshards_tp2_buffers_as_the_state_it_saved(family, request, tmp_path):
    """reshard's dp_reshardable output at TP2 DP1 (from the TP1 DP2 buckets, Qwen3-VL-MoE's from EP2's two optimizers
    into one; the vocabulary unpadded, as Bridge keeps it) is loaded by megatron-core 0.19.2 into Bridge's model and
    DistributedOptimizer at TP2 DP1; what it loaded, saved again as fully_reshardable, is its original
    fully_reshardable save, every tensor bit for bit."""
    run = request.getfixturevalue({"qwen2_5_vl": "vl_optim", "qwen3_vl": "qwen3_vl_optim", "qwen3_vl_moe": "qwen3_vl_moe_optim"}[family])
    if "hf" not in run:
        pytest.skip(NO_BRIDGE)
    out = reshard("convert", run["dp"], tmp_path / "tp2", "--to-tp", "2", "--to-ep", "1", "--to-dp", "1", "--optimizer-form",
                  "dp_reshardable", "--for", "bridge")
    assert out.returncode == 0, out.stderr
    bridge(run["hf"], tmp_path / "tp2" / "iter_0000002", tmp_path / "loaded", "--family", family, "--load", "dp_reshardable",
           "--tp", "2", script="bridge_vl_distrib_optim.py")
    loaded, loaded_common = optimizer_tensors(tmp_path / "loaded" / "resaved")
    full, full_common = optimizer_tensors(run["full"])
    assert_same(loaded, full)
    assert loaded_common == (full_common[0] if family in EP else full_common)  # at EP1 no expert optimizer: one, the dense one's groups


def test_the_tower_after_the_language_model_is_caught(vl_optim, tmp_path, monkeypatch):
    """The vision tower placed after the language model (the buffer's bucket length unchanged): the decode differs from
    megatron-core's fully_reshardable save, and the master-weight check refuses the conversion, writing nothing."""
    monkeypatch.setattr(order, "TOWERS_AT", 1)
    dp, _ = optimizer_tensors(vl_optim["dp"])
    full, _ = optimizer_tensors(vl_optim["full"])
    assert any(dp[name].tobytes() != full[name].tobytes() for name in dp)
    with pytest.raises(ReshardError, match="parameter\\(s\\) disagree"):
        convert(vl_optim["dp"], tmp_path / "out", Target(layout=LayoutChange(tp=2)))
    assert not (tmp_path / "out").exists()


def test_a_frozen_vision_model_has_no_state_and_the_rest_reads_as_megatrons_own(frozen_vl_optim, tmp_path, monkeypatch):
    """Bridge's freeze_vision_model (the patch embedding and blocks without gradients, so in no buffer): the buffers
    decode to megatron-core's fully_reshardable save, the merger's and the language model's state only, and convert to
    TP2 alike; placing the frozen part in the buffers anyway is refused naming the bucket that disagrees."""
    dp, _ = optimizer_tensors(frozen_vl_optim["dp"])
    full, _ = optimizer_tensors(frozen_vl_optim["full"])
    trained = PARAMS - (30 - MERGER)
    assert len(dp) == 3 * trained and not any(".visual.blocks." in name or ".visual.patch_embed." in name for name in dp)
    assert_same(dp, full)
    trains = order.ParamOrder.of({"freeze_vision_model": True}, order.MULTI_HEAD, open_checkpoint(frozen_vl_optim["dp"]).config).trains
    assert master_weights_are_the_model(frozen_vl_optim["dp"], dp, trains) == []
    for source in ("dp", "full"):
        out = reshard("convert", frozen_vl_optim[source], tmp_path / source, "--to-tp", "2", "--optimizer-form", "dp_reshardable")
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert len(assert_converted_alike(tmp_path / "dp", tmp_path / "full")) == 3 * trained
    monkeypatch.setattr(order, "_frozen", lambda args, config: ())
    with pytest.raises(ReshardError, match="the DistributedOptimizer layout derived from the model puts bucket 0"):
        optimizer_tensors(frozen_vl_optim["dp"])


QWEN3_VL_PARAMS = 38  # Qwen3-VL's tiny model: 27 vision-model tensors (blocks and DeepStack mergers stacked) and 11 of the language model


def decodes_as_megatrons_own(run, params: int, names: set[str]) -> dict[str, np.ndarray]:
    """The run's dp_reshardable save decodes to its fully_reshardable one (returned) bit for bit, common state too:
    `params` parameters' state, `names` among it, every moment trained, the master weights the saved weights."""
    dp, dp_common = optimizer_tensors(run["dp"])
    full, full_common = optimizer_tensors(run["full"])
    assert len(dp) == 3 * params and names <= dp.keys()
    assert_same(dp, full)
    assert dp_common == full_common
    assert master_weights_are_the_model(run["dp"], dp) == []
    assert all(np.any(t != 0) for name, t in dp.items() if ".exp_avg" in name)
    return full


def test_qwen3_vl_buffers_read_bit_for_bit_as_megatrons_fully_reshardable(qwen3_vl_optim, tmp_path, monkeypatch):
    """Qwen3-VL's vision model in Megatron form: each stacked block's parameters lie in the buffers block by block, in
    Transformer Engine's layer order, between the position embedding and the DeepStack mergers. The dp_reshardable save
    decodes to megatron-core's fully_reshardable save bit for bit, every moment trained; the blocks' tensors placed in
    the family's table order instead (the fused norm before linear_proj) differ, and the conversion is refused."""
    full = decodes_as_megatrons_own(qwen3_vl_optim, QWEN3_VL_PARAMS, {
        "optimizer.state.exp_avg.vision_model.decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "optimizer.state.exp_avg_sq.vision_model.decoder.deepstack_merger_list.linear_fc2.bias",
        "optimizer.state.param.vision_model.pos_embed.weight"})
    monkeypatch.setattr(order, "_TE_LAYER_ORDER", ())
    wrong, _ = optimizer_tensors(qwen3_vl_optim["dp"])
    assert any(wrong[name].tobytes() != full[name].tobytes() for name in wrong)
    with pytest.raises(ReshardError, match="parameter\\(s\\) disagree"):
        convert(qwen3_vl_optim["dp"], tmp_path / "out", Target(layout=LayoutChange(tp=2)))
    assert not (tmp_path / "out").exists()


def test_qwen3_vl_state_converted_to_tp2_is_what_megatrons_own_save_converts_to(qwen3_vl_optim, tmp_path):
    """TP1 DP2 -> TP2 (the vision model's linear layers split over TP as megatron-core splits them), written as
    dp_reshardable: the dp_reshardable source gives what megatron-core's fully_reshardable save gives, bit for bit."""
    for source in ("dp", "full"):
        out = reshard("convert", qwen3_vl_optim[source], tmp_path / source, "--to-tp", "2", "--optimizer-form", "dp_reshardable")
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert len(assert_converted_alike(tmp_path / "dp", tmp_path / "full")) == 3 * QWEN3_VL_PARAMS


def test_a_frozen_qwen3_vl_vision_model_keeps_its_mergers_state(tmp_path_factory):
    """Qwen3VLModel.freeze's freeze_vision_model freezes the patch and position embeddings and the blocks, then gives
    the DeepStack mergers and the merger their gradients back: the buffers decode to megatron-core's fully_reshardable
    save, holding those mergers' state and the language model's only."""
    run = _run(tmp_path_factory, "qwen3_vl", "vision_model")
    dp, _ = optimizer_tensors(run["dp"])
    full, _ = optimizer_tensors(run["full"])
    frozen = (".vision_model.patch_embed.", ".vision_model.pos_embed.", ".vision_model.decoder.layers.")
    assert len(dp) == 3 * (QWEN3_VL_PARAMS - 15) and not any(part in name for name in dp for part in frozen)
    assert any(".vision_model.decoder.deepstack_merger_list." in name for name in dp)
    assert_same(dp, full)
    trains = order.ParamOrder.of({"transformer_impl": "transformer_engine", "freeze_vision_model": True}, order.MULTI_HEAD,
                                 open_checkpoint(run["dp"]).config).trains
    assert master_weights_are_the_model(run["dp"], dp, trains) == []


QWEN3_VL_MOE_PARAMS = 39  # Qwen3-VL-MoE's tiny model: Qwen3-VL's 27 vision-model tensors and 12 of the language model


def test_qwen3_vl_moe_buffers_at_ep2_read_bit_for_bit_as_megatrons_fully_reshardable(qwen3_vl_moe_optim, tmp_path, monkeypatch):
    """Qwen3-VL-MoE at EP2 (DP2): the vision model and the language model's dense parameters in one optimizer's buffers
    (the tower first in registration order), each rank's two experts in the expert optimizer's own. The dp_reshardable
    save decodes to megatron-core's fully_reshardable save bit for bit, every moment trained; the tower placed after
    the language model, or each expert's fc2 before its fc1, each differ, and the conversion is refused."""
    full = decodes_as_megatrons_own(qwen3_vl_moe_optim, QWEN3_VL_MOE_PARAMS, {
        "optimizer.state.exp_avg.language_model.decoder.layers.mlp.experts.experts.linear_fc1.weight",
        "optimizer.state.exp_avg_sq.language_model.decoder.layers.mlp.router.weight",
        "optimizer.state.param.vision_model.decoder.deepstack_merger_list.linear_fc2.bias"})
    fc2_first = (order._EXPERT_ORDER[2], order._EXPERT_ORDER[3], order._EXPERT_ORDER[0], order._EXPERT_ORDER[1])
    for sabotage, value in (("TOWERS_AT", 1), ("_EXPERT_ORDER", fc2_first)):
        with monkeypatch.context() as m:
            m.setattr(order, sabotage, value)
            wrong, _ = optimizer_tensors(qwen3_vl_moe_optim["dp"])
            assert any(wrong[name].tobytes() != full[name].tobytes() for name in wrong), sabotage
            with pytest.raises(ReshardError, match="parameter\\(s\\) disagree"):
                convert(qwen3_vl_moe_optim["dp"], tmp_path / sabotage, Target(layout=LayoutChange(tp=2, ep=1)))
            assert not (tmp_path / sabotage).exists()


def test_qwen3_vl_moe_state_converted_to_tp2_is_what_megatrons_own_save_converts_to(qwen3_vl_moe_optim, tmp_path):
    """EP2 -> TP2 EP1 (the experts back in the dense buffer after each layer's router), written as dp_reshardable: the
    dp_reshardable source gives what megatron-core's fully_reshardable save gives, bit for bit."""
    for source in ("dp", "full"):
        out = reshard("convert", qwen3_vl_moe_optim[source], tmp_path / source, "--to-tp", "2", "--to-ep", "1",
                      "--optimizer-form", "dp_reshardable")
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert len(assert_converted_alike(tmp_path / "dp", tmp_path / "full")) == 3 * QWEN3_VL_MOE_PARAMS
