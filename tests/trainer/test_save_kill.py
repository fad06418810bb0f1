"""A trainer save killed (SIGKILL, no cleanup) at random moments: the save directory then holds the previous
checkpoint, with the tracker on it, or the complete new one; the rerun of the same command ends byte for byte
where an uninterrupted run does (issue 22).

One process, gloo, CPU: the save is the same code as a multi-rank run's on rank 0 (`trainer/checkpoint.py`
`save_checkpoint`). Each run is a process forked from one that imported the trainer (`trainer_forks`), which
SIGKILL ends as it would a launched one; the imports are most of a small run's time.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.corpus import write_corpus
from fixtures.torchrun import REPO, pythonpath
from reshard.trainer.checkpoint import TRACKER
from reshard.verify import verify

pytestmark = pytest.mark.slow  # trains with the trainer and kills it at random moments of a save

KILLS = 20
PREVIOUS, NEW = "iter_0000001", "iter_0000002"


def _args(corpus: Path, root: Path, iters: int) -> list[str]:
    args = [
        "--data",
        corpus,
        "--seq-length",
        16,
        "--micro-batch-size",
        2,
        "--global-batch-size",
        4,
        "--lr",
        3e-3,
        "--train-iters",
        iters,
        "--seed",
        7,
        "--save",
        root,
        "--load",
        root,
    ]
    return [*map(str, args)]


class Trainer:
    """Trainer runs forked from one process that imported it (`trainer_forks`): each run is a process of its own,
    as killable as a launched one, without paying for the imports again."""

    def __init__(self, log: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.trainer.trainer_forks"],
            cwd=REPO,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=pythonpath()),
        )

    def run(self, argv: list[str], watch: Path | None = None, kill_after: float | None = None) -> dict:
        """Run the trainer; SIGKILL it `kill_after` seconds after `watch` appears. Returns {status, after_watch}."""
        request = {"argv": argv, "watch": None if watch is None else str(watch), "kill_after": kill_after}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def _files(directory: Path, raw: bool = False) -> dict[str, str]:
    """sha256 of every file of an iteration directory, less (unless `raw`) the two values that differ between
    two uninterrupted saves (`test_two_uninterrupted_saves_differ_only_in_the_clock_and_torchs_save_id`): the
    manifest's wall-clock time and the random `save_id` DCP writes into `.metadata` (zeroed in its bytes)."""
    out = {}
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = f.read_bytes()
        if f.name == "reshard_manifest.json" and not raw:
            manifest = json.loads(data)
            manifest["provenance"].pop("time")
            data = json.dumps(manifest, sort_keys=True).encode()
        if f.name == ".metadata" and not raw:
            save_id = _save_id(f).encode()
            assert data.count(save_id) == 1
            data = data.replace(save_id, b"0" * len(save_id))
        out[f.relative_to(directory).as_posix()] = hashlib.sha256(data).hexdigest()
    return out


def _save_id(metadata: Path) -> str:
    with open(metadata, "rb") as f:
        return pickle.load(f).storage_meta.save_id  # a file the trainer just wrote, not an untrusted one


def _verifies(directory: Path) -> None:
    assert verify(directory).comparison.ok


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A save directory holding iteration 1 (the previous checkpoint), and two uninterrupted runs from it to
    iteration 2, saved where the kill test saves (DCP records the directory in `.metadata`)."""
    tmp = tmp_path_factory.mktemp("save_kill")
    corpus = write_corpus(tmp / "corpus.txt", docs=200, seed=0)
    trainer = Trainer(tmp / "trainer.log")
    assert trainer.run(_args(corpus, tmp / "start", 1))["status"] == 0
    for name in ("a", "b"):
        shutil.copytree(tmp / "start", tmp / "ckpt")
        assert trainer.run(_args(corpus, tmp / "ckpt", 2))["status"] == 0
        (tmp / "ckpt").rename(tmp / name)
    yield corpus, tmp, trainer
    trainer.close()


def test_two_uninterrupted_saves_differ_only_in_the_clock_and_torchs_save_id(start):
    """The oracle of the kill test: two uninterrupted saves of iteration 2 are byte-identical file for file but
    for the manifest's time and the uuid torch's FileSystemWriter draws for every save (`storage_meta.save_id`)."""
    _, tmp, _ = start
    a, b = tmp / "a" / NEW, tmp / "b" / NEW
    raw_a, raw_b = _files(a, raw=True), _files(b, raw=True)
    assert set(raw_a) == {".metadata", "__0_0.distcp", "common.pt", "metadata.json", "reshard_manifest.json"}
    assert {f for f in raw_a if raw_a[f] != raw_b[f]} <= {".metadata", "reshard_manifest.json"}
    assert _save_id(a / ".metadata") != _save_id(b / ".metadata")
    assert _files(a) == _files(b)


def test_kill_9_at_random_points_of_a_save_leaves_the_previous_checkpoint_or_the_new_one(start):
    corpus, tmp, trainer = start
    previous, new = _files(tmp / "start" / PREVIOUS), _files(tmp / "a" / NEW)
    root = tmp / "ckpt"
    rng = random.Random(20261125)
    window = 0.0  # how long a save takes, from its temporary directory's appearing to the run's end
    seen = []
    for kill in range(KILLS + 1):
        shutil.copytree(tmp / "start", root)
        if kill == 0:  # the first run is not killed: it measures the save
            report = trainer.run(_args(corpus, root, 2), watch=root / f"{NEW}.tmp")
            assert report["status"] == 0
            window = report["after_watch"]
            assert window is not None, "the save ended before its temporary directory was seen"
        else:
            report = trainer.run(_args(corpus, root, 2), watch=root / f"{NEW}.tmp", kill_after=rng.uniform(0, 1.2) * window)
            assert report["status"] in (-signal.SIGKILL, 0)

        tracker = (root / TRACKER).read_text().strip()
        assert tracker in ("1", "2")
        assert _files(root / PREVIOUS) == previous, "the previous checkpoint changed"
        if (root / NEW).exists():
            assert _files(root / NEW) == new, "a kill left iter_0000002 in place but incomplete or different"
        assert tracker == "1" or (root / NEW).is_dir(), "the tracker points at a checkpoint that is not there"
        _verifies(root / (PREVIOUS if tracker == "1" else NEW))
        seen.append("new" if tracker == "2" else "renamed" if (root / NEW).exists() else "partial")

        assert trainer.run(_args(corpus, root, 2))["status"] == 0  # the rerun resumes from the tracker's checkpoint
        assert (root / TRACKER).read_text().strip() == "2"
        assert _files(root / NEW) == new, f"the rerun after a kill ({seen[-1]}) differs from an uninterrupted run"
        assert _files(root / PREVIOUS) == previous
        assert sorted(p.name for p in root.iterdir()) == [PREVIOUS, NEW, TRACKER, "tokenizer.json"]
        shutil.rmtree(root)
    print(f"save window {window:.2f} s; kills landed: {seen}")
    assert seen.count("partial") >= 3, seen  # kills did land while the save was writing


def test_a_resave_stopped_between_the_two_renames_is_put_back_on_load(start, tmp_path, monkeypatch):
    """Where the filesystem cannot exchange two directories in one step (NFS, Lustre), re-saving an iteration moves
    the old one aside, then the new one in: a kill between the two leaves the tracker on a missing directory, and
    the next load (or save) puts the old one back."""
    from reshard.trainer import checkpoint

    _, tmp, _ = start
    root = Path(shutil.copytree(tmp / "a", tmp_path / "ckpt"))
    shutil.copytree(root / NEW, root / f"{NEW}.tmp")  # the re-save's new directory, still pending
    (root / NEW).rename(root / f".{NEW}.reshard-old")  # `replace_dir`'s first rename; the second never came
    with monkeypatch.context() as off:  # the defence off: the load is refused, the checkpoint out of reach
        off.setattr(checkpoint, "put_back", lambda target, pending: None)
        with pytest.raises(checkpoint.CheckpointError, match="not a complete torch_dist checkpoint"):
            checkpoint.find_checkpoint(root)
    assert checkpoint.find_checkpoint(root) == root / NEW
    assert _files(root / NEW) == _files(tmp / "a" / NEW)
    _verifies(root / NEW)
