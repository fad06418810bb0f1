"""FP8 block scaling, as DeepSeek-V3 releases its weights and transformers' FineGrainedFP8 loads them.

A quantized linear weight `X.weight` ([out, in], float8_e4m3fn) comes with `X.weight_scale_inv` (float32,
[ceil(out/bm), ceil(in/bn)] for blocks of [bm, bn], edge blocks partial): its values are
`float32(weight) * scale_inv` of the element's block, one float32 product, as transformers' `Fp8Dequantize`
and DeepSeek's `weight_dequant` compute them; a cast to bf16 comes after, rounding that product once.

Quantizing follows DeepSeek's recipe: a block's scale is its largest magnitude / 448 (float8_e4m3fn's
largest value), each value divided by it and rounded to the nearest float8 (an all-zero block keeps scale 1,
as transformers' `Fp8Quantize` does). Rounding to float8 costs at most half a step:

    |x - q * s| <= (2^-4 |x| + 2^-10 s) (1 + 2^-10)

(3 mantissa bits: half a step is 2^-4 of a normal value; below 2^-6 the steps are 2^-9 of the scale; the
last factor covers the float32 division and product). `check_error` holds a re-quantization to it.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from reshard.errors import ReshardError

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size
BOUND = "|x - q*s| <= (2^-4 |x| + 2^-10 s)(1 + 2^-10)"  # what `check_error` holds, as said to a user
FORMATS = ("e4m3", "float8_e4m3fn")  # quantization_config.fmt as DeepSeek-V3 and MiniMax-M2 spell float8_e4m3fn


def block_size(config: Any) -> tuple[int, int]:
    """The [rows, columns] blocks of an HF `quantization_config`, refused in one line naming the field unless it
    is fp8 (e4m3) weights with per-block scales and dynamic activation scales (nothing to carry for them)."""
    if not isinstance(config, dict):
        raise _unsupported("quantization_config", config, "an object")
    method = config.get("quant_method")
    if method != "fp8":
        raise _unsupported("quantization_config.quant_method", method, '"fp8" (block-scaled float8, DeepSeek-V3\'s form)')
    if config.get("fmt", "e4m3") not in FORMATS:
        raise _unsupported("quantization_config.fmt", config["fmt"], '"e4m3" or "float8_e4m3fn" (float8_e4m3fn weights)')
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise _unsupported("quantization_config.activation_scheme", config["activation_scheme"], '"dynamic" (no stored activation scales)')
    block = config.get("weight_block_size")
    if not isinstance(block, list) or len(block) != 2 or not all(type(b) is int and b > 0 for b in block):
        raise _unsupported("quantization_config.weight_block_size", block, "two positive block sizes, e.g. [128, 128]")
    return block[0], block[1]


def hf_config(block: tuple[int, int], source: dict[str, Any] | None = None, quantized: tuple[str, ...] = ()) -> dict[str, Any]:
    """The `quantization_config` that says so, as DeepSeek-V3's config.json spells it, or as `source` (the model's own,
    checked by `block_size`) does: its `fmt`, and the modules it leaves unquantized (MiniMax-M2's), refused where one
    of those is part of a weight written quantized (`quantized`, HF names) rather than said wrong."""
    out = {"activation_scheme": "dynamic", "fmt": (source or {}).get("fmt", "e4m3"), "quant_method": "fp8", "weight_block_size": list(block)}
    kept = (source or {}).get("modules_to_not_convert")
    if kept is None:
        return out
    if not isinstance(kept, list) or not all(isinstance(module, str) and module for module in kept):
        raise _unsupported("quantization_config.modules_to_not_convert", kept, "a list of module names")
    if clash := next((f"{module} ({name})" for name in quantized for module in kept if f".{module}." in f".{name}."), None):
        raise ReshardError(f"HF config: quantization_config.modules_to_not_convert names {clash}, which fp8 block export "
                           "quantizes: its config would not say how it is stored; export without --to-fp8-blocks")
    return {**out, "modules_to_not_convert": list(kept)}


def _unsupported(field: str, value: Any, want: str) -> ReshardError:
    return ReshardError(f"HF config: {field}={value!r} is not supported; reshard reads {want}")


def scale_name(weight: str) -> str:
    """The name of a quantized weight's scales, as transformers derives it."""
    return weight + "_scale_inv"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a weight of `shape`: one scale per block, edge blocks partial."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


# Every float8 value in float32, by its bits: a lookup is exact and about 3x faster than numpy's cast from float8.
_VALUES = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)


def dequantize(
    q: np.ndarray, scale: np.ndarray, block: tuple[int, int], origin: tuple[int, int] = (0, 0), out: np.ndarray | None = None
) -> np.ndarray:
    """float32 values of the float8 weight values `q` that lie at `origin` of their weight, whose scale grid is
    `scale`: one float32 product each (into `out` if given), a block row at a time, so that no more than a block
    row of `q` in float32 is made besides `out`."""
    out = np.empty(q.shape, np.float32) if out is None else out
    columns = np.arange(origin[1], origin[1] + q.shape[1]) // block[1]
    with np.errstate(over="ignore"):  # a product past float32 is refused by name (`check_finite`), not warned about
        for rows in block_rows(q.shape[0], block, origin[0]):
            # indexing by the uint8 bits as they are (np.take would copy them as int64 first)
            np.multiply(_VALUES[q[rows].view(np.uint8)], scale[(origin[0] + rows.start) // block[0], columns], out=out[rows])
    return out


def check_scales(scale: np.ndarray, name: str) -> None:
    """Refuse a scale grid (named `name`) with a scale that is not finite and positive: multiplying a block by it
    would make its weights inf, NaN, zeros or of flipped sign (DeepSeek's recipe gives amax / 448, or 1)."""
    bad = ~(np.isfinite(scale) & (scale > 0))
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ReshardError(f"{name}[{row}, {col}] is {scale[row, col]}: a block's scale must be finite and positive; "
                           "the checkpoint is damaged")


def check_finite(values: np.ndarray, name: str, origin: tuple[int, int]) -> None:
    """Refuse dequantized values (those of weight `name` at `origin`) that are not finite: a float8 NaN, or a
    scale so large that a float8 value times it overflows float32."""
    if not np.isfinite(values).all():
        row, col = (int(i) for i in np.argwhere(~np.isfinite(values))[0])
        raise ReshardError(f"{name}[{origin[0] + row}, {origin[1] + col}] dequantizes to {values[row, col]} (a float8 NaN, "
                           "or a scale too large); the checkpoint is damaged")


def quantize(x: np.ndarray, block: tuple[int, int], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(float8 values, float32 scale grid) of weight `x` by DeepSeek's recipe (module docstring), one block row
    at a time; `name` is the tensor's, for the refusal of non-finite values, which float8 cannot hold."""
    q = np.empty(x.shape, FP8)
    scale = np.empty(scale_shape(x.shape, block), np.float32)
    columns = np.arange(x.shape[1]) // block[1]
    for i, rows in enumerate(block_rows(x.shape[0], block)):
        values = x[rows].astype(np.float32)
        amax = np.maximum.reduceat(np.abs(values).max(axis=0), np.arange(0, x.shape[1], block[1]))
        if not np.isfinite(amax).all():
            raise ReshardError(f"{name} holds non-finite values, which float8 cannot hold; it cannot be quantized")
        scale[i] = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1))
        values /= scale[i, columns]
        q[rows] = np.clip(values, -FP8_MAX, FP8_MAX, out=values).astype(FP8)
    return q, scale


def check_error(x: np.ndarray, q: np.ndarray, scale: np.ndarray, block: tuple[int, int], name: str) -> np.ndarray:
    """The float32 values the quantized weight holds, once each is within the bound of the module docstring
    of the value `x` it stands for (refused in one line naming the tensor otherwise)."""
    held = dequantize(q, scale, block)
    columns = np.arange(x.shape[1]) // block[1]
    for i, rows in enumerate(block_rows(x.shape[0], block)):
        exact = x[rows].astype(np.float32)
        bound = (np.abs(exact) * 2.0**-4 + scale[i, columns] * 2.0**-10) * (1 + 2.0**-10)
        excess = np.abs(exact.astype(np.float64) - held[rows]) > bound
        if excess.any():
            row, col = (int(i) for i in np.argwhere(excess)[0])
            raise ReshardError(f"{name}[{rows.start + row}, {col}]: float8 holds {held[rows][row, col]} for {exact[row, col]}, "
                               "beyond the re-quantization error bound; refusing the export")
    return held


def block_rows(rows: int, block: tuple[int, int], first: int = 0) -> list[slice]:
    """Slices of `rows` rows of a weight from its row `first` on, one per block row they touch."""
    cuts = [first, *range(first - first % block[0] + block[0], first + rows, block[0]), first + rows]
    return [slice(a - first, b - first) for a, b in zip(cuts, cuts[1:])]
