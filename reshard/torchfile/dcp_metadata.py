"""PyTorch DCP's `.metadata` file, without importing `torch.distributed.checkpoint` to read it.

Importing that package (it pulls in DTensor) takes longer than converting a small model.
`load` unpickles `.metadata` with an allow-list that maps DCP's classes onto the plain records below,
so nothing in the file can run code. Writers build the same records, and `save` pickles stand-ins
that name DCP's classes, so `dist_checkpointing.load` and DCP unpickle their own objects while we
import none of them (importing them was most of a conversion's `finish`; importing them ahead in a
background thread raced the conversion's own imports: benchmarks/README.md, "Measurements behind defaults").
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from sys import intern
from typing import Any

from reshard.dtypes import DTYPE_NAMES
from reshard.errors import ReshardError
from reshard.torchfile import PARSE_ERRORS
from reshard.torchfile.pickles import Call, Named, Pickler, Unpickler, UnsafeGlobal, named, nonnegative_ints, python3_name

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
    dtype: str
    size: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)


_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")
# (fully qualified name, chunk offsets) -> storage; offsets are None for a saved object
StorageKey = tuple[str, "tuple[int, ...] | None"]


@dataclass
class DcpMetadata:
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)
    storage: dict[StorageKey, Storage] = field(default_factory=dict)
    # megatron-core <= 0.14's N-D flattened tensors (a `flattened_range`): each one's original global shape, by key,
    # as its `mcore_data` records it (the tensor's own `size` is the reformulated one: reshard/optim/flattened_range.py)
    flattened: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def saving_ranks(self) -> int | None:
        """How many ranks wrote the save, told by its files (torch DCP names each rank's `__<rank>_<n>.distcp`), or None
        where the files are not so named or their ranks do not run 0..N-1. A DistributedOptimizer's dp_reshardable
        state makes every rank write (its shard of the buckets is no other rank's)."""
        ranks = set()
        for info in self.storage.values():
            found = _RANK_FILE.fullmatch(info.relative_path.rsplit("/", 1)[-1])
            if found is None:
                return None
            ranks.add(int(found.group(1)))
        return len(ranks) if ranks and max(ranks) == len(ranks) - 1 else None


class _Pickled:
    """Stands in for a DCP class while unpickling: keeps whatever state the pickle gives it."""

    def __init__(self, *args: Any) -> None:  # an enum member is pickled as a call with its value
        self.__dict__["state"] = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and all(part is None or isinstance(part, dict) for part in state):
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


# DCP's records a `.metadata` holds (its metadata, storage and planner dataclasses and enums; megatron-core
# <= 0.15 saves DCP's Metadata and SavePlan as subclasses of its own): read as records, as harmless for
# torch's plain `pickle.load` to build as they are for us. Any other name in DCP's modules, a function
# among them, is refused like any global off the list.
_RECORDS = {
    f"{_DCP}.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                         "BytesStorageMetadata", "ChunkStorageMetadata"},
    f"{_DCP}.planner": {"SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType", "TensorWriteData",
                        "BytesIOWriteData"},
    f"{_DCP}.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "megatron.core.dist_checkpointing.strategies.torch": {"MCoreMetadata", "MCoreSavePlan"},
}


class _Unpickler(Unpickler):  # its `load`; globals from this allow-list only
    def find_class(self, module: str, name: str) -> Any:
        module, name = python3_name(module, name)
        if module == f"{_DCP}.metadata" and name == "_MEM_FORMAT_ENCODING":
            return lambda value: value
        if name in _RECORDS.get(module, ()):
            return _standin(name)
        if module == "torch.serialization" and name == "_get_layout":
            return lambda layout: layout
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch" and name in DTYPE_NAMES:
            return name
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise UnsafeGlobal(self.what, module, name)


def _checked(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """`value`, or a ValueError (the file is damaged) when it is not a `kind`: a file may hold anything
    anywhere, and what it holds must not reach the code that takes it for a `kind`."""
    if not isinstance(value, kind):
        raise ValueError(f"{what} is a {type(value).__name__}")
    return value


def _field(record: Any, name: str, kind: type | tuple[type, ...], position: int | None = None) -> Any:
    """Field `name` of DCP record `record` (at `position` of one pickled as a tuple), checked to be a `kind`."""
    return _checked(_checked(record, _Pickled, "a DCP record").get(name, position), kind, f"{type(record).__name__}.{name}")


def _sizes(record: Any, name: str) -> tuple[int, ...]:
    """A `torch.Size` field of `record` (unpickled as a tuple)."""
    return nonnegative_ints(_field(record, name, tuple))


def _metadata(raw: Any) -> DcpMetadata:
    """The records of an unpickled DCP `Metadata`."""
    out = DcpMetadata()
    for fqn, entry in _field(raw, "state_dict_metadata", dict).items():
        _checked(fqn, str, "a tensor's name")
        if type(entry).__name__ == "BytesStorageMetadata":
            out.objects.append(fqn)
            continue
        properties = _field(entry, "properties", _Pickled)
        chunks = [Chunk(_sizes(c, "offsets"), _sizes(c, "sizes")) for c in _field(entry, "chunks", list)]
        out.tensors[fqn] = TensorEntry(_field(properties, "dtype", str, 0), _sizes(entry, "size"), chunks)
    for index, info in _field(raw, "storage_data", dict).items():
        offset = _field(index, "offset", (tuple, type(None)))  # None for an object
        out.storage[(_field(index, "fqn", str), None if offset is None else nonnegative_ints(offset))] = Storage(
            _field(info, "relative_path", str), _field(info, "offset", int), _field(info, "length", int), bool(info.get("transform_descriptors"))
        )
    mcore_data = _checked(raw, _Pickled, "a DCP record").get("mcore_data")  # megatron-core's MCoreMetadata only
    for fqn, data in (_checked(mcore_data, dict, "mcore_data") if mcore_data is not None else {}).items():
        shape = _checked(data, dict, "mcore_data of a tensor").get("nd_reformulated_orig_global_shape")
        if shape is not None:
            out.flattened[_checked(fqn, str, "a tensor's name")] = nonnegative_ints(shape)
    return out


def load(path: Path) -> DcpMetadata:
    """Read a `.metadata` file; a foreign or damaged one is refused in a line."""
    try:
        with open(path, "rb") as f:
            return _metadata(_Unpickler(f, str(path)).load())
    except PARSE_ERRORS as exc:  # a truncated, foreign or damaged file
        raise ReshardError(f"{path} cannot be read ({exc.__class__.__name__}): the checkpoint is damaged") from None


_METADATA, _FILESYSTEM = f"{_DCP}.metadata", f"{_DCP}.filesystem"
_SIZE = named("torch", "Size")
_TENSOR_STORAGE = named(_METADATA, "TensorStorageMetadata")
_PROPERTIES = named(_METADATA, "TensorProperties")
_CHUNK = named(_METADATA, "ChunkStorageMetadata")
_BYTES = named(_METADATA, "BytesStorageMetadata")
_INDEX = named(_METADATA, "MetadataIndex")
_STORAGE_INFO = named(_FILESYSTEM, "_StorageInfo")
_STRIDED = named("torch.serialization", "_get_layout")("torch.strided")
_CONTIGUOUS = named(_METADATA, "_MEM_FORMAT_ENCODING")(0)


def _new(cls: Named, state: Any) -> Call:
    """An instance of DCP class `cls` with `state`, as pickle writes a dataclass."""
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


def _size(values: tuple[int, ...]) -> Call:
    return _SIZE(tuple(values))


def save(path: Path, metadata: DcpMetadata) -> None:
    """Write `.metadata` as DCP pickles its `Metadata` (torch 2.x: dataclass states, `TensorProperties`
    as its tuple, `_StorageInfo` without its unset fields), naming DCP's classes without importing them.

    Names are interned: pickle writes a string object once and refers back to it after, so equal names held as
    one object or as several (a resumed run reads them back from its work log) would give different bytes."""
    state: dict[str, Any] = {
        intern(fqn): _new(
            _TENSOR_STORAGE,
            {
                "properties": _new(_PROPERTIES, (named("torch", entry.dtype), _STRIDED, False, _CONTIGUOUS, False)),
                "size": _size(entry.size),
                "chunks": [_new(_CHUNK, {"offsets": _size(c.offsets), "sizes": _size(c.sizes)}) for c in entry.chunks],
            },
        )
        for fqn, entry in metadata.tensors.items()
    }
    state.update({intern(fqn): _new(_BYTES, {}) for fqn in metadata.objects})
    storage = {
        _new(_INDEX, {"fqn": intern(fqn), "offset": None if offsets is None else _size(offsets), "index": None}): _new(
            _STORAGE_INFO, {"relative_path": intern(s.relative_path), "offset": s.offset, "length": s.length}
        )
        for (fqn, offsets), s in metadata.storage.items()
    }
    root = _new(
        named(_METADATA, "Metadata"),
        {"state_dict_metadata": state, "planner_data": None, "storage_data": storage, "storage_meta": None, "version": None},
    )
    with open(path, "wb") as f:
        Pickler(f, protocol=4).dump(root)

