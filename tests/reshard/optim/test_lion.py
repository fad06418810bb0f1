"""Lion's DistributedOptimizer state (megatron-core 0.19.2's `--optimizer lion`: each parameter's fp32 master weights and
one moment, `exp_avg`), decoded and written by the moments its args name (`reshard.optim.state.MOMENTS`), against
megatron-core's own saves and loads of the same state: fixtures/bridge_vl_distrib_optim.py --optimizer lion trains
Megatron-Bridge 0.6.2's tiny Qwen2.5-VL two steps with megatron-core 0.19.2's DistributedOptimizer over Lion on 2 CPU
ranks (TP1 DP2) and saves the state as dp_reshardable and as fully_reshardable (a minimal torch Lion stands in for
emerging_optimizers', which is not installed: what is proven is megatron-core's layout of the state, not the update
rule). One run, shared by the tests; they need Bridge's venv (skipped, visibly, without it)."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.formats.megatron_dist import TorchDistReader
from reshard.optim import order
from reshard.optim.dp_reshardable import DpReshardable
from reshard.request import LayoutChange, Target
from tests.bridge import BRIDGE_PYTHON, bridge
from tests.cache import built
from tests.converters.hf_models import build
from tests.reshard.optim.test_dp_reshardable import assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.test_cli import reshard

pytestmark = pytest.mark.slow  # a run trained by Megatron-Bridge's model on 2 ranks, and megatron-core's load of reshard's output

PARAMS = 40  # the tiny Qwen2.5-VL's trained tensors (tests/reshard/optim/test_vl_order.py)
ITER = "iter_0000002"


def trained(out):
    """The fixture's Lion run on the tiny Qwen2.5-VL, saved under `out` ('dp', 'full'); its args from reshard's own
    torch_dist of the same HF model (Bridge records no data-parallel size)."""
    hf = build("qwen2_5_vl", out / "hf")
    assert reshard("convert", hf, out / "args", "--to-format", "torch_dist", "--for", "bridge", "-q").returncode == 0
    bridge(hf, out / "args" / "iter_0000000", out, "--optimizer", "lion", script="bridge_vl_distrib_optim.py")
    return {"hf": hf, "dp": out / "dp", "full": out / "full"}


@pytest.fixture(scope="session")
def lion(tmp_path_factory):
    if not BRIDGE_PYTHON.is_file():
        pytest.skip(f"Megatron-Bridge's venv is not here ({BRIDGE_PYTHON}; BRIDGE_VENV, ../shared/peers/setup_bridge.sh)")
    return built(tmp_path_factory, trained)


def test_lions_buckets_read_bit_for_bit_as_megatrons_fully_reshardable(lion):
    """dp_reshardable decodes to megatron-core's own fully_reshardable save of the same Lion state, bit for bit: the
    master weights and exp_avg of every parameter, no exp_avg_sq; the master weights are the saved weights; every
    moment was trained (non-zero); `inspect` names the optimizer and its moment."""
    dp, dp_common = optimizer_tensors(lion["dp"])
    full, full_common = optimizer_tensors(lion["full"])
    assert len(dp) == 2 * PARAMS and {name.split(".")[2] for name in dp} == {"param", "exp_avg"}
    assert_same(dp, full)
    assert dp_common == full_common
    assert master_weights_are_the_model(lion["dp"], dp) == []
    assert all(np.any(t != 0) for name, t in dp.items() if ".exp_avg." in name)
    out = reshard("inspect", lion["dp"])
    assert out.returncode == 0 and "optimizer: dp_reshardable, DP 2, 1 buckets over 1 model-parallel ranks; lion (exp_avg)" in out.stdout, out.stdout


def test_megatron_loads_reshards_tp2_lion_buckets_as_the_state_it_saved(lion, tmp_path):
    """reshard's dp_reshardable output at TP2 DP1 (from the TP1 DP2 buckets) is loaded by megatron-core 0.19.2 into the
    model and its Lion DistributedOptimizer at TP2; what it loaded, saved again as fully_reshardable, is its original
    fully_reshardable save, master weights and exp_avg bit for bit. Converting either form to TP2 gives the same."""
    out = reshard("convert", lion["dp"], tmp_path / "tp2", "--to-tp", "2", "--to-dp", "1", "--optimizer-form", "dp_reshardable",
                  "--for", "bridge")
    assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    bridge(lion["hf"], tmp_path / "tp2" / ITER, tmp_path / "loaded", "--load", "dp_reshardable", "--tp", "2", "--optimizer", "lion",
           script="bridge_vl_distrib_optim.py")
    loaded, loaded_common = optimizer_tensors(tmp_path / "loaded" / "resaved")
    full, full_common = optimizer_tensors(lion["full"])
    assert_same(loaded, full)
    assert loaded_common == full_common
    assert reshard("convert", lion["full"], tmp_path / "full-tp2", "--to-tp", "2", "--to-dp", "1", "--optimizer-form", "dp_reshardable",
                   "--for", "bridge").returncode == 0
    assert len(assert_converted_alike(tmp_path / "tp2", tmp_path / "full-tp2")) == 2 * PARAMS


def test_a_misread_lion_state_fails_against_megatrons_own(lion, tmp_path, monkeypatch):
    """The comparison can fail: exp_avg read from the master weights' buckets differs from megatron-core's save; the
    vision tower placed after the language model (the buckets' lengths unchanged) differs too, and the master-weight
    check refuses converting it, writing nothing."""
    full, _ = optimizer_tensors(lion["full"])
    read_place = DpReshardable._read_place
    with monkeypatch.context() as m:
        m.setattr(DpReshardable, "_read_place", lambda self, gbuf, place, state, first, out: read_place(self, gbuf, place, "param", first, out))
        with pytest.raises(AssertionError, match="exp_avg.* differs"):
            assert_same(optimizer_tensors(lion["dp"])[0], full)
    monkeypatch.setattr(order, "TOWERS_AT", 1)
    with pytest.raises(AssertionError, match="differs"):
        assert_same(optimizer_tensors(lion["dp"])[0], full)
    with pytest.raises(ReshardError, match="parameter\\(s\\) disagree"):
        convert(lion["dp"], tmp_path / "out", Target(layout=LayoutChange(tp=2)))
    assert not (tmp_path / "out").exists()


def test_lions_state_under_args_that_say_adam_is_refused_writing_nothing(lion, tmp_path, monkeypatch):
    """The same buckets read as the args of an Adam run would have them (exp_avg_sq too): refused in one line."""
    architecture = TorchDistReader._architecture
    monkeypatch.setattr(TorchDistReader, "_architecture", lambda self, *args: {**architecture(self, *args), "optimizer": "adam"})
    with pytest.raises(ReshardError, match="holds no exp_avg_sq, which the args' --optimizer adam \\(exp_avg, exp_avg_sq\\) keeps") as refused:
        convert(lion["dp"], tmp_path / "out", Target(layout=LayoutChange(tp=2)))
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()
