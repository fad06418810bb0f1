"""Region reads out of `torch.save` records, against slicing what `torch.save` was given."""

import io
import itertools
import zipfile

import pytest
import torch

from reshard.errors import ReshardError
from reshard.torchfile import archive_reader, zip_reader
from reshard.torchfile.archive_reader import RecordFile
from reshard.torchfile.archive_writer import save_tensor
from tests.arrays import as_numpy, same


@pytest.mark.parametrize("window", [archive_reader.WINDOW, 64], ids=["headers-in-windows", "headers-between"])
@pytest.mark.parametrize("block", [archive_reader.READ_BLOCK, 64], ids=["one-read", "many-blocks"])
def test_regions_read_back_as_saved(tmp_path, monkeypatch, block, window):
    monkeypatch.setattr(archive_reader, "READ_BLOCK", block)
    monkeypatch.setattr(archive_reader, "WINDOW", window)
    saved = torch.arange(3 * 10 * 12, dtype=torch.float32).reshape(3, 10, 12).to(torch.bfloat16)
    path = tmp_path / "records"
    with open(path, "wb") as f:
        f.write(b"x" * 100)  # records sit anywhere in a .distcp file
        torch.save(saved, f)
        length = f.tell() - 100
    f = RecordFile(path)
    try:
        record = f.record(100, length)
        regions = [((0, 3), (0, 10), (0, 12)), ((1, 2), (2, 9), (0, 12)), ((0, 3), (1, 4), (5, 11)), ((2, 3), (9, 10), (11, 12))]
        for region in regions:
            for into_column in (False, True):  # into a dense tensor, or a strided slice of a wider one
                shape = [b - a for a, b in region]
                wide = torch.zeros(*shape[:-1], shape[-1] + 3, dtype=saved.dtype)
                dest = wide[..., 2 : 2 + shape[-1]] if into_column else torch.zeros(shape, dtype=saved.dtype)
                f.read_into(record, region, as_numpy(dest))
                assert same(dest, saved[tuple(itertools.starmap(slice, region))]), (region, into_column)
    finally:
        f.close()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16])
def test_records_of_dtypes_without_a_legacy_storage_read_back(tmp_path, dtype):
    """torch.save pickles these through `_rebuild_tensor_v3` over an UntypedStorage of bytes."""
    saved = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6).to(dtype)
    path = tmp_path / "records"
    with open(path, "wb") as f:
        f.write(b"x" * 100)
        torch.save(saved, f)
        length = f.tell() - 100
    _read_back(path, 100, length, saved)
    with open(path, "ab") as f:  # a view: torch saves its whole storage and the view's offset, in elements
        start = f.tell()
        torch.save(saved[1:], f)
        view_length = f.tell() - start
    _read_back(path, start, view_length, saved[1:])
    f = RecordFile(path)
    try:
        out = torch.zeros(2, 3, dtype=dtype)
        f.read_into(f.record(100, length), ((1, 3), (2, 5)), as_numpy(out))
        assert same(out, saved[1:3, 2:5])
    finally:
        f.close()


def _zips() -> dict[str, bytes]:
    """Archives written by torch.save, by our own writer (Zip32 and Zip64) and by `zipfile` (Zip64 entries)."""
    out = {}
    for name, value in {"bf16": torch.ones(3, 5, dtype=torch.bfloat16), "scalar": torch.tensor(2.5), "dict": {"a": torch.arange(7)}}.items():
        buffer = io.BytesIO()
        torch.save(value, buffer)
        out[f"torch.save {name}"] = buffer.getvalue()
    for zip64_from in (0xFFFFFFFF, 0):
        buffer = io.BytesIO()
        save_tensor(as_numpy(torch.arange(40, dtype=torch.float32).reshape(5, 8)), buffer, zip64_from=zip64_from)
        out[f"save_tensor zip64_from={zip64_from}"] = buffer.getvalue()
    with zipfile.ZipFile(io.BytesIO(out["torch.save dict"])) as source:
        records = [(name, source.read(name)) for name in source.namelist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in records:
            with zf.open(name, "w", force_zip64=True) as f:
                f.write(data)
    out["zipfile force_zip64"] = buffer.getvalue()
    return out


def _read_back(path, start: int, length: int, saved: torch.Tensor) -> None:
    """The record at [start, start+length) of `path` reads back as `saved`."""
    f = RecordFile(path)
    try:
        out = torch.empty(saved.shape, dtype=saved.dtype)
        f.read_into(f.record(start, length), tuple((0, d) for d in saved.shape), as_numpy(out))
        assert same(out, saved)
    finally:
        f.close()


@pytest.mark.parametrize("name, blob", list(_zips().items()), ids=list(_zips()))
def test_records_agree_with_zipfile(name, blob):
    """Our parse against `zipfile`'s: the same records (less their folder), each one's bytes where it says."""
    records = zip_reader.records(lambda offset, size: blob[offset : offset + size], len(blob), name)
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        assert sorted(records) == sorted(n.split("/", 1)[1] for n in zf.namelist())
        for entry in zf.namelist():
            offset, size = records[entry.split("/", 1)[1]]
            assert blob[offset : offset + size] == zf.read(entry), entry


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_strided_records_are_laid_out_from_their_storage(tmp_path, dtype):
    """torch.save of a transposed tensor or a strided view keeps the storage and its strides: read back
    without torch, as torch.load gives them."""
    base = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8).to(dtype)
    path = tmp_path / "records"
    for view in (base.t(), base[1:5, ::3], base[2:, 1:].t()[::2]):
        with open(path, "wb") as f:
            torch.save(view, f)
            length = f.tell()
        _read_back(path, 0, length, view.contiguous())


def test_a_record_reaching_past_its_storage_is_refused(tmp_path):
    from reshard.torchfile.archive_writer import save_archive, tensor_call

    buffer = io.BytesIO()
    stride_call = tensor_call("0", "float32", (4, 4))  # a dense tensor's pickle...
    stride_call.args = (stride_call.args[0], 0, stride_call.args[2], (8, 1), *stride_call.args[4:])  # ...with rows 8 apart
    save_archive(stride_call, buffer)  # no storage record is written for a StorageRef: add one of 16 values
    blob = buffer.getvalue()
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        entries = {name: zf.read(name) for name in zf.namelist()}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
        zf.writestr("archive/data/0", bytes(16 * 4))
    (tmp_path / "record").write_bytes(out.getvalue())
    f = RecordFile(tmp_path / "record")
    try:
        with pytest.raises(ReshardError, match="reaches past its storage"):
            f.record(0, len(out.getvalue()))
    finally:
        f.close()
