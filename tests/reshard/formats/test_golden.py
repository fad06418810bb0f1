"""Checkpoints written by the peer tools themselves (fixtures/golden, with their provenance and the script
that regenerates them): reshard reads them, reshards them, and exports the weights the HF model they were
made from holds, bit for bit. The oracle is the HF original that transformers saved."""

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from reshard.convert import convert
from reshard.layout import Layout
from reshard.request import Target

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "golden"
HF = GOLDEN / "hf-llama-tiny"


def _same_as_original(export: Path) -> None:
    original, ours = load_file(HF / "model.safetensors"), load_file(export / "model.safetensors")
    assert sorted(ours) == sorted(original)
    for name, value in original.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
        assert np.array_equal(ours[name].view(np.uint8), value.view(np.uint8)), name


@pytest.mark.parametrize(
    "written_by", ["mlm-core-legacy-tp2pp2", "mlm-core-legacy-tp1pp1", "mlm-core-torch_dist-tp1pp1"]
)
def test_megatron_lm_converter_output_exports_the_original_weights(tmp_path, written_by):
    convert(GOLDEN / written_by, tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")


def test_megatron_lm_legacy_output_reshards_and_still_exports_the_original_weights(tmp_path):
    convert(GOLDEN / "mlm-core-legacy-tp2pp2", tmp_path / "dist", Target(format="torch_dist", layout=Layout(tp=1, pp=2)))
    convert(tmp_path / "dist", tmp_path / "legacy", Target(format="legacy", layout=Layout(tp=2, pp=1)))
    convert(tmp_path / "legacy", tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")


def test_a_flipped_bit_in_the_golden_weights_is_caught(tmp_path):
    """The comparison above can fail: one bit of one value changed in the original is found."""
    convert(GOLDEN / "mlm-core-legacy-tp1pp1", tmp_path / "hf", Target(format="hf"))
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name].view(np.uint32)[3, 5] ^= 1
    from safetensors.numpy import save_file

    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(AssertionError, match=name):
        _same_as_original(tmp_path / "hf")
