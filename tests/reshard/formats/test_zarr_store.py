"""The zarr store opens with plain zarr and tensorstore, is chunked for TP/PP/EP reads, and is sharded
into a file per tensor and layer."""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr

from fixtures.models import TINY_LLAMA, TINY_MOE
from fixtures.synthetic import SyntheticReader, write_synthetic
from reshard.convert import convert
from reshard.dtypes import itemsize
from reshard.formats.zarr_store import ZarrReader, chunk_shape, shard_shape
from reshard.layout import Layout
from reshard.request import Run, Target
from reshard.sharding import full_region
from tests.arrays import same, tensors
from tests.cli import tree_digest

MANY_EXPERTS = TINY_MOE.replace(num_experts=16)


def _as_torch(values: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def _sharded(array: Path) -> bool:
    return json.loads((array / "zarr.json").read_text())["codecs"][0]["name"] == "sharding_indexed"


@pytest.mark.parametrize("config", [TINY_LLAMA, MANY_EXPERTS], ids=["dense", "moe"])
def test_plain_zarr_and_tensorstore_open_every_array(tmp_path, dtype, config):
    store = tmp_path / "model.zarr"
    write_synthetic(store, config, Layout(tp=2), "zarr", dtype=dtype)
    source = SyntheticReader(config, Layout(tp=2), dtype)
    group = zarr.open_group(str(store), mode="r")
    attrs = group.attrs["reshard"]
    assert attrs["config"]["num_layers"] == 4 and set(attrs["tensors"]) == set(source.specs)
    assert any(_sharded(store / name) for name in source.specs) and not all(_sharded(store / name) for name in source.specs)
    for name, spec in source.specs.items():
        expected = source.read(name, full_region(spec.shape))
        plain = group[name]
        assert plain.attrs["reshard_dtype"] == dtype
        assert same(_as_torch(plain[...], spec.dtype), expected), name
        via_ts = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(store / name)}}).result()
        assert same(_as_torch(via_ts.read().result(), spec.dtype), expected), name
    assert json.loads((store / "zarr.json").read_text())["attributes"]["reshard"]["manifest"]["checksums"]


def test_chunks_follow_partition_axes():
    specs = SyntheticReader(TINY_LLAMA).specs
    # one layer deep; the QKV rows cut in 8 (any TP up to 8 reads whole chunks)
    assert chunk_shape(specs["decoder.layers.self_attention.linear_qkv.weight"]) == [1, 16, 64]
    # gated fc1: 16 row chunks so each TP rank's gate and up halves are whole chunks
    assert chunk_shape(specs["decoder.layers.mlp.linear_fc1.weight"]) == [1, 16, 64]
    assert chunk_shape(specs["decoder.layers.self_attention.linear_proj.weight"]) == [1, 64, 8]
    assert chunk_shape(specs["decoder.final_layernorm.weight"]) == [64]


def test_chunk_files_and_shards_are_byte_for_byte_those_tensorstore_writes(tmp_path):
    """Chunks are written by our threads, not through tensorstore: each chunk file and each shard (its
    chunks and index) must be the file tensorstore itself writes for the same values (it skips chunks
    equal to the fill value, so only those it wrote count)."""
    store = tmp_path / "model.zarr"
    write_synthetic(store, TINY_LLAMA, Layout(tp=2), "zarr")
    group = zarr.open_group(str(store), mode="r")
    names = list(group.attrs["reshard"]["tensors"])
    compared, shards = 0, 0
    for name in names:
        meta = json.loads((store / name / "zarr.json").read_text())
        theirs = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "ts" / name)}, "create": True,
                          "metadata": {k: meta[k] for k in ("shape", "data_type", "chunk_grid", "codecs", "chunk_key_encoding")}}).result()
        theirs.write(group[name][...]).result()  # the values as plain zarr reads them
        for chunk in (tmp_path / "ts" / name / "c").rglob("*"):
            if chunk.is_file():
                assert chunk.read_bytes() == (store / name / chunk.relative_to(tmp_path / "ts" / name)).read_bytes(), (name, chunk)
                compared += 1
                shards += _sharded(store / name)
    assert compared > len(names) and shards


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


def _files(array: Path) -> int:
    """The files holding an array's values (chunk files or shards)."""
    return sum(1 for p in array.rglob("*") if p.is_file() and p.name != "zarr.json")


def _chunks(spec) -> int:
    """Chunk files the layout before sharding had: one per chunk of the grid."""
    return math.prod(-(-d // c) for d, c in zip(spec.shape or (1,), chunk_shape(spec)))


def test_a_moe_store_is_a_file_per_tensor_and_layer(tmp_path):
    """16 experts, 4 layers, Adam state: every array holds one file per layer (one, unstacked), where a
    file per chunk made an expert array's layer 16 experts x its TP chunks."""
    store = tmp_path / "model.zarr"
    write_synthetic(store, MANY_EXPERTS, Layout(ep=4), "zarr", optimizer=True)
    specs = SyntheticReader(MANY_EXPERTS, optimizer=True).specs
    for name, spec in specs.items():
        assert _files(store / name) == (spec.shape[0] if spec.stacked else 1), name
        if spec.experts:
            assert _chunks(spec) >= MANY_EXPERTS.num_experts * _files(store / name), name
    files, before = sum(_files(store / n) for n in specs), sum(map(_chunks, specs.values()))
    assert files * 10 < before


def test_a_deepseek_v3_sized_store_stays_in_the_thousands_of_files():
    """256 experts in 61 layers at DeepSeek-V3's widths, bf16 with fp32 Adam state (counted, not written):
    a layer's expert array is cut into shards of at most MAX_SHARD_BYTES, and the files stay in the
    thousands where a file per chunk made over a million."""
    from reshard.formats.zarr_store import MAX_SHARD_BYTES

    v3 = TINY_MOE.replace(num_layers=61, hidden_size=7168, num_attention_heads=128, num_query_groups=128, kv_channels=128,
                          ffn_hidden_size=18432, num_experts=256, moe_ffn_hidden_size=2048, vocab_size=129280)
    specs = SyntheticReader(v3, dtype="bfloat16", optimizer=True).specs
    shards = {name: math.prod(-(-d // s) for d, s in zip(spec.shape or (1,), shard_shape(spec))) for name, spec in specs.items()}
    for name, spec in specs.items():
        assert math.prod(shard_shape(spec)) * itemsize(spec.dtype) <= MAX_SHARD_BYTES, name
    assert sum(shards.values()) < 10_000 and sum(map(_chunks, specs.values())) > 1_000_000


def _cut_experts(monkeypatch) -> int:
    """Shards small enough that a layer's experts are cut into blocks (as DeepSeek-V3's are at full size):
    four of the synthetic model's fc1 experts, in float32."""
    import reshard.formats.zarr_store as zarr_store

    fc1 = SyntheticReader(MANY_EXPERTS, optimizer=True).specs["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    limit = 4 * math.prod(fc1.shape[2:]) * 4
    monkeypatch.setattr(zarr_store, "MAX_SHARD_BYTES", limit)
    return limit


@pytest.mark.parametrize("cut", [False, True], ids=["layer-shards", "expert-blocks"])
def test_a_checkpoint_round_trips_bit_identically_through_the_sharded_store(tmp_path, monkeypatch, cut):
    """torch_dist TP2 EP4 -> zarr -> torch_dist TP1 EP2, optimizer state included, with several threads
    writing chunks into the same shards; plain zarr reads every shard as the source's values."""
    limit = _cut_experts(monkeypatch) if cut else None
    write_synthetic(tmp_path / "src", MANY_EXPERTS, Layout(tp=2, ep=4), "torch_dist", optimizer=True)
    store = tmp_path / "model.zarr"
    convert(tmp_path / "src", store, Target(format="zarr"), run=Run(workers=4))
    fc1 = store / "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert _sharded(fc1) and _files(fc1) == MANY_EXPERTS.num_layers * (MANY_EXPERTS.num_experts // 4 if cut else 1)
    if limit is not None:
        index = 16 * 4 * 16  # four experts of sixteen chunks, an (offset, length) entry each
        assert all(p.stat().st_size <= limit + index for p in fc1.rglob("*") if p.is_file() and p.name != "zarr.json")
    convert(store, tmp_path / "dst", Target(format="torch_dist", layout=Layout(tp=1, ep=2)), run=Run(workers=4))
    source = SyntheticReader(MANY_EXPERTS, optimizer=True)
    final = tensors(tmp_path / "dst")
    group = zarr.open_group(str(store), mode="r")
    assert set(final) == set(source.specs)
    for name, spec in source.specs.items():
        expected = source.read(name, full_region(spec.shape))
        assert same(final[name], expected), name
        assert same(_as_torch(group[name][...], spec.dtype), expected), name


def test_a_store_written_before_sharding_still_reads_and_converts(tmp_path):
    """Arrays with a file per chunk, as reshard wrote them before sharding (rewritten here by tensorstore
    itself, inner chunks as the shards' own): read by pread, vouched for, and converted."""
    store = tmp_path / "model.zarr"
    write_synthetic(store, TINY_MOE, Layout(ep=2), "zarr", optimizer=True)
    for array in [p.parent for p in store.glob("*/zarr.json")]:
        meta = json.loads((array / "zarr.json").read_text())
        if not _sharded(array):
            continue
        values = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(array)}}).result().read().result()
        chunks = meta["codecs"][0]["configuration"]["chunk_shape"]
        plain = {k: meta[k] for k in ("shape", "data_type", "attributes")} | {
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}}, "codecs": [{"name": "bytes"}]}
        ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(array)}, "create": True, "delete_existing": True,
                 "metadata": plain}).result().write(values).result()
        assert not _sharded(array) and _files(array) == _chunks(SyntheticReader(TINY_MOE, optimizer=True).specs[array.name])
    with ZarrReader(store) as reader:
        assert all(reader.stored_records(name) is not None for name in reader.specs)  # the pread path, not tensorstore
    convert(store, tmp_path / "dst", Target(format="torch_dist", layout=Layout(tp=2)))
    source = SyntheticReader(TINY_MOE, optimizer=True)
    final = tensors(tmp_path / "dst")
    assert all(same(final[name], source.read(name, full_region(spec.shape))) for name, spec in source.specs.items())



def test_a_shard_whose_index_does_not_match_is_read_back_and_refused(tmp_path):
    """A chunk its shard's index gives another length is not vouched for (offset -1) and reading it is
    refused as damage, as is a shard cut shorter than its index; the shard's other chunks are found."""
    from reshard.errors import ReshardError

    store = tmp_path / "model.zarr"
    write_synthetic(store, TINY_LLAMA, Layout(), "zarr")
    name = "decoder.layers.self_attention.linear_qkv.weight"
    meta = json.loads((store / name / "zarr.json").read_text())
    inner = meta["codecs"][0]["configuration"]["chunk_shape"]
    chunks = math.prod(s // c for s, c in zip(meta["chunk_grid"]["configuration"]["chunk_shape"], inner))
    with open(store / name / "c" / "0" / "0" / "0", "r+b") as f:  # layer 0's shard: its first chunk's length
        f.seek(-16 * chunks + 8, os.SEEK_END)
        length = int(np.frombuffer(f.read(8), "<u8")[0])
        f.seek(-8, os.SEEK_CUR)
        f.write(np.array([length - 4], "<u8").tobytes())
    with ZarrReader(store) as reader:
        offsets = [r.offset for r in reader.stored_records(name) if r.file == f"{name}/c/0/0/0"]
        assert len(offsets) == chunks and offsets[0] == -1 and min(offsets[1:]) >= 0
        with pytest.raises(ReshardError, match="not stored whole"):
            reader.read(name, ((0, 1), *full_region(tuple(meta["shape"][1:]))))
    os.truncate(store / name / "c" / "1" / "0" / "0", 8)
    with ZarrReader(store) as reader, pytest.raises(ReshardError, match="shorter than its shard index"):
        reader.stored_records(name)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_an_array_leading_out_of_the_store_is_refused(tmp_path, how):
    """zarr.json names the tensors, and each name is its array's directory: a name with `..`, an absolute one or an
    array directory linked elsewhere would read another store's files. Refused in one line; nothing written."""
    from reshard.errors import ReshardError

    store, other = tmp_path / "store", tmp_path / "other"
    write_synthetic(store, TINY_LLAMA, Layout(), "zarr")
    write_synthetic(other, TINY_LLAMA, Layout(), "zarr", seed=1)
    meta = json.loads((store / "zarr.json").read_text())
    tensors = meta["attributes"]["reshard"]["tensors"]
    name = "decoder.final_layernorm.weight"
    if how == "symlink":
        os.rename(store / name, tmp_path / "moved")
        (store / name).symlink_to(other / name)
    else:
        named = f"../other/{name}" if how == "dotdot" else str(other / name)
        tensors[named] = tensors.pop(name)
        (store / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(ReshardError, match="outside the checkpoint"):
        convert(store, tmp_path / "out", Target(format="torch_dist"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("reads", ["pread", "tensorstore"])
def test_a_chunk_file_linked_out_of_the_store_is_refused(tmp_path, monkeypatch, reads):
    """A shard (or chunk) file that is a symlink to another store's: tensorstore, and our pread, would read the
    other store's values and the conversion would vouch for them. Refused when the store opens; without the
    check the other store's weights do come through (the attack). The store is left as it was."""
    from reshard.errors import ReshardError

    store, other = tmp_path / "store", tmp_path / "other"
    write_synthetic(store, TINY_LLAMA, Layout(), "zarr")
    write_synthetic(other, TINY_LLAMA, Layout(), "zarr", seed=1)
    name = "decoder.layers.self_attention.linear_qkv.weight"
    shard = store / name / "c" / "0" / "0" / "0"
    shard.unlink()
    shard.symlink_to(other / name / "c" / "0" / "0" / "0")
    if reads == "tensorstore":
        monkeypatch.setattr(ZarrReader, "_plain", lambda self, name: None)
    before = tree_digest(store)
    with pytest.raises(ReshardError, match=rf"{name}/c/0/0/0 leads outside the checkpoint"):
        convert(store, tmp_path / "out", Target(format="torch_dist"))
    assert not (tmp_path / "out").exists() and tree_digest(store) == before

    monkeypatch.setattr("reshard.formats.zarr_store.confined_tree", lambda path: None)  # the defence off
    with ZarrReader(store) as reader, ZarrReader(other) as theirs:
        layer0 = ((0, 1), *full_region(reader.specs[name].shape[1:]))
        assert same(reader.read(name, layer0), theirs.read(name, layer0))


def test_a_chunk_file_linked_inside_the_store_is_read(tmp_path):
    """Links that stay in the store (a shard kept once and linked, as a deduplicating copy does) are fine."""
    store = tmp_path / "store"
    write_synthetic(store, TINY_LLAMA, Layout(), "zarr")
    name = "decoder.layers.self_attention.linear_qkv.weight"
    shard = store / name / "c" / "0" / "0" / "0"
    (store / "blobs").mkdir()
    os.rename(shard, store / "blobs" / "shard")
    shard.symlink_to(Path("../../../../blobs/shard"))
    (store / name / "c" / "1").rename(store / "blobs" / "layer1")
    (store / name / "c" / "1").symlink_to(store / "blobs" / "layer1", target_is_directory=True)
    convert(store, tmp_path / "out", Target(format="torch_dist", layout=Layout(tp=2)))
    source = SyntheticReader(TINY_LLAMA)
    final = tensors(tmp_path / "out")
    assert all(same(final[n], source.read(n, full_region(spec.shape))) for n, spec in source.specs.items())


QKV = "decoder.layers.self_attention.linear_qkv.weight"  # sharded: a layer's chunks in one file
NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"  # a file per chunk


def _mark_empty(store: Path) -> str:
    """Layer 1's shard of QKV: its second chunk's index entry set to (MISSING, MISSING), zarr's 'not stored'."""
    meta = json.loads((store / QKV / "zarr.json").read_text())
    inner = meta["codecs"][0]["configuration"]["chunk_shape"]
    chunks = math.prod(s // c for s, c in zip(meta["chunk_grid"]["configuration"]["chunk_shape"], inner))
    with open(store / QKV / "c" / "1" / "0" / "0", "r+b") as f:
        f.seek(-16 * chunks + 16, os.SEEK_END)
        f.write(np.array([2**64 - 1, 2**64 - 1], "<u8").tobytes())
    return "its shard's index marks it empty"


@pytest.mark.parametrize("damage", [
    _mark_empty,
    lambda store: (store / QKV / "c" / "2" / "0" / "0").unlink() or "its shard's index marks it empty",  # a whole shard
    lambda store: (store / NORM / "c" / "3" / "0").unlink() or "no file holds it",
], ids=["index-entry-empty", "shard-file-gone", "chunk-file-gone"])
@pytest.mark.parametrize("reads", ["pread", "tensorstore"])
def test_a_chunk_the_metadata_promises_and_the_store_lacks_is_damage(tmp_path, monkeypatch, capsys, damage, reads):
    """zarr reads a chunk not stored as the fill value, and without checksums the zeros went through as the
    weights. reshard writes every chunk: one missing is refused as damage in one line, the store left as it was;
    plain zarr (the oracle of what the store says) reads that chunk as zeros indeed."""
    from tests.cli import refused_cli

    store = tmp_path / "store"
    write_synthetic(store, TINY_LLAMA, Layout(), "zarr")
    meta = json.loads((store / "zarr.json").read_text())
    del meta["attributes"]["reshard"]["manifest"]  # no checksums to find the zeros by
    (store / "zarr.json").write_text(json.dumps(meta))
    how = damage(store)
    name = QKV if "shard" in how else NORM
    assert not zarr.open_group(str(store), mode="r")[name][...].all()  # zeros where the chunk is missing
    if reads == "tensorstore":
        monkeypatch.setattr(ZarrReader, "_plain", lambda self, name: None)
        how = "no file holds it"
    refused_cli(monkeypatch, capsys, ["convert", store, tmp_path / "out", "--to-format", "torch_dist", "-q"],
                f"{name} chunk", f"is not stored ({how}), though zarr.json promises it; the store is damaged", untouched=(store,))
    assert not (tmp_path / "out").exists()
