"""The disk probe behind `--dry-run --disk-speed probe`."""

from __future__ import annotations

from reshard.disk_speed import copy_speed


def test_the_disk_probe_copies_beside_a_destination_not_yet_made_and_leaves_nothing(tmp_path):
    assert copy_speed(tmp_path / "not" / "yet", total=8 << 20, threads=2) > 0
    assert list(tmp_path.iterdir()) == []
