"""How a checkpoint of one Megatron optimizer is fitted to the other (unit tests, no torchrun).

The DistributedOptimizer saves the fp32 master weights as
`optimizer.state.param.*` and its step in every param group; the plain mixed-precision optimizer saves
`optimizer.state.fp32_param.*` and one `state.common_step`. The dicts below have the shapes megatron-core
0.16's optimizers build (its code, and the keys of a GPU run's checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from fixtures.torchrun import REPO
from reshard.trainer.checkpoint import (
    align_optimizer_state,
    content_metadata,
    saved_optimizer_form,
    spell_as_saved,
)
from reshard.trainer.optim import _let_distributed_optimizer_over_torch_adam_load

# Megatron-LM's own content metadata for the run's args, as its save writes it (the process group stripped)
_MLM_CONTENT_METADATA = """
import json, sys
from argparse import Namespace
from megatron.training.checkpointing import _build_sharded_state_dict_metadata
from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
out = []
for dist, full in json.loads(sys.argv[1]):
    args = Namespace(use_distributed_optimizer=dist, dist_ckpt_optim_fully_reshardable=full, ckpt_format="torch_dist",
                     distrib_optim_fully_reshardable_mem_efficient=False)
    out.append(_clean_metadata_for_serialization(_build_sharded_state_dict_metadata(args, dp_cp_group=object())))
print(json.dumps(out))
"""


class _Sub:
    def __init__(self, groups):
        self.optimizer = type("Inner", (), {"param_groups": groups})()


def _request(prefix: str) -> dict:
    tensor = lambda kind: ShardedTensor.from_rank_offsets(f"optimizer.state.{kind}.w", torch.zeros(2))  # noqa: E731
    return {"optimizer": {"state": {0: {"exp_avg": tensor("exp_avg"), "exp_avg_sq": tensor("exp_avg_sq")}}},
            "master": tensor(prefix)}


def test_master_weights_are_spelled_as_the_checkpoint_spells_them():
    for live, saved in (("fp32_param", "param"), ("param", "fp32_param")):
        request = _request(live)
        spell_as_saved(request, {f"optimizer.state.{saved}.w", "optimizer.state.exp_avg.w"})
        assert request["master"].key == f"optimizer.state.{saved}.w"
        assert request["optimizer"]["state"][0]["exp_avg"].key == "optimizer.state.exp_avg.w"


def test_a_key_the_checkpoint_has_is_kept():
    request = _request("fp32_param")
    spell_as_saved(request, {"optimizer.state.fp32_param.w", "optimizer.state.param.w"})
    assert request["master"].key == "optimizer.state.fp32_param.w"


def test_distributed_optimizer_step_goes_to_the_plain_optimizers_common_step():
    loaded = {"optimizer": {"param_groups": [{"lr": 1e-3, "wd_mult": 1.0, "step": 4}]}}
    request = {"optimizer": {"state": {0: {}}, "param_groups": [{"lr": 0.0, "wd_mult": 1.0, "params": [0]}]}}
    out = align_optimizer_state(loaded, request, _Sub([{"lr": 0.0, "params": []}]))
    assert out["optimizer"]["state"]["common_step"] == 4


def test_plain_optimizer_common_step_goes_to_every_distributed_optimizer_group():
    loaded = {"optimizer": {"state": {"common_step": torch.tensor(4.0)},
                            "param_groups": [{"lr": 1e-3, "wd_mult": 1.0, "params": [0]},
                                             {"lr": 1e-3, "wd_mult": 0.0, "params": [1]}]}}
    request = {"optimizer": {"param_groups": [{"lr": 0.0, "wd_mult": 1.0, "step": 0},
                                              {"lr": 0.0, "wd_mult": 0.0, "step": 0}]}}
    out = align_optimizer_state(loaded, request, _Sub([{"lr": 0.0}, {"lr": 0.0}]))
    assert [float(g["step"]) for g in out["optimizer"]["param_groups"]] == [4.0, 4.0]
    assert "state" not in out["optimizer"]


def _distributed(step: float, wd_mults=(1.0, 0.0)) -> dict:
    return {"optimizer": {"param_groups": [{"lr": 1e-3, "wd_mult": w, "step": step} for w in wd_mults]},
            "param_state_sharding_type": "fully_reshardable"}


def test_a_chain_of_another_length_resumes_at_the_checkpoints_step():
    """MoE: Megatron chains a dense and an expert DistributedOptimizer at EP2, builds one at EP1. The common part
    of an EP2 checkpoint (`{0: ..., 1: ...}`, as its common.pt holds it) does not fit an EP1 request, whose
    param groups, taken instead, carry the fresh optimizer's step 0: the resumed run must take the checkpoint's
    step (3 here), or Adam's bias correction restarts (the resumed loss was 1.4% off at the second step)."""
    ep2 = {0: _distributed(3.0), 1: _distributed(3.0, wd_mults=(1.0,))}
    out = align_optimizer_state(ep2, _distributed(0.0), _Sub([{"lr": 0.0}, {"lr": 0.0}]))
    assert [g["step"] for g in out["optimizer"]["param_groups"]] == [3.0, 3.0]
    # and the other way: an EP1 checkpoint resumed by a chain
    request = {0: _distributed(0.0), 1: _distributed(0.0, wd_mults=(1.0,))}
    chained = type("Chained", (), {"chained_optimizers": [_Sub([{"lr": 0.0}] * 2), _Sub([{"lr": 0.0}])]})()
    out = align_optimizer_state(_distributed(3.0), request, chained)
    assert [g["step"] for k in (0, 1) for g in out[k]["optimizer"]["param_groups"]] == [3.0, 3.0, 3.0]


def test_the_optimizer_form_is_told_by_the_tensors():
    """An MoE chain's buckets (`chained_<i>.` prefix) are dp_reshardable; per-parameter tensors fully_reshardable."""
    assert saved_optimizer_form({"chained_0.optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"}) == "dp_reshardable"
    assert saved_optimizer_form({"optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"}) == "dp_reshardable"
    assert saved_optimizer_form({"optimizer.state.exp_avg.embedding.word_embeddings.weight"}) == "fully_reshardable"


def test_the_torch_adam_load_fixes_leave_fused_adam_alone(monkeypatch):
    """With Transformer Engine or Apex (FusedAdam, a GPU) the DistributedOptimizer is megatron's own."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    names = ("state_dict", "load_state_dict", "_set_main_param_and_optimizer_states")
    before = {name: cls.__dict__[name] for name in names}
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    _let_distributed_optimizer_over_torch_adam_load()
    assert {name: cls.__dict__[name] for name in names} == before


def test_content_metadata_is_what_megatron_lm_writes():
    """Megatron-LM (core_v0.17.1 tree, its training/checkpointing.py) builds the same content metadata for the plain
    optimizer and both DistributedOptimizer forms (its loader reads the optimizer's form from it)."""
    venv = Path(os.environ.get("MLM_VENV", REPO.parent / "peers" / "mlm-venv"))
    tree = Path(os.environ.get("MLM_TREE", REPO.parent / "peers" / "mlm-tree"))
    if not (venv / "bin" / "python").exists() or not (tree / "megatron" / "training" / "checkpointing.py").exists():
        pytest.skip(f"needs Megatron-LM's peer install ({venv}, {tree}; MLM_VENV/MLM_TREE): shared/peers/setup_mlm.sh")
    runs = [(False, False), (True, False), (True, True)]
    proc = subprocess.run([venv / "bin" / "python", "-c", _MLM_CONTENT_METADATA, json.dumps(runs)], env=dict(
        os.environ, PYTHONPATH=str(tree), PYTHONWARNINGS="ignore"), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = [content_metadata(argparse.Namespace(use_distributed_optimizer=d, dist_ckpt_optim_fully_reshardable=f))
            for d, f in runs]
    assert ours == theirs
    assert [m.get("distrib_optim_sharding_type") for m in ours] == [None, "dp_reshardable", "fully_reshardable"]
