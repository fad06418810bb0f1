"""verl's Megatron checkpoints: a step of the actor (or critic) as verl's MegatronCheckpointManager saves it.

    <run>/latest_checkpointed_iteration.txt         the newest step's number
    <run>/global_step_<N>/actor/
        ckpt_contents.json                          schema 2: what was saved where, written last (rank 0)
        transformer_config.json                     megatron-core's TransformerConfig (parallel sizes, architecture)
        model/dist_ckpt/                            dist_checkpointing.save of {"model": ...} ({"model0": ...} under VPP)
        model/huggingface/                          the HF config.json and tokenizer
        optimizer/dist_ckpt/                        {"optimizer": ..., "lr_scheduler": ...}
        extra/dist_ckpt/                            {"rng_state": ...}

Layout v1 (verl up to early 2026) has no manifest: one `dist_ckpt/` holds all of it, `huggingface/` beside it.

No Megatron-LM args are saved: the architecture is the HF config's (mapped by its family's converter), the layout
transformer_config.json's, the data-parallel size the manifest's world size over it. The step's model, optimizer and
RNG directories are read as one torch_dist checkpoint (`TorchDistReader`), their .metadata merged with each file named
from the step directory; verl's `lr_scheduler` is carried as Megatron-LM's `opt_param_scheduler`.

Written (`VerlWriter`, from a v2 step only: the HF config and transformer_config.json come from it) as layout v2 at
the target layout, for verl to resume with its config's parallel sizes changed alike.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from reshard.config import ModelConfig
from reshard.documents import read_json
from reshard.errors import ReshardError
from reshard.formats.base import Manifest
from reshard.formats.megatron_dist import METADATA_JSON, TorchDistReader, TorchDistWriter
from reshard.formats.megatron_tree import TRACKER, MegatronTree, write_tracker
from reshard.formats.model_args import _RENAMED, args_from_file
from reshard.layout import megatron_arg
from reshard.naming import is_layout_bound
from reshard.optim.dp_reshardable import is_dp_reshardable
from reshard.optim.state import OptimizerRefusal
from reshard.paths import confined
from reshard.torchfile import dcp_metadata
from reshard.torchfile.archive_writer import save_archive
from reshard.torchfile.dcp_metadata import DcpMetadata
from reshard.torchfile.payloads import load_screened

MANIFEST = "ckpt_contents.json"
TRANSFORMER_CONFIG = "transformer_config.json"
SCHEMA_VERSION = 2
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_ROLES = ("actor", "critic")
_DIST = "megatron_dist_checkpoint"
# transformer_config.json's fields that say the layout, and the architecture fields checked against the HF config
_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
             "virtual_pipeline_model_parallel_size", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
             "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
             "context_parallel_size")
_ARCHITECTURE = {"num_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
                 "ffn_hidden_size": "ffn_hidden_size", "num_query_groups": "groups", "kv_channels": "head_dim",
                 "num_moe_experts": "num_experts", "moe_ffn_hidden_size": "moe_ffn_hidden_size"}


@dataclass(frozen=True)
class VerlStep:
    """Where a verl step's parts lie; every path inside `role_dir`."""

    root: Path  # the run's checkpoint directory (the tracker's), or the step's parent
    role_dir: Path  # global_step_<N>/actor
    step: int
    version: int  # the layout: 2 (ckpt_contents.json) or 1
    model_dir: Path  # the model's dist_checkpointing directory
    optimizer_dir: Path | None  # the optimizer's (v1: the model's own)
    extra_dir: Path | None  # the RNG state's (v1: the model's own)
    hf_dir: Path
    transformer_config: Path
    world_size: int | None  # v2's manifest records it; v1 does not
    manifest: dict[str, Any] | None = None  # v2's ckpt_contents.json

    @property
    def dist_dirs(self) -> list[Path]:
        """The dist_checkpointing directories, each once."""
        return list(dict.fromkeys(d for d in (self.model_dir, self.optimizer_dir, self.extra_dir) if d is not None))


def _step_dir(path: Path) -> Path | None:
    """The global_step_<N> directory `path` names: itself, its parent (a role directory), or the run's newest
    (its tracker's)."""
    if _STEP_DIR.match(path.name):
        return path
    if path.name in _ROLES and _STEP_DIR.match(path.parent.name):
        return path.parent
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        return path / f"global_step_{int(text)}" if text.isdigit() and (path / f"global_step_{int(text)}").is_dir() else None
    steps = [(int(m.group(1)), p) for p in path.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()] if path.is_dir() else []
    return max(steps)[1] if steps else None  # without the tracker (a copied run), the newest step


def _role_dir(path: Path) -> Path | None:
    if path.name in _ROLES or (path / MANIFEST).is_file():
        return path
    step = _step_dir(path)
    found = [step / role for role in _ROLES if step is not None and (step / role).is_dir()]
    return found[0] if found else None


def _is_v1(role: Path) -> bool:
    return (role / "dist_ckpt" / ".metadata").is_file() and (role / TRANSFORMER_CONFIG).is_file()


def is_verl(path: Path) -> bool:
    """A verl step, or one whose save did not finish (model/ but no manifest yet), which `find_step` refuses by name."""
    role = _role_dir(path)
    return role is not None and ((role / MANIFEST).is_file() or (role / "model" / "dist_ckpt").is_dir() or _is_v1(role))


def find_step(path: Path) -> VerlStep:
    """The verl step at `path` (the run's directory, a global_step_<N>, or its actor/critic directory)."""
    role = _role_dir(path)
    if role is None or not is_verl(path):
        raise ReshardError(f"{path} is not a verl Megatron checkpoint (no {MANIFEST}, no dist_ckpt/ with {TRANSFORMER_CONFIG})")
    step_dir = role.parent
    root = step_dir.parent
    number = int(m.group(1)) if (m := _STEP_DIR.match(step_dir.name)) else 0
    if not (role / MANIFEST).is_file() and not _is_v1(role):
        raise ReshardError(f"{role} has model/dist_ckpt but no {MANIFEST}, which verl writes last: the save did not finish")
    if not (role / MANIFEST).is_file():
        dist = role / "dist_ckpt"
        return VerlStep(root, role, number, 1, dist, dist, dist, role / "huggingface", role / TRANSFORMER_CONFIG, None)
    manifest = read_json(role / MANIFEST)
    said = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if said != SCHEMA_VERSION:
        raise ReshardError(f"{role / MANIFEST}: schema_version is {said!r}; reshard reads verl's schema {SCHEMA_VERSION}")
    if not isinstance(manifest.get("contents"), dict):
        raise ReshardError(f"{role / MANIFEST}: contents is not a mapping of what was saved where; the manifest is damaged")
    contents = manifest["contents"]
    model = _entry(role, contents, "model", required=True)
    if model["format"] != _DIST:
        raise ReshardError(
            f"{role / MANIFEST}: contents.model is {model['format']!r} at {model['path']} (verl's mbridge save): the model is "
            "already HF weights; convert that directory"
        )
    optimizer = _entry(role, contents, "optimizer", required=False)
    extra = _entry(role, contents, "rng_state", required=False)
    hf = _entry(role, contents, "hf_config", required=True)
    config = _entry(role, contents, "transformer_config", required=True)
    world = manifest.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise ReshardError(f"{role / MANIFEST}: world_size is {world!r}, not a number of ranks")
    step = manifest.get("global_step", number)
    return VerlStep(root, role, step if isinstance(step, int) else number, 2, model["where"], optimizer["where"] if optimizer else None,
                    extra["where"] if extra else None, hf["where"], config["where"], world, manifest)


def _entry(role: Path, contents: dict, name: str, required: bool) -> dict[str, Any] | None:
    """contents.<name> of the manifest, its path confined to the step's role directory (`where`)."""
    entry = contents.get(name)
    if entry is None and not required:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        raise ReshardError(f"{role / MANIFEST}: contents.{name} has no path; the manifest is damaged")
    where = confined(role, entry["path"])
    if not where.exists():
        raise ReshardError(f"{role / MANIFEST}: contents.{name} names {entry['path']}, which does not exist: the step is incomplete")
    return {**entry, "where": where, "format": entry.get("format")}


def merged_metadata(role_dir: Path, directories: list[Path]) -> DcpMetadata:
    """The .metadata of `directories` as one, each storage file named from `role_dir`; a key in two is refused."""
    out = DcpMetadata()
    for directory in directories:
        if not (directory / ".metadata").is_file():
            raise ReshardError(f"{directory} has no .metadata: the step's dist_checkpointing save is incomplete")
        found = dcp_metadata.load(directory / ".metadata")
        clash = sorted(set(found.tensors) & set(out.tensors) | set(found.objects) & set(out.objects))
        if clash:
            raise ReshardError(f"{directory}: {clash[0]} is saved in two of the step's directories; refusing to choose")
        prefix = directory.relative_to(role_dir).as_posix()
        out.tensors.update(found.tensors)
        out.objects.extend(found.objects)
        out.flattened.update(found.flattened)
        out.storage.update({key: replace(info, relative_path=f"{prefix}/{info.relative_path}") for key, info in found.storage.items()})
    return out


class VerlReader(TorchDistReader):
    """A verl step, read as the torch_dist checkpoint its model and optimizer directories make together."""

    format_name = "verl"

    def __init__(self, path: Path):
        self.step = find_step(path)
        metadata = merged_metadata(self.step.role_dir, self.step.dist_dirs)
        if self.step.world_size is None:  # layout v1 records none: the ranks that wrote its dist_ckpt are the world
            self.step = replace(self.step, world_size=metadata.saving_ranks())
        undecodable = self._undecodable(metadata)
        self._open(path, MegatronTree(self.step.root, self.step.role_dir, self.step.step), metadata, None, True)
        self.tokenizer_dir = self.step.hf_dir
        if undecodable:
            self.unsupported_optimizer += undecodable
            self.optimizer_refusal = OptimizerRefusal(
                "dp_reshardable buckets",
                f"{self.step.role_dir}: verl's layout v1 records no world size, which decoding its dp_reshardable optimizer state needs, "
                "and its files do not tell it (not each rank's own __<rank>_<n>.distcp)",
            )

    def _undecodable(self, metadata: DcpMetadata) -> list[str]:
        """The DistributedOptimizer buckets of a step whose data-parallel size nothing tells (v1), taken out of
        `metadata` so that the model still reads."""
        if self.step.world_size is not None:
            return []
        keys = [key for key in (*metadata.tensors, *metadata.objects) if is_dp_reshardable(key)]
        for key in keys:
            metadata.tensors.pop(key, None)
        metadata.objects[:] = [key for key in metadata.objects if key not in keys]
        metadata.storage = {k: v for k, v in metadata.storage.items() if k[0] not in keys}
        return sorted(set(keys))

    def _common_state(self, directory: Path, objects: dict) -> dict[str, Any]:
        """common.pt of the step's directories, `lr_scheduler` named as Megatron-LM names it."""
        common: dict[str, Any] = {"iteration": self.step.step}
        for dist in self.step.dist_dirs:
            path = dist / "common.pt"
            if not path.is_file():
                raise ReshardError(f"{dist} has no common.pt: not a dist_checkpointing save reshard reads")
            found = load_screened(path, str(path))
            if not isinstance(found, dict):
                raise ReshardError(f"{path} does not hold a dist_checkpointing common state: the step is damaged")
            common.update(found)
        if "lr_scheduler" in common:
            common["opt_param_scheduler"] = common.pop("lr_scheduler")
        return common

    def _architecture(self, args: Any, config_file: Path | None, needed: bool) -> dict[str, Any]:
        """The HF config's architecture at transformer_config.json's layout (each checked against the other)."""
        hf = self.step.hf_dir / "config.json"
        if not hf.is_file():
            raise ReshardError(f"{hf} does not exist: verl's rank 0 writes the HF config there; the step is incomplete")
        out = args_from_file(hf)
        tc = read_json(self.step.transformer_config)
        if not isinstance(tc, dict):
            raise ReshardError(f"{self.step.transformer_config} is not a TransformerConfig as verl writes it (not a mapping)")
        out.update({_RENAMED.get(key, key): tc[key] for key in _PARALLEL if tc.get(key) is not None})
        embedding = self.metadata.tensors.get("embedding.word_embeddings.weight")
        if embedding is not None:  # its padding is the saving run's choice, not the architecture's
            out["padded_vocab_size"] = embedding.size[0]
        self._check_architecture(out, tc)
        model_parallel = out.get(megatron_arg("tp"), 1) * out.get(megatron_arg("pp"), 1) * (out.get("context_parallel_size") or 1)
        if self.step.world_size is not None:
            if self.step.world_size % model_parallel:
                raise ReshardError(f"{self.step.role_dir}: its world size {self.step.world_size} (the manifest's, or v1's writing ranks) "
                                   "is no multiple of TP x PP x CP "
                                   f"= {model_parallel} ({TRANSFORMER_CONFIG}'s): the two disagree")
            out["data_parallel_size"] = self.step.world_size // model_parallel
        # verl's DDP: gradients reduced in fp32, not overlapped (verl/utils/megatron_utils.py)
        out.update(use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False)
        out["moe_grouped_gemm"] = bool(tc.get("moe_grouped_gemm"))
        if tc.get("transformer_impl") is not None:  # else the stored names tell (TorchDistReader), TE's spec by default
            out["transformer_impl"] = tc["transformer_impl"]
        out["params_dtype"] = str(tc.get("params_dtype", "torch.float32")).removeprefix("torch.")
        return out

    def _check_architecture(self, args: dict[str, Any], tc: dict[str, Any]) -> None:
        config = ModelConfig.from_megatron_args(args)
        for theirs, ours in _ARCHITECTURE.items():
            said = tc.get(theirs)
            if ours == "ffn_hidden_size" and all(config.moe_layers):  # a model of MoE layers only has no dense MLP to size
                continue
            if said is not None and said != getattr(config, ours):
                raise ReshardError(
                    f"{self.step.transformer_config}: {theirs} is {said}, but {self.step.hf_dir / 'config.json'} says "
                    f"{getattr(config, ours)}: the step's two configs disagree; refusing to guess"
                )


_MODEL_DIR, _OPTIMIZER_DIR, _EXTRA_DIR, _HF_DIR = "model/dist_ckpt", "optimizer/dist_ckpt", "extra/dist_ckpt", "model/huggingface"
# transformer_config.json's parallel sizes, from a Layout's fields
_LAYOUT_FIELDS = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp", "expert_model_parallel_size": "ep",
                  "expert_tensor_parallel_size": "expert_tp", "num_layers_in_first_pipeline_stage": "first_stage_layers",
                  "num_layers_in_last_pipeline_stage": "last_stage_layers"}


def _directory_of(key: str) -> str:
    """The step directory a stored key belongs in, as verl's three saves divide them."""
    if key.startswith("optimizer.") or is_dp_reshardable(key):
        return _OPTIMIZER_DIR
    return _EXTRA_DIR if is_layout_bound(key) else _MODEL_DIR


def source_step(tokenizer_dir: Path | None) -> VerlStep:
    """The verl step a conversion reads, found from its reader's `tokenizer_dir` (the step's HF directory)."""
    role = next((p for p in (tokenizer_dir.parents if tokenizer_dir else []) if _role_dir(p) == p and is_verl(p)), None)
    if role is None:
        raise ReshardError("--to-format verl writes a verl step from a verl step (its transformer_config.json and HF config): convert from one")
    step = find_step(role)
    if step.version != SCHEMA_VERSION:
        raise ReshardError(f"{role} is in verl's layout v1; migrate it with verl's scripts/migrate_megatron_checkpoint_layout.py, then convert")
    return step


class VerlWriter(TorchDistWriter):
    """A verl step (layout v2) at the target layout, for verl to resume at its new size: TorchDistWriter's records, each
    in a file of the directory verl keeps its kind in (`_directory_of`: model, optimizer, RNG state), each directory with
    its own .metadata and common.pt as verl's dist_checkpointing saves make them. The optimizer state is written as
    dp_reshardable buckets (verl's default form) at the target's data-parallel size; the RNG state only where the
    (PP, TP) ranks are unchanged. The source step's HF config and tokenizer are carried untouched, its
    transformer_config.json and ckpt_contents.json with the new sizes, the manifest last."""

    format_name = "verl"

    def _iteration_directory(self) -> Path:
        self.source = source_step(self.options.tokenizer_from)
        return self.path / f"global_step_{self.common.iteration}" / self.source.role_dir.name

    def _first_file(self, key: str) -> int:
        return (_MODEL_DIR, _OPTIMIZER_DIR, _EXTRA_DIR).index(_directory_of(key)) * len(self._file_index)

    def _name(self, index: int) -> str:
        kind, rank = divmod(index, len(self._file_index))
        return f"{(_MODEL_DIR, _OPTIMIZER_DIR, _EXTRA_DIR)[kind]}/__{rank}_{self.rank}.distcp"

    def _open(self, index: int, size: int = 0) -> None:
        (self.directory / self._name(index)).parent.mkdir(parents=True, exist_ok=True)
        super()._open(index, size)

    def finish(self, manifest: Manifest, parts: list[Any] | None = None) -> None:
        metadata = self._finish_records(parts)
        extra = self.common.extra
        commons = {_MODEL_DIR: {}, _OPTIMIZER_DIR: {"optimizer": extra.get("optimizer"), "lr_scheduler": extra.get("opt_param_scheduler")},
                   _EXTRA_DIR: {}}
        written = [d for d in commons if d == _MODEL_DIR or any(_directory_of(key) == d for key, _ in metadata.storage)]
        for directory in written:
            prefix = directory + "/"
            mine = {key: replace(info, relative_path=info.relative_path.removeprefix(prefix))
                    for key, info in metadata.storage.items() if _directory_of(key[0]) == directory}
            tensors = {key: entry for key, entry in metadata.tensors.items() if _directory_of(key) == directory}
            objects = [key for key in metadata.objects if _directory_of(key) == directory]
            (self.directory / directory).mkdir(parents=True, exist_ok=True)
            dcp_metadata.save(self.directory / directory / ".metadata", DcpMetadata(tensors, objects, mine))
            with open(self.directory / directory / "common.pt", "wb") as f:
                save_archive({k: v for k, v in commons[directory].items() if v is not None}, f)
            (self.directory / directory / "metadata.json").write_text(json.dumps(METADATA_JSON))
        shutil.copytree(self.source.hf_dir, self.directory / _HF_DIR, symlinks=False)
        self._write_configs(written)
        manifest.save(self.directory)
        write_tracker(self.path, self.common.iteration)

    def _write_configs(self, written: list[str]) -> None:
        """transformer_config.json at the target's sizes, then ckpt_contents.json naming what was written."""
        tc = read_json(self.source.transformer_config)
        tc.update({field: getattr(self.layout, ours) for field, ours in _LAYOUT_FIELDS.items()})
        tc["virtual_pipeline_model_parallel_size"] = self.layout.vpp if self.layout.vpp > 1 else None
        (self.directory / TRANSFORMER_CONFIG).write_text(json.dumps(tc, indent=2))
        out = json.loads(json.dumps(self.source.manifest))
        dp = self.options.optimizer.dp if self.options.optimizer and self.options.optimizer.dp else self.common.args.get("data_parallel_size") or 1
        out["world_size"] = self.layout.tp * self.layout.pp * (tc.get("context_parallel_size") or 1) * dp
        places = {"model": _MODEL_DIR, "optimizer": _OPTIMIZER_DIR, "lr_scheduler": _OPTIMIZER_DIR, "rng_state": _EXTRA_DIR,
                  "transformer_config": TRANSFORMER_CONFIG, "hf_config": _HF_DIR, "tokenizer": _HF_DIR}
        kept = (*written, TRANSFORMER_CONFIG, _HF_DIR)
        out["contents"] = {name: dict(entry, path=places[name]) for name, entry in out["contents"].items() if places.get(name) in kept}
        out["directories"] = {name: said for name, said in out.get("directories", {}).items() if name in kept}
        needs = {"optimizer": _OPTIMIZER_DIR, "extra": _EXTRA_DIR}
        out["save_contents"] = [name for name in out.get("save_contents", []) if needs.get(name, _MODEL_DIR) in written]
        (self.directory / MANIFEST).write_text(json.dumps(out, indent=2))
