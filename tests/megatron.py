"""Checkpoints saved by megatron-core itself, and the oracle that loads them into GPTModel."""

from __future__ import annotations

import pytest
import torch

from tests.launch import run

CKPT = "fixtures.megatron_checkpoint"
ORACLE = "fixtures.megatron_oracle"


def layout_args(tp=1, pp=1, ep=1, vpp=1, first_stage_layers=None, last_stage_layers=None):
    """Command-line flags of fixtures' entry points for a layout given as Layout's fields."""
    args = ["--tp", tp, "--pp", pp, "--ep", ep, "--vpp", vpp]
    if first_stage_layers is not None:
        args += ["--first-stage-layers", first_stage_layers]
    if last_stage_layers is not None:
        args += ["--last-stage-layers", last_stage_layers]
    return args


def same(a, b, loss=True):
    """Megatron's loss (fp32, 1e-6 relative) and logits over the true vocabulary agree.

    Megatron's loss also sums over the padded vocabulary rows, so a layout that pads the vocabulary
    differently changes the loss by construction: compare with `loss=False` then.
    """
    assert a["logits"].shape == b["logits"].shape
    if loss:
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    torch.testing.assert_close(a["logits"], b["logits"], atol=1e-5, rtol=0)


def make_checkpoints(root, preset, layouts, optimizer=True):
    """A base at TP1PP1 (one Adam step) and Megatron's own reshard of it to each named layout."""
    base = root / "base"
    opt = ["--optimizer"] if optimizer else []
    run(CKPT, ["--preset", preset, "--out", base, *opt], nproc=1)
    made = {"base": base}
    for name, layout, extra in layouts:
        made[name] = root / name
        nproc = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("ep", 1)
        run(CKPT, ["--preset", preset, *layout_args(**layout), "--from", base, "--out", made[name], *extra], nproc=nproc)
    return made
