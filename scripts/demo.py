"""The main job end to end on a tiny embedded model (no downloads), as `bash scripts/demo.sh` runs it.

1. the trainer trains a tiny Llama-style model on a generated corpus at TP=2 (Megatron-Core, torch_dist,
   checksums recorded at save);
2. reshard inspects the checkpoint, reshards it to TP=1 PP=2 (optimizer state included), stores it as
   zarr and exports it to HuggingFace, verifying every tensor's checksum each time;
3. the proofs: Megatron-Core loads both layouts and computes the same loss, transformers loads the HF
   export and computes the same logits;
4. the cluster "shrinks": training resumes from the resharded checkpoint at TP=1 PP=2.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fixtures.torchrun import run  # noqa: E402

WORK = REPO / "out" / "demo"


def reshard(*args: object) -> None:
    print(f"\n$ reshard {' '.join(map(str, args))}", flush=True)
    subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], check=True, cwd=WORK)


def megatron_forward(ckpt: Path, **layout: int) -> dict:
    out = WORK / f"oracle-{ckpt.name}.pt"
    flags = [x for k, v in layout.items() for x in (f"--{k}", v)]
    run("fixtures.megatron_oracle", ["--load", ckpt, *flags, "--out", out], nproc=layout.get("tp", 1) * layout.get("pp", 1))
    return torch.load(out, weights_only=False)


def main() -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "fixtures.corpus", WORK / "corpus.txt"], check=True, cwd=REPO)
    print("training 6 iterations at TP=2 (torchrun, 2 ranks) ...", flush=True)
    train = ["--model", "tiny-llama", "--data", WORK / "corpus.txt", "--global-batch-size", 4, "--lr", "3e-3", "--lr-decay-iters", 10]
    run("reshard.trainer", [*train, "--tp", 2, "--train-iters", 6, "--save", WORK / "run1", "--save-interval", 3,
                    "--metrics", WORK / "run1.jsonl"], nproc=2)
    print((WORK / "run1.jsonl").read_text().strip().splitlines()[-1])

    reshard("inspect", "run1")
    reshard("convert", "run1", "run1-tp1pp2", "--tp", 2, "--to-tp", 1, "--to-pp", 2)
    reshard("convert", "run1-tp1pp2", "run1.zarr", "--to-format", "zarr")
    reshard("convert", "run1.zarr", "run1-hf", "--to-format", "hf", "--no-optimizer")
    reshard("verify", "run1-tp1pp2", "--against", "run1")
    reshard("verify", "run1-hf", "--against", "run1")

    print("\nMegatron-Core loads both layouts and runs a forward ...", flush=True)
    before = megatron_forward(WORK / "run1", tp=2)
    after = megatron_forward(WORK / "run1-tp1pp2", tp=1, pp=2)
    print(f"loss at TP2: {before['loss']:.7f}   loss after reshard to TP1PP2: {after['loss']:.7f}")
    assert abs(before["loss"] - after["loss"]) <= 1e-6 * abs(before["loss"])

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(WORK / "run1-hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(before["tokens"][:, :-1]).logits
    diff = (logits - before["logits"]).abs().max().item()
    print(f"transformers on the HF export vs Megatron-Core: max |logit difference| = {diff:.2e}")
    assert diff <= 1e-4

    print("\nthe cluster shrinks: training resumes at TP=1 PP=2 from the resharded checkpoint ...", flush=True)
    run("reshard.trainer", [*train, "--pp", 2, "--train-iters", 10, "--load", WORK / "run1-tp1pp2", "--save", WORK / "run1-tp1pp2",
                    "--metrics", WORK / "resumed.jsonl"], nproc=2)
    for line in (WORK / "resumed.jsonl").read_text().strip().splitlines():
        print(line)
    reshard("verify", "run1-tp1pp2")
    print(f"\nall good: outputs are in {WORK}")


if __name__ == "__main__":
    main()
