"""The intermediate form: a zarr v3 store, one array per logical tensor at its global shape.

Arrays are created through tensorstore with the plain `bytes` codec, so each chunk is a file holding
its values in C order (zarr v3's default key encoding: `<array>/c/<i>/<j>/...`). Those files are
written and read by the conversion's own threads with `pwrite`/`pread`, a large one past the page
cache (`reshard.direct_io`), byte for byte as tensorstore writes them; an array stored any other way
(compressed, sharded) is read through tensorstore. Chunks are one layer (and one expert) deep and
cut along the tensor-parallel axis at the finest split we expect (`TP_CHUNKS`), so a TP/PP/EP target
reads only the chunks it needs. bfloat16 has no zarr v3 core data type that zarr-python reads, so bf16 arrays
are stored as their uint16 bit patterns with `reshard_dtype: "bfloat16"` in the array's attributes:
plain `zarr` and `tensorstore` open every array, and the bits are exact.

The root group's attributes hold the model config, the source layout and the per-tensor checksums;
Megatron's non-tensor state (args, scheduler) is kept as `common.pt` beside the arrays.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from reshard.atomic import fsync_path
from reshard.buffers import PerThread, copy
from reshard.checksum import HashedParts
from reshard.config import ModelConfig
from reshard.direct_io import DirectFile
from reshard.dtypes import itemsize
from reshard.errors import ReshardError
from reshard.formats.base import CheckpointReader, CheckpointWriter, CommonState, Manifest, StoredRecord, cached
from reshard.layout import Layout
from reshard.logical import TensorSpec, describe
from reshard.sharding import Piece, Region, contiguous_offset, full_region, intersect, shift, to_slices
from reshard.torchfile.archive_reader import RecordFile, TensorRecord, load_archive
from reshard.torchfile.archive_writer import save_archive

if TYPE_CHECKING:
    import tensorstore as ts

PLAIN_CODECS = [{"configuration": {"endian": "little"}, "name": "bytes"}]  # a chunk file is its values in C order
TP_CHUNKS = 8  # chunk the TP axis so that TP = 1, 2, 4, 8 read whole chunks
MAX_CHUNK_BYTES = 64 << 20
COMMON_FILE = "common.pt"
_BITS = {"bfloat16": "uint16"}  # dtypes zarr-python cannot name, stored as raw bits
_ZARR_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "float64": "float64",
    "int64": "int64",
    "int32": "int32",
    "uint8": "uint8",
    "bool": "bool",
}


def is_zarr(path: Path) -> bool:
    meta = path / "zarr.json"
    if not meta.is_file():
        return False
    try:
        return "reshard" in json.loads(meta.read_text()).get("attributes", {})
    except ValueError:
        return False


def chunk_shape(spec: TensorSpec) -> list[int]:
    shape = list(spec.shape) or [1]
    chunks = list(shape)
    for axis in range(spec.prefix_axes):
        chunks[axis] = 1
    axis = spec.tp_axis
    if axis is not None:
        parts = TP_CHUNKS * (2 if spec.gated else 1)
        while parts > 1 and shape[axis] % parts:
            parts //= 2
        chunks[axis] = shape[axis] // parts
    size = itemsize(spec.dtype)
    # Keep chunks bounded for huge embeddings: halve the first splittable axis.
    first = spec.prefix_axes
    while first < len(chunks) and np.prod(chunks) * size > MAX_CHUNK_BYTES and chunks[first] % 2 == 0:
        chunks[first] //= 2
    return chunks


def chunk_grid(region: Region, chunks: list[int], shape: list[int]) -> Iterator[tuple[tuple[int, ...], Region, Region]]:
    """The chunks of an array of `shape` that `region` touches: (grid index, the chunk's whole region,
    the part of it inside the array)."""
    spans = [range(a // c, -(-b // c)) for (a, b), c in zip(region, chunks)]
    for index in itertools.product(*spans):
        whole = tuple((i * c, (i + 1) * c) for i, c in zip(index, chunks))
        yield index, whole, tuple((a, min(b, d)) for (a, b), d in zip(whole, shape))


def chunk_key(index: tuple[int, ...]) -> str:
    """A chunk's file under its array, in zarr v3's default key encoding."""
    return "/".join(("c", *map(str, index)))


def _stored_dtype(dtype: str) -> str:
    if dtype in _BITS:
        return _BITS[dtype]
    if dtype not in _ZARR_DTYPES:
        raise ReshardError(f"dtype {dtype} cannot be stored in zarr by reshard")
    return _ZARR_DTYPES[dtype]


def _tensorstore() -> Any:
    """tensorstore, imported when a zarr array is first opened: it would add to every other conversion's
    start-up otherwise (benchmarks/README.md, "Measurements behind defaults")."""
    import tensorstore

    return tensorstore


def _open(path: Path, **spec: Any) -> ts.TensorStore:
    return _tensorstore().open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}, **spec}).result()


def _stored(a: np.ndarray, dtype: str) -> np.ndarray:
    """An array's values as its zarr array stores them (a dtype zarr cannot name as its bits)."""
    return a.view(_BITS[dtype]) if dtype in _BITS else a


class ZarrReader(CheckpointReader):
    format_name = "zarr"

    def __init__(self, path: Path):
        if not is_zarr(path):
            raise ReshardError(f"{path} is not a reshard zarr store (no zarr.json with reshard attributes)")
        self.path = self.tokenizer_dir = path
        attrs = json.loads((path / "zarr.json").read_text())["attributes"]["reshard"]
        self.config = ModelConfig.from_dict(attrs["config"])
        self.layout = Layout(**attrs["layout"])
        self.manifest = Manifest.from_json(attrs["manifest"]) if "manifest" in attrs else None
        common = load_archive(path / COMMON_FILE, str(path / COMMON_FILE)) if (path / COMMON_FILE).is_file() else {}
        # what `finish` writes, checked before a damaged or foreign file's values reach code that takes them for that
        iteration = common.get("iteration", 0) if isinstance(common, dict) else None
        parts = ("args", "extra", "objects")
        if not (isinstance(iteration, int) or iteration == "release") or not all(isinstance(common.get(k, {}), dict) for k in parts):
            raise ReshardError(f"{path / COMMON_FILE} does not hold reshard's common state: the store is damaged")
        self.common = CommonState(
            args=common.get("args", {}), iteration=common.get("iteration", 0), extra=common.get("extra", {}), objects=common.get("objects", {})
        )
        self.specs = {}
        self._arrays: dict[str, ts.TensorStore] = {}
        self._layouts: dict[str, tuple[list[int], list[int]] | None] = {}
        for name, entry in attrs["tensors"].items():
            self.specs[name] = describe(name, tuple(entry["shape"]), entry["dtype"], self.config)

    def _array(self, name: str) -> ts.TensorStore:
        def open_array() -> ts.TensorStore:
            try:
                return _open(self.path / name, open=True)
            except ValueError as exc:
                raise ReshardError(f"{self.path / name}: array cannot be opened ({exc}); the store is damaged") from None

        return cached(self._arrays, name, open_array)

    def _plain(self, name: str) -> tuple[list[int], list[int]] | None:
        """(shape, chunk shape) of an array stored as reshard writes them (each chunk a file of its values
        in C order, under the default key encoding, fill value 0); None for any other array."""

        def check() -> tuple[list[int], list[int]] | None:
            meta = json.loads((self.path / name / "zarr.json").read_text())
            encoding = meta.get("chunk_key_encoding", {})
            if meta.get("codecs") != PLAIN_CODECS or encoding.get("name") != "default" or meta.get("fill_value") != 0:
                return None
            if encoding.get("configuration", {}).get("separator", "/") != "/" or meta.get("chunk_grid", {}).get("name") != "regular":
                return None
            return meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"]

        return cached(self._layouts, name, check)

    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        """A plain array's chunk files are read with `pread`, straight into `out` where a chunk is one run
        there (`RecordFile`); tensorstore decodes any other array straight into `out`."""
        spec, plain = self.specs[name], self._plain(name)
        if plain is not None and spec.shape:
            shape, chunks = plain
            for index, whole, inside in chunk_grid(region, chunks, shape):
                part = intersect(inside, region)
                assert part is not None  # the chunks chunk_grid gives touch the region
                dest = out[to_slices(shift(part, region))]
                try:
                    file = RecordFile(self.path / name / chunk_key(index))
                except FileNotFoundError:  # never written: the fill value
                    dest[...] = 0
                    continue
                try:
                    file.read_into(TensorRecord(spec.dtype, tuple(chunks), 0), shift(part, whole), dest)
                finally:
                    file.close()
            return
        if not out.flags.c_contiguous:
            out[...] = self.read(name, region)
            return
        index = to_slices(region) if spec.shape else ()
        dest = _tensorstore().array(_stored(out.reshape([b - a for a, b in region] or [1]), spec.dtype), copy=False)
        try:
            dest.write(self._array(name)[index]).result()
        except ValueError as exc:
            raise ReshardError(f"{self.path / name}: {exc}") from None

    def stored_records(self, name: str) -> list[StoredRecord] | None:
        """Each chunk of a plain array, where its zarr.json says it lies (None for other arrays). A chunk
        file that is missing or of another size, or a chunk that reaches past the array other than in its
        first axis, is read back (offset -1)."""
        spec, plain = self.specs[name], self._plain(name)
        if plain is None:
            return None
        shape, chunks = plain
        size = itemsize(spec.dtype)
        records = []
        for index, whole, inside in chunk_grid(full_region(tuple(shape)), chunks, shape):
            key = f"{name}/{chunk_key(index)}"
            start = contiguous_offset(chunks, shift(inside, whole))
            path = self.path / key
            stored = path.is_file() and path.stat().st_size == math.prod(chunks) * size
            offset = start * size if stored and start is not None and spec.shape else -1
            records.append(StoredRecord(name, inside if spec.shape else (), spec.dtype, key, offset))
        return records


class ZarrWriter(CheckpointWriter):
    format_name = "zarr"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.path.mkdir(parents=True, exist_ok=True)
        self._arrays: dict[str, ts.TensorStore] = {}
        self._scratch = PerThread()  # stages chunks that are not one run of their slab
        self._made: set[Path] = set()  # chunk directories known to exist
        self._unsynced: deque[Path] = deque()  # files written since the last `sync` (appended by reader threads)

    def _array(self, spec: TensorSpec) -> ts.TensorStore:
        """Created on first write, so that in a multi-rank run each array is created by its one writer."""
        return cached(self._arrays, spec.name, lambda: self._create(spec))

    def _create(self, spec: TensorSpec) -> ts.TensorStore:
        array = _open(
            self.path / spec.name,
            create=True,
            delete_existing=True,  # an array left half-written by an interrupted run
            metadata={
                "shape": list(spec.shape) or [1],
                "data_type": _stored_dtype(spec.dtype),
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk_shape(spec)}},
                "codecs": PLAIN_CODECS,  # tensorstore would shard large chunks otherwise; we write them as files
                "attributes": {"reshard_dtype": spec.dtype, "reshard_shape": list(spec.shape)},
            },
        )
        self._unsynced.append(self.path / spec.name / "zarr.json")
        return array

    @classmethod
    def whole_regions(cls, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> list[Region]:
        if not spec.shape:
            return [slab]
        return [inside for _, _, inside in chunk_grid(slab, chunk_shape(spec), list(spec.shape))]  # each is one file

    def prepare(
        self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], reserved: Any = None, hashed: HashedParts | None = None
    ) -> None:
        """Write the slab's chunks, each a file of its values in C order (the `bytes` codec), from this reader
        thread; a chunk that is not one run of the slab, or that reaches past the array, is staged."""
        self._array(spec)  # its zarr.json first
        shape, chunks = list(spec.shape) or [1], chunk_shape(spec)
        region = slab if spec.shape else ((0, 1),)
        values = data.reshape([b - a for a, b in region])
        for index, whole, inside in chunk_grid(region, chunks, shape):
            part = values[to_slices(shift(inside, region))]
            if inside != whole or not part.flags.c_contiguous:
                staged = self._scratch.array(chunks, data.dtype)
                if inside != whole:
                    staged[...] = 0  # the fill value, where the chunk reaches past the array
                copy(staged[to_slices(shift(inside, whole))], part)
                part = staged
            key = f"{spec.name}/{chunk_key(index)}"
            folder = (self.path / key).parent
            if folder not in self._made:  # a directory per row of chunks: made once, not checked per chunk
                folder.mkdir(parents=True, exist_ok=True)
                self._made.add(folder)
            file = DirectFile(self.path / key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                file.pwrite(part.reshape(-1).view(np.uint8), 0)
            finally:
                file.close()
            self._unsynced.append(self.path / key)
            start = contiguous_offset(chunks, shift(inside, whole))
            if start is not None and spec.shape:  # the bytes as they went to the file (a staged chunk's too)
                written = part.reshape(chunks)[to_slices(shift(inside, whole))]
                self.vouch(spec, inside, key, start * data.itemsize, written, hashed)

    def write(self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], prepared: Any = None) -> None:
        """Nothing is left to do: the reader thread wrote the chunks."""

    @classmethod
    def file_bytes(cls, moves: Iterable[tuple[TensorSpec, int]], config: ModelConfig, layout: Layout) -> dict[str, int]:
        """One file per chunk: the arrays' bytes in all."""
        return {"(zarr arrays)": sum(spec.numel * size for spec, size in moves)}

    def sync(self) -> None:
        """The chunk files written so far, and the directories naming them, made durable: a tensor is
        logged as done only after (a crashed node would otherwise lose chunks the log vouches for)."""
        files = [self._unsynced.popleft() for _ in range(len(self._unsynced))]
        for path in [*files, *dict.fromkeys(p.parent for p in files)]:
            fsync_path(path)

    def held_for(self, names: list[str]) -> int:
        """An unfinished tensor's array, as an interrupted run left it: recreated (emptied) when written."""
        return sum(f.stat().st_blocks * 512 for name in names for f in (self.path / name).rglob("*") if f.is_file())

    def restore(self, facts: list[Any]) -> None:
        """Nothing to take: a finished tensor's array is complete (and has no facts); an unfinished one is recreated."""

    def part(self) -> None:
        return None  # arrays are complete once written; the root attributes list every spec

    def finish(self, manifest: Manifest, parts: list[Any] | None = None) -> None:
        with open(self.path / COMMON_FILE, "wb") as f:
            save_archive(
                {"args": self.common.args, "iteration": self.common.iteration, "extra": self.common.extra, "objects": self.common.objects}, f
            )
        attrs = {
            "reshard": {
                "version": 1,
                "config": self.config.to_dict(),
                "layout": self.layout.__dict__,
                "tensors": {n: {"shape": list(s.shape), "dtype": s.dtype} for n, s in sorted(self.specs.items())},
                "manifest": manifest.to_json(),
            }
        }
        (self.path / "zarr.json").write_text(
            json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs}, indent=1) + "\n"
        )
