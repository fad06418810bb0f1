"""Resume continuity across a reshard, and the checkpoint's safety nets (torchrun + gloo on CPU).

Each reference run trains TOTAL iterations at layout A and saves at iteration K on the way; the
checkpoint of iteration K is converted by `reshard convert` to layout B and resumed there. The losses of
iterations K+1..TOTAL must equal the reference's within 1e-5 relative (fp32).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from fixtures.corpus import write_corpus
from fixtures.torchrun import REPO, pythonpath, run
from tests import launch
from tests.cache import built

pytestmark = pytest.mark.slow  # every test trains with the trainer (Megatron-Core)

K, TOTAL = 3, 6
REL = 1e-5
GOLDEN_BRIDGE = REPO / "fixtures" / "golden" / "bridge-torch_dist-tp1"  # written by Megatron-Bridge (megatron-core 0.19.2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return built(tmp_path_factory, written_corpus, 300, 0)  # one path for every module, so `reference` runs are shared


def written_corpus(folder: Path, docs: int, seed: int) -> Path:
    return write_corpus(folder / "corpus.txt", docs=docs, seed=seed)


def common(corpus, metrics: Path) -> list:
    return ["--data", corpus, "--seq-length", 16, "--micro-batch-size", 2, "--global-batch-size", 8,
            "--lr", 3e-3, "--min-lr", 3e-4, "--lr-warmup-iters", 1, "--train-iters", TOTAL, "--seed", 7,
            "--metrics", metrics]


def losses(metrics: Path) -> dict[int, float]:
    records = map(json.loads, metrics.read_text().splitlines())
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}


def reshard(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def converted(src_root: Path, dst: Path, *to: str) -> Path:
    proc = reshard("convert", src_root / f"iter_{K:07d}", dst, *to, "-q")
    assert proc.returncode == 0, proc.stdout
    return dst


def reference(tmp_path_factory, corpus, nproc, layout, extra=()):
    """(the checkpoints, each iteration's loss) of the uninterrupted run, trained once per test run (tests/cache.py)."""
    return built(tmp_path_factory, trained, corpus, nproc, layout, extra)


def trained(root: Path, corpus, nproc, layout, extra=()) -> tuple[Path, dict[int, float]]:
    metrics = root / "metrics.jsonl"
    launch.run("reshard.trainer", [*layout, *common(corpus, metrics), "--save", root / "ckpt", "--save-interval", K, *extra],
               nproc=nproc)
    return root / "ckpt", losses(metrics)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, corpus):
    """TP2 PP1 DP1 (4 micro-batches per step), with TensorBoard logging."""
    return trained(tmp_path_factory.mktemp("tp2"), corpus, 2, ["--tp", 2], ["--tensorboard-dir", tmp_path_factory.getbasetemp() / "tb"])


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, corpus):
    """TP1 DP2 (2 micro-batches per rank)."""
    return reference(tmp_path_factory, corpus, 2, [])


@pytest.fixture(scope="module")
def ep2(tmp_path_factory, corpus):
    """tiny-moe EP2 (DP2)."""
    return reference(tmp_path_factory, corpus, 2, ["--ep", 2, "--model", "tiny-moe"])


def resume(tmp_path, corpus, load: Path, nproc: int, layout, extra=()) -> dict[int, float]:
    metrics = tmp_path / "resumed.jsonl"
    launch.run("reshard.trainer", [*layout, *common(corpus, metrics), "--load", load, *extra], nproc=nproc)
    return losses(metrics)


def assert_continues(resumed: dict[int, float], ref: dict[int, float]) -> None:
    assert sorted(resumed) == list(range(K + 1, TOTAL + 1))
    for it, loss in resumed.items():
        assert loss == pytest.approx(ref[it], rel=REL), f"iteration {it}: {loss} vs uninterrupted {ref[it]}"


@pytest.fixture(scope="module")
def bf16(tmp_path_factory, corpus):
    """TP1 DP1, bf16 with fp32 master weights."""
    return reference(tmp_path_factory, corpus, 1, [], ["--bf16"])


@pytest.mark.parametrize("case", [pytest.param("tp2pp1->tp1pp2", marks=pytest.mark.fast), "tp2pp1->pp2vpp2", "tp1dp2->tp2dp1", "ep2->ep1"])
def test_resume_after_reshard(case, request, tmp_path, corpus):
    """pp2vpp2: four micro-batches on two stages reach the interleaved schedule's steady state, where each
    rank sends and receives in both directions at once."""
    fixture, to, nproc, layout, extra = {
        "tp2pp1->tp1pp2": ("tp2", ["--to-tp", 1, "--to-pp", 2], 2, ["--pp", 2], []),
        "tp2pp1->pp2vpp2": ("tp2", ["--to-tp", 1, "--to-pp", 2, "--to-vpp", 2], 2, ["--pp", 2, "--vpp", 2], []),
        "tp1dp2->tp2dp1": ("dp2", ["--to-tp", 2], 2, ["--tp", 2], []),
        "ep2->ep1": ("ep2", ["--to-ep", 1], 1, [], ["--model", "tiny-moe"]),
    }[case]
    src, ref = request.getfixturevalue(fixture)
    assert sorted(ref) == list(range(1, TOTAL + 1))
    assert ref[TOTAL] < ref[1], "the reference run does not learn"
    dst = converted(src, tmp_path / "converted", *map(str, to))
    assert_continues(resume(tmp_path, corpus, dst, nproc, layout, extra), ref)


def test_fresh_optimizer_breaks_continuity(tp2, tmp_path, corpus):
    """Control: the same resume without the optimizer state does not continue the run."""
    src, ref = tp2
    dst = converted(src, tmp_path / "converted", "--to-tp", "1", "--to-pp", "2")
    resumed = resume(tmp_path, corpus, dst, 2, ["--pp", 2], ["--no-load-optim"])
    assert resumed[K + 1] == pytest.approx(ref[K + 1], rel=REL)  # same weights, same data
    worst = max(abs(resumed[i] - ref[i]) / abs(ref[i]) for i in range(K + 2, TOTAL + 1))
    assert worst > 100 * REL, f"losses still agree ({worst:.2e}): the continuity check would not notice"


@pytest.fixture(scope="module")
def distopt(tmp_path_factory, corpus):
    """TP2 DP2 with Megatron's DistributedOptimizer, saved in its default dp_reshardable form."""
    return reference(tmp_path_factory, corpus, 4, ["--tp", 2], ["--use-distributed-optimizer"])


def _optimizer_keys(iter_dir: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return {k for k in FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata if k.startswith("optimizer.")}


@pytest.mark.parametrize("to,layout", [
    ((), ["--tp", 2]),
    (("--to-tp", 1, "--to-pp", 2), ["--pp", 2]),
    (("--to-tp", 1), []),
], ids=["same-layout", "tp2dp2->tp1pp2dp2", "tp2dp2->dp4"])
def test_distributed_optimizer_resumes_its_dp_reshardable_checkpoint(distopt, tmp_path, corpus, to, layout):
    """The buckets resume as they are, or converted by `reshard convert` to per-parameter tensors at a new
    layout, into the DistributedOptimizer again (over torch's Adam on the CPU)."""
    src, ref = distopt
    saved = _optimizer_keys(src / f"iter_{K:07d}")
    assert saved and all(k.startswith("optimizer.distributed.") for k in saved), sorted(saved)[:3]
    assert content_metadata(src / f"iter_{K:07d}") == MEGATRON_LM_CONTENT_METADATA["dp_reshardable"]
    load = converted(src, tmp_path / "converted", *map(str, to)) if to else src / f"iter_{K:07d}"
    if to:
        assert any(k.startswith("optimizer.state.param.") for k in _optimizer_keys(load / f"iter_{K:07d}"))
    assert_continues(resume(tmp_path, corpus, load, 4, layout, ["--use-distributed-optimizer"]), ref)


# What Megatron-LM (core_v0.17.1 training/checkpointing.py, `_build_sharded_state_dict_metadata`) saves as a
# checkpoint's content_metadata, by optimizer; its loader builds the optimizer's load request from it and takes a
# DistributedOptimizer checkpoint without it for the pre-0.13 `dp_zero_gather_scatter` form.
MEGATRON_LM_CONTENT_METADATA = {
    "plain": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
    "dp_reshardable": {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                       "chained_optim_avoid_prefix": True},
    "fully_reshardable": {"distrib_optim_sharding_type": "fully_reshardable",
                          "distrib_optim_fully_reshardable_mem_efficient": False, "singleton_local_shards": False,
                          "chained_optim_avoid_prefix": True},
}


def content_metadata(iter_dir: Path):
    """The checkpoint's content_metadata as megatron-core's own reader gives it."""
    from megatron.core.dist_checkpointing import load_content_metadata

    return load_content_metadata(str(iter_dir))


def test_ckpt_optim_fully_reshardable_saves_per_parameter_tensors_that_resume(tmp_path_factory, tmp_path, corpus):
    distopt = ["--use-distributed-optimizer"]
    src, ref = reference(tmp_path_factory, corpus, 2, [], [*distopt, "--ckpt-optim-fully-reshardable"])
    saved = _optimizer_keys(src / f"iter_{K:07d}")
    assert saved and all(k.startswith("optimizer.state.") for k in saved), sorted(saved)[:3]
    assert content_metadata(src / f"iter_{K:07d}") == MEGATRON_LM_CONTENT_METADATA["fully_reshardable"]
    assert_continues(resume(tmp_path, corpus, src / f"iter_{K:07d}", 2, [], distopt), ref)


def test_distributed_optimizer_fresh_state_breaks_continuity(distopt, tmp_path, corpus):
    """Control: the converted resume without the optimizer state does not continue the run."""
    src, ref = distopt
    dst = converted(src, tmp_path / "converted", "--to-tp", "1", "--to-pp", "2")
    resumed = resume(tmp_path, corpus, dst, 4, ["--pp", 2], ["--use-distributed-optimizer", "--no-load-optim"])
    assert resumed[K + 1] == pytest.approx(ref[K + 1], rel=REL)  # same weights, same data
    worst = max(abs(resumed[i] - ref[i]) / abs(ref[i]) for i in range(K + 2, TOTAL + 1))
    assert worst > 100 * REL, f"losses still agree ({worst:.2e}): the continuity check would not notice"


def test_a_resume_keeps_the_checkpoints_global_batch(dp2, tmp_path, corpus):
    """Without --global-batch-size, DP2 -> DP1 keeps the 8 samples per step the schedule and order count in."""
    src, ref = dp2
    dst = converted(src, tmp_path / "converted", "--to-tp", "2")
    metrics = tmp_path / "resumed.jsonl"
    flags = common(corpus, metrics)
    at = flags.index("--global-batch-size")
    del flags[at : at + 2]
    launch.run("reshard.trainer", ["--tp", 2, *flags, "--load", dst], nproc=2)
    assert_continues(losses(metrics), ref)


def test_bf16_model_only_load_keeps_the_loaded_weights(bf16, tmp_path, corpus):
    """Mixed precision steps fp32 master copies: without the optimizer state they must be the loaded
    weights, not the initial ones (which put the loss back at iteration 1's). A fresh Adam's first steps
    differ from the continued run's, but leave the model nearer the trained run than the untrained one."""
    src, ref = bf16
    resumed = resume(tmp_path, corpus, src / f"iter_{K:07d}", 1, ["--bf16"], ["--no-load-optim"])
    assert resumed[K + 1] == pytest.approx(ref[K + 1], rel=REL)  # the same weights on the same data
    for it in range(K + 2, TOTAL + 1):
        assert abs(resumed[it] - ref[it]) < 0.5 * abs(ref[1] - ref[it]), (it, resumed[it], ref[it], ref[1])


def test_a_checkpoint_without_data_state_resumes_at_megatron_lms_consumed_train_samples(bf16, tmp_path, corpus):
    """Megatron-LM saves no data_state: its position is args.consumed_train_samples, which a batch-size
    rampup (4 samples at the first step, 8 after) leaves below iteration x global batch. The resume must
    start there: report it, save from it, and train on the batches a resume told that position by a
    data_state does, not on the uninterrupted run's (whose batch K+1 starts at 8 x K)."""
    src, ref = bf16
    position = 8 * K - 4

    def edited(name: str, edit) -> Path:
        root = tmp_path / name
        shutil.copytree(src / f"iter_{K:07d}", root / f"iter_{K:07d}")
        (root / "latest_checkpointed_iteration.txt").write_text(str(K))
        path = root / f"iter_{K:07d}" / "common.pt"
        common_pt = torch.load(path, weights_only=False)
        edit(common_pt)
        torch.save(common_pt, path)
        return root

    def as_megatron_lm(common_pt):
        del common_pt["data_state"]
        common_pt["args"].consumed_train_samples = position

    megatron_lm = edited("megatron_lm", as_megatron_lm)
    told = edited("told", lambda common_pt: common_pt["data_state"].update(consumed_samples=position))
    save = tmp_path / "next"
    resumed = resume(tmp_path / "a", corpus, megatron_lm, 1, ["--bf16"], ["--save", save])
    expected = resume(tmp_path / "b", corpus, told, 1, ["--bf16"])

    records = [json.loads(line) for line in (tmp_path / "a" / "resumed.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "checkpoint_load" and records[0]["consumed_samples"] == position
    assert [r["consumed_samples"] for r in records if "loss" in r] == [position + 8 * i for i in range(1, TOTAL - K + 1)]
    saved = torch.load(save / f"iter_{TOTAL:07d}" / "common.pt", weights_only=False)
    assert saved["data_state"]["consumed_samples"] == saved["args"].consumed_train_samples == position + 8 * (TOTAL - K)
    assert sorted(resumed) == sorted(expected) == list(range(K + 1, TOTAL + 1))
    for it in resumed:
        assert resumed[it] == pytest.approx(expected[it], rel=REL), f"iteration {it}: {resumed[it]} vs {expected[it]}"
    assert resumed[K + 1] != pytest.approx(ref[K + 1], rel=100 * REL), "batch K+1 is the uninterrupted run's"


@pytest.mark.parametrize("flags,message", [
    ([], "holds bfloat16 weights and this run trains in float32: pass --bf16"),
    (["--bf16", "--seed", 8], "drawn with --seed 7: pass it to resume"),
])
def test_a_resume_that_would_not_continue_the_run_is_refused(bf16, tmp_path, corpus, flags, message):
    src, _ = bf16
    with pytest.raises(RuntimeError, match=message) as info:
        resume(tmp_path, corpus, src / f"iter_{K:07d}", 1, [], flags)
    assert_one_line(str(info.value))


def test_the_distributed_optimizer_is_told_what_to_do_with_a_checkpoint_without_master_weights(dp2, tmp_path, corpus):
    """Plain Adam in fp32 saves no master weights, which the DistributedOptimizer loads: one line naming the missing
    tensor and the ways on (issue 33, item 9), not Megatron-Core's KeyError; and the way on works."""
    src, _ = dp2
    load = src / f"iter_{K:07d}"
    expected = r"holds no fp32 master weights \(optimizer\.state\.param\..*resume without --use-distributed-optimizer, or pass --no-load-optim"
    with pytest.raises(RuntimeError, match=expected) as info:
        resume(tmp_path, corpus, load, 2, [], ["--use-distributed-optimizer"])
    assert_one_line(str(info.value))
    assert sorted(resume(tmp_path, corpus, load, 2, [], ["--use-distributed-optimizer", "--no-load-optim"])) == list(range(K + 1, TOTAL + 1))


def test_a_megatron_core_0_19_checkpoint_is_told_how_to_load(tmp_path, corpus):
    """Megatron-Bridge's golden checkpoint (megatron-core 0.19.2: the common state inside the .distcp file, no
    common.pt): a megatron-core before 0.19 is refused in one line with the way round, not a FileNotFoundError for
    common.pt; the way round works (reshard convert writes common.pt) and leaves the source as it was."""
    src = Path(shutil.copytree(GOLDEN_BRIDGE, tmp_path / "bridge"))
    before = _tree_digest(src)
    if tuple(int(p) for p in version("megatron-core").split(".")[:2]) < (0, 19):
        message = r"keeps its common state inside its \.distcp files.*convert it with `reshard convert"
        with pytest.raises(RuntimeError, match=message) as info:
            resume(tmp_path, corpus, src, 1, [], [])
        assert_one_line(str(info.value))
    proc = reshard("convert", src / "iter_0000000", tmp_path / "converted", "-q")
    assert proc.returncode == 0, proc.stdout
    assert (tmp_path / "converted" / "iter_0000000" / "common.pt").is_file()
    assert sorted(resume(tmp_path, corpus, tmp_path / "converted", 1, [], [])) == list(range(1, TOTAL + 1))
    assert _tree_digest(src) == before


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("nproc,flags,message", [
    (1, ["--tp", 3], "1 processes do not split into TP x PP = 3: launch a multiple of 3"),
    (1, ["--ep", 2, "--model", "tiny-moe"], "1 processes do not split into ETP x EP x PP = 2"),
    (1, ["--vpp", 2], "--vpp needs --pp 2 or more"),
    (1, ["--lr-warmup-iters", TOTAL], f"--lr-warmup-iters {TOTAL} must be below --lr-decay-iters {TOTAL}"),
    (2, ["--ep", 2], "EP=2 needs a mixture-of-experts model"),
    (2, ["--tp", 2, "--model", "tiny-moe", "--seq-length", 15], "MoE at TP=2 runs sequence parallel: --seq-length 15"),
])
def test_a_launch_megatron_would_refuse_is_refused_in_one_line(tmp_path, corpus, nproc, flags, message):
    with pytest.raises(RuntimeError, match=message) as info:
        run("reshard.trainer", [*common(corpus, tmp_path / "m.jsonl"), *flags], nproc=nproc)
    assert_one_line(str(info.value))


def test_load_needs_a_checkpoint_unless_it_is_the_save_directory(tmp_path, corpus):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="holds no checkpoint"):
        run("reshard.trainer", [*common(corpus, tmp_path / "a.jsonl"), "--load", empty], nproc=1)
    fresh = tmp_path / "fresh"  # `--save X --load X`: the first launch starts from scratch
    launch.run("reshard.trainer", [*common(corpus, tmp_path / "b.jsonl"), "--train-iters", 2, "--load", fresh, "--save", fresh], nproc=1)
    assert sorted(losses(tmp_path / "b.jsonl")) == [1, 2]


def test_trainer_checkpoints_verify(tp2):
    src, _ = tp2
    assert (src / "latest_checkpointed_iteration.txt").read_text().strip() == str(TOTAL)
    for path in (src, src / f"iter_{K:07d}"):
        proc = reshard("verify", path, "--json")
        assert proc.returncode == 0, proc.stdout
        report = json.loads(proc.stdout)
        assert report["ok"] and report["matched"] > 20
    common_pt = torch.load(src / f"iter_{K:07d}" / "common.pt", weights_only=False)
    args = common_pt["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (2, 1, 1)
    assert args.padded_vocab_size == 256 and args.vocab_size == 250 and args.transformer_impl == "local"
    assert content_metadata(src / f"iter_{K:07d}") == MEGATRON_LM_CONTENT_METADATA["plain"]
    assert common_pt["iteration"] == K and common_pt["data_state"]["consumed_samples"] == 8 * K
    assert common_pt["opt_param_scheduler"]["num_steps"] == 8 * K
    assert any((src.parent.parent / "tb").rglob("events.out.tfevents.*"))
    assert (src / "tokenizer.json").is_file()


def assert_one_line(out: str) -> None:
    """A refused launch: one error line, printed by rank 0, and no rank's traceback (torchrun's own report
    of the failed child follows it)."""
    assert out.count("trainer: error:") == 1, "the error should be printed once, by rank 0"
    assert "[rank1]: Traceback" not in out and "[rank0]: Traceback" not in out


def _flip_bit_in_tensor(iter_dir: Path, key: str) -> None:
    """Flip one bit inside `key`'s first stored chunk, found in the .distcp files by its bytes."""
    from torch.distributed.checkpoint import FileSystemReader

    from reshard.torchfile.archive_reader import tensor_in_blob

    md = FileSystemReader(str(iter_dir)).read_metadata()
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == key)
    value = tensor_in_blob(iter_dir / info.relative_path, info.offset, info.length)
    needle = value.tobytes()
    for path in sorted(iter_dir.glob("*.distcp")):
        blob = bytearray(path.read_bytes())
        at = blob.find(needle)
        if at >= 0:
            blob[at + len(needle) // 2] ^= 0x10
            path.write_bytes(bytes(blob))
            return
    raise AssertionError(f"the bytes of {key} were not found in any .distcp file")


def test_corrupted_tensor_refuses_to_resume(dp2, tmp_path, corpus):
    src, _ = dp2
    bad = tmp_path / "bad"
    shutil.copytree(src / f"iter_{K:07d}", bad / f"iter_{K:07d}")
    (bad / "latest_checkpointed_iteration.txt").write_text(str(K))
    key = "decoder.layers.self_attention.linear_proj.weight"
    _flip_bit_in_tensor(bad / f"iter_{K:07d}", key)
    with pytest.raises(RuntimeError) as info:
        resume(tmp_path, corpus, bad, 2, [])
    out = str(info.value)
    assert f"tensor {key} does not match the checksum recorded at save" in out
    assert_one_line(out)
    trained = tmp_path / "resumed.jsonl"
    assert not trained.exists() or not losses(trained), "it trained on a corrupted checkpoint"


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, corpus):
    """SIGKILL the run while it saves iteration 4: iteration 2 stays the latest, loads, and the run
    resumed from it reproduces the killed run's losses."""
    root = tmp_path / "ckpt"
    first = tmp_path / "first.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "reshard.trainer",
           *map(str, common(corpus, first)), "--train-iters", "4", "--save", str(root), "--save-interval", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TRAINER_TEST_SAVE_PAUSE="4:120",
               PYTHONPATH=pythonpath())
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (root / "SAVE_PAUSED_4").exists():
            assert proc.poll() is None, "the trainer exited before reaching the save"
            assert time.time() < deadline, "the save of iteration 4 never started"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (root / "iter_0000004").exists() and (root / "iter_0000004.tmp").is_dir()
    killed = losses(first)
    assert sorted(killed) == [1, 2, 3, 4]

    again = tmp_path / "again.jsonl"
    launch.run("reshard.trainer", [*common(corpus, again), "--train-iters", 4, "--load", root, "--save", root], nproc=1)
    resumed = losses(again)
    assert sorted(resumed) == [3, 4]
    for it in (3, 4):
        assert resumed[it] == pytest.approx(killed[it], rel=REL)
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert not (root / "iter_0000004.tmp").exists()
    assert reshard("verify", root).returncode == 0
