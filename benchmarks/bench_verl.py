"""verl step benchmark: a layout-v2 actor step with its DistributedOptimizer state exported to HF, and resharded TP2 -> TP4
in verl's layout, against a parallel copy and `cp -r` of the same bytes.

    python benchmarks/bench_verl.py --size 3 --out benchmarks/results_verl.json   # a ~3 GB step (model and optimizer)
    python benchmarks/bench_verl.py --size 0.6                                     # smoke

The step: bench_convert's Llama-style model at about --size / 7 GB of bf16 weights (its fp32 master weights, exp_avg
and exp_avg_sq make the other 6/7), with bench_optimizer's synthetic DistributedOptimizer state, written at TP2 DP4 as
verl's MegatronCheckpointManager lays a step out (`model/dist_ckpt`, `optimizer/dist_ckpt` as dp_reshardable buckets,
`model/huggingface`, `transformer_config.json`, `ckpt_contents.json`) by reshard's own verl writer, whose layout the
tests prove against megatron-core's save as verl makes it (tests/reshard/formats/test_verl.py). Each step in a fresh
process, cold where the page cache can be dropped; ratios against the median of each baseline taken at the start,
middle and end (this disk's speed drifts), for the bytes each conversion reads (the HF export: the model's directory
only). Peak RSS against 1 GiB + 2 x the largest parameter's fp32 state.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import MIB, REPO, dense_config, dir_bytes, finish, machine_info, measure, python_env, reshard_cmd, rmtree  # noqa: E402
from bench_optimizer import GIB, largest_parameter_fp32_bytes, optimizer_reader  # noqa: E402

SOURCE_TP, SOURCE_DP, STEP = 2, 4, 100
BF16_SHARE = 7  # bytes of the step per byte of bf16 weights: 2 of weights, 12 of fp32 optimizer state, per parameter
# name -> (convert flags, the part of the step it reads: its ratios are against copying those bytes)
STEPS = {
    "verl TP2 DP4 -> HF (model only)": (["--to-format", "hf", "--no-optimizer"], f"global_step_{STEP}/actor/model"),
    "verl TP2 DP4 -> verl TP4 DP4 (written back in verl's layout)": (["--to-tp", "4"], ""),
}


def build_main(run: Path, size_gb: float) -> None:
    """The step, under the run directory `run`: a skeleton step gives reshard's verl writer the HF config,
    transformer_config.json and manifest that verl writes beside the tensors."""
    from fixtures.verl import manifest
    from reshard.converters import family_for_model
    from reshard.layout import Layout
    from reshard.plan import make_plan
    from reshard.request import Target
    from reshard.streaming import stream

    config, layout = dense_config(size_gb / BF16_SHARE), Layout(tp=SOURCE_TP)
    skeleton = run.parent / f"{run.name}-skeleton" / f"global_step_{STEP}" / "actor"
    hf = family_for_model(config, {}).config_to_hf(config)
    for directory in ("model/huggingface", "model/dist_ckpt", "optimizer/dist_ckpt", "extra/dist_ckpt"):  # as the manifest names
        (skeleton / directory).mkdir(parents=True, exist_ok=True)
    (skeleton / "model" / "huggingface" / "config.json").write_text(json.dumps(hf, indent=2))
    sizes = {"tensor_model_parallel_size": SOURCE_TP, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1}
    (skeleton / "transformer_config.json").write_text(json.dumps({**sizes, "transformer_impl": "local"}, indent=2))
    (skeleton / "ckpt_contents.json").write_text(json.dumps(manifest(STEP, SOURCE_TP * SOURCE_DP, hf["architectures"][0]), indent=2))
    reader = optimizer_reader(config, layout)
    reader.tokenizer_dir, reader.common.iteration = skeleton / "model" / "huggingface", STEP
    reader.common.args["data_parallel_size"] = SOURCE_DP
    stream(reader, make_plan(reader, run, Target(format="verl", layout=layout, naming="local", dp=SOURCE_DP)))
    rmtree(skeleton.parent.parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=3.0, help="the step's size in GB, model and optimizer state")
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / "work" / "verl", help="work directory (git-ignored)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-drop-cache", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--copy-threads", type=int, default=8, help="threads of the parallel-copy baseline")
    parser.add_argument("--_build", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._build:
        build_main(args._build, args.size)
        return 0
    work = args.work.resolve()
    rmtree(work)
    work.mkdir(parents=True)
    env, drop, src = python_env(), not args.no_drop_cache, work / "run"
    build = measure("build the step", [sys.executable, __file__, "--size", str(args.size), "--_build", str(src)], drop=False, timeout=3600, env=env)
    if not build["ok"]:
        raise SystemExit(f"bench_verl: could not build the step:\n{build['output_tail']}")
    source_bytes, steps = dir_bytes(src), []

    def baselines(when: str) -> None:
        for kind, cmd in (("cp", ["cp", "-r", str(src), str(work / "copy")]),
                          ("parallel_copy", [sys.executable, str(REPO / "benchmarks" / "parallel_copy.py"), str(src), str(work / "copy"),
                                             "--threads", str(args.copy_threads)])):
            steps.append({**measure(f"{kind.replace('_', ' ')} ({when})", cmd, drop=drop, timeout=3600, env=env), "kind": kind})
            rmtree(work / "copy")

    for when in ("first", "second"):
        baselines(when)
        for name, (flags, reads) in STEPS.items():
            out = work / "out"
            res = measure(f"{name} ({when})", reshard_cmd(src, out, *flags, "--workers", str(args.workers), "-q"), drop=drop, timeout=3600, env=env)
            steps.append({**res, "kind": "reshard", "bytes_read": dir_bytes(src / reads), "output_dir_bytes": dir_bytes(out)})
            rmtree(out)
    baselines("last")
    rates = {k: statistics.median(source_bytes / s["seconds"] for s in steps if s["kind"] == k and s["ok"]) for k in ("cp", "parallel_copy")}
    target = GIB + 2 * largest_parameter_fp32_bytes(args.size / BF16_SHARE)
    for s in steps:
        s["vs_cp"], s["vs_parallel_copy"] = (round(s.get("bytes_read", source_bytes) / s["seconds"] / rates[k], 3) for k in ("cp", "parallel_copy"))
        s["meets_memory_target"] = s["peak_rss_bytes"] <= target
        for key in ("cmd", "output_tail"):  # as one would type them in the repository, on any machine
            s[key] = s[key].replace(sys.executable, "python").replace(f"{REPO}/", "")
    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "machine": machine_info(work),
        "size_gb": args.size, "source": f"verl layout-v2 actor step, TP{SOURCE_TP} DP{SOURCE_DP}, dp_reshardable optimizer (written by reshard)",
        "source_dir_bytes": source_bytes, "memory_target_bytes": target, "workers": args.workers, "copy_threads": args.copy_threads,
        "build_seconds": build["seconds"], "steps": steps,
    }
    rmtree(work)
    print(f"\nstep {source_bytes / 1e9:.2f} GB; memory target {target / MIB:.0f} MiB")
    print("| step | s | x cp | x parallel copy | peak RSS MiB | <= target |\n|---|---|---|---|---|---|")
    for s in steps:
        print(f"| {s['name']} | {s['seconds']:.1f} | {s['vs_cp']:.2f} | {s['vs_parallel_copy']:.2f} | {s['peak_rss_bytes'] / MIB:.0f} | "
              f"{'' if s['kind'] != 'reshard' else 'yes' if s['meets_memory_target'] else 'NO'} |")
    return finish(results, steps, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
