"""Trainer overhead and checkpoint speed (CPU-friendly, a few minutes).

    python benchmarks/bench_trainer.py [--model small-llama] [--nproc 1] [--iters 8] [--repeats 2]

1. Throughput: `python -m reshard.trainer` (data pipeline, logging, metrics) against a bare Megatron-Core loop
   built from the same pieces (GPTModel, DDP, get_megatron_optimizer, get_forward_backward_func) on
   pre-made random token batches of the same shape. Reported: median tokens/s of each over the
   iterations after the first two, best of --repeats runs, and the ratio (overhead target <= 5%).
2. Checkpoint: the trainer's save (torch_dist + checksums + atomic rename, from its metrics file) and
   load (dist_checkpointing.load + checksum verification of what was loaded) against `cp -r` of the
   same iteration directory in the same run (not page-cache cold; run-to-run noise here is +-40%).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def torchrun(nproc: int, target: list[str], args: list) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target,
           *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)), PYTHONWARNINGS="ignore",
               PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-4000:]}")
    return proc.stdout


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def steady(times: list[float]) -> float:
    return statistics.median(times[2:] if len(times) > 3 else times)


# ------------------------------------------------------------------------------ bare worker

def bare_worker(argv: list[str]) -> None:
    """A bare Megatron-Core loop: the trainer's model/optimizer pieces, random tokens, no pipeline."""
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--iters", type=int)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from reshard.layout import Layout
    from reshard.trainer.model import build_model, init_parallel
    from reshard.trainer.optim import build_optimizer
    from reshard.trainer.presets import PRESETS

    config = PRESETS[a.model]
    layout = Layout(tp=a.tp)
    init_parallel(layout, seed=1)
    models = build_model(config, layout)
    ddp, optimizer = build_optimizer(models, lr=1e-3, weight_decay=0.01, clip_grad=1.0, adam_beta2=0.95)
    ddp[0].config.finalize_model_grads_func = finalize_model_grads
    n_micro = a.global_batch_size // (a.micro_batch_size * ps.get_data_parallel_world_size())
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_rows, (a.micro_batch_size, a.seq_length + 1), generator=gen)
               for _ in range(n_micro)]
    s = a.seq_length
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    position_ids = torch.arange(s).unsqueeze(0).expand(a.micro_batch_size, s)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        out = model(tokens[:, :-1], position_ids, mask, labels=tokens[:, 1:])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    times = []
    for _ in range(a.iters):
        start = time.perf_counter()
        ddp[0].zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=ddp[0],
                                    num_microbatches=n_micro, seq_length=s, micro_batch_size=a.micro_batch_size,
                                    forward_only=False)
        optimizer.step()
        times.append(time.perf_counter() - start)
    if torch.distributed.get_rank() == 0:
        a.out.write_text(json.dumps({"iteration_s": times}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small-llama")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()

    from fixtures.corpus import write_corpus

    work = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    try:
        corpus = write_corpus(work / "corpus.txt", docs=3000, seed=0)
        shape = ["--seq-length", a.seq_length, "--micro-batch-size", a.micro_batch_size,
                 "--global-batch-size", a.global_batch_size]
        ours, bare, save_s, ckpt_bytes = [], [], [], 0
        for r in range(a.repeats):
            save = work / f"ckpt{r}"
            metrics = work / f"ours{r}.jsonl"
            torchrun(a.nproc, ["-m", "reshard.trainer"], ["--model", a.model, "--tp", a.tp, "--data", corpus, *shape,
                                                  "--train-iters", a.iters, "--save", save, "--metrics", metrics,
                                                  "--log-interval", 1000])
            recs = records(metrics)
            ours.append(steady([x["iteration_s"] for x in recs if "loss" in x]))
            saved = [x for x in recs if x.get("event") == "checkpoint_save"][-1]
            save_s.append(saved["seconds"])
            ckpt_bytes = saved["bytes"]
            out = work / f"bare{r}.json"
            torchrun(a.nproc, [str(Path(__file__).resolve()), "--bare-worker"],
                     ["--model", a.model, "--tp", a.tp, *shape, "--iters", a.iters, "--out", out])
            bare.append(steady(json.loads(out.read_text())["iteration_s"]))
        tokens = a.global_batch_size * a.seq_length

        # Load: a run that only loads (train-iters already reached) and verifies.
        load_metrics = work / "load.jsonl"
        torchrun(a.nproc, ["-m", "reshard.trainer"], ["--model", a.model, "--tp", a.tp, "--data", corpus, *shape,
                                              "--train-iters", a.iters, "--load", work / "ckpt0",
                                              "--metrics", load_metrics])
        load_s = [x for x in records(load_metrics) if x.get("event") == "checkpoint_load"][-1]["seconds"]
        cp_s = []
        src = work / "ckpt0" / f"iter_{a.iters:07d}"
        for i in range(3):
            dst = work / f"copy{i}"
            start = time.perf_counter()
            subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
            subprocess.run(["sync", str(dst)], check=False)
            cp_s.append(time.perf_counter() - start)
        cp = statistics.median(cp_s)
        result = {
            "model": a.model, "nproc": a.nproc, "tp": a.tp, "tokens_per_iteration": tokens,
            "trainer_tokens_per_s": round(tokens / min(ours), 1),
            "bare_megatron_tokens_per_s": round(tokens / min(bare), 1),
            "throughput_ratio": round(min(bare) / min(ours), 4),
            "overhead_pct": round(100 * (min(ours) / min(bare) - 1), 2),
            "checkpoint_mb": round(ckpt_bytes / 1e6, 1),
            "save_s": round(min(save_s), 3), "load_s": round(load_s, 3), "cp_r_s": round(cp, 3),
            "save_vs_cp": round(min(save_s) / cp, 2), "load_vs_cp": round(load_s / cp, 2),
            "runs": {"ours_iteration_s": ours, "bare_iteration_s": bare, "save_s": save_s, "cp_s": cp_s},
        }
        print(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--bare-worker":
        bare_worker(sys.argv[2:])
    else:
        main()
