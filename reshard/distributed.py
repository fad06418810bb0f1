"""Multi-rank conversion: the same `reshard convert`, launched by torchrun (or anything that sets
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), over a filesystem every rank sees.

Each rank converts a disjoint share of the tensors, balanced by bytes, into files of its own. Rank 0
writes the metadata last, only after every rank has reported its pieces and checksums; then every
rank re-reads its share of the output, and rank 0 moves the output into place only if every checksum
agrees. A failure on any rank fails all of them with its message. torch.distributed (gloo) is the
engine; there is no cluster manager of our own.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist

from reshard.checksum import Checksum
from reshard.errors import ReshardError
from reshard.formats import WRITERS, open_checkpoint
from reshard.formats.base import CheckpointReader, Manifest
from reshard.plan import ConversionPlan, TensorMove
from reshard.buffers import Pool
from reshard.verify import compare, compute_checksums

T = TypeVar("T")
MULTI_RANK_FORMATS = ("torch_dist", "zarr")


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
    """Run `step` on every rank and gather the results; if any rank failed, every rank raises its message."""
    try:
        outcome: tuple[bool, Any] = (True, step())
    except ReshardError as exc:
        outcome = (False, str(exc))
    except Exception as exc:  # a bug on one rank must not leave the others waiting
        outcome = (False, f"{exc.__class__.__name__}: {exc}")
    gathered: list[tuple[bool, Any]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, outcome)
    for rank, (ok, value) in enumerate(gathered):
        if not ok:
            raise ReshardError(f"rank {rank}: {value}")
    return [value for _, value in gathered]


@contextmanager
def process_group() -> Iterator[None]:
    """A gloo group for the conversion, unless the caller made one; gloo's threads must be stopped
    before the interpreter exits, or it aborts."""
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
) -> Manifest:
    """Each rank writes its share of the plan (inside `process_group()`); see the module docstring."""
    from reshard.convert import manifest_for, write_moves

    if plan.target_format not in MULTI_RANK_FORMATS:
        raise ReshardError(f"several ranks can write {' or '.join(MULTI_RANK_FORMATS)}, not {plan.target_format}; run one process")
    rank, size = dist.get_rank(), dist.get_world_size()
    # One temporary sibling, by a fixed name: a rerun after a kill clears what the killed run left (a
    # multi-rank conversion does not resume; it starts over).
    tmp = target.with_name(f".{target.name}.reshard-tmp")

    def prepare() -> None:
        if rank == 0:
            prepare_destination()
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    try:
        _together(prepare)
        mine = replace(plan, target=tmp, moves=shares(plan.moves, size)[rank])
        writer = WRITERS[plan.target_format](
            tmp, plan.config, plan.target_layout, {m.target.name: m.target for m in plan.moves}, plan.common, rank=rank, **writer_options
        )

        pool = Pool()  # slab buffers, reused by the verification pass

        def write() -> tuple[Any, dict[str, Checksum], dict[str, Checksum]]:
            written, as_read = write_moves(reader, mine, writer, progress if rank == 0 else None, workers, pool=pool)
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
                names = [m.target.name for m in mine.moves]
                records = None if reread else writer.written_records()
                return compute_checksums(written_back, workers=hash_workers, names=names, pool=pool, written=records)

        rechecked = {k: v for part in _together(check) for k, v in part.items()}

        def move_into_place() -> None:
            if rank == 0:
                compare(rechecked, written).raise_if_bad("the written checkpoint does not match the source")
                replace_destination(tmp, target)

        _together(move_into_place)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
