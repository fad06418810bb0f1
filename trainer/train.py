"""A minimal GPT pre-training loop on Megatron-Core's own building blocks (torchrun entry point).

    torchrun --nproc_per_node 4 -m reshard.trainer --tp 2 --pp 2 --model tiny-llama --data corpus.txt \\
        --seq-length 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 \\
        --lr-warmup-iters 2 --train-iters 20 --save ckpt --save-interval 10 --load ckpt --metrics m.jsonl

Pieces: `parallel_state` (TP/PP/EP/DP groups), `GPTModel` (reshard.trainer.model), Megatron's DDP and
`get_megatron_optimizer` (Adam, grad clipping, bf16 mixed precision), `OptimizerParamScheduler`
(linear warmup + cosine decay), `get_forward_backward_func` (1F1B / no-pipelining schedules with
gradient accumulation over micro-batches) and `dist_checkpointing` (torch_dist). On a machine without
CUDA the process group is gloo and `reshard.trainer.cpu_compat` redirects megatron's CUDA-only calls; on a GPU
the same code runs with nccl.

global batch = micro batch x data-parallel size x accumulation steps. --train-iters is the total: a run
resumed from iteration k trains iterations k+1 .. train-iters.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.layout import Layout
from reshard.trainer import checkpoint as ckpt
from reshard.trainer.presets import PRESETS

# How long a failed rank other than 0 waits for rank 0's report before making its own.
REPORT_GRACE_S = 10


class TrainerError(RuntimeError):
    """A user-facing failure: printed once (rank 0) as one line, exit status 1."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m reshard.trainer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1)
    g.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1)
    g.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1)
    g.add_argument("--vpp", "--virtual-pipeline-model-parallel-size", dest="vpp", type=int, default=1)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=sorted(PRESETS), default="tiny-llama",
                   help="architecture preset (a --load checkpoint's own args take precedence)")
    g.add_argument("--data", type=Path, required=True, help="corpus: .txt (one document per line) or .jsonl ('text')")
    g.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizers JSON file; default: tokenizer.json of --load/--save, else trained on the corpus")
    g.add_argument("--seq-length", type=int, default=32)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters with fp32 master weights")
    g = p.add_argument_group("optimization")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x DP")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", default="cosine", choices=("cosine", "linear", "constant"))
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over DP (Megatron's DistributedOptimizer); it saves its state as "
                        "dp_reshardable buckets, as Megatron-LM does (`reshard convert` changes their layout)")
    g.add_argument("--train-iters", type=int, required=True, help="total iterations (a resumed run continues to it)")
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=Path, default=None)
    g.add_argument("--save-interval", type=int, default=None, help="also saves at the last iteration")
    g.add_argument("--load", type=Path, default=None,
                   help="Megatron checkpoint dir (torch_dist) or a HuggingFace dir (weights cast to the run's precision)")
    g.add_argument("--ckpt-optim-fully-reshardable", "--dist-ckpt-optim-fully-reshardable",
                   dest="ckpt_optim_fully_reshardable", action="store_true",
                   help="the DistributedOptimizer saves per-parameter tensors (fully_reshardable) instead of its buckets")
    g.add_argument("--no-load-optim", action="store_true", help="load the model only: fresh optimizer and scheduler")
    g.add_argument("--no-load-rng", action="store_true")
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--metrics", type=Path, default=None, help="JSON line per iteration")
    g.add_argument("--tensorboard-dir", type=Path, default=None)
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="accelerator peak for MFU (default: 989 bf16 / 495 tf32 on GPU; no MFU on CPU)")
    args = p.parse_args(argv)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    return args


# ------------------------------------------------------------------------------------------- setup

def _rank() -> int:
    return torch.distributed.get_rank()


def log(msg: str) -> None:
    if _rank() == 0:
        print(msg, flush=True)


def _broadcast(obj):
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def hf_to_torch_dist(src: Path, layout: Layout, dtype: str) -> Path:
    """Rank 0 converts a HuggingFace model into a temporary torch_dist checkpoint with `reshard convert`,
    its weights cast to the run's `dtype` where they differ, as transformers' `dtype=` would."""
    target = None
    if _rank() == 0:
        work = Path(tempfile.mkdtemp(prefix="trainer-hf-"))
        target = work / "ckpt"
        cmd = [sys.executable, "-m", "reshard", "convert", str(src), str(target), "--to-format", "torch_dist",
               "--to-tp", str(layout.tp), "--to-pp", str(layout.pp), "--to-ep", str(layout.ep),
               "--naming", "local", "--dtype", dtype, "-q"]
        # torchrun's RANK and WORLD_SIZE would make the child a rank of a multi-rank conversion that
        # no other rank joins: it converts alone
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        try:  # whatever happens, the other ranks hear of it (they wait in the broadcast)
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            failure = proc.stdout.strip()[-2000:] if proc.returncode else None
        except OSError as exc:
            failure = str(exc)
        if failure is not None:
            target = f"ERROR: reshard convert failed: {failure}"
            shutil.rmtree(work, ignore_errors=True)
    target = _broadcast(str(target))
    if target.startswith("ERROR:"):
        raise TrainerError(target[7:])
    return Path(target)


def resolve_load(args, layout: Layout) -> tuple[Path | None, Path | None]:
    """The iteration directory to load, converting a HuggingFace directory first, and the temporary
    directory of that conversion (None otherwise). `--load` equal to `--save` resumes if there is a
    checkpoint, else starts afresh."""
    if args.load is None:
        return None, None
    first_launch = args.save is not None and args.load.resolve() == args.save.resolve()
    from reshard.formats.hf import is_hf

    if args.load.exists() and is_hf(args.load):
        log(f"--load {args.load} is a HuggingFace model: converting to torch_dist with reshard")
        converted = hf_to_torch_dist(args.load, layout, "bfloat16" if args.bf16 else "float32")
        return ckpt.find_checkpoint(converted), converted.parent
    try:
        found = ckpt.find_checkpoint(args.load) if args.load.exists() else None
    except ckpt.CheckpointError as exc:
        raise TrainerError(str(exc)) from None
    if found is None and not first_launch:
        raise TrainerError(f"--load {args.load} does not exist" if not args.load.exists() else
                           f"--load {args.load} holds no checkpoint (no {ckpt.TRACKER}, no .metadata); "
                           "to start from scratch, drop --load")
    if found is None:
        log(f"--load {args.load}: no checkpoint yet, starting from scratch")
    return found, None


def check_launch(args, layout: Layout, world: int) -> None:
    """Refuse in one line, before Megatron is set up, what Megatron would refuse with a traceback per rank."""
    if layout.vpp > 1 and layout.pp == 1:
        raise TrainerError("--vpp needs --pp 2 or more")
    for degrees, what in ((layout.tp * layout.pp, "TP x PP"), (layout.expert_tp * layout.ep * layout.pp, "ETP x EP x PP")):
        if world % degrees:
            raise TrainerError(f"{world} processes do not split into {what} = {degrees}: launch a multiple of {degrees}")
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise TrainerError(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters {args.lr_decay_iters} "
                           "(default: --train-iters)")


def model_config(args, saved_args: dict | None, tokenizer_vocab: int) -> ModelConfig:
    """The checkpoint's architecture (`saved_args`: its Megatron args; None when starting afresh), else the preset's."""
    if saved_args is not None:
        config = ModelConfig.from_megatron_args(saved_args)
    else:
        config = PRESETS[args.model]
        if tokenizer_vocab > config.vocab_rows:
            config = config.replace(vocab_size=tokenizer_vocab)
    if tokenizer_vocab > config.vocab_rows:
        raise TrainerError(f"the tokenizer has {tokenizer_vocab} tokens, the model's vocabulary only {config.vocab_rows}")
    return config.replace(params_dtype="bfloat16" if args.bf16 else "float32")


def data_position(data_state: dict, saved_args: dict, iteration: int, global_batch_size: int) -> int:
    """Samples a checkpoint of `iteration` has consumed: the trainer records them in `data_state`;
    Megatron-LM in `args.consumed_train_samples`, which a batch-size rampup makes smaller than
    iteration x global batch (its default 0 is no record)."""
    if "consumed_samples" in data_state:
        return int(data_state["consumed_samples"])
    if saved_args.get("consumed_train_samples"):
        return int(saved_args["consumed_train_samples"])
    return iteration * global_batch_size


# ------------------------------------------------------------------------------------ one iteration

def forward_step_func(device):
    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        # clone: megatron divides the returned loss in place by the number of micro-batches
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        tokens = next(data_iterator).to(device)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        b, s = inputs.shape
        position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
        # Explicit causal mask (True = masked): megatron's default mask is built on "cuda".
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1).view(1, 1, s, s)
        # Stages other than the last ignore the labels and return their hidden states.
        out = model(inputs, position_ids, mask, labels=labels)
        return out, loss_func

    return forward_step


def train_step(ddp: list, optimizer, scheduler, microbatches: list, args, device) -> tuple[float, float]:
    """One optimizer step over the rank's micro-batches; returns (loss averaged over DP, grad norm)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for m in ddp:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    n = len(microbatches)
    if len(ddp) > 1:  # interleaved schedule: every chunk reads the same micro-batches
        data = [iter(list(microbatches)) for _ in ddp]
    else:
        data = iter(microbatches)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step_func(device), data_iterator=data, model=ddp if len(ddp) > 1 else ddp[0],
        num_microbatches=n, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    scheduler.step(increment=args.global_batch_size)
    # Loss: mean over this rank's micro-batches, averaged over DP (one contribution per DP replica).
    mine = torch.zeros(1, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0 and losses:
        mine += torch.stack([d["loss"].double() for d in losses]).mean() / ps.get_data_parallel_world_size()
    torch.distributed.all_reduce(mine)
    if not ok:
        log("warning: the optimizer skipped this step")
    return float(mine), float(grad_norm) if grad_norm is not None else float("nan")


# ---------------------------------------------------------------------------------------- logging

class Logger:
    def __init__(self, args, flops_per_token: float):
        self.rank0 = _rank() == 0
        self.args, self.flops_per_token = args, flops_per_token
        self.metrics = self.tb = None
        if self.rank0 and args.metrics:
            args.metrics.parent.mkdir(parents=True, exist_ok=True)
            self.metrics = open(args.metrics, "a")
        if self.rank0 and args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(args.tensorboard_dir))
        on_gpu = torch.cuda.is_available()
        self.peak = (args.peak_tflops or (989.0 if args.bf16 else 495.0)) * 1e12 if on_gpu else None

    def iteration(self, record: dict) -> None:
        if not self.rank0:
            return
        if self.peak:
            record["mfu"] = record["tokens_per_s"] * self.flops_per_token / (self.peak * torch.distributed.get_world_size())
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if self.tb:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
                if key in record:
                    self.tb.add_scalar(f"train/{key}", record[key], record["iteration"])
        it = record["iteration"]
        if it % self.args.log_interval == 0 or it == self.args.train_iters:
            line = (f"iteration {it:6d}/{self.args.train_iters} | loss {record['loss']:.6f} | lr {record['lr']:.3e} | "
                    f"grad norm {record['grad_norm']:.4f} | {record['tokens_per_s']:.0f} tokens/s | "
                    f"{record['iteration_s'] * 1000:.0f} ms")
            if "mfu" in record:
                line += f" | MFU {100 * record['mfu']:.1f}%"
            print(line, flush=True)

    def event(self, record: dict) -> None:
        """A non-iteration record (checkpoint save/load) in the metrics file."""
        if self.rank0 and self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()

    def close(self) -> None:
        if self.metrics:
            self.metrics.close()
        if self.tb:
            self.tb.close()


def flops_per_token(config: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token: 6 x parameters + attention scores (12 x layers x hidden x seq);
    for MoE the parameters of the routed experts count top-k / experts."""
    from reshard.architecture import model_tensors

    total = 0
    for name, shape in model_tensors(config).items():
        n = math.prod(shape)
        if ".experts." in name and config.is_moe:
            n = n * config.moe_router_topk / config.num_experts
        total += n
    return 6 * total + 12 * config.num_layers * config.hidden_size * seq_length


# ------------------------------------------------------------------------------------------- main

def run(args) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from reshard.trainer.data import BatchSource, prepare
    from reshard.trainer.model import build_model, init_parallel

    layout = Layout(tp=args.tp, pp=args.pp, ep=args.ep, vpp=args.vpp)
    check_launch(args, layout, int(os.environ.get("WORLD_SIZE", "1")))
    init_parallel(layout, seed=args.seed)
    world = torch.distributed.get_world_size()
    dp = ps.get_data_parallel_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    load_dir, temporary = resolve_load(args, layout)
    saved_args = vars(ckpt.read_common(load_dir).get("args") or argparse.Namespace()) if load_dir is not None else None
    _global_batch(args, saved_args, dp)
    tokenizer, dataset, tok_source = prepare(
        args.data, args.seq_length, args.tokenizer, PRESETS[args.model].vocab_rows, [args.load, args.save])
    config = model_config(args, saved_args, tokenizer.get_vocab_size())
    layout.validate(config)
    if config.is_moe and layout.tp > 1 and args.seq_length % layout.tp:
        # sequence parallel, which megatron-core needs for MoE at TP > 1, splits each sequence over TP
        raise TrainerError(f"MoE at TP={layout.tp} runs sequence parallel: --seq-length {args.seq_length} must be a "
                           f"multiple of {layout.tp}")
    if args.save is not None and _rank() == 0:
        args.save.mkdir(parents=True, exist_ok=True)
        if not (args.save / "tokenizer.json").exists():
            tokenizer.save(str(args.save / "tokenizer.json"))
    source = BatchSource(dataset, args.seed, args.global_batch_size, args.micro_batch_size,
                         ps.get_data_parallel_rank(), dp)

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    models = build_model(config, layout, dtype)
    ddp, optimizer = build_optimizer_for(models, args)
    for m in ddp:
        m.config.finalize_model_grads_func = finalize_model_grads
    scheduler = build_scheduler_for(optimizer, args)

    logger = Logger(args, flops_per_token(config, args.seq_length))
    iteration, consumed = 0, 0
    if load_dir is not None:
        iteration, consumed = _resume(args, load_dir, temporary, saved_args, dataset, logger,
                                      (ddp, optimizer, scheduler), layout, config, world)
    log(f"trainer: {config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_rows}, {layout}, "
        f"DP{dp}, global batch {args.global_batch_size} = {args.micro_batch_size} x {dp} x "
        f"{source.num_microbatches}, {len(dataset)} samples of {args.seq_length + 1} tokens"
        + (f" (tokenizer {tok_source})" if tok_source else " (tokenizer trained on the corpus)"))

    margs = ckpt.megatron_args(
        config, layout, world, iteration=iteration, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size, lr=args.lr,
        min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters, lr_decay_iters=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        train_iters=args.train_iters, seed=args.seed, save=str(args.save) if args.save else None,
        save_interval=args.save_interval, use_distributed_optimizer=args.use_distributed_optimizer,
        dist_ckpt_optim_fully_reshardable=args.ckpt_optim_fully_reshardable, overlap_grad_reduce=False,
        grad_reduce_in_fp32=args.bf16,
        tokenizer_type="HuggingFaceTokenizer", data_path=[str(args.data)],
    )

    def save(it: int, consumed: int) -> None:
        margs.iteration = it
        margs.consumed_train_samples = consumed
        data_state = {"consumed_samples": consumed, "fingerprint": dataset.fingerprint(), "seed": args.seed,
                      "num_samples": len(dataset)}
        info = ckpt.save_checkpoint(args.save, it, ddp, optimizer, scheduler, layout, config, margs, data_state)
        logger.event({"event": "checkpoint_save", "iteration": it, **info})
        log(f"saved {args.save / ckpt.iter_dirname(it)} ({info['bytes'] / 1e6:.1f} MB) in {info['seconds']:.2f} s")

    try:
        _train(args, (ddp, optimizer, scheduler), source, logger, save, iteration, consumed, device)
    finally:
        logger.close()


def _global_batch(args, saved_args: dict | None, dp: int) -> None:
    """The global batch: a resumed run keeps its checkpoint's whatever its DP size, since the sample order and the
    schedule count in it; a changed one is said."""
    saved_batch = (saved_args or {}).get("global_batch_size")  # None for converted HF weights
    if args.global_batch_size is None:
        args.global_batch_size = saved_batch or args.micro_batch_size * dp
    elif saved_batch and saved_batch != args.global_batch_size:
        log(f"the global batch changes from the checkpoint's {saved_batch} to {args.global_batch_size}")


def _resume(args, load_dir, temporary, saved_args, dataset, logger, training, layout, config, world) -> tuple[int, int]:
    """Load `load_dir` into the model, optimizer and scheduler (`training`): the iteration and the samples consumed
    that the run goes on from."""
    ddp, optimizer, scheduler = training
    try:
        report = ckpt.load_checkpoint(load_dir, ddp, optimizer, scheduler, layout, config, world=world,
                                      load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                                      seed=args.seed)
    except ckpt.CheckpointError as exc:
        raise TrainerError(str(exc)) from None
    if temporary is not None:  # once every rank has read the converted HF weights
        torch.distributed.barrier()
        if _rank() == 0:
            shutil.rmtree(temporary, ignore_errors=True)
    data_state = report["data_state"] or {}
    if report["optimizer_loaded"]:
        iteration = report["iteration"]
        consumed = data_position(data_state, saved_args, iteration, args.global_batch_size)
    else:
        # Model only (--no-load-optim, a checkpoint without optimizer state, HF weights): Megatron-LM's
        # --finetune-like start would reset the iteration; we keep the position so the run continues.
        iteration = report["iteration"] if report["has_optimizer"] or data_state else 0
        consumed = data_position(data_state, saved_args, iteration, args.global_batch_size) if iteration else 0
        scheduler.num_steps = consumed
        scheduler.step(0)
    if data_state.get("seed") not in (None, args.seed):
        raise TrainerError(f"the checkpoint's sample order was drawn with --seed {data_state['seed']}: pass it to resume")
    if data_state and data_state.get("fingerprint") not in (None, dataset.fingerprint()):
        raise TrainerError(
            f"the data differs from the checkpoint's (token stream {dataset.fingerprint()} vs "
            f"{data_state['fingerprint']}): same --data, --seq-length and tokenizer are needed to resume")
    logger.event({"event": "checkpoint_load", "iteration": iteration, "consumed_samples": consumed,
                  "seconds": report["seconds"], "verified_tensors": report["verified"],
                  "optimizer_loaded": report["optimizer_loaded"]})
    log(f"loaded {load_dir} (iteration {iteration}, {consumed} samples consumed; optimizer "
        f"{'loaded' if report['optimizer_loaded'] else 'NOT loaded (fresh)'}; rng "
        f"{'loaded' if report['rng_loaded'] else 'reseeded'}; {report['verified']} tensors verified against "
        f"the manifest) in {report['seconds']:.2f} s")
    return iteration, consumed


def _train(args, training, source, logger, save, iteration: int, consumed: int, device) -> None:
    """Train from `iteration` to --train-iters, saving every --save-interval and at the end."""
    ddp, optimizer, scheduler = training
    tokens_per_iter = args.global_batch_size * args.seq_length
    while iteration < args.train_iters:
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
        start = time.perf_counter()
        loss, grad_norm = train_step(ddp, optimizer, scheduler, source.microbatches(consumed), args, device)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        iteration += 1
        consumed += args.global_batch_size
        if not math.isfinite(loss):
            raise TrainerError(f"iteration {iteration}: the loss is {loss}")
        logger.iteration({
            "iteration": iteration, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_iter / elapsed, "iteration_s": elapsed, "consumed_samples": consumed,
        })
        if args.save and ((args.save_interval and iteration % args.save_interval == 0) or iteration == args.train_iters):
            save(iteration, consumed)


def build_optimizer_for(models, args):
    from reshard.trainer.optim import build_optimizer

    return build_optimizer(models, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                           adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                           clip_grad=args.clip_grad, bf16=args.bf16,
                           use_distributed_optimizer=args.use_distributed_optimizer)


def build_scheduler_for(optimizer, args):
    from reshard.trainer.optim import build_scheduler

    return build_scheduler(optimizer, lr=args.lr, min_lr=args.min_lr, warmup_iters=args.lr_warmup_iters,
                           decay_iters=args.lr_decay_iters, global_batch_size=args.global_batch_size,
                           weight_decay=args.weight_decay, style=args.lr_decay_style)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    status = 0
    try:
        run(args)
    except (TrainerError, ReshardError, ValueError, ckpt.CheckpointError) as exc:
        if torch.distributed.is_initialized() and _rank() != 0:
            # Rank 0 reports. A check every rank makes fails on rank 0 too, and the launcher stops this rank
            # when rank 0 exits; exiting first would have it kill rank 0 before its line is out. A failure
            # rank 0 does not share is this rank's to report, once rank 0 has had the time to go first.
            time.sleep(REPORT_GRACE_S)
            print(f"trainer: error: rank {_rank()}: {exc}", file=sys.stderr, flush=True)
        else:
            print(f"trainer: error: {exc}", file=sys.stderr, flush=True)
        status = 1
    if torch.distributed.is_initialized():
        if status == 0:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if status:
        sys.stdout.flush()
        os._exit(status)  # skip interpreter teardown: gloo threads of a failed collective can hang it
