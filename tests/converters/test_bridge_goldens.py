"""Megatron-Bridge 0.6.2's own import of one tiny HF model per 2026 family (fixtures/golden/families, written by
fixtures/golden/make_family_goldens.py, which also proved Bridge loading reshard's import and exporting the HF weights
bit for bit): reshard's import of the same HF model holds exactly Bridge's tensors, names and values, read back by
torch's own DCP reader; and reshard reads Bridge's checkpoint and exports the HF model's weights bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from torch.distributed.checkpoint import FileSystemReader, load

from reshard.convert import convert
from reshard.formats import open_checkpoint
from reshard.request import Target

FAMILIES = Path(__file__).resolve().parents[2] / "fixtures" / "golden" / "families"
NAMES = ["gpt_oss", "glm4_moe", "minimax_m2", "deepseek_v3", "glm4_moe_lite"]


def stored_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint's iteration, as torch's own DCP reader loads it."""
    reader = FileSystemReader(str(next(checkpoint.glob("iter_*"))))
    tensors = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in reader.read_metadata().state_dict_metadata.items()
               if hasattr(v, "size")}
    load(tensors, storage_reader=reader)
    return tensors


def test_every_family_has_its_golden():
    assert sorted(p.name for p in FAMILIES.iterdir() if p.is_dir()) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_reshards_import_holds_exactly_bridges_tensors(tmp_path, name):
    convert(FAMILIES / name / "hf", tmp_path / "m", Target(format="torch_dist", naming="local", for_bridge=True))
    ours, bridge = stored_tensors(tmp_path / "m"), stored_tensors(FAMILIES / name / "bridge-tp1")
    assert sorted(ours) == sorted(bridge)
    for key, value in bridge.items():
        assert ours[key].dtype == value.dtype and ours[key].shape == value.shape and torch.equal(ours[key], value), key


@pytest.mark.parametrize("name", NAMES)
def test_bridges_import_exports_the_original_weights(tmp_path, name):
    with open_checkpoint(FAMILIES / name / "bridge-tp1") as reader:
        assert reader.config.num_experts == 4
    convert(FAMILIES / name / "bridge-tp1", tmp_path / "hf", Target(format="hf"))
    original, ours = load_file(FAMILIES / name / "hf" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(ours) == sorted(original)
    for key, value in original.items():
        assert ours[key].dtype == value.dtype and np.array_equal(ours[key].view(np.uint8), value.view(np.uint8)), key
