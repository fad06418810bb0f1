"""Paths a checkpoint names (index entries, DCP storage files, symlinks in it) are untrusted: each must lead
to a file inside the checkpoint, so that no conversion reads, exports or uploads anything beside it."""

from __future__ import annotations

import os
from pathlib import Path

from reshard.errors import ReshardError


def confined(directory: Path, name: str) -> Path:
    """`directory / name`, refused unless it stays in the directory: `name` is relative without `..`, and the file
    it leads to, through any symlinks, lies in the directory, or, for a snapshot of huggingface_hub's cache
    (`models--<org>--<name>/snapshots/<commit>`), in that repository's blobs."""
    where = directory / name
    if Path(name).is_absolute() or ".." in Path(name).parts or not Path(name).parts:
        raise ReshardError(f"{directory} names {name!r}, a path outside the checkpoint; refusing it")
    home = directory.resolve()
    if home.parent.name == "snapshots" and home.parent.parent.name.startswith("models--"):
        home = home.parent.parent / "blobs"
    try:
        real = where.resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL in the name
        raise ReshardError(f"{directory} names {name!r}, which cannot be followed ({exc}); refusing it") from None
    if not real.is_relative_to(home):
        raise ReshardError(f"{where} leads outside the checkpoint (to {real}); refusing it")
    return where


def confined_tree(directory: Path) -> None:
    """Refuse a directory holding any file or link that leads outside it (`confined`), for readers that open
    files by names they do not check (tensorstore opens a zarr array's chunk files itself). Links are not
    followed down: every real directory inside is walked where it lies."""
    for root, dirs, files in os.walk(directory):
        for name in (*dirs, *files):
            confined(directory, os.path.relpath(os.path.join(root, name), directory))
