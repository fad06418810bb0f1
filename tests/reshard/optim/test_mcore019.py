"""megatron-core 0.19's DistributedOptimizer state in the form Megatron-LM 0.19 saves by default (dp_reshardable),
read against megatron-core 0.19's own view of the same state.

The golden fixture `mcore019-distopt-tp2dp2` (fixtures/golden/make_mcore_distopt.py --version 0.19) is megatron-core
0.19.2's save at TP2 DP2 of tiny-odd (2 layers, bf16 parameters, fp32 master weights) after two Adam steps; its
`oracle.safetensors` is each parameter's fp32 master weight / exp_avg / exp_avg_sq as megatron-core 0.19 itself
loaded the save back (at TP2 DP2), saved it as fully_reshardable and loaded that into a DistributedOptimizer at TP1 DP1."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.numpy import load_file

from fixtures.torchrun import REPO
from reshard.dtypes import numpy_dtype
from reshard.formats.megatron_dist import TorchDistReader
from reshard.sharding import full_region
from reshard.torchfile import dcp_metadata
from reshard.torchfile.dcp_metadata import Storage
from tests.reshard.optim.test_dp_reshardable import STATES, assert_same, optimizer_tensors
from tests.reshard.optim.test_flattened_range import megatron_016_dump
from tests.reshard.test_cli import _digest, _one_line_error, reshard

GOLDEN = REPO / "fixtures" / "golden" / "mcore019-distopt-tp2dp2"
CHECKPOINT, ORACLE = GOLDEN / "checkpoint", GOLDEN / "oracle.safetensors"
ITER = "iter_0000002"
BUCKET = "optimizer.distributed.dp_group_idx_{group}.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.{state}"


def test_the_golden_is_megatron_019s_default_save():
    """What megatron-core 0.19 writes: the buckets as flat tensors (one per TP rank's DP group), each parameter's range
    and its alignment padding a chunk of its own; the common state inside the .distcp files (no common.pt)."""
    metadata = dcp_metadata.load(CHECKPOINT / ITER / ".metadata")
    assert not (CHECKPOINT / ITER / "common.pt").exists()
    assert any(key.startswith("common_state/") for key, _ in metadata.storage)
    assert not any(key.startswith("optimizer.state.") for key in metadata.tensors)
    for group in (0, 1):
        for state in STATES:
            entry = metadata.tensors[BUCKET.format(group=group, state=state)]
            assert entry.size == (30720,) and len(entry.chunks) > 2
    with TorchDistReader(CHECKPOINT) as reader:
        assert reader.common.extra["content_metadata"] == {
            "distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True, "singleton_local_shards": False
        }
        assert {spec.dtype for spec in reader.specs.values() if not spec.is_optimizer} == {"bfloat16"}


def _model_tensors(path: Path) -> dict[str, np.ndarray]:
    with TorchDistReader(path) as reader:
        out = {}
        for name, spec in reader.specs.items():
            if not spec.is_optimizer:
                out[name] = np.empty(spec.shape, numpy_dtype(spec.dtype))
                reader.read_into(name, full_region(spec.shape), out[name])
        return out


def test_reads_bit_for_bit_as_megatron_019_loads_it():
    oracle = load_file(ORACLE)
    found, optimizer = optimizer_tensors(CHECKPOINT)
    assert len(oracle) == 63  # 21 parameters x (param, exp_avg, exp_avg_sq)
    assert_same(found, oracle)
    assert all(np.any(t != 0) for name, t in found.items() if ".exp_avg" in name)  # two real Adam steps
    # megatron-core copied the fp32 master weights into its bf16 model after the step: the saved weights are the
    # oracle's master weights rounded to bf16
    model = _model_tensors(CHECKPOINT)
    assert len(model) == 21
    masters = {name: oracle[f"optimizer.state.param.{name}"] for name in model}
    for name, weights in model.items():
        assert masters[name].astype(ml_dtypes.bfloat16).tobytes() == weights.tobytes(), name
    assert all(masters[name].tobytes() != weights.astype(np.float32).tobytes() for name, weights in model.items())  # not bf16 values
    assert optimizer["param_state_sharding_type"] == "fully_reshardable"  # as reshard presents the decoded buckets
    steps = {g["step"] for g in optimizer["optimizer"]["param_groups"]}
    assert steps == {float(safe_open(ORACLE, "np").metadata()["step"])} == {2.0}


def test_inspect_names_the_form():
    out = reshard("inspect", CHECKPOINT)
    assert out.returncode == 0, out.stderr
    assert "optimizer: dp_reshardable, DP 2, 2 buckets over 2 model-parallel ranks" in out.stdout


@pytest.mark.slow  # launches megatron-core 0.16 to load what it converts
@pytest.mark.parametrize(
    "target, form, dp",
    [
        (["--to-tp", "1", "--to-pp", "2"], "fully_reshardable", 1),
        (["--to-tp", "1", "--optimizer-form", "dp_reshardable", "--to-dp", "2"], "dp_reshardable", 2),
    ],
    ids=["tp1pp2-fully_reshardable-loaded-at-pp1dp1", "tp1dp2-dp_reshardable-loaded-at-dp2"],
)
def test_converted_loads_in_megatron_016_with_the_oracles_state(tmp_path, target, form, dp):
    """reshard's output at TP1 PP2 (fully_reshardable), loaded by megatron-core 0.16 into its DistributedOptimizer at
    TP1 PP1 DP1 (megatron-core's own load joins the stages), or at TP1 in dp_reshardable for DP2, loaded at DP2 (each
    rank its own ranges), holds megatron-core 0.19's state bit for bit."""
    out = reshard("convert", CHECKPOINT, tmp_path / "converted", *target)
    assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    oracle = load_file(ORACLE)
    found, _ = optimizer_tensors(tmp_path / "converted")
    assert_same(found, oracle)
    proc = megatron_016_dump("0.19", tmp_path / "converted" / ITER, form, tmp_path / "loaded.safetensors", dp)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert_same(load_file(tmp_path / "loaded.safetensors"), oracle)
    assert safe_open(tmp_path / "loaded.safetensors", "np").metadata()["step"] == "2.0"


def _shift_bucket(dest: Path, group: int, by: int) -> None:
    """A copy of the golden whose DP group `group` (one TP rank's) bucket holds its values `by` elements later (all
    three states): each chunk's new values appended to the .distcp file that held it, .metadata pointed at them."""
    shutil.copytree(CHECKPOINT, dest)
    directory = dest / ITER
    metadata = dcp_metadata.load(directory / ".metadata")
    for state in STATES:
        key = BUCKET.format(group=group, state=state)
        bucket = torch.empty(metadata.tensors[key].size, dtype=torch.float32)
        dcp.load({key: bucket}, checkpoint_id=directory, no_dist=True)  # torch's own reader of megatron's save
        shifted = torch.roll(bucket, by)
        for chunk in metadata.tensors[key].chunks:
            (start,), (size,) = chunk.offsets, chunk.sizes
            blob = io.BytesIO()
            torch.save(shifted[start : start + size].clone(), blob)
            old = metadata.storage[(key, (start,))]
            path = directory / old.relative_path
            offset = path.stat().st_size
            with open(path, "ab") as f:
                f.write(blob.getvalue())
            metadata.storage[(key, (start,))] = Storage(old.relative_path, offset, len(blob.getvalue()))
    dcp_metadata.save(directory / ".metadata", metadata)


@pytest.mark.parametrize("group, first, disagree", [
    (0, "decoder.final_layernorm.bias", 21),  # TP rank 0: its replicated parameters' master weights are the ones read
    (1, "decoder.layers.mlp.linear_fc1.bias", 8),  # TP rank 1: only its slices of the 8 TP-split parameters
])
def test_a_shifted_bucket_is_refused_in_one_line_naming_the_tensor(tmp_path, group, first, disagree):
    """A TP rank's bucket shifted by one parameter alignment (64 elements): its lengths are all right, so only the
    master weights show it; reading it against the oracle shows the same shift."""
    _shift_bucket(tmp_path / "bad", group, 64)
    found, _ = optimizer_tensors(tmp_path / "bad")
    oracle = load_file(ORACLE)
    with pytest.raises(AssertionError, match="differs"):
        assert_same(found, oracle)
    before = _digest(tmp_path / "bad")
    result = reshard("convert", tmp_path / "bad", tmp_path / "out", "--to-tp", "1", "--to-pp", "2")
    _one_line_error(result, f"{first}: the fp32 master weights decoded", f"({disagree} parameter(s) disagree)", "--no-optimizer")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.reshard-*"))
    assert _digest(tmp_path / "bad") == before
