"""Megatron-LM's legacy format: one `torch.save` per model-parallel rank, stage-local layer numbers.

`iter_N/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt`, each holding `args`, `iteration`
and `model` (or `model0..N` with virtual pipeline stages). Read with `torch.load(mmap=True)` so only
the bytes a region needs are touched; written with `StreamingTorchSave`, one tensor at a time.
"""

from __future__ import annotations

import re
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any

import torch

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.formats.base import (
    CheckpointReader,
    CheckpointWriter,
    CommonState,
    Manifest,
    args_for_layout,
    layout_from_args,
)
from reshard.formats.megatron_tree import args_dict, args_namespace, iteration_dirname, locate, write_tracker
from reshard.formats.torch_blob import StreamingTorchSave
from reshard.layout import Layout, RankCoord, ranks
from reshard.logical import TensorSpec, describe, is_extra_state
from reshard.sharding import Piece, Region, intersect, pieces, region_size, shift, to_slices

RANK_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LOCAL_LAYER = re.compile(r"^(?P<head>(?:.*\.)?decoder\.layers\.)(?P<index>\d+)\.(?P<tail>.+)$")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(?P<index>\d+)\.")

# Transformer-Engine (canonical) parameter names -> Megatron-Core local-spec names. The local spec
# keeps separate norm modules where Transformer Engine fuses them into the next linear layer.
LOCAL_SPEC_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
TE_NAMES = {local: te for te, local in LOCAL_SPEC_NAMES.items()}
# Keys of a rank file that are not model state and are carried as common state.
_NOT_COMMON = ("args", "iteration", "rng_state", "optimizer", "model")


def is_legacy(path: Path) -> bool:
    tree = locate(path) if path.is_dir() else None
    return tree is not None and any(_RANK_DIR.match(p.name) for p in tree.iteration_dir.iterdir())


def uses_te_names(args: dict[str, Any]) -> bool:
    """Megatron-LM's default implementation is Transformer Engine; `local` keeps separate norms."""
    return args.get("transformer_impl", "transformer_engine") != "local"


def local_name(spec: TensorSpec, piece: Piece, te_names: bool) -> str:
    """The name of a piece in its rank's `model` state dict."""
    if piece.alias:
        return piece.alias
    if not (spec.stacked or spec.layer is not None):
        return spec.name
    match = re.match(r"^(?P<head>(?:.*\.)?decoder\.layers\.)(?:\d+\.)?(?P<tail>.+)$", spec.name)
    assert match is not None
    tail = match.group("tail")
    if not te_names:
        tail = LOCAL_SPEC_NAMES.get(tail, tail)
    if piece.local_expert is not None:
        tail = tail.replace("mlp.experts.experts.", f"mlp.experts.local_experts.{piece.local_expert}.", 1)
    return f"{match.group('head')}{piece.local_layer}.{tail}"


def _logical_name(name: str) -> tuple[str, int | None]:
    """Local name -> (logical name without layer index, global-independent local layer index)."""
    match = _LOCAL_LAYER.match(name)
    if not match:
        return name, None
    tail = TE_NAMES.get(match.group("tail"), match.group("tail"))
    tail = _LOCAL_EXPERT.sub("mlp.experts.experts.", tail)
    return f"{match.group('head')}{tail}", int(match.group("index"))


def _model_keys(vpp: int) -> list[str]:
    return ["model"] if vpp == 1 else [f"model{i}" for i in range(vpp)]


class LegacyReader(CheckpointReader):
    format_name = "legacy"

    def __init__(self, path: Path):
        tree = locate(path)
        if tree is None or not is_legacy(path):
            raise ReshardError(f"{path} is not a legacy Megatron checkpoint (no mp_rank_* directories)")
        self.path, self.tree = path, tree
        first = self._load_path(self._rank_file(sorted(p.name for p in tree.iteration_dir.iterdir() if _RANK_DIR.match(p.name))[0]))
        args = args_dict(first.get("args"))
        self.config = ModelConfig.from_megatron_args(args)
        self.layout = layout_from_args(args)
        self.te_names = uses_te_names(args)
        self._states: dict[RankCoord, dict[str, Any]] = {}
        for rank in ranks(self.layout):
            if not (tree.iteration_dir / rank.legacy_dirname(self.layout) / RANK_FILE).is_file():
                raise ReshardError(
                    f"{tree.iteration_dir / rank.legacy_dirname(self.layout) / RANK_FILE} is missing but args say {self.layout}: the checkpoint is incomplete"
                )
        extra = {k: v for k, v in first.items() if k not in _NOT_COMMON and not k.startswith("model")}
        dropped = [k for k in ("rng_state", "optimizer") if k in first]
        self.common = CommonState(args=args, iteration=first.get("iteration", tree.iteration), extra=extra, dropped=dropped)
        self.manifest = Manifest.load(tree.iteration_dir)
        self.specs = self._discover()
        self._pieces: dict[str, list[Piece]] = {}

    def _rank_file(self, dirname: str) -> Path:
        return self.tree.iteration_dir / dirname / RANK_FILE

    @staticmethod
    def _load_path(path: Path) -> dict[str, Any]:
        try:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception as exc:
            raise ReshardError(f"{path} cannot be loaded ({exc.__class__.__name__}): the file is truncated or damaged") from None

    def _state(self, rank: RankCoord) -> dict[str, Any]:
        key = RankCoord(pp=rank.pp, tp=rank.tp, ep=rank.ep)
        if key not in self._states:
            self._states[key] = self._load_path(self._rank_file(key.legacy_dirname(self.layout)))
        return self._states[key]

    def _model(self, rank: RankCoord) -> dict[str, torch.Tensor]:
        state = self._state(rank)
        key = _model_keys(self.layout.vpp)[rank.vstage]
        if key not in state:
            raise ReshardError(f"{self._rank_file(rank.legacy_dirname(self.layout))} has no {key!r}: args say VPP={self.layout.vpp}")
        return state[key]

    def _discover(self) -> dict[str, TensorSpec]:
        """Logical tensors from the tp=0, ep=0 ranks of every stage (other ranks hold the same names)."""
        config, layout = self.config, self.layout
        stages = layout.stage_layers(config.num_layers)
        per_layer: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
        singles: dict[str, torch.Tensor] = {}
        for chunk, layers in enumerate(stages):
            rank = RankCoord(pp=chunk % layout.pp, tp=0, ep=0, vstage=chunk // layout.pp)
            for name, tensor in self._model(rank).items():
                if not isinstance(tensor, torch.Tensor) or is_extra_state(name):
                    continue
                if name == "output_layer.weight" and config.tied_embeddings:
                    continue  # the last stage's copy of the tied embedding
                logical, local_layer = _logical_name(name)
                if local_layer is None:
                    singles[logical] = tensor
                else:
                    per_layer[logical][layers.start + local_layer] = tensor
        specs: dict[str, TensorSpec] = {}
        for name, tensor in singles.items():
            specs[name] = self._global_spec(name, tensor, layer_axis=False)
        for name, by_layer in per_layer.items():
            if len(by_layer) == config.num_layers:
                specs[name] = self._global_spec(name, next(iter(by_layer.values())), layer_axis=True)
            else:  # heterogeneous stack: one logical tensor per layer, as torch_dist names them
                for layer, tensor in by_layer.items():
                    per_name = name.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
                    specs[per_name] = self._global_spec(per_name, tensor, layer_axis=False)
        return specs

    def _global_spec(self, name: str, local: torch.Tensor, layer_axis: bool) -> TensorSpec:
        """The logical spec of a per-rank tensor: undo the TP split and put back layer/expert axes."""
        dtype = str(local.dtype).removeprefix("torch.")
        probe = describe(name, (1,) * (int(layer_axis) + 1 + local.dim()), dtype, self.config)
        dims = list(local.shape)
        if probe.tp_axis is not None and probe.tp_axis - probe.prefix_axes < len(dims):
            dims[probe.tp_axis - probe.prefix_axes] *= self.layout.expert_tp if probe.experts else self.layout.tp
        prefix = ([self.config.num_layers] if layer_axis else []) + ([self.config.num_experts] if probe.experts else [])
        return describe(name, tuple(prefix + dims), dtype, self.config)

    def read(self, name: str, region: Region) -> torch.Tensor:
        spec = self.specs[name]
        if name not in self._pieces:
            self._pieces[name] = [p for p in pieces(spec, self.config, self.layout) if p.primary]
        out = torch.empty([b - a for a, b in region], dtype=getattr(torch, spec.dtype))
        filled = 0
        for piece in self._pieces[name]:
            inside = intersect(piece.region, region)
            if inside is None:
                continue
            local_key = local_name(spec, piece, self.te_names)
            model = self._model(piece.rank)
            if local_key not in model:
                raise ReshardError(f"{self._rank_file(piece.rank.legacy_dirname(self.layout))} lacks {local_key}: the checkpoint is incomplete")
            local = model[local_key]
            if tuple(local.shape) != piece.local_shape:
                raise ReshardError(f"{local_key} has shape {tuple(local.shape)} on rank {piece.rank}, expected {piece.local_shape}")
            within_piece = shift(inside, piece.region)
            # piece.region and the local region have the same extent; drop the layer/expert axes.
            local_region = tuple(
                (l0 + a, l0 + b) for (a, b), (l0, _) in zip(within_piece[len(within_piece) - len(piece.local_region) :], piece.local_region)
            )
            out[to_slices(shift(inside, region))] = local[to_slices(local_region)].reshape([b - a for a, b in inside])
            filled += region_size(inside)
        if filled != region_size(region):
            raise ReshardError(f"{name}: the rank files do not cover the tensor; the checkpoint is incomplete")
        return out

    def close(self) -> None:
        self._states.clear()


class LegacyWriter(CheckpointWriter):
    format_name = "legacy"

    def __init__(self, *args: Any, te_names: bool | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.te_names = uses_te_names(self.common.args) if te_names is None else te_names
        self.directory = self.path / iteration_dirname(self.common.iteration)
        self._streams: dict[RankCoord, StreamingTorchSave] = {}
        self._models: dict[RankCoord, list[dict[str, Any]]] = {}
        for rank in ranks(self.layout):
            rank_dir = self.directory / rank.legacy_dirname(self.layout)
            rank_dir.mkdir(parents=True, exist_ok=True)
            self._streams[rank] = StreamingTorchSave(rank_dir / RANK_FILE)
            self._models[rank] = [OrderedDict() for _ in range(self.layout.vpp)]

    def write(self, spec: TensorSpec, slab: Region, data: torch.Tensor, pieces: list[Piece]) -> None:
        grouped: dict[tuple[RankCoord, int, str], list[Piece]] = defaultdict(list)
        for piece in pieces:
            file_rank = RankCoord(pp=piece.rank.pp, tp=piece.rank.tp, ep=piece.rank.ep)
            grouped[(file_rank, piece.rank.vstage, local_name(spec, piece, self.te_names))].append(piece)
        for (rank, vstage, key), group in grouped.items():
            local = torch.empty(group[0].local_shape, dtype=data.dtype)
            for piece in group:
                values = data[to_slices(shift(piece.region, slab))]
                local[to_slices(piece.local_region)] = values.reshape([b - a for a, b in piece.local_region])
            self._models[rank][vstage][key] = self._streams[rank].add(local)

    def finish(self, manifest: Manifest) -> None:
        args = args_namespace(
            args_for_layout(self.common.args, self.layout, self.config, "torch")
            | {"transformer_impl": "transformer_engine" if self.te_names else "local"}
        )
        for rank, stream in self._streams.items():
            state: dict[str, Any] = {"args": args, "iteration": self.common.iteration}
            state.update(self.common.extra)
            state.setdefault("checkpoint_version", 3.0)
            models = [OrderedDict(sorted(m.items(), key=_module_order)) for m in self._models[rank]]
            if self.layout.vpp == 1:
                state["model"] = models[0]
            else:
                for i, model in enumerate(models):
                    state[f"model{i}"] = model
            stream.finish(state)
        manifest.save(self.directory)
        write_tracker(self.path, self.common.iteration)


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
