"""MXFP4 weights as gpt-oss is released (`quantization_config.quant_method: "mxfp4"`), read dequantized, and written
(`--to-mxfp4`) as the release was made.

A quantized HF tensor `name` of shape [*lead, C, R] (as transformers holds it dequantized: gpt-oss's experts'
`gate_up_proj [E, H, 2I]` and `down_proj [E, I, H]`) is stored as `name_blocks` uint8 [*lead, R, C/32, 16] and
`name_scales` uint8 [*lead, R, C/32]: row r of the transposed weight in groups of 32 E2M1 values, byte b of a group's
block holding element 2b in its low nibble and 2b+1 in its high one, the group scaled by 2^(scale - 127) (E8M0; 255 is
NaN). Dequantized, the result is transposed back (transformers' integrations/mxfp4.py `_convert_moe_packed_tensors`,
which loading with `dequantize=True` calls), so a family maps an MXFP4 file as it maps the unquantized one. Every value
is exact in float32 (and in bfloat16: at most two significant bits, scaled by a power of two in its range).

Written, a group's scale is the power of two its largest magnitude over 6 rounds up to (the exponent bits of that
float32 quotient, rounded up unless its mantissa is zero), and each value over the scale rounds to the nearest E2M1
value, ties away from zero, as triton_kernels' `downcast_to_mxfp_torch` does in its default ROUND_UP mode (what
transformers' MXFP4 quantization calls, and what made the release: every released group's largest code is 4 or 6).
So a group so made comes back byte for byte, and any released value comes back exactly. Each written value is within
`BOUND` of the one it stands for: half the widest E2M1 step (between 4 and 6) is one unit of its group's scale.
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
# A scaled magnitude's E2M1 code, by its float32 exponent and top two mantissa bits (its bits >> 21): the number of
# midpoints between neighbouring E2M1 magnitudes at or below it (a tie goes up). Each midpoint has at most two
# mantissa bits, so it is the least value of its entry, and every value of an entry rounds alike.
_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_CODE_OF_TOP_BITS = np.searchsorted(_MIDPOINTS, (np.arange(1 << 10, dtype=np.uint32) << 21).view(np.float32), side="right").astype(np.uint8)
# Each E8M0 scale as its power of two (255, NaN, refused before use; 2^128 is inf): one gather instead of an ldexp
# per value. The product of a value and a power of two is rounded once, as ldexp rounds it: the same bits.
with np.errstate(over="ignore"):
    _POW2 = np.ldexp(np.float32(1), np.arange(256) - 127).astype(np.float32)
_KEYS = {"quant_method", "modules_to_not_convert"}  # what gpt-oss's release gives; which tensors are packed, the files say
BOUND = "|x - q| <= 2^(e - 127), e the E8M0 scale of x's group of 32"  # what `check_error` holds, as said to a user


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


def packed_shapes(name: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of tensor `name` [*lead, C, R]; refused where C is no whole number of groups."""
    *lead, columns, rows = shape
    if columns % GROUP:
        raise ReshardError(f"{name} has {columns} input columns, not a multiple of MXFP4's group of {GROUP}: it cannot be MXFP4")
    return (*lead, rows, columns // GROUP, GROUP // 2), (*lead, rows, columns // GROUP)


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


def quantize(x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(blocks uint8 [*lead, R, C/32, 16], scales uint8 [*lead, R, C/32]) of weight `x` [*lead, C, R] as transformers
    holds it (C a multiple of 32), by the module docstring's rounding; non-finite values, and a group past what E8M0
    scales, refused naming `name`."""
    *lead, columns, rows = x.shape
    packed_shapes(name, x.shape)
    groups = np.ascontiguousarray(np.swapaxes(x, -1, -2), dtype=np.float32).reshape(*lead, rows, columns // GROUP, GROUP)
    magnitudes = np.abs(groups)
    largest = magnitudes.max(axis=-1)
    if not np.isfinite(largest).all():
        raise ReshardError(f"{name} holds a value that is not finite, which MXFP4 cannot hold")
    # the exponent bits of largest / 6, rounded up to a power of two unless they are one already
    rounded = ((largest / np.float32(6)).view(np.int32) + 0x7FFFFF) & 0x7F800000
    scales = (rounded >> 23).astype(np.uint8)
    if (scales == NAN_SCALE).any():
        raise ReshardError(f"{name} holds a value past 6 x 2^127, which MXFP4's scales cannot reach")
    with np.errstate(divide="ignore"):
        unit = np.where(rounded == 0, np.float32(0), np.float32(1) / rounded.view(np.float32))
    magnitudes *= unit[..., None]
    codes = _CODE_OF_TOP_BITS[magnitudes.view(np.uint32) >> 21]
    codes |= np.signbit(groups).view(np.uint8) << 3
    codes = codes.reshape(*lead, rows, columns // GROUP, GROUP // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), scales


def check_error(x: np.ndarray, blocks: np.ndarray, scales: np.ndarray, name: str) -> np.ndarray:
    """The float32 values [*lead, C, R] MXFP4 weight `name` holds, once each is within `BOUND` of the value of `x` it
    stands for (refused in one line naming the tensor otherwise)."""
    held = dequantize(blocks, scales, name)
    *lead, columns, rows = held.shape
    error = np.abs(held - x.astype(np.float32)).reshape(*lead, columns // GROUP, GROUP, rows)
    worst = error - np.swapaxes(_POW2[scales], -1, -2)[..., None, :]  # each value's group's scale
    if (worst > 0).any():
        at = np.unravel_index(int(worst.argmax()), held.shape)
        raise ReshardError(f"{name}: MXFP4 holds {held[at]} for {x[at]} at {list(map(int, at))}, past the bound {BOUND}")
    return held
