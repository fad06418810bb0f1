"""HF tensors addressed by a slice along their leading axis (`HFAddress`, `converters.base.at_index`): transformers
stores gpt-oss's experts fused ([E, ...]); a slab of one expert reads that expert's bytes and no others, an export
writes each expert into its place in the fused tensor, and a file whose fused tensor holds other than the config's
experts is refused."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from reshard.converters.gpt_oss import deinterleave_gated
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.formats.hf import HFAddress, slice_runs
from reshard.torchfile.archive_reader import RecordFile
from tests.cli import run_cli
from tests.converters.hf_models import build

FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "hf")


@pytest.mark.parametrize("address,name,index", [
    ("model.layers.1.mlp.experts.down_proj[3]", "model.layers.1.mlp.experts.down_proj", 3),
    ("model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.down_proj", None),
    ("a[12]", "a", 12),
    ("a[x]", "a[x]", None),  # not an index: a name as it is
])
def test_an_address_is_a_name_and_maybe_a_leading_index(address, name, index):
    assert HFAddress.parse(address) == HFAddress(name, index)


def test_one_experts_slab_reads_that_experts_bytes_only(source, monkeypatch):
    """Layer 1's expert 2 of linear_fc1: one pread of 64 x 96 float32 values at expert 2's offset in gate_up_proj
    [4, 64, 96], de-interleaved and transposed as Megatron holds it."""
    reads = []
    read_exact = RecordFile.read_exact
    monkeypatch.setattr(RecordFile, "read_exact", lambda self, view, offset: (reads.append((offset, len(view))),
                                                                                read_exact(self, view, offset))[1])
    fused = load_file(str(source / "model.safetensors"))["model.layers.1.mlp.experts.gate_up_proj"]
    with open_checkpoint(source) as reader:
        out = np.empty((1, 1, 96, 64), np.float32)
        reader.read_into(FC1, ((1, 2), (2, 3), (0, 96), (0, 64)), out)
        whole = reader._stored["model.layers.1.mlp.experts.gate_up_proj"]
    expert = 64 * 96 * 4
    assert reads == [(whole.offset + 2 * expert, expert)]
    assert np.array_equal(out[0, 0], deinterleave_gated(fused[2].T))
    assert not np.array_equal(out[0, 0], fused[2].T)  # the interleave mattered


def test_a_fused_tensor_of_other_experts_than_the_config_is_refused(source, tmp_path):
    """A fused tensor holding a fifth expert where config.json (and the router) say 4: read at the config's, it would
    be dropped."""
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[name] = np.concatenate([tensors[name], tensors[name][:1]])
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ReshardError, match=rf"{name} has shape \[5, 64, 96\] but config.json implies \[4, 64, 96\]"):
        open_checkpoint(bad)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return build("qwen3_next", tmp_path_factory.mktemp("qwen3_next") / "hf")


def _joined_across_gaps(hf_names, regions, axis):
    """`slice_runs` with one mistake: it takes the slices of one tensor for consecutive whatever their indices."""
    renamed = [n if HFAddress.parse(n).index is None else f"{HFAddress.parse(n).name}[{i}]" for i, n in enumerate(hf_names)]
    original = dict(zip(renamed, hf_names))
    return [(original[first], region) for first, region in slice_runs(renamed, regions, axis)]


@pytest.mark.parametrize("sabotaged", [pytest.param("import", marks=pytest.mark.slow), "export"])
def test_runs_joined_across_a_gap_in_the_fused_rows_fail_the_round_trip(qwen3_next, tmp_path, monkeypatch, capsys, sabotaged):
    """Control for test_hf_roundtrip's bit-identical Qwen3-Next round trip (safetensors reads the export), which is
    what proves `slice_runs`: Gated DeltaNet's in_proj rows go head by head, so a run joining one head's rows to the
    next head's reads or writes other rows; the round trip then no longer gives the source's bytes."""
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    with monkeypatch.context() as patch:
        if sabotaged == "import":
            patch.setattr("reshard.formats.hf.slice_runs", _joined_across_gaps)
        assert run_cli(patch, capsys, "convert", qwen3_next, megatron, "--to-format", "torch_dist", "--to-tp", "2", "-q")[0] == 0
    if sabotaged == "export":
        monkeypatch.setattr("reshard.formats.hf.slice_runs", _joined_across_gaps)
    assert run_cli(monkeypatch, capsys, "convert", megatron, back, "--to-format", "hf", "-q")[0] == 0
    original, exported = (load_file(next(d.glob("*.safetensors"))) for d in (qwen3_next, back))
    differ = [key for key, value in original.items() if not np.array_equal(exported[key], value)]
    assert any("in_proj_qkvz" in key for key in differ), differ
