"""fp8 block scaling's pure transforms against transformers' own dequantization and an independent torch recipe."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from reshard import fp8_blocks
from reshard.dtypes import from_torch, to_torch
from reshard.errors import ReshardError
from tests.arrays import same
from tests.fp8_models import dequantize, quantize  # the tests' own torch recipe


def random_fp8(shape, seed=0) -> np.ndarray:
    """Every finite float8_e4m3fn value may appear, subnormals and both zeros included."""
    raw = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0  # 0x7F and 0xFF are NaN
    return raw.view(fp8_blocks.FP8)


def random_scales(shape, seed=1) -> np.ndarray:
    return (np.random.default_rng(seed).random(shape, dtype=np.float32) * 1e-3 + 1e-6).astype(np.float32)


def test_dequantize_is_transformers_fp8_dequantize():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    values, scales = random_fp8((96, 64)), random_scales((3, 2))  # transformers wants whole blocks
    theirs = Fp8Dequantize(None)._dequantize_one(to_torch(values), torch.from_numpy(scales), output_dtype=torch.float32)
    ours = fp8_blocks.dequantize(values, scales, (32, 32))
    assert same(ours, theirs)
    in_bf16 = Fp8Dequantize(None)._dequantize_one(to_torch(values), torch.from_numpy(scales), output_dtype=torch.bfloat16)
    assert same(ours.astype(ml_dtypes.bfloat16), in_bf16)  # one rounding of the float32 product, as there


def test_dequantize_edge_blocks_and_any_origin():
    values, scales = random_fp8((100, 70)), random_scales((4, 2))
    expected = from_torch(dequantize(to_torch(values), torch.from_numpy(scales), (32, 48)))
    assert same(fp8_blocks.dequantize(values, scales, (32, 48)), expected)
    part = np.empty((40, 15), np.float32)
    fp8_blocks.dequantize(values[33:73, 50:65], scales, (32, 48), (33, 50), out=part)
    assert same(part, expected[33:73, 50:65])


def test_quantize_is_deepseeks_recipe():
    weight = np.random.default_rng(2).standard_normal((100, 70)).astype(ml_dtypes.bfloat16)
    weight[:32, :48] = 0  # an all-zero block keeps scale 1
    values, scales = fp8_blocks.quantize(weight, (32, 48), "w")
    their_values, their_scales = quantize(to_torch(weight), (32, 48))
    assert same(values, their_values) and same(scales, their_scales) and scales[0, 0] == 1
    held = fp8_blocks.check_error(weight, values, scales, (32, 48), "w")
    assert same(held, fp8_blocks.dequantize(values, scales, (32, 48)))
    error = np.abs(held - weight.astype(np.float32))
    assert error.max() > 0 and (error <= np.abs(weight.astype(np.float32)) / 16 + 1e-6).all()


def test_a_value_beyond_the_bound_is_refused_by_name():
    weight = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
    values, scales = fp8_blocks.quantize(weight, (32, 32), "w")
    values[5, 7] = -values[5, 7] if values[5, 7] != 0 else np.float32(1).astype(fp8_blocks.FP8)
    with pytest.raises(ReshardError, match=r"^layers\.0\.w\[5, 7\]: float8 holds"):
        fp8_blocks.check_error(weight, values, scales, (32, 32), "layers.0.w")
    weight[40, 3] = np.inf
    with pytest.raises(ReshardError, match="layers.0.w holds non-finite values"):
        fp8_blocks.quantize(weight, (32, 32), "layers.0.w")


GOOD = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("change,field", [
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ({"fmt": "e5m2"}, "fmt='e5m2'"),
    ({"activation_scheme": "static"}, "activation_scheme='static'"),
    ({"weight_block_size": None}, "weight_block_size=None"),
    ({"weight_block_size": [128, 0]}, r"weight_block_size=\[128, 0\]"),
])
def test_other_quantization_configs_are_refused_by_field(change, field):
    assert fp8_blocks.block_size(GOOD) == (128, 128)
    assert fp8_blocks.block_size({"quant_method": "fp8", "weight_block_size": [64, 32]}) == (64, 32)  # transformers' spelling
    with pytest.raises(ReshardError, match=f"^HF config: quantization_config.{field} is not supported"):
        fp8_blocks.block_size(GOOD | change)
