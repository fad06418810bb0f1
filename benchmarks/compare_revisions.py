"""Is a change slower? The same conversions by two revisions of reshard, alternately, on the same sources.

    python benchmarks/compare_revisions.py --old eff24f5 --size 1 --rounds 3

Builds the dense (TP4) and MoE (TP2 EP4) synthetic sources of `bench_convert.py` once, extracts the old
revision's tree with `git archive`, then runs each step with the old and the new tree in turn, `--rounds`
times, each in a fresh process, with the page cache dropped before it where permitted. Alternating keeps
the disk's and the machine's drift out of the comparison; the result is each step's median time per tree
and their ratio (new / old: below 1 is faster). Both trees run with this interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

STEPS = {  # name: (source kind, reshard convert arguments after SRC DST)
    "TP4->TP8 torch_dist": ("dense", ["--to-tp", "8"]),
    "TP4->TP2PP2 torch_dist": ("dense", ["--to-tp", "2", "--to-pp", "2"]),
    "torch_dist->zarr": ("dense", ["--to-format", "zarr"]),
    "torch_dist->legacy": ("dense", ["--to-format", "legacy", "--no-optimizer"]),
    "torch_dist->HF": ("dense", ["--to-format", "hf", "--no-optimizer"]),
    "MoE EP4->EP2": ("moe", ["--to-ep", "2"]),
}


def drop_caches() -> None:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not permitted here: every run then reads warm, old and new alike


def timed(tree: Path, source: Path, out: Path, args: list[str]) -> float:
    shutil.rmtree(out, ignore_errors=True)
    drop_caches()
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "reshard", "convert", str(source), str(out), "-q", *args],
                   cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["sync"], check=False)
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the revision to compare with (a commit, tag or branch)")
    parser.add_argument("--size", type=float, default=1.0, help="GB of each synthetic source (bf16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / "work" / "compare")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    opts = parser.parse_args()
    shutil.rmtree(opts.work, ignore_errors=True)
    opts.work.mkdir(parents=True)
    old = opts.work / "old-tree"
    old.mkdir()
    archive = subprocess.run(["git", "archive", opts.old], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    sources = {}
    for kind in ("dense", "moe"):
        sources[kind] = opts.work / f"src-{kind}"
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_convert.py"), "--_build", kind, str(sources[kind]),
                        str(opts.size)], cwd=REPO, check=True)
    trees = {"old": old, "new": REPO}
    times: dict[str, dict[str, list[float]]] = {step: {"old": [], "new": []} for step in STEPS}
    for round_ in range(opts.rounds):
        for step, (kind, args) in STEPS.items():
            order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
            for which in order:
                times[step][which].append(timed(trees[which], sources[kind], opts.work / "out", args))
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print(f"| step ({opts.size:g} GB, {opts.rounds} rounds) | {opts.old} median s | {rev} median s | new / old |")
    print("| --- | ---: | ---: | ---: |")
    results = {}
    for step, by in times.items():
        o, n = statistics.median(by["old"]), statistics.median(by["new"])
        results[step] = {"old": by["old"], "new": by["new"], "ratio": n / o}
        print(f"| {step} | {o:.2f} | {n:.2f} | {n / o:.2f} |")
    if opts.out:
        opts.out.write_text(json.dumps({"old": opts.old, "new": rev, "size_gb": opts.size, "steps": results}, indent=1) + "\n")
    shutil.rmtree(opts.work, ignore_errors=True)


if __name__ == "__main__":
    main()
