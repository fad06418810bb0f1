"""The zarr store opens with plain zarr and tensorstore, and is chunked for TP/PP/EP reads."""

import json

import numpy as np
import tensorstore as ts
import torch
import zarr

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import SyntheticReader, write_synthetic
from reshard.formats.zarr_store import MAX_CHUNK_BYTES, chunk_shape, write_bands
from reshard.layout import Layout
from reshard.sharding import full_region


def _as_torch(values: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def test_plain_zarr_and_tensorstore_open_every_array(tmp_path, dtype):
    store = tmp_path / "model.zarr"
    write_synthetic(store, TINY_LLAMA, Layout(tp=2), "zarr", dtype=dtype)
    source = SyntheticReader(TINY_LLAMA, Layout(tp=2), dtype)
    group = zarr.open_group(str(store), mode="r")
    attrs = group.attrs["reshard"]
    assert attrs["config"]["num_layers"] == 4 and set(attrs["tensors"]) == set(source.specs)
    for name, spec in source.specs.items():
        expected = source.read(name, full_region(spec.shape))
        plain = group[name]
        assert plain.attrs["reshard_dtype"] == dtype
        assert torch.equal(_as_torch(plain[...], dtype), expected), name
        via_ts = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(store / name)}}).result()
        assert torch.equal(_as_torch(via_ts.read().result(), dtype), expected), name
    assert json.loads((store / "zarr.json").read_text())["attributes"]["reshard"]["manifest"]["checksums"]


def test_chunks_follow_partition_axes():
    specs = SyntheticReader(TINY_LLAMA).specs
    # one layer deep; the QKV rows cut in 8 (any TP up to 8 reads whole chunks)
    assert chunk_shape(specs["decoder.layers.self_attention.linear_qkv.weight"]) == [1, 16, 64]
    # gated fc1: 16 row chunks so each TP rank's gate and up halves are whole chunks
    assert chunk_shape(specs["decoder.layers.mlp.linear_fc1.weight"]) == [1, 16, 64]
    assert chunk_shape(specs["decoder.layers.self_attention.linear_proj.weight"]) == [1, 64, 8]
    assert chunk_shape(specs["decoder.final_layernorm.weight"]) == [64]


def test_write_bands_are_whole_chunks_of_bounded_size():
    rows, cols, chunk_rows = 128512, 2048, 16064  # a bf16 128k-vocabulary embedding
    bands = write_bands(((0, rows), (0, cols)), [chunk_rows, cols], 2)
    assert bands[0][0][0] == 0 and bands[-1][0][1] == rows
    assert all(a[0][1] == b[0][0] for a, b in zip(bands, bands[1:]))  # contiguous, in order
    assert all((b[0][1] - b[0][0]) % chunk_rows == 0 for b in bands[:-1])  # whole chunks
    assert all((b[0][1] - b[0][0]) * cols * 2 <= MAX_CHUNK_BYTES for b in bands)
    layer = ((3, 4), (0, 64), (0, 32))  # one layer of a stacked tensor: cut along its rows
    assert write_bands(layer, [1, 64, 32], 4) == [layer]
    assert write_bands(((0, 1),), [1], 4) == [((0, 1),)]
