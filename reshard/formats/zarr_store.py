"""The intermediate form: a zarr v3 store, one array per logical tensor at its global shape.

Written and read through tensorstore. Chunks are one layer (and one expert) deep and cut along the
tensor-parallel axis at the finest split we expect (`TP_CHUNKS`), so a TP/PP/EP target reads only
the chunks it needs. bfloat16 has no zarr v3 core data type that zarr-python reads, so bf16 arrays
are stored as their uint16 bit patterns with `reshard_dtype: "bfloat16"` in the array's attributes:
plain `zarr` and `tensorstore` open every array, and the bits are exact.

The root group's attributes hold the model config, the source layout and the per-tensor checksums;
Megatron's non-tensor state (args, scheduler) is kept as `common.pt` beside the arrays.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts
import torch

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.formats.base import CheckpointReader, CheckpointWriter, CommonState, Manifest, cached
from reshard.layout import Layout
from reshard.logical import TensorSpec, describe
from reshard.sharding import Piece, Region, cut, long_axis, shift, to_slices

TP_CHUNKS = 8  # chunk the TP axis so that TP = 1, 2, 4, 8 read whole chunks
MAX_CHUNK_BYTES = 64 << 20
COMMON_FILE = "common.pt"
_BITS = {"bfloat16": ("uint16", torch.int16)}  # dtypes zarr-python cannot name, stored as raw bits
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
    itemsize = torch.empty(0, dtype=getattr(torch, spec.dtype)).element_size()
    # Keep chunks bounded for huge embeddings: halve the first splittable axis.
    first = spec.prefix_axes
    while first < len(chunks) and np.prod(chunks) * itemsize > MAX_CHUNK_BYTES and chunks[first] % 2 == 0:
        chunks[first] //= 2
    return chunks


def write_bands(region: Region, chunks: list[int], itemsize: int) -> list[Region]:
    """`region` cut along its first axis longer than one into bands of whole chunks, each about
    MAX_CHUNK_BYTES: tensorstore copies what one write encodes, so writing a 0.5 GiB vocabulary slab
    at once held a second copy of it."""
    axis = long_axis(region)
    if axis is None:
        return [region]
    per_row = itemsize * int(np.prod([b - a for i, (a, b) in enumerate(region) if i != axis]))
    step = max(1, MAX_CHUNK_BYTES // max(1, per_row * chunks[axis])) * chunks[axis]
    start, stop = region[axis]
    return cut(region, axis, [*range(start, stop, step), stop])


def _stored_dtype(dtype: str) -> str:
    if dtype in _BITS:
        return _BITS[dtype][0]
    if dtype not in _ZARR_DTYPES:
        raise ReshardError(f"dtype {dtype} cannot be stored in zarr by reshard")
    return _ZARR_DTYPES[dtype]


def _open(path: Path, **spec: Any) -> ts.TensorStore:
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}, **spec}).result()


def _to_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype in _BITS:
        return t.contiguous().view(_BITS[dtype][1]).numpy().view(np.uint16)
    return t.contiguous().numpy()


class ZarrReader(CheckpointReader):
    format_name = "zarr"

    def __init__(self, path: Path):
        if not is_zarr(path):
            raise ReshardError(f"{path} is not a reshard zarr store (no zarr.json with reshard attributes)")
        self.path = path
        attrs = json.loads((path / "zarr.json").read_text())["attributes"]["reshard"]
        self.config = ModelConfig.from_dict(attrs["config"])
        self.layout = Layout(**attrs["layout"])
        self.manifest = Manifest.from_json(attrs["manifest"]) if "manifest" in attrs else None
        common = torch.load(path / COMMON_FILE, weights_only=False) if (path / COMMON_FILE).is_file() else {}
        self.common = CommonState(
            args=common.get("args", {}), iteration=common.get("iteration", 0), extra=common.get("extra", {}), objects=common.get("objects", {})
        )
        self.specs = {}
        self._dtypes: dict[str, str] = {}
        self._arrays: dict[str, ts.TensorStore] = {}
        for name, entry in attrs["tensors"].items():
            self.specs[name] = describe(name, tuple(entry["shape"]), entry["dtype"], self.config)

    def _array(self, name: str) -> ts.TensorStore:
        def open_array() -> ts.TensorStore:
            try:
                return _open(self.path / name, open=True)
            except ValueError as exc:
                raise ReshardError(f"{self.path / name}: array cannot be opened ({exc}); the store is damaged") from None

        return cached(self._arrays, name, open_array)

    def read_into(self, name: str, region: Region, out: torch.Tensor) -> None:
        """tensorstore decodes straight into `out` (wrapped without a copy), not into an array of its own."""
        if not out.is_contiguous():
            out.copy_(self.read(name, region))
            return
        spec = self.specs[name]
        index = to_slices(region) if spec.shape else ()
        dest = ts.array(_to_numpy(out.reshape([b - a for a, b in region] or [1]), spec.dtype), copy=False)
        try:
            dest.write(self._array(name)[index]).result()
        except ValueError as exc:
            raise ReshardError(f"{self.path / name}: {exc}") from None


class ZarrWriter(CheckpointWriter):
    format_name = "zarr"

    def __init__(self, *args: Any, rank: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.path.mkdir(parents=True, exist_ok=True)
        self._arrays: dict[str, ts.TensorStore] = {}

    def _array(self, spec: TensorSpec) -> ts.TensorStore:
        """Created on first write, so that in a multi-rank run each array is created by its one writer."""
        return cached(
            self._arrays,
            spec.name,
            lambda: _open(
                self.path / spec.name,
                create=True,
                delete_existing=True,  # an array left half-written by an interrupted run
                metadata={
                    "shape": list(spec.shape) or [1],
                    "data_type": _stored_dtype(spec.dtype),
                    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk_shape(spec)}},
                    "attributes": {"reshard_dtype": spec.dtype, "reshard_shape": list(spec.shape)},
                },
            ),
        )

    def write(self, spec: TensorSpec, slab: Region, data: torch.Tensor, pieces: list[Piece], prepared: Any = None) -> None:
        region = slab if spec.shape else ((0, 1),)
        values = _to_numpy(data.reshape([b - a for a, b in region]), spec.dtype)
        array = self._array(spec)
        for band in write_bands(region, chunk_shape(spec), values.itemsize):
            array[to_slices(band)].write(values[to_slices(shift(band, region))]).result()

    resumable = True

    def state(self) -> dict:
        return {}  # a finished tensor's array is complete; an unfinished one is recreated

    def restore(self, state: Any) -> None:
        pass

    def part(self) -> None:
        return None  # arrays are complete once written; the root attributes list every spec

    def finish(self, manifest: Manifest, parts: list[Any] | None = None) -> None:
        torch.save(
            {"args": self.common.args, "iteration": self.common.iteration, "extra": self.common.extra, "objects": self.common.objects},
            self.path / COMMON_FILE,
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
