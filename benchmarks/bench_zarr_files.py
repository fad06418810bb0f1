"""zarr stores sharded (a file per tensor and layer) against a file per chunk: files, write and read time.

    python benchmarks/bench_zarr_files.py --size 1 --rounds 3 --out benchmarks/results_zarr_files.json

Builds bench_convert.py's MoE source (32 experts, TP2 EP4 torch_dist, bf16) once, then `--rounds` times,
alternating the two layouts, each step in a fresh process with the page cache dropped where permitted:
writes the store (torch_dist -> zarr), reads it all back (`reshard verify`, which rereads every value), and
converts it to TP1 EP2 torch_dist. The file-per-chunk layout is reshard's own writer with `shard_shape` set
to `chunk_shape`, which is what it wrote before sharding. Reports each layout's files and median seconds per
step, and their ratios (sharded / per chunk: below 1 is fewer or faster).
Internal mode (--_convert) is the subprocess that converts with a given layout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_convert import (  # noqa: E402  (after the path above)
    dir_bytes,
    machine_info,
    measure,
    moe_config,
    python_env,
    rmtree,
    tensor_stats,
)

LAYOUTS = ("sharded", "per-chunk")


def convert_main(layout: str, reshard_argv: list[str]) -> None:
    """`reshard ...` with the zarr writer in `layout`."""
    import reshard.formats.zarr_store as zarr_store
    from reshard.cli import run

    if layout == "per-chunk":
        zarr_store.shard_shape = zarr_store.chunk_shape
    sys.argv = ["reshard", *reshard_argv]
    run()


def files(path: Path) -> int:
    return sum(1 for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=1.0, help="model size in GB (bf16 bytes) of the source (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both layouts (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default: <work>/results_zarr_files.json)")
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / "work", help="work directory (git-ignored)")
    parser.add_argument("--no-drop-cache", action="store_true", help="do not drop the page cache before each step")
    parser.add_argument("--_convert", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._convert:
        convert_main(args._convert[0], args._convert[1:])
        return 0

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    drop, timeout, env = not args.no_drop_cache, max(300.0, 300.0 * args.size), python_env()
    config = moe_config(args.size)
    source = work / "zarr_files_src"
    results: dict = {"machine": machine_info(work), "size_gb": args.size, "model": {"config": config.to_dict(), **tensor_stats(config)},
                     "steps": []}
    print(f"bench_zarr_files: MoE {args.size} GB, {args.rounds} rounds, work {work}", flush=True)
    rmtree(source)
    build = [sys.executable, str(REPO / "benchmarks" / "bench_convert.py"), "--_build", "moe", str(source), str(args.size)]
    if not measure("build MoE source", build, drop=False, timeout=timeout, env=env)["ok"]:  # in a process of its own, as every step
        raise SystemExit("bench_zarr_files: could not build the source")
    seconds: dict[tuple[str, str], list[float]] = {}
    counts: dict[str, int] = {}

    def step(layout: str, name: str, *reshard_argv: str) -> None:
        res = measure(f"{layout} {name}", [sys.executable, __file__, "--_convert", layout, *reshard_argv], drop=drop, timeout=timeout, env=env)
        if not res["ok"]:
            raise SystemExit(f"bench_zarr_files: {layout} {name} failed:\n{res['output_tail']}")
        res["layout"], res["step"] = layout, name
        results["steps"].append(res)
        seconds.setdefault((layout, name), []).append(res["seconds"])

    try:
        for _ in range(args.rounds):
            for layout in LAYOUTS:
                store, back = work / f"zarr_files_{layout}.zarr", work / f"zarr_files_{layout}_back"
                rmtree(store)
                rmtree(back)
                step(layout, "write", "convert", str(source), str(store), "-q", "--to-format", "zarr")
                counts[layout] = files(store)
                results.setdefault("store_bytes", {})[layout] = dir_bytes(store)
                step(layout, "read", "verify", str(store))
                step(layout, "to EP2", "convert", str(store), str(back), "-q", "--to-format", "torch_dist", "--to-tp", "1", "--to-ep", "2")
                rmtree(back)
    finally:
        for layout in LAYOUTS:
            rmtree(work / f"zarr_files_{layout}.zarr")
        rmtree(source)

    median = {f"{layout} {name}": statistics.median(s) for (layout, name), s in seconds.items()}
    results["files"] = counts
    results["median_seconds"] = median
    names = list(dict.fromkeys(name for _, name in seconds))
    results["ratios"] = {"files": counts["sharded"] / counts["per-chunk"],
                         **{name: median[f"sharded {name}"] / median[f"per-chunk {name}"] for name in names}}
    out = (args.out or work / "results_zarr_files.json").resolve()
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"files: sharded {counts['sharded']}, per chunk {counts['per-chunk']} ({results['ratios']['files']:.4f})")
    for name in names:
        print(f"{name}: sharded {median[f'sharded {name}']:.1f} s, per chunk {median[f'per-chunk {name}']:.1f} s ({results['ratios'][name]:.3f})")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
