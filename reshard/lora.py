"""LoRA adapters as Megatron-Bridge saves them (its `LoRA` PEFT, also what NeMo-RL's Megatron policy saves): a torch_dist
checkpoint of the adapter weights only, its `run_config.yaml` recording the `peft:` section (dim, alpha, targets).
ms-swift's (Megatron-SWIFT's `--tuner_type lora`, `formats.ms_swift`) is the same model under peft's names
(`X.lora_A.default.weight`, `X.lora_B.default.weight`) with its settings in args.json, except that linear_fc1's B is
stored as each TP rank's own [gate; up] rows one after another (`SWIFT`); its routed experts' (TEGroupedLinear's, one A
and B per gemm) are on the global expert axis as Bridge's are.

Each adapted linear `X.weight` has `X.adapter.linear_in.weight` (A: [dim, in]) and `X.adapter.linear_out.weight`
(B: [out, dim]) beside it, and computes `X(x) + alpha/dim * B(A(x))` (dropout aside). Read as global tensors, A and B
are in the base weight's own Megatron layout (B's rows as linear_qkv's: per GQA group q heads, k, v; as linear_fc1's:
[gate; up]), so the merged weight is `W + alpha/dim * B @ A` computed there, per TP shard alike, before any mapping to
HF splits it. An MoE model's experts (SequentialMLP's, each expert's linear_fc1/linear_fc2 matched by Bridge's targets)
have one adapter each, saved on the global expert axis as the experts' weights are (`[layer, expert, ...]`): merged
expert by expert alike. `MergedReader` is the base model so merged, any source format and any target.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reshard.documents import read_yaml
from reshard.dtypes import numpy_dtype
from reshard.errors import ReshardError
from reshard.formats import ms_swift
from reshard.formats.base import CheckpointReader
from reshard.formats.megatron_tree import locate
from reshard.formats.model_args import RUN_CONFIG
from reshard.layout import Layout
from reshard.sharding import Region

IN, OUT = ".adapter.linear_in.weight", ".adapter.linear_out.weight"


@dataclass(frozen=True)
class AdapterNames:
    """How a framework's save names the A and B of an adapted linear `X` (beside `X.weight`), and whether linear_fc1's
    B is stored as each TP rank's own [gate; up] rows (no swiglu sharded factory on it) rather than the base's [gate; up]."""

    a: str
    b: str
    fc1_b_per_rank: bool = False


BRIDGE = AdapterNames(IN, OUT)  # its linear_out of fc1 takes swiglu's factory, as the base weight does
# mcore-bridge's LoraParallelLinear under peft (adapter `default`): swiglu's factory goes to `base_layer.weight` only
# Its routed experts' (TEGroupedLinear's, one A and B per gemm) are saved on the global expert axis, as Bridge's are, whole:
# LoraParallelLinear refuses expert TP > 1, so their fc1 lora_B is the base's [gate; up]
SWIFT = AdapterNames(".lora_A.default.weight", ".lora_B.default.weight", fc1_b_per_rank=True)


@dataclass(frozen=True)
class LoraConfig:
    """The `peft:` section of a Bridge save (or ms-swift's args.json): the rank and scale of its adapters, their names,
    and the TP they were saved at (which modules it adapts, its tensors say)."""

    dim: int
    alpha: float
    names: AdapterNames = BRIDGE
    saved_tp: int = 1

    @property
    def scale(self) -> float:
        return self.alpha / self.dim  # ParallelLinearAdapter's `alpha / dim`


def lora_config(path: Path) -> LoraConfig | None:
    """The LoRA settings of the Bridge save at `path` (a save, an iteration or a NeMo-RL step) or of ms-swift's, None if
    it is no PEFT save."""
    tree = locate(path) if path.is_dir() else None
    swift = ms_swift.saved_args(tree.root) if tree is not None else None
    if swift is not None:
        if not ms_swift.is_lora(swift, tree.root):
            return None
        rank_alpha = _rank_and_alpha(swift, ("lora_rank", "lora_alpha"), tree.root / ms_swift.ARGS_FILE)
        return LoraConfig(*rank_alpha, names=SWIFT, saved_tp=Layout.from_megatron_args(swift).tp)
    run_config = tree.iteration_dir / RUN_CONFIG if tree is not None else None
    if run_config is None or not run_config.is_file():
        return None
    peft = (read_yaml(run_config) or {}).get("peft")
    if not peft:
        return None
    target = str(peft.get("_target_", ""))
    if not target.endswith(".LoRA"):
        raise ReshardError(f"{run_config}: peft._target_ {target!r} is not Megatron-Bridge's LoRA (DoRA, canonical LoRA and "
                           "VLM LoRA are not read); merge it with Bridge")
    dim, alpha = _rank_and_alpha(peft, ("dim", "alpha"), run_config, "peft.")
    for field, why in (("normalize_moe_lora", "the experts' adapters have rank dim / moe_router_topk"),
                       ("experts_shared_outer_loras", "grouped experts share one lora_A of gate/up and one lora_B of down")):
        if peft.get(field):
            raise ReshardError(f"{run_config}: peft.{field} is true ({why}), which reshard does not merge; merge it with "
                               "Megatron-Bridge (export_hf_weights with merge_adapter_weights)")
    return LoraConfig(dim, alpha)


def _rank_and_alpha(section: dict, fields: tuple[str, str], where: Path, prefix: str = "") -> tuple[int, float]:
    """A save's LoRA rank and alpha, its `fields` of `section` (recorded in the file `where`)."""
    rank_field, alpha_field = (prefix + field for field in fields)
    try:
        dim, alpha = int(section[fields[0]]), float(section[fields[1]])
    except (KeyError, TypeError, ValueError) as err:
        raise ReshardError(f"{where}: {rank_field} and {alpha_field} must be numbers ({err})") from None
    if dim <= 0:
        raise ReshardError(f"{where}: {rank_field} is {dim}; a LoRA rank is positive")
    return dim, alpha


def adapted(adapter: CheckpointReader, names: AdapterNames = BRIDGE) -> list[str]:
    """The base weights `adapter` adapts (`X.weight` for each `X` + `names.a`), refusing what reshard does not merge by
    name."""
    found = []
    for name in adapter.specs:
        if name.endswith(names.a):
            found.append(name[: -len(names.a)] + ".weight")
        elif not name.endswith(names.b):
            raise ReshardError(f"{adapter.path}: tensor {name!r} of the adapter save is no LoRA {names.a[1:]} / {names.b[1:]}; "
                               "reshard merges LoRA's A and B only (not modules_to_save, DoRA or bias)")
    for name in found:  # the partition table has refused targets other than reshard's families' linears (`logical`)
        if name[: -len(".weight")] + names.b not in adapter.specs:
            raise ReshardError(f"{adapter.path}: {name[: -len('.weight')] + names.a} has no {names.b[1:]} beside it: the save is incomplete")
    return found


def per_rank_gate_up(b: np.ndarray, tp: int) -> np.ndarray:
    """linear_fc1's B stored as TP ranks' own [gate; up] rows one after another, in the base's [gate; up] order."""
    *lead, rows, rank = b.shape
    return b.reshape(*lead, tp, 2, rows // (2 * tp), rank).swapaxes(-4, -3).reshape(b.shape)


class MergedReader(CheckpointReader):
    """The base model with a LoRA adapter merged into it: every adapted weight reads as `W + alpha/dim * B @ A`."""

    format_name = "lora"

    def __init__(self, base: CheckpointReader, adapter: CheckpointReader, config: LoraConfig):
        self.base, self.adapter, self.lora = base, adapter, config
        self.path, self.config, self.layout = base.path, base.config, base.layout
        # the model only (a base's optimizer state is not the adapted model's); merged, the base's checksums do not hold
        self.specs = {name: spec for name, spec in base.specs.items() if not spec.is_optimizer}
        self.common, self.manifest = base.common, None
        self.tokenizer_dir, self.tokenizer_in_iteration = base.tokenizer_dir, base.tokenizer_in_iteration
        self.default_dtype = base.default_dtype
        self.targets = {name: name[: -len(".weight")] for name in adapted(adapter, config.names)}
        for name, stem in self.targets.items():
            self._check(name, stem)

    def _check(self, name: str, stem: str) -> None:
        spec = self.specs.get(name)
        if spec is None:
            raise ReshardError(f"the adapter {self.adapter.path} adapts {name}, which the base {self.base.path} does not have: "
                               "give the base model it was trained on")
        names = self.lora.names
        a, b = self.adapter.specs[stem + names.a].shape, self.adapter.specs[stem + names.b].shape
        lead, (out, inp) = spec.shape[:-2], spec.shape[-2:]
        if a != (*lead, self.lora.dim, inp) or b != (*lead, out, self.lora.dim):
            raise ReshardError(f"the adapter's {stem} (A {a}, B {b}) does not fit the base's {name} {spec.shape} "
                               f"at rank {self.lora.dim}: give the base model it was trained on")

    def a(self, stem: str, lead: list[tuple[int, int]], cols: tuple[int, int]) -> np.ndarray:
        """A's `cols` (the base weight's input columns), every rank."""
        return self.adapter.read(stem + self.lora.names.a, (*lead, (0, self.lora.dim), cols))

    def b(self, stem: str, lead: list[tuple[int, int]], rows: tuple[int, int]) -> np.ndarray:
        """B's `rows` of the base weight's own row order."""
        name, full = stem + self.lora.names.b, (0, self.lora.dim)
        per_rank = self.lora.names.fc1_b_per_rank and not self.adapter.specs[name].experts  # experts': ETP 1, whole
        if not (per_rank and self.lora.saved_tp > 1 and stem.endswith("linear_fc1") and self.config.swiglu):
            return self.adapter.read(name, (*lead, rows, full))
        whole = self.adapter.read(name, (*lead, (0, self.adapter.specs[name].shape[-2]), full))
        return per_rank_gate_up(whole, self.lora.saved_tp)[..., rows[0]:rows[1], :]

    def read(self, name: str, region: Region) -> np.ndarray:
        out = self.base.read(name, region)
        stem = self.targets.get(name)
        if stem is None:
            return out
        *lead, rows, cols = region
        a, b = self.a(stem, lead, cols).astype(np.float32), self.b(stem, lead, rows).astype(np.float32)
        merged = out.astype(np.float32) + np.float32(self.lora.scale) * np.matmul(b, a)
        return merged.astype(numpy_dtype(self.specs[name].dtype))

    def close(self) -> None:
        self.base.close()
        self.adapter.close()


def peft_tensors(merged: MergedReader) -> tuple[dict[str, np.ndarray], list[str]]:
    """The adapter in PEFT's names for the base's HF model, and the HF modules it adapts. Each HF projection a fused
    Megatron one holds (q/k/v of linear_qkv, gate/up of linear_fc1) gets the whole A and its rows of B, split by the
    family's own mapping of the base weight's rows."""
    from reshard.converters import family_for_model
    from reshard.converters.base import QKV, GatedMLP, Rename

    config = merged.config
    family = getattr(merged.base, "family", None) or family_for_model(config, merged.common.args)
    mappings = {m.megatron: m for m in family.mappings(config)}
    tensors: dict[str, np.ndarray] = {}
    for name, stem in merged.targets.items():
        mapping, spec = mappings.get(name), merged.specs[name]
        if not isinstance(mapping, (Rename, QKV, GatedMLP)):
            raise ReshardError(f"{name} maps to HF {family.model_type} as {type(mapping).__name__}, which a PEFT adapter cannot "
                               "hold; export the merged model instead (--to-format hf)")
        *lead, rows, cols = [(0, d) for d in spec.shape]
        a_all, b_all = merged.a(stem, lead, cols), merged.b(stem, lead, rows)
        if not spec.stacked:  # one layer's: given a layer axis, so that every adapter reads [layer, (expert,) ...]
            a_all, b_all = a_all[None], b_all[None]
        # an experts' LoRA has one adapter per expert, written per expert as Bridge's save_hf_adapter does (`experts.{e}.`)
        experts = range(a_all.shape[1]) if spec.experts else [None]
        for index, layer in enumerate(range(spec.shape[0]) if spec.stacked else [spec.layer]):
            for expert in experts:
                at = (index, expert) if spec.experts else (index,)
                a, b = a_all[at], b_all[at]
                for hf_name, rows in zip(mapping.hf_names(layer=layer, expert=expert), mapping.to_hf(b, config), strict=True):
                    module = "base_model.model." + hf_name.removesuffix(".weight")
                    tensors[module + ".lora_A.weight"] = np.ascontiguousarray(a)
                    tensors[module + ".lora_B.weight"] = np.ascontiguousarray(rows)
    modules = sorted({key.split(".")[-3] for key in tensors})
    return tensors, modules


def peft_config(lora_config: LoraConfig, modules: list[str], base: Path) -> dict:
    """PEFT's adapter_config.json: r and lora_alpha as Bridge's dim and alpha, so that peft's lora_alpha / r is
    Bridge's scale (the fields Bridge's own `save_hf_adapter` writes)."""
    alpha = int(lora_config.alpha) if lora_config.alpha.is_integer() else lora_config.alpha  # as Bridge's int field reads
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": lora_config.dim,
            "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": modules, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False, "use_rslora": False}


def write_peft(merged: MergedReader, destination: Path, base: Path, overwrite: bool) -> None:
    """`adapter_config.json` + `adapter_model.safetensors` at `destination`, written aside and renamed into place."""
    import json
    import shutil

    from safetensors.numpy import save_file

    from reshard.atomic import replace_dir

    if destination.exists() and any(destination.iterdir()) and not overwrite:
        raise ReshardError(f"{destination} exists and is not empty; choose another destination or pass --overwrite")
    tensors, modules = peft_tensors(merged)
    tmp = destination.parent / f".{destination.name}.peft-partial"  # ours by name: a stopped run's is started over
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(peft_config(merged.lora, modules, base), indent=2) + "\n")
        replace_dir(tmp, destination)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
