"""Multi-rank conversion: the same `reshard convert`, launched by torchrun (or anything that sets
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), over a filesystem every rank sees.

Each rank converts a disjoint share of the tensors, balanced by bytes, into files of its own. Rank 0
writes the metadata last, only after every rank has reported its pieces and checksums; then every
rank re-reads its share of the output, and rank 0 moves the output into place only if every checksum
agrees. A failure on any rank fails all of them with its message. Each rank logs its finished
tensors in the partial output, so a killed run resumes like a single process does. torch.distributed
(gloo) is the engine; there is no cluster manager of our own.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from reshard.checksum import Checksum
from reshard.errors import KeepsPartial, ReshardError
from reshard.formats import WRITERS, open_checkpoint
from reshard.formats.base import CheckpointReader, CheckpointWriter, Manifest
from reshard.plan import ConversionPlan, TensorMove
from reshard.buffers import Pool
from reshard.verify import compare, compute_checksums
from reshard.worklog import Done, Recorder, Resumed, WorkLog, fingerprint

T = TypeVar("T")


def world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment; (0, 1) when run alone."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def shares(moves: list[TensorMove], size: int) -> list[list[TensorMove]]:
    """Split the moves over `size` ranks: largest first, each to the least-loaded rank (deterministic)."""
    loads, out = [0] * size, [[] for _ in range(size)]
    for move in sorted(moves, key=lambda m: (-m.bytes, m.target.name)):
        rank = loads.index(min(loads))
        out[rank].append(move)
        loads[rank] += move.bytes
    order = {m.target.name: i for i, m in enumerate(moves)}
    return [sorted(share, key=lambda m: order[m.target.name]) for share in out]


def _together(step: Callable[[], T]) -> list[T]:
    """Run `step` on every rank and gather the results; if any rank failed, every rank raises its message.
    A rank that crashed (not a refusal) or stopped keeping its partial output makes it a `KeepsPartial`:
    like a killed run, the same command resumes it."""
    try:
        outcome: tuple[str, Any] = ("ok", step())
    except KeepsPartial as exc:
        outcome = ("kept", str(exc))
    except ReshardError as exc:
        outcome = ("refused", str(exc))
    except Exception as exc:  # a bug on one rank must not leave the others waiting
        outcome = ("kept", f"{exc.__class__.__name__}: {exc}")
    import torch.distributed as dist  # here and below: a single-process conversion never imports torch

    gathered: list[tuple[str, Any]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, outcome)
    for rank, (how, value) in enumerate(gathered):
        if how != "ok":
            raise (ReshardError if how == "refused" else KeepsPartial)(f"rank {rank}: {value}")
    return [value for _, value in gathered]


@contextmanager
def process_group() -> Iterator[None]:
    """A gloo group for the conversion, unless the caller made one; gloo's threads must be stopped
    before the interpreter exits, or it aborts."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=timedelta(hours=4))
    try:
        yield
        if created:  # every rank past its last collective before any tears gloo down (an abort at exit, seen under load)
            dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()


def convert_distributed(
    reader: CheckpointReader,
    plan: ConversionPlan,
    target: Path,
    writer_options: dict[str, Any],
    prepare_destination: Callable[[], None],
    replace_destination: Callable[[Path, Path], None],
    progress: Callable[[int], None] | None,
    workers: int,
    reread: bool = False,
    check_space: bool = True,
) -> Manifest:
    """Each rank writes its share of the plan (inside `process_group()`); see the module docstring. Each
    rank logs its finished tensors, so the same command run again with as many ranks resumes where a
    killed or crashed run stopped; anything else about the partial output starts it over."""
    import torch.distributed as dist

    from reshard.convert import check_free_space, manifest_for, partial_path, write_moves

    rank, size = dist.get_rank(), dist.get_world_size()
    tmp = partial_path(target)
    log = WorkLog(tmp, fingerprint(plan, writer_options), rank, size)

    _together(lambda: prepare_destination() if rank == 0 else None)  # a refusal here leaves a partial output be
    try:
        logs: list[Resumed | None] = []  # this rank's, read once and kept here (not gathered)

        def read_log() -> bool:
            logs.append(log.resume() if tmp.is_dir() else None)
            return logs[0] is not None

        resuming = all(_together(read_log))  # every rank's log, or none
        found = logs[0] if resuming else None
        if not resuming:
            _together(lambda: _start_over(tmp) if rank == 0 else None)

        opened: list[tuple[CheckpointWriter, list[Done]]] = []  # this rank's, kept here: a writer is not gathered

        def open_writer() -> None:
            if not resuming:
                log.start()
            writer = WRITERS[plan.target_format](
                tmp, plan.config, plan.target_layout, {m.target.name: m.target for m in plan.moves}, plan.common, rank=rank,
                **writer_options,
            )
            if found:  # back to this rank's last logged tensor (before its first: none of its files)
                writer.restore(found.facts)
            opened.append((writer, found.done if found else []))

        _together(open_writer)
        writer, done = opened[0]
        finished = {d.name for d in done}
        share = shares(plan.moves, size)[rank]
        mine = replace(plan, target=tmp, moves=[m for m in share if m.target.name not in finished])
        sizes = _together(lambda: (mine.bytes_stored, writer.held_for([m.target.name for m in mine.moves]) if resuming else 0))
        needed, freed = (sum(column) for column in zip(*sizes))
        _together(lambda: check_free_space(tmp, target, needed, resuming, freed) if rank == 0 and check_space else None)

        pool = Pool()  # slab buffers, reused by the verification pass

        def write() -> tuple[Any, dict[str, Checksum], dict[str, Checksum]]:
            recorder = Recorder(log, writer)
            try:
                written, as_read = write_moves(reader, mine, writer, progress if rank == 0 else None, workers, finished=recorder, pool=pool)
            finally:
                recorder.close()
            written.update({d.name: d.written for d in done})
            as_read.update({d.name: d.read for d in done})
            if rank == 0:
                writer.before_finish()
            return writer.part(), written, as_read

        results = _together(write)
        written = {k: v for _, w, _ in results for k, v in w.items()}
        manifest = manifest_for(replace(plan, target=tmp), written)

        def finish() -> None:
            if rank != 0:
                return
            if reader.manifest is not None:
                as_read = {k: v for _, _, r in results for k, v in r.items()}
                compare(as_read, reader.manifest.checksums, subset=True).raise_if_bad(
                    f"{plan.source} does not match the checksums recorded when it was written"
                )
            writer.finish(manifest, [part for part, _, _ in results])

        _together(finish)

        hash_workers = plan.hash_workers()
        pool.shrink(hash_workers)

        def check() -> dict[str, Checksum]:
            with open_checkpoint(tmp, plan.target_format) as written_back:
                names = [m.target.name for m in share]
                records = None if reread else writer.written_records()  # an earlier run's tensors are read back
                return compute_checksums(written_back, workers=hash_workers, names=names, pool=pool, written=records)

        rechecked = {k: v for part in _together(check) for k, v in part.items()}

        _together(lambda: compare(rechecked, written).raise_if_bad("the written checkpoint does not match the source"))
        _together(log.remove)  # only now: a run stopped while verifying resumes at `finish`, not from the start
        _together(lambda: replace_destination(tmp, target) if rank == 0 else None)
    except ReshardError as exc:
        if rank == 0 and not isinstance(exc, KeepsPartial):  # a refusal: nothing worth resuming
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _start_over(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
