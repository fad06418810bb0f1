"""Checksums recomputed region by region must cover each element exactly once."""

import pytest

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import SyntheticReader, write_synthetic
from reshard.errors import ReshardError
from reshard.formats.megatron_dist import TorchDistReader
from reshard.layout import Layout
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
