"""Megatron-LM's legacy `distrib_optim.pt` (--ckpt-format torch with --use-distributed-optimizer), written by
megatron-core's own `save_parameter_state` next to each `mp_rank_*/model_optim_rng.pt` (fixture `distrib_optim`),
decoded against Megatron's own fully_reshardable torch_dist save of the same optimizer; and written by reshard for a
new TP/PP/DP, against megatron-core's own legacy save of the same state at that layout (fixtures/distrib_optim_resave.py
--legacy-out) and against its `load_parameter_state` resuming the run (fixtures/distrib_optim_legacy_resume.py)."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures.torchrun import run
from reshard.convert import convert
from reshard.formats.megatron_legacy import LegacyReader
from reshard.layout import Layout
from reshard.request import Target
from reshard.worklog import LOG_NAME
from tests import launch
from tests.cache import built
from tests.reshard.optim.test_dp_reshardable import ITER, assert_converted_alike, assert_same, master_weights_are_the_model, optimizer_tensors
from tests.reshard.test_cli import _digest, _one_line_error, reshard
from tests.reshard.test_resume import Stop, _bomb, _files

pytestmark = pytest.mark.slow  # every test reads a DistributedOptimizer run trained by Megatron-Core on 4 ranks (distrib_optim)

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


MOE_CASES = [(1, 2, None), (2, 2, None), (1, 2, 6000)]  # pp, ep, bucket size


@pytest.mark.parametrize("pp, ep, bucket_size", MOE_CASES, ids=[f"tiny-moe-pp{c[0]}ep{c[1]}{'-buckets' if c[2] else ''}" for c in MOE_CASES])
def test_moe_distrib_optim_pt_reads_bit_for_bit_as_megatrons_fully_reshardable(distrib_optim, pp, ep, bucket_size):
    """An MoE model's ChainedOptimizer writes `[dense, experts]` per file, the dense state only where its writer is the
    dense optimizer's DP rank 0 (EP rank 0 files), the experts' in every EP rank's file, their buffers padded for the
    expert data-parallel size: decoded, every optimizer tensor equals Megatron's own fully_reshardable save."""
    made = distrib_optim("tiny-moe", tp=1, pp=pp, ep=ep, bucket_size=bucket_size)
    files = {p.parent.name: torch.load(p, weights_only=True) for p in sorted((made["legacy"] / ITER).glob("mp_rank_*/distrib_optim.pt"))}
    assert len(files) == pp * ep and all(isinstance(f, list) and len(f) == 2 and f[1] is not None for f in files.values())
    assert sorted(name for name, f in files.items() if f[0] is not None) == sorted(n for n in files if n.endswith("_000"))
    legacy, legacy_common = optimizer_tensors(made["legacy"], LegacyReader)
    full, full_common = optimizer_tensors(made["full"])
    assert len(legacy) == len(full) == 3 * 10
    assert_same(legacy, full)
    assert legacy_common == full_common and sorted(legacy_common) == [0, 1]
    assert all(np.any(t != 0) for name, t in legacy.items() if ".exp_avg" in name)


def test_moe_legacy_converts_to_torch_dist_as_megatrons_fully_reshardable_does(distrib_optim, tmp_path):
    made = distrib_optim("tiny-moe", tp=1, ep=2)
    legacy = reshard("convert", made["legacy"], tmp_path / "legacy", "--to-format", "torch_dist", "--to-ep", "1")
    assert legacy.returncode == 0 and "checksums verified" in legacy.stdout, legacy.stderr
    full = reshard("convert", made["full"], tmp_path / "full", "--to-ep", "1")
    assert full.returncode == 0, full.stderr
    assert len(assert_converted_alike(tmp_path / "legacy", tmp_path / "full")) == 3 * 10


def test_many_buckets_coalesced_decode_as_the_one_bucket_runs_state(distrib_optim):
    """7 buckets per rank laid end to end without their padding: each bucket starts where the unpadded lengths of the
    ones before it end. The run's state is the one-bucket run's bit for bit (test_dp_reshardable.py says why that,
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


@pytest.mark.parametrize("keep, words", [(300, ["damaged"]), (0, ["not a zip-format torch.save file"])], ids=["truncated", "emptied"])
def test_a_damaged_distrib_optim_pt_is_refused_naming_the_file(tmp_path, keep, words):
    """Issue #33: a distrib_optim.pt that cannot be loaded was called "a layout-bound form reshard cannot reshard". The
    refusal names the file, what is wrong with it and what to do; inspect says so; the model still converts without it.
    The file: reshard's distrib_optim.pt of Megatron-LM's own dp_reshardable save (golden mlm-distopt-tp2dp2)."""
    golden = Path(__file__).resolve().parents[3] / "fixtures" / "golden" / "mlm-distopt-tp2dp2" / "checkpoint"
    assert reshard("convert", golden, tmp_path / "legacy", "--to-format", "legacy").returncode == 0
    path = tmp_path / "legacy" / "iter_0000003" / "mp_rank_01" / "distrib_optim.pt"
    path.write_bytes(path.read_bytes()[:keep])
    before = _digest(tmp_path / "legacy")
    result = reshard("convert", tmp_path / "legacy", tmp_path / "out", "--to-format", "torch_dist")
    _one_line_error(result, "mp_rank_01/distrib_optim.pt", *words, "--no-optimizer")
    assert "layout-bound" not in result.stderr
    assert not (tmp_path / "out").exists() and _digest(tmp_path / "legacy") == before
    shown = reshard("inspect", tmp_path / "legacy")
    assert shown.returncode == 0 and "optimizer: not read: " in shown.stdout and "mp_rank_01/distrib_optim.pt" in shown.stdout
    model_only = reshard("convert", tmp_path / "legacy", tmp_path / "model", "--to-format", "torch_dist", "--no-optimizer")
    assert model_only.returncode == 0, model_only.stderr


@pytest.fixture(scope="module")
def legacy_resaved(distrib_optim, tmp_path_factory):
    """legacy_resaved(preset, bf16, to_tp, to_pp, to_ep=1, to_etp=None, source=TP2) -> the iteration directory of
    megatron-core's own legacy save (model_optim_rng.pt, distrib_optim.pt) of `distrib_optim(preset, **source)`'s state,
    loaded by its DistributedOptimizer at TP `to_tp` PP `to_pp` EP `to_ep` ETP `to_etp` on 4 ranks (DP = 4 / (TP x PP))."""
    def made(preset, bf16, to_tp, to_pp, to_ep=1, to_etp=None, source=(("tp", 2),)):
        full = distrib_optim(preset, bf16=bf16, **dict(source))["full"] / ITER
        return built(tmp_path_factory, resaved_as_legacy, preset, bf16, to_tp, to_pp, to_ep, to_etp, full)

    return made


def resaved_as_legacy(out, preset, bf16, to_tp, to_pp, to_ep, to_etp, full) -> Path:
    launch.run("fixtures.distrib_optim_resave", ["--preset", preset, "--tp", to_tp, "--pp", to_pp, "--ep", to_ep, "--load", full,
                                                 "--out", out / "dp", "--legacy-out", out / "legacy", *(["--bf16"] if bf16 else []),
                                                 *(["--etp", to_etp] if to_etp else [])],
               nproc=4, timeout=600)
    return out / "legacy" / ITER


def rank_files(iter_dir: Path, name: str) -> dict[str, dict]:
    return {p.parent.name: torch.load(p, map_location="cpu", weights_only=False) for p in sorted(iter_dir.glob(f"mp_rank_*/{name}"))}


def buffer_differences(mine: dict, theirs: dict) -> list[str]:
    """Where reshard's distrib_optim.pt differs from megatron-core's: its structure, or any value (alignment gaps
    included, which both hold as zeros)."""
    out = []
    for rank in sorted(set(mine) | set(theirs)):
        a, b = mine.get(rank, {}), theirs.get(rank, {})
        if a.keys() != b.keys() or a.get("buckets_coalesced") is not True:
            out.append(f"{rank}: keys {list(a)} != {list(b)}")
            continue
        for gbuf in (k for k in b if k != "buckets_coalesced"):
            if a[gbuf].keys() != b[gbuf].keys():
                out.append(f"{rank} buffer {gbuf}: dtypes {list(a[gbuf])} != {list(b[gbuf])}")
                continue
            for dtype, tensors in b[gbuf].items():
                if a[gbuf][dtype]["numel_unpadded"] != tensors["numel_unpadded"]:
                    out.append(f"{rank} buffer {gbuf}: numel_unpadded {a[gbuf][dtype]['numel_unpadded']} != {tensors['numel_unpadded']}")
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    x, y = a[gbuf][dtype][key], tensors[key]
                    if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                        out.append(f"{rank} buffer {gbuf} {key}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}, "
                                   f"{int((x != y).sum()) if x.shape == y.shape else '?'} values differ")
    return out


WRITE_CASES = [
    ("tiny-llama", False, "dp", 1, 2),  # TP2 DP2 dp_reshardable -> TP1 PP2 DP2
    ("tiny-llama", False, "legacy", 1, 1),  # TP2 DP2 legacy -> DP4
    ("tiny-odd-tied", False, "full", 1, 2),  # alignment gaps; the tied embedding's own buckets on both stages
    ("tiny-odd", True, "dp", 1, 2),  # bf16 parameters: buffers of dtype (bfloat16, float32)
]


# fast: the first case, the one test of the distrib_optim.pt writer in the fast tier
@pytest.mark.parametrize("preset, bf16, form, to_tp, to_pp",
                         [pytest.param(*c, marks=pytest.mark.fast if i == 0 else ()) for i, c in enumerate(WRITE_CASES)],
                         ids=[f"{c[0]}{'-bf16' if c[1] else ''}-{c[2]}-tp2-to-tp{c[3]}pp{c[4]}dp{4 // (c[3] * c[4])}" for c in WRITE_CASES])
def test_written_distrib_optim_is_megatrons_own_legacy_save_at_the_new_layout(distrib_optim, legacy_resaved, tmp_path, preset, bf16, form,
                                                                             to_tp, to_pp):
    dp = 4 // (to_tp * to_pp)
    source = distrib_optim(preset, tp=2, bf16=bf16)[form]
    out = reshard("convert", source, tmp_path / "out", "--to-format", "legacy", "--to-tp", to_tp, "--to-pp", to_pp, "--to-dp", dp)
    assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    theirs_dir = legacy_resaved(preset, bf16, to_tp, to_pp)
    mine, theirs = rank_files(tmp_path / "out" / ITER, "distrib_optim.pt"), rank_files(theirs_dir, "distrib_optim.pt")
    assert len(theirs) == to_tp * to_pp and sorted(mine) == sorted(theirs)
    assert buffer_differences(mine, theirs) == []
    for path in (tmp_path / "out" / ITER).glob("mp_rank_*/*.pt"):
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None, path  # every record's CRC-32 (distrib_optim.pt's combined from its parts)
    assert sum(t["numel_unpadded"] for f in theirs.values() for g, d in f.items() if g != "buckets_coalesced" for t in d.values()) > 0
    my_ranks, their_ranks = rank_files(tmp_path / "out" / ITER, "model_optim_rng.pt"), rank_files(theirs_dir, "model_optim_rng.pt")
    for rank, state in their_ranks.items():
        assert my_ranks[rank]["optimizer"] == state["optimizer"]  # the DistributedOptimizer's state_dict(): param groups, step
        args = my_ranks[rank]["args"]
        assert (args.data_parallel_size, args.world_size, args.use_distributed_optimizer) == (dp, 4, True)
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.ckpt_format) == (to_tp, to_pp, "torch")
    # control: the comparison notices one buffer shifted by one parameter alignment
    rank = sorted(mine)[0]
    (tensors,) = mine[rank][0].values()
    tensors["exp_avg"] = torch.roll(tensors["exp_avg"], 64)
    assert [d.split(":")[0] for d in buffer_differences(mine, theirs)] == [f"{rank} buffer 0 exp_avg"]


def by_optimizer(files: dict[str, object]) -> dict[str, dict]:
    """Each distrib_optim.pt's optimizer states by rank directory, an MoE model's ChainedOptimizer's list by
    `<rank directory>[<chain>]` (its None places left out: a state where the other has None is a difference)."""
    out = {}
    for rank, state in files.items():
        for i, one in enumerate(state) if isinstance(state, list) else [(None, state)]:
            if one is not None:
                out[rank if i is None else f"{rank}[{i}]"] = one
    return out


def test_moe_distrib_optim_pt_with_expert_tp_below_tp_reads_as_megatrons_fully_reshardable(distrib_optim, legacy_resaved, tmp_path):
    """TP2 EP2 ETP1 on 4 ranks: megatron-core numbers expert ranks etp + ETP * (ep + EP * edp), so only mp_rank_00_000
    and mp_rank_01_001 exist, each holding TP rank tp's dense state and EP rank ep's expert state (`BufferLayout.holder`).
    Megatron's own legacy save there of the state it loaded from the TP1 EP2 run's fully_reshardable save decodes as
    that save, every optimizer tensor; with the two expert states swapped between the files (control) the expert
    tensors no longer do."""
    source = distrib_optim("tiny-moe", tp=1, ep=2)["full"]
    resaved = legacy_resaved("tiny-moe", False, 2, 1, to_ep=2, to_etp=1, source=(("ep", 2), ("tp", 1))).parent
    files = {p.parent.name: torch.load(p, weights_only=True) for p in sorted((resaved / ITER).glob("mp_rank_*/distrib_optim.pt"))}
    assert sorted(files) == ["mp_rank_00_000", "mp_rank_01_001"] and all(None not in f for f in files.values())
    full, full_common = optimizer_tensors(source)
    legacy, legacy_common = optimizer_tensors(resaved, LegacyReader)
    assert len(legacy) == len(full) == 3 * 10
    assert_same(legacy, full)
    assert legacy_common == full_common and sorted(legacy_common) == [0, 1]
    shutil.copytree(resaved, tmp_path / "swapped")
    first, second = (tmp_path / "swapped" / ITER / name / "distrib_optim.pt" for name in files)
    torch.save([files["mp_rank_00_000"][0], files["mp_rank_01_001"][1]], first)
    torch.save([files["mp_rank_01_001"][0], files["mp_rank_00_000"][1]], second)
    swapped, _ = optimizer_tensors(tmp_path / "swapped", LegacyReader)
    experts = sorted(n for n in full if ".mlp.experts." in n)
    assert len(experts) == 3 * 2 and sorted(n for n in full if not np.array_equal(swapped[n], full[n])) == experts


MOE_WRITE_CASES = [  # source form, target TP, PP, EP, ETP (DP 4 / (TP x PP)); the source: tiny-moe TP1 EP2 DP4
    ("dp", 1, 1, 2, None),  # experts in their own chained optimizer, expert DP 2
    ("dp", 1, 1, 1, None),  # one optimizer, the experts in the dense buffer after the router
    ("legacy", 2, 1, 2, 1),  # ETP < TP: two files hold both chains (`BufferLayout.holder`), the TP rank past ETP's experts none
]


@pytest.mark.parametrize("form, to_tp, to_pp, to_ep, to_etp", MOE_WRITE_CASES,
                         ids=[f"tiny-moe-{c[0]}-ep2-to-tp{c[1]}pp{c[2]}ep{c[3]}{f'etp{c[4]}' if c[4] else ''}" for c in MOE_WRITE_CASES])
def test_written_moe_distrib_optim_is_megatrons_own_chained_legacy_save(distrib_optim, legacy_resaved, tmp_path, form, to_tp, to_pp, to_ep,
                                                                        to_etp):
    """An MoE model's ChainedOptimizer state written for a new layout: every distrib_optim.pt (the list `[dense,
    experts]` at EP > 1, None where the file's writer is not that optimizer's DP rank 0) and every rank file's
    `optimizer` entry are megatron-core's own legacy save of the same state loaded at that layout, tensor for tensor."""
    dp = 4 // (to_tp * to_pp)
    source = distrib_optim("tiny-moe", tp=1, ep=2)[form]
    layout = ["--to-tp", to_tp, "--to-pp", to_pp, "--to-ep", to_ep, *(["--to-etp", to_etp] if to_etp else [])]
    out = reshard("convert", source, tmp_path / "out", "--to-format", "legacy", *layout, "--to-dp", dp)
    assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    theirs_dir = legacy_resaved("tiny-moe", False, to_tp, to_pp, to_ep=to_ep, to_etp=to_etp, source=(("ep", 2), ("tp", 1)))
    mine_files, theirs_files = rank_files(tmp_path / "out" / ITER, "distrib_optim.pt"), rank_files(theirs_dir, "distrib_optim.pt")
    assert sorted(mine_files) == sorted(theirs_files) and len(theirs_files) == to_tp * to_pp * to_ep // (to_tp // (to_etp or to_tp))
    assert all(isinstance(f, list) and len(f) == 2 for f in theirs_files.values()) == (to_ep > 1)
    mine, theirs = by_optimizer(mine_files), by_optimizer(theirs_files)
    assert len(theirs) == to_pp * (to_tp + to_ep * (to_etp or to_tp) if to_ep > 1 else to_tp)
    assert buffer_differences(mine, theirs) == []
    my_ranks, their_ranks = rank_files(tmp_path / "out" / ITER, "model_optim_rng.pt"), rank_files(theirs_dir, "model_optim_rng.pt")
    assert set(their_ranks) <= set(my_ranks)  # reshard writes every (TP, EP) pair's; megatron only the ranks ETP < TP has
    for rank, state in their_ranks.items():
        assert my_ranks[rank]["optimizer"] == state["optimizer"]  # each optimizer's state_dict(): param groups, step
        assert isinstance(state["optimizer"], list) == (to_ep > 1)
    # control: the comparison notices the last expert buffer shifted by one parameter alignment
    name = sorted(theirs)[-1]
    (tensors,) = mine[name][0].values()
    tensors["exp_avg_sq"] = torch.roll(tensors["exp_avg_sq"], 64)
    assert [d.split(":")[0] for d in buffer_differences(mine, theirs)] == [f"{name} buffer 0 exp_avg_sq"]


def resumed_losses(tmp_path: Path, name: str, layout: list, *extra, preset: str = "tiny-llama") -> dict[int, float]:
    out = tmp_path / f"{name}.json"
    launch.run("fixtures.distrib_optim_legacy_resume", ["--preset", preset, *layout, "--steps", STEPS, "--out", out, *extra],
               nproc=4, timeout=600)
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


STEPS, REL = 6, 1e-5


def test_written_distrib_optim_resumes_the_run_in_megatrons_distributed_optimizer(distrib_optim, tmp_path):
    """Stopped at iteration 2 at TP2 DP2 (dp_reshardable), converted to legacy TP1 PP2 DP2, loaded by Megatron-Core's
    own `load_parameter_state`: its losses are the uninterrupted TP2 DP2 run's within 1e-5 relative per step; the same
    resume with a fresh optimizer is not (control)."""
    out = reshard("convert", distrib_optim("tiny-llama", tp=2)["dp"], tmp_path / "legacy", "--to-format", "legacy", "--to-tp", 1,
                  "--to-pp", 2, "--to-dp", 2)
    assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    reference = resumed_losses(tmp_path, "reference", ["--tp", 2])
    resumed = resumed_losses(tmp_path, "resumed", ["--tp", 1, "--pp", 2], "--load", tmp_path / "legacy")
    assert sorted(resumed) == list(range(3, STEPS + 1)) and sorted(reference) == list(range(1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=REL), (step, loss, reference[step])
    fresh = resumed_losses(tmp_path, "fresh", ["--tp", 1, "--pp", 2], "--load", tmp_path / "legacy", "--no-load-optim")
    assert fresh[3] == pytest.approx(reference[3], rel=REL)  # the same weights and data: the first step's loss agrees
    worst = max(abs(fresh[i] - reference[i]) / abs(reference[i]) for i in range(4, STEPS + 1))
    assert worst > 100 * REL, f"losses still agree ({worst:.2e}): the continuity check would not notice"


def test_dry_run_shows_the_optimizer_work(distrib_optim, tmp_path):
    source = distrib_optim("tiny-llama", tp=2)["dp"]
    out = reshard("convert", source, tmp_path / "out", "--to-format", "legacy", "--to-tp", 1, "--to-dp", 4, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "optimizer state: dp_reshardable buckets (DP 2) -> distrib_optim.pt buffers (DP 4)" in out.stdout, out.stdout
    assert not (tmp_path / "out").exists()


def test_a_chained_expert_optimizer_from_a_one_optimizer_source_is_refused_in_one_line(distrib_optim, tmp_path):
    """Legacy output at EP > 1 holds the expert optimizer's `state_dict()`, whose param groups a one-optimizer source
    (reshard's own EP1 legacy output) does not record: refused when planning, nothing written; the model still converts."""
    ep1 = reshard("convert", distrib_optim("tiny-moe", tp=1, ep=2)["dp"], tmp_path / "ep1", "--to-format", "legacy", "--to-ep", 1)
    assert ep1.returncode == 0, ep1.stderr
    result = reshard("convert", tmp_path / "ep1", tmp_path / "out", "--to-format", "legacy", "--to-ep", 2)
    _one_line_error(result, "--to-format legacy", "EP > 1", "chained expert optimizer", "fully_reshardable")
    assert not (tmp_path / "out").exists()
    model_only = reshard("convert", tmp_path / "ep1", tmp_path / "model", "--to-format", "legacy", "--to-ep", 2, "--no-optimizer")
    assert model_only.returncode == 0, model_only.stderr


TE_RESUMES = {"tiny-odd": False, "tiny-nemotron-h": True}  # preset: also resumed with a fresh optimizer (the control)


@pytest.mark.parametrize("preset", TE_RESUMES)
def test_distrib_optim_pt_in_the_te_order_resumes_the_run(distrib_optim, tmp_path, preset):
    """A run whose buffers follow the Transformer-Engine spec's parameter order (a GPT layer's norms fused into
    linear_qkv and fc1; Nemotron-H's Mamba mixers, which megatron-core builds in that spec only), stopped at iteration 2
    at TP2 DP2 (dp_reshardable), converted to legacy TP1 PP2 DP2 under TE's names (Nemotron-H: each rank's in_proj and
    conv1d parts fused in its file, the stage cut between attention and a Mamba layer), loaded by megatron-core's own
    `load_parameter_state`: its losses are the uninterrupted TP2 run's within 1e-5 relative per step."""
    out = reshard("convert", distrib_optim(preset, tp=2, te_order=True)["dp"], tmp_path / "legacy", "--to-format", "legacy",
                  "--to-tp", 1, "--to-pp", 2, "--to-dp", 2, "--naming", "te")
    assert out.returncode == 0 and "checksums verified" in out.stdout, out.stderr
    reference = resumed_losses(tmp_path, "reference", ["--tp", 2, "--te-order"], preset=preset)
    resumed = resumed_losses(tmp_path, "resumed", ["--tp", 1, "--pp", 2, "--te-order"], "--load", tmp_path / "legacy", preset=preset)
    assert sorted(resumed) == list(range(3, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=REL), (step, loss, reference[step])
    if TE_RESUMES[preset]:
        fresh = resumed_losses(tmp_path, "fresh", ["--tp", 1, "--pp", 2, "--te-order"], "--load", tmp_path / "legacy",
                               "--no-load-optim", preset=preset)
        assert max(abs(fresh[i] - reference[i]) / abs(reference[i]) for i in range(4, STEPS + 1)) > 100 * REL


def test_two_ranks_write_the_distrib_optim_pt_one_process_writes(distrib_optim, tmp_path):
    """Under torchrun the ranks split the tensors, each writing its pieces into every distrib_optim.pt; rank 0 seals the
    records with the CRC-32s combined from both ranks' parts: the same bytes as one process (which the test above holds
    to megatron-core's own save)."""
    source = distrib_optim("tiny-llama", tp=2)["dp"]
    flags = ["--to-format", "legacy", "--to-tp", 1, "--to-pp", 2, "--to-dp", 2]
    run("reshard", ["convert", source, tmp_path / "multi", *flags], nproc=2)
    single = reshard("convert", source, tmp_path / "single", *flags)
    assert single.returncode == 0, single.stderr
    multi, one = _files(tmp_path / "multi"), _files(tmp_path / "single")
    assert sorted(multi) == sorted(one) and sum(name.endswith("distrib_optim.pt") for name in one) == 2
    assert [name for name in one if multi[name] != one[name]] == []


def test_an_interrupted_conversion_resumes_to_the_same_distrib_optim_pt(distrib_optim, tmp_path):
    """Stopped after two thirds of its slabs (optimizer tensors among those done), the rerun restores the parts already
    in each distrib_optim.pt from the work log and writes the rest: the files of an uninterrupted run, byte for byte."""
    source = distrib_optim("tiny-llama", tp=2)["dp"]
    target = Target(format="legacy", layout=Layout(tp=1, pp=2), dp=2)
    fresh_calls = []
    convert(source, tmp_path / "fresh", target, progress=lambda _: fresh_calls.append(1))
    bomb, _ = _bomb(after_slabs=len(fresh_calls) * 2 // 3)
    with pytest.raises(Stop):
        convert(source, tmp_path / "out", target, progress=bomb)
    log = (tmp_path / ".out.reshard-partial" / LOG_NAME).read_text().splitlines()[1:]
    assert any(json.loads(line)["name"].startswith("optimizer.") for line in log)
    counted, calls = _bomb(after_slabs=0)
    convert(source, tmp_path / "out", target, progress=counted)
    assert 0 < len(calls) < len(fresh_calls)  # the rerun skipped what was done
    assert _files(tmp_path / "out") == _files(tmp_path / "fresh")
