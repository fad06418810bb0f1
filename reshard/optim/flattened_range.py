"""Megatron's DistributedOptimizer state in its `fully_sharded_model_space` form, read as logical per-parameter tensors.

megatron-core <= 0.14 saved the distributed optimizer's state per model parameter, each DP rank its contiguous
`flattened_range` of the parameter's flattened local (TP-sharded) tensor: keys `optimizer.state.<fp32_param|
exp_avg|exp_avg_sq>.<model key>` (megatron-core 0.16+ refuses a `flattened_range` outright, so cannot load it).
Its torch_dist strategy stores such a tensor of global shape [X, Y] cut into local chunks [x, y] as one of shape
[X/x, Y/y, x*y]: the chunk's index along each axis, then the flattened chunk, of which each DP rank wrote its range
(a DCP chunk at offsets (i, j, start), sizes (1, 1, length)). The original global shape is recorded only in the
`.metadata`'s `mcore_data` (`nd_reformulated_orig_global_shape`); a prepended layer axis is one more chunk axis.

This module names each as Megatron's `fully_reshardable` form does (`optimizer.state.<param|exp_avg|exp_avg_sq>.
<model key>` at the model tensor's global shape, `param` being the fp32 master weight), like buffers.py does
for dp_reshardable, so that everything downstream treats the forms alike. A read touches only the span of each
local chunk it needs (one parameter's TP shard at most in memory). Ranges that do not tile every local chunk are
refused when the checkpoint is opened, naming the parameter.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product
from typing import Any

import numpy as np

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.logical import OPTIMIZER_PREFIX, TensorSpec, describe
from reshard.optim.state import OptimizerState, StoredForm, check_states
from reshard.sharding import Region, intersect, shift, to_slices
from reshard.torchfile.dcp_metadata import TensorEntry

FORM = "fully_sharded_model_space"
PREFIX = "optimizer.state."  # (the deprecated fully_sharded_bucket_space form flattens `optimizer.distributed.*` buckets)
# the form's state names -> fully_reshardable's (the fp32 master weight is `fp32_param` here, `param` there); which of
# the moments a parameter has is its optimizer's (`state.MOMENTS`)
STATES = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


@dataclass(frozen=True)
class Flattened:
    """One stored N-D flattened tensor: `chunks` local chunks along each axis of the global tensor, each of
    `local_shape`, stored flattened."""

    key: str  # as stored
    chunks: tuple[int, ...]
    local_shape: tuple[int, ...]

    def chunk_region(self, index: tuple[int, ...]) -> Region:
        return tuple((i * n, (i + 1) * n) for i, n in zip(index, self.local_shape))


def _flattened(key: str, param: str, entry: TensorEntry, shape: tuple[int, ...]) -> Flattened:
    """`key`'s layout, checked: its reformulated shape against the global `shape`, and its ranges tiling every local chunk."""
    chunks, numel = entry.size[:-1], entry.size[-1]
    if len(chunks) != len(shape) or any(c == 0 or d % c for d, c in zip(shape, chunks)):
        raise ReshardError(
            f"{param}: {key} is stored as {list(entry.size)}, not as local chunks of its global shape {list(shape)}; the checkpoint is damaged"
        )
    local = tuple(d // c for d, c in zip(shape, chunks))
    if math.prod(local) != numel:
        raise ReshardError(
            f"{param}: {key} stores chunks of {numel} elements where its global shape {list(shape)} has {math.prod(local)}; the checkpoint is damaged"
        )
    ranges: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
    for chunk in entry.chunks:
        index = chunk.offsets[:-1]
        if any(s != 1 for s in chunk.sizes[:-1]) or any(i >= c for i, c in zip(index, chunks)):
            raise ReshardError(
                f"{param}: {key} holds a range at {list(chunk.offsets)} that is not part of one local chunk; the checkpoint is damaged"
            )
        ranges[index].append((chunk.offsets[-1], chunk.offsets[-1] + chunk.sizes[-1]))
    for index in product(*map(range, chunks)):
        end = 0
        for start, stop in sorted(ranges.get(index, [])):
            if start != end:
                break
            end = stop
        if end != numel:
            raise ReshardError(
                f"{param}: the DistributedOptimizer's flattened ranges of {key} in local chunk {list(index)} tile only "
                f"[0, {end}) of its {numel} elements{' (then a gap or an overlap)' if end < numel else ', past its end'}; "
                "the checkpoint is truncated or damaged"
            )
    return Flattened(key, tuple(chunks), local)


def is_model_space(key: str, flattened: dict[str, tuple[int, ...]]) -> bool:
    """Whether stored tensor `key` is this form's (`flattened`: `DcpMetadata.flattened`)."""
    return key in flattened and key.startswith(PREFIX)


class FlattenedRange(OptimizerState):
    """The logical optimizer tensors of a fully_sharded_model_space save, read through `read_raw(key, region, out)`
    (the torch_dist reader's chunk reading of the stored, reformulated tensors)."""

    def __init__(
        self,
        tensors: dict[str, TensorEntry],  # every stored flattened optimizer tensor, by key
        shapes: dict[str, tuple[int, ...]],  # their original global shapes (`DcpMetadata.flattened`)
        canonical: Callable[[str], str],  # a stored key's canonical name
        model_specs: dict[str, TensorSpec],
        config: ModelConfig | None,
        args: dict[str, Any],  # the saving run's: its data-parallel size and optimizer
        read_raw: Callable[[str, Region, np.ndarray], None],
    ):
        self.read_raw, self.dp = read_raw, args.get("data_parallel_size")
        self.specs: dict[str, TensorSpec] = {}
        self.stored: dict[str, Flattened] = {}
        states: dict[str, set[str]] = defaultdict(set)
        for key, entry in tensors.items():
            match = OPTIMIZER_PREFIX.match(canonical(key))
            if match is None or match["state"] not in STATES:
                raise ReshardError(f"{key}: not optimizer state of the {FORM} form reshard knows; the checkpoint is foreign or damaged")
            param = match["param"]
            model = model_specs.get(param)
            if model is None or model.shape != shapes[key]:
                found = "no such model tensor" if model is None else f"the model tensor's is {list(model.shape)}"
                raise ReshardError(f"{param}: its optimizer state {key} has global shape {list(shapes[key])}, {found}; the checkpoint is damaged")
            name = f"optimizer.state.{STATES[match['state']]}.{param}"
            self.stored[name] = _flattened(key, param, entry, model.shape)
            self.specs[name] = describe(name, model.shape, entry.dtype, config)
            states[param].add(STATES[match["state"]])
        for param, found in states.items():
            check_states(args, found, f"{param}: its {FORM} optimizer state")

    @property
    def form(self) -> StoredForm:
        return StoredForm(FORM, self.dp)

    @property
    def described(self) -> str:
        return "per-parameter tensors"

    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        stored = self.stored[name]
        first = [a // n for (a, _), n in zip(region, stored.local_shape)]
        last = [(b - 1) // n for (_, b), n in zip(region, stored.local_shape)]
        local = np.empty(stored.local_shape, out.dtype)
        flat = local.reshape(-1)
        for index in product(*(range(a, b + 1) for a, b in zip(first, last))):
            chunk = stored.chunk_region(index)
            inside = intersect(region, chunk)
            if inside is None:
                continue
            wanted = shift(inside, chunk)  # in the local chunk; read only the flattened span it spans
            start = int(np.ravel_multi_index([a for a, _ in wanted], stored.local_shape))
            stop = int(np.ravel_multi_index([b - 1 for _, b in wanted], stored.local_shape)) + 1
            self.read_raw(stored.key, tuple((i, i + 1) for i in index) + ((start, stop),), flat[start:stop].reshape((1,) * len(index) + (-1,)))
            out[to_slices(shift(inside, region))] = local[to_slices(wanted)]

    def common(self, extra: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's common state with the optimizer's entry as Megatron's fully_reshardable save writes it
        (the param groups, their `step` included; the form's per-parameter `step` copies dropped), and a
        recorded content metadata naming that form: Megatron-LM builds its load request from it."""
        optimizer = extra.get("optimizer")
        if not (isinstance(optimizer, dict) and isinstance(optimizer.get("optimizer"), dict)):
            raise ReshardError(f"the checkpoint's common state holds no DistributedOptimizer param groups for its {FORM} state; it is damaged")
        out = dict(extra, optimizer={"optimizer": optimizer["optimizer"], "param_state_sharding_type": "fully_reshardable"})
        if isinstance(extra.get("content_metadata"), dict):
            out["content_metadata"] = dict(extra["content_metadata"], distrib_optim_sharding_type="fully_reshardable")
        return out
