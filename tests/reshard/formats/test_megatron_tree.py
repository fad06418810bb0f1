"""Where a Megatron checkpoint lies in the directories that save it: NeMo-RL's `step_<N>/policy/weights/`, Megatron-
Bridge's own save (the golden one it wrote, fixtures/golden/bridge-torch_dist-tp1), found without flags."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fixtures.torchrun import REPO
from reshard.convert import convert
from reshard.formats import detect
from reshard.request import Target
from tests.arrays import same, tensors

BRIDGE = REPO / "fixtures" / "golden" / "bridge-torch_dist-tp1"


def _nemo_rl_run(root: Path) -> Path:
    """The Bridge save where NeMo-RL's checkpointer puts its Megatron policy's (nemo_rl/algorithms: `step_<N>` with
    policy/weights, policy/tokenizer, config.yaml and training_info.json), an older step and an unfinished one beside."""
    for name in ("step_1", "step_3", "tmp_step_4"):
        step = root / name
        shutil.copytree(BRIDGE, step / "policy" / "weights")
        (step / "policy" / "tokenizer").mkdir()
        (step / "config.yaml").write_text("policy:\n  megatron_cfg:\n    enabled: true\n")
        (step / "training_info.json").write_text(json.dumps({"step": int(name.rsplit("_", 1)[1])}))
    shutil.rmtree(root / "step_1" / "policy" / "weights" / "iter_0000000")  # were it read, the conversion would fail
    shutil.rmtree(root / "tmp_step_4" / "policy" / "weights" / "iter_0000000")
    return root


def test_a_nemo_rl_step_reads_and_exports_as_the_bridge_save_it_holds(tmp_path):
    run = _nemo_rl_run(tmp_path / "results")
    want = tensors(BRIDGE)
    for path in (run, run / "step_3"):
        assert detect(path) == "torch_dist"
        got = tensors(path)
        assert sorted(got) == sorted(want) and all(same(got[name], want[name]) for name in want)
    convert(run, tmp_path / "hf", Target(format="hf", optimizer=False))
    convert(BRIDGE, tmp_path / "oracle", Target(format="hf", optimizer=False))
    got, want = tensors(tmp_path / "hf"), tensors(tmp_path / "oracle")
    assert got and sorted(got) == sorted(want) and all(same(got[name], want[name]) for name in want)
