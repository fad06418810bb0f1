"""Element types by their torch names ("bfloat16"), as numpy dtypes.

Values move through a conversion as numpy arrays over reused buffers, so a conversion between formats
that torch does not have to decode (torch_dist, zarr, HF) never imports torch, whose import was a
fifth of a 3 GB conversion here and more on a GPU host (benchmarks/README.md, "Measurements behind defaults"). numpy has no
bfloat16 or float8 of its own; `ml_dtypes` (which tensorstore brings) gives them, with the same bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from reshard.errors import ReshardError

if TYPE_CHECKING:
    import torch

_NUMPY: dict[str, np.dtype] = {
    name: np.dtype(t)
    for name, t in {
        "float64": np.float64,
        "float32": np.float32,
        "float16": np.float16,
        "bfloat16": ml_dtypes.bfloat16,
        "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
        "float8_e5m2": ml_dtypes.float8_e5m2,
        "int64": np.int64,
        "int32": np.int32,
        "int16": np.int16,
        "int8": np.int8,
        "uint8": np.uint8,
        "uint16": np.uint16,
        "uint32": np.uint32,
        "uint64": np.uint64,
        "bool": np.bool_,
        "complex64": np.complex64,
        "complex128": np.complex128,
    }.items()
}
_NAMES = {dtype: name for name, dtype in _NUMPY.items()}
DTYPE_NAMES = frozenset(_NUMPY)
_UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of torch dtype `name` (with or without its "torch." prefix)."""
    dtype = _NUMPY.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise ReshardError(f"tensors of dtype {name} are not supported")
    return dtype


def dtype_name(dtype: np.dtype) -> str:
    """The torch name of a numpy dtype."""
    return _NAMES[np.dtype(dtype)]


def itemsize(name: str) -> int:
    return numpy_dtype(name).itemsize


def bits(a: np.ndarray) -> np.ndarray:
    """`a`'s memory as unsigned integers of its element size: copied, compared and hashed as bits, which
    numpy does for every dtype alike (and outside the GIL), where a float view would compare NaNs unequal."""
    return a.view(_UNSIGNED[a.dtype.itemsize])


def from_torch(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array (numpy cannot take a bfloat16 tensor itself)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bool:
        return t.numpy()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(as_int).numpy().view(numpy_dtype(str(t.dtype)))


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A numpy array's memory as a CPU tensor (for tests and Megatron-facing code)."""
    import torch

    if a.dtype == np.bool_:
        return torch.from_numpy(a)
    dtype = getattr(torch, dtype_name(a.dtype))
    return torch.from_numpy(np.ascontiguousarray(a).view({1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize])).view(dtype)
