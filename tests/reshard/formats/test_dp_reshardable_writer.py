"""`reshard convert --optimizer-form dp_reshardable`: the DistributedOptimizer's flat buckets for a new layout,
against Megatron-Core's own: the same state loaded at that layout by Megatron's DistributedOptimizer from its
fully_reshardable save and saved again as dp_reshardable (fixtures/distrib_optim_resave.py). Every bucket tensor
must hold what Megatron wrote, bit for bit, wherever Megatron's own buffers put a parameter (their `param_index_map`,
dumped by the fixture), and zeros in the alignment padding between (where Megatron's save holds uninitialized
memory); every per-rank object and common.pt's optimizer entry must be Megatron's. Both sides are read with torch's
own DCP reader.

tiny-odd-tied at PP2 has alignment gaps and its tied embedding's buckets of their own on both stages; bf16 runs
keep fp32 master weights with gradients reduced in fp32 (dtype_(torch.bfloat16, torch.float32)). tiny-moe (4 experts)
trained at EP2 DP4 is written at EP4, PP2 EP2 and EP2 DP2 as megatron-core's ChainedOptimizer (`chained_0.` dense,
`chained_1.` experts padded for the expert DP size), and at EP1 as its one optimizer with the experts in the dense
buffer."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from fixtures.torchrun import run
from reshard.formats.distrib_optim import is_dp_reshardable
from tests.reshard.formats.test_distrib_optim import assert_same, optimizer_tensors
from tests.reshard.test_cli import _one_line_error, reshard

ITER = "iter_0000002"


def saved_state(iter_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, object], dict, object]:
    """The optimizer's tensors and ShardedObjects in `iter_dir` as torch reads them, common.pt's optimizer entry and args."""
    from torch.distributed.checkpoint import FileSystemReader, load

    reader = FileSystemReader(str(iter_dir))
    metadata = reader.read_metadata()
    tensors = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
               if is_dp_reshardable(k) and hasattr(v, "size")}
    load(tensors, storage_reader=reader)
    objects = {}
    for key, storage in metadata.storage_data.items():
        if key.offset is None and is_dp_reshardable(key.fqn):
            with open(iter_dir / storage.relative_path, "rb") as f:
                f.seek(storage.offset)
                objects[key.fqn] = torch.load(io.BytesIO(f.read(storage.length)), weights_only=False)
    common = torch.load(iter_dir / "common.pt", weights_only=False)
    return tensors, objects, common["optimizer"], common["args"]


def differences(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], ranges: dict[str, list]) -> list[str]:
    """Bucket tensors of `mine` that differ from Megatron's (`theirs`) where a parameter lies, or hold other than zeros
    in the padding."""
    out = []
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype and mine[key].shape == value.shape, key
        params = torch.zeros(value.numel(), dtype=torch.bool)
        for start, end in ranges[key.rsplit(".", 1)[0]]:
            params[start:end] = True
        assert params.sum() > 0.9 * value.numel()
        differ = int((mine[key][params] != value[params]).sum())
        if differ or mine[key][~params].any():
            out.append(f"{key}: {differ} of {int(params.sum())} parameter values differ")
    return out


@pytest.fixture(scope="module")
def resaved(distrib_optim, tmp_path_factory):
    """resaved(preset, tp, pp, bf16, to_tp, to_pp, ep=1, to_ep=1, to_dp=None) -> Megatron's dp_reshardable save of
    `distrib_optim`'s state at TP `to_tp` PP `to_pp` EP `to_ep` and DP `to_dp` (default 4 / (TP x PP): 4 ranks)."""
    cache = {}

    def made(preset, tp, pp, bf16, to_tp, to_pp, ep=1, to_ep=1, to_dp=None):
        key = (preset, tp, pp, bf16, to_tp, to_pp, ep, to_ep, to_dp)
        if key not in cache:
            out = tmp_path_factory.mktemp("resaved")
            full = distrib_optim(preset, tp=tp, pp=pp, bf16=bf16, ep=ep)["full"] / ITER
            nproc = to_tp * to_pp * to_dp if to_dp else 4
            run("fixtures.distrib_optim_resave", ["--preset", preset, "--tp", to_tp, "--pp", to_pp, "--ep", to_ep, "--load", full,
                                                  "--out", out, *(["--bf16"] if bf16 else [])], nproc=nproc, timeout=600)
            ranges = {}
            for path in sorted(out.glob("param_ranges_*.json")):
                ranges.update(json.loads(path.read_text()))
            cache[key] = out / ITER, ranges
        return cache[key]

    return made


CASES = [  # preset, source TP PP EP, bf16, target TP PP EP DP
    ("tiny-llama", 2, 1, 1, False, 1, 2, 1, 2),  # TP2 DP2 -> TP1 PP2 DP2
    ("tiny-llama", 2, 1, 1, False, 1, 1, 1, 4),  # TP2 DP2 -> DP4
    ("tiny-odd-tied", 2, 1, 1, False, 1, 2, 1, 2),
    ("tiny-odd", 2, 1, 1, True, 1, 2, 1, 2),
    ("tiny-moe", 1, 1, 2, False, 1, 1, 1, 4),  # EP2 DP4 -> EP1: one optimizer, the experts in the dense buffer
    ("tiny-moe", 1, 1, 2, False, 1, 1, 4, 4),  # -> EP4: expert DP 1
    ("tiny-moe", 1, 1, 2, False, 1, 2, 2, 2),  # -> PP2 EP2 DP2: two stages' chained optimizers
    ("tiny-moe", 1, 1, 2, False, 1, 1, 2, 2),  # -> DP2 (2 ranks): the same EP, another (expert) DP
]


@pytest.mark.parametrize("preset, tp, pp, ep, bf16, to_tp, to_pp, to_ep, dp", CASES,
                         ids=["tiny-llama-tp2dp2-to-tp1pp2dp2", "tiny-llama-tp2dp2-to-dp4", "tiny-odd-tied-tp2-to-pp2",
                              "tiny-odd-bf16-tp2-to-pp2", "tiny-moe-ep2dp4-to-ep1", "tiny-moe-ep2dp4-to-ep4",
                              "tiny-moe-ep2dp4-to-pp2ep2dp2", "tiny-moe-ep2dp4-to-ep2dp2"])
def test_written_buckets_are_megatrons_own_at_the_new_layout(distrib_optim, resaved, tmp_path, preset, tp, pp, ep, bf16, to_tp,
                                                             to_pp, to_ep, dp):
    source = distrib_optim(preset, tp=tp, pp=pp, bf16=bf16, ep=ep)["dp"]
    out = reshard("convert", source, tmp_path / "out", "--to-tp", to_tp, "--to-pp", to_pp, "--to-ep", to_ep,
                  "--optimizer-form", "dp_reshardable", "--to-dp", dp)
    assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    mine, my_objects, my_common, my_args = saved_state(tmp_path / "out" / ITER)
    resaved_dir, ranges = resaved(preset, tp, pp, bf16, to_tp, to_pp, ep, to_ep, dp)
    theirs, their_objects, their_common, _ = saved_state(resaved_dir)
    chained = to_ep > 1
    prefixes = ("chained_0.", "chained_1.") if chained else ("",)
    assert {k[: k.index("optimizer.distributed.")] for k in theirs} == set(prefixes)
    assert sorted(mine) == sorted(theirs)
    assert {k.rsplit(".", 1)[0] for k in theirs} == set(ranges)
    assert differences(mine, theirs, ranges) == []
    assert my_objects == their_objects  # per_bucket_numel(_unpadded) and param_groups of every model-parallel rank
    form = {"param_state_sharding_type": "dp_reshardable"}
    assert my_common == their_common == ({0: form, 1: form} if chained else form)
    assert (my_args.data_parallel_size, my_args.world_size, my_args.use_distributed_optimizer) == (dp, to_tp * to_pp * dp, True)
    assert (my_args.tensor_model_parallel_size, my_args.pipeline_model_parallel_size) == (to_tp, to_pp)
    assert my_args.expert_model_parallel_size == to_ep


def test_megatrons_own_ep1_moe_save_decodes_as_its_source(distrib_optim, resaved):
    """The reader side of EP1: Megatron's own dp_reshardable save of tiny-moe at EP1 (one optimizer, no chain, the
    experts after each layer's router in the dense buffer) decodes bit for bit as the EP2 fully_reshardable save it
    was loaded from."""
    resaved_dir, ranges = resaved("tiny-moe", 1, 1, False, 1, 1, 2, 1, 4)
    assert all(not k.startswith("chained_") for k in ranges)
    got, _ = optimizer_tensors(resaved_dir.parent)
    want, _ = optimizer_tensors(distrib_optim("tiny-moe", tp=1, ep=2)["full"])
    assert len(got) == 3 * 10
    assert_same(got, want)


@pytest.mark.parametrize("preset, tp, ep, to_ep, to_pp, shifted", [
    ("tiny-llama", 2, 1, 1, 2, ""),
    ("tiny-moe", 1, 2, 4, 1, "chained_1."),  # an expert bucket
], ids=["tiny-llama", "tiny-moe-experts"])
def test_a_parameter_one_alignment_off_is_noticed(distrib_optim, resaved, tmp_path, preset, tp, ep, to_ep, to_pp, shifted):
    """Control for the comparison above: the same output with one bucket's values shifted by 64 elements (one
    parameter alignment) differs from Megatron's."""
    source = distrib_optim(preset, tp=tp, pp=1, bf16=False, ep=ep)["dp"]
    out = reshard("convert", source, tmp_path / "out", "--to-tp", 1, "--to-pp", to_pp, "--to-ep", to_ep, "--optimizer-form", "dp_reshardable")
    assert out.returncode == 0, out.stderr
    mine, _, _, _ = saved_state(tmp_path / "out" / ITER)
    resaved_dir, ranges = resaved(preset, tp, 1, False, 1, to_pp, ep, to_ep, 4 // to_pp)
    theirs, _, _, _ = saved_state(resaved_dir)
    assert differences(mine, theirs, ranges) == []
    key = next(k for k in sorted(theirs) if k.startswith(shifted) and k.endswith(".exp_avg"))
    mine[key] = torch.roll(mine[key], 64)
    assert [d.split(":")[0] for d in differences(mine, theirs, ranges)] == [key]


@pytest.mark.parametrize("flags, words", [
    (["--to-dp", "4"], ["--to-dp", "--optimizer-form dp_reshardable"]),
    (["--optimizer-form", "dp_reshardable", "--no-optimizer"], ["drop --no-optimizer"]),
    (["--optimizer-form", "dp_reshardable", "--to-format", "zarr"], ["torch_dist form", "zarr"]),
    (["--optimizer-form", "dp_reshardable", "--naming", "te"], ["Transformer-Engine", "--naming local"]),
])
def test_a_request_it_cannot_write_is_refused_in_one_line(distrib_optim, tmp_path, flags, words):
    source = distrib_optim("tiny-llama", tp=2, pp=1, bf16=False)["dp"]
    _one_line_error(reshard("convert", source, tmp_path / "out", *flags), *words)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_dry_run_shows_the_optimizer_work(distrib_optim, tmp_path):
    source = distrib_optim("tiny-llama", tp=2, pp=1, bf16=False)["dp"]
    out = reshard("convert", source, tmp_path / "out", "--to-tp", 1, "--optimizer-form", "dp_reshardable", "--to-dp", 4, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "optimizer state: dp_reshardable buckets (DP 2) -> dp_reshardable buckets (DP 4), 2.1 MiB" in out.stdout, out.stdout
    assert not (tmp_path / "out").exists()


def test_moe_requests_it_cannot_write_are_refused_in_one_line(distrib_optim, tmp_path):
    """An expert DP size that does not divide, and a chained expert optimizer from a source with one optimizer
    (reshard's own EP1 output: no expert param_groups recorded) are refused at planning; nothing is written."""
    source = distrib_optim("tiny-moe", tp=1, ep=2)["dp"]
    _one_line_error(reshard("convert", source, tmp_path / "out", "--to-ep", 4, "--optimizer-form", "dp_reshardable", "--to-dp", 2),
                    "data-parallel size 2 x TP 1", "ETP 1 x EP 4", "--to-dp")
    assert not (tmp_path / "out").exists()
    out = reshard("convert", source, tmp_path / "ep1", "--to-ep", 1, "--optimizer-form", "dp_reshardable")
    assert out.returncode == 0, out.stderr
    _one_line_error(reshard("convert", tmp_path / "ep1", tmp_path / "out", "--to-ep", 2, "--optimizer-form", "dp_reshardable"),
                    "EP > 1", "chained expert optimizer", "fully_reshardable")
    assert not (tmp_path / "out").exists()


def test_dry_run_shows_the_moe_optimizer_work(distrib_optim, tmp_path):
    source = distrib_optim("tiny-moe", tp=1, ep=2)["dp"]
    out = reshard("convert", source, tmp_path / "out", "--to-ep", 4, "--to-pp", 2, "--optimizer-form", "dp_reshardable", "--to-dp", 4,
                  "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "optimizer state: dp_reshardable buckets (DP 4) -> dp_reshardable buckets (DP 4), 3.2 MiB" in out.stdout, out.stdout
    assert not (tmp_path / "out").exists()
