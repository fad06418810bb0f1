"""megatron-core 0.14's DistributedOptimizer state in its fully_sharded_model_space form (per-parameter
`flattened_range` shards), read against megatron-core 0.14's own view of the same state.

The golden fixture `mcore014-distopt-tp2dp2` (fixtures/golden/make_mcore_distopt.py --version 0.14) is megatron-core 0.14's save at TP2
DP2 after two Adam steps; its `oracle.safetensors` is each parameter's fp32 master weight / exp_avg / exp_avg_sq as
megatron-core 0.14 itself loaded them back into a DistributedOptimizer at TP1 DP1."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from fixtures.torchrun import REPO, pythonpath
from reshard.formats.megatron_dist import TorchDistReader
from reshard.torchfile import dcp_metadata
from tests.reshard.optim.test_dp_reshardable import assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.test_cli import _digest, _one_line_error, reshard

GOLDEN = REPO / "fixtures" / "golden" / "mcore014-distopt-tp2dp2"
CHECKPOINT, ORACLE = GOLDEN / "checkpoint", GOLDEN / "oracle.safetensors"
ITER = "iter_0000002"
SPLIT = "optimizer.state.fp32_param.decoder.layers.mlp.linear_fc1.weight"  # layer 0's gate: two DP ranks' ranges


def test_the_fixture_splits_a_parameter_between_dp_ranks():
    """What makes the form hard: a rank's range that starts inside a local chunk (not only whole chunks)."""
    metadata = dcp_metadata.load(CHECKPOINT / ITER / ".metadata")
    entry = metadata.tensors[SPLIT]
    assert metadata.flattened[SPLIT] == (2, 144, 40) and entry.size == (2, 4, 1, 1440)
    assert any(chunk.offsets[-1] > 0 for chunk in entry.chunks)
    assert not any(key.startswith("optimizer.state.param.") for key in metadata.tensors)


def test_reads_bit_for_bit_as_megatron_014_loads_it():
    oracle = load_file(ORACLE)
    found, optimizer = optimizer_tensors(CHECKPOINT)
    assert len(oracle) == 63  # 21 parameters x (param, exp_avg, exp_avg_sq)
    assert_same(found, oracle)
    assert all(np.any(t != 0) for name, t in found.items() if ".exp_avg" in name)  # two real Adam steps
    assert master_weights_are_the_model(CHECKPOINT, found) == []  # an fp32 run: its master weights are its weights
    with TorchDistReader(CHECKPOINT) as reader:
        assert reader.common.extra["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert optimizer["param_state_sharding_type"] == "fully_reshardable"
    steps = {g["step"] for g in optimizer["optimizer"]["param_groups"]}
    assert steps == {float(safe_open(ORACLE, "np").metadata()["step"])} == {2.0}


def test_inspect_names_the_form():
    out = reshard("inspect", CHECKPOINT)
    assert out.returncode == 0, out.stderr
    assert "optimizer: fully_sharded_model_space, DP 2" in out.stdout


def megatron_016_dump(release: str, checkpoint: Path, form: str, out: Path, dp: int = 1):
    """megatron-core 0.16 (this venv) loads `checkpoint` (of the golden of megatron-core `release`'s model) into its
    DistributedOptimizer at TP1 DP`dp` and writes what it holds (the DP ranks' ranges gathered)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={dp}",
        str(REPO / "fixtures" / "golden" / "make_mcore_distopt.py"),
        "_dump",
        release,
        str(checkpoint),
        form,
        str(out),
    ]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=pythonpath())
    return subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


@pytest.mark.slow  # launches megatron-core 0.16 to load what it converts
def test_megatron_016_cannot_load_the_form_itself(tmp_path):
    """Why the conversion is needed: megatron-core 0.16 refuses the flattened ranges."""
    proc = megatron_016_dump("0.14", CHECKPOINT / ITER, "fully_sharded_model_space", tmp_path / "state.safetensors")
    assert proc.returncode != 0 and "flattened_range" in proc.stdout
    assert not (tmp_path / "state.safetensors").exists()


@pytest.mark.slow  # launches megatron-core 0.16 to load what it converts
@pytest.mark.parametrize(
    "target, dp",
    [(["--to-tp", "1"], 1), (["--to-tp", "1"], 2), (["--to-tp", "1", "--to-pp", "2"], 1)],
    ids=["tp2dp2-to-tp1dp1", "tp2dp2-to-tp1dp2", "tp2dp2-to-pp2-loaded-at-pp1"],
)
def test_converted_loads_in_megatron_016_with_the_oracles_state(tmp_path, target, dp):
    """reshard's fully_reshardable output at TP1 (or TP1 PP2), loaded by megatron-core 0.16 into its DistributedOptimizer
    at TP1 DP1 or DP2 (at DP2 each rank takes its own ranges, split elsewhere than the saving run's; a PP2 output is
    resharded by megatron-core's own load), holds megatron-core 0.14's state bit for bit."""
    out = reshard("convert", CHECKPOINT, tmp_path / "converted", *target)
    assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    oracle = load_file(ORACLE)
    found, _ = optimizer_tensors(tmp_path / "converted")
    assert_same(found, oracle)
    proc = megatron_016_dump("0.14", tmp_path / "converted" / ITER, "fully_reshardable", tmp_path / "loaded.safetensors", dp)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert_same(load_file(tmp_path / "loaded.safetensors"), oracle)
    assert safe_open(tmp_path / "loaded.safetensors", "np").metadata()["step"] == "2.0"


def _damage(dest: Path, how: str) -> None:
    """A copy of the fixture whose .metadata gives layer 0's split range of SPLIT (its second DP rank's part, 608
    elements at 832) 8 elements fewer (`truncated`) or drops it (`missing`)."""
    shutil.copytree(CHECKPOINT, dest)
    path = dest / ITER / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # torch's own classes: the test's copy, written by megatron-core
    chunks = metadata.state_dict_metadata[SPLIT].chunks
    i = next(i for i, c in enumerate(chunks) if tuple(c.offsets) == (0, 0, 0, 832))
    if how == "truncated":
        chunks[i].sizes = type(chunks[i].sizes)((1, 1, 1, 600))
    else:  # and the file's record of it, as when a rank's file is lost
        del chunks[i]
        metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if not (k.fqn == SPLIT and tuple(k.offset) == (0, 0, 0, 832))}
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("how, covered", [("truncated", "[0, 1432)"), ("missing", "[0, 832)")])
def test_ranges_that_do_not_tile_are_refused_in_one_line_naming_the_parameter(tmp_path, how, covered):
    _damage(tmp_path / "bad", how)
    before = _digest(tmp_path / "bad")
    result = reshard("convert", tmp_path / "bad", tmp_path / "out", "--to-tp", "1")
    _one_line_error(result, "decoder.layers.mlp.linear_fc1.weight", "local chunk [0, 0, 0]", f"{covered} of its 1440")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.reshard-*"))
    assert _digest(tmp_path / "bad") == before


def test_any_region_reads_as_the_oracles_slice():
    """Reads of parts of a tensor (convert reads slabs) that cross local chunks and DP ranges: only their spans."""
    oracle = load_file(ORACLE)
    rng = np.random.default_rng(0)
    with TorchDistReader(CHECKPOINT) as reader:
        for name in sorted(oracle):
            for _ in range(4):
                region = []
                for d in oracle[name].shape:
                    a = int(rng.integers(0, d))
                    region.append((a, int(rng.integers(a + 1, d + 1))))
                out = np.empty([b - a for a, b in region], np.float32)
                reader.read_into(name, tuple(region), out)
                assert out.tobytes() == oracle[name][tuple(slice(a, b) for a, b in region)].tobytes(), (name, region)
