"""MXFP4 weights as gpt-oss is released (`quantization_config.quant_method: "mxfp4"`), read dequantized.

A quantized HF tensor `name` of shape [*lead, C, R] (as transformers holds it dequantized: gpt-oss's experts'
`gate_up_proj [E, H, 2I]` and `down_proj [E, I, H]`) is stored as `name_blocks` uint8 [*lead, R, C/32, 16] and
`name_scales` uint8 [*lead, R, C/32]: row r of the transposed weight in groups of 32 E2M1 values, byte b of a group's
block holding element 2b in its low nibble and 2b+1 in its high one, the group scaled by 2^(scale - 127) (E8M0; 255 is
NaN). Dequantized, the result is transposed back (transformers' integrations/mxfp4.py `_convert_moe_packed_tensors`,
which loading with `dequantize=True` calls), so a family maps an MXFP4 file as it maps the unquantized one. Every value
is exact in float32 (and in bfloat16: at most two significant bits, scaled by a power of two in its range).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reshard.errors import ReshardError

METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
GROUP = 32  # values per block (16 bytes) and per scale
# E2M1: sign bit 3, then 2 exponent bits and one mantissa bit
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
NAN_SCALE = 255
# Each E8M0 scale as its power of two (255, NaN, refused before use; 2^128 is inf): one gather instead of an ldexp
# per value. The product of a value and a power of two is rounded once, as ldexp rounds it: the same bits.
with np.errstate(over="ignore"):
    _POW2 = np.ldexp(np.float32(1), np.arange(256) - 127).astype(np.float32)
_KEYS = {"quant_method", "modules_to_not_convert"}  # what gpt-oss's release gives; which tensors are packed, the files say


def is_config(quantization: Any) -> bool:
    return isinstance(quantization, dict) and quantization.get("quant_method") == METHOD


def check_config(quantization: dict[str, Any]) -> None:
    """Refuse a `quantization_config` key the MXFP4 reader does not read, naming it."""
    if unknown := sorted(set(quantization) - _KEYS):
        raise ReshardError(f"HF config: quantization_config.{unknown[0]} is not read by reshard's MXFP4 reader "
                           f"(it reads {', '.join(sorted(_KEYS))}); open an issue with the model name")


def stored_names(name: str) -> tuple[str, str]:
    """(blocks, scales) of quantized tensor `name`."""
    return name + BLOCKS, name + SCALES


def shape(name: str, blocks: tuple[int, ...], scales: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantized shape [*lead, C, R] of `name`'s blocks [*lead, R, G, 16] and scales [*lead, R, G], refused
    naming the tensor where they do not pair."""
    if len(blocks) < 3 or blocks[-1] != GROUP // 2 or tuple(blocks[:-1]) != tuple(scales):
        raise ReshardError(f"MXFP4 tensor {name}: blocks {list(blocks)} and scales {list(scales)} do not pair "
                           f"(blocks [..., rows, groups, {GROUP // 2}], scales [..., rows, groups])")
    *lead, rows, groups = scales
    return (*lead, groups * GROUP, rows)


def dequantize(blocks: np.ndarray, scales: np.ndarray, name: str) -> np.ndarray:
    """float32 [*lead, C, R] (C-contiguous) of uint8 blocks [*lead, R, G, 16] and scales [*lead, R, G]; a NaN scale, or
    one that takes a value past float32's range, refused naming `name`. The bytes are transposed first (a quarter of
    the values' size), so that every later step runs along contiguous rows: 3x faster than transposing the values."""
    if (scales == NAN_SCALE).any():
        raise ReshardError(f"MXFP4 tensor {name}{SCALES} holds the NaN scale {NAN_SCALE}: the checkpoint is damaged")
    *lead, rows, groups, _ = blocks.shape
    by_column = np.ascontiguousarray(np.moveaxis(blocks, -3, -1))  # [*lead, G, 16, R]
    values = np.empty((*lead, groups, GROUP // 2, 2, rows), np.float32)
    values[..., 0, :] = FP4[by_column & 0x0F]  # element 2b of a block in its byte b's low nibble
    values[..., 1, :] = FP4[by_column >> 4]
    values = values.reshape(*lead, groups, GROUP, rows)
    with np.errstate(over="ignore"):
        values *= _POW2[np.swapaxes(scales, -1, -2)][..., None, :]
    # 6 x 2^126 and up: past float32, as in transformers' float32 and bfloat16; no scale below 253 reaches it
    if scales.size and scales.max() >= 253 and not np.isfinite(values).all():
        raise ReshardError(f"MXFP4 tensor {name}{SCALES} scales values past float32's range: the checkpoint is damaged")
    return values.reshape(*lead, groups * GROUP, rows)
