"""The destination of a conversion: one writer at a time, and the old checkpoint or the new one in place
whenever the run stops."""

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.models import PRESETS, TINY_LLAMA
from fixtures.synthetic import write_synthetic
from fixtures.torchrun import REPO, pythonpath
from reshard.convert import DestinationLock, convert, partial_path
from reshard.errors import KeepsPartial, ReshardError
from reshard.layout import Layout
from reshard.request import Target
from tests.arrays import same, tensors


def _digest(path):
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture()
def pair(tmp_path):
    """A source at TP2 and an existing destination (TP1) holding another checkpoint."""
    write_synthetic(tmp_path / "src", TINY_LLAMA, Layout(tp=2), "torch_dist")
    write_synthetic(tmp_path / "dst", TINY_LLAMA, Layout(tp=1), "torch_dist", seed=1)
    return tmp_path / "src", tmp_path / "dst"


def _leftovers(dst):
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def test_a_second_writer_is_refused_while_another_process_writes_the_destination(pair):
    src, dst = pair
    before = _digest(dst)
    partial = partial_path(dst)
    partial.mkdir()
    (partial / "theirs").write_text("the other writer's progress")
    holder = subprocess.Popen(  # another process, holding the destination as a running conversion does
        [sys.executable, "-c", "import sys; from pathlib import Path; from reshard.convert import DestinationLock; "
         "DestinationLock(Path(sys.argv[1])).acquire(); print('held', flush=True); sys.stdin.read()", str(dst)],
        cwd=REPO, env={"PYTHONPATH": pythonpath(), "PATH": "/usr/bin:/bin"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # it holds the lock until it is killed (its stdin never ends), however long the refusal takes on a busy machine
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ReshardError, match=rf"{dst} is being written by another reshard convert \(pid {holder.pid} "):
            convert(src, dst, Target(layout=Layout(tp=1)), overwrite=True)
    finally:
        holder.kill()
        holder.wait()
    assert _digest(dst) == before
    assert (partial / "theirs").read_text() == "the other writer's progress"  # its partial output is its own
    convert(src, dst, Target(layout=Layout(tp=1)), overwrite=True)  # the lock died with its holder
    assert _leftovers(dst) == []


def test_the_lock_is_released_after_a_refusal_and_after_success(pair):
    src, dst = pair
    with pytest.raises(ReshardError, match="exists and is not empty"):
        convert(src, dst, Target(layout=Layout(tp=1)))
    convert(src, dst, Target(layout=Layout(tp=1)), overwrite=True)
    lock = DestinationLock(dst)
    lock.acquire()  # nobody holds it
    lock.release()
    assert _leftovers(dst) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_overwrite_replaces_the_destination_whole(pair, monkeypatch, exchange):
    src, dst = pair
    if not exchange:
        monkeypatch.setattr("reshard.atomic._exchange", lambda a, b: False)
    convert(src, dst, Target(layout=Layout(tp=1)), overwrite=True)
    new, old = tensors(dst), tensors(src)
    assert set(new) == set(old) and all(same(new[n], old[n]) for n in old)
    assert _leftovers(dst) == []


def test_a_run_stopped_between_the_two_renames_gets_the_old_checkpoint_back(pair, monkeypatch):
    src, dst = pair
    before = _digest(dst)
    monkeypatch.setattr("reshard.atomic._exchange", lambda a, b: False)
    renames = []
    real = type(dst).rename

    def stop_after_first(self, target):
        renames.append(self)
        if len(renames) == 2:
            raise KeyboardInterrupt  # a kill after the old checkpoint moved aside
        return real(self, target)

    monkeypatch.setattr(type(dst), "rename", stop_after_first)
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, Target(layout=Layout(tp=1)), overwrite=True)
    monkeypatch.setattr(type(dst), "rename", real)
    assert not dst.exists()
    with pytest.raises(ReshardError, match="exists and is not empty"):  # the next run puts it back first
        convert(src, dst, Target(layout=Layout(tp=1)))
    assert _digest(dst) == before


def test_a_symlinked_destination_is_replaced_where_it_points_and_the_link_kept(pair, tmp_path):
    src, real = pair
    link = tmp_path / "latest"
    link.symlink_to(real, target_is_directory=True)
    convert(src, link, Target(layout=Layout(tp=1)), overwrite=True)
    assert link.is_symlink() and link.resolve() == real.resolve()
    new, old = tensors(link), tensors(src)
    assert all(same(new[n], old[n]) for n in old)


def test_a_full_disk_names_the_destination_and_keeps_the_partial_output(pair, monkeypatch):
    src, dst = pair

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("reshard.convert.write_moves", full)
    with pytest.raises(KeepsPartial, match=rf"the disk holding {dst} is full \(No space left on device\); free space"):
        convert(src, dst, Target(layout=Layout(tp=1)), overwrite=True)
    assert partial_path(dst).is_dir()


def test_a_lock_on_a_file_its_holder_removed_is_not_kept(tmp_path, monkeypatch):
    """A process that opened the lock file just before its holder released it (and removed it) must not keep
    a lock on the removed file: a third writer would create a new one and both would hold 'the' lock."""
    import fcntl
    import os

    lock = DestinationLock(tmp_path / "out")
    real, calls = fcntl.flock, []

    def holder_releases_first(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            lock.path.unlink()  # the holder's release, between our open and our flock
        return real(fd, op)

    monkeypatch.setattr("reshard.convert.fcntl.flock", holder_releases_first)
    lock.acquire()
    assert len(calls) == 2  # taken again, on the file the path names
    assert os.stat(lock.path).st_ino == os.fstat(lock.fd).st_ino
    lock.release()


@pytest.mark.parametrize("where", ["under-a-file", "unwritable"])
def test_a_destination_that_cannot_be_written_is_one_line(pair, tmp_path, where):
    src, _ = pair
    (tmp_path / "afile").write_text("x")
    dst = tmp_path / "afile" / "out" if where == "under-a-file" else Path("/proc/out")  # not even root may create files there
    with pytest.raises(ReshardError, match=rf"cannot write {dst}: .*; choose another destination"):
        convert(src, dst, Target(layout=Layout(tp=1)))


def _content(path):
    """`_digest` of a checkpoint without the manifest's wall-clock time (in reshard_manifest.json, or zarr.json's
    attributes), the one value two runs may differ in."""

    def timeless(value):
        if isinstance(value, dict):
            return {k: timeless(v) for k, v in value.items() if not (k == "time" and "tool" in value)}
        return [timeless(v) for v in value] if isinstance(value, list) else value

    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode())
        if f.name in ("reshard_manifest.json", "zarr.json"):
            h.update(json.dumps(timeless(json.loads(f.read_text())), sort_keys=True).encode())
        else:
            h.update(f.read_bytes())
    return h.hexdigest()


@pytest.mark.slow  # kills conversions at random moments (a clock)
@pytest.mark.parametrize("fmt,kills", [("torch_dist", 12), ("zarr", 8)])
def test_kill_9_at_random_points_leaves_the_old_checkpoint_or_the_new_one(tmp_path, fmt, kills):
    """`convert --overwrite` killed (SIGKILL, no cleanup) at random moments, from start-up to past the rename:
    the destination then holds the previous checkpoint or the complete new one, nothing else; the rerun
    resumes or redoes the work and ends equal byte for byte to an uninterrupted run's output (the manifest's
    clock aside), leaving nothing beside the destination."""
    src, old = tmp_path / "src", tmp_path / "old"
    write_synthetic(src, PRESETS["small-llama"], Layout(tp=2), "torch_dist", optimizer=fmt == "torch_dist")
    write_synthetic(old, PRESETS["small-llama"], Layout(tp=1), fmt, seed=1)
    env = dict(os.environ, PYTHONPATH=pythonpath())
    dst = tmp_path / "dst"
    command = [sys.executable, "-m", "reshard", "convert", str(src), str(dst), "--to-format", fmt,
               "--to-tp", "1", "--to-pp", "2", "--overwrite", "-q"]
    started = time.monotonic()
    subprocess.run(command, check=True, env=env, capture_output=True)
    took = time.monotonic() - started
    new = _content(dst)
    shutil.rmtree(dst)
    previous = _content(old)
    rng = random.Random(20261125)
    seen = []
    for kill in range(kills):
        shutil.copytree(old, dst, symlinks=True)
        run = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if kill == 0:  # once as soon as the partial output exists, whatever the machine's speed: the moments drawn
            _wait_for(partial_path(dst), run)  # from the first run's time can all land before it on a busy machine
        else:
            time.sleep(rng.uniform(0.2, 1.1) * took)
        run.send_signal(signal.SIGKILL)
        run.wait()
        after_kill = _content(dst)
        assert after_kill in (previous, new), "a kill left the destination neither the old checkpoint nor the new one"
        seen.append("new" if after_kill == new else "partial" if partial_path(dst).exists() else "old")
        subprocess.run(command, check=True, env=env, capture_output=True)
        assert _content(dst) == new, f"the rerun after a kill ({seen[-1]}) differs from an uninterrupted run"
        assert _leftovers(dst) == []
        shutil.rmtree(dst)
    assert _content(old) == previous
    assert "partial" in seen, seen  # a kill did land while the conversion was writing


def _wait_for(path: Path, run: subprocess.Popen) -> None:
    """Return once `path` exists (or `run` has ended, which the test's assertions then show)."""
    while not path.exists() and run.poll() is None:
        time.sleep(0.002)


# Siblings reshard makes beside a destination (issue 33, item 3), planted by someone else: each is refused in one
# line naming it, or left alone, and never written through.

def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_text("not reshard's")
    return victim


@pytest.mark.parametrize("plant", ["symlink", "hard link", "directory"])
def test_a_planted_lock_is_refused_and_not_written_through(pair, tmp_path, plant):
    src, dst = pair
    victim = _victim(tmp_path)
    lock = DestinationLock(dst).path
    if plant == "symlink":
        lock.symlink_to(victim)
    elif plant == "hard link":
        os.link(victim, lock)
    else:
        lock.mkdir()
    before, source = _digest(dst), _digest(src)
    with pytest.raises(ReshardError, match=rf"{lock} is (a symbolic link|a hard link|not a plain file): reshard did not leave it there") as refused:
        convert(src, dst, Target(layout=Layout(tp=1)), overwrite=True)
    assert "\n" not in str(refused.value)
    assert victim.read_text() == "not reshard's" and _digest(dst) == before and _digest(src) == source


@pytest.mark.parametrize("plant", ["symlink", "file", "link inside"])
def test_a_planted_partial_output_is_refused_and_not_written_through(pair, tmp_path, plant):
    src, dst = pair
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("not reshard's")
    victim = _victim(tmp_path)
    partial = partial_path(dst)
    if plant == "symlink":
        partial.symlink_to(elsewhere, target_is_directory=True)
    elif plant == "file":
        partial.write_text("not reshard's")
    else:
        partial.mkdir()
        (partial / "__0_0.distcp").symlink_to(victim)
    before, source = _digest(dst), _digest(src)
    with pytest.raises(ReshardError, match=f"{partial}.* reshard did not leave it there") as refused:
        convert(src, dst, Target(layout=Layout(tp=1)), overwrite=True)
    assert "\n" not in str(refused.value)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep"] and victim.read_text() == "not reshard's"
    assert _digest(dst) == before and _digest(src) == source


@pytest.mark.parametrize("plant", ["directory", "symlink"])
def test_a_stray_old_sibling_stays_where_it_is(pair, tmp_path, plant):
    """Nothing was being replaced (no destination, no pending output): a `.DEST.reshard-old` is not a checkpoint to
    put back, and the fresh destination is the conversion's own."""
    src, _ = pair
    dst = tmp_path / "fresh"
    stray = tmp_path / ".fresh.reshard-old"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("not reshard's")
    if plant == "directory":
        shutil.copytree(elsewhere, stray)
    else:
        stray.symlink_to(elsewhere, target_is_directory=True)
    convert(src, dst, Target(layout=Layout(tp=1)))
    assert not (dst / "keep").exists()
    new, old = tensors(dst), tensors(src)
    assert set(new) == set(old) and all(same(new[n], old[n]) for n in old)
    assert sorted(p.name for p in stray.iterdir()) == ["keep"] and os.path.islink(stray) == (plant == "symlink")


def test_a_stray_old_sibling_beside_an_existing_destination_is_refused(pair, tmp_path):
    """Replacing the destination may move it aside under that name: someone else's directory there is refused."""
    src, dst = pair
    stray = tmp_path / f".{dst.name}.reshard-old"
    stray.mkdir()
    (stray / "keep").write_text("not reshard's")
    before = _digest(dst)
    with pytest.raises(ReshardError, match=f"{stray} is a directory reshard has not put back"):
        convert(src, dst, Target(layout=Layout(tp=1)), overwrite=True)
    assert (stray / "keep").read_text() == "not reshard's" and _digest(dst) == before
