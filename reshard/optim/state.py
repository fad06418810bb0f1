"""The reader's seam: a checkpoint reader *has* an optimizer state, decoded from the form the checkpoint stores it in,
which it asks for regions of Megatron's fully_reshardable per-parameter tensors (`optimizer.state.<param|exp_avg|
exp_avg_sq>.<model key>`, the moments those of the optimizer the args name: `MOMENTS`). What a reader does not decode
it lists as not read (`CheckpointReader.unsupported_optimizer`), and where a decoder refused what it found, it keeps
why (`OptimizerRefusal`): the model still converts without it."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from reshard.errors import ReshardError
from reshard.logical import TensorSpec
from reshard.records import StoredRecord
from reshard.sharding import Region


@dataclass(frozen=True)
class StoredForm:
    """How a checkpoint stores its optimizer state: `fully_reshardable` (per-parameter tensors, any layout),
    `dp_reshardable` (the DistributedOptimizer's flat buckets, tied to their DP size), `distrib_optim.pt` (the legacy
    format's buffers, tied to it too), `plain` (the non-distributed optimizer's per-parameter tensors),
    `fully_sharded_model_space` (megatron-core <= 0.14's per-parameter flattened ranges), or the name Megatron records
    for another form."""

    form: str
    dp: int | None  # the data-parallel size the state was saved at
    buckets: int | None = None  # a buffer form's buckets over every model-parallel rank and model chunk
    ranks: int | None = None  # a buffer form's model-parallel ranks holding buckets
    optimizer: str = ""  # the optimizer and its moments (`described`), where known

    def render(self) -> str:
        where = f", {self.buckets} buckets over {self.ranks} model-parallel ranks" if self.buckets is not None else ""
        return f"optimizer: {self.form}, DP {self.dp or '?'}{where}{f'; {self.optimizer}' if self.optimizer else ''}"


@dataclass(frozen=True)
class OptimizerRefusal:
    """Why a reader did not decode the optimizer state it found."""

    stored: str  # what was not read, as a conversion without it lists it among what it drops
    reason: str  # the decoder's refusal in one line, naming the file or tensor

    def error(self) -> ReshardError:
        """The refusal of a conversion that would carry the state, saying what to do."""
        if "--no-optimizer" in self.reason:  # the decoder said what to do already
            return ReshardError(self.reason)
        return ReshardError(f"{self.reason}; pass --no-optimizer to convert the model without its optimizer state")


# Megatron-LM's --optimizer values whose state reshard decodes, and the moments each keeps beside the fp32 master
# weights (megatron-core 0.19's `DistributedOptimizer.optimizer_state_keys`): the one place that says which they are.
MOMENTS = {"adam": ("exp_avg", "exp_avg_sq"), "lion": ("exp_avg",)}
MASTER = "param"  # the fp32 master weights, as the DistributedOptimizer's forms name them
MASTER_STATES = (MASTER, "fp32_param")  # and as the plain optimizer (and megatron-core <= 0.14's model-space form) does
# and why it does not decode the others' (megatron-core 0.18+'s Muon)
_OTHER_KINDS = {
    "muon": "Muon's layer-wise distributed optimizer state reloads only at the data-parallel size it was saved at",
    "dist_muon": "Muon's layer-wise distributed optimizer state reloads only at the data-parallel size it was saved at",
}


def optimizer_kind(args: dict[str, Any]) -> str:
    """The optimizer a run's args name (Megatron-LM's `--optimizer`; Megatron-Bridge's `optimizer.optimizer`)."""
    return str(args.get("optimizer") or "adam")


def state_keys(args: dict[str, Any]) -> tuple[str, ...]:
    """Each parameter's optimizer state as the run's DistributedOptimizer keeps it: the fp32 master weights, then its
    optimizer's moments (an optimizer reshard does not decode has Adam's: `other_kind` refuses it by name)."""
    return (MASTER, *MOMENTS.get(optimizer_kind(args), MOMENTS["adam"]))


def described(args: dict[str, Any]) -> str:
    """The optimizer and its moments in words (for `inspect` and refusals)."""
    kind = optimizer_kind(args)
    return f"{kind} ({', '.join(MOMENTS[kind])})" if kind in MOMENTS else kind


def check_states(args: dict[str, Any], found: set[str], where: str, complete: bool = True, way_on: str = "") -> None:
    """Refuse in one line optimizer state `where` holding another optimizer's moments than the one the args name
    (`found`: its state names), or (`complete`: a form that keeps all of them, the master weights as `param`) lacking
    one of them: read as the args say, it would resume the run with moments of the wrong meaning. `way_on` ends the
    refusal where the caller has one (a decoder refusing at opening has none)."""
    keys = state_keys(args)
    other = sorted(found - set(keys) - set(MASTER_STATES))
    missing = [key for key in keys if key not in found] if complete else []
    if other or missing:
        said = f"{', '.join(other)}, which" if other else f"no {', '.join(missing)}, which"
        raise ReshardError(
            f"{where} holds {said} the args' --optimizer {described(args)} {'does not keep' if other else 'keeps'}: the "
            f"args do not describe this optimizer state (damaged or mislabelled){way_on}"
        )


def other_kind(args: dict[str, Any], source: object) -> OptimizerRefusal | None:
    """The refusal of an optimizer state saved by an optimizer whose state reshard does not decode, by its name: another
    optimizer, or a decoded one under megatron-core 0.19's layer-wise distributed optimizer (not the DistributedOptimizer
    whose forms reshard reads)."""
    kind = optimizer_kind(args)
    layer_wise = bool(args.get("use_layer_wise_distributed_optimizer"))
    if kind in MOMENTS and not layer_wise:
        return None
    why = _OTHER_KINDS.get(kind, f"reshard decodes {' and '.join(sorted(MOMENTS))} state only")
    if kind in MOMENTS:
        kind, why = f"{kind} --use-layer-wise-distributed-optimizer", "its layer-wise state reloads only at the data-parallel size it was saved at"
    return OptimizerRefusal(f"optimizer state ({kind})", f"{source} was trained with --optimizer {kind}: {why}, so reshard does not "
                            "reshard its state; pass --no-optimizer to convert the model without it (the run resumes with a new "
                            "optimizer), or resume it at the layout it was saved at")


class OptimizerState(abc.ABC):
    """The optimizer tensors a checkpoint's stored form decodes to."""

    specs: dict[str, TensorSpec]  # the logical optimizer tensors it holds
    # decoded by the buffer layout reshard derives (`optim.buffers`), which `master_weights` checks on every decode
    from_buffers: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def form(self) -> StoredForm:
        """The form as stored (for `inspect`)."""

    @property
    @abc.abstractmethod
    def described(self) -> str:
        """The form as a plan names what it reads."""

    @abc.abstractmethod
    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        """Fill `out` (shaped like `region`) with the values of `region` of logical optimizer tensor `name`."""

    @abc.abstractmethod
    def common(self, extra: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's common state `extra` with its `optimizer` entry as Megatron's fully_reshardable save
        writes it (what a conversion carries)."""

    def stored_records(self, name: str) -> list[StoredRecord] | None:
        """Where tensor `name`'s values lie as plain records (what a conversion's writer vouches for, so that
        verifying need not read them back); None where they are not one run each."""
        return None

    def close(self) -> None:
        """Release file handles."""
