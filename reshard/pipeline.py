"""Ordered, bounded parallelism: workers prepare items ahead, the caller consumes them in order.

Reading a slab (`pread` into numpy buffers, tensorstore) and hashing it (numpy matrix
products) release the GIL, so threads overlap them with each other and with the writer. Results
come back in submission order, so what is written does not depend on the number of workers, and
the items waiting in memory stay within a budget (bytes of slabs, for a conversion).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(
    fn: Callable[[T], R], items: Iterable[T], workers: int, budget: int, cost: Callable[[T], int] = lambda _: 1
) -> Iterator[R]:
    """`map(fn, items)` computed by `workers` threads, with the items outstanding (submitted, not yet
    consumed) costing at most `budget` together. An item that does not fit even alone is computed in
    the caller's thread once all before it are consumed."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reshard") as pool:
        pending: deque[tuple[Future[R], int]] = deque()
        outstanding = 0
        try:
            for item in items:
                size = cost(item)
                while pending and outstanding + size > budget:
                    future, done = pending.popleft()
                    outstanding -= done
                    yield future.result()
                if size > budget:
                    yield fn(item)
                    continue
                pending.append((pool.submit(fn, item), size))
                outstanding += size
            while pending:
                yield pending.popleft()[0].result()
        finally:
            for future, _ in pending:
                future.cancel()
