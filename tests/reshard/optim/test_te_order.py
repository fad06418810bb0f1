"""DistributedOptimizer buffers of a Transformer-Engine-spec model (`transformer_impl=transformer_engine`, Megatron-LM's
default), decoded by the TE parameter order of reshard/optim/order.py (`ParamOrder`).

What is and is not proven here. Transformer Engine is not installable on this machine and no TE-written save exists,
so the fixture (`distrib_optim(..., te_order=True)`) is a local-spec model whose named_parameters() yield the order
*we read* from TE's and megatron-core's source (fixtures/distrib_optim_checkpoint.py `te_named_parameters`), args
saying transformer_engine. Megatron-core's own DDP lays its buffers out by that order, trains two steps and saves
them itself; so these tests prove reshard's bucket layout for that order against Megatron's (alignment, reversal,
buckets, padding, the chained expert optimizer, grouped experts) bit for bit, NOT that TE registers its parameters
in that order: that remains our opinion, and the master-weight check (reshard/optim/master_weights.py) is the guard
that refuses a real TE save if it is wrong (shown below with the wrong order on purpose)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from reshard.formats.megatron_dist import TorchDistReader
from reshard.formats.megatron_legacy import LegacyReader
from tests.reshard.optim.test_dp_reshardable import ITER, assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.test_cli import _digest, _one_line_error, reshard

pytestmark = pytest.mark.slow  # every test reads a DistributedOptimizer run trained by Megatron-Core on 4 ranks (distrib_optim)

QKV_NORM, PROJ = "decoder.layers.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.self_attention.linear_proj.weight"
CASES = [("tiny-odd", {"tp": 2}, 21), ("tiny-moe", {"tp": 1, "ep": 2}, 10)]


def _start(path: Path, name: str) -> int:
    with TorchDistReader(path) as reader:
        return reader.optimizer.placed[(name, 0, None, 0, 0, 0)][1].start


def _with_args(source: Path, dest: Path, **changes) -> None:
    """A copy of `source` whose common.pt args say `changes` (the fixture's own file, so unpickled here)."""
    shutil.copytree(source, dest)
    common = torch.load(dest / ITER / "common.pt", weights_only=False)
    for key, value in changes.items():
        setattr(common["args"], key, value)
    torch.save(common, dest / ITER / "common.pt")


@pytest.mark.parametrize("preset, layout, params", CASES, ids=["tiny-odd-tp2", "tiny-moe-ep2-grouped"])
def test_te_ordered_buckets_decode_bit_for_bit_as_megatrons_fully_reshardable(distrib_optim, tmp_path, preset, layout, params):
    te = distrib_optim(preset, te_order=True, **layout)
    with TorchDistReader(te["dp"]) as reader:
        assert reader.common.args["transformer_impl"] == "transformer_engine"
        assert reader.optimizer.buffer_layout.order.grouped_experts == (preset == "tiny-moe")
    dp, dp_common = optimizer_tensors(te["dp"])
    full, full_common = optimizer_tensors(te["full"])
    assert len(dp) == 3 * params
    assert_same(dp, full)
    assert dp_common == full_common
    assert master_weights_are_the_model(te["dp"], dp) == []
    # the input norm moved: after linear_proj in TE's named_parameters, so before it in the reversed buffer
    local = distrib_optim(preset, **layout)["dp"]
    assert _start(local, QKV_NORM) > _start(local, PROJ) and _start(te["dp"], QKV_NORM) < _start(te["dp"], PROJ)
    target = ["--to-tp", "1"] if preset == "tiny-odd" else ["--to-ep", "1"]
    for form in ("dp", "full"):
        out = reshard("convert", te[form], tmp_path / form, *target)
        assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    assert_converted_alike(tmp_path / "dp", tmp_path / "full")


def test_te_ordered_distrib_optim_pt_decodes_as_megatrons_fully_reshardable(distrib_optim):
    """The legacy format's distrib_optim.pt (megatron-core's own save_parameter_state of the TE-ordered buffers; the
    model file's norms renamed as TE names them)."""
    te = distrib_optim("tiny-odd", tp=2, te_order=True)
    legacy, _ = optimizer_tensors(te["legacy"], LegacyReader)
    assert_same(legacy, optimizer_tensors(te["full"])[0])


def test_sequential_order_on_grouped_experts_is_refused_by_the_master_weights(distrib_optim, tmp_path):
    """Grouped and sequential experts give every bucket the same length (each expert's fc1 and fc2 are one size),
    so only the master-weight check can tell: the TE save claimed as SequentialMLP (moe_grouped_gemm off) is refused
    in one line naming an expert tensor, and nothing is written."""
    _with_args(distrib_optim("tiny-moe", tp=1, ep=2, te_order=True)["dp"], tmp_path / "bad", moe_grouped_gemm=False)
    before = _digest(tmp_path / "bad")
    result = reshard("convert", tmp_path / "bad", tmp_path / "out", "--to-ep", "1")
    _one_line_error(result, "decoder.layers.mlp.experts.experts.linear_fc", "the fp32 master weights decoded", "--no-optimizer")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.reshard-*"))
    assert _digest(tmp_path / "bad") == before


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_the_other_specs_order_is_refused(distrib_optim, tmp_path, impl):
    """A save decoded with the other spec's order (the TE save claimed local, the local save claimed TE) is refused
    in one line, by the bucket lengths or the master weights, whichever sees it first."""
    made = distrib_optim("tiny-odd", tp=2, te_order=impl == "local")["dp"]
    _with_args(made, tmp_path / "bad", transformer_impl=impl)
    result = reshard("convert", tmp_path / "bad", tmp_path / "out", "--to-tp", "1")
    _one_line_error(result, "cannot be decoded safely")
    assert not (tmp_path / "out").exists()
