"""The processes taking part in a conversion, and the one thing they do together: run a step on every
rank and gather what each returned (or the first failure, on every rank).

`Alone` is a single process: the step just runs. `Gloo` is a multi-rank conversion launched by torchrun
(or anything that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT) over a filesystem every rank sees;
torch.distributed with gloo is the engine, and only it imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from reshard.errors import KeepsPartial, ReshardError

if TYPE_CHECKING:
    from reshard.plan import TensorMove

T = TypeVar("T")


class Collective(Protocol):
    rank: int
    size: int

    def together(self, step: Callable[[], T]) -> list[T]:
        """Run `step` on every rank and return every rank's result, in rank order; if it failed on any rank,
        raise on every rank."""
        ...


class Alone:
    """One process: `together` runs the step, and its failure is raised as it is."""

    rank, size = 0, 1

    def together(self, step: Callable[[], T]) -> list[T]:
        return [step()]


class Gloo:
    """The ranks of a torch.distributed (gloo) group (see `joined`)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def together(self, step: Callable[[], T]) -> list[T]:
        """A failure becomes every rank's: a refusal (ReshardError) stays one; a rank that crashed or kept its
        partial output makes it a `KeepsPartial`, so that, as after a kill, the same command resumes it."""
        try:
            outcome: tuple[str, Any] = ("ok", step())
        except KeepsPartial as exc:
            outcome = ("kept", str(exc))
        except ReshardError as exc:
            outcome = ("refused", str(exc))
        except Exception as exc:  # a bug on one rank must not leave the others waiting
            outcome = ("kept", f"{exc.__class__.__name__}: {exc}")
        import torch.distributed as dist

        gathered: list[tuple[str, Any]] = [None] * self.size  # type: ignore[list-item]
        dist.all_gather_object(gathered, outcome)
        for rank, (how, value) in enumerate(gathered):
            if how != "ok":
                raise (ReshardError if how == "refused" else KeepsPartial)(f"rank {rank}: {value}")
        return [value for _, value in gathered]


def world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment; (0, 1) when run alone."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


@contextmanager
def joined() -> Iterator[Collective]:
    """The collective this process belongs to: `Alone`, or under a launcher a gloo group (made here unless
    the caller made one; gloo's threads must be stopped before the interpreter exits, or it aborts)."""
    if world()[1] == 1:
        yield Alone()
        return
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=timedelta(hours=4))
    try:
        yield Gloo()
        if created:  # every rank past its last collective before any tears gloo down (an abort at exit, seen under load)
            dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()


def shares(moves: list[TensorMove], size: int) -> list[list[TensorMove]]:
    """Split the moves over `size` ranks: largest first, each to the least-loaded rank (deterministic)."""
    loads: list[int] = [0] * size
    out: list[list[TensorMove]] = [[] for _ in range(size)]
    for move in sorted(moves, key=lambda m: (-m.bytes, m.target.name)):
        rank = loads.index(min(loads))
        out[rank].append(move)
        loads[rank] += move.bytes
    order = {m.target.name: i for i, m in enumerate(moves)}
    return [sorted(share, key=lambda m: order[m.target.name]) for share in out]
