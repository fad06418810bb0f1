"""What the master-weight check costs a conversion of DistributedOptimizer buckets (reshard/optim/master_weights.py).

    python benchmarks/bench_master_weights.py --size 0.25 --out benchmarks/results_master_weights.json

Every conversion of a dp_reshardable (or distrib_optim.pt) source reads its model weights and fp32 master weights
once more and compares them. In one run, each step cold where the page cache can be dropped (bench_convert's
`measure`): bench_optimizer's synthetic source (bf16 model, dp_reshardable TP2 DP4, master weights = the weights),
`cp -r` of it, `reshard convert` of it to TP1 PP2 (check included), and the check alone on the same plan; all that
--rounds times (medians reported: a shared machine's load drifts within minutes).
Reported: each step's seconds, peak RSS, and the check's share of the conversion (check alone / convert).
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import MIB, REPO, dir_bytes, finish, machine_info, measure, python_env  # noqa: E402

BENCH_OPTIMIZER = Path(__file__).resolve().parent / "bench_optimizer.py"
TARGET = ["--to-tp", "1", "--to-pp", "2"]


def check_main(src: Path) -> None:
    """The check alone, as `reshard convert <src> ... --to-tp 1 --to-pp 2` runs it before moving a byte."""
    from reshard.collective import joined
    from reshard.formats import open_checkpoint
    from reshard.optim import master_weights
    from reshard.plan import make_plan
    from reshard.request import LayoutChange, Target

    with open_checkpoint(src) as reader, joined() as team:
        assert master_weights.decoded_from_buffers(reader)
        master_weights.check(reader, make_plan(reader, src.parent / "unused", Target(layout=LayoutChange(tp=1, pp=2))).moves, team)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=0.25, help="the model's bf16 size in GB (its optimizer state is 6x)")
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / "work" / "master_weights", help="work directory (git-ignored)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-drop-cache", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--_check", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._check:
        check_main(args._check)
        return 0

    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env, drop, src = python_env(), not args.no_drop_cache, work / "src"
    build = measure("build source", [sys.executable, str(BENCH_OPTIMIZER), "--size", str(args.size), "--_build", str(src)],
                    drop=False, timeout=3600, env=env)
    if not build["ok"]:
        raise SystemExit(f"bench_master_weights: could not build the source:\n{build['output_tail']}")
    source_bytes = dir_bytes(src)
    steps = []
    for round_ in range(1, args.rounds + 1):
        cp = measure(f"cp -r (round {round_})", ["cp", "-r", str(src), str(work / "cp")], drop=drop, timeout=3600, env=env)
        shutil.rmtree(work / "cp", ignore_errors=True)
        steps.append({**cp, "kind": "cp"})
        convert = [sys.executable, "-m", "reshard", "convert", str(src), str(work / "out"), *TARGET, "--workers", str(args.workers), "-q"]
        steps.append({**measure(f"convert TP2 DP4 -> TP1 PP2, check included (round {round_})", convert, drop=drop, timeout=3600, env=env),
                      "kind": "convert"})
        shutil.rmtree(work / "out", ignore_errors=True)
        check = [sys.executable, __file__, "--_check", str(src)]
        steps.append({**measure(f"the check alone (round {round_})", check, drop=drop, timeout=3600, env=env), "kind": "check"})
    seconds = {kind: statistics.median(s["seconds"] for s in steps if s["kind"] == kind) for kind in ("cp", "convert", "check")}
    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(work),
        "size_gb": args.size,
        "source": "bench_optimizer's synthetic dense bf16, dp_reshardable TP2 DP4 (written by reshard)",
        "source_dir_bytes": source_bytes,
        "workers": args.workers,
        "steps": steps,
        "median_seconds": seconds,
        "check_share_of_convert": round(seconds["check"] / seconds["convert"], 3),
        "check_vs_cp": round(seconds["check"] / seconds["cp"], 3),
    }
    shutil.rmtree(work, ignore_errors=True)
    print(f"\nsource {source_bytes / 1e9:.2f} GB; check / convert {results['check_share_of_convert']:.2f}, check / cp {results['check_vs_cp']:.2f}")
    print("| step | s | peak RSS MiB |\n|---|---|---|")
    for s in steps:
        print(f"| {s['name']} | {s['seconds']:.1f} | {s['peak_rss_bytes'] / MIB:.0f} |")
    return finish(results, steps, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
