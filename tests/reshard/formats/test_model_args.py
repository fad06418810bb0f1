"""The architecture from a Megatron-Bridge run_config.yaml (its save, fixtures/golden/bridge-torch_dist-tp1) and
from --config files, made hostile: a name where reshard reads a dtype or an activation, a value that is not plain
YAML, a mapping where a value is read, values out of range, nesting 20,000 deep. Each is refused when read, in one
line naming the field, and the checkpoint is left as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.cli import refused_cli, run_cli

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "golden"
BRIDGE = GOLDEN / "bridge-torch_dist-tp1"
RUN_CONFIG = "iter_0000000/run_config.yaml"
DEEP = "[" * 20_000 + "]" * 20_000

# (a line of Bridge's run_config.yaml, what it becomes, the words of the refusal)
EDITS = [
    ("    _target_: torch.float32\n  perform_initialization", "    _target_: os.system\n  perform_initialization",
     "model.params_dtype names 'os.system'; reshard reads torch.bfloat16 or torch.float16 or torch.float32 there"),
    ("  params_dtype:\n    _call_: false\n    _target_: torch.float32\n", "  params_dtype:\n    _target_: [torch.float32]\n",
     "model.params_dtype names a YAML list"),
    ("    _target_: torch.nn.functional.silu\n", "    _target_: os.system\n",
     "model.activation_func names 'os.system'; reshard reads megatron.core.fusions.fused_bias_geglu.quick_gelu or torch.nn.functional.silu there"),
    ("  gated_linear_unit: true\n", "  gated_linear_unit: false\n",
     "model.activation_func names 'torch.nn.functional.silu'; reshard reads torch.nn.functional.gelu there"),
    ("  layernorm_epsilon: 1.0e-06\n", "  layernorm_epsilon: {_target_: builtins.float, _args_: ['-1']}\n",
     "model.layernorm_epsilon holds a YAML dict, not a plain value reshard reads"),
    ("  num_layers: 2\n", "  num_layers: [2]\n", "model.num_layers holds a YAML list, not a plain value reshard reads"),
    ("  hidden_dropout: 0.0\n", "  hidden_dropout: 2024-01-01\n", "model.hidden_dropout holds a YAML date"),
    ("  hidden_dropout: 0.0\n", "  hidden_dropout: !!binary aGVsbG8=\n", "model.hidden_dropout holds a YAML bytes"),
    ("  hidden_dropout: 0.0\n", "  hidden_dropout: !!set {a}\n", "model.hidden_dropout holds a YAML set"),
    ("  layernorm_epsilon: 1.0e-06\n", "  layernorm_epsilon: -1\n", "the model's norm_epsilon is -1, not a positive number"),
    ("  rotary_base: 500000.0\n", "  rotary_base: 0\n", "the model's rotary_base is 0, not a positive number"),
    ("  rotary_percent: 1.0\n", "  rotary_percent: .nan\n", "the model's rotary_percent is nan"),
    ("  hidden_dropout: 0.0\n", f"  hidden_dropout: {DEEP}\n", "nests deeper than 32 levels"),
    ("  recompute_modules:\n  - core_attn\n", f"  recompute_modules: {DEEP}\n", "nests deeper than 32 levels"),
]


@pytest.mark.parametrize("old, new, words", EDITS, ids=lambda v: v.strip()[:30] if isinstance(v, str) else None)
def test_a_hostile_run_config_is_refused_when_read(tmp_path, monkeypatch, capsys, old, new, words):
    source = Path(shutil.copytree(BRIDGE, tmp_path / "src"))
    text = (source / RUN_CONFIG).read_text()
    assert old in text
    (source / RUN_CONFIG).write_text(text.replace(old, new, 1))
    for command in (["convert", source, tmp_path / "out", "--to-format", "hf", "-q"], ["inspect", source]):
        refused_cli(monkeypatch, capsys, command, words, untouched=(source,))
    assert not (tmp_path / "out").exists()


def test_the_run_config_as_bridge_wrote_it_reads(tmp_path, monkeypatch, capsys):
    """The refusals above are of the edits: Bridge's own file, a list of modules and a self-referencing alias among
    what it leaves out included, converts."""
    source = Path(shutil.copytree(BRIDGE, tmp_path / "src"))
    text = (source / RUN_CONFIG).read_text()
    (source / RUN_CONFIG).write_text(text.replace("  recompute_modules:\n  - core_attn\n", "  recompute_modules: &l [*l]\n"))
    code, lines = run_cli(monkeypatch, capsys, "convert", source, tmp_path / "out", "--to-format", "hf", "-q")
    assert code == 0, lines


@pytest.mark.parametrize("name, text, words", [
    ("args.yaml", "params_dtype: {_target_: os.system}\n", "params_dtype is a YAML dict, not a plain value"),
    ("args.yaml", "norm_epsilon: 2024-01-01\n", "norm_epsilon is a YAML date"),
    ("args.yaml", f"num_layers: {DEEP}\n", "nests deeper than 32 levels"),
    ("args.yaml", "1: 2\n", "--config"),
    ("args.yaml", "num_layers: [2]\nhidden_size: 64\nnum_attention_heads: 4\n", "the model's num_layers is [2], not a whole number"),
    ("config.json", f'{{"deep": {DEEP}}}', "nests deeper than 32 levels"),
    ("config.json", '{"deep": ' + "[" * 40 + "]" * 40 + "}", "nests deeper than 32 levels"),
], ids=lambda v: v[:20])
def test_a_hostile_config_file_is_refused_when_read(tmp_path, monkeypatch, capsys, name, text, words):
    config = tmp_path / name
    config.write_text(text)
    source = GOLDEN / "mcore019-torch_dist-bare"
    refused_cli(monkeypatch, capsys, ["convert", source, tmp_path / "out", "--to-format", "hf", "--config", config, "-q"],
                words, untouched=(source,))
    assert not (tmp_path / "out").exists()


def test_an_args_file_of_values_out_of_range_is_refused(tmp_path, monkeypatch, capsys):
    """The whole architecture of the bare save, as Megatron-LM args, with one value out of range."""
    hf = json.loads((GOLDEN / "hf-llama-tiny" / "config.json").read_text())
    config = tmp_path / "args.yaml"
    config.write_text(f"num_layers: {hf['num_hidden_layers']}\nhidden_size: {hf['hidden_size']}\nnum_attention_heads: 4\n"
                      "rotary_base: 0\n")
    source = GOLDEN / "mcore019-torch_dist-bare"
    refused_cli(monkeypatch, capsys, ["inspect", source, "--config", config], "the model's rotary_base is 0", untouched=(source,))
