"""torch_dist output is checked with PyTorch's own DCP loader, not with our reader."""

import io
import struct
import zipfile

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from fixtures.models import TINY_LLAMA, TINY_MOE
from fixtures.synthetic import SyntheticReader, rewrite_args, write_synthetic
from reshard import direct_io
from reshard.convert import convert
from reshard.dtypes import numpy_dtype
from reshard.errors import ReshardError
from reshard.formats.megatron_dist import TorchDistReader
from reshard.layout import Layout
from reshard.request import Target
from reshard.sharding import full_region
from reshard.torchfile import dcp_metadata
from reshard.torchfile.dcp_metadata import Storage
from tests.arrays import same
from tests.cli import refused_by_every_command


def _dcp_load(directory, names_and_specs):
    state = {name: torch.empty(spec.shape, dtype=getattr(torch, spec.dtype)) for name, spec in names_and_specs}
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return state


@pytest.mark.parametrize("page_aligned", [False, True], ids=["small-records", "page-aligned"])
def test_pytorch_dcp_reads_what_we_write(tmp_path, dtype, page_aligned, monkeypatch):
    """Page-aligned archives (large records, written past the page cache) with gaps between them too."""
    if page_aligned:
        monkeypatch.setattr(direct_io, "DIRECT_FROM", 1)
    layout = Layout(tp=2, pp=2)
    write_synthetic(tmp_path / "ckpt", TINY_LLAMA, layout, "torch_dist", dtype=dtype, optimizer=True)
    source = SyntheticReader(TINY_LLAMA, layout, dtype, optimizer=True)
    directory = tmp_path / "ckpt" / "iter_0000010"
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    tensor_records = [
        info for index, info in metadata.storage_data.items() if hasattr(metadata.state_dict_metadata[index.fqn], "chunks")
    ]
    assert any(info.offset % direct_io.ALIGN for info in tensor_records) != page_aligned
    # where each record's tensor bytes start in the file, by the zip spec (local header: 30 bytes, then
    # the name and the extra field, whose lengths sit at bytes 26 and 28)
    data_offsets = []
    for info in tensor_records:
        blob = (directory / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        with zipfile.ZipFile(io.BytesIO(blob)) as zf:
            entry = next(e for e in zf.infolist() if "/data/" in e.filename)
        name_length, extra_length = struct.unpack_from("<HH", blob, entry.header_offset + 26)
        data_offsets.append(info.offset + entry.header_offset + 30 + name_length + extra_length)
    assert any(offset % direct_io.ALIGN for offset in data_offsets) != page_aligned
    loaded = _dcp_load(directory, source.specs.items())
    assert len(loaded) == len(source.specs) > 20
    for name, spec in source.specs.items():
        assert same(loaded[name], source.read(name, full_region(spec.shape))), name


def test_moe_keys_follow_the_spec_naming(tmp_path):
    write_synthetic(tmp_path / "ckpt", TINY_MOE, Layout(ep=2), "torch_dist")
    directory = tmp_path / "ckpt" / "iter_0000010"
    keys = set(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
    # The synthetic source says nothing of transformer_impl: Megatron-LM's default, Transformer Engine, applies.
    assert "decoder.layers.pre_mlp_layernorm.weight" in keys
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in keys
    assert any(k.startswith("decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_3.3_4.4") for k in keys)


def test_reader_reads_regions_across_chunks(tmp_path):
    write_synthetic(tmp_path / "ckpt", TINY_LLAMA, Layout(tp=2), "torch_dist")
    source = SyntheticReader(TINY_LLAMA, Layout(tp=2))
    reader = TorchDistReader(tmp_path / "ckpt")
    name = "decoder.layers.self_attention.linear_qkv.weight"
    region = ((1, 3), (40, 90), (3, 60))  # crosses the TP boundary at row 64
    assert same(reader.read(name, region), source.read(name, region))


def test_files_hold_each_byte_once(tmp_path):
    """torch.save of a slice saves its whole storage; the writer must store only the piece."""
    write_synthetic(tmp_path / "ckpt", TINY_LLAMA, Layout(tp=2, pp=2), "torch_dist", optimizer=True)
    source = SyntheticReader(TINY_LLAMA, optimizer=True)
    logical = sum(spec.numel * 4 for spec in source.specs.values())
    stored = sum(p.stat().st_size for p in (tmp_path / "ckpt" / "iter_0000010").glob("*.distcp"))
    assert logical <= stored < 1.1 * logical + 200_000  # plus a small record header per chunk


def test_prefetched_headers_are_parsed_once_and_read_the_same(tmp_path, monkeypatch):
    """Headers parsed ahead on the background threads are the ones the reads use: each chunk's once."""
    write_synthetic(tmp_path / "ckpt", TINY_MOE, Layout(tp=2, ep=2), "torch_dist")
    source = SyntheticReader(TINY_MOE, Layout(tp=2, ep=2))
    parsed = []
    real = TorchDistReader._parse
    monkeypatch.setattr(TorchDistReader, "_parse", lambda self, info: parsed.append((info.relative_path, info.offset)) or real(self, info))
    with TorchDistReader(tmp_path / "ckpt") as reader:
        for name, spec in reader.specs.items():
            reader.prefetch(name, full_region(spec.shape))
        for name, spec in reader.specs.items():
            out = np.empty(spec.shape, dtype=numpy_dtype(spec.dtype))
            reader.read_into(name, full_region(spec.shape), out)
            assert same(out, source.read(name, full_region(spec.shape))), name
        chunks = sum(len(reader.stored_records(name)) for name in reader.specs)
    assert len(parsed) == len(set(parsed)) == chunks


def test_objects_are_loaded_only_when_a_conversion_needs_them(tmp_path, monkeypatch):
    """Opening to plan, inspect or verify reads no ShardedObject; a damaged one is refused while planning,
    before anything is written."""
    write_synthetic(tmp_path / "ckpt", TINY_MOE, Layout(ep=2), "torch_dist")
    loads = []
    real = TorchDistReader._object
    monkeypatch.setattr(TorchDistReader, "_object", lambda self, info, key: loads.append(info) or real(self, info, key))
    with TorchDistReader(tmp_path / "ckpt") as reader:
        keys = list(reader.common.objects)
        assert keys and not loads
        assert reader.common.objects[keys[0]] is reader.common.objects[keys[0]] and len(loads) == 1  # loaded once

    def damaged(self, info, key):
        raise ReshardError(f"{info.relative_path}: a ShardedObject is not encoded as Megatron encodes them")

    monkeypatch.setattr(TorchDistReader, "_object", damaged)
    with pytest.raises(ReshardError, match="not encoded as Megatron"):
        convert(tmp_path / "ckpt", tmp_path / "out", Target(layout=Layout(ep=1)))
    assert not (tmp_path / "out").exists()



@pytest.mark.parametrize("named", ["../outside/__0_0.distcp", "/ABSOLUTE/__0_0.distcp", "link.distcp"])
def test_a_storage_file_outside_the_checkpoint_is_refused(tmp_path, named):
    """.metadata names the files its chunks lie in: one that leads outside the checkpoint (by `..`, an absolute
    path or a symlink) is refused in one line before anything is read or written, the source unchanged."""
    from tests.reshard.test_cli import _digest, _one_line_error, reshard

    source = tmp_path / "src"
    write_synthetic(source, TINY_LLAMA, Layout(), "torch_dist")
    directory = next(p for p in source.iterdir() if p.is_dir())
    outside = tmp_path / "outside"
    outside.mkdir()
    real = sorted(directory.glob("*.distcp"))[0]
    (outside / "__0_0.distcp").write_bytes(real.read_bytes())
    named = named.replace("/ABSOLUTE", str(outside))
    if named == "link.distcp":
        (directory / named).symlink_to(outside / "__0_0.distcp")
    metadata = dcp_metadata.load(directory / ".metadata")
    metadata.storage = {key: Storage(named if info.relative_path == real.name else info.relative_path, info.offset, info.length)
                        for key, info in metadata.storage.items()}
    dcp_metadata.save(directory / ".metadata", metadata)
    before = _digest(source)
    result = reshard("convert", source, tmp_path / "out", "--to-format", "zarr")
    _one_line_error(result, "outside the checkpoint")
    assert not (tmp_path / "out").exists() and _digest(source) == before


def test_a_chunk_no_file_holds_is_refused_naming_the_tensor(tmp_path):
    """.metadata lists a chunk of a model tensor whose storage record is gone (a rank's file lost): one line naming
    the tensor and the chunk, before anything is written."""
    from tests.reshard.test_cli import _digest, _one_line_error, reshard

    source = tmp_path / "src"
    write_synthetic(source, TINY_LLAMA, Layout(tp=2), "torch_dist")
    directory = next(p for p in source.iterdir() if p.is_dir())
    metadata = dcp_metadata.load(directory / ".metadata")
    lost = next(key for key in metadata.storage if key[0].endswith("linear_qkv.weight"))  # (name, chunk offsets)
    metadata.storage = {key: info for key, info in metadata.storage.items() if key != lost}
    dcp_metadata.save(directory / ".metadata", metadata)
    before = _digest(source)
    result = reshard("convert", source, tmp_path / "out", "--to-format", "zarr")
    _one_line_error(result, lost[0], "that no file holds")
    assert not (tmp_path / "out").exists() and _digest(source) == before


@pytest.mark.parametrize("config, saved, args, words", [
    (TINY_LLAMA, Layout(tp=2), dict(tensor_model_parallel_size=4), "tensor_model_parallel_size=4, but its files hold "
     "embedding.word_embeddings.weight in 2 tensor-parallel parts"),
    (TINY_LLAMA, Layout(tp=2), dict(tensor_model_parallel_size=1), "tensor_model_parallel_size=1, but its files hold "
     "embedding.word_embeddings.weight in 2"),
    (TINY_LLAMA, Layout(tp=1), dict(tensor_model_parallel_size=2), "tensor_model_parallel_size=2, but its files hold "
     "embedding.word_embeddings.weight in 1"),
    (TINY_MOE, Layout(tp=2), dict(expert_tensor_parallel_size=1), "expert_tensor_parallel_size=1, but its files hold "
     "decoder.layers.mlp.experts.experts.linear_fc1.weight in 2"),
    (TINY_MOE, Layout(tp=2, etp=1), dict(expert_tensor_parallel_size=2), "expert_tensor_parallel_size=2, but its files hold "
     "decoder.layers.mlp.experts.experts.linear_fc1.weight in 1"),
], ids=lambda v: str(v)[:30] if isinstance(v, dict) else None)
def test_args_that_contradict_the_chunks_are_refused_by_name(tmp_path, monkeypatch, capsys, config, saved, args, words):
    """The files say the layout: a TP2 checkpoint whose args say TP4 was shown and verified as TP4, then refused
    with a message on query groups. Refused naming the arg by inspect, verify and convert alike, left as it was."""
    source = tmp_path / "src"
    write_synthetic(source, config, saved, "torch_dist")
    rewrite_args(source, **args)
    refused_by_every_command(monkeypatch, capsys, source, tmp_path / "out", words, "the args do not describe these files")


def _drop_objects(iter_dir, dropped: str) -> int:
    """What Megatron-LM 0.18's --ckpt-drop-redundant-extra-state saves: the `_extra_state` objects matching
    `dropped` left out of the checkpoint (their .metadata entries removed; the bytes may stay). How many went."""
    metadata = dcp_metadata.load(iter_dir / ".metadata")
    gone = [key for key in metadata.storage if key[1] is None and dropped in key[0]]
    for key in gone:
        del metadata.storage[key]
    metadata.objects = [key for key in metadata.objects if dropped not in key]
    dcp_metadata.save(iter_dir / ".metadata", metadata)
    return len(gone)


@pytest.mark.slow  # launches Megatron-Core to load what it converts
@pytest.mark.parametrize("to", [["--to-tp", 1], ["--to-format", "legacy"], []], ids=["tp2->tp1", "legacy", "same-layout"])
def test_a_source_saved_without_redundant_extra_state_gives_megatron_core_every_one(tmp_path, monkeypatch, capsys, to):
    """Megatron-LM 0.18+ (`--ckpt-drop-redundant-extra-state`) may save only some `_extra_state` objects (those of
    delayed FP8 scaling); a run loading without the flag asks for every one. The copy holds each module's, the
    source's own where it has one, an empty one where not: megatron-core's own load of all of them succeeds."""
    from tests.cli import run_cli
    from tests.launch import run

    write_synthetic(tmp_path / "src", TINY_LLAMA, Layout(tp=2), "torch_dist", dtype="float32")
    assert _drop_objects(tmp_path / "src" / "iter_0000010", "mlp.linear_fc1._extra_state") > 0
    assert run_cli(monkeypatch, capsys, "convert", tmp_path / "src", tmp_path / "dst", *to, "-q")[0] == 0
    if to == ["--to-format", "legacy"]:  # what Megatron-LM's strict load_state_dict asks of each rank file
        model = torch.load(tmp_path / "dst" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["model"]
        for layer in range(TINY_LLAMA.num_layers):
            assert model[f"decoder.layers.{layer}.mlp.linear_fc1._extra_state"] is None
        return
    run("fixtures.megatron_load_all", ["--load", tmp_path / "dst", "--out", tmp_path / "loaded.pt"], nproc=1)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    assert len(loaded["objects"]) == 4 * TINY_LLAMA.num_layers and set(loaded["objects"].values()) == {None}
