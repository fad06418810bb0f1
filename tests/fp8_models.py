"""fp8 block-scaled HF models for the tests, made in torch independently of `reshard.fp8_blocks`: DeepSeek's
recipe (a block's scale is its largest magnitude / 448) and the dequantization the tests hold reshard to
(`weight.float() * scale` repeated over each block, edge blocks partial)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# DeepSeek-V3's choice, in HF names: the decoder's linear weights (MLA's kv_a_proj_with_mqa and an MTP layer's
# eh_proj too), not embeddings, head, norms or router
LINEAR = re.compile(r"\.layers\.\d+\..*(proj|proj_with_mqa|w[123])\.weight$")


def load(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    scale = torch.empty(-(-rows // block[0]), -(-cols // block[1]), dtype=torch.float32)
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].float()
            amax = part.abs().max()
            s = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            scale[i, j] = s
            values[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (part / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return values, scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = values.shape
    return values.float() * scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def make_fp8(source: Path, directory: Path, block: tuple[int, int]) -> Path:
    """`source` (an HF model) with its decoder's linear weights quantized in blocks of `block`."""
    directory.mkdir(parents=True)
    out = {}
    for name, tensor in load(source).items():
        if LINEAR.search(name):
            out[name], out[name + "_scale_inv"] = quantize(tensor, block)
        else:
            out[name] = tensor.to(torch.bfloat16)
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(source / "tokenizer_config.json", directory)
    return directory


def dequantized(directory: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """An fp8 model's tensors as float32, its scales gone."""
    tensors = load(directory)
    return {name: dequantize(t, tensors[name + "_scale_inv"], block) if t.dtype == torch.float8_e4m3fn else t.float()
            for name, t in tensors.items() if not name.endswith("_scale_inv")}
