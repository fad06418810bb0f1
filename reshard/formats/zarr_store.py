"""The intermediate form: a zarr v3 store, one array per logical tensor at its global shape.

Chunks are one layer (and one expert) deep and cut along the tensor-parallel axis at the finest split
we expect (`TP_CHUNKS`), so a TP/PP/EP target reads only the chunks it needs; they hold their values in
C order (the plain `bytes` codec). An array with several chunks per layer is sharded (zarr v3's
`sharding_indexed` codec): a layer's chunks, of all its experts up to `MAX_SHARD_BYTES`, lie in one file
(`shard_shape`), so a 256-expert model with its optimizer state is thousands of files, not a million,
which shared cluster filesystems handle badly. A shard holds its chunks in C order from offset 0 and
their index after them (little-endian uint64 offset and length per chunk, no checksum), so every chunk's
place is known before its bytes exist. Chunk files (zarr v3's default key encoding: `<array>/c/<i>/...`)
and shards are written and read by the conversion's own threads with `pwrite`/`pread`, a large chunk
past the page cache (`reshard.direct_io`), byte for byte as tensorstore writes them; stores written
before sharding (a file per chunk) read the same way, and an array stored any other way (compressed,
another index) is read through tensorstore. bfloat16 has no zarr v3 core data type that zarr-python
reads, so bf16 arrays are stored as their uint16 bit patterns with `reshard_dtype: "bfloat16"` in the
array's attributes: plain `zarr` and `tensorstore` open every array, and the bits are exact.

The root group's attributes hold the model config, the source layout and the per-tensor checksums;
Megatron's non-tensor state (args, scheduler) is kept as `common.pt` beside the arrays.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from reshard.atomic import fsync_path
from reshard.buffers import PerThread, copy
from reshard.checksum import HashedParts
from reshard.config import ModelConfig
from reshard.direct_io import DirectFile
from reshard.documents import read_json
from reshard.dtypes import itemsize
from reshard.errors import ReshardError
from reshard.formats.base import CheckpointReader, CheckpointWriter, CommonState, Manifest, StoredRecord, cached
from reshard.layout import Layout
from reshard.logical import TensorSpec, describe
from reshard.paths import confined, confined_tree
from reshard.sharding import Piece, Region, contiguous_offset, full_region, intersect, shift, to_slices
from reshard.torchfile.archive_reader import RecordFile, TensorRecord
from reshard.torchfile.archive_writer import save_archive
from reshard.torchfile.payloads import load_screened

if TYPE_CHECKING:
    import tensorstore as ts

PLAIN_CODECS = [{"configuration": {"endian": "little"}, "name": "bytes"}]  # a chunk file is its values in C order
TP_CHUNKS = 8  # chunk the TP axis so that TP = 1, 2, 4, 8 read whole chunks
MAX_CHUNK_BYTES = 64 << 20
# A shard (one file) is one layer of an array, cut along the experts while larger than this: DeepSeek-V3's
# 256 experts' fc1 is 15 GB a layer in bf16, twice that per fp32 optimizer state.
MAX_SHARD_BYTES = 4 << 30
INDEX_DTYPE = "<u8"  # a shard index holds each chunk's (offset, length) as two of these
INDEX_ENTRY = 2 * np.dtype(INDEX_DTYPE).itemsize
MISSING = 2**64 - 1  # an index entry's offset and length for a chunk not stored (the fill value)
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
        return "reshard" in read_json(meta).get("attributes", {})
    except (ReshardError, AttributeError, TypeError):  # no JSON object of attributes: no store of reshard's
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


def shard_shape(spec: TensorSpec) -> list[int]:
    """Chunks stored in one file: one layer's (all of the array when it is not stacked by layer), halved
    along the first axis after the layer's that has an even number of chunks while larger than MAX_SHARD_BYTES."""
    chunks = chunk_shape(spec)
    shard = [-(-d // c) * c for d, c in zip(list(spec.shape) or [1], chunks)]
    if spec.stacked:
        shard[0] = chunks[0]
    size = itemsize(spec.dtype)
    for axis in range(int(spec.stacked), len(shard)):
        while math.prod(shard) * size > MAX_SHARD_BYTES and shard[axis] // chunks[axis] % 2 == 0:
            shard[axis] //= 2
    return shard


@dataclass(frozen=True)
class Grid:
    """Where an array's chunks lie: each in a file of its own, or (sharded) `shard`-shaped blocks of them
    in one file each, in C order from offset 0 and followed by their index."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    shard: tuple[int, ...]
    itemsize: int

    @classmethod
    def of(cls, spec: TensorSpec) -> Grid:
        return cls(tuple(spec.shape) or (1,), tuple(chunk_shape(spec)), tuple(shard_shape(spec)), itemsize(spec.dtype))

    @property
    def sharded(self) -> bool:
        return self.shard != self.chunks

    @property
    def per_shard(self) -> tuple[int, ...]:
        return tuple(s // c for s, c in zip(self.shard, self.chunks))

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunks) * self.itemsize

    @property
    def index_bytes(self) -> int:
        """A shard's index: an (offset, length) entry per chunk (none for an unsharded array)."""
        return math.prod(self.per_shard) * INDEX_ENTRY if self.sharded else 0

    def place(self, index: tuple[int, ...]) -> tuple[str, int]:
        """A chunk's file (under its array) and its position among that file's chunks (0 in a file of its own)."""
        if not self.sharded:
            return chunk_key(index), 0
        outer = tuple(i // n for i, n in zip(index, self.per_shard))
        inner = tuple(i % n for i, n in zip(index, self.per_shard))
        return chunk_key(outer), int(np.ravel_multi_index(inner, self.per_shard))

    def index(self) -> np.ndarray:
        """A shard's index as the writer lays it out: the chunk at position i whole at i chunks from the start."""
        positions = np.arange(math.prod(self.per_shard), dtype=INDEX_DTYPE) * self.chunk_bytes
        return np.stack([positions, np.full_like(positions, self.chunk_bytes)], axis=1)

    def stored_bytes(self) -> int:
        """The array's files, chunks and index entries: a chunk reaching past the array is stored whole."""
        chunks = math.prod(-(-d // c) for d, c in zip(self.shape, self.chunks))
        return chunks * (self.chunk_bytes + (INDEX_ENTRY if self.sharded else 0))

    def codecs(self) -> list[dict[str, Any]]:
        if not self.sharded:
            return PLAIN_CODECS
        sharding = {"chunk_shape": list(self.chunks), "codecs": PLAIN_CODECS, "index_codecs": PLAIN_CODECS}  # index at the end
        return [{"name": "sharding_indexed", "configuration": sharding}]

    @classmethod
    def of_metadata(cls, meta: dict[str, Any], size: int) -> Grid | None:
        """The grid of an array whose zarr.json says it is stored as reshard writes them (chunks of their
        values in C order, default key encoding, fill value 0, plain or with a plain index at the end);
        None for any other array."""
        encoding = meta.get("chunk_key_encoding", {})
        if encoding.get("name") != "default" or meta.get("fill_value") != 0 or meta.get("chunk_grid", {}).get("name") != "regular":
            return None
        if encoding.get("configuration", {}).get("separator", "/") != "/":
            return None
        shape, outer = tuple(meta["shape"]), tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        codecs = meta.get("codecs")
        if codecs == PLAIN_CODECS:
            return cls(shape, outer, outer, size)
        inner = codecs[0].get("configuration", {}).get("chunk_shape") if isinstance(codecs, list) and len(codecs) == 1 else None
        if not isinstance(inner, list) or len(inner) != len(outer) or any(s % c for s, c in zip(outer, inner)):
            return None
        grid = cls(shape, tuple(inner), outer, size)
        return grid if grid.sharded and codecs == grid.codecs() else None


def chunk_grid(region: Region, chunks: Sequence[int], shape: Sequence[int]) -> Iterator[tuple[tuple[int, ...], Region, Region]]:
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
        confined_tree(path)  # tensorstore opens chunk files by name, following links: none may lead out
        attrs = read_json(path / "zarr.json")["attributes"]["reshard"]
        # None: written from a checkpoint that records no architecture (global tensors, which convert only as they are)
        self.config = ModelConfig.from_dict(attrs["config"]) if attrs["config"] is not None else None
        self.layout = Layout(**attrs["layout"])
        self.manifest = Manifest.from_json(attrs["manifest"]) if "manifest" in attrs else None
        common = load_screened(path / COMMON_FILE, str(path / COMMON_FILE)) if (path / COMMON_FILE).is_file() else {}
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
        self._grids: dict[str, Grid | None] = {}
        self._indexes: dict[Path, tuple[np.ndarray, int] | None] = {}
        for name, entry in attrs["tensors"].items():
            confined(path, name)  # a tensor's name is its array's directory: one leading out of the store is refused
            self.specs[name] = describe(name, tuple(entry["shape"]), entry["dtype"], self.config)

    def _array(self, name: str) -> ts.TensorStore:
        def open_array() -> ts.TensorStore:
            try:
                return _open(self.path / name, open=True)
            except ValueError as exc:
                raise ReshardError(f"{self.path / name}: array cannot be opened ({exc}); the store is damaged") from None

        return cached(self._arrays, name, open_array)

    def _plain(self, name: str) -> Grid | None:
        """The grid of an array stored as reshard writes them (`Grid.of_metadata`); None for any other array."""
        size = itemsize(self.specs[name].dtype)
        return cached(self._grids, name, lambda: Grid.of_metadata(json.loads((self.path / name / "zarr.json").read_text()), size))

    def _shard_index(self, path: Path, grid: Grid) -> tuple[np.ndarray, int] | None:
        """A shard's index, read from the end of its file, and where its chunks' bytes end (None: never written)."""

        def read() -> tuple[np.ndarray, int] | None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                end = os.fstat(fd).st_size - grid.index_bytes
                data = os.pread(fd, grid.index_bytes, end) if end >= 0 else b""
            finally:
                os.close(fd)
            if len(data) != grid.index_bytes:
                raise ReshardError(f"{path}: shorter than its shard index; the store is damaged")
            return np.frombuffer(data, INDEX_DTYPE).reshape(-1, 2), end

        return cached(self._indexes, path, read)

    def _where(self, name: str, grid: Grid, index: tuple[int, ...]) -> tuple[str, int | None]:
        """A chunk's file (relative to the store) and the offset of its values there: None where it is not
        stored (which is damage: `_lacks`), -1 where it is stored other than whole (a file or index entry of another size)."""
        file, position = grid.place(index)
        key = f"{name}/{file}"
        if not grid.sharded:
            try:
                size = (self.path / key).stat().st_size
            except FileNotFoundError:
                return key, None
            return key, 0 if size == grid.chunk_bytes else -1
        shard = self._shard_index(self.path / key, grid)
        if shard is None:
            return key, None
        entries, end = shard
        offset, length = (int(v) for v in entries[position])
        if offset == length == MISSING:
            return key, None
        return key, offset if length == grid.chunk_bytes and offset + length <= end else -1

    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        """A plain array's chunks are read with `pread` from their files or shards, straight into `out` where
        a chunk is one run there (`RecordFile`); tensorstore decodes any other array straight into `out`."""
        spec, grid = self.specs[name], self._plain(name)
        if grid is not None and spec.shape:
            for index, whole, inside in chunk_grid(region, grid.chunks, grid.shape):
                part = intersect(inside, region)
                assert part is not None  # the chunks chunk_grid gives touch the region
                dest = out[to_slices(shift(part, region))]
                key, offset = self._where(name, grid, index)
                if offset is None:
                    raise _lacks(self.path / key, name, index, grid.sharded)
                if offset < 0:
                    raise ReshardError(f"{self.path / key}: chunk {index} is not stored whole; the store is damaged")
                file = RecordFile(self.path / key)
                try:
                    file.read_into(TensorRecord(spec.dtype, grid.chunks, offset), shift(part, whole), dest)
                finally:
                    file.close()
            return
        if not out.flags.c_contiguous:
            out[...] = self.read(name, region)
            return
        index = to_slices(region) if spec.shape else ()
        dest = _tensorstore().array(_stored(out.reshape([b - a for a, b in region] or [1]), spec.dtype), copy=False)
        try:
            if not self._array(name)[index].storage_statistics(query_fully_stored=True).result().fully_stored:
                raise _lacks(self.path / name, name, region, sharded=False)
            dest.write(self._array(name)[index]).result()
        except ValueError as exc:
            raise ReshardError(f"{self.path / name}: {exc}") from None

    def stored_records(self, name: str) -> list[StoredRecord] | None:
        """Each chunk of a plain array, where its zarr.json (and its shard's index) says it lies (None for
        other arrays). A chunk not stored whole, or that reaches past the array other than in its first
        axis, is read back (offset -1)."""
        spec, grid = self.specs[name], self._plain(name)
        if grid is None:
            return None
        records = []
        for index, whole, inside in chunk_grid(full_region(grid.shape), grid.chunks, grid.shape):
            key, offset = self._where(name, grid, index)
            start = contiguous_offset(grid.chunks, shift(inside, whole))
            stored = offset is not None and offset >= 0 and start is not None and spec.shape
            records.append(StoredRecord(name, inside if spec.shape else (), spec.dtype, key, offset + start * grid.itemsize if stored else -1))
        return records


def _lacks(where: Path, name: str, chunk: Any, sharded: bool) -> ReshardError:
    """A chunk zarr.json promises and the store lacks. zarr reads it as the fill value; reshard writes every chunk,
    so here it is damage, found whether or not the store carries checksums to find the zeros by."""
    how = "its shard's index marks it empty" if sharded else "no file holds it"
    return ReshardError(f"{where}: {name} chunk {chunk} is not stored ({how}), though zarr.json promises it; the store is damaged")


class ZarrWriter(CheckpointWriter):
    format_name = "zarr"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.path.mkdir(parents=True, exist_ok=True)
        self._arrays: dict[str, ts.TensorStore] = {}
        self._scratch = PerThread()  # stages chunks that are not one run of their slab
        self._made: set[Path] = set()  # chunk directories known to exist
        self._shards: set[Path] = set()  # shard files created, with their index
        self._unsynced: deque[Path] = deque()  # files written since the last `sync` (appended by reader threads)

    def _array(self, spec: TensorSpec) -> ts.TensorStore:
        """Created on first write, so that in a multi-rank run each array is created by its one writer."""
        return cached(self._arrays, spec.name, lambda: self._create(spec))

    def _create(self, spec: TensorSpec) -> ts.TensorStore:
        grid = Grid.of(spec)
        array = _open(
            self.path / spec.name,
            create=True,
            delete_existing=True,  # an array left half-written by an interrupted run
            metadata={
                "shape": list(spec.shape) or [1],
                "data_type": _stored_dtype(spec.dtype),
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(grid.shard)}},
                "codecs": grid.codecs(),  # given, not tensorstore's default: we write the chunks ourselves
                "attributes": {"reshard_dtype": spec.dtype, "reshard_shape": list(spec.shape)},
            },
        )
        self._unsynced.append(self.path / spec.name / "zarr.json")
        return array

    @classmethod
    def whole_regions(cls, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> list[Region]:
        if not spec.shape:
            return [slab]
        return [inside for _, _, inside in chunk_grid(slab, chunk_shape(spec), list(spec.shape))]  # each is one chunk

    def _folder(self, path: Path) -> None:
        """A directory per row of chunks or shards: made once, not checked per file."""
        if path.parent not in self._made:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made.add(path.parent)

    def reserve(self, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> None:
        """The array's zarr.json, and each shard the slab reaches that does not exist yet with its index at
        its end, its chunks' places before their bytes: reader threads then `pwrite` chunks into shards in
        any order and never read one back (as tensorstore's read-modify-write of a shard would). Here, in
        plan order, in the one thread that reserves; a tensor is written by one process (multi-rank runs
        split the tensors), so no shard has two writers."""
        self._array(spec)
        grid = Grid.of(spec)
        if not grid.sharded:
            return
        for index, _, _ in chunk_grid(slab if spec.shape else ((0, 1),), grid.shard, grid.shape):
            path = self.path / spec.name / chunk_key(index)
            if path in self._shards:
                continue
            self._folder(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.pwrite(fd, grid.index().tobytes(), math.prod(grid.per_shard) * grid.chunk_bytes)
            finally:
                os.close(fd)
            self._shards.add(path)
            self._unsynced.append(path)

    def prepare(
        self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], reserved: Any = None, hashed: HashedParts | None = None
    ) -> None:
        """Write the slab's chunks, their values in C order (the `bytes` codec), each to its file or its
        place in its shard (`reserve` made it), from this reader thread; a chunk that is not one run of the
        slab, or that reaches past the array, is staged."""
        grid = Grid.of(spec)
        chunks = list(grid.chunks)
        region = slab if spec.shape else ((0, 1),)
        values = data.reshape([b - a for a, b in region])
        for index, whole, inside in chunk_grid(region, grid.chunks, grid.shape):
            part = values[to_slices(shift(inside, region))]
            if inside != whole or not part.flags.c_contiguous:
                staged = self._scratch.array(chunks, data.dtype)
                if inside != whole:
                    staged[...] = 0  # the fill value, where the chunk reaches past the array
                copy(staged[to_slices(shift(inside, whole))], part)
                part = staged
            file, position = grid.place(index)
            key = f"{spec.name}/{file}"
            self._folder(self.path / key)
            # no O_TRUNC: a chunk file's bytes are all written again, a shard's index is kept; an interrupted
            # run's array was emptied when it was recreated
            out = DirectFile(self.path / key, os.O_WRONLY | os.O_CREAT)
            try:
                out.pwrite(part.reshape(-1).view(np.uint8), position * grid.chunk_bytes)
            finally:
                out.close()
            self._unsynced.append(self.path / key)
            start = contiguous_offset(chunks, shift(inside, whole))
            if start is not None and spec.shape:  # the bytes as they went to the file (a staged chunk's too)
                written = part.reshape(chunks)[to_slices(shift(inside, whole))]
                self.vouch(spec, inside, key, position * grid.chunk_bytes + start * data.itemsize, written, hashed)

    def write(self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], prepared: Any = None) -> None:
        """Nothing is left to do: the reader thread wrote the chunks."""

    @classmethod
    def file_bytes(cls, moves: Iterable[tuple[TensorSpec, int]], config: ModelConfig, layout: Layout) -> dict[str, int]:
        """The arrays' chunks, whole, and their shards' indexes."""
        return {"(zarr arrays)": sum(Grid.of(spec).stored_bytes() for spec, _ in moves)}

    def sync(self) -> None:
        """The chunk files written so far, and the directories naming them, made durable: a tensor is
        logged as done only after (a crashed node would otherwise lose chunks the log vouches for)."""
        files = dict.fromkeys(self._unsynced.popleft() for _ in range(len(self._unsynced)))  # a shard once, however many chunks
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
                "config": self.config.to_dict() if self.config else None,
                "layout": self.layout.__dict__,
                "tensors": {n: {"shape": list(s.shape), "dtype": s.dtype} for n, s in sorted(self.specs.items())},
                "manifest": manifest.to_json(),
            }
        }
        (self.path / "zarr.json").write_text(
            json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs}, indent=1) + "\n"
        )
