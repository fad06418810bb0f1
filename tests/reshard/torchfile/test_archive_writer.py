"""Our `torch.save` writer against the oracles: `torch.load` (also memory-mapped) and Python's `zipfile`,
which checks every record's CRC-32."""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch

from reshard.buffers import Scratch
from reshard.direct_io import DirectFile
from reshard.torchfile.archive_writer import At, StreamingTorchSave, archive_size, save_tensor
from tests.arrays import as_numpy, dtype_of, same


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g).to(torch.bfloat16)
    return {
        "contiguous": base,
        "row_slice": base[2:4],  # a view into a larger storage: only its own bytes may be written
        "column_slice": base[:, 3:7],  # strided: staged through the scratch buffer
        "one_strided_element": base[0, ::20],  # "contiguous" to torch (one element), yet its stride is 20
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "int": torch.arange(7, dtype=torch.int64),
        # no legacy storage class: torch pickles these through `_rebuild_tensor_v3` and an UntypedStorage
        "float8_e4m3fn": torch.randn(3, 5, generator=g).to(torch.float8_e4m3fn),
        "float8_e5m2_slice": torch.randn(4, 6, generator=g).to(torch.float8_e5m2)[:, 1:4],
        "uint16": torch.arange(9, dtype=torch.int32).to(torch.uint16),
    }


@pytest.mark.parametrize("zip64_from", [0xFFFFFFFF, 0], ids=["zip32", "zip64"])
def test_save_tensor_loads_with_torch_and_passes_zipfile_crc(zip64_from: int) -> None:
    scratch = Scratch()
    for name, tensor in _tensors().items():
        f = io.BytesIO(b"prefix")  # DCP appends records to a file: offsets are relative to the record
        f.seek(0, 2)
        saved = save_tensor(as_numpy(tensor), f, scratch, zip64_from=zip64_from)
        blob = f.getvalue()[len(b"prefix") :]
        loaded = torch.load(io.BytesIO(blob), weights_only=True)
        assert loaded.dtype == tensor.dtype and same(loaded, tensor), name
        assert loaded.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
        with zipfile.ZipFile(io.BytesIO(blob)) as zf:
            assert zf.testzip() is None, name
            stored = zf.read("archive/data/0")
        # what it reports as written is the storage zipfile finds, where it finds it
        assert saved.size == len(blob) and saved.data.tobytes() == stored, name
        assert blob[saved.data_offset : saved.data_offset + len(stored)] == stored, name


@pytest.mark.parametrize("zip64_from", [0xFFFFFFFF, 0], ids=["zip32", "zip64"])
def test_tensors_of_one_shape_each_get_their_own_crc(zip64_from: int) -> None:
    """All of an archive but the tensor's bytes and CRC-32 is built once per shape: each archive written
    from it still loads, and zipfile finds each record's CRC-32 right."""
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        tensor = torch.randn(4, 6, generator=g).to(torch.bfloat16)
        f = io.BytesIO()
        save_tensor(as_numpy(tensor), f, zip64_from=zip64_from)
        assert same(torch.load(io.BytesIO(f.getvalue()), weights_only=True), tensor)
        with zipfile.ZipFile(io.BytesIO(f.getvalue())) as zf:
            assert zf.testzip() is None  # against the central directory's CRC-32s
            for info in zf.infolist():  # which each local header repeats (zip spec: CRC-32 at byte 14)
                assert struct.unpack_from("<I", f.getvalue(), info.header_offset + 14)[0] == info.CRC, info.filename


@pytest.mark.parametrize("zip64_from", [0xFFFFFFFF, 0], ids=["zip32", "zip64"])
def test_streaming_save_matches_the_state_dict(tmp_path, zip64_from: int) -> None:
    path = tmp_path / "model_optim_rng.pt"
    writer = StreamingTorchSave(path, zip64_from=zip64_from)
    tensors = _tensors()
    scratch = Scratch()
    slots = {name: writer.reserve(tuple(t.shape), dtype_of(t)) for name, t in tensors.items()}
    for name, t in tensors.items():
        writer.fill(slots[name], as_numpy(t), scratch)
    stubs = {name: slot.stub for name, slot in slots.items()}
    writer.finish({"model": stubs, "iteration": 7, "args": {"lr": 0.1}})
    for mmap in (False, True):  # torch's mmap loading needs aligned records
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert loaded["iteration"] == 7 and loaded["args"] == {"lr": 0.1}
        for name, tensor in tensors.items():
            assert same(loaded["model"][name], tensor), (name, mmap)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        assert all(n.startswith("model_optim_rng/") for n in zf.namelist())


@pytest.mark.parametrize("zip64_from", [0xFFFFFFFF, 0], ids=["zip32", "zip64"])
def test_archive_size_is_known_before_the_values(zip64_from):
    for name, t in _tensors().items():
        buf = io.BytesIO()
        written = save_tensor(as_numpy(t), buf, zip64_from=zip64_from).size
        assert archive_size(tuple(t.shape), dtype_of(t), zip64_from) == written == len(buf.getvalue()), name
    big = (128512, 2048)  # shapes whose pickles differ in length from the small ones
    assert archive_size(big, "bfloat16") - 128512 * 2048 * 2 != archive_size((3, 4), "bfloat16") - 24


def test_records_written_at_planned_offsets_by_several_threads(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    tensors = list(_tensors().values())
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + archive_size(tuple(t.shape), dtype_of(t)))
    path = tmp_path / "records"
    file = DirectFile(path)
    try:
        with ThreadPoolExecutor(3) as pool:  # written in any order, each at its planned offset
            list(pool.map(lambda i: save_tensor(as_numpy(tensors[i]), At(file, offsets[i]), Scratch()), reversed(range(len(tensors)))))
    finally:
        file.close()
    data = path.read_bytes()
    assert len(data) == offsets[-1]
    for t, a, b in zip(tensors, offsets, offsets[1:]):
        assert zipfile.ZipFile(io.BytesIO(data[a:b])).testzip() is None
        assert same(torch.load(io.BytesIO(data[a:b])), t)


def test_streaming_records_reserved_in_order_and_filled_by_threads_in_any_order(tmp_path):
    """The legacy writer's way: records placed in plan order, written from reader threads; a large one
    starts on a page (for direct I/O) and torch still loads the file, memory-mapped too."""
    from concurrent.futures import ThreadPoolExecutor

    tensors = {**_tensors(), "large": torch.arange(1 << 20, dtype=torch.int16).view(512, 2048)}  # 2 MiB
    path = tmp_path / "model_optim_rng.pt"
    writer = StreamingTorchSave(path)
    slots = {name: writer.reserve(tuple(t.shape), dtype_of(t)) for name, t in tensors.items()}
    with ThreadPoolExecutor(3) as pool:
        written = dict(pool.map(lambda n: (n, writer.fill(slots[n], as_numpy(tensors[n]), Scratch()).tobytes()), reversed(list(tensors))))
    writer.finish({"model": {name: slot.stub for name, slot in slots.items()}})
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)["model"]
        for name, tensor in tensors.items():
            assert same(loaded[name], tensor), (name, mmap)
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        for index, (name, slot) in enumerate(slots.items()):
            stored = zf.read(f"model_optim_rng/data/{index}")
            assert written[name] == stored == raw[slot.data_offset : slot.data_offset + len(stored)], name
    assert slots["large"].data_offset % 4096 == 0
