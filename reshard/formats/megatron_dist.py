"""Megatron-Core's torch_dist format: PyTorch DCP files (`__R_K.distcp` + `.metadata`) plus `common.pt`.

Read without a model or a process group: `.metadata` lists every tensor's global shape and the
chunks it was saved in, and each chunk is a `torch.save` blob inside a `.distcp` file, of which we
read just the bytes asked for (see `archive_reader`). Written the same way, one file per target rank holding that rank's
primary pieces, so that `megatron.core.dist_checkpointing.load` reads it at any layout.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from reshard.architecture import check_shapes
from reshard.buffers import PerThread
from reshard.checksum import HashedParts
from reshard.config import ModelConfig
from reshard.direct_io import DirectFile, round_up
from reshard.dtypes import itemsize, numpy_dtype
from reshard.errors import ReshardError
from reshard.formats import integrity, ms_swift
from reshard.formats.base import (
    CheckpointReader,
    CheckpointWriter,
    CommonState,
    LazyObjects,
    Manifest,
    StoredRecord,
    args_for_layout,
    cached,
)
from reshard.formats.megatron_tree import (
    TOKENIZER_ASSETS,
    MegatronTree,
    args_dict,
    args_namespace,
    found_iteration,
    iteration_dirname,
    locate,
    stored_iteration,
    tokenizer_dir,
    write_tracker,
)
from reshard.formats.model_args import RUN_CONFIG, args_from_file, bridge_args, save_run_config
from reshard.layout import Layout, RankCoord, megatron_arg, ranks
from reshard.logical import TensorSpec, describe
from reshard.naming import canonical, is_layout_bound, layer_is_moe, spell, uses_te_names
from reshard.optim.dp_reshardable import DpReshardable, DpReshardableSink, is_dp_reshardable
from reshard.optim.flattened_range import FlattenedRange, is_model_space
from reshard.optim.sink import Placement
from reshard.optim.state import OptimizerState
from reshard.paths import confined
from reshard.sharding import Piece, Region, RegionIndex, pieces, region_size, shift, split_by_slab, to_slices
from reshard.torchfile import PARSE_ERRORS, dcp_metadata
from reshard.torchfile.archive_reader import RecordFile, TensorRecord
from reshard.torchfile.archive_writer import At, archive_size, save_archive, save_tensor, storage_alignment
from reshard.torchfile.dcp_metadata import Chunk, DcpMetadata, Storage, StorageKey, TensorEntry
from reshard.torchfile.payloads import EXTRA_STATE, load_args_screened, screen_payloads

HEADER_THREADS = 8  # small reads in flight at once: the disk answers many as fast as one

T = TypeVar("T")
# How Megatron-LM (megatron-core >= 0.13) records the form of what it saved, in common.pt's `content_metadata`:
# `load_checkpoint` builds its load request from it, and without it asks for a form reshard does not write
# (fully_sharded_model_space or dp_zero_gather_scatter). reshard writes megatron-core's current spellings.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def content_metadata(recorded: object, form: str | None) -> dict[str, Any]:
    """The source's content metadata (if any) naming the DistributedOptimizer form (None: no DistributedOptimizer
    state) and key spellings written."""
    out = {**(recorded if isinstance(recorded, dict) else {}), **CONTENT_METADATA}
    if form is None:
        return out
    out["distrib_optim_sharding_type"] = form
    if form == "fully_reshardable":  # as Megatron-LM's own fully_reshardable save records it
        out.setdefault("distrib_optim_fully_reshardable_mem_efficient", False)
    else:
        out.pop("distrib_optim_fully_reshardable_mem_efficient", None)
    return out


METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}


def is_torch_dist(path: Path) -> bool:
    tree = locate(path) if path.is_dir() else None
    return tree is not None and (tree.iteration_dir / ".metadata").is_file()


_COMMON_STATE = "common_state/"  # megatron-core 0.19's ShardedObject of the common state, by its storage key


class TorchDistReader(CheckpointReader):
    format_name = "torch_dist"
    integrity = False  # whether its iteration directory has Megatron-LM's integrity.json (`formats.integrity`)

    def __init__(self, path: Path, config_file: Path | None = None, need_architecture: bool = True):
        """`config_file` (`--config`): the architecture of a checkpoint that records none (see `model_args`).
        Without `need_architecture`, a checkpoint that records none opens with `config` None: its tensors are
        global, so inspecting and checksumming them needs none (their TP splits are then unknown)."""
        tree = locate(path)
        if tree is None or not (tree.iteration_dir / ".metadata").is_file():
            raise ReshardError(f"{path} is not a torch_dist checkpoint (no .metadata found)")
        directory = tree.iteration_dir
        self.integrity = (directory / integrity.NAME).exists()  # Megatron-LM's file digests: checked before anything is read
        listed = integrity.verify(directory) if self.integrity else set()
        metadata = dcp_metadata.load(directory / ".metadata")
        if self.integrity:
            needed = [".metadata", *(["common.pt"] if (directory / "common.pt").exists() else [])]
            integrity.require_covered(directory, listed, needed + sorted({info.relative_path for info in metadata.storage.values()}))
        self._open(path, tree, metadata, config_file, need_architecture)

    def _open(self, path: Path, tree: MegatronTree, metadata: DcpMetadata, config_file: Path | None, need_architecture: bool) -> None:
        """Read the checkpoint `metadata` lists, its files named relative to `tree.iteration_dir` (a layout that
        keeps the model and the optimizer in directories of their own gives them merged: `formats.verl`)."""
        self.path, self.tree, self.tokenizer_dir = path, tree, tokenizer_dir(tree)
        self.tokenizer_in_iteration = self.tokenizer_dir != tree.root
        directory = tree.iteration_dir
        self.metadata = metadata
        by_offset: dict[str, list[tuple[tuple[int, ...], Storage]]] = defaultdict(list)
        objects: dict[str, Storage] = {}
        for (fqn, offsets), info in self.metadata.storage.items():
            if offsets is None:
                objects[fqn] = info
            else:
                by_offset[fqn].append((offsets, info))
        self.specs: dict[str, TensorSpec] = {}
        self._files: dict[Path, RecordFile] = {}
        self._checked: dict[str, tuple[Path, int]] = {}  # a file .metadata names -> its confined path and size
        self._records: dict[tuple[str, int], tuple[RecordFile, TensorRecord]] = {}
        self._chunks: dict[str, list[tuple[Region, Storage]]] = {}
        self._index: dict[str, RegionIndex[Storage]] = {}
        self._header_pool: ThreadPoolExecutor | None = None
        self._prefetched: set[tuple[str, int]] = set()
        self._closed = False
        self._dropped_args: list[str] = []  # arguments of classes off the allow-list (`load_args_screened`)
        common = self._common_state(directory, objects)
        args = self._architecture(common.pop("args", None), config_file, need_architecture)
        iteration = found_iteration(tree, common.pop("iteration", tree.iteration))
        self.config: ModelConfig | None = ModelConfig.from_megatron_args(args) if args else None
        self.layout = Layout.from_megatron_args(args) if args else Layout()
        self.common = CommonState(args=args or {}, iteration=iteration, extra=common, integrity=self.integrity, dropped=self._dropped_args)
        self.manifest = Manifest.load(directory)
        self.unsupported_optimizer = []
        kept = []
        for key in self.metadata.objects:
            if key.startswith(_COMMON_STATE):
                continue
            if key.startswith("optimizer") or is_dp_reshardable(key):  # an MoE model's are chained_<i>.optimizer.*
                self.unsupported_optimizer.append(key)
            elif "_extra_state" in key or is_layout_bound(key):
                kept.append(key)
            else:
                self.common.dropped.append(key)
        self.common.objects = LazyObjects(kept, lambda key: self._object(objects[key], key))
        named_moe = any(".experts." in key for key in self.metadata.tensors)  # without an architecture, the names tell
        mla = self.config is not None and self.config.multi_latent_attention
        for key, entry in self.metadata.tensors.items():
            if key in self.metadata.flattened:  # megatron-core <= 0.14's flattened optimizer state: some decoded below
                self.unsupported_optimizer.append(key)
                continue
            name = canonical(key, "dist", layer_is_moe(self.config, key) if self.config else named_moe, mla)
            if name != key:  # the MoE pre-MLP norm gives the spec away
                self.common.args.setdefault("transformer_impl", "local")
            try:
                self.specs[name] = describe(name, entry.size, entry.dtype, self.config)
            except ReshardError:
                if not (key.startswith("optimizer.") or is_dp_reshardable(key)):
                    raise
                self.unsupported_optimizer.append(key)
                continue
            self._index_chunks(name, key, by_offset)
        if self.config is not None:
            check_shapes(self.config, {name: spec.shape for name, spec in self.specs.items()}, str(path))
            self._check_layout()
        self.optimizer: OptimizerState | None = None
        # decoding the buffers needs the saving run's layout and architecture; without them they stay listed as not read
        if self.config is not None and any(is_dp_reshardable(key) for key in self.unsupported_optimizer):
            self._decode_dp_reshardable(objects, by_offset)
        elif any(is_model_space(key, self.metadata.flattened) for key in self.unsupported_optimizer):
            moe = (lambda key: layer_is_moe(self.config, key)) if self.config else (lambda key: named_moe)
            self._decode_flattened_range(by_offset, lambda key: canonical(key, "dist", moe(key), mla))

    def _decoded(self, state: OptimizerState, keys: list[str]) -> None:
        """Take `state`, decoded from the stored `keys`, as the checkpoint's optimizer state."""
        self.optimizer = state
        self.specs.update(state.specs)
        self.common.extra = state.common(self.common.extra)
        self.unsupported_optimizer = [key for key in self.unsupported_optimizer if key not in keys]

    def _check_layout(self) -> None:
        """The files say the layout, where their chunks show it: a tensor-parallel weight is saved cut where its TP
        ranks' shares end (`sharding.pieces`). Args that say another degree are refused naming the arg (the
        embedding, vocabulary-parallel, shows TP; an expert weight ETP; chunks are per layer and expert whatever
        PP and EP were)."""
        expert = next((n for n, s in self.specs.items() if s.experts and s.tp_axis is not None and not s.is_optimizer), None)
        embedding = self.config.language_model_prefix + "embedding.word_embeddings.weight"
        for name, field in ((embedding, "tp"), (expert, "etp")):
            spec = self.specs.get(name)
            if spec is None or spec.tp_axis is None:
                continue
            said = {p.region[spec.tp_axis] for p in pieces(spec, self.config, self.layout) if p.primary}
            saved = {region[spec.tp_axis] for region, _ in self._chunks[name]}
            if saved != said:
                degree = self.layout.expert_tp if field == "etp" else self.layout.tp
                raise ReshardError(
                    f"{self.path}: its args say {megatron_arg(field)}={degree}, but its files hold {name} in "
                    f"{len(saved) // (2 if spec.gated else 1)} tensor-parallel parts: the args do not describe these files; refusing them"
                )

    def _decode_flattened_range(self, by_offset: dict[str, list], canonical_name: Callable[[str], str]) -> None:
        """megatron-core <= 0.14's fully_sharded_model_space state, read as its fully_reshardable tensors
        (optim/flattened_range.py); the stored tensors are indexed here and read by `_read_chunks`."""
        keys = [key for key in self.unsupported_optimizer if is_model_space(key, self.metadata.flattened)]
        for key in keys:
            self._index_chunks(key, key, by_offset)
        tensors = {key: self.metadata.tensors[key] for key in keys}
        self._decoded(FlattenedRange(tensors, self.metadata.flattened, canonical_name, self.specs, self.config, self.common.args, self._read_chunks),
                      keys)

    def _index_chunks(self, name: str, key: str, by_offset: dict[str, list]) -> None:
        """Index stored tensor `key`'s chunks (regions and where they lie) under `name`, for `_read_chunks`."""
        stored = dict(by_offset[key])
        chunks = self.metadata.tensors[key].chunks
        lost = [chunk.offsets for chunk in chunks if chunk.offsets not in stored]
        if lost:
            raise ReshardError(f"{key}: .metadata lists a chunk at {list(lost[0])} that no file holds; the checkpoint is damaged")
        self._chunks[name] = [(tuple((o, o + s) for o, s in zip(c.offsets, c.sizes)), stored[c.offsets]) for c in chunks]
        self._index[name] = RegionIndex(self._chunks[name])

    def _decode_dp_reshardable(self, objects: dict[str, Storage], by_offset: dict[str, list]) -> None:
        """The DistributedOptimizer's dp_reshardable buckets, read as its fully_reshardable tensors
        (optim/dp_reshardable.py); the raw bucket tensors are indexed here and read by `_read_chunks`."""
        keys = [key for key in self.unsupported_optimizer if is_dp_reshardable(key)]
        for key in keys:
            if key in self.metadata.tensors:
                self._index_chunks(key, key, by_offset)

        def saved_object(prefix: str) -> object:
            found = [key for key in keys if key.startswith(prefix + "/")]
            if len(found) != 1:
                raise ReshardError(f"{self.path}: {prefix} is missing from the checkpoint; its dp_reshardable optimizer state cannot be decoded")
            return self._object(objects[found[0]], found[0])

        tensors = {key: self.metadata.tensors[key] for key in keys if key in self.metadata.tensors}
        state = DpReshardable(tensors, saved_object, self.specs, self.config, self.layout, self.common.args, self._read_chunks, self._run_at)
        self._decoded(state, keys)

    def _common_state(self, directory: Path, objects: dict[str, Storage]) -> dict[str, Any]:
        """Megatron's non-tensor state: `common.pt` (megatron-core up to 0.18), or from 0.19 on (Megatron-
        Bridge's too) a ShardedObject `common_state` inside the .distcp files."""
        common_path = directory / "common.pt"
        inside = [key for key in objects if key.startswith(_COMMON_STATE)]
        if common_path.is_file():
            common, self._dropped_args = load_args_screened(common_path, str(common_path))
            where = str(common_path)
        elif inside:
            common, where = self._object(objects[inside[0]], inside[0]), f"{directory}'s common_state"
        else:
            raise ReshardError(
                f"{directory} has neither common.pt nor a common_state object: not a complete Megatron torch_dist checkpoint"
            )
        if not isinstance(common, dict):
            raise ReshardError(f"{where} does not hold Megatron's common state: the checkpoint is damaged")
        return common

    def _architecture(self, args: Any, config_file: Path | None, needed: bool) -> dict[str, Any] | None:
        """Megatron-LM's args where it saved them, else Megatron-Bridge's run_config.yaml (beside the
        iteration or the save directory), else `--config`, else (when not `needed`) None. ms-swift's args
        (`formats.ms_swift`) give the layout; its architecture is an HF config.json beside them or `--config`."""
        swift = args_dict(args) if args is not None and ms_swift.saved_by_swift(args_dict(args)) else None
        if swift is not None:
            args, config_file = None, ms_swift.architecture_file(swift, self.tree.root, config_file, self.path)
            self.architecture_hint = ms_swift.architecture_hint(swift)
        if config_file is not None and args is not None:
            raise ReshardError(f"{self.path} records its architecture in its args; drop --config")
        if args is not None:
            return args_dict(args)
        if config_file is not None:
            args = args_from_file(config_file)
            embedding = self.metadata.tensors.get(args.get("language_model_prefix", "") + "embedding.word_embeddings.weight")
            if embedding is not None:  # its padding is the saving run's choice, not the architecture's
                args["padded_vocab_size"] = embedding.size[0]
            return {**args, **ms_swift.layout_args(swift)} if swift is not None else args
        for directory in (self.tree.iteration_dir, self.tree.root):
            if (directory / RUN_CONFIG).is_file():
                return self._with_data_parallel_size(bridge_args(directory / RUN_CONFIG))
        if not needed:
            return None
        raise ReshardError(f"{self.path} records no architecture (no Megatron-LM args, no {RUN_CONFIG}): {self.architecture_hint}")

    def _with_data_parallel_size(self, args: dict[str, Any]) -> dict[str, Any]:
        """Megatron-Bridge's run_config.yaml records no data-parallel size, which a dp_reshardable optimizer state is
        laid out by: the ranks that wrote the save are TP x PP x CP of it."""
        world = self.metadata.saving_ranks()
        model_parallel = math.prod(int(args.get(megatron_arg(key)) or 1) for key in ("tp", "pp")) * int(args.get("context_parallel_size") or 1)
        if args.get("data_parallel_size") is None and world is not None and world % model_parallel == 0:
            args["data_parallel_size"] = world // model_parallel
        return args

    def _object(self, info: Storage, key: str) -> object:
        file, values = self._decode(info, "an object", RecordFile.unpickle)
        # Megatron serializes a ShardedObject as the list of its data on the saving rank.
        if not (isinstance(values, list) and len(values) == 1):
            raise ReshardError(f"{file.path}: a ShardedObject is not encoded as Megatron encodes them; the file is foreign or damaged")
        screen_payloads(values[0], f"{file.path} ({key})", extra_state=EXTRA_STATE in key)  # TE's pickle in it
        return values[0]

    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        if self.optimizer is not None and name in self.optimizer.specs:
            self.optimizer.read_into(name, region, out)
        else:
            self._read_chunks(name, region, out)

    def _read_chunks(self, name: str, region: Region, out: np.ndarray) -> None:
        filled = 0
        for chunk_region, wanted, info in self._index[name].overlapping(region):
            file, record = self._record(info)
            if record.shape != tuple(b - a for a, b in chunk_region) or numpy_dtype(record.dtype) != out.dtype:
                raise ReshardError(f"{file.path}: chunk of {name} has the wrong shape or dtype; the file is damaged")
            file.read_into(record, shift(wanted, chunk_region), out[to_slices(shift(wanted, region))])
            filled += region_size(wanted)
        if filled != region_size(region):
            raise ReshardError(f"{name}: the checkpoint's chunks do not cover the tensor; a .distcp file is missing or truncated")

    def prefetch(self, name: str, region: Region) -> None:
        """Parse the headers of the chunks `region` needs on background threads: each is two small reads at
        random places, which would otherwise stall a reader thread once per chunk (thousands of chunks
        in a MoE checkpoint: benchmarks/README.md). A record torch itself must decode (not stored dense)
        is loaded whole there, as the reader would load it."""
        if self._closed or name not in self._index:
            return
        if self._header_pool is None:
            self._header_pool = ThreadPoolExecutor(HEADER_THREADS, thread_name_prefix="reshard-headers")
        for _, _, info in self._index[name].overlapping(region):
            key = (info.relative_path, info.offset)
            if key not in self._records and key not in self._prefetched:
                self._prefetched.add(key)
                self._header_pool.submit(self._record, info)  # a failure is raised again by the reader that needs it

    def stored_regions(self, name: str) -> list[Region]:
        if name not in self._chunks:  # decoded from DistributedOptimizer buckets
            return super().stored_regions(name)
        chunks = sorted(self._chunks[name], key=lambda chunk: (chunk[1].relative_path, chunk[1].offset))
        return [part for region, _ in chunks for part in split_by_slab(self.specs[name], region)]

    def stored_records(self, name: str) -> list[StoredRecord] | None:
        if self.optimizer is not None and name in self.optimizer.specs:
            return self.optimizer.stored_records(name)
        if name not in self._chunks:
            return None
        records = []
        for region, info in self._chunks[name]:
            file, record = self._record(info)
            if record.shape != tuple(b - a for a, b in region):
                raise ReshardError(f"{file.path}: chunk of {name} has the wrong shape; the file is damaged")
            records.append(StoredRecord(name, region, record.dtype, info.relative_path, record.offset))
        return records

    def _run_at(self, key: str, start: int, count: int) -> tuple[str, int, str] | None:
        """Where elements [start, start + count) of stored 1-D tensor `key` lie as one run of one chunk: its file,
        the byte offset of the first and the dtype; None where they are not."""
        found = list(self._index[key].overlapping(((start, start + count),)))
        if len(found) != 1 or found[0][1] != ((start, start + count),):
            return None
        chunk, _, info = found[0]
        _, record = self._record(info)
        return info.relative_path, record.offset + (start - chunk[0][0]) * itemsize(record.dtype), record.dtype

    def _record(self, info: Storage) -> tuple[RecordFile, TensorRecord]:
        """The chunk's file and where its tensor lies in it (headers parsed once per chunk)."""
        return cached(self._records, (info.relative_path, info.offset), lambda: self._parse(info))

    def _parse(self, info: Storage) -> tuple[RecordFile, TensorRecord]:
        return self._decode(info, "a chunk", RecordFile.record)

    def _checked_file(self, relative_path: str) -> tuple[Path, int]:
        """A file .metadata names (untrusted: confined to the iteration directory) and its size, checked once per
        file, not once per chunk (an MoE checkpoint's files hold thousands)."""
        path = confined(self.tree.iteration_dir, relative_path)
        if not path.is_file():
            raise ReshardError(f"{path} is missing: the checkpoint is incomplete")
        return path, path.stat().st_size

    def _decode(self, info: Storage, what: str, how: Callable[[RecordFile, int, int], T]) -> tuple[RecordFile, T]:
        """`how` applied to the blob `info` places in its file (each file opened once); a missing, truncated
        or undecodable blob is refused in a line."""
        if info.transformed:
            raise ReshardError(f"{info.relative_path}: DCP stream transforms (compression) are not supported")
        path, size = cached(self._checked, info.relative_path, lambda: self._checked_file(info.relative_path))
        if size < info.offset + info.length:
            raise ReshardError(f"{path} is truncated: the checkpoint is damaged")
        file = cached(self._files, path, lambda: RecordFile(path))
        try:
            return file, how(file, info.offset, info.length)
        except PARSE_ERRORS as exc:
            raise ReshardError(f"{path}: {what} cannot be decoded ({exc.__class__.__name__}); the file is damaged") from None

    def close(self) -> None:
        self._closed = True
        if self.optimizer is not None:
            self.optimizer.close()
        if self._header_pool is not None:
            self._header_pool.shutdown(cancel_futures=True)
            self._header_pool = None
        for file in self._files.values():
            file.close()
        self._files.clear()


@dataclass(frozen=True)
class _Record:
    """Where one piece's archive goes: planned before its values are read."""

    index: int  # of the target rank file
    storage: Storage
    chunk: Chunk
    key: str | None = None  # the tensor it is a chunk of, where not the logical tensor's own (optimizer buckets)
    placement: Placement | None = None  # the piece it holds, where `prepare` writes it


class TorchDistWriter(CheckpointWriter):
    """Each piece is one `torch.save` archive in its target rank's file. Archive sizes are known from the
    shapes, so `reserve` places every record in plan order and reader threads write them at once, in any
    order (`os.pwrite`); `write` then only records them, in plan order. Optimizer state in the DistributedOptimizer's
    dp_reshardable form goes where the writer's optimizer sink places it (`optim.dp_reshardable`)."""

    format_name = "torch_dist"
    needs_extra_state = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        te_names = self.options.te_names
        self.te_names = uses_te_names(self.common.args) if te_names is None else te_names
        # the files of a multi-rank conversion's ranks are __<target rank>_<rank>.distcp
        self.directory = self._iteration_directory()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file_index = {rank: i for i, rank in enumerate(ranks(self.layout))}
        self._files: dict[int, DirectFile] = {}
        self._planned: dict[int, int] = {}  # each file's end once every reserved record is written
        self._sizes: dict[int, int] = {}  # each file's end after the records `write` has recorded
        self._chunks: dict[str, list[Chunk]] = defaultdict(list)
        self._storage: dict[StorageKey, Storage] = {}
        self._scratch = PerThread()  # stages strided pieces, in each reader thread
        # without an architecture, the names tell MoE models apart, as the reader took them (`TorchDistReader`)
        self._named_moe = any(".experts." in name for name in self.specs)
        self.sink: DpReshardableSink | None = None
        optimizer = self.options.optimizer
        if optimizer is not None and optimizer.form.sink is not None:
            self.sink = optimizer.form.sink(self.specs, self.config, self.layout, self._target_args(), self.common.objects, self.common.extra,
                                            optimizer.dp)
            self.common = replace(self.common, objects=self.sink.objects, extra=self.sink.extra)

    def tokenizer_home(self) -> Path:
        # the source's Megatron-LM 0.18 tokenizer assets stay in the iteration, where they were saved
        return self.directory / TOKENIZER_ASSETS if self.options.tokenizer_in_iteration else self.path

    def _iteration_directory(self) -> Path:
        """Where the checkpoint's files go (`_name`s are relative to it)."""
        return self.path / iteration_dirname(self.common.iteration)

    def _name(self, index: int) -> str:
        return f"__{index}_{self.rank}.distcp"

    def _first_file(self, key: str) -> int:
        """The file where stored object (or optimizer gap) `key` goes: the first rank's."""
        return 0

    def _open(self, index: int, size: int = 0) -> None:
        self._files[index] = DirectFile(self.directory / self._name(index))
        self._planned[index] = self._sizes[index] = size

    @classmethod
    def whole_regions(cls, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> list[Region]:
        return [p.region for p in pieces if p.primary]  # each is one record

    def _placements(self, spec: TensorSpec, pieces: list[Piece]) -> list[Placement]:
        """Where the pieces of `spec` go: optimizer state in a buffer form where the sink places it, anything else
        each primary piece as a chunk of its own tensor."""
        if self.sink is not None and spec.is_optimizer:
            return self.sink.placements(spec, pieces)
        return [
            Placement(p, RankCoord(pp=p.rank.pp, tp=p.rank.tp, ep=p.rank.ep), None, tuple(a for a, _ in p.region), tuple(b - a for a, b in p.region))
            for p in pieces
            if p.primary
        ]

    def reserve(self, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> list[_Record]:
        """Place each piece's record after the ones reserved before it in its file."""
        first = self._first_file(spec.name)  # 0, or where a layout keeps this kind of tensor (formats.verl)
        return [
            self._reserve_record(first + self._file_index[placed.rank], placed.offsets, placed.shape, spec.dtype, placed.key, placed)
            for placed in self._placements(spec, pieces)
        ]

    def _reserve_record(
        self, index: int, offsets: tuple[int, ...], shape: tuple[int, ...], dtype: str, key: str | None = None, placement: Placement | None = None
    ) -> _Record:
        """Place a chunk's archive after the ones reserved before it in file `index`."""
        if index not in self._files:
            self._open(index)
        # a page-aligned storage needs its archive on a page; the gap before it is read by no one
        offset = round_up(self._planned[index], storage_alignment(math.prod(shape) * itemsize(dtype)))
        length = archive_size(shape, dtype)
        self._planned[index] = offset + length
        return _Record(index, Storage(self._name(index), offset, length), Chunk(offsets, shape), key, placement)

    def prepare(
        self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], reserved: Any = None, hashed: HashedParts | None = None
    ) -> list[_Record]:
        """Write the slab's records where `reserve` placed them: staging a strided piece, its CRC-32 and
        the copy into the file all run in this reader thread."""
        for record in reserved:
            piece = record.placement.piece
            # a copy only of a strided piece flattened into a bucket
            chunk = data[to_slices(shift(piece.region, slab))].reshape(record.placement.shape)
            saved = save_tensor(chunk, At(self._files[record.index], record.storage.offset), self._scratch.scratch)
            if saved.size != record.storage.length:
                raise AssertionError(f"{spec.name}: archive of {saved.size} bytes where {record.storage.length} were planned")
            if record.placement.vouched:  # the checksum of the bytes as they went to the file (staged ones included)
                values = saved.data.view(data.dtype).reshape([b - a for a, b in piece.region])
                self.vouch(spec, piece.region, record.storage.relative_path, record.storage.offset + saved.data_offset, values, hashed)
        return reserved

    def write(self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], prepared: Any = None) -> None:
        """Record the slab's written records (in plan order: what `facts` and `.metadata` list)."""
        for record in prepared:
            key = record.key or self._key(spec.name)
            self._add(key, record)
            chunk, storage = record.chunk, record.storage
            self._facts.append([key, list(chunk.offsets), list(chunk.sizes), record.index, storage.offset, storage.length])

    def _add(self, key: str, record: _Record) -> None:
        self._chunks[key].append(record.chunk)
        self._storage[(key, record.chunk.offsets)] = record.storage
        self._sizes[record.index] = record.storage.offset + record.storage.length

    def _tensor_entries(self) -> dict[str, TensorEntry]:
        """.metadata's tensors, their chunks by position: the same list however the slabs were cut into units or
        shared by ranks; optimizer state in a buffer form as its sink's tensors."""
        entries = {
            self._key(name): TensorEntry(spec.dtype, spec.shape, sorted(self._chunks[self._key(name)], key=lambda c: c.offsets))
            for name, spec in self.specs.items()
            if self.sink is None or not spec.is_optimizer
        }
        if self.sink is not None:
            entries.update(self.sink.entries(self._chunks, self._zeros))
        return entries

    def _zeros(self, key: str, start: int, count: int) -> None:
        """A chunk of zeros of fp32 tensor `key` at `start`, in the first file (a gap between the sink's pieces)."""
        first = self._open_first(key)
        record = self._reserve_record(first, (start,), (count,), "float32", key)
        save_tensor(np.zeros(count, np.float32), At(self._files[first], record.storage.offset))
        self._add(key, record)

    def _open_first(self, key: str) -> int:
        """The first rank's file (`_first_file`), where objects (and zeros) go after its records (closed by `part` in a
        multi-rank run, or never written)."""
        first = self._first_file(key)
        if first not in self._files:
            path = self.directory / self._name(first)
            self._open(first, path.stat().st_size if path.exists() else 0)
        return first

    def _target_args(self) -> dict[str, Any]:
        args = args_for_layout(self.common.args, self.layout, self.config, "torch_dist")
        args["transformer_impl"] = "transformer_engine" if self.te_names else "local"
        # Megatron-LM's load_checkpoint asks for the RNG state (at an unchanged TP/PP) and the optimizer state unless
        # the args say they were not saved: what this checkpoint lacks is said so
        if not any(is_layout_bound(key) for key in self.common.objects):
            args["no_save_rng"] = True
        if not any(spec.is_optimizer for spec in self.specs.values()):
            args["no_save_optim"] = True
        return args if self.sink is None else args | self.sink.extra_args

    def _key(self, name: str) -> str:
        if self.config is None:
            return spell(name, "dist", self.te_names, self._named_moe)
        return spell(name, "dist", self.te_names, layer_is_moe(self.config, name), self.config.multi_latent_attention)

    def _write_objects(self) -> list[str]:
        """Per-module objects go into the first rank's file, as Megatron's replica 0 saves them."""
        for key, value in sorted(self.common.objects.items()):
            first = self._open_first(key)
            buffer = io.BytesIO()
            save_archive([value], buffer)
            offset = self._sizes[first]
            At(self._files[first], offset).write(buffer.getbuffer())
            self._sizes[first] = self._planned[first] = offset + len(buffer.getbuffer())
            self._storage[(key, None)] = Storage(self._name(first), offset, len(buffer.getbuffer()))
        return sorted(self.common.objects)

    def sync(self) -> None:
        for file in list(self._files.values()):
            os.fsync(file.fd)

    def restore(self, facts: list[Any]) -> None:
        """Continue after the logged records (each `[key, offsets, sizes, file index, offset, length]`):
        files cut back to their last one's end (records of later tensors may have been written past it),
        files of none removed."""
        for key, o, z, i, at, n in facts:
            self._add(key, _Record(i, Storage(self._name(i), at, n), Chunk(tuple(o), tuple(z))))
        kept = {self._name(i) for i in self._sizes}
        for path in self.directory.glob(f"__*_{self.rank}.distcp"):
            if path.name not in kept:
                path.unlink()
        for index, end in list(self._sizes.items()):
            self._open(index, end)
            os.ftruncate(self._files[index].fd, end)
        self._facts.extend(facts)

    def part(self) -> tuple[dict[str, list[Chunk]], dict[StorageKey, Storage]]:
        self._close_files()
        return dict(self._chunks), dict(self._storage)

    def _close_files(self) -> None:
        for index, file in self._files.items():
            os.ftruncate(file.fd, self._sizes[index])  # nothing past the last recorded record
            os.fsync(file.fd)
            file.close()
        self._files.clear()

    def _finish_records(self, parts: list[Any] | None) -> DcpMetadata:
        """Every rank's records (`parts`, in rank order, rank 0's own among them) and the objects, written and listed."""
        if parts is not None:
            self._chunks, self._storage = defaultdict(list), {}
            for chunks, storage in parts:
                for key, found in chunks.items():
                    self._chunks[key].extend(found)
                self._storage.update(storage)
        tensors = self._tensor_entries()
        objects = self._write_objects()
        self._close_files()
        return DcpMetadata(tensors, objects, self._storage)

    def finish(self, manifest: Manifest, parts: list[Any] | None = None) -> None:
        dcp_metadata.save(self.directory / ".metadata", self._finish_records(parts))
        common = dict(self.common.extra)
        common["iteration"] = stored_iteration(self.common.iteration)
        form = common.get("optimizer", {}).get("param_state_sharding_type") if isinstance(common.get("optimizer"), dict) else None
        if form is not None:  # Megatron-LM asks for the optimizer form its content metadata names (else an older one)
            common["content_metadata"] = content_metadata(common.get("content_metadata"), form)
        if self.config is not None:  # else the source recorded no architecture, and neither does its copy
            args = self._target_args()
            common["args"] = args_namespace(args)
            # what Megatron-Bridge's loader builds the model from (it reads no Megatron-LM args without a model type)
            save_run_config(self.directory, args, self.config, self.layout, self.te_names)
        with open(self.directory / "common.pt", "wb") as f:
            save_archive(common, f)
        (self.directory / "metadata.json").write_text(json.dumps(METADATA_JSON))
        manifest.save(self.directory)
        if self.common.integrity:  # last: it lists every file written above
            integrity.write(self.directory)
        write_tracker(self.path, self.common.iteration)
