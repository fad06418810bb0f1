"""Fine-tuning from HuggingFace weights (torchrun + gloo on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fixtures.corpus import write_corpus
from tests.converters.hf_models import build
from tests.launch import run

pytestmark = pytest.mark.slow  # every test trains with the trainer (Megatron-Core)


def stored_dtypes(hf_dir: Path) -> set[torch.dtype]:
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        return {f.get_tensor(name).dtype for name in f.keys()}


def losses(metrics: Path) -> dict[int, float]:
    records = map(json.loads, metrics.read_text().splitlines())
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}


def test_fp32_hf_weights_are_cast_for_a_bf16_run(tmp_path):
    """A --bf16 run from fp32 HF weights trains as the same run from the bf16 copy transformers makes of
    them (`from_pretrained(dtype=torch.bfloat16)`): the same bf16 values at the same layout, so the same
    losses. Two ranks (TP2): the conversion runs in a child of rank 0 alone."""
    from transformers import AutoModelForCausalLM

    fp32 = build("llama", tmp_path / "fp32")
    AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert stored_dtypes(fp32) == {torch.float32} and stored_dtypes(tmp_path / "bf16") == {torch.bfloat16}
    corpus = write_corpus(tmp_path / "corpus.txt", docs=300, seed=0)

    def finetune(load: Path) -> dict[int, float]:
        metrics = tmp_path / f"{load.name}.jsonl"
        run("reshard.trainer", ["--tp", 2, "--bf16", "--load", load, "--data", corpus, "--seq-length", 16,
                        "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 3, "--seed", 7,
                        "--metrics", metrics], nproc=2)
        return losses(metrics)

    cast, expected = finetune(fp32), finetune(tmp_path / "bf16")
    assert sorted(cast) == sorted(expected) == [1, 2, 3]
    for it in cast:
        assert cast[it] == pytest.approx(expected[it], rel=1e-6), f"iteration {it}: {cast[it]} vs {expected[it]}"
