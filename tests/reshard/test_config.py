"""Values of a model's config that no tensor's shape pins down, yet its math depends on: out of range, the model
would compute inf, NaN or flipped signs, and a conversion would still say "checksums verified". Each is refused
when the checkpoint is read, in one line naming the field, whatever records it, and the source is left as it was."""

from __future__ import annotations

import json

import pytest

from fixtures.models import TINY_LLAMA, TINY_MOE
from fixtures.synthetic import write_synthetic
from reshard.layout import Layout
from tests.cli import refused_by_every_command, refused_cli

# (Megatron-LM argument, value, the words of the refusal)
OUT_OF_RANGE = [
    ("norm_epsilon", -1, "the model's norm_epsilon is -1, not a positive number"),
    ("norm_epsilon", 0.0, "norm_epsilon is 0.0"),
    ("norm_epsilon", float("nan"), "norm_epsilon is nan"),
    ("rotary_base", 0, "the model's rotary_base is 0, not a positive number"),
    ("rotary_base", float("inf"), "rotary_base is inf"),
    ("rotary_base", "10000", "rotary_base is '10000'"),
    ("rotary_percent", 0.0, "rotary_percent is 0.0, not a fraction in (0, 1]"),
    ("rotary_percent", 1.5, "rotary_percent is 1.5"),
    ("rope_scaling_factor", -8.0, "rope_scaling_factor is -8.0"),
    ("max_position_embeddings", 0, "max_position_embeddings is 0, not a whole number of at least 1"),
    ("make_vocab_size_divisible_by", -128, "make_vocab_size_divisible_by is -128"),
]
# a writer records the precision of the model it writes, whatever the args said: a zarr store's config can say otherwise
NOT_A_PRECISION = ("params_dtype", "os.system", "params_dtype is 'os.system', not one of bfloat16, float16, float32")
MOE_OUT_OF_RANGE = [
    ("moe_router_topk_scaling_factor", -1.0, "moe_router_topk_scaling_factor is -1.0"),
    ("moe_router_topk_scaling_factor", 0, "moe_router_topk_scaling_factor is 0"),
    ("moe_router_topk", 0, "moe_router_topk is 0"),
    ("moe_router_topk", True, "moe_router_topk is True"),
]


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
@pytest.mark.parametrize("field, value, words", OUT_OF_RANGE + MOE_OUT_OF_RANGE, ids=lambda v: str(v)[:24])
def test_megatron_args_out_of_range_are_refused_when_read(tmp_path, monkeypatch, capsys, fmt, field, value, words):
    source = tmp_path / "src"
    config = TINY_MOE if field.startswith("moe_") else TINY_LLAMA
    write_synthetic(source, config, Layout(), fmt, args={field: value})
    refused_by_every_command(monkeypatch, capsys, source, tmp_path / "out", words, "fix it where the checkpoint records it",
                             to=("--to-format", "hf"))


@pytest.mark.parametrize("field, value, words", [*OUT_OF_RANGE[:6], NOT_A_PRECISION], ids=lambda v: str(v)[:24])
def test_a_zarr_stores_recorded_config_out_of_range_is_refused_when_read(tmp_path, monkeypatch, capsys, field, value, words):
    source = tmp_path / "src"
    write_synthetic(source, TINY_LLAMA, Layout(), "zarr")
    meta = json.loads((source / "zarr.json").read_text())
    meta["attributes"]["reshard"]["config"][field] = value
    (source / "zarr.json").write_text(json.dumps(meta))
    refused_cli(monkeypatch, capsys, ["convert", source, tmp_path / "out", "--to-format", "torch_dist", "-q"], words,
                untouched=(source,))
    assert not (tmp_path / "out").exists()
