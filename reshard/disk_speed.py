"""How fast a disk copies: a short parallel copy, for a dry run's time estimate (`reshard convert --dry-run
--disk-speed probe`).

Threads each copy a file of their own, as a conversion's workers read and write at once: the files are
written and synced first and dropped from the page cache (`posix_fadvise` DONTNEED, which clean pages obey),
so the copy reads from the disk; its writes are synced before the clock stops, as `cp` then `sync` would be.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PROBE_BYTES = 256 << 20
CHUNK = 8 << 20


def copy_speed(directory: Path, total: int = PROBE_BYTES, threads: int = 4) -> float:
    """Bytes a second that `threads` parallel copies of `total` bytes in all move inside `directory` (the nearest
    existing one above it, for a destination not yet made); the probe's files are removed after."""
    while not directory.exists():
        directory = directory.parent
    block = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()  # incompressible
    each = max(CHUNK, total // threads // CHUNK * CHUNK)
    probe = Path(tempfile.mkdtemp(prefix=".reshard-disk-probe-", dir=directory))
    try:
        for i in range(threads):
            with open(probe / f"{i}", "wb") as f:
                for _ in range(each // CHUNK):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

        def copy(i: int) -> None:
            with open(probe / f"{i}", "rb") as src, open(probe / f"{i}.copy", "wb") as dst:
                while chunk := src.read(CHUNK):
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(copy, range(threads)))
        return threads * each / (time.perf_counter() - start)
    finally:
        shutil.rmtree(probe, ignore_errors=True)
