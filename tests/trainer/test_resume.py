"""Resume continuity across a reshard, and the checkpoint's safety nets (torchrun + gloo on CPU).

Each reference run trains TOTAL iterations at layout A and saves at iteration K on the way; the
checkpoint of iteration K is converted by `reshard convert` to layout B and resumed there. The losses of
iterations K+1..TOTAL must equal the reference's within 1e-5 relative (fp32).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fixtures.corpus import write_corpus
from fixtures.torchrun import REPO, pythonpath, run

K, TOTAL = 3, 6
REL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt", docs=300, seed=0)


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


def reference(tmp_path_factory, corpus, name, nproc, layout, extra=()):
    root = tmp_path_factory.mktemp(name)
    metrics = root / "metrics.jsonl"
    run("trainer", [*layout, *common(corpus, metrics), "--save", root / "ckpt", "--save-interval", K, *extra],
        nproc=nproc)
    return root / "ckpt", losses(metrics)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, corpus):
    """TP2 PP1 DP1 (4 micro-batches per step), with TensorBoard logging."""
    return reference(tmp_path_factory, corpus, "tp2", 2, ["--tp", 2],
                     ["--tensorboard-dir", tmp_path_factory.getbasetemp() / "tb"])


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, corpus):
    """TP1 DP2 (2 micro-batches per rank)."""
    return reference(tmp_path_factory, corpus, "dp2", 2, [])


@pytest.fixture(scope="module")
def ep2(tmp_path_factory, corpus):
    """tiny-moe EP2 (DP2)."""
    return reference(tmp_path_factory, corpus, "ep2", 2, ["--ep", 2, "--model", "tiny-moe"])


def resume(tmp_path, corpus, load: Path, nproc: int, layout, extra=()) -> dict[int, float]:
    metrics = tmp_path / "resumed.jsonl"
    run("trainer", [*layout, *common(corpus, metrics), "--load", load, *extra], nproc=nproc)
    return losses(metrics)


def assert_continues(resumed: dict[int, float], ref: dict[int, float]) -> None:
    assert sorted(resumed) == list(range(K + 1, TOTAL + 1))
    for it, loss in resumed.items():
        assert loss == pytest.approx(ref[it], rel=REL), f"iteration {it}: {loss} vs uninterrupted {ref[it]}"


@pytest.mark.parametrize("case", ["tp2pp1->tp1pp2", "tp1dp2->tp2dp1", "ep2->ep1"])
def test_resume_after_reshard(case, request, tmp_path, corpus):
    fixture, to, nproc, layout, extra = {
        "tp2pp1->tp1pp2": ("tp2", ["--to-tp", 1, "--to-pp", 2], 2, ["--pp", 2], []),
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
    assert common_pt["iteration"] == K and common_pt["data_state"]["consumed_samples"] == 8 * K
    assert common_pt["opt_param_scheduler"]["num_steps"] == 8 * K
    assert any((src.parent.parent / "tb").rglob("events.out.tfevents.*"))
    assert (src / "tokenizer.json").is_file()


def _flip_bit_in_tensor(iter_dir: Path, key: str) -> None:
    """Flip one bit inside `key`'s first stored chunk, found in the .distcp files by its bytes."""
    from reshard.formats.torch_blob import tensor_in_blob
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(iter_dir)).read_metadata()
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == key)
    value = tensor_in_blob(iter_dir / info.relative_path, info.offset, info.length)
    needle = value.contiguous().view(torch.uint8).numpy().tobytes()
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
    assert out.count("trainer: error:") == 1, "the error should be printed once, by rank 0"
    assert "[rank1]: Traceback" not in out and "[rank0]: Traceback" not in out
    trained = tmp_path / "resumed.jsonl"
    assert not trained.exists() or not losses(trained), "it trained on a corrupted checkpoint"


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, corpus):
    """SIGKILL the run while it saves iteration 4: iteration 2 stays the latest, loads, and the run
    resumed from it reproduces the killed run's losses."""
    root = tmp_path / "ckpt"
    first = tmp_path / "first.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "trainer",
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
    run("trainer", [*common(corpus, again), "--train-iters", 4, "--load", root, "--save", root], nproc=1)
    resumed = losses(again)
    assert sorted(resumed) == [3, 4]
    for it in (3, 4):
        assert resumed[it] == pytest.approx(killed[it], rel=REL)
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert not (root / "iter_0000004.tmp").exists()
    assert reshard("verify", root).returncode == 0
