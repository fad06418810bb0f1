"""`convert`: a conversion as one transaction: plan, stream into a temporary sibling (resuming an
interrupted run), verify what was written, then rename it into place. One pipeline for a single process
and for the ranks of a multi-rank conversion (`reshard.collective`)."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from reshard.buffers import Pool
from reshard.checksum import Checksum
from reshard.collective import Collective, joined, shares
from reshard.errors import KeepsPartial, ReshardError
from reshard.formats import open_checkpoint
from reshard.formats.base import CheckpointReader, CheckpointWriter, Manifest
from reshard.plan import ConversionPlan, human_bytes, make_plan
from reshard.request import Run, SourceHints, Target
from reshard.streaming import Progress, manifest_for, write_moves
from reshard.verify import compare, compute_checksums
from reshard.worklog import Recorder, Resumed, WorkLog, fingerprint

@dataclass
class ConversionResult:
    plan: ConversionPlan
    manifest: Manifest | None  # None for a dry run
    seconds: float


def partial_path(target: Path) -> Path:
    """Where a conversion writes until its output verifies: a hidden sibling of the target, by a fixed
    name, so that running the same command again finds it (and resumes or clears it)."""
    return target.with_name(f".{target.name}.reshard-partial")


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


def _prepare_destination(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ReshardError(f"{target} exists and is a file; choose another destination")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ReshardError(f"{target} exists and is not empty; pass --overwrite to replace it or choose another destination")
    target.parent.mkdir(parents=True, exist_ok=True)


def _start_over(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def transact(
    reader: CheckpointReader, plan: ConversionPlan, overwrite: bool, run: Run, progress: Progress | None, team: Collective
) -> Manifest:
    """Write the plan into a partial sibling of `plan.target`, verify everything written against the
    source, then move it into place; each rank of `team` converts its share of the tensors (all of them
    when alone) into files of its own, and rank 0 writes the metadata last, only after every rank has
    reported its pieces and checksums.

    Each rank logs its finished tensors in the partial output: the same command run again (with as many
    ranks) resumes where a killed or crashed run stopped; anything else about the partial output starts
    it over. A refusal removes the partial output; a stop that keeps it (`KeepsPartial`) or a crash does not."""
    rank, target = team.rank, plan.target
    tmp = partial_path(target)
    here = replace(plan, target=tmp)
    log = WorkLog(tmp, fingerprint(plan), rank, team.size)

    team.together(lambda: _prepare_destination(target, overwrite) if rank == 0 else None)  # a refusal leaves a partial output be
    try:
        logs: list[Resumed | None] = []  # this rank's, kept here: only whether it was found is gathered

        def read_log() -> bool:
            logs.append(log.resume() if tmp.is_dir() else None)
            return logs[0] is not None

        resuming = all(team.together(read_log))  # every rank's log, or none
        found = logs[0] if resuming else None
        if not resuming:
            team.together(lambda: _start_over(tmp) if rank == 0 else None)

        opened: list[CheckpointWriter] = []  # this rank's, kept here: a writer is not gathered

        def open_writer() -> None:
            if not resuming:
                log.start()
            writer = here.new_writer(rank)
            if found:  # back to this rank's last logged tensor (before its first: none of its files)
                writer.restore(found.facts)
            opened.append(writer)

        team.together(open_writer)
        writer, done = opened[0], found.done if found else []
        finished = {d.name for d in done}
        share = shares(plan.moves, team.size)[rank]
        mine = replace(here, moves=[m for m in share if m.target.name not in finished])
        sizes = team.together(lambda: (mine.bytes_stored, writer.held_for([m.target.name for m in mine.moves]) if resuming else 0))
        needed, freed = (sum(column) for column in zip(*sizes))
        if run.check_space:
            team.together(lambda: check_free_space(tmp, target, needed, resuming, freed) if rank == 0 else None)

        pool = Pool()  # slab buffers, reused by the verification pass

        def write() -> tuple[Any, dict[str, Checksum], dict[str, Checksum]]:
            recorder = Recorder(log, writer)
            try:
                written, as_read = write_moves(
                    reader, mine, writer, progress if rank == 0 else None, run.workers, finished=recorder, pool=pool
                )
                if rank == 0:
                    writer.before_finish()  # while the log's last entries wait for the disk
            finally:
                recorder.close()
            written.update({d.name: d.written for d in done})
            as_read.update({d.name: d.read for d in done})
            return writer.part(), written, as_read

        results = team.together(write)
        written = {k: v for _, w, _ in results for k, v in w.items()}
        manifest = manifest_for(plan, written)

        def finish() -> None:
            if reader.manifest is not None:
                as_read = {k: v for _, _, r in results for k, v in r.items()}
                compare(as_read, reader.manifest.checksums, "source as read", "source's recorded checksums", subset=True).raise_if_bad(
                    f"{plan.source} does not match the checksums recorded when it was written"
                )
            writer.finish(manifest, [part for part, _, _ in results])

        team.together(lambda: finish() if rank == 0 else None)

        hash_workers = plan.hash_workers()
        pool.shrink(hash_workers)

        def check() -> dict[str, Checksum]:
            with open_checkpoint(tmp, plan.target_format) as written_back:
                records = None if run.reread else writer.written_records()  # an earlier run's tensors are read back
                names = [m.target.name for m in share]
                return compute_checksums(written_back, workers=hash_workers, names=names, pool=pool, written=records)

        rechecked = {k: v for part in team.together(check) for k, v in part.items()}
        team.together(lambda: compare(rechecked, written, "written", "source").raise_if_bad("the written checkpoint does not match the source"))
        team.together(log.remove)  # only now: a run stopped while verifying resumes at `finish`, not from the start
        team.together(lambda: _replace(tmp, target) if rank == 0 else None)
    except ReshardError as exc:
        if rank == 0 and not isinstance(exc, KeepsPartial):  # a refusal: nothing worth resuming
            shutil.rmtree(tmp, ignore_errors=True)
        raise  # interrupted or crashed: the partial directory stays, and the same command resumes it
    return manifest


def convert(
    source: Path | str,
    destination: Path | str,
    target: Target = Target(),
    *,
    hints: SourceHints = SourceHints(),
    run: Run = Run(),
    overwrite: bool = False,
    dry_run: bool = False,
    planned: Callable[[ConversionPlan], None] | None = None,
    progress: Progress | None = None,
) -> ConversionResult:
    """Convert `source` into `destination` as `target` says (by default: the source's format and layout),
    with what the user knows of the source in `hints`, run as `run` says.

    Nothing is written at `destination` unless the whole output verifies against the source's checksums:
    the output is opened as any checkpoint is, and each tensor's checksum is recomputed from what it holds.
    Where the writer can vouch for a record that the metadata on disk puts exactly where it wrote it, the
    checksum of its bytes as written counts and its values are not read back; `run.reread` reads back every
    value regardless (what `reshard verify` always does). An existing, non-empty destination is replaced
    only with `overwrite`, and only once the new output verifies.

    Under a launcher (torchrun: RANK and WORLD_SIZE set) the ranks share the work (see `transact`).
    `planned`, if given, is called with the plan before any byte moves; `progress` is then called with the
    bytes of each unit written, which add up to `plan.bytes_moved` (less what a resumed run finds done).
    """
    start = time.perf_counter()
    source, destination = Path(source), Path(destination)
    src, dst = source.resolve(), destination.resolve()
    if src == dst:
        raise ReshardError("source and destination are the same directory; choose another destination")
    # Replacing a destination that holds the source would delete it; writing into the source changes it.
    if src.is_relative_to(dst):
        raise ReshardError(f"{destination} contains the source {source}; choose a destination outside it")
    if dst.is_relative_to(src):
        raise ReshardError(f"{destination} is inside the source {source}; choose a destination outside it")
    with open_checkpoint(source) as reader:
        for key in ("tp", "pp", "ep"):
            expected, actual = getattr(hints, key), getattr(reader.layout, key)
            if expected is not None and actual != expected:
                raise ReshardError(f"{source} is saved at {key.upper()}={actual}, not {expected}; fix --{key} or drop it")
        if hints.vocab_size is not None:
            _set_vocab_size(reader, hints.vocab_size)
        plan = make_plan(reader, destination, target, run)
        if planned:
            planned(plan)
        if dry_run:
            return ConversionResult(plan, None, time.perf_counter() - start)
        with joined() as team:
            manifest = transact(reader, plan, overwrite, run, progress, team)
    return ConversionResult(plan, manifest, time.perf_counter() - start)


def _set_vocab_size(reader: CheckpointReader, vocab_size: int) -> None:
    if reader.config.vocab_size not in (None, vocab_size):
        raise ReshardError(f"{reader.path} records a vocabulary of {reader.config.vocab_size}; --vocab-size {vocab_size} "
                           "contradicts it: drop --vocab-size")
    if vocab_size > reader.config.padded_vocab_size:
        raise ReshardError(f"--vocab-size {vocab_size} exceeds the checkpoint's {reader.config.padded_vocab_size} embedding rows")
    reader.config = reader.config.replace(vocab_size=vocab_size)
