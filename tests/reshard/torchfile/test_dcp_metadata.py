"""Our `.metadata` reader against PyTorch's own (`FileSystemReader.read_metadata`) on Megatron-saved
checkpoints, and our writer read back by PyTorch."""

import subprocess
import sys

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from reshard.torchfile import dcp_metadata


def _same_as_pytorch(directory):
    ours = dcp_metadata.load(directory / ".metadata")
    theirs = FileSystemReader(str(directory)).read_metadata()
    objects = sorted(k for k, v in theirs.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    assert sorted(ours.objects) == objects and objects
    tensors = {k: v for k, v in theirs.state_dict_metadata.items() if not isinstance(v, BytesStorageMetadata)}
    assert set(ours.tensors) == set(tensors)
    for fqn, md in tensors.items():
        entry = ours.tensors[fqn]
        assert entry.dtype == str(md.properties.dtype).removeprefix("torch.") and entry.size == tuple(md.size)
        assert [(c.offsets, c.sizes) for c in entry.chunks] == [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    assert len(ours.storage) == len(theirs.storage_data)
    for index, info in theirs.storage_data.items():
        storage = ours.storage[(index.fqn, None if index.offset is None else tuple(index.offset))]
        assert (storage.relative_path, storage.offset, storage.length) == (info.relative_path, info.offset, info.length)


@pytest.mark.slow  # reads checkpoints made by Megatron-Core (dense, moe)
def test_reads_megatron_metadata_as_pytorch_does(dense, moe):
    for path in (dense["base"], moe["ep2"]):
        _same_as_pytorch(next(path.glob("iter_*")))


@pytest.mark.slow  # reads checkpoints made by Megatron-Core (dense, moe)
def test_pytorch_reads_what_save_writes(dense, tmp_path):
    directory = next(dense["base"].glob("iter_*"))
    (tmp_path / "copy").mkdir()
    dcp_metadata.save(tmp_path / "copy" / ".metadata", dcp_metadata.load(directory / ".metadata"))
    theirs = FileSystemReader(str(tmp_path / "copy")).read_metadata()
    original = FileSystemReader(str(directory)).read_metadata()
    assert set(theirs.state_dict_metadata) == set(original.state_dict_metadata)
    assert {(i.fqn, i.offset): (s.relative_path, s.offset, s.length) for i, s in theirs.storage_data.items()} == {
        (i.fqn, i.offset): (s.relative_path, s.offset, s.length) for i, s in original.storage_data.items()
    }
    assert theirs.storage_data.keys() == original.storage_data.keys()  # MetadataIndex, offsets as torch.Size
    assert theirs.state_dict_metadata == original.state_dict_metadata  # DCP's dataclasses, compared whole
    for fqn, md in original.state_dict_metadata.items():
        assert type(theirs.state_dict_metadata[fqn]) is type(md)
        if not isinstance(md, BytesStorageMetadata):
            assert theirs.state_dict_metadata[fqn].size == md.size and theirs.state_dict_metadata[fqn].chunks == md.chunks
            assert theirs.state_dict_metadata[fqn].properties == md.properties


@pytest.mark.slow  # reads checkpoints made by Megatron-Core (dense, moe)
def test_save_needs_no_import_of_torch(dense, tmp_path):
    """Importing DCP took a second of every conversion's end, importing torch more; `load` and `save`
    name their classes instead."""
    script = (
        "import sys; from pathlib import Path; from reshard.torchfile import dcp_metadata as m; "
        f"m.save(Path({str(tmp_path / '.metadata')!r}), m.load(Path({str(next(dense['base'].glob('iter_*')) / '.metadata')!r}))); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    assert (tmp_path / ".metadata").stat().st_size > 0


def test_reads_metadata_saved_by_megatron_core_0_15(tmp_path, monkeypatch):
    """megatron-core 0.15 pickles DCP's Metadata as its subclass MCoreMetadata (an extra `mcore_data`
    field); such a checkpoint was refused as damaged."""
    meta = dcp_metadata.DcpMetadata(
        tensors={"w": dcp_metadata.TensorEntry("float32", (4, 2), [dcp_metadata.Chunk((0, 0), (4, 2))])},
        objects=["o"],
        storage={("w", (0, 0)): dcp_metadata.Storage("__0_0.distcp", 0, 32), ("o", None): dcp_metadata.Storage("__0_0.distcp", 32, 8)},
    )
    mcore = dcp_metadata.named("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata")
    real_named, real_new = dcp_metadata.named, dcp_metadata._new

    def named(module, name):
        return mcore if (module, name) == (dcp_metadata._METADATA, "Metadata") else real_named(module, name)

    def new(cls, state):
        return real_new(cls, {**state, "mcore_data": {"w": {}}} if cls is mcore else state)

    monkeypatch.setattr(dcp_metadata, "named", named)
    monkeypatch.setattr(dcp_metadata, "_new", new)
    dcp_metadata.save(tmp_path / ".metadata", meta)
    monkeypatch.undo()
    assert b"MCoreMetadata" in (tmp_path / ".metadata").read_bytes()
    assert dcp_metadata.load(tmp_path / ".metadata") == meta
