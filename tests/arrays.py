"""Values as the tests compare them: bit for bit, whether a reader gave them (numpy) or torch did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from reshard.dtypes import bits, dtype_name, from_torch, to_torch
from reshard.formats import open_checkpoint
from reshard.sharding import full_region


def as_numpy(values: Any) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else from_torch(values)


def same(a: Any, b: Any) -> bool:
    """Equal shapes, dtypes and bits (a NaN equals itself; -0.0 does not equal 0.0)."""
    a, b = as_numpy(a), as_numpy(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


def dtype_of(values: Any) -> str:
    """The torch name of a tensor's or array's dtype."""
    return dtype_name(as_numpy(values).dtype)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every logical tensor of the checkpoint at `path`, as torch tensors (torch is the tests' oracle)."""
    with open_checkpoint(path) as reader:
        return {name: to_torch(reader.read(name, full_region(spec.shape))) for name, spec in reader.specs.items()}
