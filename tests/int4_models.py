"""Kimi-K2 in the INT4 form its Thinking release ships: a tiny model's routed experts quantized and packed by
compressed-tensors' own code (`calculate_qparams`, `PackedQuantizationCompressor.compress`: symmetric INT4, a
bfloat16 scale per group of 32 columns), everything else bfloat16; and what compressed-tensors makes of them
(`PackedQuantizationCompressor.decompress`), the values reshard is held to."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROUTED = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
# as Kimi-K2-Thinking's config.json leaves out of the quantization: all but the routed experts
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]


def scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                                                           group_size=32))


def make_int4(source: Path, directory: Path) -> Path:
    """`source` (a tiny Kimi-K2 with experts' inputs a multiple of 32) in bfloat16, each routed expert's weight as
    `weight_packed`, `weight_scale` and `weight_shape`, with the compressed-tensors quantization_config."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams

    directory.mkdir(parents=True)
    out = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        weight = tensor.to(torch.bfloat16)
        if not ROUTED.fullmatch(name):
            out[name] = weight
            continue
        groups = weight.reshape(weight.shape[0], -1, 32)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme().weights)
        packed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale.to(torch.bfloat16)}, scheme())
        out.update({f"{name.removesuffix('.weight')}.{part}": value for part, value in packed.items()})
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    quantization = QuantizationConfig(config_groups={"group_0": scheme()}, format="pack-quantized", quantization_status="compressed",
                                      ignore=IGNORE).model_dump()
    config = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, dtype="bfloat16", quantization_config=quantization), indent=2))
    shutil.copy(source / "tokenizer_config.json", directory)
    return directory


def decompressed(directory: Path) -> dict[str, torch.Tensor]:
    """The INT4 model's tensors as compressed-tensors decompresses them, the rest as stored."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    tensors = load_file(str(directory / "model.safetensors"))
    out = {name: t for name, t in tensors.items() if not name.endswith(("weight_packed", "weight_scale", "weight_shape"))}
    for name in tensors:
        if name.endswith(".weight_packed"):
            base = name.removesuffix("_packed")
            parts = {part: tensors[f"{base}_{part.removeprefix('weight_')}"] for part in ("weight_packed", "weight_scale", "weight_shape")}
            out[base] = PackedQuantizationCompressor.decompress(parts, scheme())["weight"]
    return out
