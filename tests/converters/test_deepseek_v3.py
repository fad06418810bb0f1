"""The DeepSeek-V3 family's other releases: Kimi-K2 (DeepSeek-V3's classes under model_type kimi_k2, rms_norm_eps
1e-5) through reshard and back bit for bit, its config.json too. (Its logits: tests/converters/test_hf_logits.py.)"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_hf_roundtrip import hf_tensors

from reshard.cli import main
from reshard.formats import open_checkpoint
from tests.arrays import same

from hf_models import build


def convert(*args) -> None:
    result = CliRunner().invoke(main, ["convert", *map(str, args), "-q"], standalone_mode=False)
    assert result.exception is None, result.exception


@pytest.mark.parametrize("layout", [["--to-tp", "2", "--to-ep", "2"], ["--to-pp", "2"]], ids=["tp2ep2", "pp2"])
def test_kimi_k2_round_trip_is_bit_identical(tmp_path, layout):
    source = build("kimi_k2", tmp_path / "hf")
    convert(source, tmp_path / "m", "--to-format", "torch_dist", *layout)
    with open_checkpoint(tmp_path / "m") as reader:
        assert reader.config.norm_epsilon == 1e-5 and reader.config.num_experts == 4
        assert reader.common.args["hf_model_type"] == "deepseek_v3"
    convert(tmp_path / "m", tmp_path / "back", "--to-format", "hf")
    original, exported = hf_tensors(source), hf_tensors(tmp_path / "back")
    assert exported.keys() == original.keys() and all(same(exported[k], v) for k, v in original.items())
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config == json.loads((source / "config.json").read_text()) and config["model_type"] == "kimi_k2"
