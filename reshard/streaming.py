"""The streaming engine: every tensor of a plan read unit by unit, hashed, and handed to a writer.

Workers read and hash units of work ahead of the writer (within the plan's memory budget); the writer takes
them in plan order, so the output is the same whatever the number of workers. `reshard.convert` wraps this
in the conversion's transaction (partial output, resume, verification, replace).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from reshard import __version__
from reshard.buffers import Pool
from reshard.checksum import Checksum, HashedParts, TensorChecksum
from reshard.dtypes import itemsize, numpy_dtype
from reshard.formats.base import CheckpointReader, CheckpointWriter, Manifest
from reshard.pipeline import ordered_map
from reshard.plan import BAND_BYTES, ConversionPlan, TensorMove, Unit
from reshard.sharding import Piece, Region, bands, region_size, shift, to_slices
from reshard.worklog import Done

Progress = Callable[[int], None]  # called with the bytes just processed


def read_slab(reader: CheckpointReader, move: TensorMove, slab: Region, out: np.ndarray) -> None:
    """Fill `out` with the target slab's values: the source region, zero-padded where the target
    vocabulary is larger."""
    source_rows = move.source.shape[0] if move.source.shape else 1
    if not move.target.vocab or slab[0][1] <= source_rows:
        reader.read_into(move.source.name, slab, out)
        return
    inside = ((slab[0][0], min(slab[0][1], source_rows)), *slab[1:])
    rows = max(0, inside[0][1] - inside[0][0])
    out[rows:] = 0
    if rows:
        reader.read_into(move.source.name, inside, out[:rows])


@dataclass
class _Prepared:
    """One slab read (and hashed) by a worker, waiting to be written in order."""

    move: TensorMove
    slab: Region
    pieces: list[Piece]  # the target pieces in this slab
    data: np.ndarray
    buffer: np.ndarray  # the pool's slab buffer, given back once written (`data` unless cast)
    prepared: Any  # the writer's `prepare` result
    as_read: TensorChecksum  # of the source values
    as_written: TensorChecksum  # of the values after a dtype cast (the same object when there is none), or as stored


class _Reading:
    """What the reading threads do for one conversion: read a unit of work, hash it, cast it, and let the
    writer prepare it; large slabs are read and hashed in bands on helper threads."""

    def __init__(self, reader: CheckpointReader, plan: ConversionPlan, writer: CheckpointWriter, pool: Pool, workers: int):
        self.reader, self.plan, self.writer, self.pool, self.workers = reader, plan, writer, pool, workers
        self.content = {m.target.name: reader.config.vocab_rows if m.target.vocab and reader.config else None for m in plan.moves}
        self.helpers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reshard-band") if workers > 1 else None

    def checksum(self, move: TensorMove, dtype: str) -> TensorChecksum:
        """An empty checksum of `move`'s target tensor, over values of `dtype`."""
        return TensorChecksum(move.target.shape, dtype, self.content[move.target.name])

    def jobs(self) -> Iterator[tuple[TensorMove, Unit, Any]]:
        """Every unit of work in plan order, with what the writer reserved for it."""
        for move in self.plan.moves:
            for unit in self.plan.units(move):
                self.reader.prefetch(move.source.name, unit.region)
                yield move, unit, self.writer.reserve(move.target, unit.region, unit.pieces)

    def prepare(self, job: tuple[TensorMove, Unit, Any]) -> _Prepared:
        move, unit, reserved = job
        slab = unit.region
        data = buffer = self.pool.array([b - a for a, b in slab], numpy_dtype(move.source.dtype))
        as_read, hashed = self.read_and_hash_parts(move, unit, data)
        as_written, written_parts = as_read, hashed
        if move.target.dtype != move.source.dtype:
            data = data.astype(numpy_dtype(move.target.dtype))
            as_written, written_parts = self.checksum(move, move.target.dtype), None
            as_written.add(slab, data)
        prepared = self.writer.prepare(move.target, slab, data, unit.pieces, reserved, written_parts)
        if self.writer.stored_dtype(move.target) is not None:
            as_written = prepared  # the checksum of the values the writer stored instead
        return _Prepared(move, slab, unit.pieces, data, buffer, prepared, as_read, as_written)

    def read_and_hash_parts(self, move: TensorMove, unit: Unit, out: np.ndarray) -> tuple[TensorChecksum, HashedParts]:
        """Read `unit` into `out` and hash it: by the writer's records where they tile it (`Unit.runs`: hashing
        by them spares hashing each record again as written), else whole (in bands on the helper threads
        when it is large)."""
        parts = unit.runs() if out.nbytes < 2 * BAND_BYTES else None
        if parts is None:
            whole = self.read_and_hash(move, unit.region, out)
            return whole, HashedParts({unit.region: (out, whole)})
        read_slab(self.reader, move, unit.region, out)
        total = self.checksum(move, move.source.dtype)
        hashed = {}
        for region in parts:
            view = out[to_slices(shift(region, unit.region))]
            part = self.checksum(move, move.source.dtype)
            part.add(region, view)
            total.merge(part)
            hashed[region] = (view, part)
        return total, HashedParts(hashed)

    def read_and_hash(self, move: TensorMove, slab: Region, out: np.ndarray) -> TensorChecksum:
        """Read `slab` into `out` and hash it, in bands on the helper threads when it is large."""

        def band(region: Region) -> TensorChecksum:
            view = out[to_slices(shift(region, slab))]
            read_slab(self.reader, move, region, view)
            part = self.checksum(move, move.source.dtype)
            part.add(region, view)
            return part

        size = out.nbytes
        if self.helpers is None or size < 2 * BAND_BYTES:
            return band(slab)
        parts = list(self.helpers.map(band, bands(slab, min(self.workers, size // BAND_BYTES))))
        for part in parts[1:]:
            parts[0].merge(part)
        return parts[0]

    def close(self) -> None:
        if self.helpers is not None:
            self.helpers.shutdown(cancel_futures=True)


def write_moves(
    reader: CheckpointReader,
    plan: ConversionPlan,
    writer: CheckpointWriter,
    progress: Progress | None,
    workers: int = 1,
    finished: Callable[[Done], None] | None = None,
    pool: Pool | None = None,
) -> tuple[dict[str, Checksum], dict[str, Checksum]]:
    """Copy every tensor of the plan into `writer`, unit of work by unit (`ConversionPlan.units`: slabs, a
    large one in parts). Returns the checksums of the values as written (after a cast to the target dtype,
    when a move changes it) and as read. Workers read and hash units ahead (within `plan.read_ahead`
    bytes); the writer takes them in plan order, so the output is the same whatever the number of workers.
    `finished` hears of each tensor once it is wholly written."""
    pool = pool or Pool()
    reading = _Reading(reader, plan, writer, pool, workers)
    read_sums = {m.target.name: reading.checksum(m, m.source.dtype) for m in plan.moves}
    written_sums = {m.target.name: reading.checksum(m, writer.stored_dtype(m.target) or m.target.dtype) for m in plan.moves}
    current: str | None = None

    def close(name: str) -> None:
        if finished:
            finished(Done(name, written_sums[name].result(), read_sums[name].result()))

    def slab_bytes(job: tuple[TensorMove, Unit, Any]) -> int:
        return region_size(job[1].region) * itemsize(job[0].source.dtype)

    try:
        for item in ordered_map(reading.prepare, reading.jobs(), workers, plan.read_ahead(workers), slab_bytes):
            name = item.move.target.name
            if name != current:  # moves arrive one after another
                if current is not None:
                    close(current)
                current = name
            writer.write(item.move.target, item.slab, item.data, item.pieces, item.prepared)
            pool.give(item.buffer)
            read_sums[name].merge(item.as_read)
            written_sums[name].merge(item.as_written)
            if progress:
                progress(item.data.nbytes)
    finally:
        reading.close()
    if current is not None:
        close(current)
    written = {name: acc.result() for name, acc in written_sums.items()}
    return written, {name: acc.result() for name, acc in read_sums.items()}


def manifest_for(plan: ConversionPlan, checksums: dict[str, Checksum]) -> Manifest:
    return Manifest(
        format=plan.target_format,
        config=plan.config,
        layout=plan.target_layout,
        checksums=checksums,
        provenance={
            "tool": f"reshard {__version__}",
            "source": str(plan.source),
            "source_format": plan.source_format,
            "source_layout": str(plan.source_layout),
            "dropped": plan.dropped,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )


def stream(
    reader: CheckpointReader,
    plan: ConversionPlan,
    progress: Progress | None = None,
    source_checksums: dict[str, Checksum] | None = None,
    workers: int = 1,
) -> Manifest:
    """Write the whole plan at `plan.target` in one process, with no partial output, resume or verification
    (fixtures and benchmarks); the manifest holds the checksums as written. `source_checksums`, if given,
    receives the checksums of the values as read, before any cast."""
    writer = plan.new_writer()
    written, as_read = write_moves(reader, plan, writer, progress, workers)
    if source_checksums is not None:
        source_checksums.update(as_read)
    manifest = manifest_for(plan, written)
    writer.finish(manifest)
    return manifest
