"""Durable updates that write only what they made: a temporary sibling is never written through, and only a
replacement stopped half-way is undone."""

import os

import pytest

from reshard.atomic import aside, put_back, write_atomic


@pytest.mark.parametrize("plant", ["symlink", "hard link"])
def test_write_atomic_does_not_write_through_a_planted_temporary_file(tmp_path, plant):
    victim = tmp_path / "victim"
    victim.write_text("not ours")
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    planted = tmp_path / f".{tracker.name}.tmp"
    if plant == "symlink":
        planted.symlink_to(victim)
    else:
        os.link(victim, planted)
    write_atomic(tracker, "7\n")
    assert tracker.read_text() == "7\n" and not tracker.is_symlink()
    assert victim.read_text() == "not ours" and not os.path.lexists(planted)


def _old_checkpoint(target):
    old = aside(target)
    old.mkdir()
    (old / "weights").write_text("the old checkpoint")
    return old


def test_a_replacement_stopped_between_its_renames_is_undone(tmp_path):
    target, pending = tmp_path / "ckpt", tmp_path / ".ckpt.reshard-partial"
    _old_checkpoint(target)
    pending.mkdir()
    put_back(target, pending)
    assert (target / "weights").read_text() == "the old checkpoint" and not os.path.lexists(aside(target))


@pytest.mark.parametrize("case", ["no pending output", "a link aside", "the target exists"])
def test_a_stray_directory_aside_is_not_put_back(tmp_path, case):
    target, pending = tmp_path / "ckpt", tmp_path / ".ckpt.reshard-partial"
    if case == "a link aside":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        aside(target).symlink_to(elsewhere, target_is_directory=True)
    else:
        _old_checkpoint(target)
    if case != "no pending output":
        pending.mkdir()
    if case == "the target exists":
        target.mkdir()
    put_back(target, pending)
    assert os.path.lexists(aside(target))
    assert not os.path.lexists(target) or not any(target.iterdir())
