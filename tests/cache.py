"""What a test run builds once and shares: a Megatron-made checkpoint or a training run asked for by several test
modules (a module fixture imported into another is built again for it) or by several pytest-xdist workers (each a
session of its own). The first caller builds; a caller in another process waits on a file lock, then reads the same
result.

The key is a hash of the builder's source and its arguments, so that two builders, or one with two argument sets,
never share a folder. Folders live in this run's temporary directory, so the code that built one cannot change
under it: a new run builds everything again.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def shared_root(tmp_path_factory) -> Path:
    """A folder every process of this test run sees: under xdist, beside the workers' own base folders."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built"
    root.mkdir(exist_ok=True)
    return root


def built(tmp_path_factory, build: Callable[..., T], *args) -> T:
    """`build(folder, *args)`'s result, with `folder` its own empty folder: run by the first caller of this run
    with this builder and these arguments, and given back to every later one."""
    key = hashlib.sha256(inspect.getsource(build).encode() + repr(args).encode()).hexdigest()[:16]
    root = shared_root(tmp_path_factory)
    folder, result = root / f"{build.__name__}-{key}", root / f"{build.__name__}-{key}.pickle"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        if not result.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed halfway
            folder.mkdir()
            value = build(folder, *args)  # built in place: a checkpoint may record where it was saved
            result.write_bytes(pickle.dumps(value))
    return pickle.loads(result.read_bytes())  # this run's own file, written above
