"""A damaged or foreign file is refused in one line as damaged; a bug of ours is not passed off as one."""

import dataclasses
import pickle
import shutil
import sys
import zipfile

import pytest

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import write_synthetic
from reshard import cli
from reshard.errors import ReshardError
from reshard.formats.megatron_dist import TorchDistReader
from reshard.layout import Layout
from reshard.torchfile import archive_reader, dcp_metadata, zip_reader
from reshard.torchfile.archive_reader import load_archive

CALLS_A_NUMBER = b"\x80\x02K\x01)R."  # 1(): the pickle machine itself raises a TypeError
NOT_A_STORAGE = b"\x80\x02K\x05Q."  # persistent id 5, where torch's are ("storage", ...) tuples


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("parse") / "ckpt"
    write_synthetic(path, TINY_LLAMA, Layout(tp=2), "torch_dist")
    return path


@pytest.fixture
def ckpt(source, tmp_path):
    shutil.copytree(source, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _iteration(ckpt):
    return next(ckpt.glob("iter_*"))


def _storage_offset_none(path):
    metadata = dcp_metadata.load(path)
    key = next(iter(metadata.storage))
    metadata.storage[key] = dataclasses.replace(metadata.storage[key], offset=None)
    dcp_metadata.save(path, metadata)


@pytest.mark.parametrize("damage", [
    lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    lambda path: path.write_bytes(b"not a pickle"),
    lambda path: path.write_bytes(CALLS_A_NUMBER),
    lambda path: path.write_bytes(pickle.dumps({"state_dict_metadata": {}})),  # no DCP record at all
    _storage_offset_none,  # a record's field of the wrong type
], ids=["truncated", "not-a-pickle", "calls-a-number", "foreign-pickle", "wrong-field-type"])
def test_damaged_metadata_is_refused_as_damaged(ckpt, damage):
    path = _iteration(ckpt) / ".metadata"
    damage(path)
    with pytest.raises(ReshardError, match="cannot be read .*: the checkpoint is damaged"):
        dcp_metadata.load(path)


def _archive_of(pickled: bytes):
    def write(path):
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("archive/data.pkl", pickled)
            zf.writestr("archive/version", b"3\n")

    return write


@pytest.mark.parametrize("damage", [
    lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    _archive_of(CALLS_A_NUMBER),
    _archive_of(NOT_A_STORAGE),
], ids=["truncated", "calls-a-number", "not-a-storage"])
def test_damaged_archives_are_refused_as_damaged(ckpt, damage):
    path = _iteration(ckpt) / "common.pt"
    damage(path)
    with pytest.raises(ReshardError, match="(cannot be loaded|is not a torch.save archive as torch writes one) .*: the checkpoint is damaged"):
        load_archive(path, str(path))


def _read_every_record(ckpt):
    with TorchDistReader(ckpt) as reader:
        for name in reader.specs:
            reader.stored_records(name)


def test_a_damaged_chunk_is_refused_as_damaged(ckpt):
    """A chunk whose zip end record is gone (zeroed)."""
    storage = next(s for (_, offsets), s in dcp_metadata.load(_iteration(ckpt) / ".metadata").storage.items() if offsets is not None)
    path = _iteration(ckpt) / storage.relative_path
    data = bytearray(path.read_bytes())
    end = storage.offset + storage.length
    data[end - 22 : end] = bytes(22)
    path.write_bytes(bytes(data))
    with pytest.raises(ReshardError, match="is not a torch.save archive as torch writes one .*: the checkpoint is damaged"):
        _read_every_record(ckpt)


def _raises(error):
    def bug(*args, **kwargs):
        raise error("a bug of ours")

    return bug


@pytest.mark.parametrize("module, name, read", [
    (dcp_metadata, "_metadata", lambda ckpt: dcp_metadata.load(_iteration(ckpt) / ".metadata")),
    (dcp_metadata, "_standin", lambda ckpt: dcp_metadata.load(_iteration(ckpt) / ".metadata")),  # inside the unpickler
    (zip_reader, "records", lambda ckpt: load_archive(_iteration(ckpt) / "common.pt", "common.pt")),
    (archive_reader, "archive_tensor", _read_every_record),
], ids=["metadata", "unpickler", "zip", "chunk"])
@pytest.mark.parametrize("error", [TypeError, AttributeError])
def test_a_bug_is_not_reported_as_damaged(ckpt, monkeypatch, module, name, read, error):
    monkeypatch.setattr(module, name, _raises(error))
    with pytest.raises(error, match="a bug of ours"):
        read(ckpt)


def _cli(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["reshard", *map(str, args)])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()


def test_the_cli_reports_damage_as_an_error_and_a_bug_as_an_internal_one(ckpt, monkeypatch, capsys):
    metadata = _iteration(ckpt) / ".metadata"
    intact = metadata.read_bytes()
    metadata.write_bytes(CALLS_A_NUMBER)
    code, lines = _cli(monkeypatch, capsys, "inspect", ckpt)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("reshard: error:") and "the checkpoint is damaged" in lines[0]
    metadata.write_bytes(intact)
    monkeypatch.setattr(dcp_metadata, "_metadata", _raises(TypeError))
    code, lines = _cli(monkeypatch, capsys, "inspect", ckpt)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("reshard: internal error: TypeError: a bug of ours") and "damaged" not in lines[0]


@pytest.mark.parametrize("common", [[1, 2], {"args": 5}, {"iteration": [1]}, {"extra": 3}, {"objects": [1]}, b"xx"],
                         ids=["list", "args", "iteration", "extra", "objects", "bytes"])
def test_a_zarr_store_whose_common_state_is_damaged_is_refused_in_one_line(tmp_path, monkeypatch, capsys, common):
    """A common.pt holding anything but what the zarr writer writes gave an AttributeError or a TypeError."""
    import torch

    store = tmp_path / "store"
    write_synthetic(store, TINY_LLAMA, Layout(), "zarr")
    torch.save(common, store / "common.pt")
    code, lines = _cli(monkeypatch, capsys, "inspect", store)
    assert code == 1 and lines == [f"reshard: error: {store / 'common.pt'} does not hold reshard's common state: the store is damaged"]
