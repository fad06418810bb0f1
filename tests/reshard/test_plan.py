"""Units of work: which records a unit holds as contiguous runs, and when it may be cut into them; the
default memory budget."""

from __future__ import annotations

from types import SimpleNamespace

from reshard.plan import UNIT_BYTES, Unit, default_budget

MIB = 1 << 20


def test_runs_are_the_records_in_memory_order_when_they_tile_the_unit():
    # a [4, 6] unit cut by rows into two records: each is one run of the buffer
    unit = Unit(((0, 4), (0, 6)), [], [((2, 4), (0, 6)), ((0, 2), (0, 6))])
    assert unit.runs() == [((0, 2), (0, 6)), ((2, 4), (0, 6))]


def test_a_record_split_along_the_last_axis_is_strided():
    unit = Unit(((0, 4), (0, 6)), [], [((0, 4), (0, 3)), ((0, 4), (3, 6))])
    assert unit.runs() is None


def test_cut_by_record_only_where_the_records_cover_the_unit_once():
    columns = [((0, 4), (0, 3)), ((0, 4), (3, 6))]
    cut = Unit(((0, 4), (0, 6)), [], columns).by_record()
    assert [u.region for u in cut] == columns and [u.records for u in cut] == [[r] for r in columns]
    # the same region written by two ranks (a replicated tensor) is one unit
    assert [u.region for u in Unit(((0, 4), (0, 6)), [], [((0, 4), (0, 6))] * 2).by_record()] == [((0, 4), (0, 6))]
    assert Unit(((0, 4), (0, 6)), [], columns[:1]).by_record() is None  # a gap: nothing would read it
    overlapping = [((0, 4), (0, 4)), ((0, 4), (2, 4))]  # as large together as the unit, but overlapping
    assert Unit(((0, 4), (0, 6)), [], overlapping).by_record() is None


def test_default_budget_reads_ahead_a_unit_per_worker_within_an_eighth_of_ram(monkeypatch):
    def ram(nbytes):
        monkeypatch.setattr("reshard.plan.psutil.virtual_memory", lambda: SimpleNamespace(total=nbytes))

    ram(64 << 30)
    assert default_budget(10 * MIB, workers=2) == 20 * MIB + 256 * MIB  # at least 256 MiB ahead
    assert default_budget(10 * MIB, workers=8) == 20 * MIB + 8 * UNIT_BYTES
    ram(1 << 30)
    assert default_budget(10 * MIB, workers=8) == 20 * MIB + 128 * MIB  # a small machine: an eighth of RAM
