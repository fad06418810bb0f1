"""INT4 weights as Kimi-K2-Thinking and later are released (compressed-tensors' `pack-quantized` format: symmetric
integers, a scale per group of columns), read dequantized.

A quantized Linear weight `X.weight` [out, in] is stored as `X.weight_packed` int32 [out, ceil(in * 4 / 32)] (eight
values a word, the first in the lowest four bits, each as q + 8 for q in [-8, 7]), `X.weight_scale` [out,
ceil(in / group)] in the model's dtype, and `X.weight_shape` ([out, in]). Dequantized, value (r, c) is
q(r, c) * scale(r, c // group) rounded to the scale's dtype, as compressed-tensors computes it (`x_q.to(scale.dtype)
* scale`): a bfloat16 scale gives bfloat16 values, each exact in float32. Which Linear layers are packed, the files
say; the `quantization_config` must describe exactly this (its other schemes and keys are refused by name).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reshard.errors import ReshardError

METHOD, FORMAT = "compressed-tensors", "pack-quantized"
PACKED, SCALE, SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"
BITS = 4
# What a pack-quantized config says, and what of it reshard reads: a weights-only symmetric INT4 group scheme
_KEYS = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "quantization_status", "global_compression_ratio",
         "sparsity_config", "moe_sparsity_config", "transform_config", "version"}
_WEIGHTS = {"num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group", "dynamic": False}
_WEIGHT_KEYS = {*_WEIGHTS, "group_size", "actorder", "block_structure", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}


def is_config(quantization: Any) -> bool:
    return isinstance(quantization, dict) and quantization.get("quant_method") == METHOD


def group_size(quantization: dict[str, Any]) -> int:
    """The columns of a group, once the config is refused in one line naming its field unless it is pack-quantized
    symmetric INT4 weights in groups, one group size for all, nothing else quantized."""
    def refuse(field: str, value: Any, want: str) -> ReshardError:
        return ReshardError(f"HF config: quantization_config.{field} is {value!r}; reshard reads {want}")

    if unknown := sorted(set(quantization) - _KEYS):
        raise refuse(unknown[0], quantization[unknown[0]], f"only {', '.join(sorted(_KEYS))}")
    if quantization.get("format") != FORMAT:
        raise refuse("format", quantization.get("format"), f"{FORMAT!r} (INT4 packed in int32)")
    for field in ("kv_cache_scheme", "sparsity_config", "moe_sparsity_config", "transform_config"):
        if quantization.get(field):
            raise refuse(field, quantization[field], "none (only weights quantized)")
    groups = quantization.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("config_groups", groups, "the schemes of the quantized layers")
    sizes = set()
    for name, scheme in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(scheme, dict) or not isinstance(scheme.get("weights"), dict):
            raise refuse(where, scheme, "a scheme with weights")
        for field in ("input_activations", "output_activations"):
            if scheme.get(field):
                raise refuse(f"{where}.{field}", scheme[field], "none (weights-only quantization)")
        if scheme.get("format") not in (None, FORMAT):
            raise refuse(f"{where}.format", scheme["format"], f"{FORMAT!r}, as the whole config's")
        weights = scheme["weights"]
        if unknown := sorted(set(weights) - _WEIGHT_KEYS):
            raise refuse(f"{where}.weights.{unknown[0]}", weights[unknown[0]], f"only {', '.join(sorted(_WEIGHT_KEYS))}")
        for field, want in _WEIGHTS.items():
            if weights.get(field, want if field == "dynamic" else None) != want:
                raise refuse(f"{where}.weights.{field}", weights.get(field), repr(want))
        if weights.get("actorder") not in (None, False) or weights.get("block_structure") is not None:
            raise refuse(f"{where}.weights.actorder", weights.get("actorder"), "none (columns in their order)")
        size = weights.get("group_size")
        if type(size) is not int or size < 1:
            raise refuse(f"{where}.weights.group_size", size, "a whole number of columns")
        sizes.add(size)
    if len(sizes) != 1:
        raise refuse("config_groups", sorted(sizes), "one group size for every quantized layer")
    return sizes.pop()


def stored_names(name: str) -> tuple[str, str, str]:
    """(packed, scale, shape) of quantized HF weight `name` (`X.weight`)."""
    base = name.removesuffix(".weight")
    return base + PACKED, base + SCALE, base + SHAPE


def shape(name: str, packed: tuple[int, ...], scale: tuple[int, ...], stated: np.ndarray, group: int) -> tuple[int, int]:
    """The dequantized [out, in] of `name`: its weight_shape, refused naming the tensor where the packed words or the
    scales do not fit it."""
    values = np.asarray(stated).reshape(-1)
    if values.size != 2 or (values < 1).any():
        raise ReshardError(f"INT4 tensor {name}: weight_shape {values.tolist()} is not [out, in]")
    out, columns = int(values[0]), int(values[1])
    if tuple(packed) != (out, -(-columns * BITS // 32)) or tuple(scale) != (out, -(-columns // group)):
        raise ReshardError(f"INT4 tensor {name}: packed {list(packed)} and scale {list(scale)} do not fit weight_shape "
                           f"{[out, columns]} (packed [out, in/8], scale [out, in/{group}])")
    return out, columns


def dequantize(packed: np.ndarray, scale: np.ndarray, columns: int, group: int, name: str) -> np.ndarray:
    """float32 [out, columns] of int32 words [out, words] and scales [out, groups] (float32, bfloat16 or float16); a
    scale that is not finite and positive refused naming `name`."""
    wide = scale.astype(np.float32)
    if not (np.isfinite(wide) & (wide > 0)).all():
        raise ReshardError(f"INT4 tensor {stored_names(name)[1]} holds a scale that is not a positive number: the checkpoint is damaged")
    nibbles = (packed.view(np.uint32)[:, :, None] >> np.arange(0, 32, BITS, dtype=np.uint32)) & 0xF
    values = nibbles.reshape(packed.shape[0], -1)[:, :columns].astype(np.float32) - 8
    values *= np.repeat(wide, group, axis=1)[:, :columns]
    # exact in float32 (4 bits times the scale's 8 or 11); rounded to the scale's dtype as compressed-tensors' product is
    return values.astype(scale.dtype).astype(np.float32)
