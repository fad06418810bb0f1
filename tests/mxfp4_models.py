"""gpt-oss in its released MXFP4 form for the tests: a tiny model's experts replaced by random MXFP4 blocks and scales
(`*_blocks`/`*_scales`, uint8), everything else in bfloat16, as openai/gpt-oss ships; and what transformers makes of them
(`_convert_moe_packed_tensors`, which its dequantizing load calls), the values reshard is held to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EXPERTS = ("gate_up_proj", "down_proj")  # what the release quantizes: the experts' weights, not their biases
QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                      "model.embed_tokens", "lm_head"]}


def make_mxfp4(source: Path, directory: Path, seed: int = 0) -> Path:
    """`source` (a tiny gpt-oss with experts' inputs a multiple of 32) with each expert weight [E, C, R] replaced by
    blocks [E, R, C/32, 16] of random bytes and scales [E, R, C/32] around 2^-4 (values of order 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True)
    out = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if name.rsplit(".", 1)[-1] in EXPERTS:
            experts, columns, rows = tensor.shape
            out[name + "_blocks"] = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=gen, dtype=torch.uint8)
            out[name + "_scales"] = torch.randint(120, 126, (experts, rows, columns // 32), generator=gen, dtype=torch.uint8)
        else:
            out[name] = tensor.to(torch.bfloat16)
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, dtype="bfloat16", quantization_config=QUANTIZATION), indent=2))
    shutil.copy(source / "tokenizer_config.json", directory)
    return directory


def dequantized(directory: Path) -> dict[str, torch.Tensor]:
    """The MXFP4 model's tensors as transformers dequantizes them (float32), the rest as stored."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    tensors = load_file(str(directory / "model.safetensors"))
    out = {name: t for name, t in tensors.items() if not name.endswith(("_blocks", "_scales"))}
    for name in tensors:
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            # [E, C, R], transposed by transformers as its gpt-oss holds the weight
            out[base] = _convert_moe_packed_tensors(tensors[name], tensors[base + "_scales"], dtype=torch.float32)
    return out
