"""Which target format takes which form of the optimizer state (one table, `TAKES`), and what writing a form bound
to a data-parallel size needs of the source: the plan's `OptimizerOutput`.

| target format | its own form | also, by --optimizer-form |
| --- | --- | --- |
| torch_dist | per-parameter tensors (Megatron's fully_reshardable) | dp_reshardable buckets |
| legacy | the DistributedOptimizer's distrib_optim.pt beside each rank file | |
| zarr | per-parameter tensors | |
| hf | none: refused | |
| verl | dp_reshardable buckets (verl's default) | |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reshard.errors import ReshardError
from reshard.layout import Layout
from reshard.logical import TensorSpec
from reshard.optim.common import param_groups
from reshard.optim.distrib_optim_pt import DistribOptimPtSink
from reshard.optim.dp_reshardable import DpReshardableSink
from reshard.optim.order import ParamOrder, attention_of
from reshard.optim.sink import Form, OptimizerOutput
from reshard.optim.state import described, state_keys
from reshard.request import Target

if TYPE_CHECKING:
    from reshard.formats.base import CheckpointReader, CommonState


FULLY_RESHARDABLE = Form("per-parameter tensors (fully_reshardable)")
PER_PARAMETER = Form("per-parameter tensors")
# the DistributedOptimizer's buffers of the target layout, at the target run's data-parallel size (--to-dp)
DP_RESHARDABLE = Form("dp_reshardable buckets", DpReshardableSink, "--optimizer-form dp_reshardable")
DISTRIB_OPTIM_PT = Form("distrib_optim.pt buffers", DistribOptimPtSink, "--to-format legacy with the DistributedOptimizer's state")


@dataclass(frozen=True)
class Takes:
    """The forms of the optimizer state one target format takes."""

    own: Form | None  # what it writes unless asked otherwise; None: it holds no optimizer state
    also: dict[str, Form] = field(default_factory=dict)  # what --optimizer-form may ask for besides
    refusal: str = ""  # why it holds none


TAKES: dict[str, Takes] = {
    "torch_dist": Takes(FULLY_RESHARDABLE, {"dp_reshardable": DP_RESHARDABLE}),
    "legacy": Takes(DISTRIB_OPTIM_PT),
    "zarr": Takes(PER_PARAMETER),
    "hf": Takes(None, refusal="the HF format holds no optimizer state"),
    "verl": Takes(DP_RESHARDABLE, {"dp_reshardable": DP_RESHARDABLE}),  # verl's default form (dist_ckpt_optim_fully_reshardable off)
}


def requested(format_name: str, target: Target) -> Form | None:
    """The form `target` asks of a `format_name` output: the format's own unless --optimizer-form names another it
    takes. A form it does not take, one asked for without the state, or a data-parallel size for a form not bound to
    one is refused in one line."""
    takes = TAKES[format_name]
    form = takes.own
    if target.optimizer_form in takes.also:
        form = takes.also[target.optimizer_form]
        if not target.optimizer:
            raise ReshardError(f"{form.requested_as} writes optimizer state: drop --no-optimizer")
    elif target.optimizer_form != "fully_reshardable":  # the default: whatever form the format holds
        formats = [name for name, other in TAKES.items() if target.optimizer_form in other.also]
        raise ReshardError(f"--optimizer-form {target.optimizer_form} is a {' or '.join(formats)} form; it cannot be written as {format_name}")
    if target.dp is not None and (form is None or form.sink is None):
        raise ReshardError(
            "--to-dp sets the data-parallel size of DistributedOptimizer state bound to it: add --optimizer-form "
            "dp_reshardable (torch_dist) or --to-format legacy (distrib_optim.pt)"
        )
    return form


def output(
    form: Form | None, format_name: str, reader: CheckpointReader, specs: dict[str, TensorSpec], common: CommonState, target: Target,
    layout: Layout,
) -> OptimizerOutput:
    """How the optimizer tensors among `specs` are written in `form` (`requested`'s) as the source holds them; a form
    bound to a data-parallel size is written at the target's (`target.dp`, else the source's). Refused in one line:
    a format that holds none, a source that lacks what the form needs, an expert data-parallel size that does not
    divide."""
    if form is None:
        first = next(name for name, spec in specs.items() if spec.is_optimizer)
        raise ReshardError(f"{TAKES[format_name].refusal} ({first}, ...); pass --no-optimizer")
    read = "per-parameter tensors" if reader.optimizer is None else reader.optimizer.described
    if form.sink is None:
        return OptimizerOutput(form, None, read)
    _refuse_what_buffers_lack(form, reader, specs, common, layout)
    dp = target.dp or int(reader.common.args.get("data_parallel_size") or 1)
    if reader.config.is_moe and (dp * layout.tp) % (layout.expert_tp * layout.ep):
        raise ReshardError(
            f"data-parallel size {dp} x TP {layout.tp} is not a multiple of ETP {layout.expert_tp} x EP {layout.ep}, as "
            "megatron-core's expert data-parallel size needs: choose another --to-dp"
        )
    return OptimizerOutput(form, dp, read)


def _refuse_what_buffers_lack(form: Form, reader: CheckpointReader, specs: dict[str, TensorSpec], common: CommonState, layout: Layout) -> None:
    """The DistributedOptimizer's buffers hold every state of every parameter (the master weights and its optimizer's
    moments), placed by the architecture, and the param groups of each of its optimizers (an expert one at EP > 1)."""
    if reader.config is None:
        raise ReshardError(f"{form.requested_as} places parameters by the architecture, which the source does not record: pass --config")
    order = ParamOrder.of(common.args, attention_of(reader.config), reader.config)  # what the run trained: its frozen parts have no state
    models = [name for name, spec in specs.items() if not spec.is_optimizer and order.trains(name)]
    keys = state_keys(common.args)
    missing = [f"optimizer.state.{k}.{name}" for name in models for k in keys if f"optimizer.state.{k}.{name}" not in specs]
    if missing:
        raise ReshardError(
            f"{missing[0]} is not in the source: the DistributedOptimizer's dp_reshardable state needs fp32 master weights "
            f"and every moment of --optimizer {described(common.args)} of every parameter (a DistributedOptimizer checkpoint's "
            "state); pass --no-optimizer"
        )
    param_groups(common.extra.get("optimizer"), reader.config.is_moe and layout.ep > 1, form.requested_as)
