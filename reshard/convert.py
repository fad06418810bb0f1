"""`convert`: stream a checkpoint into another format and/or layout, verify it, then move it into place."""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from reshard import __version__
from reshard.buffers import Pool
from reshard.checksum import Checksum, HashedParts, TensorChecksum
from reshard.distributed import convert_distributed, process_group, world
from reshard.errors import KeepsPartial, ReshardError
from reshard.formats import WRITERS, open_checkpoint
from reshard.formats.base import CheckpointReader, CheckpointWriter, Manifest
from reshard.layout import Layout
from reshard.logical import normalize_dtype
from reshard.pipeline import ordered_map
from reshard.dtypes import itemsize, numpy_dtype
from reshard.plan import BAND_BYTES, ConversionPlan, TensorMove, Unit, human_bytes, make_plan
from reshard.sharding import Piece, Region, bands, region_size, shift, to_slices
from reshard.verify import compare, compute_checksums
from reshard.worklog import Done, Recorder, Resumed, WorkLog, fingerprint

Progress = Callable[[int], None]  # called with the bytes just processed


@dataclass
class ConversionResult:
    plan: ConversionPlan
    manifest: Manifest | None  # None for a dry run
    seconds: float


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
    as_written: TensorChecksum  # of the values after a dtype cast (the same object when there is none)


def new_writer(plan: ConversionPlan, writer_options: dict[str, Any]) -> CheckpointWriter:
    specs = {m.target.name: m.target for m in plan.moves}
    return WRITERS[plan.target_format](plan.target, plan.config, plan.target_layout, specs, plan.common, **writer_options)


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
    content = {m.target.name: reader.config.vocab_rows if m.target.vocab else None for m in plan.moves}
    pool = pool or Pool()
    helpers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reshard-band") if workers > 1 else None

    def read_and_hash(move: TensorMove, slab: Region, out: np.ndarray) -> TensorChecksum:
        """Read `slab` into `out` and hash it, in bands on the helper threads when it is large."""

        def band(region: Region) -> TensorChecksum:
            view = out[to_slices(shift(region, slab))]
            read_slab(reader, move, region, view)
            part = TensorChecksum(move.target.shape, move.source.dtype, content[move.target.name])
            part.add(region, view)
            return part

        size = out.nbytes
        if helpers is None or size < 2 * BAND_BYTES:
            return band(slab)
        parts = list(helpers.map(band, bands(slab, min(workers, size // BAND_BYTES))))
        for part in parts[1:]:
            parts[0].merge(part)
        return parts[0]

    def read_and_hash_parts(move: TensorMove, unit: Unit, out: np.ndarray) -> tuple[TensorChecksum, HashedParts]:
        """Read `unit` into `out` and hash it: by the writer's records where they tile it (`Unit.runs`: hashing
        by them spares hashing each record again as written), else whole (in bands on the helper threads
        when it is large)."""
        parts = unit.runs() if out.nbytes < 2 * BAND_BYTES else None
        if parts is None:
            whole = read_and_hash(move, unit.region, out)
            return whole, HashedParts({unit.region: (out, whole)})
        read_slab(reader, move, unit.region, out)
        total = TensorChecksum(move.target.shape, move.source.dtype, content[move.target.name])
        hashed = {}
        for region in parts:
            view = out[to_slices(shift(region, unit.region))]
            part = TensorChecksum(move.target.shape, move.source.dtype, content[move.target.name])
            part.add(region, view)
            total.merge(part)
            hashed[region] = (view, part)
        return total, HashedParts(hashed)

    def prepare(job: tuple[TensorMove, Unit, Any]) -> _Prepared:
        move, unit, reserved = job
        slab = unit.region
        data = buffer = pool.array([b - a for a, b in slab], numpy_dtype(move.source.dtype))
        as_read, hashed = read_and_hash_parts(move, unit, data)
        as_written, written_parts = as_read, hashed
        if move.target.dtype != move.source.dtype:
            data = data.astype(numpy_dtype(move.target.dtype))
            as_written, written_parts = TensorChecksum(move.target.shape, move.target.dtype, content[move.target.name]), None
            as_written.add(slab, data)
        prepared = writer.prepare(move.target, slab, data, unit.pieces, reserved, written_parts)
        return _Prepared(move, slab, unit.pieces, data, buffer, prepared, as_read, as_written)

    def jobs() -> Iterator[tuple[TensorMove, Unit, Any]]:
        for move in plan.moves:
            for unit in plan.units(move):
                reader.prefetch(move.source.name, unit.region)
                yield move, unit, writer.reserve(move.target, unit.region, unit.pieces)

    read_sums = {m.target.name: TensorChecksum(m.target.shape, m.source.dtype, content[m.target.name]) for m in plan.moves}
    written_sums = {m.target.name: TensorChecksum(m.target.shape, m.target.dtype, content[m.target.name]) for m in plan.moves}
    current: str | None = None

    def close(name: str) -> None:
        if finished:
            finished(Done(name, written_sums[name].result(), read_sums[name].result()))

    def slab_bytes(job: tuple[TensorMove, Unit, Any]) -> int:
        return region_size(job[1].region) * itemsize(job[0].source.dtype)

    try:
        for item in ordered_map(prepare, jobs(), workers, plan.read_ahead(workers), slab_bytes):
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
        if helpers is not None:
            helpers.shutdown(cancel_futures=True)
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
    writer_options: dict[str, Any],
    progress: Progress | None,
    source_checksums: dict[str, Checksum] | None = None,
    workers: int = 1,
) -> Manifest:
    """Write the whole plan at `plan.target` in one process; the manifest holds the checksums as written.
    `source_checksums`, if given, receives the checksums of the values as read, before any cast."""
    writer = new_writer(plan, writer_options)
    written, as_read = write_moves(reader, plan, writer, progress, workers)
    if source_checksums is not None:
        source_checksums.update(as_read)
    manifest = manifest_for(plan, written)
    writer.finish(manifest)
    return manifest


def partial_path(target: Path) -> Path:
    """Where a conversion writes until its output verifies: a hidden sibling of the target, by a fixed
    name, so that running the same command again finds it (and resumes or clears it)."""
    return target.with_name(f".{target.name}.reshard-partial")


def _check_destination(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ReshardError(f"{target} exists and is a file; choose another destination")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ReshardError(f"{target} exists and is not empty; pass --overwrite to replace it or choose another destination")


def check_free_space(partial: Path, target: Path, needed: int, resuming: bool, freed: int = 0) -> None:
    """Refuse up front what cannot fit, instead of failing with a full disk after writing most of it. The
    tensors' bytes alone (as the files hold them, legacy's copies included) are counted: headers and
    metadata add little, so nothing that fits is refused; an old destination given to --overwrite is
    removed only after, so it still takes its space.
    `freed`: what a resumed run's partial output holds that writing the rest removes first (see
    `CheckpointWriter.held_for`). A resumed run's refusal keeps what it had converted."""
    stats = os.statvfs(partial)
    free = stats.f_frsize * (stats.f_bfree if os.geteuid() == 0 else stats.f_bavail) + freed  # root may use the reserve
    if needed > free:
        again = "run the same command again (it resumes)" if resuming else "run the same command again"
        raise (KeepsPartial if resuming else ReshardError)(
            f"not enough free space for {target}: the conversion writes {human_bytes(needed)} more and "
            f"{human_bytes(free)} is free there; free space and {again}, choose another destination, or pass "
            "--no-space-check if this filesystem misreports its free space"
        )


def _replace(tmp: Path, target: Path) -> None:
    """Move the verified output into place; an old destination is removed only after the rename."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.reshard-old-{os.getpid()}")
        target.rename(old)
    tmp.rename(target)
    if old is not None:
        shutil.rmtree(old)


def _convert_here(
    reader: CheckpointReader,
    plan: ConversionPlan,
    target: Path,
    options: dict[str, Any],
    progress: Progress | None,
    workers: int,
    reread: bool,
    check_space: bool,
) -> Manifest:
    """Write into a partial sibling directory, resuming a previous interrupted run of the same conversion,
    verify everything written against the source, then move it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(target)
    full = replace(plan, target=tmp)
    log = WorkLog(tmp, fingerprint(plan, options))
    resumable = WRITERS[plan.target_format].resumable
    resumed = (log.resume() if resumable and tmp.is_dir() else None) or Resumed([], [])
    done = resumed.done
    if not done:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        writer = new_writer(full, options)
        if done:
            writer.restore(resumed.facts)
        else:
            tmp.mkdir(parents=True, exist_ok=True)
            log.start()
        finished = {d.name for d in done}
        remaining = replace(full, moves=[m for m in plan.moves if m.target.name not in finished])
        if check_space:
            freed = writer.held_for([m.target.name for m in remaining.moves]) if done else 0
            check_free_space(tmp, target, remaining.bytes_stored, bool(done), freed)
        recorder = Recorder(log, writer) if resumable else None
        pool = Pool()  # slab buffers, reused by the verification pass
        try:
            written, as_read = write_moves(reader, remaining, writer, progress, workers, finished=recorder, pool=pool)
            writer.before_finish()
        finally:
            if recorder:
                recorder.close()
        hash_workers = plan.hash_workers()
        pool.shrink(hash_workers)
        written.update({d.name: d.written for d in done})
        as_read.update({d.name: d.read for d in done})
        if reader.manifest is not None:
            compare(as_read, reader.manifest.checksums, "source as read", "source's recorded checksums", subset=True).raise_if_bad(
                f"{plan.source} does not match the checksums recorded when it was written"
            )
        manifest = manifest_for(plan, written)
        writer.finish(manifest)
        with open_checkpoint(tmp, plan.target_format) as written_back:
            records = None if reread else writer.written_records()
            checked = compute_checksums(written_back, workers=hash_workers, pool=pool, written=records)
            compare(checked, written, "written", "source").raise_if_bad("the written checkpoint does not match the source")
        log.remove()  # only now: a run stopped while verifying resumes at `finish`, not from the start
        _replace(tmp, target)
    except ReshardError as exc:
        if not isinstance(exc, KeepsPartial):
            shutil.rmtree(tmp, ignore_errors=True)  # a refusal: nothing worth resuming
        raise
    except BaseException:
        if not resumable:
            shutil.rmtree(tmp, ignore_errors=True)
        raise  # interrupted or crashed: the partial directory stays, and the same command resumes it
    return manifest


def convert(
    source: Path | str,
    target: Path | str,
    *,
    to_format: str | None = None,
    layout: Layout | Callable[[Layout], Layout] | None = None,
    expect_layout: dict[str, int] | None = None,
    optimizer: bool = True,
    overwrite: bool = False,
    dry_run: bool = False,
    vocab_size: int | None = None,
    dtype: str | None = None,
    writer_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    planned: Callable[[ConversionPlan], None] | None = None,
    workers: int = 1,
    max_memory: int | None = None,
    reread: bool = False,
    check_space: bool = True,
) -> ConversionResult:
    """Convert `source` to `target` at `layout` (default: the source's) in `to_format` (default: the source's).
    `layout` may be a function of the source's layout, e.g. `lambda source: source.retarget(tp=8)`.

    `expect_layout` (e.g. {"tp": 4}) asserts the source's layout, as `--tp 4` does on the command line.
    `dtype` (e.g. "bfloat16") casts the model's weights and makes it the output's precision; optimizer
    state is not cast, and a change of precision with optimizer state is refused.
    Nothing is written at `target` unless the whole output verifies against the source's checksums: the
    output is opened as any checkpoint is, and each tensor's checksum is recomputed from what it holds.
    Where the writer can vouch for a record that the metadata on disk puts exactly where it wrote it, the
    checksum of its bytes as written counts and its values are not read back; `reread` reads back every
    value regardless (what `reshard verify` always does). `check_space=False` skips the refusal of a
    conversion that does not fit in the destination's free space (for filesystems that misreport it).

    `planned`, if given, is called with the plan before any byte moves; `progress` is then called with the
    bytes of each unit written, which add up to `plan.bytes_moved` (less what a resumed run finds done).
    """
    start = time.perf_counter()
    source, target = Path(source), Path(target)
    src, dst = source.resolve(), target.resolve()
    if src == dst:
        raise ReshardError("source and destination are the same directory; choose another destination")
    # Replacing a destination that holds the source would delete it; writing into the source changes it.
    if src.is_relative_to(dst):
        raise ReshardError(f"{target} contains the source {source}; choose a destination outside it")
    if dst.is_relative_to(src):
        raise ReshardError(f"{target} is inside the source {source}; choose a destination outside it")
    with open_checkpoint(source) as reader:
        for key, value in (expect_layout or {}).items():
            actual = getattr(reader.layout, key)
            if value is not None and actual != value:
                raise ReshardError(f"{source} is saved at {key.upper()}={actual}, not {value}; fix --{key} or drop it")
        if vocab_size is not None:
            if reader.config.vocab_size not in (None, vocab_size):
                raise ReshardError(f"{source} records a vocabulary of {reader.config.vocab_size}; --vocab-size {vocab_size} "
                                   "contradicts it: drop --vocab-size")
            if vocab_size > reader.config.padded_vocab_size:
                raise ReshardError(f"--vocab-size {vocab_size} exceeds the checkpoint's {reader.config.padded_vocab_size} embedding rows")
            reader.config = reader.config.replace(vocab_size=vocab_size)
        options = dict(writer_options or {})
        dtype = normalize_dtype(dtype) if dtype is not None else None
        if dtype is not None and (to_format or reader.format_name) == "hf":
            options["dtype"] = dtype  # also config.json's dtype
        plan = make_plan(
            reader,
            target,
            to_format or reader.format_name,
            layout(reader.layout) if callable(layout) else layout or reader.layout,
            optimizer=optimizer,
            te_names=options.get("te_names"),
            workers=workers,
            max_memory=max_memory,
            dtype=dtype,
        )
        if planned:
            planned(plan)
        if dry_run:
            return ConversionResult(plan, None, time.perf_counter() - start)
        if world()[1] > 1:
            with process_group():
                manifest = convert_distributed(
                    reader, plan, target, options, lambda: _check_destination(target, overwrite), _replace, progress, workers, reread,
                    check_space,
                )
            return ConversionResult(plan, manifest, time.perf_counter() - start)
        _check_destination(target, overwrite)
        manifest = _convert_here(reader, plan, target, options, progress, workers, reread, check_space)
    return ConversionResult(plan, manifest, time.perf_counter() - start)
