"""Ordered, bounded parallelism: workers prepare items ahead, the caller consumes them in order.

Reading a slab (memory-mapped copies, tensorstore, safetensors) and hashing it (numpy matrix
products) release the GIL, so threads overlap them with each other and with the writer. Results
come back in submission order, so what is written does not depend on the number of workers, and
at most `depth` prepared items wait in memory at a time.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int, depth: int) -> Iterator[R]:
    """`map(fn, items)` computed by `workers` threads with at most `depth` results outstanding."""
    if workers <= 1 or depth <= 0:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reshard") as pool:
        pending: deque[Future[R]] = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= depth:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
