"""Megatron-LM's legacy `distrib_optim.pt` (--ckpt-format torch with --use-distributed-optimizer), written by
megatron-core's own `save_parameter_state` next to each `mp_rank_*/model_optim_rng.pt` (fixture `distrib_optim`),
decoded against Megatron's own fully_reshardable torch_dist save of the same optimizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from reshard.formats.megatron_legacy import LegacyReader
from tests.reshard.formats.test_distrib_optim import ITER, assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.test_cli import _digest, _one_line_error, reshard

CASES = [
    ("tiny-odd", 2, 1, 1, False),
    ("tiny-odd", 1, 2, 1, False),
    ("tiny-odd", 1, 2, 2, False),
    ("tiny-odd-tied", 1, 2, 1, False),
    ("tiny-odd", 2, 1, 1, True),
]


@pytest.mark.parametrize(
    "preset, tp, pp, vpp, bf16", CASES, ids=[f"{c[0]}-tp{c[1]}pp{c[2]}{f'vpp{c[3]}' if c[3] > 1 else ''}{'-bf16' if c[4] else ''}" for c in CASES]
)
def test_distrib_optim_pt_reads_bit_for_bit_as_megatrons_fully_reshardable(distrib_optim, preset, tp, pp, vpp, bf16):
    made = distrib_optim(preset, tp=tp, pp=pp, vpp=vpp, bf16=bf16)
    assert sorted(p.name for p in (made["legacy"] / ITER).glob("mp_rank_*/distrib_optim.pt") if p.is_file()) == ["distrib_optim.pt"] * (tp * pp)
    legacy, legacy_common = optimizer_tensors(made["legacy"], LegacyReader)
    full, full_common = optimizer_tensors(made["full"])
    assert len(legacy) == len(full) > 0
    assert_same(legacy, full)
    assert legacy_common == full_common and {g["step"] for g in legacy_common["optimizer"]["param_groups"]} == {2.0}
    assert all(np.any(t != 0) for name, t in legacy.items() if ".exp_avg" in name)


def test_many_buckets_coalesced_decode_as_the_one_bucket_runs_state(distrib_optim):
    """7 buckets per rank laid end to end without their padding: each bucket starts where the unpadded lengths of the
    ones before it end. The run's state is the one-bucket run's bit for bit (test_distrib_optim.py says why that,
    and not Megatron 0.16's own fully_reshardable save of the many-bucket run, is the truth)."""
    legacy, _ = optimizer_tensors(distrib_optim("tiny-odd", tp=2, bucket_size=6000)["legacy"], LegacyReader)
    full, _ = optimizer_tensors(distrib_optim("tiny-odd", tp=2)["full"])
    assert_same(legacy, full)
    assert master_weights_are_the_model(distrib_optim("tiny-odd", tp=2)["full"], legacy) == []


@pytest.mark.parametrize("target", [["--to-tp", "1"], ["--to-tp", "1", "--to-pp", "2"]], ids=["tp2-to-tp1", "tp2-to-pp2"])
def test_convert_legacy_distrib_optim_to_torch_dist_equals_converting_fully_reshardable(distrib_optim, tmp_path, target):
    made = distrib_optim("tiny-odd", tp=2)
    first = reshard("convert", made["legacy"], tmp_path / "legacy", "--to-format", "torch_dist", *target)
    assert first.returncode == 0 and "checksums verified" in first.stdout, first.stderr
    second = reshard("convert", made["full"], tmp_path / "full", *target)
    assert second.returncode == 0, second.stderr
    assert_converted_alike(tmp_path / "legacy", tmp_path / "full")


def _rewrite(source: Path, dest: Path, change) -> None:
    """A copy of `source` whose mp_rank_01's distrib_optim.pt holds `change(state)`."""
    shutil.copytree(source, dest)
    path = dest / ITER / "mp_rank_01" / "distrib_optim.pt"
    state = torch.load(path, weights_only=True)
    torch.save(change(state), path)


def test_a_buffer_shorter_than_its_layout_is_refused_in_one_line_naming_the_tensor(distrib_optim, tmp_path):
    def shorten(state):
        (tensors,) = state[0].values()
        tensors.update({k: tensors[k][:-64] for k in ("param", "exp_avg", "exp_avg_sq")}, numel_unpadded=tensors["numel_unpadded"] - 64)
        return state

    _rewrite(distrib_optim("tiny-odd", tp=2)["legacy"], tmp_path / "bad", shorten)
    before = _digest(tmp_path / "bad")
    result = reshard("convert", tmp_path / "bad", tmp_path / "out", "--to-format", "torch_dist", "--to-tp", "1")
    _one_line_error(result, "embedding.word_embeddings.weight", "mp_rank_01/distrib_optim.pt", "numel_unpadded")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.reshard-*"))
    assert _digest(tmp_path / "bad") == before
    model_only = reshard("convert", tmp_path / "bad", tmp_path / "model", "--to-format", "torch_dist", "--to-tp", "1", "--no-optimizer")
    assert model_only.returncode == 0, model_only.stderr  # the model converts without the damaged optimizer state


def test_the_older_per_bucket_layout_is_refused_by_name(distrib_optim, tmp_path):
    def per_bucket(state):
        del state["buckets_coalesced"]
        (dtype,) = state[0]
        state[0][dtype] = [state[0][dtype]]  # one entry per bucket, as megatron-core wrote before coalescing
        return state

    _rewrite(distrib_optim("tiny-odd", tp=2)["legacy"], tmp_path / "old", per_bucket)
    result = reshard("convert", tmp_path / "old", tmp_path / "out", "--to-format", "torch_dist", "--to-tp", "1")
    _one_line_error(result, "mp_rank_01/distrib_optim.pt", "per-bucket layout", "buckets_coalesced")
    assert not (tmp_path / "out").exists()
