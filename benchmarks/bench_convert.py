"""End-to-end conversion benchmark: reshard against `cp -r`, a naive converter and Megatron-Core.

    python benchmarks/bench_convert.py --size 3 --out benchmarks/results.json   # full (~10-15 min here)
    python benchmarks/bench_convert.py --size 0.2                               # smoke
    python benchmarks/bench_convert.py --quick                                  # tiniest smoke (~1 min)

What it does, in one run:
  1. writes two deterministic synthetic checkpoints (fixtures.synthetic) of --size GB each in bf16:
     a Llama-style dense model at TP4 torch_dist, and a MoE model (many experts) at TP2 EP4;
  2. for every measurement: sync, drop the page cache (if permitted; recorded as cold/warm), run the
     command in a fresh subprocess, then `sync` (included in the time, so buffered writers and
     fsyncing writers are treated alike); peak RSS is that child's own ru_maxrss (os.wait4), and
     psutil polling gives the whole process tree's peak (torchrun) and its disk I/O;
  3. measures `cp -r` of each source (the physical limit), reshard conversions
     (`python -m reshard convert`; dense TP4->TP8 also at --workers 1, 2 and 4, and as a 2-rank conversion
     under torchrun), a naive load-everything converter and, unless --skip-mcore, Megatron-Core's own
     reshard-on-load (dist_checkpointing.load at TP8 under torchrun, then save);
  4. writes JSON (machine info included) and prints a markdown table.

Throughput is the model's logical bytes (sum of tensor sizes) per second; `cp` is the directory's bytes
per second. Memory is compared with the largest single parameter (one layer/expert of one tensor, the
unit reshard streams) and with the target "<= 1 GiB + 2 x largest tensor"; steps launched by torchrun
report the whole process tree's summed peak RSS (launcher and every rank), not one process's.
Internal modes (--_build, --_naive, --_mcore) are the subprocesses the benchmark runs itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GIB = 1 << 30
MIB = 1 << 20


# ----------------------------------------------------------------------------- model shapes


def dense_config(size_gb: float):
    """A Llama-style model (GQA, SwiGLU, untied 128k vocabulary) of about `size_gb` GB in bf16."""
    from reshard.config import ModelConfig, pad_vocab

    if size_gb >= 1.5:  # Llama-3.2-1B-like width: 16 layers ~= 1.5B params ~= 3.0 GB
        h, heads, groups, ffn, vocab = 2048, 32, 8, 8192, 128256
    elif size_gb >= 0.15:
        h, heads, groups, ffn, vocab = 1024, 16, 8, 4096, 32000
    else:
        h, heads, groups, ffn, vocab = 512, 16, 8, 2048, 32000
    head_dim = h // heads
    per_layer = 2 * ((heads + 2 * groups) * head_dim * h + heads * head_dim * h + 3 * ffn * h + 2 * h)
    embeddings = 2 * 2 * pad_vocab(vocab, 128, 4) * h
    layers = max(2, round((size_gb * 1e9 - embeddings) / per_layer))
    layers += layers % 2  # PP2 must divide it
    return ModelConfig(
        num_layers=layers, hidden_size=h, num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim,
        ffn_hidden_size=ffn, vocab_size=vocab, padded_vocab_size=pad_vocab(vocab, 128, 4),
        max_position_embeddings=4096, params_dtype="bfloat16", untie_embeddings_and_output_weights=True,
    )


def moe_config(size_gb: float):
    """A MoE model (32 experts, top-2, shared expert, 32k vocabulary) of about `size_gb` GB in bf16."""
    from reshard.config import ModelConfig, pad_vocab

    if size_gb >= 1.5:
        h, heads, groups, eff, shared, experts = 2048, 16, 8, 768, 2048, 32
    elif size_gb >= 0.15:
        h, heads, groups, eff, shared, experts = 1024, 16, 8, 384, 1024, 32
    else:
        h, heads, groups, eff, shared, experts = 512, 8, 4, 256, 512, 16
    vocab, head_dim = 32000, h // heads
    per_layer = 2 * ((heads + 2 * groups) * head_dim * h + heads * head_dim * h + experts * (3 * eff * h + h)
                     + 3 * shared * h + 2 * h)
    embeddings = 2 * 2 * pad_vocab(vocab, 128, 2) * h
    layers = max(2, round((size_gb * 1e9 - embeddings) / per_layer))
    return ModelConfig(
        num_layers=layers, hidden_size=h, num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim,
        ffn_hidden_size=4 * h, vocab_size=vocab, padded_vocab_size=pad_vocab(vocab, 128, 2),
        num_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=eff, moe_shared_expert_intermediate_size=shared,
        params_dtype="bfloat16", untie_embeddings_and_output_weights=True,
    )


def tensor_stats(config) -> dict:
    """Logical bytes, the largest stacked (torch_dist) tensor and the largest single parameter (slab)."""
    from reshard.architecture import model_tensors
    from reshard.logical import describe

    total, stacked, slab = 0, 0, 0
    for name, shape in model_tensors(config).items():
        spec = describe(name, shape, "bfloat16", config)
        n = 2 * spec.numel
        per_slab = n
        for axis in range(spec.prefix_axes):
            per_slab //= spec.shape[axis]
        total, stacked, slab = total + n, max(stacked, n), max(slab, per_slab)
    return {"logical_bytes": total, "largest_stacked_tensor_bytes": stacked, "largest_tensor_bytes": slab,
            "params": total // 2}


# ----------------------------------------------------------------------------- measuring


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def meminfo_cached() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return -1


def drop_caches(enabled: bool) -> dict:
    """sync, then drop the page cache; report whether it worked (Cached: shrinks)."""
    subprocess.run(["sync"], check=False)
    if not enabled:
        return {"cold": False, "why": "--no-drop-cache"}
    before = meminfo_cached()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return {"cold": False, "why": f"drop_caches not permitted ({exc.__class__.__name__})"}
    after = meminfo_cached()
    return {"cold": after < before * 0.5 or after < 256 * MIB, "cached_before_mib": before // MIB,
            "cached_after_mib": after // MIB}


class TreePoller(threading.Thread):
    """Polls a process tree: peak summed RSS and the tree's disk I/O (read_bytes/write_bytes)."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        import psutil

        self.psutil, self.root, self.interval = psutil, psutil.Process(pid), interval
        self.peak_rss = 0
        self.io: dict[int, tuple[int, int, int, int]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        ps = self.psutil
        while not self.stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except ps.Error:
                break
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                    c = p.io_counters()
                    self.io[p.pid] = (c.read_bytes, c.write_bytes, c.read_chars, c.write_chars)
                except ps.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            self.stop.wait(self.interval)

    def totals(self) -> dict:
        """The tree's I/O. Linux adds a child's counters to its parent's once the parent reaps it, so when
        the root (the launcher) has reaped the ranks its own counters already hold theirs."""
        root = self.io.get(self.root.pid, (0, 0, 0, 0))
        children = [sum(v[i] for pid, v in self.io.items() if pid != self.root.pid) for i in range(4)]
        r = [root[i] if root[i] >= children[i] else root[i] + children[i] for i in range(4)]
        return {"disk_read_bytes": r[0], "disk_write_bytes": r[1], "read_chars": r[2], "write_chars": r[3]}


def _self_rss() -> int:
    """The benchmark process's RSS: a floor under every child's ru_maxrss (see machine_info)."""
    import psutil

    return psutil.Process().memory_info().rss


def measure(name: str, cmd: list[str], *, drop: bool, timeout: float, env: dict | None = None,
            cwd: Path = REPO, ranks: int | None = None) -> dict:
    """Run `cmd` cold (if possible) in a fresh process, then sync; time, peak RSS, I/O, output tail.
    `ranks`: `cmd` is a torchrun launch of that many processes, so its memory is the tree's summed peak."""
    cache = drop_caches(drop)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    poller = TreePoller(proc.pid)
    poller.start()
    out_chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    deadline = t0 + timeout
    status, usage, timed_out = None, None, False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            timed_out = True
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    run_s = time.perf_counter() - t0
    subprocess.run(["sync"], check=False)
    total_s = time.perf_counter() - t0
    poller.stop.set()
    poller.join()
    reader.join(timeout=5)
    text = b"".join(out_chunks).decode(errors="replace")
    result = {
        "name": name, "cmd": " ".join(map(str, cmd)), "ok": proc.returncode == 0 and not timed_out,
        "returncode": proc.returncode, "timed_out": timed_out, "seconds": round(total_s, 2),
        "seconds_before_sync": round(run_s, 2), "peak_rss_bytes": usage.ru_maxrss * 1024,
        "tree_peak_rss_bytes": poller.peak_rss, "parent_rss_bytes": _self_rss(), "cache": cache, **poller.totals(),
        "ranks": ranks,
        # a failure keeps more: under torchrun the failing rank's own message sits above a ~12-line summary
        "output_tail": "\n".join(text.strip().splitlines()[-6 if proc.returncode == 0 and not timed_out else -30:]),
    }
    status_word = "ok" if result["ok"] else ("TIMEOUT" if timed_out else f"FAILED rc={proc.returncode}")
    rss_mib = (poller.peak_rss if ranks else usage.ru_maxrss * 1024) / MIB
    print(f"  {name}: {status_word} {total_s:.1f} s, peak RSS {rss_mib:.0f} MiB{' (process tree)' if ranks else ''}"
          f"{'' if cache.get('cold') else ' (warm cache)'}", flush=True)
    if not result["ok"]:
        print("    " + result["output_tail"].replace("\n", "\n    "), flush=True)
    return result


def finish(results: dict, steps: list[dict], out: Path | None) -> int:
    """Write `results` to `out` (if given), flush the disk for the next job, and the exit status: 0 when every step ran."""
    if out:
        out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    subprocess.run(["sync"], check=False)
    return 0 if all(s["ok"] for s in steps) else 1


def python_env(threads: int | None = None) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def git_rev() -> str | None:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "reshard"], cwd=REPO, capture_output=True, text=True).stdout
        return rev + ("+dirty" if dirty else "") if rev else None
    except Exception:
        return None


def machine_info(work: Path) -> dict:
    import psutil

    disk = {}
    try:
        src = subprocess.run(["df", "-PT", str(work)], capture_output=True, text=True).stdout.splitlines()[-1].split()
        disk = {"device": src[0], "fstype": src[1], "size_gib": round(int(src[2]) * 1024 / GIB, 1),
                "free_gib": round(int(src[4]) * 1024 / GIB, 1)}
    except Exception:  # df output varies; the rest of the info is still useful
        pass
    cpu_model = ""
    try:
        cpu_model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except Exception:
        pass
    # Versions come from a child process: importing torch here would inflate every child's ru_maxrss
    # (a forked child's peak RSS includes the parent's pages it started with, and exec keeps that peak).
    probe = ("import json, importlib\nout = {}\nfor m in ('torch', 'numpy', 'tensorstore', 'megatron.core'):\n"
             "    try: out[m] = importlib.import_module(m).__version__\n    except Exception: out[m] = None\nprint(json.dumps(out))")
    try:
        versions = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                             env=python_env()).stdout.strip().splitlines()[-1])
    except Exception:
        versions = {}
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "reshard"], cwd=REPO, capture_output=True, text=True).stdout)
    except Exception:
        rev, dirty = None, None
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": platform.node(), "cpu_cores": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model, "ram_gib": round(psutil.virtual_memory().total / GIB, 1), "disk": disk,
        "python": platform.python_version(), "torch": versions.pop("torch", None), "platform": platform.platform(),
        "git_rev": rev, "reshard_tree_dirty": dirty, **{f"{k}_version": v for k, v in versions.items()},
    }


# ----------------------------------------------------------------------------- internal modes


def build_main(kind: str, path: Path, size_gb: float) -> None:
    """Write the synthetic source checkpoint (dense: TP4 local names, so Megatron's CPU model loads it)."""
    from fixtures.synthetic import SyntheticReader
    from reshard.layout import Layout
    from reshard.plan import make_plan
    from reshard.request import Target
    from reshard.streaming import stream

    if kind == "dense":
        config, layout, naming = dense_config(size_gb), Layout(tp=4), "local"
    else:
        config, layout, naming = moe_config(size_gb), Layout(tp=2, ep=4), None
    reader = SyntheticReader(config, layout, "bfloat16", seed=0)
    if kind == "dense":  # local-spec names (input_layernorm...): what reshard.trainer.model.build_model's GPTModel holds
        reader.common.args["transformer_impl"] = "local"
    plan = make_plan(reader, path, Target(format="torch_dist", layout=layout, naming=naming))
    stream(reader, plan)


_COLUMN = re.compile(r"(linear_qkv\.(weight|bias)|linear_fc1\.(weight|bias)|word_embeddings\.weight|output_layer\.weight)$")
_ROW = re.compile(r"(linear_proj|linear_fc2)\.weight$")


def naive_main(source: Path, target: Path, to_tp: int) -> None:
    """What converters without streaming do (Megatron-LM tools/checkpoint): torch.load every legacy
    rank file fully, torch.cat full tensors, split them for every target rank (all held in memory),
    torch.save one file per target rank. Dense, PP1/EP1 only."""
    import copy

    import torch

    from reshard.config import pad_vocab

    tracker = (source / "latest_checkpointed_iteration.txt").read_text().strip()
    it_dir = source / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    rank_dirs = sorted(p for p in it_dir.iterdir() if re.fullmatch(r"mp_rank_\d\d", p.name))
    if not rank_dirs:
        raise SystemExit(f"naive: no mp_rank_XX directories in {it_dir} (dense PP1 legacy only)")
    states = [torch.load(d / "model_optim_rng.pt", map_location="cpu", weights_only=False) for d in rank_dirs]
    args = states[0]["args"]
    swiglu = getattr(args, "swiglu", True)
    vocab = getattr(args, "vocab_size", None)
    padded = pad_vocab(vocab, args.make_vocab_size_divisible_by, to_tp) if vocab else args.padded_vocab_size
    full: dict[str, object] = {}
    for key in list(states[0]["model"]):
        parts = [s["model"][key] for s in states]
        first = parts[0]
        if not isinstance(first, torch.Tensor):
            full[key] = first
        elif _COLUMN.search(key):
            if swiglu and "linear_fc1" in key:
                halves = [p.chunk(2, dim=0) for p in parts]
                full[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                full[key] = torch.cat(parts, dim=0)
            if "word_embeddings" in key or "output_layer" in key:
                t = full[key]
                rows = min(vocab or t.shape[0], t.shape[0])
                new = torch.zeros((padded, *t.shape[1:]), dtype=t.dtype)
                new[:rows] = t[:rows]
                full[key] = new
        elif _ROW.search(key):
            full[key] = torch.cat(parts, dim=1)
        else:
            full[key] = first
        for s in states:
            s["model"][key] = None  # as a careful converter would: drop the shards once merged
    common = {k: v for k, v in states[0].items() if k not in ("model", "args", "optimizer", "rng_state")}
    del states, parts, first
    targets: list[dict] = [dict() for _ in range(to_tp)]
    for key, t in full.items():
        for r in range(to_tp):
            if not isinstance(t, torch.Tensor):
                targets[r][key] = t
            elif _COLUMN.search(key):
                if swiglu and "linear_fc1" in key:
                    g, u = t.chunk(2, dim=0)
                    targets[r][key] = torch.cat([g.chunk(to_tp, 0)[r], u.chunk(to_tp, 0)[r]], dim=0)
                else:
                    targets[r][key] = t.chunk(to_tp, dim=0)[r].clone()
            elif _ROW.search(key):
                targets[r][key] = t.chunk(to_tp, dim=1)[r].clone()
            else:
                targets[r][key] = t.clone()
    del full
    new_args = copy.copy(args)
    new_args.tensor_model_parallel_size = to_tp
    new_args.padded_vocab_size = padded
    out_dir = target / it_dir.name
    for r, model in enumerate(targets):
        d = out_dir / f"mp_rank_{r:02d}"
        d.mkdir(parents=True, exist_ok=True)
        torch.save({**common, "args": new_args, "model": model}, d / "model_optim_rng.pt")
    (target / "latest_checkpointed_iteration.txt").write_text(tracker)


def mcore_main(source: Path, target: Path, size_gb: float, to_tp: int) -> None:
    """torchrun worker: Megatron-Core's reshard-on-load. Build the dense GPTModel (local spec, bf16, CPU)
    at TP=to_tp, dist_checkpointing.load the TP4 source into it, dist_checkpointing.save it."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from reshard.layout import Layout
    from reshard.trainer.model import build_model, init_parallel

    config = dense_config(size_gb)
    layout = Layout(tp=to_tp)
    init_parallel(layout)
    t0 = time.perf_counter()
    models = build_model(config, layout, dtype=torch.bfloat16)
    t_build = time.perf_counter() - t0
    tracker = (source / "latest_checkpointed_iteration.txt").read_text().strip()
    it_name = "release" if tracker == "release" else f"iter_{int(tracker):07d}"
    request = {"model": models[0].sharded_state_dict()}
    loaded = dist_checkpointing.load(request, str(source / it_name), strict="assume_ok_unexpected")
    models[0].load_state_dict(loaded["model"], strict=True)
    del loaded
    t_load = time.perf_counter() - t0 - t_build
    out = target / it_name
    if torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    from fixtures.megatron_checkpoint import megatron_args  # the common state Megatron-LM saves (reshard verify needs args)

    state = {"model": models[0].sharded_state_dict(), "iteration": int(tracker) if tracker != "release" else 0,
             "args": megatron_args(config, layout, "torch_dist", int(tracker) if tracker != "release" else 0,
                                   torch.distributed.get_world_size()),
             "checkpoint_version": 3.0}
    dist_checkpointing.save(state, str(out), sharded_strategy=strategy)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        (target / "latest_checkpointed_iteration.txt").write_text(tracker)
        print(f"mcore phases: build {t_build:.1f} s, load {t_load:.1f} s, save {time.perf_counter() - t0 - t_build - t_load:.1f} s",
              flush=True)
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- the benchmark


def reshard_args(src: Path, dst: Path, *flags: str) -> list[str]:
    return ["-m", "reshard", "convert", str(src), str(dst), "-q", *flags]


def reshard_cmd(src: Path, dst: Path, *flags: str) -> list[str]:
    return [sys.executable, *reshard_args(src, dst, *flags)]


def torchrun_cmd(ranks: int, *program: str) -> list[str]:
    """`torchrun --standalone` on this machine: `program` is a script path or `-m module` plus its arguments.
    Through `python -m torch.distributed.run` so that the venv's interpreter runs the launcher too."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *program]


def verify_step(res: dict, out: Path, against: Path, key: str, env: dict) -> None:
    """Untimed: does `out` hold the same logical weights as `against`? (`reshard verify`; result under `key`)."""
    if not res["ok"] or not out.exists() or not against.exists():
        return
    check = subprocess.run([sys.executable, "-m", "reshard", "verify", str(out), "--against", str(against)],
                           cwd=REPO, env=env, capture_output=True, text=True)
    # exit 1: the weights differ (or reshard refused to compare them); anything else: verify itself broke (None)
    res[key] = {0: True, 1: False}.get(check.returncode)
    res["verify_output"] = (check.stdout + check.stderr).strip()[-400:]
    said = {True: "same weights", False: "DIFFERENT weights", None: f"verify failed rc={check.returncode}"}[res[key]]
    print(f"    {res['name']}: output against {against.name}: {said}", flush=True)
    if not res[key]:
        print("    " + res["verify_output"].replace("\n", "\n    "), flush=True)


def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _counts(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4), for --workers and --ranks."""
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=3.0, help="model size in GB (bf16 bytes) of each source (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: --size 0.05, short timeouts")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default: <work>/results.json)")
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / "work", help="work directory (git-ignored)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints in --work")
    parser.add_argument("--no-drop-cache", action="store_true", help="do not drop the page cache before each step")
    parser.add_argument("--skip-mcore", action="store_true", help="skip Megatron-Core's reshard-on-load")
    parser.add_argument("--skip-naive", action="store_true", help="skip the naive load-everything converter")
    parser.add_argument("--skip-moe", action="store_true", help="dense model only")
    parser.add_argument("--only", action="append", metavar="TEXT",
                        help="run only the dense reshard steps whose label contains TEXT (repeatable; cp always runs)")
    parser.add_argument("--timeout", type=float, default=None, help="per-step limit in seconds (default scales with size)")
    parser.add_argument("--workers", type=_counts, default=(1, 2, 4), metavar="N,N,...",
                        help="--workers values of the TP4->TP8 scaling steps (default 1,2,4)")
    parser.add_argument("--ranks", type=_counts, default=(2,), metavar="N,N,...",
                        help="torchrun process counts of the multi-rank TP4->TP8 steps (default 2)")
    parser.add_argument("--_build", nargs=3, metavar=("KIND", "PATH", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--_naive", nargs=3, metavar=("SRC", "DST", "TP"), help=argparse.SUPPRESS)
    parser.add_argument("--_mcore", nargs=4, metavar=("SRC", "DST", "SIZE", "TP"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._build:
        build_main(args._build[0], Path(args._build[1]), float(args._build[2]))
        return 0
    if args._naive:
        naive_main(Path(args._naive[0]), Path(args._naive[1]), int(args._naive[2]))
        return 0
    if args._mcore:
        mcore_main(Path(args._mcore[0]), Path(args._mcore[1]), float(args._mcore[2]), int(args._mcore[3]))
        return 0

    size = 0.05 if args.quick else args.size
    if size <= 0:
        parser.error("--size must be positive")
    work: Path = args.work.resolve()
    out_path = (args.out or work / "results.json").resolve()
    timeout = args.timeout or max(120.0, 120.0 * size)
    drop = not args.no_drop_cache
    try:
        import psutil  # noqa: F401
    except ImportError:
        print("bench_convert: psutil is needed (pip install psutil)", file=sys.stderr)
        return 2

    work.mkdir(parents=True, exist_ok=True)
    need = size * 1e9 * 12  # sources, outputs kept for later steps, plus reshard's write amplification margin
    free = shutil.disk_usage(work).free
    if free < need:
        print(f"bench_convert: {work} has {free / 1e9:.1f} GB free; about {need / 1e9:.0f} GB are needed for --size {size}",
              file=sys.stderr)
        return 2

    info = machine_info(work)
    dense, moe = dense_config(size), moe_config(size)
    models = {"dense": {"config": dense.to_dict(), **tensor_stats(dense), "source_layout": "TP4PP1EP1 torch_dist"},
              "moe": {"config": moe.to_dict(), **tensor_stats(moe), "source_layout": "TP2PP1EP4 torch_dist"}}
    kinds = ["dense"] if args.skip_moe else ["dense", "moe"]
    results: dict = {"machine": info, "size_gb": size, "models": {k: models[k] for k in kinds}, "steps": [],
                     "notes": []}
    env = python_env()
    print(f"bench_convert: size {size} GB, work {work}, {info['cpu_cores']} cores, {info['ram_gib']} GiB RAM", flush=True)
    for k in kinds:
        m = models[k]
        print(f"  {k}: {m['params'] / 1e9:.2f} B params, {m['logical_bytes'] / 1e9:.2f} GB, largest tensor "
              f"{m['largest_tensor_bytes'] / MIB:.0f} MiB ({m['largest_stacked_tensor_bytes'] / MIB:.0f} MiB stacked)", flush=True)

    src = {k: work / f"{k}_src" for k in kinds}
    steps: list[dict] = results["steps"]

    def record(res: dict, model: str, kind: str, out_dir: Path | None, source_dir: Path | None) -> dict:
        res["model"], res["kind"] = model, kind
        res["git_rev"] = git_rev()  # reshard/ may change under a long run; every step says what it measured
        res["logical_bytes"] = models[model]["logical_bytes"]
        res["source_dir_bytes"] = dir_bytes(source_dir) if source_dir else None
        res["output_dir_bytes"] = dir_bytes(out_dir) if out_dir and out_dir.exists() else None
        steps.append(res)
        return res

    def measure_multi_rank(source: Path, out: Path, ranks: int) -> None:
        """reshard TP4->TP8 as one conversion over `ranks` processes (reshard.collective: each rank writes a
        share, rank 0 the metadata), under torchrun; timed and measured as a whole process tree."""
        name = f"reshard TP4->TP8 torch_dist, {ranks} ranks (torchrun)"
        rmtree(out)
        cmd = torchrun_cmd(ranks, *reshard_args(source, out, "--to-tp", "8"))
        # OMP_NUM_THREADS=1 is what torchrun sets anyway (with a warning); the ranks' reader threads are --workers.
        res = record(measure(name, cmd, drop=drop, timeout=timeout * 2, env=python_env(threads=1), ranks=ranks),
                     "dense", "reshard", out, source)
        # reshard checks its own checksums; this also checks that the ranks' shares add up to the source's weights
        verify_step(res, out, source, "verified_against_source", env)
        rmtree(out)

    t_start = time.perf_counter()
    try:
        print("building sources", flush=True)
        for k in kinds:
            rmtree(src[k])
            res = measure(f"build {k} source", [sys.executable, __file__, "--_build", k, str(src[k]), str(size)],
                          drop=False, timeout=timeout * 3, env=env)
            record(res, k, "build", src[k], None)
            if not res["ok"]:
                raise SystemExit(f"bench_convert: could not build the {k} source:\n{res['output_tail']}")

        def measure_cp(k: str) -> None:
            """One `cp -r` of a source: taken at the start, the middle and the end of the run, since this
            disk's speed drifts by 2x within minutes; ratios are to their median."""
            dst = work / f"{k}_cp"
            rmtree(dst)
            record(measure(f"cp -r {k}", ["cp", "-r", str(src[k]), str(dst)], drop=drop, timeout=timeout), k, "cp", dst, src[k])
            rmtree(dst)

        def measure_floors() -> None:
            """`cp -r` of each source, and reshard's start-up alone: a cold `import reshard.convert` (Python, torch,
            numpy, tensorstore) is a fixed cost that `cp` does not pay, 1-2 s on a CPU-only torch and ~5 s on a
            CUDA build (its libraries read from disk), which weighs on a 3 GB conversion and not on a 140 GB one."""
            for k in kinds:
                measure_cp(k)
            record(measure("start-up: import reshard.convert", [sys.executable, "-c", "import reshard.convert"], drop=drop,
                           timeout=timeout, env=env), "dense", "startup", None, None)

        print("measuring", flush=True)
        measure_floors()

        d = src["dense"]
        zarr_dir, legacy_dir, hf_dir = work / "dense_zarr", work / "dense_legacy_tp4", work / "dense_hf"
        # The --workers steps pin the thread count the default (min(8, 2 x cores)) leaves to the machine: scaling.
        dense_steps = [
            ("TP4->TP8 torch_dist", d, work / "dense_tp8", ["--to-tp", "8"], True),
            *((f"TP4->TP8 torch_dist --workers {w}", d, work / f"dense_tp8_w{w}", ["--to-tp", "8", "--workers", str(w)], True)
              for w in args.workers),
            ("TP4->TP2PP2 torch_dist", d, work / "dense_tp2pp2", ["--to-tp", "2", "--to-pp", "2"], True),
            ("torch_dist->zarr", d, zarr_dir, ["--to-format", "zarr"], False),
            ("zarr->torch_dist", zarr_dir, work / "dense_from_zarr", ["--to-format", "torch_dist"], True),
            ("torch_dist->legacy", d, legacy_dir, ["--to-format", "legacy", "--no-optimizer"], False),
            ("legacy TP4->TP8", legacy_dir, work / "dense_legacy_tp8", ["--to-tp", "8"], args.skip_naive),
            ("torch_dist->hf (export)", d, hf_dir, ["--to-format", "hf", "--no-optimizer"], False),
            ("hf->torch_dist TP4 (import)", hf_dir, work / "dense_from_hf", ["--to-format", "torch_dist", "--to-tp", "4"], True),
        ]
        for label, s, t, flags, delete in dense_steps:
            if args.only and not any(o in label for o in args.only):
                continue
            rmtree(t)
            if not s.exists():
                print(f"  reshard {label}: skipped, its source {s.name} was not produced", flush=True)
                steps.append({"name": f"reshard {label}", "model": "dense", "kind": "reshard", "ok": False,
                              "skipped": f"source {s.name} missing (an earlier step failed)"})
                continue
            record(measure(f"reshard {label}", reshard_cmd(s, t, *flags), drop=drop, timeout=timeout, env=env),
                   "dense", "reshard", t, s)
            if delete:
                rmtree(t)
        for ranks in args.ranks:
            if not args.only or any(o in f"{ranks} ranks" for o in args.only):
                measure_multi_rank(d, work / "dense_tp8_ranks", ranks)
        if "moe" in kinds:
            t = work / "moe_ep2"
            rmtree(t)
            record(measure("reshard EP4->EP2 (MoE)", reshard_cmd(src["moe"], t, "--to-ep", "2"), drop=drop, timeout=timeout, env=env),
                   "moe", "reshard", t, src["moe"])
            rmtree(t)
        # The baselines come last: Megatron-Core's step holds 14 GB at 3 GB, and on a VM memory handed back
        # is slow to fault in again (a fresh page, 1 GB/s; a recycled one, 7 GB/s), which taxes the next step.
        measure_floors()
        rmtree(zarr_dir)
        rmtree(hf_dir)

        if not args.skip_naive:
            naive_out = work / "dense_naive_tp8"
            rmtree(naive_out)
            if legacy_dir.exists():
                res = record(measure("naive legacy TP4->TP8", [sys.executable, __file__, "--_naive", str(legacy_dir), str(naive_out), "8"],
                                     drop=drop, timeout=timeout * 2, env=env), "dense", "naive", naive_out, legacy_dir)
                verify_step(res, naive_out, work / "dense_legacy_tp8", "verified_against_reshard", env)  # is the baseline right?
            rmtree(naive_out)
            rmtree(work / "dense_legacy_tp8")
        rmtree(legacy_dir)

        if not args.skip_mcore:
            mcore_out = work / "dense_mcore_tp8"
            rmtree(mcore_out)
            cmd = torchrun_cmd(8, __file__, "--_mcore", str(d), str(mcore_out), str(size), "8")
            res = record(measure("megatron-core load@TP8+save", cmd, drop=drop, timeout=timeout * 3, env=python_env(threads=1),
                                 ranks=8), "dense", "mcore", mcore_out, d)
            phases = re.search(r"mcore phases: (.*)", res.get("output_tail", ""))
            res["phases"] = phases.group(1) if phases else None
            verify_step(res, mcore_out, d, "verified_against_source", env)  # same logical weights?
            rmtree(mcore_out)
        else:
            results["notes"].append("megatron-core reshard-on-load: not measured (--skip-mcore)")

        measure_floors()
    finally:
        results["total_seconds"] = round(time.perf_counter() - t_start, 1)
        summarize(results)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1))
        if not args.keep:
            for k in kinds:
                rmtree(src[k])
            for p in work.glob("dense_*"):
                rmtree(p)
            for p in work.glob("moe_*"):
                rmtree(p)
            for p in work.glob(".*.reshard-partial"):  # a conversion killed at the timeout leaves its partial sibling
                rmtree(p)
        print(render(results))
        print(f"\nresults: {out_path} ({results['total_seconds']} s in all)")
    return 0 if all(s.get("ok") for s in steps) else 1


def summarize(results: dict) -> None:
    """Derived figures: MB/s, ratio to cp of the same model, memory ratios and the memory target."""
    runs: dict[str, list[float]] = {}
    for s in results["steps"]:
        if s.get("kind") == "cp" and s.get("ok") and s.get("seconds"):
            runs.setdefault(s["model"], []).append(s["source_dir_bytes"] / s["seconds"] / 1e6)
    cp = {model: statistics.median(speeds) for model, speeds in runs.items()}
    results["cp_mb_per_s"] = {model: {"median": round(cp[model], 1), "runs": [round(v, 1) for v in speeds]} for model, speeds in runs.items()}
    startups = [s["seconds"] for s in results["steps"] if s.get("kind") == "startup" and s.get("ok")]
    startup = statistics.median(startups) if startups else None
    if startups:
        results["startup_seconds"] = {"median": startup, "runs": startups}
    for s in results["steps"]:
        if not s.get("seconds") or s.get("kind") in ("build", "startup"):
            continue
        m = results["models"][s["model"]]
        if s["kind"] == "cp":
            s["mb_per_s"] = round(s["source_dir_bytes"] / s["seconds"] / 1e6, 1)
            s["logical_mb_per_s"] = round(m["logical_bytes"] / s["seconds"] / 1e6, 1)
        else:
            s["mb_per_s"] = round(m["logical_bytes"] / s["seconds"] / 1e6, 1)
        if s["model"] in cp:  # a cp run too: how far it is from the median
            s["vs_cp"] = round(s["mb_per_s"] / cp[s["model"]], 3)
            if s["kind"] != "cp" and not s.get("ranks") and startup and s["seconds"] > startup:  # the conversion itself
                s["vs_cp_after_startup"] = round(m["logical_bytes"] / (s["seconds"] - startup) / 1e6 / cp[s["model"]], 3)
        rss = s["tree_peak_rss_bytes"] if s.get("ranks") else s["peak_rss_bytes"]  # torchrun: the launcher's own peak says nothing
        s["rss_bytes_reported"] = rss
        s["rss_over_largest_tensor"] = round(rss / m["largest_tensor_bytes"], 2)
        s["memory_target_bytes"] = GIB + 2 * m["largest_tensor_bytes"]
        s["meets_memory_target"] = rss <= s["memory_target_bytes"]
        if s.get("output_dir_bytes"):
            s["output_over_logical"] = round(s["output_dir_bytes"] / m["logical_bytes"], 2)
    steps = {s["name"]: s for s in results["steps"]}
    reshard_tp8, naive = steps.get("reshard legacy TP4->TP8"), steps.get("naive legacy TP4->TP8")
    if reshard_tp8 and naive and reshard_tp8.get("ok") and naive.get("ok"):
        results["reshard_vs_naive"] = {
            "speedup": round(naive["seconds"] / reshard_tp8["seconds"], 2),
            "memory_ratio": round(naive["peak_rss_bytes"] / reshard_tp8["peak_rss_bytes"], 2),
            "note": "same conversion (legacy TP4 -> legacy TP8); reshard also checksums every tensor as read and as written",
        }


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def render(results: dict) -> str:
    lines = [
        f"\n### reshard conversion benchmark: {results['size_gb']} GB models, {results['machine']['cpu_cores']} cores, "
        f"{results['machine']['ram_gib']} GiB RAM, {results['machine']['disk'].get('fstype', '?')} ({results['machine']['date']})\n",
    ]
    for k, m in results["models"].items():
        lines.append(f"- {k}: {m['params'] / 1e9:.2f} B params, {m['logical_bytes'] / 1e9:.2f} GB bf16, {m['source_layout']}, "
                     f"largest tensor {m['largest_tensor_bytes'] / MIB:.0f} MiB, memory target "
                     f"{(GIB + 2 * m['largest_tensor_bytes']) / MIB:.0f} MiB")
    lines += ["", "| step | cache | s | MB/s | × cp | × cp less start-up | peak RSS MiB | RSS / largest | ≤ target | out / logical |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: |"]
    for s in results["steps"]:
        if s.get("kind") in ("build", "startup"):
            continue
        if not s.get("ok"):
            why = s.get("skipped") or ("timeout" if s.get("timed_out") else f"failed rc={s.get('returncode')}")
            lines.append(f"| {s['name']} | | | | | | | | | {why} |")
            continue
        # a step that ran but whose output `reshard verify` rejected (or could not check) must not read as a plain result
        checks = [v for k, v in s.items() if k.startswith("verified_")]
        flag = " (output DIFFERS)" if False in checks else " (verify error)" if None in checks else ""
        lines.append(
            f"| {s['name']}{flag} | {'cold' if s['cache'].get('cold') else 'warm'} | "
            f"{s['seconds']:.1f} | {s['mb_per_s']:.0f} | "
            f"{s.get('vs_cp', float('nan')):.2f} | {_ratio(s.get('vs_cp_after_startup'))} | {s['rss_bytes_reported'] / MIB:.0f} | "
            f"{s['rss_over_largest_tensor']:.1f} | {'yes' if s['meets_memory_target'] else 'NO'} | "
            f"{s.get('output_over_logical', float('nan')):.2f} |"
        )
    if results.get("reshard_vs_naive"):
        r = results["reshard_vs_naive"]
        lines.append(f"\nreshard vs naive (legacy TP4->TP8): naive time / reshard time = {r['speedup']}, "
                     f"naive peak RSS / reshard peak RSS = {r['memory_ratio']}")
    lines.append("\nMB/s: model (logical) bytes per second, cp: directory bytes per second; times include a final `sync`.")
    for model, cp in results.get("cp_mb_per_s", {}).items():
        lines.append(f"× cp: against the median of {len(cp['runs'])} `cp -r` runs of the {model} source ({cp['runs']} MB/s).")
    if results.get("startup_seconds"):
        st = results["startup_seconds"]
        lines.append(f"× cp less start-up: the step's time less reshard's start-up alone (a cold `import reshard.convert`: "
                     f"median of {st['runs']} s), a cost `cp` does not pay and that does not grow with the model.")
    if any(s.get("ranks") and s.get("ok") for s in results["steps"]):
        lines.append("Peak RSS of torchrun steps (N ranks): the summed RSS of the whole process tree (launcher and ranks).")
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
