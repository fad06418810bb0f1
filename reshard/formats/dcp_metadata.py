"""PyTorch DCP's `.metadata` file, without importing `torch.distributed.checkpoint` to read it.

Importing that package takes 1.3 s here (it pulls in DTensor): more than converting a small model.
`load` unpickles `.metadata` with an allow-list that maps DCP's classes onto the plain records below,
so nothing in the file can run code. Writers build the same records, and `save` turns them into
DCP's own classes (imported only then) and pickles those, so `dist_checkpointing.load` and DCP read
the file as their own. (Importing in a background thread ahead of time was tried: it competed for
the GIL with the conversion, and a daemon thread still importing at exit aborted the process.)
"""

from __future__ import annotations

import importlib
import pickle
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.errors import ReshardError

_DCP = "torch.distributed.checkpoint"


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Storage:
    """Where a chunk or object was saved: a byte range of one `.distcp` file."""

    relative_path: str
    offset: int
    length: int
    transformed: bool = False  # DCP stream transforms (compression), which we do not decode


@dataclass
class TensorEntry:
    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)


# (fully qualified name, chunk offsets) -> storage; offsets are None for a saved object
StorageKey = tuple[str, "tuple[int, ...] | None"]


@dataclass
class DcpMetadata:
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)
    storage: dict[StorageKey, Storage] = field(default_factory=dict)


class _Pickled:
    """Stands in for a DCP class while unpickling: keeps whatever state the pickle gives it."""

    def __init__(self, *args: Any) -> None:  # an enum member is pickled as a call with its value
        self.__dict__["state"] = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) of a slotted dataclass
        self.__dict__["state"] = state

    def get(self, name: str, position: int | None = None) -> Any:
        state = self.__dict__.get("state")
        if isinstance(state, dict):
            return state.get(name)
        if isinstance(state, tuple) and position is not None:  # TensorProperties pickles a tuple
            return state[position]
        return None


_STANDINS: dict[str, type[_Pickled]] = {}


def _standin(name: str) -> type[_Pickled]:
    if name not in _STANDINS:
        _STANDINS[name] = type(name, (_Pickled,), {})
    return _STANDINS[name]


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == f"{_DCP}.metadata" and name == "_MEM_FORMAT_ENCODING":
            return lambda value: value
        if module.startswith(_DCP):  # metadata, storage info, planner data: records only
            return _standin(name)
        if module == "torch.serialization" and name == "_get_layout":
            return lambda layout: layout
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise pickle.UnpicklingError(f"unexpected {module}.{name}")


def _offsets(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in value)


def load(path: Path) -> DcpMetadata:
    """Read a `.metadata` file; a foreign or damaged one is refused in a line."""
    try:
        with open(path, "rb") as f:
            raw = _Unpickler(f).load()
        out = DcpMetadata()
        for fqn, entry in raw.get("state_dict_metadata").items():
            if type(entry).__name__ == "BytesStorageMetadata":
                out.objects.append(fqn)
                continue
            properties = entry.get("properties")
            chunks = [Chunk(_offsets(c.get("offsets")), _offsets(c.get("sizes"))) for c in entry.get("chunks")]
            out.tensors[fqn] = TensorEntry(properties.get("dtype", 0), _offsets(entry.get("size")), chunks)
        for index, info in raw.get("storage_data").items():
            out.storage[(index.get("fqn"), _offsets(index.get("offset")))] = Storage(
                info.get("relative_path"), int(info.get("offset")), int(info.get("length")), bool(info.get("transform_descriptors"))
            )
        return out
    except Exception as exc:  # a truncated, foreign or damaged file
        raise ReshardError(f"{path} cannot be read ({exc.__class__.__name__}): the checkpoint is damaged") from None


def import_dcp() -> None:
    """Import the DCP modules `save` needs (0.75 s; `prefetch` runs it where it overlaps a wait)."""
    for module in ("torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.metadata"):
        importlib.import_module(module)


def prefetch() -> None:
    """Start importing DCP in the background; `save` then finds it imported, or waits on the import lock."""
    threading.Thread(target=import_dcp, name="reshard-import-dcp", daemon=True).start()


def save(path: Path, metadata: DcpMetadata) -> None:
    """Write `.metadata` with DCP's own classes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state: dict[str, Any] = {
        fqn: TensorStorageMetadata(
            properties=TensorProperties(dtype=entry.dtype),
            size=torch.Size(entry.size),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in entry.chunks],
        )
        for fqn, entry in metadata.tensors.items()
    }
    state.update({fqn: BytesStorageMetadata() for fqn in metadata.objects})
    storage = {
        MetadataIndex(fqn, None if offsets is None else torch.Size(offsets)): _StorageInfo(s.relative_path, s.offset, s.length)
        for (fqn, offsets), s in metadata.storage.items()
    }
    with open(path, "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=state, storage_data=storage), f)
