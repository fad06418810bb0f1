"""The zarr store opens with plain zarr and tensorstore, and is chunked for TP/PP/EP reads."""

import json

import numpy as np
import tensorstore as ts
import torch
import zarr

from fixtures.models import TINY_LLAMA, TINY_MOE
from fixtures.synthetic import SyntheticReader, write_synthetic
from reshard.convert import convert
from reshard.formats.zarr_store import chunk_shape
from reshard.layout import Layout
from reshard.request import Target
from reshard.sharding import full_region
from tests.arrays import same


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
        assert same(_as_torch(plain[...], dtype), expected), name
        via_ts = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(store / name)}}).result()
        assert same(_as_torch(via_ts.read().result(), dtype), expected), name
    assert json.loads((store / "zarr.json").read_text())["attributes"]["reshard"]["manifest"]["checksums"]


def test_chunks_follow_partition_axes():
    specs = SyntheticReader(TINY_LLAMA).specs
    # one layer deep; the QKV rows cut in 8 (any TP up to 8 reads whole chunks)
    assert chunk_shape(specs["decoder.layers.self_attention.linear_qkv.weight"]) == [1, 16, 64]
    # gated fc1: 16 row chunks so each TP rank's gate and up halves are whole chunks
    assert chunk_shape(specs["decoder.layers.mlp.linear_fc1.weight"]) == [1, 16, 64]
    assert chunk_shape(specs["decoder.layers.self_attention.linear_proj.weight"]) == [1, 64, 8]
    assert chunk_shape(specs["decoder.final_layernorm.weight"]) == [64]


def test_chunk_files_are_byte_for_byte_those_tensorstore_writes(tmp_path):
    """Chunks are written by our threads, not through tensorstore: each must be the file tensorstore itself
    writes for the same values (it skips chunks equal to the fill value, so only those it wrote count)."""
    store = tmp_path / "model.zarr"
    write_synthetic(store, TINY_LLAMA, Layout(tp=2), "zarr")
    group = zarr.open_group(str(store), mode="r")
    names = list(group.attrs["reshard"]["tensors"])
    compared = 0
    for name in names:
        meta = json.loads((store / name / "zarr.json").read_text())
        theirs = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "ts" / name)}, "create": True,
                          "metadata": {k: meta[k] for k in ("shape", "data_type", "chunk_grid", "codecs", "chunk_key_encoding")}}).result()
        theirs.write(group[name][...]).result()  # the values as plain zarr reads them
        for chunk in (tmp_path / "ts" / name / "c").rglob("*"):
            if chunk.is_file():
                assert chunk.read_bytes() == (store / name / chunk.relative_to(tmp_path / "ts" / name)).read_bytes(), (name, chunk)
                compared += 1
    assert compared > len(names)


def test_chunks_reaching_past_the_array_hold_the_fill_value(tmp_path, monkeypatch):
    """Chunk shapes that do not divide the array: edge chunks are staged (their clipped parts read back by
    the conversion's verification), and plain zarr reads every value."""
    import reshard.formats.zarr_store as zarr_store

    monkeypatch.setattr(zarr_store, "chunk_shape", lambda spec: [1] * spec.prefix_axes + [5] * (len(spec.shape) - spec.prefix_axes) or [1])
    write_synthetic(tmp_path / "src", TINY_LLAMA, Layout(), "torch_dist")
    store = tmp_path / "model.zarr"
    convert(tmp_path / "src", store, Target(format="zarr"))
    source = SyntheticReader(TINY_LLAMA)
    group = zarr.open_group(str(store), mode="r")
    for name, spec in source.specs.items():
        assert same(_as_torch(group[name][...], spec.dtype), source.read(name, full_region(spec.shape))), name


def test_a_tensor_is_logged_only_once_its_files_are_durable(tmp_path, monkeypatch):
    """The work log vouches for a tensor only after every file of its array was fsynced (and the folders
    naming them): a crashed node must not leave a logged tensor without its chunks."""
    import os

    from reshard.worklog import WorkLog

    synced, at_record = set(), {}
    real_fsync, real_record = os.fsync, WorkLog.record

    def fsync(fd):
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def record(self, done, state):
        at_record[done.name] = set(synced)
        real_record(self, done, state)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(WorkLog, "record", record)
    write_synthetic(tmp_path / "src", TINY_MOE, Layout(ep=2), "torch_dist")
    convert(tmp_path / "src", tmp_path / "out", Target(format="zarr"))
    out, partial = str(tmp_path / "out"), str(tmp_path / ".out.reshard-partial")
    assert at_record
    for name, seen in at_record.items():
        files = [str(p).replace(out, partial) for p in (tmp_path / "out" / name).rglob("*") if p.is_file()]
        assert files and all(f in seen for f in files), name
