"""`DirectFile` must store and return exactly the bytes given, however a transfer falls on pages."""

import os

import numpy as np
import pytest

from reshard import direct_io
from reshard.buffers import empty
from reshard.direct_io import ALIGN, DirectFile


@pytest.fixture
def small_direct(monkeypatch):
    monkeypatch.setattr(direct_io, "DIRECT_FROM", 1)  # every transfer with a whole page in it goes direct


@pytest.mark.parametrize("offset", [0, ALIGN, 100, ALIGN - 1])
@pytest.mark.parametrize("start", [0, 100])  # where the data starts in a page-aligned buffer
def test_writes_and_reads_back_the_same_bytes(tmp_path, small_direct, offset, start):
    rng = np.random.default_rng(offset + start)
    buffer = empty(start + 5 * ALIGN + 123)
    buffer[:] = rng.integers(0, 256, buffer.size, dtype=np.uint8)
    data = buffer[start:]
    file = DirectFile(tmp_path / "f")
    try:
        assert file.pwrite(data, offset) == data.size
        back = empty(start + data.size)[start:]
        assert file.pread(memoryview(back), offset) == data.size
        assert file.pread(memoryview(empty(10)), offset + data.size - 3) == 3  # short only at the end
    finally:
        file.close()
    on_disk = (tmp_path / "f").read_bytes()
    assert on_disk[offset:] == data.tobytes() == back.tobytes()
    assert on_disk[:offset] == b"\0" * offset


def test_the_aligned_middle_goes_direct(tmp_path, small_direct, monkeypatch):
    """So the test above covers direct I/O wherever the filesystem offers it (ext4 here and in CI)."""
    seen = []
    original = direct_io._pwrite_all
    monkeypatch.setattr(direct_io, "_pwrite_all", lambda fd, view, offset: (seen.append((fd, offset, len(view))), original(fd, view, offset)))
    file = DirectFile(tmp_path / "f")
    try:
        file.pwrite(empty(4 * ALIGN)[ALIGN - 10 :], ALIGN - 10)  # memory and file offset agree mod a page
    finally:
        direct = file.direct
        file.close()
    if direct is None:  # a filesystem without O_DIRECT: one plain write
        assert [(offset, n) for _, offset, n in seen] == [(ALIGN - 10, 3 * ALIGN + 10)]
    else:
        assert (direct, ALIGN, 3 * ALIGN) in seen


def test_falls_back_where_direct_io_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    file = DirectFile(tmp_path / "f")
    try:
        assert file.direct is None
        data = np.arange(3 * ALIGN, dtype=np.uint8)
        file.pwrite(data, 7)
    finally:
        file.close()
    assert (tmp_path / "f").read_bytes()[7:] == data.tobytes()


def test_falls_back_when_a_direct_transfer_is_refused(tmp_path, small_direct, monkeypatch):
    """Some filesystems accept O_DIRECT at open and refuse it at the first write or read (EINVAL)."""
    writer, reader = DirectFile(tmp_path / "f"), DirectFile(tmp_path / "f")
    refused = {writer.direct, reader.direct} - {None}
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def check(fd):
        if fd in refused:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", lambda fd, *a: check(fd) or real_pwrite(fd, *a))
    monkeypatch.setattr(os, "preadv", lambda fd, *a: check(fd) or real_preadv(fd, *a))
    data = empty(3 * ALIGN)
    data[:] = 9
    back = empty(data.size)
    try:
        assert writer.pwrite(data, 0) == data.size
        assert reader.pread(memoryview(back), 0) == data.size
        assert writer.direct is None and reader.direct is None  # given up after the refusal
    finally:
        writer.close()
        reader.close()
    assert back.tobytes() == data.tobytes() == (tmp_path / "f").read_bytes()
