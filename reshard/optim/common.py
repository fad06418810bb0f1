"""The optimizer's entry in Megatron's common state (common.pt's `optimizer`): its param groups, read from any form
and written in the form a target takes."""

from __future__ import annotations

from typing import Any

from reshard.errors import ReshardError
from reshard.optim.buffers import DENSE_CHAIN, EXPERT_CHAIN


def fully_reshardable_common(param_groups: dict[int | None, Any]) -> dict[Any, Any]:
    """common.pt's `optimizer` entry as Megatron's fully_reshardable save writes it, from each chained optimizer's
    saved `optimizer` state (by chain index; None: unchained): one entry per chained optimizer where there is a chain."""

    def entry(groups: Any) -> dict[str, Any]:
        return {"optimizer": groups, "param_state_sharding_type": "fully_reshardable"}

    if None in param_groups:
        return entry(param_groups[None])
    return {chain: entry(groups) for chain, groups in sorted(param_groups.items())}


def param_groups(recorded: Any, chained: bool, output: str = "--optimizer-form dp_reshardable") -> dict[int | None, Any]:
    """Each target optimizer's saved state (its param_groups, by chain index; None: unchained) from common.pt's
    `optimizer` entry as the source records it (one optimizer's, or one per chained optimizer). The dense optimizer's
    is either form's dense one; the expert optimizer's only a chained source records (else refused, naming `output`)."""
    if not isinstance(recorded, dict):
        recorded = {}
    by_chain = {None: recorded["optimizer"]} if "optimizer" in recorded else {
        chain: entry["optimizer"] for chain, entry in recorded.items() if isinstance(entry, dict) and "optimizer" in entry
    }
    dense = by_chain.get(DENSE_CHAIN, by_chain.get(None))
    if not isinstance(dense, dict):
        raise ReshardError("the source records no DistributedOptimizer param_groups: its optimizer state cannot be written as dp_reshardable")
    if not chained:
        return {None: dense}
    if not isinstance(by_chain.get(EXPERT_CHAIN), dict):
        raise ReshardError(
            f"{output} at EP > 1 writes megatron-core's chained expert optimizer, whose param_groups "
            "the source (one optimizer, an EP1 run's) does not record: write torch_dist's fully_reshardable form"
        )
    return {DENSE_CHAIN: dense, EXPERT_CHAIN: by_chain[EXPERT_CHAIN]}
