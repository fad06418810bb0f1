"""HuggingFace format: a directory with config.json and *.safetensors (one file, or shards + index).

`HFReader` presents the canonical logical tensors of the model's family (`converters/`): a slab read
reads only that layer's (and expert's) HF tensors, with `pread` at the offsets the safetensors headers give.
A model of fp8 block-scaled weights (DeepSeek-V3's form, `reshard.fp8_blocks`) is read dequantized to float32,
one block row at a time; its scales never reach the logical view, and a conversion casts the values to
bfloat16 unless told another dtype.

`HFWriter` streams: every output tensor's name, shape and dtype is known before the first slab
arrives, so each shard's safetensors header is computed up front and slab data is written at its
offset; memory is bounded by a slab. Vocabulary padding is cut back to the true vocabulary, the dtype
is selectable (writer option `dtype`), tied models get no `lm_head`, and tokenizer files are copied
from the HF directory the model came from when it can be found. With `fp8_blocks` the decoder's linear
weights are re-quantized per block, each value held to the error bound of `reshard.fp8_blocks`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Iterator
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from reshard import fp8_blocks, int4_pack, mxfp4
from reshard.buffers import PerThread, copy
from reshard.checksum import HashedParts, TensorChecksum
from reshard.config import ModelConfig
from reshard.direct_io import ALIGN, DirectFile
from reshard.documents import read_json
from reshard.dtypes import itemsize, numpy_dtype
from reshard.errors import ReshardError
from reshard.formats.base import (
    MANIFEST_NAME,
    CheckpointReader,
    CheckpointWriter,
    CommonState,
    Manifest,
    StoredRecord,
    args_for_layout,
    cached,
    precision_args,
)
from reshard.layout import Layout
from reshard.logical import TensorSpec, describe, normalize_dtype
from reshard.paths import confined
from reshard.sharding import Piece, Region, full_region, intersect, region_size, shift, slab_of, slabs, to_slices
from reshard.torchfile.archive_reader import RecordFile, TensorRecord

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
    # a multimodal model's processor (Qwen2.5-VL's image and video preprocessing), carried as its tokenizer is
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    GENERATION_CONFIG,
)
# What a model's users load beside the weights: an export records each one's sha256 (provenance `hf_files`),
# and an upload refuses one that differs or that the export did not write.
RECORDED_FILES = (CONFIG, INDEX, *TOKENIZER_FILES)
DEFAULT_SHARD_BYTES = 5 * 1024**3
# What fp8 block export quantizes: every linear weight of the decoder layers (MLA's down and up projections and
# experts' too) and of an MTP layer (its eh_proj and decoder layer), as DeepSeek-V3 is released; never
# embeddings, the output layer, norms or the router.
FP8_LINEAR = re.compile(
    r"^((decoder|mtp)\.layers\..*\blinear_(qkv|proj|fc1|fc2|q_proj|q_down_proj|q_up_proj|kv_down_proj|kv_up_proj)"
    r"|mtp\.layers\.\d+\.eh_proj)\.weight$"
)
STAGE_BYTES = 64 << 20  # a larger tensor not placed for direct I/O goes through the page cache instead of a copy

_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def is_hf(path: Path) -> bool:
    return (path / CONFIG).is_file() and (any(path.glob("*.safetensors")) or (path / INDEX).is_file())


def model_files(directory: Path) -> list[Path]:
    """The safetensors files of the HF model in `directory`: those its index names (each checked to stay in the
    directory and to be there), or without an index every *.safetensors beside config.json."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = read_json(confined(directory, INDEX), name=str(index))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ReshardError(f"{index} is not a safetensors index (no weight_map of tensor -> file)") from None
        for name in names:
            if not isinstance(name, str) or not name.endswith(".safetensors"):
                raise ReshardError(f"{index} names {name!r}, not a safetensors file; refusing it")
        files = [confined(directory, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]  # False for a name too long, too
        if missing:
            raise ReshardError(f"{missing[0]} is missing: the model download is incomplete")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ReshardError(f"{directory} has no *.safetensors files (PyTorch .bin weights are not supported; re-save with safetensors)")
    return [confined(directory, f.name) for f in files]


def recorded_digests(directory: Path) -> dict[str, str]:
    """The sha256 of each of RECORDED_FILES the directory has."""
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in RECORDED_FILES if (directory / name).is_file()}


def copy_tokenizer(source: Path | None, destination: Path) -> list[str]:
    """Copy the tokenizer files (TOKENIZER_FILES) that `source` has into `destination`; the names copied. One
    that leads outside `source` (a symlink) is refused (`reshard.paths.confined`)."""
    copied = []
    for name in TOKENIZER_FILES if source is not None else ():
        if (source / name).is_file():
            shutil.copyfile(confined(source, name), destination / name)
            copied.append(name)
    return copied


# Every dtype the safetensors library knows, in bits per value (a file naming another is refused).
_ST_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
_ST_MAX_HEADER = 100_000_000  # the safetensors library's limit
_USIZE = 1 << 64


class _Pairs(list):
    """A JSON object as its (key, value) pairs, duplicates kept."""


def _bad(path: Path, why: str) -> ReshardError:
    return ReshardError(f"{path} is not a safetensors file ({why})")


def _usize(value: Any) -> bool:
    return type(value) is int and 0 <= value < _USIZE


def _check_strings(value: Any) -> None:
    """Refuse what the library's JSON parser refuses and Python's accepts: lone surrogates (`\\ud800`)."""
    if isinstance(value, str):
        value.encode("utf-8")
    elif isinstance(value, (list, tuple)):  # an object's (key, value) pairs too
        for item in value:
            _check_strings(item)


def _parse_header(path: Path, raw: bytes) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors header lists, by the rules of the safetensors library (its JSON and
    TensorInfo types): one object, `__metadata__` once and string to string, each tensor a known dtype, a shape
    and two offsets of unsigned integers; a repeated tensor name counts as its last entry, as there."""
    def constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    try:
        top = json.loads(raw.decode("utf-8"), object_pairs_hook=_Pairs, parse_constant=constant)
        _check_strings(top)
    except (UnicodeError, ValueError, RecursionError) as exc:
        raise _bad(path, f"its header is not JSON: {exc}") from None
    if not isinstance(top, _Pairs):
        raise _bad(path, "its header is not a JSON object")
    tensors: dict[str, dict[str, Any]] = {}
    metadata_seen = False
    for name, value in top:
        if name == "__metadata__":
            if metadata_seen:
                raise _bad(path, "__metadata__ appears twice")
            metadata_seen = True
            if value is not None and (not isinstance(value, _Pairs) or not all(isinstance(v, str) for _, v in value)):
                raise _bad(path, "__metadata__ is not a map of strings to strings")
            continue
        if not isinstance(value, _Pairs):
            raise _bad(path, f"tensor {name!r} is not described by an object")
        info: dict[str, Any] = {}
        for key, field in value:
            if key in ("dtype", "shape", "data_offsets"):
                if key in info:
                    raise _bad(path, f"tensor {name!r} gives {key} twice")
                info[key] = field
        if set(info) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"tensor {name!r} lacks {sorted({'dtype', 'shape', 'data_offsets'} - set(info))[0]}")
        offsets, shape = info["data_offsets"], info["shape"]
        if info["dtype"] not in _ST_BITS:
            raise _bad(path, f"tensor {name!r} has dtype {info['dtype']!r}, which safetensors does not know")
        if isinstance(shape, _Pairs) or not isinstance(shape, list) or not all(map(_usize, shape)):
            raise _bad(path, f"tensor {name!r} has shape {shape!r}, not a list of unsigned integers")
        if isinstance(offsets, _Pairs) or not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_usize, offsets)):
            raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r}, not two unsigned integers")
        tensors[name] = info
    return tensors


def _check_offsets(path: Path, tensors: dict[str, dict[str, Any]], data_bytes: int) -> None:
    """The tensors' byte ranges, in order, cover the data exactly once (no overlap, hole or trailing byte), each
    as long as its shape and dtype say."""
    end = 0
    for name, info in sorted(tensors.items(), key=lambda item: item[1]["data_offsets"]):
        begin, stop = info["data_offsets"]
        if begin != end or stop < begin:
            raise _bad(path, f"tensor {name!r} has data_offsets [{begin}, {stop}] where the previous tensor ends at {end}: "
                             "overlapping or with a hole")
        bits = math.prod(info["shape"]) * _ST_BITS[info["dtype"]]
        if math.prod(info["shape"]) >= _USIZE or bits >= _USIZE or bits % 8 or stop - begin != bits // 8:
            raise _bad(path, f"tensor {name!r} of shape {info['shape']} and dtype {info['dtype']} does not fill its "
                             f"{stop - begin} bytes")
        end = stop
    if end != data_bytes:
        raise ReshardError(f"{path} is truncated: the model download is incomplete" if end > data_bytes else
                           f"{path} is not a safetensors file ({data_bytes - end} bytes past its last tensor)")


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The tensors a safetensors file lists, and where its data starts, once the header is as valid as the
    safetensors library requires."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ReshardError(f"{path} is truncated (no safetensors header)")
        (size,) = struct.unpack("<Q", raw)
        if size > _ST_MAX_HEADER:
            raise ReshardError(f"{path} is not a safetensors file (header of {size} bytes)")
        raw = f.read(size)
        length = os.fstat(f.fileno()).st_size
    if len(raw) < size:
        raise ReshardError(f"{path} is truncated: the model download is incomplete")
    header = _parse_header(path, raw)
    _check_offsets(path, header, length - 8 - size)
    return header, 8 + size


def stacked_regions(spec: TensorSpec, slab: Region, shapes: list[tuple[int, ...]]) -> list[Region]:
    """The regions of `slab` that HF tensors of these shapes hold when the slab is them stacked by rows
    (`Mapping.stacks_rows`): where the writer vouches for each and where the reader finds it."""
    regions, row, inner = [], 0, len(slab) - spec.prefix_axes
    for shape in shapes:
        # a band of the slab's rows, or one row of it (a tensor's slice at a leading index: `HFAddress`; a scalar)
        rows, columns = (shape[0], shape[1:]) if len(shape) == inner else (1, shape)
        regions.append((*slab[: spec.prefix_axes], (row, row + rows), *((0, d) for d in columns)))
        row += rows
    return regions


def slice_runs(hf_names: list[str], regions: list[Region], axis: int) -> list[tuple[str, Region]]:
    """A slab's HF tensors (in stacking order, with their `stacked_regions`, stacked along `axis`: the spec's
    `prefix_axes`) as runs: consecutive slices of one fused tensor (`t[i]`, `t[i+1]`, ...) lie back to back in its
    file as in the slab, so each run is one record, read, written and vouched for at once (Gated DeltaNet's in_proj
    and conv1d are thousands of row slices per layer of a few KiB each: slice by slice, their fixed costs outweighed
    the bytes). Each run as its first tensor's name and the region of the slab it fills."""
    runs: list[tuple[str, Region]] = []
    last: HFAddress | None = None
    for name, region in zip(hf_names, regions):
        address = HFAddress.parse(name)
        if runs and last is not None and address.index is not None and (address.name, address.index) == (last.name, last.index + 1):
            first, joined = runs[-1]
            runs[-1] = (first, (*joined[:axis], (joined[axis][0], region[axis][1]), *joined[axis + 1 :]))
        else:
            runs.append((name, region))
        last = address
    return runs


_ADDRESS = re.compile(r"^(?P<name>.+)\[(?P<index>\d+)\]$")


@dataclass(frozen=True)
class HFAddress:
    """What a mapping names on the HF side: a whole tensor, or one slice of it along its leading axis
    (`name[index]`, `converters.base.at_index`), as transformers stores fused experts ([E, ...], one expert a
    slice). A slice of a C-order tensor at a leading index is itself one contiguous run: it is read and written
    where it lies, never with the rest of the tensor."""

    name: str
    index: int | None = None

    @classmethod
    def parse(cls, address: str) -> HFAddress:
        match = _ADDRESS.match(address)
        return cls(match["name"], int(match["index"])) if match else cls(address)

    def __str__(self) -> str:
        return self.name if self.index is None else f"{self.name}[{self.index}]"


@dataclass(frozen=True)
class _Stored:
    """Where one HF tensor lives, by its file's header."""

    file: Path
    st_dtype: str  # safetensors' name for it, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # of its data in the file

    @property
    def record(self) -> TensorRecord:
        """Where its values lie in its file (a safetensors tensor is one C-order run)."""
        return TensorRecord(_ST_DTYPES[self.st_dtype], self.shape, self.offset)

    def part(self, index: int, address: str) -> _Stored:
        """Its slice at `index` along the leading axis; one past its end is the config contradicting the file."""
        if not self.shape or index >= self.shape[0]:
            raise ReshardError(f"{address} is past tensor {HFAddress.parse(address).name} of shape {list(self.shape)}: "
                               "config.json does not match the weights")
        size = math.prod(self.shape[1:]) * _ST_BITS[self.st_dtype] // 8
        return _Stored(self.file, self.st_dtype, self.shape[1:], self.offset + index * size)


@dataclass(frozen=True)
class _Packed:
    """A quantized tensor stored as parts (`reshard.mxfp4`: blocks and scales; `reshard.int4_pack`: packed words and
    scales), or one leading slice of them (an expert of fused experts); read dequantized to float32."""

    name: str
    parts: tuple[_Stored, ...]
    names: tuple[str, ...]  # every stored tensor it takes (INT4's weight_shape too)
    shape: tuple[int, ...]  # dequantized
    group: int | None = None  # INT4: the columns a scale covers; None: MXFP4
    st_dtype = "F32"  # as read

    def part(self, index: int, address: str) -> _Packed:
        return _Packed(self.name, tuple(p.part(index, address) for p in self.parts), self.names, self.shape[1:], self.group)

    def values(self, parts: list[np.ndarray]) -> np.ndarray:
        if self.group is None:
            return mxfp4.dequantize(*parts, self.name)
        return int4_pack.dequantize(*parts, self.shape[-1], self.group, self.name)


def hf_tensors(
    specs: dict[str, TensorSpec], mappings: dict[str, Any], config: ModelConfig
) -> Iterator[tuple[str, TensorSpec, int | None, str, tuple[int, ...]]]:
    """(Megatron name, its spec, layer, HF name, HF shape) of every HF tensor of the model; a vocabulary
    tensor has the true vocabulary's rows."""
    for name, spec in specs.items():
        mapping = mappings[name]
        slab_shape = list(spec.shape[spec.prefix_axes :])
        if spec.vocab:
            slab_shape[0] = config.vocab_rows
        shapes = mapping.hf_shapes(slab_shape, config)
        for layer in range(spec.shape[0]) if spec.stacked else [None]:
            for expert in range(spec.shape[int(spec.stacked)]) if spec.experts else [None]:
                for hf_name, shape in zip(mapping.hf_names(layer, expert), shapes):
                    yield name, spec, layer, hf_name, tuple(shape)


def whole_tensors(tensors: Iterator[tuple[str, TensorSpec, int | None, str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of each whole HF tensor of `hf_tensors`: a tensor named by its slices (`HFAddress`) once,
    as [slices, *slice shape], its slices numbered from 0 without a gap, each of one shape."""
    whole: dict[str, tuple[int, ...]] = {}
    parts: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
    for *_, hf_name, shape in tensors:
        address = HFAddress.parse(hf_name)
        if address.index is None:
            whole[hf_name] = shape
        else:
            whole.setdefault(address.name, ())
            parts.setdefault(address.name, []).append((address.index, shape))
    for name, slices in parts.items():
        if sorted(index for index, _ in slices) != list(range(len(slices))) or len({shape for _, shape in slices}) != 1:
            raise ReshardError(f"internal: the slices of HF tensor {name} are not numbered 0.. of one shape")
        whole[name] = (len(slices), *slices[0][1])
    return list(whole.items())


class HFReader(CheckpointReader):
    format_name = "hf"

    def __init__(self, path: Path):
        from reshard.architecture import model_tensors
        from reshard.converters import family_for_hf

        self.path = self.tokenizer_dir = Path(path)
        if not (self.path / CONFIG).is_file():
            raise ReshardError(f"{self.path} has no config.json: not a HuggingFace model directory")
        self.hf_config = read_json(confined(self.path, CONFIG), name=str(self.path / CONFIG))
        self.family = family_for_hf(self.hf_config)
        try:
            config, extras = self.family.config_from_hf(self.hf_config)
        except KeyError as exc:
            raise ReshardError(f"{self.path / CONFIG} lacks {exc.args[0]!r}, which a {self.family.model_type} config needs") from None
        self.layout = Layout()
        if (self.path / MANIFEST_NAME).exists():
            confined(self.path, MANIFEST_NAME)
        self.manifest = Manifest.load(self.path)
        self._stored = self._locate_tensors()
        self._handles: dict[Path, RecordFile] = {}
        quantization = self.hf_config.get("quantization_config")
        packs = mxfp4.is_config(quantization) or int4_pack.is_config(quantization)
        self._block = fp8_blocks.block_size(quantization) if quantization and not packs else None
        self._scales = self._pair_scales()  # quantized weight -> its scales, by their names in the files
        # MXFP4 or INT4 tensor -> its parts
        self._packed = self._pair_mxfp4() if mxfp4.is_config(quantization) else self._pair_int4(quantization) if packs else {}
        self._rows = PerThread()  # a block row of float8 values being dequantized
        # Told no dtype, a conversion writes bf16: DeepSeek-V3's and gpt-oss's unquantized tensors are, and they run in it.
        self.default_dtype = "bfloat16" if self._scales or self._packed else None
        self._alias = self._aliases()
        self.family, config, absent = self.family.for_files(config, {*self._stored, *self._packed, *self._alias})
        self._check_vocab_rows(config)
        self._mappings = {m.megatron: m for m in self.family.mappings(config)}
        shapes = model_tensors(config)
        if set(shapes) != set(self._mappings):
            raise ReshardError(
                f"internal: {self.family.model_type} mappings do not cover the model's tensors "
                f"(missing {sorted(set(shapes) - set(self._mappings))[:3]}, extra {sorted(set(self._mappings) - set(shapes))[:3]})"
            )
        dtypes, dropped = self._dtypes(config)
        if not self.hf_config.get("dtype") and not self.hf_config.get("torch_dtype"):
            config = config.replace(params_dtype=dtypes[config.language_model_prefix + "embedding.word_embeddings.weight"])
        self.config = config
        self.specs: dict[str, TensorSpec] = {name: describe(name, shape, dtypes[name], config) for name, shape in shapes.items()}
        # Every tensor at the shape config.json implies: values are read at offsets computed from it.
        for hf_name, shape in whole_tensors(hf_tensors(self.specs, self._mappings, config)):
            if (stored := self._shape(hf_name)) != shape:
                from reshard.converters.base import hf_axis_fields

                raise ReshardError(
                    f"{hf_name} has shape {list(stored)} but config.json implies {list(shape)} (check "
                    f"{hf_axis_fields(hf_name, tuple(stored), tuple(shape))}): config.json does not match the weights"
                )
        self.common = CommonState(args=self._args(config, extras), iteration="release", extra={"checkpoint_version": 3.0},
                                  dropped=absent + dropped)

    def _locate_tensors(self) -> dict[str, _Stored]:
        """Where each HF tensor lives, from the index or the file headers; a name in two files is refused."""
        stored: dict[str, _Stored] = {}
        for file in model_files(self.path):
            header, start = _read_header(file)
            for name, info in header.items():
                if name in stored:
                    raise ReshardError(f"tensor {name} is in both {stored[name].file.name} and {file.name}")
                stored[name] = _Stored(file, info["dtype"], tuple(info["shape"]), start + info["data_offsets"][0])
        return stored

    def _aliases(self) -> dict[str, str]:
        """Canonical HF name -> name in the files, where they differ (old GPT-2 keys lack "transformer.")."""
        prefix = self.family.prefix
        return {prefix + name: name for name in self._stored
                if not name.startswith(prefix) and name != "lm_head.weight" and prefix + name not in self._stored}

    def _check_vocab_rows(self, config: ModelConfig) -> None:
        """The embedding has the rows config.json's vocab_size says (they are read at offsets computed from it)."""
        emb = {m.megatron: m for m in self.family.mappings(config)}[config.language_model_prefix + "embedding.word_embeddings.weight"]
        shape = self._shape(emb.hf_names()[0])
        if len(shape) != 2:
            raise ReshardError(f"{emb.hf_names()[0]} has shape {list(shape)}, not [rows, columns]: it is no embedding")
        if shape[0] != config.vocab_size:
            raise ReshardError(
                f"config.json says vocab_size={config.vocab_size} but {emb.hf_names()[0]} has {shape[0]} rows: fix config.json"
            )

    def _dtypes(self, config: ModelConfig) -> tuple[dict[str, str], list[str]]:
        """The dtype of each logical tensor (one floating-point dtype for all its HF tensors; fp8 read as float32),
        and the stored tensors no mapping uses that the family drops by design; any other is refused."""
        used: set[str] = set()
        dtypes: dict[str, str] = {}
        for name, mapping in self._mappings.items():
            # only a stacked tensor ("decoder.layers.<param>") has a slab per layer: a layer's own ("decoder.layers.3.<param>")
            # names its HF tensors already, and looping every layer for it made opening a model quadratic in its layers
            language = config.language_name(name)
            stacked = language.startswith("decoder.layers.") and not language.split(".")[2].isdigit()
            layers = range(config.num_layers) if stacked else [None] if language.startswith("decoder.layers.") else config.tower_blocks(name)
            experts = range(config.num_experts or 0) if ".experts.experts." in name else [None]
            kinds = set()
            for layer in layers:
                for expert in experts:
                    for hf_name in mapping.hf_names(layer, expert):
                        base = HFAddress.parse(hf_name).name
                        stored = self._alias.get(base, base)
                        kinds.add(self._stored_as(hf_name).st_dtype)
                        used.update([stored, fp8_blocks.scale_name(stored)] if stored in self._scales else
                                    self._packed[stored].names if stored in self._packed else [stored])
            if len(kinds) != 1 or next(iter(kinds)) not in ("F32", "BF16", "F16", "F8_E4M3"):
                raise ReshardError(f"{name}: HF tensors have dtypes {sorted(kinds)}; expected one floating-point dtype")
            dtypes[name] = "float32" if kinds == {"F8_E4M3"} else _ST_DTYPES[next(iter(kinds))]  # fp8: dequantized
        dropped = []
        for name in sorted(n for n in self._stored if n not in used):
            if self.family.is_ignored(name) or (name == "lm_head.weight" and config.tied_embeddings):
                dropped.append(name)
            else:
                raise ReshardError(
                    f"{self.path}: tensor {name} is not mapped by the {self.family.model_type} converter; "
                    "refusing to drop weights silently (is config.json right for these weights?)"
                )
        return dtypes, dropped

    def _args(self, config: ModelConfig, extras: dict[str, Any]) -> dict[str, Any]:
        """The Megatron arguments of the model, with where it came from (its tokenizer, its HF config)."""
        args = dict(config.megatron_args())
        args.update(extras)
        args.update(
            vocab_size=config.vocab_size,
            padded_vocab_size=config.padded_vocab_size,
            make_vocab_size_divisible_by=128,
            **precision_args(config.params_dtype),
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=str(self.path.resolve()),
            hf_model_type=self.family.model_type,
            **({"hf_form": form} if (form := self.family.files_form()) else {}),
            hf_architecture=self.family.architectures[0],
            hf_config=self.hf_config,
            hf_source=str(self.path.resolve()),
        )
        return args_for_layout(args, self.layout, config, "hf")

    def _pair_scales(self) -> dict[str, str]:
        """Each float8 weight's scales (`fp8_blocks.scale_name`), found and checked against the weight's shape;
        a weight without them, scales without their weight or of another shape are refused naming the tensor."""
        scales = {}
        for name, stored in self._stored.items():
            if stored.st_dtype.startswith("F8_") and stored.st_dtype != "F8_E4M3":
                raise ReshardError(f"{self.path}: tensor {name} is {stored.st_dtype}; reshard reads float8_e4m3fn (F8_E4M3) weights only")
            if stored.st_dtype == "F8_E4M3":
                if self._block is None:
                    raise ReshardError(f"{self.path}: tensor {name} is float8 but config.json has no quantization_config to scale it")
                scale = self._stored.get(fp8_blocks.scale_name(name))
                if scale is None:
                    raise ReshardError(f"{self.path}: tensor {name} is float8 without its scales {fp8_blocks.scale_name(name)}")
                if len(stored.shape) != 2:
                    raise ReshardError(f"{self.path}: tensor {name} is float8 of shape {list(stored.shape)}; only 2-D weights are block-scaled")
                want = fp8_blocks.scale_shape(stored.shape, self._block)
                if scale.shape != want or scale.st_dtype != "F32":
                    raise ReshardError(
                        f"{self.path}: tensor {fp8_blocks.scale_name(name)} is {scale.st_dtype} {list(scale.shape)}, but {name} "
                        f"{list(stored.shape)} in blocks of {list(self._block)} needs F32 {list(want)}"
                    )
                scales[name] = fp8_blocks.scale_name(name)
        for name in self._stored:
            if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") not in scales:
                raise ReshardError(f"{self.path}: tensor {name} scales no float8 weight {name.removesuffix('_scale_inv')}")
        return scales

    def _pair_mxfp4(self) -> dict[str, _Packed]:
        """Each MXFP4 tensor of the files (`reshard.mxfp4`: `name_blocks` and `name_scales`, uint8, of shapes that
        pair); blocks without their scales, scales without their blocks, or either of another dtype refused naming it."""
        mxfp4.check_config(self.hf_config["quantization_config"])
        packed = {}
        for name, stored in self._stored.items():
            for suffix, other in ((mxfp4.BLOCKS, mxfp4.SCALES), (mxfp4.SCALES, mxfp4.BLOCKS)):
                base = name.removesuffix(suffix)
                if base == name:
                    continue
                if (pair := self._stored.get(base + other)) is None:
                    raise ReshardError(f"{self.path}: MXFP4 tensor {name} is without its {base + other}")
                if stored.st_dtype != "U8":
                    raise ReshardError(f"{self.path}: MXFP4 tensor {name} is {stored.st_dtype}, not U8")
                if suffix == mxfp4.BLOCKS:  # its shape refuses blocks and scales that do not pair
                    packed[base] = _Packed(base, (stored, pair), (name, base + other), mxfp4.shape(base, stored.shape, pair.shape))
        return packed

    def _pair_int4(self, quantization: dict[str, Any]) -> dict[str, _Packed]:
        """Each INT4 pack-quantized weight of the files (`reshard.int4_pack`: `X.weight_packed` int32, `X.weight_scale`,
        `X.weight_shape`, fitting each other); a part without the others, or of another dtype, refused naming it."""
        group = int4_pack.group_size(quantization)
        packed = {}
        for name in self._stored:
            suffix = next((s for s in (int4_pack.PACKED, int4_pack.SCALE, int4_pack.SHAPE) if name.endswith(s)), None)
            if suffix is None:
                continue
            weight = name.removesuffix(suffix) + ".weight"
            names = int4_pack.stored_names(weight)
            parts = [self._stored.get(part) for part in names]
            if None in parts:
                raise ReshardError(f"{self.path}: INT4 tensor {name} is without its {names[parts.index(None)]}")
            for part, where, dtypes in zip(names, parts, (("I32",), ("BF16", "F16", "F32"), ("I32", "I64"))):
                if where.st_dtype not in dtypes:
                    raise ReshardError(f"{self.path}: INT4 tensor {part} is {where.st_dtype}, not {' or '.join(dtypes)}")
            if suffix != int4_pack.PACKED:
                continue
            file = cached(self._handles, parts[2].file, lambda where=parts[2]: RecordFile(where.file))
            stated = np.empty(parts[2].shape, numpy_dtype(_ST_DTYPES[parts[2].st_dtype]))
            file.read_into(parts[2].record, full_region(parts[2].shape), stated)
            dims = int4_pack.shape(weight, parts[0].shape, parts[1].shape, stated, group)
            packed[weight] = _Packed(weight, tuple(parts[:2]), names, dims, group)
        return packed

    # -- files ------------------------------------------------------------------------------------
    def _stored_as(self, hf_name: str) -> _Stored | _Packed:
        address = HFAddress.parse(hf_name)
        stored = self._stored.get(self._alias.get(address.name, address.name)) or self._packed.get(address.name)
        if stored is None:
            raise ReshardError(f"{self.path}: tensor {address.name} is missing; the checkpoint is incomplete or config.json does not match it")
        return stored if address.index is None else stored.part(address.index, hf_name)

    def _shape(self, hf_name: str) -> tuple[int, ...]:
        return self._stored_as(hf_name).shape

    def _record(self, hf_name: str) -> tuple[RecordFile, TensorRecord]:
        """The file holding an HF tensor and where its values lie (a safetensors tensor is one C-order run)."""
        stored = self._stored_as(hf_name)
        file = cached(self._handles, stored.file, lambda: RecordFile(stored.file))
        return file, stored.record

    def _tensor(self, hf_name: str) -> np.ndarray:
        shape = self._shape(hf_name)
        quantized = self._alias.get(hf_name, hf_name) in self._scales
        out = np.empty(shape, dtype=np.float32 if quantized else numpy_dtype(_ST_DTYPES[self._stored_as(hf_name).st_dtype]))
        self._read(hf_name, full_region(shape), out)
        return out

    def _read(self, hf_name: str, region: Region, out: np.ndarray) -> None:
        """`region` of an HF tensor into `out`: as stored, a float8 weight dequantized to float32, read a block
        row at a time, or an MXFP4 one (or one slice of it: an expert) dequantized whole."""
        if isinstance(packed := self._stored_as(hf_name), _Packed):
            stored = []
            for where in packed.parts:
                file = cached(self._handles, where.file, lambda where=where: RecordFile(where.file))
                stored.append(np.empty(where.shape, numpy_dtype(_ST_DTYPES[where.st_dtype])))
                file.read_into(where.record, full_region(where.shape), stored[-1])
            copy(out, packed.values(stored)[tuple(slice(a, b) for a, b in region)])
            return
        file, record = self._record(hf_name)
        scales = self._scales.get(self._alias.get(hf_name, hf_name))
        if scales is None:
            file.read_into(record, region, out)
            return
        grid = self._tensor(scales)
        fp8_blocks.check_scales(grid, scales)
        (r0, r1), (c0, c1) = region
        for rows in fp8_blocks.block_rows(r1 - r0, self._block, r0):
            values = self._rows.array([rows.stop - rows.start, c1 - c0], fp8_blocks.FP8)
            file.read_into(record, ((r0 + rows.start, r0 + rows.stop), (c0, c1)), values)
            fp8_blocks.dequantize(values, grid, self._block, (r0 + rows.start, c0), out=out[rows])
            fp8_blocks.check_finite(out[rows], hf_name, (r0 + rows.start, c0))

    def close(self) -> None:
        for file in self._handles.values():
            file.close()
        self._handles.clear()

    # -- logical reads ----------------------------------------------------------------------------
    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        spec = self.specs[name]
        mapping = self._mappings[name]
        prefix = spec.prefix_axes
        inner = region[prefix:]
        layers = range(*region[0]) if spec.stacked else [None]
        experts = range(*region[int(spec.stacked)]) if spec.experts else [None]
        for li, layer in enumerate(layers):
            for ei, expert in enumerate(experts):
                index = tuple(i for i, present in ((li, spec.stacked), (ei, spec.experts)) if present)
                if spec.vocab:
                    self._vocab_rows_into(mapping, inner, out[index])
                    continue
                hf_names = mapping.hf_names(layer, expert)
                if mapping.stacks_rows and len(hf_names) > 1 and self._stacked_rows_into(spec, hf_names, inner, out[index]):
                    continue
                value = mapping.to_megatron([self._tensor(n) for n in hf_names], self.config)
                if tuple(value.shape) != spec.shape[prefix:]:
                    raise ReshardError(f"{name}: HF tensors give shape {tuple(value.shape)}, expected {spec.shape[prefix:]}")
                copy(out[index], value[tuple(slice(a, b) for a, b in inner)])

    def _stacked_rows_into(self, spec: TensorSpec, hf_names: list[str], inner: Region, out: np.ndarray) -> bool:
        """Region `inner` of a row-stacking slab (`stacks_rows`) read run by run (`slice_runs`) straight from the
        files into `out`; False, reading nothing, where a tensor is stored quantized (its values are not its bytes)."""
        stored = self._stored_plain(hf_names)
        if stored is None:
            return False
        slab = full_region(spec.shape)  # its prefix axes (layer, expert) are not looked at here
        runs = self._runs(spec, slab, hf_names, stored)
        if sum(region_size(region[spec.prefix_axes :]) for _, region in runs) != region_size(slab[spec.prefix_axes :]):
            raise ReshardError(f"{spec.name}: HF tensors {hf_names[0]}, ... do not make its shape {spec.shape[spec.prefix_axes:]}")
        for first, region in runs:
            whole = region[spec.prefix_axes :]
            part = intersect(whole, inner)
            if part is not None:
                file = cached(self._handles, first.file, lambda where=first: RecordFile(where.file))
                record = TensorRecord(first.record.dtype, tuple(b - a for a, b in whole), first.offset)
                file.read_into(record, shift(part, whole), out[to_slices(shift(part, inner))])
        return True

    def stored_records(self, name: str) -> list[StoredRecord] | None:
        """Where each HF tensor of a row-stacking mapping (`stacks_rows`) lies, by the safetensors headers;
        None for tensors whose HF form moves values around (QKV, transposed)."""
        spec, mapping = self.specs[name], self._mappings[name]
        if not mapping.stacks_rows:
            return None
        records = []
        for slab in slabs(spec):
            layer, expert = slab_of(spec, slab)
            hf_names = mapping.hf_names(layer, expert)
            stored = self._stored_plain(hf_names)
            if stored is None:
                return None
            for first, region in self._runs(spec, slab, hf_names, stored):
                records.append(StoredRecord(name, region, first.record.dtype, first.file.name, first.offset))
        return records

    def _stored_plain(self, hf_names: list[str]) -> list[_Stored] | None:
        """Where each of `hf_names` is stored; None where one is quantized (its dequantized values are not its bytes)."""
        stored = [self._stored_as(hf_name) for hf_name in hf_names]
        return None if any(isinstance(s, _Packed) or s.st_dtype == "F8_E4M3" for s in stored) else stored

    def _runs(self, spec: TensorSpec, slab: Region, hf_names: list[str], stored: list[_Stored]) -> list[tuple[_Stored, Region]]:
        """A row-stacking slab's HF tensors as `slice_runs`, each with where its first tensor lies (the same records
        the writer vouches for, so that a verification finds them)."""
        at = dict(zip(hf_names, stored))
        regions = stacked_regions(spec, slab, [s.shape for s in stored])
        return [(at[first], region) for first, region in slice_runs(hf_names, regions, spec.prefix_axes)]

    def _vocab_rows_into(self, mapping, inner: Region, out: np.ndarray) -> None:
        """Rows of an embedding/output layer region, read from the file straight into `out`;
        rows past the HF vocabulary are padding (zeros)."""
        (r0, r1), cols = inner[0], inner[1:]
        hf_name, *copies = mapping.hf_names()
        rows = max(0, min(r1, self._shape(hf_name)[0]) - r0)
        if rows:
            self._read(hf_name, ((r0, r0 + rows), *cols), out[:rows])
            twins = [np.empty_like(out[:rows]) for _ in copies]  # the same rows stored again (DeepSeek-V3's MTP layers)
            for name, twin in zip(copies, twins):
                self._read(name, ((r0, r0 + rows), *cols), twin)
            if twins:
                mapping.to_megatron([out[:rows], *twins], self.config)  # refuses copies that differ
        out[rows:] = 0


@dataclass
class _Entry:
    """One HF tensor of the output: where its bytes go and whether they arrived."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: int
    offset: int  # absolute, in the file
    nbytes: int
    written: bool = False


class HFWriter(CheckpointWriter):
    format_name = "hf"

    def __init__(self, *args: Any, **kwargs: Any):
        """As every writer; `options.te_names` means nothing here (so --naming never breaks an export), and each
        rank of a multi-rank export writes the same headers, and its tensors where they go."""
        from reshard.converters import family_for_model
        from reshard.converters.base import FusedQKV, Transposed

        super().__init__(*args, **kwargs)
        config, specs, common, options = self.config, self.specs, self.common, self.options
        optimizer = [n for n, s in specs.items() if s.is_optimizer]
        if optimizer:
            raise ReshardError(f"the HF format holds no optimizer state ({optimizer[0]}, ...); pass --no-optimizer")
        self.family = family_for_model(config, common.args)
        self.dtype = normalize_dtype(options.dtype) if options.dtype else None
        saved = common.args.get("hf_config") if isinstance(common.args.get("hf_config"), dict) else None
        self.hf_config = self.family.config_to_hf(config, saved, common.args)
        self.hf_config.pop("quantization_config", None)  # the weights are written unquantized unless below
        self._mappings = {m.megatron: m for m in self.family.mappings(config)}
        self._block = None  # of fp8 blocks, when written
        self._quantized: set[str] = set()  # tensors written quantized: as fp8 blocks, or (no `_block`) as MXFP4
        if options.mxfp4:
            self._quantized = self._mxfp4_tensors(saved)
        if options.fp8_blocks:
            source = (saved or {}).get("quantization_config")  # an fp8 model's own blocks, for its bytes back
            source = source if isinstance(source, dict) and source.get("quant_method") == "fp8" else None  # not MXFP4's, INT4's
            self._block = fp8_blocks.block_size(source) if source else fp8_blocks.DEFAULT_BLOCK
            self._quantized = {name for name in self._mappings if FP8_LINEAR.match(name)}
            written = tuple(hf for name in self._quantized for hf in self._mappings[name].hf)
            self.hf_config["quantization_config"] = fp8_blocks.hf_config(self._block, source, written)
            for name in self._quantized:
                mapping = self._mappings[name]
                if isinstance(mapping, Transposed) or (isinstance(mapping, FusedQKV) and mapping.conv1d):
                    raise ReshardError(f"HF {self.family.model_type} stores {name} as a Conv1D weight ([in, out]), which "
                                       "fp8 blocks do not scale; export it without --to-fp8-blocks")
        if set(self._mappings) != set(specs):
            missing = sorted(set(self._mappings) - set(specs))
            extra = sorted(set(specs) - set(self._mappings))
            raise ReshardError(
                f"the checkpoint's tensors do not match an HF {self.family.model_type} model "
                f"(missing {missing[:3]}, unmapped {extra[:3]}); it cannot be exported without losing weights"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, _Entry] = {}  # by HF name, and by the address of each slice of a fused tensor
        self._slices: dict[str, dict[str, int]] = {}  # fused HF tensor -> its slices' addresses -> their index
        self._scratch = PerThread()  # stages the tensors that cannot be written from where they are
        self._plan_files(options.max_shard_bytes or DEFAULT_SHARD_BYTES)
        self._unwritten = {fused: len(parts) for fused, parts in self._slices.items()}  # slices not yet written (`_mark`)

    def _mxfp4_tensors(self, saved: dict[str, Any] | None) -> set[str]:
        """The Megatron tensors the family's MXFP4 release quantizes (refused for a family not released so), and
        config.json's quantization_config: the source's where it was MXFP4, else the release's."""
        if not self.family.mxfp4_tensors:
            raise ReshardError(f"HF {self.family.model_type} is not released in MXFP4 (gpt-oss is): export it without --to-mxfp4")
        source = (saved or {}).get("quantization_config")
        self.hf_config["quantization_config"] = deepcopy(source) if mxfp4.is_config(source) else {
            "quant_method": mxfp4.METHOD, "modules_to_not_convert": list(self.family.mxfp4_unconverted)}
        return {name for name, mapping in self._mappings.items()
                if any(HFAddress.parse(hf).name.endswith(self.family.mxfp4_tensors) for hf in mapping.hf_names(0, 0))}

    def _packed_names(self, hf_name: str) -> tuple[str, str]:
        """The MXFP4 blocks and scales of HF tensor (or slice) `hf_name`, as the writer addresses them."""
        address = HFAddress.parse(hf_name)
        blocks, scales = mxfp4.stored_names(address.name)
        return (blocks, scales) if address.index is None else (str(HFAddress(blocks, address.index)), str(HFAddress(scales, address.index)))

    # -- planning ---------------------------------------------------------------------------------
    def _out_dtype(self, spec: TensorSpec) -> str:
        return self.dtype or spec.dtype

    def _all_tensors(self) -> list[tuple[tuple, str, tuple[int, ...], str]]:
        """(sort key, HF name, shape, dtype) of every output tensor, in HF's usual order (by layer); a tensor written
        by its slices (`HFAddress`) once, whole, each slice's place noted in `_slices`."""
        out = []
        for name, spec, layer, hf_name, shape in hf_tensors(self.specs, self._mappings, self.config):
            group = 0 if self.config.language_name(name).startswith("embedding.") else (2 if not spec.stacked else 1)
            key = (group, layer if layer is not None else -1, hf_name)
            address = HFAddress.parse(hf_name)
            if name in self._quantized and not self._block:  # MXFP4: blocks and scales, each whole or by slices
                for packed, packed_shape in zip(self._packed_names(hf_name), mxfp4.packed_shapes(hf_name, shape)):
                    whole = HFAddress.parse(packed)
                    if whole.index is None:
                        out.append(((*key[:2], packed), packed, packed_shape, "uint8"))
                        continue
                    slices = self._slices.setdefault(whole.name, {})
                    if not slices:
                        out.append(((*key[:2], whole.name), whole.name, packed_shape, "uint8"))
                    slices[packed] = whole.index
                continue
            if address.index is not None:
                if name in self._quantized:
                    raise ReshardError(f"HF {self.family.model_type} stores {name} fused with other experts ({address.name}), "
                                       "which fp8 blocks do not scale; export it without --to-fp8-blocks")
                slices = self._slices.setdefault(address.name, {})
                if not slices:
                    out.append(((*key[:2], address.name), address.name, shape, self._out_dtype(spec)))
                slices[hf_name] = address.index
                continue
            if name in self._quantized:  # the float8 weight, its scales after it
                out.append((key, hf_name, shape, "float8_e4m3fn"))
                scales = fp8_blocks.scale_name(hf_name)
                out.append(((*key[:2], scales), scales, fp8_blocks.scale_shape(shape, self._block), "float32"))
            else:
                out.append((key, hf_name, shape, self._out_dtype(spec)))
        out.sort(key=lambda t: t[0])
        return [(key, name, (len(self._slices[name]), *shape) if name in self._slices else shape, dtype)
                for key, name, shape, dtype in out]

    def _plan_files(self, max_shard_size: int) -> None:
        shards: list[list[tuple[str, tuple[int, ...], str, int]]] = [[]]
        size = 0
        for _, name, shape, dtype in self._all_tensors():
            nbytes = math.prod(shape) * itemsize(dtype)
            if shards[-1] and size + nbytes > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append((name, shape, dtype, nbytes))
            size += nbytes
        n = len(shards)
        self._file_names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._files: list[DirectFile] = []
        for index, (file_name, tensors) in enumerate(zip(self._file_names, shards)):
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name, shape, dtype, nbytes in tensors:
                header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-(8 + len(raw)) % ALIGN)  # data starts on a page (safetensors pads to 8 with spaces too)
            start = 8 + len(raw)
            # Not truncated on opening: every rank of a multi-rank export, and a resumed one, writes the same
            # header and sets the same length, around tensors other ranks or the earlier run may have written.
            f = DirectFile(self.path / file_name, os.O_RDWR | os.O_CREAT)
            f.pwrite(struct.pack("<Q", len(raw)) + raw, 0)
            os.ftruncate(f.fd, start + offset)
            self._files.append(f)
            for name, shape, dtype, nbytes in tensors:
                begin = header[name]["data_offsets"][0]
                self._entries[name] = _Entry(name, tuple(shape), dtype, index, start + begin, nbytes)
                for address, i in self._slices.get(name, {}).items():  # one contiguous run each
                    size = nbytes // shape[0]
                    self._entries[address] = _Entry(address, tuple(shape[1:]), dtype, index, start + begin + i * size, size)

    # -- streaming --------------------------------------------------------------------------------
    def prepare(
        self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], reserved: Any = None, hashed: HashedParts | None = None
    ) -> None:
        """Write the slab's HF tensors at their offsets from this reader thread: a tensor that is strided,
        cast, or (up to STAGE_BYTES) not as far past a page as its offset is staged first, so that its
        middle goes to the disk directly. A slab that is its HF tensors stacked row-wise (`stacks_rows`)
        has each kept with the checksum of its bytes as written."""
        mapping = self._mappings[spec.name]
        layer, expert = slab_of(spec, slab)
        value = data.reshape(data.shape[spec.prefix_axes :]) if spec.prefix_axes else data
        if spec.vocab:
            value = value[: self.config.vocab_rows]  # the padding never reaches HF
        hf_names = mapping.hf_names(layer, expert)
        if spec.name in self._quantized:
            return self._quantize(spec, slab, hf_names, mapping.to_hf(value, self.config))
        tensors = mapping.to_hf(value, self.config)
        for hf_name, tensor in zip(hf_names, tensors):
            if tensor.shape != self._entries[hf_name].shape:
                raise ReshardError(f"{hf_name}: got shape {tensor.shape}, expected {self._entries[hf_name].shape}")
        if mapping.stacks_rows:
            regions = stacked_regions(spec, slab, [self._entries[hf_name].shape for hf_name in hf_names])
            runs = self._runs(spec, value, hf_names, tensors, regions)
        else:
            runs = [(hf_name, tensor, None) for hf_name, tensor in zip(hf_names, tensors)]
        for hf_name, tensor, region in runs:
            entry = self._entries[hf_name]
            out = tensor
            aligned = tensor.ctypes.data % ALIGN == entry.offset % ALIGN
            if tensor.dtype != numpy_dtype(entry.dtype) or not tensor.flags.c_contiguous or (not aligned and tensor.nbytes <= STAGE_BYTES):
                out = self._scratch.scratch.array_for(entry.offset, tensor.shape, numpy_dtype(entry.dtype))
                copy(out, tensor)
            self._files[entry.file].pwrite(out.reshape(-1).view(np.uint8), entry.offset)
            if region is not None:
                self.vouch(spec, region, self._file_names[entry.file], entry.offset, out.reshape([b - a for a, b in region]), hashed)

    @staticmethod
    def _runs(spec: TensorSpec, value: np.ndarray, hf_names: list[str], tensors: list[np.ndarray],
              regions: list[Region]) -> list[tuple[str, np.ndarray, Region]]:
        """What to write of a row-stacking slab: each run of slices (`slice_runs`) at once, from the slab's memory
        where `to_hf` gave them there back to back (as its rows, untouched), else each HF tensor on its own: what is
        written is always what `to_hf` gave, so a mapping that changed the values is still caught by its checksum."""
        first = {name: j for j, name in enumerate(hf_names)}
        runs = slice_runs(hf_names, regions, spec.prefix_axes)
        ends = [first[name] for name, _ in runs[1:]] + [len(hf_names)]
        out = []
        for (name, region), end in zip(runs, ends):
            j = first[name]
            joined = value[to_slices(region[spec.prefix_axes :])]
            at = joined.ctypes.data
            for tensor in tensors[j:end]:
                at = at + tensor.nbytes if tensor.flags.c_contiguous and tensor.ctypes.data == at and tensor.dtype == joined.dtype else -1
            if end - j > 1 and joined.flags.c_contiguous and at == joined.ctypes.data + joined.nbytes:
                out.append((name, joined, region))
            else:
                out.extend(zip(hf_names[j:end], tensors[j:end], regions[j:end]))
        return out

    def _quantize(self, spec: TensorSpec, slab: Region, hf_names: list[str], tensors: list[np.ndarray]) -> TensorChecksum:
        """Write a slab's HF weights as float8 blocks and their scales, each value first held to the error bound;
        the checksum of the slab as the output holds it (dequantized, as its reader gives it), hashed weight by
        weight where the slab is its weights stacked (`stacks_rows`), else regrouped as the reader does."""
        mapping = self._mappings[spec.name]
        checksum = TensorChecksum(spec.shape, "float32")
        regions = stacked_regions(spec, slab, [t.shape for t in tensors])
        held = []
        for hf_name, tensor, region in zip(hf_names, tensors, regions):
            dequantized = self._write_quantized(hf_name, tensor)
            if mapping.stacks_rows:
                checksum.add(region, dequantized.reshape([b - a for a, b in region]))
            else:
                held.append(dequantized)
        if held:
            checksum.add(slab, mapping.to_megatron(held, self.config).reshape([b - a for a, b in slab]))
        return checksum

    def _write_quantized(self, hf_name: str, tensor: np.ndarray) -> np.ndarray:
        """Write HF weight `hf_name` as fp8 blocks and their scales, or as MXFP4 blocks and scales; the float32 values
        it then holds, each checked within the error bound."""
        if self._block:
            values, scales = fp8_blocks.quantize(tensor, self._block, hf_name)
            stored = zip((hf_name, fp8_blocks.scale_name(hf_name)), (values, scales))
        else:
            blocks, scales = mxfp4.quantize(tensor, hf_name)
            stored = zip(self._packed_names(hf_name), (blocks, scales))
        for name, array in stored:
            entry = self._entries[name]
            if array.shape != entry.shape:
                raise ReshardError(f"{name}: got shape {array.shape}, expected {entry.shape}")
            self._files[entry.file].pwrite(array.reshape(-1).view(np.uint8), entry.offset)
        if self._block:
            return fp8_blocks.check_error(tensor, values, scales, self._block, hf_name)
        return mxfp4.check_error(tensor, blocks, scales, hf_name)

    def stored_dtype(self, spec: TensorSpec) -> str | None:
        return "float32" if spec.name in self._quantized else None

    def write(self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], prepared: Any = None) -> None:
        layer, expert = slab_of(spec, slab)
        names = self._mappings[spec.name].hf_names(layer, expert)
        if spec.name in self._quantized:
            names = [n for name in names for n in ((name, fp8_blocks.scale_name(name)) if self._block else self._packed_names(name))]
        self._mark(names)
        self._facts.extend(names)

    def _mark(self, names: list[str]) -> None:
        """Note HF tensors (or slices of one) as written; a fused tensor is written once every slice is (counted
        down: a tensor of thousands of row slices, as Gated DeltaNet's in_proj, must not rescan them per slice)."""
        for name in names:
            entry = self._entries[name]
            if entry.written:  # a resumed run's facts, or another rank's, may name it again
                continue
            entry.written = True
            fused = HFAddress.parse(name).name
            if fused != name:
                self._unwritten[fused] -= 1
                if not self._unwritten[fused]:
                    self._entries[fused].written = True

    # Every tensor has its place from the start, so a tensor is done once its bytes are durable: the state
    # to resume from, or to hand to rank 0, is the names of the tensors written.
    def sync(self) -> None:
        for f in self._files:
            os.fsync(f.fd)

    def restore(self, facts: list[str]) -> None:
        self._mark(facts)
        self._facts.extend(facts)

    def part(self) -> list[str]:
        self._close_files()
        return self.facts()

    def _close_files(self) -> None:
        for f in self._files:
            os.fsync(f.fd)
            f.close()
        self._files = []

    def finish(self, manifest: Manifest, parts: list[Any] | None = None) -> None:
        self._close_files()
        self.restore([name for part in parts or [] for name in part])  # what the other ranks wrote
        missing = [e.name for e in self._entries.values() if not e.written]
        if missing:
            raise ReshardError(f"internal: {len(missing)} HF tensors were never written (first: {missing[0]})")
        tensors = {name: e for name, e in self._entries.items() if HFAddress.parse(name).name == name}  # slices are not tensors
        if len(self._file_names) > 1:
            index = {
                "metadata": {"total_size": sum(e.nbytes for e in tensors.values())},
                "weight_map": {name: self._file_names[e.file] for name, e in sorted(tensors.items())},
            }
            (self.path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = dict(self.hf_config)
        out_dtype = self.dtype or self.specs[self.config.language_model_prefix + "embedding.word_embeddings.weight"].dtype
        config["dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"] = out_dtype
        config.pop("_name_or_path", None)
        (self.path / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copied = copy_tokenizer(self.options.tokenizer_from, self.path)
        if GENERATION_CONFIG not in copied:
            generation = {"_from_model_config": True}
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if config.get(key) is not None:
                    generation[key] = config[key]
            (self.path / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        manifest.provenance = dict(manifest.provenance, hf_family=self.family.model_type, hf_files_copied=copied,
                                   hf_files=recorded_digests(self.path))
        # its checksums are of the values dequantized, held to the bound, not the source's
        if self._block:
            manifest.provenance["fp8_blocks"] = {"weight_block_size": list(self._block), "bound": fp8_blocks.BOUND}
        elif self._quantized:
            manifest.provenance["mxfp4"] = {"bound": mxfp4.BOUND}
        manifest.save(self.path)
