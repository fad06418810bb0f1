"""Checksums recomputed region by region must cover each element exactly once; records a writer vouches
for are counted without a re-read only where the metadata on disk puts them."""

from dataclasses import replace

import numpy as np
import pytest

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import SyntheticReader, write_synthetic
from reshard.convert import convert
from reshard.dtypes import bits
from reshard.errors import ReshardError
from reshard.formats.hf import HFReader
from reshard.formats.megatron_dist import TorchDistReader
from reshard.formats.megatron_legacy import LegacyReader
from reshard.formats.zarr_store import ZarrReader
from reshard.layout import Layout
from reshard.plan import make_plan
from reshard.request import Target
from reshard.streaming import manifest_for, write_moves
from reshard.verify import compute_checksums


class _Regions(SyntheticReader):
    """A reader whose stored regions are those of another, edited."""

    def __init__(self, edit):
        super().__init__(TINY_LLAMA)
        self.edit = edit

    def stored_regions(self, name):
        return self.edit(super().stored_regions(name))


def test_chunks_of_a_written_checkpoint_give_the_slabs_checksums(tmp_path):
    write_synthetic(tmp_path / "ckpt", TINY_LLAMA, Layout(tp=2, pp=2), "torch_dist")
    with TorchDistReader(tmp_path / "ckpt") as reader:
        name = "decoder.layers.self_attention.linear_qkv.weight"
        assert len(reader.stored_regions(name)) == 2 * TINY_LLAMA.num_layers  # one per TP rank and layer
        assert compute_checksums(reader) == compute_checksums(SyntheticReader(TINY_LLAMA))


@pytest.mark.parametrize("edit", [lambda r: r[1:], lambda r: r + r[:1]], ids=["a region missing", "a region twice"])
def test_regions_that_miss_or_repeat_elements_are_refused(edit):
    with pytest.raises(ReshardError, match="do not cover the tensor exactly once"):
        compute_checksums(_Regions(edit))


READERS = {"torch_dist": TorchDistReader, "legacy": LegacyReader, "zarr": ZarrReader}
LAYOUT_FREE = {"hf": HFReader}


def _write(path, reader, layout, fmt="torch_dist"):
    """Convert `reader` to `fmt` at `path`; the writer's records with their checksums as written, and the
    tensors' checksums as written."""
    plan = make_plan(reader, path, Target(format=fmt, layout=layout))
    writer = plan.new_writer()
    written, _ = write_moves(reader, plan, writer, None, workers=2)
    writer.finish(manifest_for(plan, written))
    return writer.written_records(), written


def _counting(fmt, path):
    """The format's reader, counting the regions whose values are read back."""

    class Counting({**READERS, **LAYOUT_FREE}[fmt]):
        reads = 0

        def read_into(self, name, region, out):
            self.reads += 1
            super().read_into(name, region, out)

    return Counting(path)


@pytest.mark.parametrize("fmt", READERS)
def test_records_found_where_the_writer_put_them_are_not_read_back(tmp_path, fmt):
    records, written = _write(tmp_path / "ckpt", SyntheticReader(TINY_LLAMA), Layout(tp=2, pp=2), fmt)
    with _counting(fmt, tmp_path / "ckpt") as reader:
        assert len(records) == sum(len(reader.stored_records(name)) for name in reader.specs)
        assert compute_checksums(reader, written=records) == written
        assert reader.reads == 0
        assert compute_checksums(reader) == written  # the same, read back
        assert reader.reads > 0


def test_hf_tensors_stacked_row_wise_are_not_read_back_the_others_are(tmp_path):
    """An HF export vouches for the tensors its mapping only renames or splits into row bands (embedding,
    norms, gate/up, down); QKV, whose heads are regrouped, is read back."""
    records, written = _write(tmp_path / "hf", SyntheticReader(TINY_LLAMA), Layout(), "hf")
    with _counting("hf", tmp_path / "hf") as reader:
        regrouped = [n for n in reader.specs if reader.stored_records(n) is None]
        assert regrouped == ["decoder.layers.self_attention.linear_qkv.weight"]
        assert len(records) == sum(len(reader.stored_records(n)) for n in reader.specs if n not in regrouped)
        assert compute_checksums(reader, written=records) == written
        assert reader.reads == sum(len(reader.stored_regions(n)) for n in regrouped)


@pytest.mark.parametrize("fmt", READERS)
def test_a_record_the_metadata_places_elsewhere_is_read_back(tmp_path, fmt):
    records, written = _write(tmp_path / "ckpt", SyntheticReader(TINY_LLAMA), Layout(tp=2), fmt)
    moved = next(r for r in records if len(r.region) == 2)
    records[replace(moved, offset=moved.offset + 64)] = records.pop(moved)
    with _counting(fmt, tmp_path / "ckpt") as reader:
        assert compute_checksums(reader, written=records) == written
        assert reader.reads == 1


def _roll_saved_tensor(monkeypatch):
    import reshard.formats.megatron_dist as megatron_dist

    real = megatron_dist.save_tensor
    monkeypatch.setattr(megatron_dist, "save_tensor", lambda chunk, f, scratch: real(np.roll(chunk, 1, axis=-1), f, scratch))


def _roll_filled_record(monkeypatch):
    from reshard.torchfile.archive_writer import StreamingTorchSave

    real = StreamingTorchSave.fill
    monkeypatch.setattr(StreamingTorchSave, "fill", lambda self, slot, t, scratch=None: real(self, slot, np.roll(t, 1, axis=-1), scratch))


def _roll_renamed(monkeypatch):
    from reshard.converters.base import Rename

    monkeypatch.setattr(Rename, "to_hf", lambda self, tensor, config: [np.roll(tensor, 1, axis=-1)])


@pytest.mark.parametrize(
    "fmt, layout, corrupt",
    [("torch_dist", Layout(pp=2), _roll_saved_tensor), ("legacy", Layout(pp=2), _roll_filled_record), ("hf", Layout(), _roll_renamed)],
    ids=["torch_dist", "legacy", "hf"],
)
def test_bytes_written_other_than_the_slab_says_are_caught_without_reading_back(tmp_path, monkeypatch, fmt, layout, corrupt):
    """A writer bug between the slab and the file (here: each record's values shifted by one column) is
    seen in the checksums of the bytes as written, so the conversion refuses and leaves nothing."""
    write_synthetic(tmp_path / "src", TINY_LLAMA, Layout(tp=2), "torch_dist")
    corrupt(monkeypatch)
    with pytest.raises(ReshardError, match="does not match the source"):
        convert(tmp_path / "src", tmp_path / "dst", Target(format=fmt, layout=layout))
    assert not (tmp_path / "dst").exists()


def _off_by_one_copy(monkeypatch, module):
    """A staging bug: every strided piece copied into its staging buffer with its first value changed."""
    real = module.copy

    def copy(dest, src):
        real(dest, src)
        bits(dest)[(0,) * dest.ndim] += 1

    monkeypatch.setattr(module, "copy", copy)


@pytest.mark.parametrize("fmt", ["torch_dist", "zarr"])
def test_a_staging_bug_is_caught_without_reading_back(tmp_path, monkeypatch, fmt):
    """Row-parallel pieces at TP2 are strided in their slab and staged before they are written: the checksum
    of the staged bytes, not of the slab, is what the written record counts with."""
    import reshard.formats.zarr_store as zarr_store
    import reshard.torchfile.archive_writer as archive_writer

    write_synthetic(tmp_path / "src", TINY_LLAMA, Layout(), "torch_dist")
    _off_by_one_copy(monkeypatch, archive_writer if fmt == "torch_dist" else zarr_store)
    with pytest.raises(ReshardError, match="does not match the source"):
        convert(tmp_path / "src", tmp_path / "dst", Target(format=fmt, layout=Layout(tp=2)))
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("fmt", READERS)
def test_regions_read_back_in_bands_give_the_same_checksums(tmp_path, monkeypatch, fmt):
    """A large stored region (an embedding slab) is read back in bands of about UNIT_BYTES, not whole."""
    _, written = _write(tmp_path / "ckpt", SyntheticReader(TINY_LLAMA), Layout(tp=2), fmt)
    monkeypatch.setattr("reshard.verify.UNIT_BYTES", 1 << 10)
    with _counting(fmt, tmp_path / "ckpt") as reader:
        assert compute_checksums(reader) == written
        regions = sum(len(reader.stored_regions(name)) for name in reader.specs)
        assert reader.reads > regions


@pytest.mark.parametrize("fmt", READERS)
def test_records_written_from_the_memory_hashed_as_read_are_not_hashed_again(tmp_path, monkeypatch, fmt):
    """At TP1 a torch_dist record is a whole slab written from the slab's own memory: each value is hashed
    once. A legacy rank tensor made of several pieces (a gated MLP) is assembled and hashed again, as is a
    zarr chunk that is staged (not one run of its slab)."""
    import reshard.checksum

    hashed = []
    real = reshard.checksum.TensorChecksum.add
    monkeypatch.setattr(reshard.checksum.TensorChecksum, "add", lambda self, region, data: hashed.append(data.size) or real(self, region, data))
    reader = SyntheticReader(TINY_LLAMA)
    records, written = _write(tmp_path / "ckpt", reader, Layout(), fmt)
    total = sum(spec.numel for spec in reader.specs.values())
    assert sum(hashed) == total if fmt == "torch_dist" else total < sum(hashed) < 2 * total
    with _counting(fmt, tmp_path / "ckpt") as back:
        assert compute_checksums(back, written=records) == written and back.reads == 0
