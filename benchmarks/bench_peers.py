"""HF -> Megatron TP2 and back: reshard side by side with Megatron-LM's and Megatron-Bridge's converters.

    python benchmarks/bench_peers.py --size 1 --out benchmarks/results_peers.json \
        --mlm-venv PEERS/mlm-venv --mlm-tree PEERS/mlm-tree --bridge-venv PEERS/bridge-venv
    python benchmarks/bench_peers.py --size 0.05          # smoke

The peers are not part of this repository: build them with the recipes of the project's shared folder
(`shared/peers/setup_mlm.sh`, `setup_bridge.sh`; see fixtures/golden/README.md), as make_golden.py does.

What it does, in one run:
  1. writes a deterministic synthetic HF Llama of about --size GB (bf16 `model.safetensors`, `config.json`,
     a WordLevel `tokenizer.json` standing in for the real one) with numpy only: no torch in this process;
  2. runs every step in a fresh subprocess, each after `sync` + dropping the page cache where permitted, and
     times it to the end of a final `sync`; peak RSS is the summed RSS of the whole process tree (psutil
     polling every 50 ms: launcher, ranks, Megatron-LM's saver process), as bench_convert.py measures torchrun;
  3. steps: `cp -r` of the source (at the start, the middle and the end; steps are compared with the median),
     reshard HF -> torch_dist TP2, HF -> legacy TP2 and torch_dist TP2 -> HF; Megatron-LM's
     tools/checkpoint/convert.py HF (loader llama_mistral) -> legacy TP2 (saver core, local spec, CPU);
     Megatron-Bridge HF -> torch_dist TP2 (torchrun, 2 ranks, gloo) and torch_dist TP2 -> HF (torchrun, its
     load_megatron_model + save_hf_pretrained on the CPU);
  4. checks every output (not timed): `reshard verify OUT --against SOURCE`, and for HF outputs every tensor's
     bytes compared with the source's here; a step whose output does not check is reported as failed;
  5. writes JSON (machine, load average, git revision) and prints a markdown table.

Megatron-LM's tools/checkpoint has no HF saver for Llama (only saver_hf_llava.py), so it has no "back" step.
Internal mode: `_step NAME ...` runs inside a peer venv (bridge-import, bridge-export).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()
MIB = 1 << 20
SEED = 1234


# ----------------------------------------------------------------------------- the synthetic HF model


def hf_config(size_gb: float) -> dict:
    """config.json of bench_convert.py's dense Llama-style model (GQA, SwiGLU, untied) of about `size_gb` GB in bf16.
    Its vocabularies are multiples of 256, so Megatron-LM (128 x TP2) adds no padding rows and every tool holds
    the same tensors."""
    from bench_convert import dense_config

    m = dense_config(size_gb)
    vocab, h, ffn, layers, heads, groups, hd = (m.vocab_size, m.hidden_size, m.ffn_hidden_size, m.num_layers, m.num_attention_heads,
                                                m.groups, m.head_dim)
    assert vocab % 256 == 0
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": h,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": groups, "head_dim": hd, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "initializer_range": 0.02,
        "torch_dtype": "bfloat16", "dtype": "bfloat16", "use_cache": True,
    }


def hf_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, hd, ffn = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (c["num_attention_heads"] * hd, h)),
                (p + "self_attn.k_proj.weight", (c["num_key_value_heads"] * hd, h)),
                (p + "self_attn.v_proj.weight", (c["num_key_value_heads"] * hd, h)),
                (p + "self_attn.o_proj.weight", (h, c["num_attention_heads"] * hd)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (ffn, h)), (p + "mlp.up_proj.weight", (ffn, h)),
                (p + "mlp.down_proj.weight", (h, ffn))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]


def _bf16(x):
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    import numpy as np

    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def build_hf(dest: Path, size_gb: float) -> dict:
    """Write the model with numpy: weights 0.02 N(0,1), norms 1 + 0.1 N(0,1), one seeded generator per tensor."""
    import numpy as np

    dest.mkdir(parents=True)
    c = hf_config(size_gb)
    tensors = hf_tensors(c)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(dest / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for i, (name, shape) in enumerate(tensors):
            rng = np.random.default_rng([SEED, i])
            numel, step = int(np.prod(shape)), 1 << 24
            for start in range(0, numel, step):
                x = rng.standard_normal(min(step, numel - start), dtype=np.float32)
                x = 1.0 + 0.1 * x if "norm" in name else 0.02 * x
                f.write(_bf16(x.astype(np.float32)).tobytes())
    (dest / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    (dest / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}) + "\n")
    # a stand-in tokenizer: WordLevel over the whole vocabulary (Megatron-LM's loader reads its size)
    words = ["<s>", "</s>", "<unk>"] + [f"t{i}" for i in range(c["vocab_size"] - 3)]
    special = [{"id": i, "content": w, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                "special": True} for i, w in enumerate(words[:3])]
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special, "normalizer": None,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)}, "unk_token": "<unk>"}}
    (dest / "tokenizer.json").write_text(json.dumps(tok))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "model_max_length": 4096}, indent=2) + "\n")
    return {"config": c, "tensors": len(tensors), "logical_bytes": offset,
            "params": offset // 2, "dir_bytes": dir_bytes(dest)}


def dir_bytes(path: Path) -> int:
    return sum(os.lstat(os.path.join(r, f)).st_size for r, _, fs in os.walk(path) for f in fs)


# ----------------------------------------------------------------------------- checking outputs


def _safetensors_index(d: Path) -> dict[str, tuple[Path, str, list, int, int]]:
    """name -> (file, dtype, shape, absolute start, end) over every *.safetensors file in d."""
    out = {}
    for p in sorted(d.glob("*.safetensors")):
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                out[k] = (p, v["dtype"], v["shape"], 8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
    return out


def compare_hf(a: Path, b: Path) -> str | None:
    """None if every tensor of b has a's name, dtype, shape and bytes; else what differs."""
    ia, ib = _safetensors_index(a), _safetensors_index(b)
    if set(ia) != set(ib):
        return f"tensor names differ: {sorted(set(ia) ^ set(ib))[:6]}"
    for k, (pa, da, sa, s0, e0) in ia.items():
        pb, db, sb, s1, e1 = ib[k]
        if (da, sa) != (db, sb):
            return f"{k}: {da} {sa} against {db} {sb}"
        with open(pa, "rb") as fa, open(pb, "rb") as fb:
            fa.seek(s0)
            fb.seek(s1)
            left = e0 - s0
            while left:
                n = min(left, 64 * MIB)
                if fa.read(n) != fb.read(n):
                    return f"{k}: values differ"
                left -= n
    return None


def check(out: Path, source: Path, hf: bool) -> dict:
    """reshard verify OUT --against SOURCE (any format); for HF outputs also the bytes of every tensor."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "reshard", "verify", str(out), "--against", str(source)],
                          cwd=REPO, capture_output=True, text=True, env=python_env())
    res = {"reshard_verify_rc": proc.returncode, "reshard_verify": proc.stdout.strip().splitlines()[-3:]
           + proc.stderr.strip().splitlines()[-3:]}
    ok = proc.returncode == 0
    if hf:
        diff = compare_hf(source, out)
        res["bytes_equal"] = diff is None
        if diff:
            res["bytes_diff"] = diff
        ok = ok and diff is None
    res["checked"] = ok
    res["check_s"] = round(time.perf_counter() - t0, 1)
    return res


# ----------------------------------------------------------------------------- running the steps


def python_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return {**env, **(extra or {})}


def peer_env(extra: dict | None = None) -> dict:
    """As make_golden.py runs the peers: CPU only, no network, one OpenMP thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONHASHSEED": "0",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
                "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    return {**env, **(extra or {})}


def git_rev() -> str | None:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "reshard"], cwd=REPO, capture_output=True, text=True)
        return rev.strip() + ("+dirty" if dirty.stdout else "")
    except Exception:
        return None


def machine(work: Path) -> dict:
    import platform

    import psutil

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "host": platform.node(),
            "cpu_cores": os.cpu_count(), "cpu_model": cpu, "ram_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
            "python": platform.python_version(), "git_rev": git_rev(), "loadavg_start": os.getloadavg()}


def pip_versions(venv: Path, names: list[str]) -> dict:
    code = ("import importlib.metadata as m, json, sys\nout = {}\nfor n in sys.argv[1:]:\n    try: out[n] = m.version(n)\n"
            "    except Exception: out[n] = None\nprint(json.dumps(out))")
    try:
        return json.loads(subprocess.run([str(venv / "bin/python"), "-c", code, *names], capture_output=True,
                                         text=True).stdout)
    except Exception:
        return {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=1.0, help="model size in GB (bf16)")
    p.add_argument("--work", default=str(REPO / "benchmarks/work/peers"))
    p.add_argument("--out", default=None, help="JSON record of the run")
    p.add_argument("--mlm-venv", default=os.environ.get("MLM_VENV", "/work/peers/mlm-venv"))
    p.add_argument("--mlm-tree", default=os.environ.get("MLM_TREE", "/work/peers/mlm-tree"))
    p.add_argument("--bridge-venv", default=os.environ.get("BRIDGE_VENV", "/work/peers/bridge-venv"))
    p.add_argument("--only", nargs="+", default=None, help="step names (cp always runs)")
    p.add_argument("--rounds", type=int, default=1, help="run the whole sequence this many times, alternating")
    p.add_argument("--no-drop-cache", action="store_true")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_convert import measure  # the same measurement as bench_convert.py (drop cache, wait4, tree poller)

    work = Path(a.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    hf = work / "hf"
    t0 = time.perf_counter()
    model = build_hf(hf, a.size)
    model["build_s"] = round(time.perf_counter() - t0, 1)
    print(f"source: {model['params'] / 1e6:.0f}M params, {model['logical_bytes'] / 1e9:.2f} GB, "
          f"{model['config']['num_hidden_layers']} layers, hidden {model['config']['hidden_size']} "
          f"({model['build_s']} s)", flush=True)
    mlm_venv, mlm_tree, bridge_venv = Path(a.mlm_venv).resolve(), Path(a.mlm_tree).resolve(), Path(a.bridge_venv).resolve()
    rs = [sys.executable, "-m", "reshard", "convert", "-q"]
    mlm_env = peer_env({"PYTHONPATH": str(mlm_tree)})
    torchrun = [str(bridge_venv / "bin/torchrun"), "--nproc_per_node", "2", "--master_port", "29531"]
    # (name, tool, direction, command, cwd, env, output dir, source for the check, output is HF)
    steps = [
        ("reshard hf->torch_dist TP2", "reshard", "import", rs + [hf, work / "rs-dist", "--to-format", "torch_dist",
         "--to-tp", "2"], REPO, python_env(), "rs-dist", hf, False),
        ("reshard hf->legacy TP2", "reshard", "import", rs + [hf, work / "rs-legacy", "--to-format", "legacy",
         "--to-tp", "2"], REPO, python_env(), "rs-legacy", hf, False),
        ("reshard torch_dist TP2->hf", "reshard", "export", rs + [work / "rs-dist", work / "rs-hf", "--to-format",
         "hf"], REPO, python_env(), "rs-hf", hf, True),
        ("Megatron-LM hf->legacy TP2", "megatron-lm", "import",
         [mlm_venv / "bin/python", mlm_tree / "tools/checkpoint/convert.py", "--model-type", "GPT", "--loader",
          "llama_mistral", "--checkpoint-type", "hf", "--model-size", "llama3", "--bf16", "--load-dir", "hf",
          "--tokenizer-model", "hf", "--saver", "core", "--saver-transformer-impl", "local", "--save-dir", "mlm-legacy",
          "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1", "--megatron-path", mlm_tree],
         work, mlm_env, "mlm-legacy", hf, False),
        ("Megatron-Bridge hf->torch_dist TP2", "megatron-bridge", "import",
         torchrun + [HERE, "_step", "bridge-import", "hf", "bridge-dist", "2"], work, peer_env(), "bridge-dist", hf, False),
        ("Megatron-Bridge torch_dist TP2->hf", "megatron-bridge", "export",
         torchrun + [HERE, "_step", "bridge-export", "hf", "bridge-dist", "bridge-hf", "2"], work, peer_env(),
         "bridge-hf", hf, True),
    ]
    steps = [s for s in steps if not a.only or s[0] in a.only or s[1] in a.only]
    record = {"benchmark": "bench_peers", "size_gb": a.size, "model": model, "machine": machine(work),
              "versions": {"megatron-lm": pip_versions(mlm_venv, ["torch", "megatron-core", "transformers"]),
                           "megatron-bridge": pip_versions(bridge_venv, ["torch", "megatron-core", "megatron-bridge",
                                                                         "transformers"])},
              "megatron_lm_tree": "core_v0.17.1 + shared/peers/mlm-cpu-patches-v0.17.1.diff", "runs": []}

    def run(name, cmd, cwd, env, tool, direction, out_dir=None, source=None, is_hf=False):
        if out_dir:
            shutil.rmtree(work / out_dir, ignore_errors=True)
        cmd = [str(c) for c in cmd]
        log = work / f"{out_dir or 'step'}.log"
        if tool not in ("cp", "reshard"):  # the whole output to a file (measure keeps a tail); exec keeps the pid
            cmd = ["sh", "-c", 'exec "$0" "$@" > "$LOG" 2>&1', *cmd]
            env = {**env, "LOG": str(log)}
        r = measure(name, cmd, drop=not a.no_drop_cache, timeout=a.timeout, env=env, cwd=cwd, ranks=2)
        r.update(tool=tool, direction=direction, loadavg=os.getloadavg(), time=time.strftime("%H:%M:%S"))
        if log.exists():
            text = log.read_text(errors="replace")
            r["output_tail"] = "\n".join(text.strip().splitlines()[-12:])
            if tool == "megatron-lm":  # convert.py exits 0 even when its saver process crashed: judge by its output
                r["ok"] = r["ok"] and "Done!" in text and "Traceback" not in text
            if not r["ok"]:
                print("    " + "\n    ".join(text.strip().splitlines()[-25:]), flush=True)
        # the polled sum over the tree: a forked child's own ru_maxrss starts at this process's RSS (see bench_convert)
        r["peak_bytes"] = r["tree_peak_rss_bytes"]
        if source is not None and r["ok"]:
            r["out_bytes"] = dir_bytes(work / out_dir)
            r.update(check(work / out_dir, source, is_hf))
            r["ok"] = r["checked"]
            print(f"    check: {'ok' if r['checked'] else 'FAILED'} {r.get('reshard_verify', '')[-1:]}", flush=True)
        record["runs"].append(r)
        return r

    for _ in range(a.rounds):
        run("cp -r source", ["cp", "-r", hf, work / "cp"], REPO, None, "cp", "copy", "cp", None)
        for i, (name, tool, direction, cmd, cwd, env, out, src, is_hf) in enumerate(steps):
            run(name, cmd, cwd, env, tool, direction, out, src, is_hf)
            if i == len(steps) // 2 - 1:
                run("cp -r source", ["cp", "-r", hf, work / "cp"], REPO, None, "cp", "copy", "cp", None)
    run("cp -r source", ["cp", "-r", hf, work / "cp"], REPO, None, "cp", "copy", "cp", None)
    record["machine"]["loadavg_end"] = os.getloadavg()
    record["table"] = table(record)
    print(record["table"])
    if a.out:
        Path(a.out).write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"wrote {a.out}")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)


def table(record: dict) -> str:
    runs = record["runs"]
    cp = statistics.median(r["seconds"] for r in runs if r["tool"] == "cp")
    # each peer step against reshard's step with the same source and target format
    ref = {"Megatron-LM hf->legacy TP2": "reshard hf->legacy TP2",
           "Megatron-Bridge hf->torch_dist TP2": "reshard hf->torch_dist TP2",
           "Megatron-Bridge torch_dist TP2->hf": "reshard torch_dist TP2->hf"}
    lines = ["| step | wall s | × cp (cp s / step s) | × reshard's time | peak RSS MiB (tree) | output checked |",
             "| --- | ---: | ---: | ---: | ---: | :---: |"]
    names = list(dict.fromkeys(r["name"] for r in runs))
    for name in names:
        rr = [r for r in runs if r["name"] == name]
        secs = " / ".join(f"{r['seconds']:.1f}" if r["ok"] else "failed" for r in rr)
        rss = " / ".join(f"{r['peak_bytes'] / MIB:.0f}" for r in rr)
        ok = [r for r in rr if r["ok"]]
        xcp = f"{cp / statistics.median(r['seconds'] for r in ok):.2f}" if ok else ""
        base = [r["seconds"] for r in runs if r["name"] == ref.get(name, name) and r["ok"]]
        xrs = f"{statistics.median(r['seconds'] for r in ok) / statistics.median(base):.1f}" if ok and base and rr[0]["tool"] != "cp" else ""
        checked = "" if rr[0]["tool"] == "cp" else ("yes" if all(r.get("checked") for r in rr) else "NO")
        lines.append(f"| {name} | {secs} | {xcp} | {xrs} | {rss} | {checked} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- inside the Bridge venv


def _golden():
    sys.path.insert(0, str(REPO / "fixtures/golden"))
    import make_golden

    return make_golden


def _bridge_import(hf_dir: str, dest: str, tp: int) -> None:
    """AutoBridge.import_ckpt's steps with the model built on the CPU (make_golden._bridge), in bf16."""
    import torch

    g = _golden()
    g._cpu_stubs()
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec

    g._init_dist(tp)
    bridge = AutoBridge.from_hf_pretrained(hf_dir, torch_dtype=torch.bfloat16)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = 1
    provider.transformer_layer_spec = local_layer_spec
    for fusion in ("apply_rope_fusion", "gradient_accumulation_fusion", "masked_softmax_fusion",
                   "bias_activation_fusion", "bias_dropout_fusion", "persist_layer_norm"):
        setattr(provider, fusion, False)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    bridge.save_megatron_model(model, dest, hf_tokenizer_path=hf_dir, low_memory_save=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _bridge_export(hf_dir: str, checkpoint: str, dest: str, tp: int) -> None:
    """Megatron-Bridge loads its torch_dist checkpoint (make_golden._bridge_load) and writes HF with
    AutoBridge.save_hf_pretrained (config, tokenizer and streamed safetensors; its one-call export_ckpt
    calls .cuda())."""
    import torch

    g = _golden()
    g._cpu_stubs()
    from megatron.bridge import AutoBridge

    g._init_dist(tp)
    bridge = AutoBridge.from_hf_pretrained(hf_dir, torch_dtype=torch.bfloat16)
    overrides = {"tensor_model_parallel_size": tp, "expert_tensor_parallel_size": tp}
    overrides |= {f: False for f in ("apply_rope_fusion", "gradient_accumulation_fusion", "masked_softmax_fusion",
                                     "bias_activation_fusion", "bias_dropout_fusion", "persist_layer_norm")}
    model = bridge.load_megatron_model(checkpoint, mp_overrides=overrides)
    bridge.save_hf_pretrained(model, dest, show_progress=False)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_step":
        name, *rest = sys.argv[2:]
        if name == "bridge-import":
            _bridge_import(rest[0], rest[1], int(rest[2]))
        elif name == "bridge-export":
            _bridge_export(rest[0], rest[1], rest[2], int(rest[3]))
        else:
            raise SystemExit(f"unknown step {name}")
    else:
        main()
