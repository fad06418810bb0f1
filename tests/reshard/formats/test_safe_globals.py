"""Every pickle reshard writes loads with `torch.load(weights_only=True)` under megatron-core's own list of safe
classes (`megatron.core.safe_globals.SAFE_GLOBALS`), as Megatron-LM 0.18+ loads `common.pt` and rank files:
the common state, the legacy rank files, and the objects inside the `.distcp` files. Sources: checkpoints
Megatron-LM and megatron-core wrote themselves (fixtures/golden), with their args, RNG and optimizer state."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from megatron.core.safe_globals import register_safe_globals

from reshard.convert import convert
from reshard.layout import Layout
from reshard.request import Target
from reshard.torchfile import dcp_metadata

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "golden"


def strict_load(blob: bytes, where: str) -> object:
    """torch.load(weights_only=True) with megatron-core's list added, as megatron-core adds it when imported (for the
    process: torch's `safe_globals` context would take them away again on leaving, from every later test too)."""
    register_safe_globals()
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:  # what Megatron-LM would report, with the file named
        raise AssertionError(f"{where} does not load with weights_only under megatron-core's SAFE_GLOBALS: {exc}") from None


def pickles(checkpoint: Path) -> dict[str, bytes]:
    """Every pickle in a Megatron checkpoint reshard wrote, by where it lies: .pt files and .distcp objects."""
    found = {str(p.relative_to(checkpoint)): p.read_bytes() for p in sorted(checkpoint.rglob("*.pt"))}
    for metadata in checkpoint.rglob(".metadata"):
        md = dcp_metadata.load(metadata)
        for (fqn, offsets), info in md.storage.items():
            if offsets is None:
                with open(metadata.parent / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    found[f"{metadata.parent.name}/{info.relative_path}:{fqn}"] = f.read(info.length)
    return found


@pytest.mark.parametrize("source,target", [
    ("mlm-core-torch_dist-tp1pp1", Target(format="torch_dist", layout=Layout(tp=2))),
    ("mlm-core-torch_dist-tp1pp1", Target(format="legacy", layout=Layout(pp=2))),
    ("mlm-core-legacy-tp2pp2", Target(format="torch_dist", layout=Layout(tp=1, pp=2))),
    ("mlm-core-legacy-tp2pp2", Target(format="legacy")),
    ("mcore014-distopt-tp2dp2/checkpoint", Target(format="torch_dist", layout=Layout(tp=1))),
    ("mcore019-distopt-tp2dp2/checkpoint", Target(format="legacy", layout=Layout(tp=1))),
], ids=["mlm-dist->dist-tp2", "mlm-dist->legacy-pp2", "mlm-legacy->dist-pp2", "mlm-legacy->legacy", "distopt014->dist", "distopt019->legacy"])
def test_what_reshard_writes_loads_with_megatron_lm_weights_only(tmp_path, source, target):
    convert(GOLDEN / source, tmp_path / "out", target)
    found = pickles(tmp_path / "out")
    names = " ".join(found)
    assert ("common.pt" in names) == (target.format == "torch_dist") and ("mp_rank_" in names) == (target.format == "legacy")
    assert len(found) >= 2
    for where, blob in found.items():
        strict_load(blob, where)


def test_the_check_can_fail(tmp_path):
    """A class outside the list (an object torch.load would have to import and build) is refused by it."""
    from collections import OrderedDict
    from fractions import Fraction

    buffer = io.BytesIO()
    torch.save({"args": OrderedDict(lr=Fraction(1, 3))}, buffer)
    with pytest.raises(AssertionError, match="does not load with weights_only"):
        strict_load(buffer.getvalue(), "a pickle with a Fraction")
