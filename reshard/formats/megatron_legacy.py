"""Megatron-LM's legacy format: one `torch.save` per model-parallel rank, stage-local layer numbers.

`iter_N/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`, each holding `args`, `iteration`
and `model` (or `model0..N` with virtual pipeline stages). Read without torch: the pickle for the
structure (`archive_reader.load_archive`: stand-ins, nothing run), then the bytes a region needs with
`pread` where the zip's directory places its tensor's storage; written with `StreamingTorchSave`,
every local tensor's record placed when the writer opens and written by the reader threads (of any
rank of a multi-rank conversion).

With `--use-distributed-optimizer` each rank directory also holds megatron-core's `distrib_optim.pt`
(`reshard.optim.distrib_optim_pt.DistribOptimFiles`, the reader's optimizer state), read as the logical per-parameter
optimizer tensors of the fully_reshardable form; the legacy writer composes that module's `DistribOptimPtSink` to
write that state.
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from isal.isal_zlib import crc32

from reshard.architecture import check_shapes, model_tensors
from reshard.buffers import PerThread, copy
from reshard.checksum import HashedParts
from reshard.config import ModelConfig
from reshard.dtypes import itemsize
from reshard.errors import ReshardError
from reshard.formats.base import (
    CheckpointReader,
    CheckpointWriter,
    CommonState,
    Manifest,
    StoredRecord,
    args_for_layout,
    cached,
)
from reshard.formats.megatron_tree import (
    args_dict,
    args_namespace,
    found_iteration,
    iteration_dirname,
    locate,
    stored_iteration,
    tokenizer_dir,
    write_tracker,
)
from reshard.layout import Layout, RankCoord, megatron_arg, ranks
from reshard.logical import TensorSpec, describe
from reshard.naming import ObjectKey, canonical, fused_parts, layer_is_moe, spell, uses_te_names
from reshard.optim.distrib_optim_pt import OPTIM_FILE, DistribOptimFiles, DistribOptimPtSink
from reshard.optim.state import OptimizerRefusal
from reshard.paths import confined
from reshard.sharding import (
    Piece,
    Region,
    contiguous_offset,
    full_region,
    intersect,
    pieces,
    pieces_by_slab,
    region_size,
    shift,
    slab_of,
    slabs,
    to_slices,
)
from reshard.torchfile.archive_reader import RecordFile, TensorRecord, archive_tensor
from reshard.torchfile.archive_writer import Slot, StreamingTorchSave, tensor_bytes
from reshard.torchfile.crc32 import crc32_of_parts
from reshard.torchfile.payloads import load_args_screened

RANK_FILE = "model_optim_rng.pt"
_PART = "part"  # a fact of the writer's log: one part of a fused parameter written (`LegacyWriter.prepare`)
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LOCAL_LAYER = re.compile(r"^(?P<head>(?:.*\.)?decoder\.layers\.)(?P<index>\d+)\.(?P<tail>.+)$")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(?P<index>\d+)\.")

# Keys of a rank file that are not model state and are carried as common state.
_NOT_COMMON = ("args", "iteration", "rng_state", "optimizer", "model")


def is_legacy(path: Path) -> bool:
    tree = locate(path) if path.is_dir() else None
    return tree is not None and any(_RANK_DIR.match(p.name) for p in tree.iteration_dir.iterdir())


def refuse_te_mla(config: ModelConfig, layout: Layout, te_names: bool) -> None:
    """Transformer Engine's MLA keeps the down projections whole on every TP rank where the local spec splits
    them (`logical.PARTITION_RULES`); torch_dist stores both alike, per-rank files do not."""
    if te_names and config.multi_latent_attention and layout.tp > 1:
        raise ReshardError(
            "multi_latent_attention with Transformer Engine names in the legacy format at TP>1 is not supported "
            "(its linear_q_down_proj/linear_kv_down_proj are not TP-split); use torch_dist or --naming local"
        )


def refuse_mtp(config: ModelConfig) -> None:
    """Per-rank files would hold MTP layers with rank-local expert names and an embedding copy on their stage,
    which reshard neither writes nor reads yet: refused rather than written wrong or read without them."""
    if config.mtp_num_layers:
        raise ReshardError(
            f"the model has {config.mtp_num_layers} multi-token-prediction layers (mtp_num_layers), which reshard does not "
            "carry in the legacy (per-rank) format yet; use torch_dist or zarr"
        )


def refuse_towers(config: ModelConfig) -> None:
    """Megatron-LM's per-rank files hold a GPT model; a vision-language model's towers (`config.Tower`) and its
    language_model. prefix are Megatron-Bridge's, which saves torch_dist only."""
    if config.towers or config.language_model_prefix:
        raise ReshardError(f"the model has towers beside its language model ({', '.join(t.prefix for t in config.towers)}), which "
                           "the legacy (per-rank) format does not hold; use torch_dist or zarr")


@dataclass(frozen=True)
class Fusion:
    """Where the pieces of a fused parameter's parts lie in the rank's one tensor (`FUSED_PARTS`)."""

    specs: dict[str, TensorSpec]
    config: ModelConfig
    layout: Layout
    te_names: bool

    def piece(self, spec: TensorSpec, piece: Piece) -> Piece:
        """`piece` of `spec` as its rank's tensor holds it: a part's rows after the rank's rows of the parts before it."""
        param, _, part = spec.name.rpartition(".")
        parts = fused_parts(param)
        if part not in parts:
            return piece
        rows = [self._local_rows(self.specs[f"{param}.{p}"]) for p in parts]
        start = sum(rows[: parts.index(part)])
        (a, b), *rest = piece.local_region
        alias = local_name(param, piece, self.te_names, layer_is_moe(self.config, param), self.config.multi_latent_attention)
        return replace(piece, local_shape=(sum(rows), *piece.local_shape[1:]), local_region=((start + a, start + b), *rest), alias=alias)

    def _local_rows(self, spec: TensorSpec) -> int:
        return spec.shape[spec.prefix_axes] // self.layout.tp


def te_named(config: ModelConfig, asked: bool) -> bool:
    """Whether the rank files hold Transformer Engine's names: as asked (the args' transformer_impl, --naming), but always
    for a model with Mamba layers, which megatron-core 0.16.1 builds from Transformer Engine's spec only (MambaModel)."""
    return asked or "M" in (config.hybrid_override_pattern or "")


def local_name(name: str, piece: Piece, te_names: bool, moe: bool, mla: bool = False) -> str:
    """The name of a piece of logical tensor `name` in its rank's `model` state dict."""
    if piece.alias:
        return piece.alias
    return _localize(spell(name, "legacy", te_names, moe, mla), piece.local_layer, piece.local_expert)


def _localize(name: str, local_layer: int | None, local_expert: int | None) -> str:
    """Stacked canonical name -> stage-local layer number and rank-local expert number."""
    if local_layer is None:
        return name
    tail = name.split("decoder.layers.", 1)[1]
    tail = re.sub(r"^\d+\.", "", tail)
    if local_expert is not None:
        tail = tail.replace("mlp.experts.experts.", f"mlp.experts.local_experts.{local_expert}.", 1)
    return f"{name.split('decoder.layers.', 1)[0]}decoder.layers.{local_layer}.{tail}"


def _globalize(name: str, moe: bool, mla: bool = False) -> tuple[str, int | None, int | None]:
    """Local name -> (canonical stacked name, stage-local layer, rank-local expert)."""
    match = _LOCAL_LAYER.match(name)
    if not match:
        return name, None, None
    tail, expert = match.group("tail"), None
    expert_match = _LOCAL_EXPERT.search(tail)
    if expert_match:
        expert = int(expert_match.group("index"))
        tail = _LOCAL_EXPERT.sub("mlp.experts.experts.", tail)
    return canonical(f"{match.group('head')}{tail}", "legacy", moe, mla), int(match.group("index")), expert


def _model_keys(vpp: int) -> list[str]:
    return ["model"] if vpp == 1 else [f"model{i}" for i in range(vpp)]


class LegacyReader(CheckpointReader):
    format_name = "legacy"

    def __init__(self, path: Path):
        tree = locate(path)
        if tree is None or not is_legacy(path):
            raise ReshardError(f"{path} is not a legacy Megatron checkpoint (no mp_rank_* directories)")
        self.path, self.tree, self.tokenizer_dir = path, tree, tokenizer_dir(tree)
        self.tokenizer_in_iteration = self.tokenizer_dir != tree.root
        names = sorted(p.name for p in tree.iteration_dir.iterdir() if _RANK_DIR.match(p.name))
        first_file = self._rank_file(names[0])
        first, dropped = self._load_path(first_file)
        args = args_dict(first.get("args"))
        self.config = ModelConfig.from_megatron_args(args)
        self.layout = Layout.from_megatron_args(args)
        self._check_layout(names)
        self.te_names = te_named(self.config, uses_te_names(args))
        refuse_te_mla(self.config, self.layout, self.te_names)
        refuse_mtp(self.config)
        self._states: dict[RankCoord, dict[str, Any]] = {}
        self._files: dict[RankCoord, RecordFile] = {}
        self._present = {rank for rank in ranks(self.layout) if self._rank_file(rank.legacy_dirname(self.layout)).is_file()}
        for rank in ranks(self.layout):
            self._holder(rank, experts=False)
            if self.config.is_moe:
                self._holder(rank, experts=True)
        extra = {k: v for k, v in first.items() if k not in _NOT_COMMON and not k.startswith("model")}
        self.common = CommonState(args=args, iteration=found_iteration(tree, first.get("iteration", tree.iteration)), extra=extra,
                                  dropped=dropped)
        # Legacy optimizer state is keyed by parameter index within each rank: tied to its layout.
        self.unsupported_optimizer = ["optimizer (legacy per-rank state)"] if "optimizer" in first else []
        self.manifest = Manifest.load(tree.iteration_dir)
        self.specs = self._discover()
        self._fusion = Fusion(self.specs, self.config, self.layout, self.te_names)
        check_shapes(self.config, {name: spec.shape for name, spec in self.specs.items()}, str(path))
        self._pieces: dict[str, list[Piece]] = {}
        self.optimizer: DistribOptimFiles | None = None
        if confined(tree.iteration_dir, f"{next(ranks(self.layout)).legacy_dirname(self.layout)}/{OPTIM_FILE}").is_file():
            try:
                self.optimizer = DistribOptimFiles(tree.iteration_dir, first_file, first.get("optimizer"), self.specs, self.config, self.layout, args)
            except ReshardError as exc:  # the model still converts (--no-optimizer); with the optimizer the plan refuses, saying why
                self.optimizer_refusal = OptimizerRefusal(f"optimizer ({OPTIM_FILE})", str(exc))
            else:
                self.specs.update(self.optimizer.specs)
                self.common.extra = self.optimizer.common(self.common.extra)
            self.unsupported_optimizer = []  # the rank files' `optimizer` entry is the DistributedOptimizer's param groups

    def _check_layout(self, names: list[str]) -> None:
        """The files say the layout: Megatron names a rank's directory mp_rank_TT, then _PPP with PP > 1, then _EEE
        with EP > 1. Args that name directories otherwise, or fewer ranks than there are, are refused naming the arg."""
        fields = [[int(n) for n in _RANK_DIR.match(name).groups() if n is not None] for name in names]
        axes = ["tp", *(["pp"] if self.layout.pp > 1 else []), *(["ep"] if self.layout.ep > 1 else [])]
        for length in {len(f) for f in fields} - {len(axes)}:
            said = " and ".join(f"{megatron_arg(axis)}={getattr(self.layout, axis)}" for axis in ("pp", "ep"))
            raise ReshardError(f"{self.path}: its args say {said}, but it has rank directories named like "
                               f"{next(n for n, f in zip(names, fields) if len(f) == length)}: the args do not describe these files; refusing them")
        for i, axis in enumerate(axes):  # fewer ranks than the args say: some file is missing (`_holder` says so)
            saved = 1 + max(f[i] for f in fields)
            if saved > getattr(self.layout, axis):
                raise ReshardError(f"{self.path}: its args say {megatron_arg(axis)}={getattr(self.layout, axis)}, but its rank "
                                   f"directories ({names[0]} to {names[-1]}) hold {saved}: the args do not describe these files; refusing them")

    def _holder(self, rank: RankCoord, experts: bool) -> RankCoord:
        """The rank file holding `rank`'s dense (or expert) tensors. Megatron names a file by its writer's
        TP and EP ranks, and with ETP < TP not every pair is a rank: TP2 EP2 ETP1 on 4 GPUs writes only
        mp_rank_00_000 and mp_rank_01_001. Another file then holds the same values: the same TP rank's
        for dense tensors, the same EP rank's with the same expert-TP part for experts."""
        plain = RankCoord(pp=rank.pp, tp=rank.tp, ep=rank.ep)
        if plain not in self._present:
            etp = self.layout.expert_tp
            same = [
                other for other in sorted(self._present, key=lambda r: (r.tp, r.ep))
                if other.pp == rank.pp
                and ((other.ep == rank.ep and other.tp % etp == rank.tp % etp) if experts else other.tp == rank.tp)
            ]
            if not same:
                raise ReshardError(
                    f"{self._rank_file(rank.legacy_dirname(self.layout))} is missing but args say {self.layout}: the checkpoint "
                    "is incomplete, or the args do not describe these files"
                )
            plain = same[0]
        return RankCoord(pp=plain.pp, tp=plain.tp, ep=plain.ep, vstage=rank.vstage)

    def _rank_file(self, dirname: str) -> Path:
        return confined(self.tree.iteration_dir, f"{dirname}/{RANK_FILE}")  # a link in the checkpoint may not lead out of it

    @staticmethod
    def _load_path(path: Path) -> tuple[dict[str, Any], list[str]]:
        """A rank's state, and the arguments dropped from it (`load_args_screened`)."""
        state, dropped = load_args_screened(path, str(path))
        if not isinstance(state, dict):
            raise ReshardError(f"{path} does not hold a Megatron rank's state: the file is foreign or damaged")
        return state, dropped

    def _state(self, rank: RankCoord) -> dict[str, Any]:
        key = RankCoord(pp=rank.pp, tp=rank.tp, ep=rank.ep)
        return cached(self._states, key, lambda: self._load_rank(key))

    def _load_rank(self, rank: RankCoord) -> dict[str, Any]:
        return self._load_path(self._rank_file(rank.legacy_dirname(self.layout)))[0]

    def _file(self, rank: RankCoord) -> RecordFile:
        return cached(self._files, rank, lambda: RecordFile(self._rank_file(rank.legacy_dirname(self.layout))))

    def _model(self, rank: RankCoord) -> dict[str, Any]:
        state = self._state(rank)
        key = _model_keys(self.layout.vpp)[rank.vstage]
        if key not in state:
            raise ReshardError(f"{self._rank_file(rank.legacy_dirname(self.layout))} has no {key!r}: args say VPP={self.layout.vpp}")
        return state[key]

    def _discover(self) -> dict[str, TensorSpec]:
        """Logical tensors and per-module objects, from the tp=0 ranks of every stage."""
        config, layout, moe = self.config, self.layout, self.config.is_moe
        per_layer: dict[str, dict[int, TensorRecord]] = defaultdict(dict)
        singles: dict[str, TensorRecord] = {}
        seen: set[tuple[str, int, int | None]] = set()  # (tensor, layer, local expert): each once
        for chunk, layers in enumerate(layout.stage_layers(config.num_layers)):
            for ep in range(layout.ep):
                rank = RankCoord(pp=chunk % layout.pp, tp=0, ep=ep, vstage=chunk // layout.pp)
                dense, experts = self._holder(rank, experts=False), self._holder(rank, experts=moe)
                for name, value in self._entries(dense, experts):
                    logical, local_layer, local_expert = _globalize(name, moe, config.multi_latent_attention)
                    if local_layer is not None and config.per_layer_names:  # a dense layer among MoE ones: its own spelling
                        logical = _globalize(name, config.moe_layers[layers.start + local_layer], config.multi_latent_attention)[0]
                    local = archive_tensor(value)
                    if name.endswith("_extra_state"):
                        self._add_object(logical, layers.start, local_layer, local_expert, ep, value)
                    elif ep > 0 or local is None:
                        continue  # other EP ranks repeat the dense tensors
                    elif name == "output_layer.weight" and config.tied_embeddings:
                        continue  # the last stage's copy of the tied embedding
                    elif local_layer is None:
                        singles[logical] = local
                    else:
                        held = (logical, layers.start + local_layer, local_expert)
                        if local_layer >= len(layers) or held in seen:
                            raise ReshardError(
                                f"{self._rank_file(rank.legacy_dirname(layout))} holds {name}, but the args give "
                                f"its stage layers {layers.start}-{layers.stop - 1}: the stage sizes in the args are not the saved ones"
                            )
                        seen.add(held)
                        per_layer[logical][layers.start + local_layer] = local
        for rank in sorted(self._present, key=lambda r: (r.pp, r.tp, r.ep)):  # one per rank that saved
            state = self._state(rank)
            if "rng_state" in state:
                offsets, shape = (rank.pp, rank.tp), (layout.pp, layout.tp)
                if layout.ep > 1:
                    offsets, shape = offsets + (rank.ep,), shape + (layout.ep,)
                self.common.objects[str(ObjectKey("rng_state", offsets, shape))] = state["rng_state"]
        specs: dict[str, TensorSpec] = {}
        for name, tensor in singles.items():
            specs[name] = self._global_spec(name, tensor, layer_axis=False)
        for name, by_layer in per_layer.items():
            if len(by_layer) == config.num_layers and not config.per_layer_names:
                specs.update(self._global_specs(name, next(iter(by_layer.values())), layer_axis=True))
            elif not config.per_layer_names:
                missing = sorted(set(range(config.num_layers)) - set(by_layer))
                raise ReshardError(f"{name} is missing for layer(s) {missing[:8]}: the checkpoint is incomplete")
            else:  # MoE and dense layers mixed: one logical tensor per layer, as torch_dist names them
                for layer, tensor in by_layer.items():
                    per_name = name.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
                    specs.update(self._global_specs(per_name, tensor, layer_axis=False))
        return specs

    @functools.cached_property
    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """The global shapes the args give every tensor (computed once, not per fused tensor of every layer)."""
        return model_tensors(self.config)

    def _global_specs(self, name: str, local: TensorRecord, layer_axis: bool) -> dict[str, TensorSpec]:
        """The logical tensors of a per-rank tensor: itself (`_global_spec`), or a fused parameter's parts (`FUSED_PARTS`),
        each of the shape the args give it, if they add up to the rank's tensor."""
        parts = fused_parts(name)
        if not parts:
            return {name: self._global_spec(name, local, layer_axis)}
        expected = self._expected_shapes
        lead = [self.config.num_layers] if layer_axis else []
        rows, *rest = local.shape
        shapes = [expected.get(f"{name}.{part}") for part in parts]
        if None in shapes or sum(s[len(lead)] for s in shapes) != rows * self.layout.tp or any(list(s[len(lead) + 1 :]) != rest for s in shapes):
            raise ReshardError(f"{name} has shape {tuple(local.shape)} per rank at TP={self.layout.tp}, but the args give its parts "
                               f"({', '.join(parts)}) other sizes: the args do not describe these files")
        return {f"{name}.{part}": describe(f"{name}.{part}", shape, local.dtype, self.config) for part, shape in zip(parts, shapes)}

    def _entries(self, dense: RankCoord, experts: RankCoord) -> Iterator[tuple[str, Any]]:
        """A model chunk's entries, the dense ones from `dense`'s file and the experts' from `experts`'s."""
        for holder in dict.fromkeys((dense, experts)):
            for name, value in self._model(holder).items():
                if holder == (experts if _LOCAL_EXPERT.search(name) else dense):
                    yield name, value

    def _add_object(self, module: str, first_layer: int, local_layer: int | None, local_expert: int | None, ep: int, value: Any) -> None:
        if local_layer is None:
            return  # output_layer's (always empty) extra state: the writer recreates it
        if local_expert is None and ep > 0:
            return
        config, layer = self.config, first_layer + local_layer
        offsets, shape = (layer,), (config.num_layers,)
        if config.per_layer_names:  # keyed per layer, as torch_dist keys a model of mixed layers
            module, offsets, shape = module.replace("decoder.layers.", f"decoder.layers.{layer}.", 1), (), ()
        if local_expert is not None:
            assert config.num_experts is not None
            offsets += (ep * (config.num_experts // self.layout.ep) + local_expert,)
            shape += (config.num_experts,)
        if not offsets:
            offsets, shape = (0,), (1,)
        self.common.objects[str(ObjectKey(module, offsets, shape))] = value

    def _global_spec(self, name: str, local: TensorRecord, layer_axis: bool) -> TensorSpec:
        """The logical spec of a per-rank tensor: undo the TP split and put back layer/expert axes."""
        dtype = local.dtype
        probe = describe(name, (1,) * (int(layer_axis) + 1 + len(local.shape)), dtype, self.config)
        dims = list(local.shape)
        if probe.tp_axis is not None and probe.tp_axis - probe.prefix_axes < len(dims):
            dims[probe.tp_axis - probe.prefix_axes] *= self.layout.expert_tp if probe.experts else self.layout.tp
        prefix = ([self.config.num_layers] if layer_axis else []) + ([self.config.num_experts] if probe.experts else [])
        return describe(name, tuple(prefix + dims), dtype, self.config)

    def _primary(self, name: str) -> list[Piece]:
        if name not in self._pieces:
            spec = self.specs[name]
            self._pieces[name] = [self._fusion.piece(spec, p) for p in pieces(spec, self.config, self.layout) if p.primary]
        return self._pieces[name]

    def _piece_holder(self, name: str, piece: Piece) -> RankCoord:
        return self._holder(piece.rank, experts=self.specs[name].experts)

    def _local(self, name: str, piece: Piece) -> TensorRecord:
        """Where the rank's tensor that holds `piece` lies in its file."""
        local_key = local_name(name, piece, self.te_names, layer_is_moe(self.config, name), self.config.multi_latent_attention)
        holder = self._piece_holder(name, piece)
        model = self._model(holder)
        if local_key not in model:
            raise ReshardError(f"{self._rank_file(holder.legacy_dirname(self.layout))} lacks {local_key}: the checkpoint is incomplete")
        local = archive_tensor(model[local_key])
        if local is None:
            raise ReshardError(f"{self._rank_file(holder.legacy_dirname(self.layout))}: {local_key} is not a tensor; the file is damaged")
        if tuple(local.shape) != piece.local_shape:
            raise ReshardError(f"{local_key} has shape {tuple(local.shape)} on rank {piece.rank}, expected {piece.local_shape}")
        return local

    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        if self.optimizer is not None and name in self.optimizer.specs:
            self.optimizer.read_into(name, region, out)
            return
        filled = 0
        for piece in self._primary(name):
            inside = intersect(piece.region, region)
            if inside is None:
                continue
            local = self._local(name, piece)
            within_piece = shift(inside, piece.region)
            # piece.region and the local region have the same extent; drop the layer/expert axes.
            local_region = tuple(
                (l0 + a, l0 + b) for (a, b), (l0, _) in zip(within_piece[len(within_piece) - len(piece.local_region) :], piece.local_region)
            )
            dest = out[to_slices(shift(inside, region))].reshape([b - a for a, b in local_region])  # size-1 axes only: a view
            file_rank = replace(self._piece_holder(name, piece), vstage=0)
            self._file(file_rank).read_into(local, local_region, dest)
            filled += region_size(inside)
        if filled != region_size(region):
            raise ReshardError(f"{name}: the rank files do not cover the tensor; the checkpoint is incomplete")

    def stored_records(self, name: str) -> list[StoredRecord] | None:
        """Each primary piece where the rank file's zip directory places its values (offset -1 where they
        are not one run there: such a record is read back)."""
        if self.optimizer is not None and name in self.optimizer.specs:
            return self.optimizer.stored_records(name)
        records = []
        for piece in self._primary(name):
            local = self._local(name, piece)
            file_rank = replace(self._piece_holder(name, piece), vstage=0)
            within = contiguous_offset(piece.local_shape, piece.local_region)
            offset = -1 if local.offset < 0 or within is None else local.offset + within * local.itemsize
            records.append(StoredRecord(name, piece.region, local.dtype, f"{file_rank.legacy_dirname(self.layout)}/{RANK_FILE}", offset))
        return records

    def close(self) -> None:
        if self.optimizer is not None:
            self.optimizer.close()
        self._states.clear()
        for file in self._files.values():
            file.close()
        self._files.clear()


@dataclass(frozen=True)
class _Local:
    """One rank's local tensor made of a slab's pieces, placed in its rank file before the slab is read."""

    rank: RankCoord  # of the rank file
    vstage: int
    key: str  # in that model chunk's state dict
    pieces: tuple[Piece, ...]
    slot: Slot
    fused: bool  # its record holds other tensors' pieces too (`FUSED_PARTS`), each written on its own


class LegacyWriter(CheckpointWriter):
    """Each rank file is one `torch.save` archive. A local tensor's record size follows from its shape, so
    every record is placed when the writer opens (in the order of the specs, their slabs and ranks) and
    reader threads write them at once (`StreamingTorchSave.fill`); `finish` pickles each rank's state dict
    after its last record. The placement does not depend on which tensors this process writes: the ranks
    of a multi-rank conversion, or a resumed run, fill the same files, and the state to resume from or to
    hand to rank 0 is the local tensors written, with their records' CRC-32s."""

    format_name = "legacy"
    needs_extra_state = True
    stores_replicas = True  # each rank file is a whole state dict

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        te_names = self.options.te_names
        self.te_names = te_named(self.config, uses_te_names(self.common.args) if te_names is None else te_names)
        refuse_te_mla(self.config, self.layout, self.te_names)
        refuse_mtp(self.config)
        refuse_towers(self.config)
        self.directory = self.path / iteration_dirname(self.common.iteration)
        self._streams: dict[RankCoord, StreamingTorchSave] = {}
        self._models: dict[RankCoord, list[dict[str, Any]]] = {}
        self._scratch = PerThread()  # where a local tensor of several pieces is assembled, in each reader thread
        for file_rank in ranks(self.layout):
            rank_dir = self.directory / file_rank.legacy_dirname(self.layout)
            rank_dir.mkdir(parents=True, exist_ok=True)
            self._streams[file_rank] = StreamingTorchSave(rank_dir / RANK_FILE)
            self._models[file_rank] = [OrderedDict() for _ in range(self.layout.vpp)]
        self._fusion = Fusion(self.specs, self.config, self.layout, self.te_names)
        self._slots: dict[tuple[RankCoord, int, str], Slot] = {}  # (file, model chunk, local key) -> its record
        self._parts: dict[tuple[RankCoord, int, str], dict[int, tuple[int, int]]] = {}  # a fused record's parts written
        self._sizes: dict[tuple[RankCoord, int, str], int] = {}  # a fused record's bytes
        for spec in self.model_specs():
            by_slab = pieces_by_slab(pieces(spec, self.config, self.layout), spec)
            for slab in slabs(spec):
                for group in self._groups(spec, by_slab.get(slab_of(spec, slab), [])):
                    place = self._local_key(spec, group)
                    if place not in self._slots:  # a fused parameter's parts share their rank's record
                        self._slots[place] = self._streams[place[0]].reserve(group[0].local_shape, spec.dtype)
                    if fused_parts(spec.name.rpartition(".")[0]):
                        self._parts[place], self._sizes[place] = {}, int(np.prod(group[0].local_shape)) * itemsize(spec.dtype)
        self.sink: DistribOptimPtSink | None = None  # the optimizer tensors' writer: distrib_optim.pt beside the rank files
        optimizer = self.options.optimizer
        if optimizer is not None and optimizer.form.sink is not None:
            self.sink = optimizer.form.sink(self.specs, self.config, self.layout, self._target_args(), self.common.objects, self.common.extra,
                                            optimizer.dp, self.directory)
            self.common = replace(self.common, objects=self.sink.objects, extra=self.sink.extra)

    def model_specs(self) -> list[TensorSpec]:
        """The tensors of the rank files' `model` entries (the optimizer's go to distrib_optim.pt: its own sink's)."""
        return [spec for spec in self.specs.values() if not spec.is_optimizer]

    def _target_args(self) -> dict[str, Any]:
        args = args_for_layout(self.common.args, self.layout, self.config, "torch") | {
            "transformer_impl": "transformer_engine" if self.te_names else "local"
        }
        return args if self.sink is None else args | self.sink.extra_args

    def _groups(self, spec: TensorSpec, pieces: list[Piece]) -> list[list[Piece]]:
        return _local_groups([self._fusion.piece(spec, piece) for piece in pieces])

    def _local_key(self, spec: TensorSpec, group: list[Piece]) -> tuple[RankCoord, int, str]:
        rank = group[0].rank
        key = local_name(spec.name, group[0], self.te_names, layer_is_moe(self.config, spec.name), self.config.multi_latent_attention)
        return RankCoord(pp=rank.pp, tp=rank.tp, ep=rank.ep), rank.vstage, key

    @classmethod
    def whole_regions(cls, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> list[Region]:
        """The span of each local tensor's pieces (a gated MLP's gate and up rows keep together)."""
        return [
            tuple((min(a for a, _ in axis), max(b for _, b in axis)) for axis in zip(*(p.region for p in group)))
            for group in _local_groups(pieces)
        ]

    def _sink_takes(self, spec: TensorSpec) -> bool:
        return self.sink is not None and spec.is_optimizer

    def reserve(self, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> Any:
        """Each rank's local tensor of this slab (several pieces share one: a fused gated MLP), with its record."""
        if self._sink_takes(spec):
            return self.sink.reserve(spec, pieces)
        locals_ = []
        for group in self._groups(spec, pieces):
            place = self._local_key(spec, group)
            locals_.append(_Local(*place, tuple(group), self._slots[place], place in self._parts))
        return locals_

    def prepare(
        self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], reserved: Any = None, hashed: HashedParts | None = None
    ) -> Any:
        """Write the slab's local tensors where `reserve` placed them, and keep the checksums of their
        primary pieces as written."""
        if self._sink_takes(spec):
            return self.sink.prepare(spec, slab, data, pieces, reserved, hashed, self.vouch)
        facts = []
        for local in reserved:
            first = local.pieces[0]
            if local.fused:
                facts.extend(self._write_parts(spec, slab, data, local, hashed))
                continue
            if len(local.pieces) == 1 and first.local_region == full_region(first.local_shape):  # layer/expert axes dropped
                values = data[to_slices(shift(first.region, slab))].reshape(first.local_shape)
            else:
                values = self._scratch.array(first.local_shape, data.dtype)
                for piece in local.pieces:
                    part = data[to_slices(shift(piece.region, slab))]
                    copy(values[to_slices(piece.local_region)], part.reshape([b - a for a, b in piece.local_region]))
            written = self._streams[local.rank].fill(local.slot, values, self._scratch.scratch)
            as_written = written.view(data.dtype).reshape(first.local_shape)
            file = f"{local.rank.legacy_dirname(self.layout)}/{RANK_FILE}"
            for piece in local.pieces:
                start = contiguous_offset(first.local_shape, piece.local_region)
                if piece.primary and start is not None:
                    offset = local.slot.data_offset + start * data.itemsize
                    shape = [b - a for a, b in piece.region]
                    self.vouch(spec, piece.region, file, offset, as_written[to_slices(piece.local_region)].reshape(shape), hashed)
            facts.append([local.rank.legacy_dirname(self.layout), local.vstage, local.key, self._streams[local.rank].crc(local.slot)])
        return facts

    def _write_parts(self, spec: TensorSpec, slab: Region, data: np.ndarray, local: _Local, hashed: HashedParts | None) -> list[list[Any]]:
        """Each piece of a fused parameter's part into its rows of the rank's record (`Fusion`), its bytes' CRC-32 kept for
        `finish` to seal the record with; the facts of the parts written."""
        facts, file = [], f"{local.rank.legacy_dirname(self.layout)}/{RANK_FILE}"
        for piece in local.pieces:
            shape = [b - a for a, b in piece.local_region]
            values = data[to_slices(shift(piece.region, slab))].reshape(shape)
            written = tensor_bytes(values, self._scratch.scratch)
            start = contiguous_offset(piece.local_shape, piece.local_region) * data.itemsize  # a part's rows: one run
            self._streams[local.rank].write_part(local.slot, start, written)
            if piece.primary:
                as_written = written.view(data.dtype).reshape([b - a for a, b in piece.region])
                self.vouch(spec, piece.region, file, local.slot.data_offset + start, as_written, hashed)
            facts.append([_PART, local.rank.legacy_dirname(self.layout), local.vstage, local.key, start, written.nbytes, crc32(memoryview(written))])
        return facts

    def write(self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], prepared: Any = None) -> None:
        self.restore(prepared)

    def _place_objects(self) -> dict[RankCoord, Any]:
        """Put per-module objects into the model dicts of every rank holding the module; return RNG states."""
        layout, config = self.layout, self.config
        stages = layout.stage_layers(config.num_layers)
        last = len(stages) - 1
        rng: dict[RankCoord, Any] = {}
        for tp in range(layout.tp):
            for ep in range(layout.ep):
                rank = RankCoord(pp=last % layout.pp, tp=tp, ep=ep)
                # Megatron's output layer always has an (empty) extra state in module state dicts.
                self._models[rank][last // layout.pp].setdefault("output_layer._extra_state", None)
        for text, value in sorted(self.common.objects.items()):
            key = ObjectKey.parse(text)
            if key is None:
                continue
            if key.module == "rng_state":
                for rank in ranks(layout):
                    if (rank.pp, rank.tp, rank.ep)[: len(key.offsets)] == key.offsets and len(key.offsets) >= 2:
                        rng[rank] = value
                continue
            if key.layer is None:
                continue
            pp, vstage, local_layer = layout.chunk_of_layer(config.num_layers, key.layer)
            ep_ranks, local_expert = list(range(layout.ep)), None
            if key.expert is not None:
                per_rank = key.num_experts // layout.ep
                ep_ranks, local_expert = [key.expert // per_rank], key.expert % per_rank
            name = _localize(key.module, local_layer, local_expert)
            for tp in range(layout.tp):
                for ep in ep_ranks:
                    self._models[RankCoord(pp=pp, tp=tp, ep=ep)][vstage][name] = value
        return rng

    def sync(self) -> None:
        for stream in self._streams.values():
            stream.sync()
        if self.sink is not None:
            self.sink.sync()

    def restore(self, facts: list[Any]) -> None:
        """Take the local tensors of `facts` (each `[rank file, model chunk, key, CRC-32 of its record]`) as written,
        and hand the optimizer sink its own."""
        sunk = [fact for fact in facts if self.sink is not None and self.sink.owns(fact)]
        own = [fact for fact in facts if not (self.sink is not None and self.sink.owns(fact))]
        by_name = {f.legacy_dirname(self.layout): f for f in self._streams}
        for fact in own:
            if fact[0] == _PART:  # [tag, rank file, model chunk, key, byte offset, length, CRC-32]: `finish` seals the record
                name, vstage, key, start, length, crc = fact[1:]
                self._parts[(by_name[name], vstage, key)][start] = (length, crc)
            else:
                name, vstage, key, crc = fact
                self._streams[by_name[name]].restore(self._slots[(by_name[name], vstage, key)], crc)
            self._models[by_name[name]][vstage][key] = self._slots[(by_name[name], vstage, key)].stub
        self._facts.extend(own)
        if sunk:
            self.sink.restore(sunk)
            self._facts.extend(sunk)

    def part(self) -> list[Any]:
        """Rank 0 finishes every file; the others hand it what they wrote and close theirs."""
        self.sync()
        if self.rank != 0:
            for stream in self._streams.values():
                stream.close()
            if self.sink is not None:
                self.sink.close()
        return self.facts()

    def finish(self, manifest: Manifest, parts: list[Any] | None = None) -> None:
        """The optimizer sink's files first, then each rank file, the manifest and the tracker, last."""
        for part in parts or []:
            self.restore(part)
        if self.sink is not None:
            self.sink.finish()
        for place, parts in self._parts.items():
            file_rank, _, key = place
            crc = crc32_of_parts(parts, self._sizes[place], f"{file_rank.legacy_dirname(self.layout)} {key}")
            self._streams[file_rank].seal(self._slots[place], crc)
        rng = self._place_objects()
        args = args_namespace(self._target_args())
        for rank, stream in self._streams.items():
            state: dict[str, Any] = {"args": args, "iteration": stored_iteration(self.common.iteration)}
            state.update(self.common.extra)
            state.setdefault("checkpoint_version", 3.0)
            if rank in rng:
                state["rng_state"] = rng[rank]
            for key, model in zip(_model_keys(self.layout.vpp), self._models[rank]):
                state[key] = OrderedDict(sorted(model.items(), key=_module_order))
            stream.finish(state)
        manifest.save(self.directory)
        write_tracker(self.path, self.common.iteration)


def _local_groups(pieces: list[Piece]) -> list[list[Piece]]:
    """A slab's pieces by the local tensor holding them: one per rank (model chunk included) and alias, as
    a slab is one layer's (and expert's), so `local_name` is the same throughout a group."""
    groups: dict[tuple[RankCoord, str | None], list[Piece]] = defaultdict(list)
    for piece in pieces:
        groups[(piece.rank, piece.alias)].append(piece)
    return list(groups.values())


def _module_order(item: tuple[str, Any]) -> tuple[int, int, str]:
    """Embedding, layers in order, final norm, output layer: the order of Megatron's own state dicts."""
    name = item[0]
    match = _LOCAL_LAYER.match(name)
    if name.startswith("embedding."):
        return (0, 0, name)
    if match:
        return (1, int(match.group("index")), name)
    if name.startswith("output_layer."):
        return (3, 0, name)
    return (2, 0, name)
