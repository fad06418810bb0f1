"""DistributedOptimizer state benchmark: a dp_reshardable checkpoint converted to another TP/PP, against `cp -r` and a
parallel copy of the same bytes.

    python benchmarks/bench_optimizer.py --size 1 --out benchmarks/results_optimizer.json   # ~1 GB bf16 model
    python benchmarks/bench_optimizer.py --size 0.1                                         # smoke
    python benchmarks/bench_optimizer.py --size 1 --old main --out benchmarks/results_optimizer.json  # vs main too

What it does, in one run:
  1. builds a deterministic synthetic Llama-style model of --size GB in bf16 (bench_convert's `dense_config`) with
     DistributedOptimizer state (fp32 master weights, exp_avg, exp_avg_sq: 12 bytes per parameter), written by
     `reshard convert`'s own dp_reshardable writer as Megatron-LM's default form at TP2 DP4;
  2. measures, each cold where the page cache can be dropped (bench_convert's `measure`: a fresh process, `sync`
     included, peak RSS from os.wait4): `cp -r` of the source and its parallel copy (benchmarks/parallel_copy.py,
     `--copy-threads` threads over 64 MiB ranges, fsynced: the baseline of #20's target, >= 0.8x), then `reshard
     convert` of it to TP1 PP2 DP4, once written again as dp_reshardable buckets and once as per-parameter
     fully_reshardable tensors; all that twice, then both copies once more (x cp and x parallel copy are against
     the median of the three runs of each: this disk's speed drifts within minutes);
     with `--old REV`, each conversion also by that revision's tree (`git archive`), right after or before the new
     one (alternating), so that the ratio of the two is measured under the same load and disk;
  3. writes JSON (commands repo-relative) and prints a markdown table.

Throughput is the source directory's bytes per second (model and optimizer, as `cp` moves them). The memory target
is 1 GiB + 2 x the largest parameter's fp32 state (one state tensor of the largest single parameter).
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import MIB, REPO, dense_config, dir_bytes, finish, machine_info, measure, python_env, tensor_stats  # noqa: E402

GIB = 1 << 30
SOURCE = dict(tp=2, dp=4)
STEPS = {  # name -> convert flags
    "dp_reshardable TP2 DP4 -> TP1 PP2 DP4 (buckets)": ["--to-tp", "1", "--to-pp", "2", "--optimizer-form", "dp_reshardable"],
    "dp_reshardable TP2 DP4 -> TP1 PP2 (fully_reshardable)": ["--to-tp", "1", "--to-pp", "2"],
}


def optimizer_reader(config, layout):
    """A deterministic synthetic bf16 model of `config` at `layout`, with DistributedOptimizer state (fp32 master
    weights, exp_avg, exp_avg_sq), as a reader a conversion streams from."""
    from fixtures.synthetic import SyntheticReader
    from reshard.logical import describe

    reader = SyntheticReader(config, layout, "bfloat16", seed=0)
    for name, spec in list(reader.specs.items()):
        for state in ("param", "exp_avg", "exp_avg_sq"):
            key = f"optimizer.state.{state}.{name}"
            reader.specs[key] = describe(key, spec.shape, "float32", config)
    reader.common.args.update(transformer_impl="local", use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    group = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "step": 10}
    reader.common.extra["optimizer"] = {
        "optimizer": {"param_groups": [{**group, "wd_mult": 1.0}, {**group, "wd_mult": 0.0}]},
        "param_state_sharding_type": "fully_reshardable",
    }
    return reader


def build_main(path: Path, size_gb: float) -> None:
    """The synthetic source: model tensors and DistributedOptimizer state streamed into dp_reshardable buckets."""
    from reshard.layout import Layout
    from reshard.plan import make_plan
    from reshard.request import Target
    from reshard.streaming import stream

    layout = Layout(tp=SOURCE["tp"])
    reader = optimizer_reader(dense_config(size_gb), layout)
    target = Target(format="torch_dist", layout=layout, naming="local", optimizer_form="dp_reshardable", dp=SOURCE["dp"])
    stream(reader, make_plan(reader, path, target))


def largest_parameter_fp32_bytes(size_gb: float) -> int:
    """One fp32 state tensor of the largest single parameter (a layer's slice of a stacked tensor)."""
    from reshard.architecture import model_tensors
    from reshard.logical import describe

    config = dense_config(size_gb)
    largest = 0
    for name, shape in model_tensors(config).items():
        spec = describe(name, shape, "float32", config)
        per_parameter = spec.numel
        for axis in range(spec.prefix_axes):
            per_parameter //= spec.shape[axis]
        largest = max(largest, 4 * per_parameter)
    return largest


def new_vs_old(steps: list[dict]) -> dict[str, dict[str, float]]:
    """Each conversion's median seconds by this tree and by `--old`'s, and how many times faster this one is."""
    rows = {}
    for name in STEPS:
        by = {
            tree: statistics.median(s["seconds"] for s in steps if s.get("tree") == tree and s["name"].startswith(name + " ("))
            for tree in ("new", "old")
        }
        rows[name] = {"new_seconds": by["new"], "old_seconds": by["old"], "speedup": round(by["old"] / by["new"], 3)}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=1.0, help="the model's bf16 size in GB (its optimizer state is 6x)")
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / "work" / "optimizer", help="work directory (git-ignored)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-drop-cache", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--copy-threads", type=int, default=8, help="threads of the parallel-copy baseline")
    parser.add_argument("--old", help="also convert with this revision (a commit, tag or branch), alternately with this tree")
    parser.add_argument("--_build", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._build:
        build_main(args._build, args.size)
        return 0

    work = args.work.resolve()  # the old tree runs from its own directory
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = python_env()
    drop = not args.no_drop_cache
    src = work / "src"
    steps = []
    trees = {"new": REPO}
    if args.old:
        trees["old"] = Path(tempfile.mkdtemp(prefix="old-tree-", dir=work))
        archive = subprocess.run(["git", "archive", args.old], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(trees["old"])], input=archive, check=True)
    build = measure("build source", [sys.executable, __file__, "--size", str(args.size), "--_build", str(src)], drop=False, timeout=3600, env=env)
    if not build["ok"]:
        raise SystemExit(f"bench_optimizer: could not build the source:\n{build['output_tail']}")
    source_bytes = dir_bytes(src)

    def measure_cp(when: str) -> None:
        """`cp -r` of the source, and the parallel copy the speed target is stated against."""
        for kind, name, cmd in (
            ("cp", f"cp -r ({when})", ["cp", "-r", str(src), str(work / "cp")]),
            ("parallel_copy", f"parallel copy, {args.copy_threads} threads ({when})",
             [sys.executable, str(REPO / "benchmarks" / "parallel_copy.py"), str(src), str(work / "cp"), "--threads", str(args.copy_threads)]),
        ):
            res = measure(name, cmd, drop=drop, timeout=3600, env=env)
            shutil.rmtree(work / "cp", ignore_errors=True)
            steps.append({**res, "kind": kind})

    for i, round_ in enumerate(("first", "second")):  # each step twice, alternating, so that drift does not favour one
        measure_cp(round_)
        for name, flags in STEPS.items():
            for tree in sorted(trees, reverse=i % 2 == 1):
                out = work / "out"
                cmd = [sys.executable, "-m", "reshard", "convert", str(src), str(out), *flags, "--workers", str(args.workers), "-q"]
                label = f"{name} ({round_}{', ' + args.old if tree == 'old' else ''})"
                res = measure(label, cmd, drop=drop, timeout=3600, env=dict(env, PYTHONPATH=str(trees[tree])), cwd=trees[tree])
                res.update(kind="reshard", tree=tree, output_dir_bytes=dir_bytes(out))
                steps.append(res)
                shutil.rmtree(out, ignore_errors=True)
    measure_cp("last")
    cp_rate, copy_rate = (statistics.median(source_bytes / st["seconds"] for st in steps if st["kind"] == k) for k in ("cp", "parallel_copy"))
    largest = largest_parameter_fp32_bytes(args.size)
    target_rss = GIB + 2 * largest
    for s in steps:
        s["mb_per_s"] = round(source_bytes / s["seconds"] / 1e6, 1)
        s["vs_cp"] = round(source_bytes / s["seconds"] / cp_rate, 3)
        s["vs_parallel_copy"] = round(source_bytes / s["seconds"] / copy_rate, 3)
        s["meets_memory_target"] = s["peak_rss_bytes"] <= target_rss
        for key in ("cmd", "output_tail"):  # as one would type them in the repository, on any machine
            s[key] = s[key].replace(sys.executable, "python").replace(f"{REPO}/", "")
    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(work),
        "size_gb": args.size,
        "params": tensor_stats(dense_config(args.size))["params"],
        "source": "synthetic dense bf16, DistributedOptimizer dp_reshardable at TP2 DP4 (written by reshard)",
        "source_dir_bytes": source_bytes,
        "largest_parameter_fp32_bytes": largest,
        "memory_target_bytes": target_rss,
        "workers": args.workers,
        "copy_threads": args.copy_threads,
        "old": args.old,
        "build_seconds": build["seconds"],
        "steps": steps,
        "new_vs_old": new_vs_old(steps) if args.old else None,
    }
    shutil.rmtree(work, ignore_errors=True)
    print(f"\nsource {source_bytes / 1e9:.2f} GB; memory target {target_rss / MIB:.0f} MiB")
    print("| step | s | MB/s | x cp | x parallel copy | peak RSS MiB | <= target |\n|---|---|---|---|---|---|---|")
    for s in steps:
        print(
            f"| {s['name']} | {s['seconds']:.1f} | {s['mb_per_s']:.0f} | {s['vs_cp']:.2f} | {s['vs_parallel_copy']:.2f} | "
            f"{s['peak_rss_bytes'] / MIB:.0f} | "
            f"{'yes' if s['meets_memory_target'] else 'no'} |"
        )
    for name, row in (results["new_vs_old"] or {}).items():
        print(f"{name}: median {row['new_seconds']:.1f} s (this tree) vs {row['old_seconds']:.1f} s ({args.old}): x{row['speedup']:.2f}")
    return finish(results, steps, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
