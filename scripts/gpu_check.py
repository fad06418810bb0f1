"""The CUDA + NCCL proof, for a machine with one GPU (CI has none): `python scripts/gpu_check.py [step ...]`.

CI and the demo run Megatron-Core on the CPU with gloo (trainer/cpu_compat.py redirects its CUDA-only
calls). This checks that the same trainer and the same checkpoints behave on a GPU, and that a
checkpoint moves between the two through reshard:

1. reference: the trainer on the CPU (gloo, 2 ranks, TP=2), fp32, 6 iterations;
2. the same run stopped at iteration 3, resharded to TP=1 (optimizer state included), resumed on the
   GPU (NCCL, TP=1) to iteration 6: the checksums of what was loaded verify, and the losses of
   iterations 4-6 equal the CPU reference's (CPU and GPU kernels differ, hence a tolerance);
3. bf16 with Megatron's DistributedOptimizer (CUDA only) on the GPU for 4 iterations, resharded to
   TP=2, resumed on the CPU (2 ranks, the plain mixed-precision optimizer) to iteration 6; and a CPU
   bf16 run resharded to TP=1 and resumed on the GPU; each against an uninterrupted GPU run, the latter
   also against the uninterrupted CPU run (its own first iterations, so the tighter oracle);
4. the HF export of step 2's checkpoint: transformers on the GPU gives Megatron-Core's logits (GPU).

Every step runs and is reported, also after an earlier one failed (a JSON summary, also written to
out/gpu_check/summary.json); the exit status is non-zero when any check failed.

The results of its last run on a GPU (date, machine, versions, each check's margin) are in docs/trainer.md.
`python scripts/gpu_check.py cpu_to_gpu_bf16` runs one step.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fixtures.torchrun import run  # noqa: E402

WORK = REPO / "out" / "gpu_check"
CPU = {"CUDA_VISIBLE_DEVICES": ""}  # ranks on the CPU: gloo and trainer/cpu_compat.py
LOSS_RTOL = {"fp32": 1e-3, "bf16": 3e-2, "bf16-resumed": 1e-3}  # the last: 2 iterations on other kernels
LOGITS_ATOL = 1e-4


def reshard(*args: object) -> None:
    print(f"$ reshard {' '.join(map(str, args))}", flush=True)
    subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], check=True, cwd=WORK)


def train(name: str, *flags: object, nproc: int = 1, env: dict | None = None) -> dict[int, float]:
    """Run the trainer with the common flags; return {iteration: loss} from its metrics file."""
    metrics = WORK / f"{name}.jsonl"
    common = ["--model", "tiny-llama", "--data", WORK / "corpus.txt", "--global-batch-size", 4, "--lr", "3e-3",
              "--lr-decay-iters", 6, "--metrics", metrics]
    print(f"trainer {name}: {' '.join(map(str, flags))} ({'CPU' if env else 'GPU'}, {nproc} rank(s))", flush=True)
    run("reshard.trainer", [*common, *map(str, flags)], nproc=nproc, env=env)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}


def load_event(name: str) -> dict:
    records = [json.loads(line) for line in (WORK / f"{name}.jsonl").read_text().splitlines()]
    return next(r for r in records if r.get("event") == "checkpoint_load")


class Checks:
    def __init__(self) -> None:
        self.results: list[dict] = []

    def add(self, name: str, ok: bool, **facts) -> None:
        self.results.append({"check": name, "ok": bool(ok), **facts})
        print(f"{'ok  ' if ok else 'FAIL'} {name} {facts}", flush=True)

    def step(self, fn) -> None:
        """Run one step; a step that raises is a failed check, and the next steps still run."""
        print(f"== {fn.__name__}", flush=True)
        try:
            fn(self)
        except Exception as exc:  # report every step, not only the first failure
            self.add(fn.__name__, False, error=str(exc)[-3000:])

    def losses(self, name: str, got: dict[int, float], want: dict[int, float], iters: range, rtol: float) -> None:
        rel = max(abs(got[i] - want[i]) / abs(want[i]) for i in iters)
        self.add(name, rel <= rtol, max_rel_diff=rel, rtol=rtol,
                 got=[got[i] for i in iters], want=[want[i] for i in iters])

    def resumed(self, name: str) -> None:
        event = load_event(name)
        self.add(f"{name}: loaded checkpoint verified", event["optimizer_loaded"] and event["verified_tensors"] > 0,
                 verified_tensors=event["verified_tensors"], optimizer_loaded=event["optimizer_loaded"])


def cpu_to_gpu(checks: Checks) -> None:
    """fp32: CPU TP=2 -> reshard -> GPU TP=1, against the uninterrupted CPU run."""
    reference = train("cpu-reference", "--tp", 2, "--train-iters", 6, nproc=2, env=CPU)
    train("cpu-first-half", "--tp", 2, "--train-iters", 3, "--save", WORK / "run-a", nproc=2, env=CPU)
    reshard("convert", "run-a", "run-a-tp1", "--tp", 2, "--to-tp", 1)
    resumed = train("gpu-resumed", "--train-iters", 6, "--load", WORK / "run-a-tp1", "--save", WORK / "run-a-tp1")
    checks.resumed("gpu-resumed")
    checks.losses("CPU TP2 -> reshard -> GPU TP1: losses 4-6 equal the CPU run's", resumed, reference, range(4, 7),
                  LOSS_RTOL["fp32"])


def distributed_optimizer_to_cpu(checks: Checks) -> None:
    """bf16: Megatron's DistributedOptimizer (dp_reshardable) on the GPU -> reshard TP=2 -> the plain
    mixed-precision optimizer on the CPU, against the uninterrupted GPU run."""
    distopt = ["--bf16", "--use-distributed-optimizer"]
    reference = train("gpu-bf16-reference", *distopt, "--train-iters", 6)
    train("gpu-bf16-first-part", *distopt, "--train-iters", 4, "--save", WORK / "run-b")
    reshard("convert", "run-b", "run-b-tp2", "--to-tp", 2)
    reshard("verify", "run-b-tp2", "--against", "run-b")
    resumed = train("cpu-bf16-resumed", "--bf16", "--tp", 2, "--train-iters", 6, "--load", WORK / "run-b-tp2",
                    "--save", WORK / "run-b-tp2", nproc=2, env=CPU)
    checks.resumed("cpu-bf16-resumed")
    checks.losses("GPU DistributedOptimizer bf16 -> reshard TP2 -> CPU plain optimizer: losses 5-6", resumed,
                  reference, range(5, 7), LOSS_RTOL["bf16"])


def cpu_to_gpu_bf16(checks: Checks) -> None:
    """bf16: CPU TP=2 -> reshard TP=1 -> GPU with the plain optimizer. Against the uninterrupted
    CPU run, whose first 4 iterations are the resumed run's, so only 2 iterations of GPU kernels separate
    them; and against the uninterrupted GPU run, which differs from the start."""
    cpu_reference = train("cpu-bf16-reference", "--bf16", "--tp", 2, "--train-iters", 6, nproc=2, env=CPU)
    gpu_reference = train("gpu-bf16-plain-reference", "--bf16", "--train-iters", 6)
    train("cpu-bf16-first-part", "--bf16", "--tp", 2, "--train-iters", 4, "--save", WORK / "run-c", nproc=2, env=CPU)
    reshard("convert", "run-c", "run-c-tp1", "--to-tp", 1)
    resumed = train("gpu-bf16-resumed", "--bf16", "--train-iters", 6, "--load", WORK / "run-c-tp1",
                    "--save", WORK / "run-c-tp1")
    checks.resumed("gpu-bf16-resumed")
    checks.losses("CPU bf16 TP2 -> reshard TP1 -> GPU: losses 5-6 against the CPU run", resumed, cpu_reference,
                  range(5, 7), LOSS_RTOL["bf16-resumed"])
    checks.losses("CPU bf16 TP2 -> reshard TP1 -> GPU: losses 5-6 against the GPU run", resumed, gpu_reference,
                  range(5, 7), LOSS_RTOL["bf16"])


def hf_logits(checks: Checks) -> None:
    """transformers vs Megatron-Core, both on the GPU, on the HF export of cpu_to_gpu's checkpoint."""
    reshard("convert", "run-a-tp1", "run-a-hf", "--to-format", "hf", "--no-optimizer")
    run("fixtures.megatron_oracle", ["--load", WORK / "run-a-tp1", "--out", WORK / "oracle.pt"], nproc=1)
    oracle = torch.load(WORK / "oracle.pt", weights_only=False)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(WORK / "run-a-hf", dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = model(oracle["tokens"][:, :-1].cuda()).logits.float().cpu()
    diff = (logits - oracle["logits"]).abs().max().item()
    checks.add("transformers (GPU) on the HF export = Megatron-Core (GPU) logits", diff <= LOGITS_ATOL,
               max_abs_diff=diff, atol=LOGITS_ATOL)


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device (CI and the demo cover the CPU)")
    steps = {step.__name__: step for step in (cpu_to_gpu, distributed_optimizer_to_cpu, cpu_to_gpu_bf16, hf_logits)}
    if unknown := set(sys.argv[1:]) - set(steps):
        raise SystemExit(f"unknown step(s) {sorted(unknown)}; steps: {', '.join(steps)}")
    wanted = set(sys.argv[1:]) or set(steps)
    if "hf_logits" in wanted:
        wanted.add("cpu_to_gpu")  # whose checkpoint it exports
    chosen = [name for name in steps if name in wanted]
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "fixtures.corpus", WORK / "corpus.txt"], check=True, cwd=REPO)
    checks = Checks()
    for name in chosen:
        checks.step(steps[name])
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "megatron_core": _version("megatron-core"), "python": sys.version.split()[0], "checks": checks.results}
    (WORK / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if all(r["ok"] for r in checks.results) else 1


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
