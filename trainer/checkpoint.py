"""Megatron-LM style torch_dist checkpoints: atomic save with recorded checksums, validated load.

Layout on disk (what Megatron-LM writes, so `reshard` and Megatron-LM read it):

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_NNNNNNN/{__R_0.distcp, .metadata, common.pt, metadata.json, reshard_manifest.json}

`common.pt` (under megatron-core 0.19 the ShardedObject `common_state` in the .distcp files instead)
holds `args` (a Megatron-LM Namespace), `checkpoint_version`, `iteration`,
`opt_param_scheduler`, `data_state` and the non-tensor part of the optimizer; model and optimizer tensors
(`optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<param>`, "fully reshardable"; `param` for the fp32
master weights of the DistributedOptimizer) are global ShardedTensors; the DistributedOptimizer saves
by default, as Megatron-LM does, its flat buckets instead (`optimizer.distributed.*`, "dp_reshardable");
`rng_state` is a per-rank ShardedObject (layout-bound: `reshard convert` drops it on a layout change).
`common.pt` also records Megatron-LM's `content_metadata` (the DistributedOptimizer's form), which
Megatron-LM's loader builds its optimizer load request from.

Atomicity: every rank writes into `<save>/iter_NNNNNNN.tmp`; once all shards are on disk (fsynced),
rank 0 adds the manifest, renames the directory to `iter_NNNNNNN`, then replaces the tracker file via a
temporary file and `os.replace`. A crash at any point leaves `latest` on the previous complete checkpoint.

Checksums: every rank hashes its primary shards (replica_id 0) with `reshard.checksum.TensorChecksum`
(layout-invariant partial sums), the partial sums are gathered and combined, and rank 0 records them in
`reshard_manifest.json`. After a load the same is recomputed from the live model and optimizer and compared.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

from reshard.atomic import fsync_path, put_back, replace_dir, write_atomic
from reshard.checksum import TensorChecksum
from reshard.config import ModelConfig
from reshard.dtypes import from_torch
from reshard.errors import ReshardError
from reshard.formats import megatron_dist
from reshard.formats.base import Manifest
from reshard.layout import Layout
from reshard.logical import describe
from reshard.naming import canonical
from reshard.optim.dp_reshardable import is_dp_reshardable
from reshard.torchfile.screen import screen
from reshard.trainer.model import sequence_parallel
from reshard.verify import compare

CHECKPOINT_VERSION = 3.0
TRACKER = "latest_checkpointed_iteration.txt"
# How megatron lays out the optimizer state: each tensor as a global ShardedTensor
# `optimizer.state.<exp_avg|exp_avg_sq>.<param key>`, independent of TP/PP/EP.
SHARDED_SD_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
    "singleton_local_shards": False,
}
# The fp32 master weights are one tensor saved under two names: `optimizer.state.param.<p>` by Megatron's
# DistributedOptimizer ("fully_reshardable"), `optimizer.state.fp32_param.<p>` by its plain mixed-precision
# optimizer. Spelling a load request as the checkpoint does lets either optimizer resume the other's run.
MASTER_WEIGHT_PREFIXES = ("optimizer.state.fp32_param.", "optimizer.state.param.")
# Test hook: "ITERATION:SECONDS" pauses the save of that iteration after the shards are written and
# before the directory is renamed (a test SIGKILLs the run there).
SAVE_PAUSE_ENV = "TRAINER_TEST_SAVE_PAUSE"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says which tensor or file and why."""


def iter_dirname(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


# ----------------------------------------------------------------------------------------- args

def megatron_args(config: ModelConfig, layout: Layout, world: int, **extra) -> argparse.Namespace:
    """The Megatron-LM `args` Namespace a training run at `layout` would have saved."""
    a = config.megatron_args()
    a.update(
        padded_vocab_size=config.padded_vocab_for(layout.tp),
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        params_dtype=getattr(torch, config.params_dtype),
        **layout.megatron_args(),
        num_layers_per_virtual_pipeline_stage=(config.num_layers // (layout.pp * layout.vpp)) if layout.vpp > 1 else None,
        data_parallel_size=world // (layout.tp * layout.pp),
        world_size=world,
        ckpt_format="torch_dist",
        fp16=False,
        bf16=config.params_dtype == "bfloat16",
        use_distributed_optimizer=False,
        transformer_impl="local",
        use_rotary_position_embeddings=config.position_embedding_type == "rope",
        moe_token_dispatcher_type="allgather" if config.is_moe else None,
        moe_grouped_gemm=False,
        sequence_parallel=sequence_parallel(config, layout),
        tokenizer_type="NullTokenizer",
        model_type="GPT",
    )
    a.update(extra)
    return argparse.Namespace(**a)


# ------------------------------------------------------------------------------------------ rng

def rng_state() -> dict:
    """Megatron-LM's per-rank RNG record (cuda_rng_state is None on a CPU machine)."""
    from megatron.core import tensor_parallel

    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def reseed(seed: int, iteration: int) -> None:
    """Deterministic RNG state for a resumed run whose checkpoint has none for this layout."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    s = seed + 100_003 * iteration + 7 * ps.get_pipeline_model_parallel_rank()
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    tensor_parallel.model_parallel_cuda_manual_seed(s)


def sharded_rng_state(layout: Layout):
    """rng_state as the ShardedObject Megatron-LM's torch_dist save uses."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    if layout.ep > 1:
        ep = ps.get_expert_model_parallel_rank()
        return ShardedObject("rng_state", [rng_state()], (layout.pp, layout.tp, layout.ep), (pp, tp, ep),
                             replica_id=ps.get_expert_data_parallel_rank())
    return ShardedObject("rng_state", [rng_state()], (layout.pp, layout.tp), (pp, tp),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


# -------------------------------------------------------------------------------- state dicts

def unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def model_keys(n: int) -> list[str]:
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def model_sharded_state_dict(models: list) -> dict:
    # the data-parallel group named, as Megatron-LM names it: megatron-core 0.16's GPTModel looks it up unguarded on a
    # last pipeline stage holding multi-token-prediction layers and the embedding they share
    from megatron.core import parallel_state as ps

    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    return {key: unwrap(m).sharded_state_dict(metadata=metadata) for key, m in zip(model_keys(len(models)), models)}


def optimizer_sharded_state_dict(models: list, optimizer, is_loading: bool, form: str = "fully_reshardable") -> dict:
    """`form`: the DistributedOptimizer's `distrib_optim_sharding_type` (the plain optimizer has one form)."""
    return optimizer.sharded_state_dict(model_sharded_state_dict(models), is_loading=is_loading,
                                        metadata={**SHARDED_SD_METADATA, "distrib_optim_sharding_type": form})


def content_metadata(args: argparse.Namespace) -> dict:
    """What Megatron-LM (megatron-core 0.15+) records as the checkpoint's `content_metadata` for a run's `args`
    (its training/checkpointing.py `_build_sharded_state_dict_metadata`, less the process group it strips
    before saving): the DistributedOptimizer's form, which its loader builds the load request from, and which,
    absent, it takes for the pre-0.13 `dp_zero_gather_scatter`. The same record reshard's torch_dist writer makes."""
    form = None
    if getattr(args, "use_distributed_optimizer", False):
        form = "fully_reshardable" if getattr(args, "dist_ckpt_optim_fully_reshardable", False) else "dp_reshardable"
    return megatron_dist.content_metadata(None, form)


def saved_optimizer_form(saved_keys: set[str]) -> str:
    """The DistributedOptimizer form a checkpoint holds: Megatron-LM builds its load request in the checkpoint's
    form, not its own flags', and so does the trainer. Megatron-LM reads the form from `content_metadata`; the
    trainer goes by the tensors themselves (an MoE chain's `chained_<i>.` prefix included), which a checkpoint
    written before megatron-core 0.15 holds without that record."""
    return "dp_reshardable" if any(map(is_dp_reshardable, saved_keys)) else "fully_reshardable"


def spell_as_saved(optimizer_state: dict, saved_keys: set[str]) -> None:
    """Rename, in place, the master-weight entries (ShardedTensors or factories) of a sharded optimizer
    state dict whose key the checkpoint lacks to the other optimizer's spelling, where the checkpoint has that."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    for item in nested_values(optimizer_state):
        key = getattr(item, "key", None)
        if not isinstance(key, str) or key in saved_keys:
            continue
        for mine, theirs in (MASTER_WEIGHT_PREFIXES, MASTER_WEIGHT_PREFIXES[::-1]):
            if key.startswith(mine) and theirs + key[len(mine):] in saved_keys:
                item.key = theirs + key[len(mine):]
                break


def check_saved(ckpt: Path, optimizer_state: dict, saved_keys: set[str]) -> None:
    """Refuse, naming it, per-parameter optimizer state the request holds (spelled as saved) that the checkpoint
    lacks, which Megatron-Core would report as a KeyError: fp32 master weights (`optimizer.state.param.`), which
    the DistributedOptimizer loads and a plain optimizer training in fp32 does not save, above all."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    for item in nested_values(optimizer_state):
        key = getattr(item, "key", None)
        if not isinstance(key, str) or not key.startswith("optimizer.state.") or key in saved_keys:
            continue
        if key.startswith(MASTER_WEIGHT_PREFIXES[1]):
            raise CheckpointError(
                f"{ckpt} holds no fp32 master weights ({key} is missing: a plain optimizer training in fp32 saves none), "
                "which the DistributedOptimizer loads: resume without --use-distributed-optimizer, or pass --no-load-optim "
                "to start the optimizer afresh"
            )
        raise CheckpointError(f"{ckpt} has no {key}, which this run's optimizer loads: resume with the optimizer options "
                              "it was saved with, or pass --no-load-optim to start the optimizer afresh")


def _find_step(tree):
    """The optimizer step of a loaded optimizer dict: the plain optimizer's `state.common_step`, else the
    step the DistributedOptimizer keeps in each of its param groups."""
    def find(tree, key):
        if isinstance(tree, dict):
            if key in tree:
                return tree[key]
            for value in tree.values():
                found = find(value, key)
                if found is not None:
                    return found
        return None

    def group_step(tree):
        groups = find(tree, "param_groups")
        return next((g["step"] for g in groups if isinstance(g, dict) and "step" in g), None) if groups else None

    step = find(tree, "common_step")
    return step if step is not None else group_step(tree)


def _unwrap_value(value):
    """The plain value of a request entry (param_groups come as LocalNonpersistentObject)."""
    if hasattr(value, "unwrap"):
        return _unwrap_value(value.unwrap())
    if isinstance(value, list):
        return [_unwrap_value(v) for v in value]
    return value


def align_optimizer_state(loaded: dict, request: dict, optimizer) -> dict:
    """Fit a loaded optimizer dict to the structure of the current optimizer's request.

    Megatron chains one optimizer for dense and one for expert parameters only when EP > 1, so the
    non-tensor part (param_groups, common_step, from common.pt) of a checkpoint saved at EP1 is one
    optimizer's while EP2 expects two (and vice versa). The tensors (exp_avg...) are layout-free; the
    non-tensor part is taken from the loaded dict where its structure matches, else from the request
    (param ids) and the live optimizer (hyper-parameters such as lr, betas, wd_mult). The plain optimizer
    keeps its step in `state.common_step`, the DistributedOptimizer in each param group: either's step
    reaches the other.
    """
    out = _align(loaded, request, _find_step(loaded))
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = [out] if ("param_groups" in out or "optimizer" in out) else [out[k] for k in sorted(out)]
    for sub, part in zip(subs, parts):
        if "param_groups" not in part:  # mixed precision: {"optimizer": {...}, "fp32_from_fp16_params": ...}
            part = part["optimizer"]
        live = sub.optimizer.param_groups
        part["param_groups"] = [
            g if "wd_mult" in g else {**{k: v for k, v in lg.items() if k != "params"}, **g}
            for lg, g in zip(live, part["param_groups"])
        ]
    return out


def _align(loaded: dict, request: dict, step) -> dict:
    out = {}
    for key, want in request.items():
        have = loaded.get(key)
        if isinstance(want, dict):
            out[key] = _align(have if isinstance(have, dict) else {}, want, step)
        else:
            out[key] = have if have is not None else _unwrap_value(want)
    if "param_groups" in request and step is not None:
        if "state" in request:  # the plain optimizer: one step shared by all parameters
            out.setdefault("state", {}).setdefault("common_step", step)
        from_request = loaded.get("param_groups") is None
        for group, wanted in zip(out["param_groups"], _unwrap_value(request["param_groups"])):
            # the DistributedOptimizer: the step in every param group; groups taken from the request (a chain
            # of another length than the checkpoint's) hold the live optimizer's step, 0, not the run's
            if "step" in wanted and (from_request or "step" not in group):
                group["step"] = step
    return out


# --------------------------------------------------------------------------------- checksums

def _is_vocab(name: str, shape, dtype: str, config: ModelConfig) -> bool:
    try:
        return describe(name, tuple(shape), dtype, config).vocab
    except ReshardError:
        return False


def local_checksums(sharded_state_dict: dict, config: ModelConfig) -> dict[str, TensorChecksum]:
    """Partial checksums of this rank's primary shards, by canonical (manifest) name.

    Applies the state dict's ShardedTensorFactories in place (as `dist_checkpointing.save` would).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    apply_factories(sharded_state_dict)
    accs: dict[str, TensorChecksum] = {}
    for st in nested_values(sharded_state_dict):
        if not isinstance(st, ShardedTensor) or not is_main_replica(st.replica_id):
            continue
        name = canonical(st.key, "dist", config.is_moe)
        dtype = str(st.dtype).removeprefix("torch.")
        if name not in accs:
            rows = config.vocab_rows if _is_vocab(name, st.global_shape, dtype, config) else None
            accs[name] = TensorChecksum(tuple(st.global_shape), dtype, rows)
        p = st.prepend_axis_num
        region = tuple((o, o + 1) for o in st.global_offset[:p]) + tuple(
            (o, o + s) for o, s in zip(st.global_offset[p:], st.local_shape))
        data = st.data.detach().to("cpu").reshape([1] * p + list(st.local_shape))
        accs[name].add(region, from_torch(data))
    return accs


def combine_checksums(local: dict[str, TensorChecksum]):
    """Gather every rank's partial sums and combine them; returns {name: Checksum} on every rank."""
    parts = [local]
    if torch.distributed.is_initialized():
        parts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, local)
    total: dict[str, TensorChecksum] = {}
    for part in parts:
        for name, acc in part.items():
            if name in total:
                total[name].merge(acc)
            else:
                total[name] = acc
    incomplete = [n for n, a in total.items() if not a.complete]
    if incomplete:
        raise CheckpointError(f"checksum of {incomplete[0]} covers {total[incomplete[0]].covered} of "
                              f"{total[incomplete[0]].expected} elements: shards are missing or counted twice")
    return {n: a.result() for n, a in sorted(total.items())}


# ---------------------------------------------------------------------------------------- save

def _save_pause(iteration: int, tmp: Path) -> None:
    spec = os.environ.get(SAVE_PAUSE_ENV)
    if not spec:
        return
    it, seconds = spec.split(":")
    if int(it) == iteration:
        if _rank() == 0:
            (tmp.parent / f"SAVE_PAUSED_{iteration}").write_text(str(os.getpid()))
        time.sleep(float(seconds))


def _in_process_results_queue() -> None:
    """Megatron's torch_dist writer hands its results back through a queue made by a `spawn`
    multiprocessing Manager: a fresh interpreter that re-imports torch and megatron, slowly (benchmarks/README.md),
    the first time a process saves. A synchronous save runs the writer in this process, so a
    plain in-process queue carries the results just as well."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(save_dir: Path, iteration: int, models: list, optimizer, scheduler, layout: Layout,
                    config: ModelConfig, args: argparse.Namespace, data_state: dict) -> dict:
    """Save atomically (see the module docstring); returns {'seconds', 'bytes'}. `args` (Megatron-LM's) chooses
    the DistributedOptimizer's form, recorded as Megatron-LM does in `content_metadata` (see there)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    start = time.perf_counter()
    save_dir = Path(save_dir)
    final = save_dir / iter_dirname(iteration)
    tmp = save_dir / f"{final.name}.tmp"
    if _rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        put_back(final, tmp)  # a re-save of this iteration stopped between the two renames of `replace_dir`
        if tmp.exists():  # left by a crashed save
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()

    state = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "opt_param_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "data_state": data_state,
    }
    metadata = content_metadata(args)
    optimizer_form = metadata.get("distrib_optim_sharding_type", "fully_reshardable")
    state.update(model_sharded_state_dict(models))
    if optimizer is not None:
        state["optimizer"] = optimizer_sharded_state_dict(models, optimizer, is_loading=False, form=optimizer_form)
    state["rng_state"] = sharded_rng_state(layout)
    checked = state
    if optimizer is not None and optimizer_form != "fully_reshardable":
        # the manifest records optimizer state per parameter, as reshard reads every form (the buckets'
        # gaps are uninitialised memory besides): this form's state is gathered once more for it
        checked = {**state, "optimizer": optimizer_sharded_state_dict(models, optimizer, is_loading=False)}
    local = local_checksums(checked, config)  # applies the factories, which save would do anyway

    _in_process_results_queue()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dist_checkpointing.save(state, str(tmp), sharded_strategy=strategy, content_metadata=metadata)
    checksums = combine_checksums(local)
    for f in tmp.glob(f"__{_rank()}_*.distcp"):
        fsync_path(f)
    _save_pause(iteration, tmp)
    _barrier()

    if _rank() == 0:
        Manifest(
            format="torch_dist",
            config=config.replace(padded_vocab_size=config.padded_vocab_for(layout.tp)),
            layout=layout,
            checksums=checksums,
            provenance={"tool": "trainer", "iteration": iteration,
                        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        ).save(tmp)
        for f in tmp.iterdir():
            if f.is_file() and not f.name.startswith("__"):
                fsync_path(f)
        fsync_path(tmp)
        replace_dir(tmp, final)  # re-saving an iteration swaps the old one out in one step
        fsync_path(save_dir)
        write_atomic(save_dir / TRACKER, f"{iteration}\n")
    _barrier()
    size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
    return {"seconds": time.perf_counter() - start, "bytes": size}


# ---------------------------------------------------------------------------------------- load

def find_checkpoint(load_dir: Path) -> Path | None:
    """The iteration directory `latest_checkpointed_iteration.txt` points at (or an iter_* dir itself),
    its pickles screened: torch loads `.metadata` and DCP's objects with plain pickle, which would run
    whatever a hostile one names (`reshard.torchfile.screen`; refused in one line, a ReshardError)."""
    load_dir = Path(load_dir)
    if (load_dir / ".metadata").is_file():
        directory = load_dir
    else:
        tracker = load_dir / TRACKER
        if not tracker.is_file():
            return None
        text = tracker.read_text().strip()
        directory = load_dir / ("release" if text == "release" else iter_dirname(int(text)))
        # a re-save stopped between `replace_dir`'s two renames (no atomic exchange there)
        put_back(directory, directory.with_name(f"{directory.name}.tmp"))
        if not (directory / ".metadata").is_file():
            raise CheckpointError(f"{tracker} points at {directory.name}, which is not a complete torch_dist checkpoint")
    screen(directory)
    return directory


def read_common(ckpt: Path) -> dict:
    """The checkpoint's common (non-sharded) state: `common.pt` as megatron-core up to 0.18 saves it, else the
    ShardedObject `common_state` in the .distcp files that megatron-core 0.19 saves instead (its own reader,
    weights_only as well), which an older megatron-core cannot read: refused then, with the way round."""
    from megatron.core import dist_checkpointing  # registers the classes of Megatron-LM's args as safe for weights_only

    path = Path(ckpt) / "common.pt"
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    if not any(key.startswith("common_state/") for key in saved_tensor_keys(ckpt)):
        raise CheckpointError(f"{ckpt} has neither common.pt nor a common_state object: not a complete torch_dist checkpoint")
    installed = version("megatron-core")
    if tuple(int(part) for part in installed.split(".")[:2]) < (0, 19):
        raise CheckpointError(
            f"{ckpt} keeps its common state inside its .distcp files, as megatron-core 0.19 and later save it, which the "
            f"installed megatron-core {installed} cannot read: convert it with `reshard convert {ckpt} NEW_DIR` (which "
            "writes common.pt) and load NEW_DIR, or install megatron-core 0.19"
        )
    return dist_checkpointing.load_common_state_dict(str(ckpt))


def saved_tensor_keys(ckpt: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


def load_checkpoint(ckpt: Path, models: list, optimizer, scheduler, layout: Layout, config: ModelConfig,
                    *, world: int, load_optim: bool = True, load_rng: bool = True, seed: int = 0) -> dict:
    """Load model (and optimizer, scheduler, RNG) from the iteration directory `ckpt`, then verify
    what was loaded against the checkpoint's manifest. Returns a report dict:
    {'iteration', 'data_state', 'common', 'optimizer_loaded', 'rng_loaded', 'verified', 'seconds'}.
    """
    from megatron.core import dist_checkpointing

    start = time.perf_counter()
    common = read_common(ckpt)
    keys = saved_tensor_keys(ckpt)
    saved_args = vars(common.get("args") or argparse.Namespace())
    # an MoE model's buckets are a chain of two optimizers' (`chained_0.optimizer.distributed.`, `chained_1.`...)
    has_optim = any(k.startswith("optimizer.state.") or is_dp_reshardable(k) for k in keys)
    saved_dtype = "bfloat16" if saved_args.get("bf16") else "float16" if saved_args.get("fp16") else "float32"
    if saved_dtype != config.params_dtype:
        raise CheckpointError(
            f"{ckpt} holds {saved_dtype} weights and this run trains in {config.params_dtype}: "
            + ("pass --bf16" if saved_dtype == "bfloat16" else "drop --bf16" if saved_dtype == "float32" else "fp16 is not supported")
        )
    load_optim = load_optim and optimizer is not None and has_optim
    # only the degrees matter here: dist_checkpointing loads the tensors whatever the stage split
    saved = Layout.from_megatron_args(saved_args, any_split=True)
    same_ranks = (saved.tp, saved.pp, saved.ep, saved_args.get("world_size")) == (layout.tp, layout.pp, layout.ep, world)
    load_rng = load_rng and same_ranks and any(k.startswith("rng_state") for k in keys)

    request = model_sharded_state_dict(models)
    if load_optim:
        request["optimizer"] = optimizer_sharded_state_dict(models, optimizer, is_loading=True,
                                                            form=saved_optimizer_form(keys))
        spell_as_saved(request["optimizer"], keys)
        check_saved(ckpt, request["optimizer"], keys)
    if load_rng:
        request["rng_state"] = sharded_rng_state(layout)
    loaded = dist_checkpointing.load(request, str(ckpt), strict="assume_ok_unexpected")
    for key, m in zip(model_keys(len(models)), models):
        unwrap(m).load_state_dict(loaded[key], strict=True)
    if load_optim:
        # no_grad: an fp32 DistributedOptimizer's master weights are views of the parameters, leaves that need grads
        with torch.no_grad():
            optimizer.load_state_dict(align_optimizer_state(loaded["optimizer"], request["optimizer"], optimizer))
        if scheduler is not None and common.get("opt_param_scheduler"):
            scheduler.load_state_dict(common["opt_param_scheduler"])
    elif optimizer is not None:  # mixed precision keeps fp32 master copies of the initial weights: refresh them
        optimizer.reload_model_params()
    iteration = int(common.get("iteration", 0)) if str(common.get("iteration", 0)).isdigit() else 0
    if load_rng:
        state = loaded["rng_state"]
        set_rng_state(state[0] if isinstance(state, list) else state)
    else:
        reseed(seed, iteration)

    verified = verify_loaded(ckpt, models, optimizer if load_optim else None, config, saved_keys=keys)
    return {"iteration": iteration, "data_state": common.get("data_state"), "common": common,
            "optimizer_loaded": load_optim, "has_optimizer": has_optim, "rng_loaded": load_rng,
            "verified": verified, "seconds": time.perf_counter() - start}


def verify_loaded(ckpt: Path, models: list, optimizer, config: ModelConfig, saved_keys: set[str] | None = None) -> int:
    """Recompute the checksums of the loaded model (and optimizer) state, compare with the manifest
    (optimizer names spelled as in `saved_keys`, the checkpoint's tensor keys, when given).

    Raises CheckpointError naming the first tensor that differs; returns the number of tensors checked
    (0 when the checkpoint has no manifest).
    """
    state = model_sharded_state_dict(models)
    if optimizer is not None:
        state["optimizer"] = optimizer_sharded_state_dict(models, optimizer, is_loading=False)
        if saved_keys is not None:
            spell_as_saved(state["optimizer"], saved_keys)
    actual = combine_checksums(local_checksums(state, config))
    manifest = Manifest.load(Path(ckpt))
    if manifest is None:
        return 0
    # recorded tensors that were not loaded (optimizer state, with --no-load-optim) are `missing`: no error
    result = compare(actual, manifest.checksums)
    bad = sorted(result.mismatched + result.dtype_differs)
    if bad:
        raise CheckpointError(
            f"checkpoint {ckpt}: tensor {bad[0]} does not match the checksum recorded at save "
            f"({len(bad)} tensor(s) differ); the checkpoint is corrupted, refusing to train on it")
    if result.unexpected:
        raise CheckpointError(f"checkpoint {ckpt}: tensor {result.unexpected[0]} has no recorded checksum in the manifest")
    return len(actual)
