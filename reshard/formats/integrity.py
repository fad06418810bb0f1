"""Megatron-LM's `integrity.json` (megatron-core >= 0.18, saved with `--verify-integrity`): the sha256 of every
file directly in a torch_dist iteration directory, `{"algorithm": "sha256", "files": {name: hex digest}}`,
which Megatron-LM checks before it loads.

A source that has one is checked before a byte of it is read, and the files reshard reads must be among those
it lists (a file it does not cover could have been swapped). A copy of such a checkpoint gets a manifest of its
own, written after its last file, so that Megatron-LM's check passes on it too: the source's would be wrong.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from reshard.checksum import file_sha256
from reshard.errors import ReshardError
from reshard.paths import confined

NAME = "integrity.json"
ALGORITHM = "sha256"
_DIGEST = re.compile(r"[0-9a-f]{64}")
_WORKERS = 8  # hashlib lets go of the GIL on large updates: files hash side by side at the disk's speed


def _hashed(directory: Path, names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max(1, min(_WORKERS, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda name: file_sha256(directory / name), names), strict=True))


def _listed(directory: Path) -> dict[str, str]:
    """The manifest's files and digests, each name a file directly in `directory`."""
    where = directory / NAME
    try:
        manifest = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReshardError(f"{where} cannot be read as JSON ({exc}); restore it from the save, or remove it to read the checkpoint "
                           "unchecked") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ReshardError(f"{where} is not Megatron-LM's integrity manifest (no \"files\" object); restore it, or remove it to read the "
                           "checkpoint unchecked")
    algorithm = manifest.get("algorithm", ALGORITHM)  # as Megatron-LM reads it: sha256 when not said
    if algorithm != ALGORITHM:
        raise ReshardError(f"{where} hashes with {algorithm!r}; Megatron-LM and reshard check only {ALGORITHM!r}")
    files: dict[str, str] = manifest["files"]
    for name, value in files.items():
        if not isinstance(value, str) or not _DIGEST.fullmatch(value):
            raise ReshardError(f"{where} gives {name!r} the digest {value!r}, not a sha256 in hex; restore it from the save")
        if Path(name).name != name:  # Megatron-LM lists the files directly in the directory, by name
            raise ReshardError(f"{where} names {name!r}, which is not a file of {directory}; refusing the checkpoint")
        confined(directory, name)
    return files


def verify(directory: Path) -> set[str]:
    """Check every file `directory`'s manifest lists against its digest; the names it lists."""
    files = _listed(directory)
    missing = [name for name in files if not (directory / name).is_file()]
    if missing:
        raise ReshardError(f"{directory / missing[0]} is listed in {NAME} but missing; restore it from the save")
    for name, found in _hashed(directory, sorted(files)).items():
        if found != files[name]:
            raise ReshardError(f"{directory / name} does not match its sha256 in {NAME}: it changed after the save; restore it, "
                               "or remove integrity.json to read the checkpoint as it is")
    return set(files)


def require_covered(directory: Path, listed: set[str], needed: list[str]) -> None:
    """Refuse a file the checkpoint is read from that the verified manifest does not list."""
    for name in needed:
        if name not in listed:
            raise ReshardError(f"{directory / NAME} does not cover {name}, which the checkpoint is read from: the file was added or "
                               "renamed after the save; restore the save, or remove integrity.json to read it unchecked")


def write(directory: Path) -> None:
    """Megatron-LM's manifest of the files now in `directory` (its own name left out), as Megatron-LM writes it."""
    names = sorted(entry.name for entry in os.scandir(directory) if entry.is_file() and entry.name != NAME)
    payload = {"algorithm": ALGORITHM, "files": _hashed(directory, names)}
    (directory / NAME).write_text(json.dumps(payload, indent=2))
