"""Region reads out of `torch.save` records, against slicing what `torch.save` was given."""

import itertools

import pytest
import torch

from reshard.formats import torch_blob
from reshard.formats.torch_blob import RecordFile


@pytest.mark.parametrize("block", [torch_blob.READ_BLOCK, 64], ids=["one-read", "many-blocks"])
def test_regions_read_back_as_saved(tmp_path, monkeypatch, block):
    monkeypatch.setattr(torch_blob, "READ_BLOCK", block)
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
                f.read_into(record, region, dest)
                assert torch.equal(dest, saved[tuple(itertools.starmap(slice, region))]), (region, into_column)
    finally:
        f.close()
