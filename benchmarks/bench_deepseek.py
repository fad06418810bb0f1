"""DeepSeek-V3-shaped conversion benchmark: HF FP8 blocks -> torch_dist TP2 EP4 -> HF, against `cp -r`.

    python benchmarks/bench_deepseek.py --size 3 --out benchmarks/results_deepseek.json   # ~3 GB of bf16 weights
    python benchmarks/bench_deepseek.py --size 0.3                                        # smoke

The model is DeepSeek-V3's own config.json (fixtures/deepseek_v3/config.json) scaled down: MLA with q/kv
latents, 64 routed experts in 8 groups (top-8 of 4 groups), a shared expert, a first dense layer
(first_k_dense_replace), its 129k vocabulary; layers are added until the weights are about --size GB in bf16.
The source is written as DeepSeek releases its weights: HF safetensors shards with an index, every linear
weight of the decoder layers float8_e4m3fn with a float32 `weight_scale_inv` per 128x128 block, the rest bf16
(random values; the tensor list is the one reshard's deepseek_v3 mapping gives for the config, via
`reshard.formats.config_only`). MTP layers are left out (num_nextn_predict_layers 0): the import refuses them today.

Steps, each in a fresh process after a page-cache drop where permitted (`bench_convert.measure`):
`cp -r` of the HF source and of the torch_dist checkpoint (at the start and at the end: this disk drifts),
the import HF fp8 -> torch_dist TP2 EP4 (dequantized to bf16), the export back to HF fp8 blocks
(`--to-fp8-blocks`) and to HF bf16; the bf16 export is then checked against the torch_dist checkpoint with
`reshard verify` (untimed). Each conversion is compared with a `cp -r` of its own source's bytes, and its
peak RSS with the target 1 GiB + 2 x the largest tensor (the 129k x hidden embedding, in bf16).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import GIB, MIB, REPO, dir_bytes, git_rev, machine_info, measure, python_env, reshard_cmd, rmtree, tensor_stats, verify_step  # noqa: E402

REAL_CONFIG = REPO / "fixtures" / "deepseek_v3" / "config.json"
# DeepSeek-V3's release quantizes every linear weight of its decoder layers (MLA's projections and the experts'),
# never the embeddings, head, norms or router: HF names ending in proj.weight inside model.layers
RELEASE_FP8 = re.compile(r"^model\.layers\.\d+\..*proj(_with_mqa)?\.weight$")
SHARD_BYTES = 1 << 30
BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size

# DeepSeek-V3's shape, narrower: every ratio that matters to the mapping kept (topk = 2 x topk_group, MLA's
# head dims, one shared expert, dense first layers)
SCALED = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 384,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "intermediate_size": 2816,
    "moe_intermediate_size": 512,
    "n_routed_experts": 64,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
}


def hf_config(size_gb: float) -> dict:
    """DeepSeek-V3's config.json at SCALED widths, with as many layers as make about `size_gb` GB in bf16."""
    base = {k: v for k, v in json.loads(REAL_CONFIG.read_text()).items() if k != "auto_map"} | SCALED

    def gigabytes(layers: int) -> float:
        return tensor_stats(config_reader(base | {"num_hidden_layers": layers}).config)["logical_bytes"] / 1e9

    per_layer = gigabytes(3) - gigabytes(2)
    layers = max(2, round(2 + (size_gb - gigabytes(2)) / per_layer))
    return base | {"num_hidden_layers": layers}


def config_reader(hf: dict):
    """The config-only view of an HF config (`reshard.formats.config_only`): its ModelConfig and tensors."""
    from reshard.formats.config_only import ConfigOnlyReader

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(hf))
        return ConfigOnlyReader(path)  # read whole on opening


def _bf16(values: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes (rounded to nearest even)."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def _fp8(numel: int, rng: np.random.Generator) -> bytes:
    """Random float8_e4m3fn values, none NaN (0x7f, 0xff)."""
    bits = rng.integers(0, 256, numel, dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] -= 1
    return bits.tobytes()


def build_main(path: Path, size_gb: float) -> None:
    """Write the HF fp8 source: shards of at most SHARD_BYTES, an index, config.json."""
    from reshard import fp8_blocks
    from reshard.formats.hf import hf_tensors

    hf = hf_config(size_gb) | {"torch_dtype": "bfloat16"}
    reader = config_reader(hf)
    tensors = []  # (name, dtype, shape, kind)
    for *_, name, shape in hf_tensors(reader.specs, reader.mappings, reader.config):
        if RELEASE_FP8.match(name):
            tensors += [(name, "F8_E4M3", shape, "fp8"), (fp8_blocks.scale_name(name), "F32", fp8_blocks.scale_shape(shape, BLOCK), "scale")]
        else:
            tensors.append((name, "BF16", shape, "norm" if "norm" in name else "bf16"))
    write_release(path, hf, tensors)


# The bytes each kind of tensor of a release is written with (random, deterministic, of realistic magnitude).
_FILL = {
    "fp8": _fp8,
    "scale": lambda n, rng: rng.uniform(1e-4, 3e-4, n).astype(np.float32).tobytes(),
    "norm": lambda n, rng: _bf16(1 + 0.1 * rng.standard_normal(n, dtype=np.float32)),
    "bf16": lambda n, rng: _bf16(0.02 * rng.standard_normal(n, dtype=np.float32)),
    "u8": lambda n, rng: rng.integers(0, 256, n, dtype=np.uint8).tobytes(),
    "e8m0": lambda n, rng: rng.integers(118, 124, n, dtype=np.uint8).tobytes(),  # MXFP4 scales: 2^-9 .. 2^-4
}
_BYTES = {"F8_E4M3": 1, "U8": 1, "F32": 4, "BF16": 2}


def write_release(path: Path, hf: dict, tensors: list[tuple[str, str, tuple[int, ...], str]]) -> None:
    """An HF model as a release ships it: `tensors` (name, safetensors dtype, shape, `_FILL` kind) in shards of at
    most SHARD_BYTES with an index, and config.json."""
    shards, current, used = [], [], 0
    for t in tensors:
        n = math.prod(t[2]) * _BYTES[t[1]]
        if current and used + n > SHARD_BYTES:
            shards.append(current)
            current, used = [], 0
        current.append(t)
        used += n
    shards.append(current)
    path.mkdir(parents=True)
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape, _ in shard:
            n = math.prod(shape) * _BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for _, _, shape, kind in shard:
                f.write(_FILL[kind](math.prod(shape), rng))
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    print(f"wrote {path}: {len(tensors)} tensors in {len(shards)} shards, {total / 1e9:.2f} GB")


@dataclass(frozen=True)
class Release:
    """A family's quantized release, benchmarked as `run_release` runs it."""

    tag: str  # of its work directories and results file
    title: str  # of its results table
    script: str  # its benchmark's file: `script --_build PATH SIZE` writes the source
    hf_config: Callable[[float], dict]  # its config.json at about SIZE GB of bf16 weights
    shown: tuple[str, ...]  # the config fields its results record
    steps: Callable[[Steps], None]  # its conversions, after the source is built


@dataclass
class Steps:
    """What a release's `steps` run: copies and conversions, each measured in a fresh process and recorded."""

    work: Path
    source: Path
    record: Callable[..., dict]
    drop: bool
    timeout: float
    env: dict
    made: list[Path]

    def path(self, name: str) -> Path:
        self.made.append(self.work / name)
        return self.made[-1]

    def copy(self, source: Path) -> None:
        """`cp -r` of `source`, and the parallel copy of the same bytes (benchmarks/parallel_copy.py, 8 threads)."""
        dst = self.path("copy")
        for kind, command in (("cp", ["cp", "-r", str(source), str(dst)]),
                              ("parallel_copy", [sys.executable, str(REPO / "benchmarks" / "parallel_copy.py"), str(source), str(dst)])):
            rmtree(dst)
            self.record(measure(f"{kind.replace('_', ' ')} {source.name}", command, drop=self.drop, timeout=self.timeout, env=self.env),
                        kind, source, dst)
        rmtree(dst)

    def convert(self, label: str, source: Path, out: Path, *flags: str) -> dict:
        rmtree(out)
        command = reshard_cmd(source, out, *flags)
        return self.record(measure(f"reshard {label}", command, drop=self.drop, timeout=self.timeout, env=self.env), "reshard", source, out)


def run_release(argv: list[str] | None, release: Release) -> int:
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=float, default=3.0, help="model size in GB of bf16 weights (default 3)")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON results (default: <work>/results_{release.tag}.json)")
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / "work", help="work directory (git-ignored)")
    parser.add_argument("--no-drop-cache", action="store_true", help="do not drop the page cache before each step")
    parser.add_argument("--timeout", type=float, default=None, help="per-step limit in seconds (default scales with size)")
    args = parser.parse_args(argv)
    work: Path = args.work.resolve() / release.tag
    out_path = (args.out or work.parent / f"results_{release.tag}.json").resolve()
    timeout, drop, env = args.timeout or max(300.0, 300.0 * args.size), not args.no_drop_cache, python_env()
    work.mkdir(parents=True, exist_ok=True)
    need = args.size * 1e9 * 5  # source (quantized: a fraction), the Megatron checkpoint, the exports, a copy
    if shutil.disk_usage(work).free < need:
        print(f"{release.script}: {work} has too little free space; about {need / 1e9:.0f} GB are needed", file=sys.stderr)
        return 2
    hf = release.hf_config(args.size)
    stats = tensor_stats(config_reader(hf).config)
    m = {
        "hf_config": {k: v for k, v in hf.items() if k in (*release.shown, "num_hidden_layers", "vocab_size")},
        **stats,
        "memory_target_bytes": GIB + 2 * stats["largest_tensor_bytes"],
    }
    results: dict = {"machine": machine_info(work), "size_gb": args.size, "model": m, "steps": [], "notes": [], "title": release.title}
    print(
        f"{release.title}: {m['params'] / 1e9:.2f} B params, {m['logical_bytes'] / 1e9:.2f} GB bf16, largest tensor "
        f"{m['largest_tensor_bytes'] / MIB:.0f} MiB, memory target {m['memory_target_bytes'] / MIB:.0f} MiB",
        flush=True,
    )

    def record(res: dict, kind: str, source: Path | None, out: Path | None) -> dict:
        res["kind"], res["git_rev"] = kind, git_rev()
        res["source"] = source.name if source else None
        res["source_dir_bytes"] = dir_bytes(source) if source else None
        res["output_dir_bytes"] = dir_bytes(out) if out and out.exists() else None
        results["steps"].append(res)
        return res

    run = Steps(work, work / "hf_release", record, drop, timeout, env, [work / "hf_release"])
    t0 = time.perf_counter()
    try:
        rmtree(run.source)
        build = [sys.executable, release.script, "--_build", str(run.source), str(args.size), release.tag]
        if not record(measure("build HF release", build, drop=False, timeout=timeout * 2, env=env), "build", None, run.source)["ok"]:
            raise SystemExit(f"{release.script}: could not build the source:\n{results['steps'][-1]['output_tail']}")
        release.steps(run)
    finally:
        results["total_seconds"] = round(time.perf_counter() - t0, 1)
        summarize(results)
        out_path.write_text(json.dumps(results, indent=1))
        for p in run.made:
            rmtree(p)
        for p in work.glob(".*.reshard-partial"):
            rmtree(p)
        print(render(results))
        print(f"\nresults: {out_path} ({results['total_seconds']} s in all)")
    return 0 if all(s.get("ok") for s in results["steps"]) else 1


def _steps(run: Steps) -> None:
    ts, fp8_out, bf16_out = run.path("tp2ep4"), run.path("back_fp8"), run.path("back_bf16")
    run.copy(run.source)
    run.convert("HF fp8 -> torch_dist TP2 EP4", run.source, ts, "--to-format", "torch_dist", "--to-tp", "2", "--to-ep", "4")
    if ts.exists():
        run.copy(ts)
        run.convert("torch_dist TP2 EP4 -> HF fp8 blocks", ts, fp8_out, "--to-format", "hf", "--to-fp8-blocks")
        rmtree(fp8_out)
        res = run.convert("torch_dist TP2 EP4 -> HF bf16", ts, bf16_out, "--to-format", "hf")
        verify_step(res, bf16_out, ts, "verified_against_torch_dist", run.env)
        rmtree(bf16_out)
        run.copy(ts)
    run.copy(run.source)


DEEPSEEK = Release("deepseek", "DeepSeek-V3-shaped MoE", __file__, hf_config, tuple(SCALED), _steps)


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--_build"]:  # the source, written in a process of its own
        build_main(Path(sys.argv[2]), float(sys.argv[3]))
        return 0
    return run_release(argv, DEEPSEEK)


def summarize(results: dict) -> None:
    """Each conversion against the median `cp -r` of its own source: cp seconds per byte of that source x its
    bytes / the step's seconds (1.0: as fast as copying the bytes it reads); RSS against the target."""
    speed: dict[str, dict[str, list[float]]] = {"cp": {}, "parallel_copy": {}}
    for s in results["steps"]:
        if s["kind"] in speed and s.get("ok"):
            speed[s["kind"]].setdefault(s["source"], []).append(s["source_dir_bytes"] / s["seconds"])
    for kind, by_source in speed.items():
        results[f"{kind}_mb_per_s"] = {
            k: {"median": round(statistics.median(v) / 1e6, 1), "runs": [round(x / 1e6, 1) for x in v]} for k, v in by_source.items()
        }
    target = results["model"]["memory_target_bytes"]
    for s in results["steps"]:
        if s["kind"] != "reshard" or not s.get("ok"):
            continue
        if s["source"] in speed["cp"]:
            s["cp_seconds_same_bytes"] = round(s["source_dir_bytes"] / statistics.median(speed["cp"][s["source"]]), 2)
            s["vs_cp"] = round(s["cp_seconds_same_bytes"] / s["seconds"], 3)
        if s["source"] in speed["parallel_copy"]:
            s["vs_parallel_copy"] = round(s["source_dir_bytes"] / statistics.median(speed["parallel_copy"][s["source"]]) / s["seconds"], 3)
        s["meets_memory_target"] = s["peak_rss_bytes"] <= target
        s["rss_over_largest_tensor"] = round(s["peak_rss_bytes"] / results["model"]["largest_tensor_bytes"], 2)


def render(results: dict) -> str:
    m, machine = results["model"], results["machine"]
    lines = [
        f"\n### {results['title']}, {m['params'] / 1e9:.2f} B params ({m['logical_bytes'] / 1e9:.2f} GB bf16), "
        f"{machine['cpu_affinity']} cores, {machine['ram_gib']} GiB RAM ({machine['date']})\n",
        f"largest tensor {m['largest_tensor_bytes'] / MIB:.0f} MiB, memory target {m['memory_target_bytes'] / MIB:.0f} MiB\n",
        "| step | cache | source GB | s | cp of the same bytes, s | × cp | × parallel copy | peak RSS MiB | ≤ target |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for s in results["steps"]:
        if s["kind"] == "build":
            continue
        if not s.get("ok"):
            lines.append(f"| {s['name']} | | | | | | | | {'timeout' if s.get('timed_out') else 'failed'} |")
            continue
        checks = [v for k, v in s.items() if k.startswith("verified_")]
        flag = " (output DIFFERS)" if False in checks else " (verify error)" if None in checks else " (verified)" if checks else ""
        lines.append(
            f"| {s['name']}{flag} | {'cold' if s['cache'].get('cold') else 'warm'} | {s['source_dir_bytes'] / 1e9:.2f} | "
            f"{s['seconds']:.1f} | {s.get('cp_seconds_same_bytes', '')} | {s.get('vs_cp', '')} | {s.get('vs_parallel_copy', '')} | "
            f"{s['peak_rss_bytes'] / MIB:.0f} | {'' if s['kind'] != 'reshard' else 'yes' if s['meets_memory_target'] else 'NO'} |"
        )
    for kind, what in (("cp", "`cp -r`"), ("parallel_copy", "the parallel copy")):
        for k, v in results.get(f"{kind}_mb_per_s", {}).items():
            lines.append(f"\n{what} of {k}: {v['runs']} MB/s (median {v['median']})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
