"""A cache that reader threads share, each entry made once (a file opened, a header parsed, an object loaded)."""

from __future__ import annotations

import threading
from typing import Any

_CACHE_LOCK = threading.Lock()
_MAKING: dict[tuple[int, Any], threading.Lock] = {}  # a lock per entry being made


def cached(cache: dict, key: Any, make: Any) -> Any:
    """Get or create an entry of a cache that reader threads share; `make()` runs once per key. Entries are
    made under their own lock, so threads making different ones (each reading headers) do not queue."""
    try:
        return cache[key]
    except KeyError:
        pass
    with _CACHE_LOCK:
        lock = _MAKING.setdefault((id(cache), key), threading.Lock())
    try:
        with lock:
            if key not in cache:
                cache[key] = make()
            return cache[key]
    finally:
        with _CACHE_LOCK:
            _MAKING.pop((id(cache), key), None)
