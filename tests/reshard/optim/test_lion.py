"""Lion's DistributedOptimizer state (megatron-core 0.19.2's `--optimizer lion`: each parameter's fp32 master weights and
one moment, `exp_avg`), decoded and written by the moments its args name (`reshard.optim.state.MOMENTS`), against
megatron-core's own saves and loads of the same state: fixtures/bridge_vl_distrib_optim.py --optimizer lion trains
Megatron-Bridge 0.6.2's tiny Qwen2.5-VL two steps with megatron-core 0.19.2's DistributedOptimizer over Lion on 2 CPU
ranks (TP1 DP2) and saves the state as dp_reshardable and as fully_reshardable (a minimal torch Lion stands in for
emerging_optimizers', which is not installed: what is proven is megatron-core's layout of the state, not the update
rule). One run, shared by the tests; they need Bridge's venv (skipped, visibly, without it).

Lion's state in the legacy `distrib_optim.pt` has megatron-core 0.19.2's own `save_parameter_state` and
`load_parameter_state` as its oracle: fixtures/distrib_optim_lion.py trains Bridge's tiny Llama (megatron-core's GPTModel;
Megatron-LM's legacy files hold no vision tower) two Lion steps at TP1 DP2 and saves the state as fully_reshardable
and, as Megatron-LM's `--ckpt-format torch` does, in `mp_rank_*/model_optim_rng.pt` beside `distrib_optim.pt`."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.formats.megatron_dist import TorchDistReader
from reshard.formats.megatron_legacy import LegacyReader
from reshard.optim import order
from reshard.optim.dp_reshardable import DpReshardable
from reshard.request import LayoutChange, Target
from tests.bridge import bridge, require_bridge
from tests.cache import built
from tests.converters.hf_models import build
from tests.reshard.optim.test_dp_reshardable import assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.test_cli import _one_line_error, reshard

pytestmark = pytest.mark.slow  # a run trained by Megatron-Bridge's model on 2 ranks, and megatron-core's load of reshard's output

PARAMS = 40  # the tiny Qwen2.5-VL's trained tensors (tests/reshard/optim/test_vl_order.py)
ITER = "iter_0000002"
STORED = {"dp": "dp_reshardable", "legacy": "distrib_optim.pt"}  # a run's folder -> its form as `inspect` names it


# Each shared Lion run: (its tiny HF model, the flags of reshard's torch_dist of it that gives the run its args, that
# output's iteration, the fixture and its flags). Bridge records no data-parallel size, hence reshard's args.
RUNS = {
    "vl": ("qwen2_5_vl", ["--for", "bridge"], "iter_0000000", "bridge_vl_distrib_optim.py", ["--optimizer", "lion"]),  # 'dp', 'full'
    "legacy": ("llama", [], "release", "distrib_optim_lion.py", []),  # 'full', 'legacy'
}


def trained(out, run: str) -> dict:
    """The fixture's Lion run `run` (RUNS), saved under `out`."""
    family, flags, iteration, script, extra = RUNS[run]
    hf = build(family, out / "hf")
    assert reshard("convert", hf, out / "args", "--to-format", "torch_dist", *flags, "-q").returncode == 0
    bridge(hf, out / "args" / iteration, out, *extra, script=script)
    return {"hf": hf, "dp": out / "dp", "full": out / "full", "legacy": out / "legacy"}


@pytest.fixture(scope="session")
def lion(tmp_path_factory):
    require_bridge()
    return built(tmp_path_factory, trained, "vl")


def assert_decoded_as_megatrons_own(run: dict, form: str, params: int, open_reader=TorchDistReader) -> None:
    """`run[form]` decodes to megatron-core's own fully_reshardable save of the same Lion state, bit for bit: the master
    weights and exp_avg of each of the `params` parameters, no exp_avg_sq; the master weights are the saved weights;
    every moment was trained (non-zero); `inspect` names the form, the optimizer and its moment."""
    got, got_common = optimizer_tensors(run[form], open_reader)
    full, full_common = optimizer_tensors(run["full"])
    assert len(got) == 2 * params and {name.split(".")[2] for name in got} == {"param", "exp_avg"}
    assert_same(got, full)
    assert got_common == full_common
    assert master_weights_are_the_model(run["full"], got) == []
    assert all(np.any(t != 0) for name, t in got.items() if ".exp_avg." in name)
    out = reshard("inspect", run[form])
    shown = f"optimizer: {STORED[form]}, DP 2, 1 buckets over 1 model-parallel ranks; lion (exp_avg)"
    assert out.returncode == 0 and shown in out.stdout, out.stdout


def test_lions_buckets_read_bit_for_bit_as_megatrons_fully_reshardable(lion):
    """megatron-core 0.19.2's dp_reshardable buckets of Lion decode as its own fully_reshardable save."""
    assert_decoded_as_megatrons_own(lion, "dp", PARAMS)


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


TEXT_PARAMS = 9  # the tiny Llama's trained tensors (stacked over its layers)


@pytest.fixture(scope="session")
def lion_legacy(tmp_path_factory):
    require_bridge()
    return built(tmp_path_factory, trained, "legacy")


def test_lions_distrib_optim_pt_reads_bit_for_bit_as_megatrons_fully_reshardable(lion_legacy):
    """megatron-core 0.19.2's `save_parameter_state` of Lion writes each buffer's `param` and `exp_avg` only, which
    reshard decodes as its own fully_reshardable save (`assert_decoded_as_megatrons_own`)."""
    saved = torch.load(lion_legacy["legacy"] / ITER / "mp_rank_00" / "distrib_optim.pt", weights_only=True)
    assert [set(tensors) for tensors in saved[0].values()] == [{"param", "exp_avg", "numel_unpadded"}]
    assert_decoded_as_megatrons_own(lion_legacy, "legacy", TEXT_PARAMS, LegacyReader)


def test_megatron_loads_reshards_tp2_lion_distrib_optim_pt_as_the_state_it_saved(lion_legacy, tmp_path):
    """reshard's legacy output at TP2 DP1 (from TP1 DP2) is loaded by megatron-core 0.19.2 as Megatron-LM's
    `--ckpt-format torch` load does (each rank's model_optim_rng.pt, then `load_parameter_state` of the distrib_optim.pt
    beside it) into the model and its Lion DistributedOptimizer at TP2; what it loaded, saved again as fully_reshardable,
    is its original fully_reshardable save, master weights and exp_avg bit for bit."""
    out = reshard("convert", lion_legacy["legacy"], tmp_path / "tp2", "--to-tp", "2", "--to-dp", "1")
    assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert sorted(p.parent.name for p in (tmp_path / "tp2" / ITER).glob("mp_rank_*/distrib_optim.pt")) == ["mp_rank_00", "mp_rank_01"]
    bridge(lion_legacy["hf"], tmp_path / "tp2" / ITER, tmp_path / "loaded", "--load", "--tp", "2", script="distrib_optim_lion.py")
    loaded, loaded_common = optimizer_tensors(tmp_path / "loaded" / "resaved")
    full, full_common = optimizer_tensors(lion_legacy["full"])
    assert_same(loaded, full)
    assert loaded_common == full_common


def test_a_shifted_lion_bucket_or_adams_moments_expected_fail_against_megatrons_own(lion_legacy, tmp_path):
    """The comparison can fail: megatron-core's distrib_optim.pt with its exp_avg buffer shifted by one element decodes
    to values that differ from its fully_reshardable save; the same files under args that say adam (whose exp_avg_sq
    they lack) are refused in one line, writing nothing."""
    full, _ = optimizer_tensors(lion_legacy["full"])
    shifted = tmp_path / "shifted"
    shutil.copytree(lion_legacy["legacy"], shifted)
    path = shifted / ITER / "mp_rank_00" / "distrib_optim.pt"
    state = torch.load(path, weights_only=True)
    (tensors,) = state[0].values()
    tensors["exp_avg"] = torch.roll(tensors["exp_avg"], 1)
    torch.save(state, path)
    with pytest.raises(AssertionError, match="exp_avg.* differs"):
        assert_same(optimizer_tensors(shifted, LegacyReader)[0], full)
    adam = tmp_path / "adam"
    shutil.copytree(lion_legacy["legacy"], adam)
    path = adam / ITER / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["args"].optimizer = "adam"
    torch.save(state, path)
    result = reshard("convert", adam, tmp_path / "out", "--to-tp", "2", "--to-dp", "1")
    _one_line_error(result, "distrib_optim.pt", "holds no exp_avg_sq, which the args' --optimizer adam (exp_avg, exp_avg_sq) keeps")
    assert not (tmp_path / "out").exists()
