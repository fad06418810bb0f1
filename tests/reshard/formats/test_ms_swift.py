"""An ms-swift (Megatron-SWIFT) checkpoint is a source: the run directory (its newest checkpoint-N), or a checkpoint.
Its args hold the parallel sizes but not the architecture, which comes from the HF config.json swift saves beside
its weights or from --config; the HF model directory its args name is never followed. The oracle: the checkpoint's
weights are Megatron-LM's own save of the golden HF model (fixtures/golden), whose HF export must be that model bit for bit."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from fixtures.ms_swift import save_as_ms_swift, save_lora
from fixtures.torchrun import REPO
from reshard import lora
from reshard.convert import convert
from reshard.layout import Layout
from reshard.request import LayoutChange, SourceHints, Target
from tests.cli import refused_cli, run_cli
from tests.reshard.formats.test_golden import GOLDEN, HF, _same_as_original

MEGATRON_LM = GOLDEN / "mlm-core-torch_dist-tp1pp1"  # Megatron-LM's save of HF (megatron-core's GPTModel names)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """The golden checkpoint at TP2: a layout only swift's args can tell the reader."""
    out = tmp_path_factory.mktemp("tp2") / "dist"
    convert(MEGATRON_LM, out, Target(format="torch_dist", layout=Layout(tp=2)))
    return out


@pytest.mark.parametrize("given", ["run", "checkpoint"])
def test_a_checkpoint_with_its_hf_config_exports_the_original_weights(tmp_path, given):
    run = tmp_path / "v0-20261127-101500"
    save_as_ms_swift(MEGATRON_LM, run, Layout(), step=1)  # older: never read
    newest = save_as_ms_swift(MEGATRON_LM, run, Layout(), step=12, hf_config=HF / "config.json")
    (run / "checkpoint-1" / "iter_0000001" / "__0_0.distcp").unlink()
    convert(run if given == "run" else newest, tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")


def test_its_layout_comes_from_swifts_args_and_its_architecture_from_config(tmp_path, monkeypatch, capsys, tp2):
    source = save_as_ms_swift(tp2, tmp_path / "run", Layout(tp=2))
    code, _ = run_cli(monkeypatch, capsys, "convert", source, tmp_path / "dist", "--to-tp", "1", "--config", HF / "config.json", "-q")
    assert code == 0
    args = torch.load(tmp_path / "dist" / "iter_0000001" / "common.pt", weights_only=False)["args"]
    assert (args.num_layers, args.tensor_model_parallel_size) == (2, 1)  # Megatron-LM's args: its loader needs them
    convert(tmp_path / "dist", tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")


def test_without_an_architecture_it_is_refused_naming_the_model(tmp_path, monkeypatch, capsys):
    """The HF model directory args.json names holds a config.json, outside the checkpoint: not followed."""
    base = tmp_path / "models" / "tiny"
    shutil.copytree(HF, base)
    source = save_as_ms_swift(MEGATRON_LM, tmp_path / "run", Layout(), model_dir=str(base))
    line = refused_cli(monkeypatch, capsys, ["convert", source, tmp_path / "hf", "--to-format", "hf", "-q"],
                       "ms-swift", str(base), "--config", untouched=(source,))
    assert "records no architecture" in line and not (tmp_path / "hf").exists()


def test_a_lora_llm_save_is_refused_by_name(tmp_path, monkeypatch, capsys):
    """`lora_llm` saves the model with its LoRA dropped (`peft_format=False`): nothing to merge from."""
    source = save_as_ms_swift(MEGATRON_LM, tmp_path / "run", Layout(), tuner_type="lora_llm", hf_config=HF / "config.json")
    for command in (["convert", source, tmp_path / "hf", "--to-format", "hf", "-q"], ["inspect", source]):
        refused_cli(monkeypatch, capsys, command, "ms-swift lora_llm save", "checkpoint-N-merged", untouched=(source,))
    assert json.loads((source / "args.json").read_text())["tuner_type"] == "lora_llm"


# --- LoRA saves (fixtures/golden/ms_swift_lora: swift's save written through megatron-core as its code does, and the
# same adapter in PEFT's own format, `truth/`) -------------------------------------------------------------------------
SWIFT_LORA = GOLDEN / "ms_swift_lora"


def _logits(model, tokens) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module")
def peft_merged():
    """The oracle: peft 0.21.2 loads the drawn adapter (`truth/`) onto transformers' HF base and merges it
    (`merge_and_unload`, the W + lora_alpha / r * B @ A that swift's own `LoraParallelLinear.merge` computes per shard)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(HF, dtype="float32")
    merged = PeftModel.from_pretrained(base, SWIFT_LORA / "tp1" / "truth").merge_and_unload()
    return {name: tensor.numpy() for name, tensor in merged.state_dict().items()}


def _same_as_peft_merged(hf_dir, expected) -> None:
    ours = load_file(str(hf_dir / "model.safetensors"))
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert np.allclose(ours[name], tensor, rtol=0, atol=1e-6), (name, np.abs(ours[name] - tensor).max())


# the fast tier keeps TP2 (the per-rank fc1 chunks); TP1 is the full tier's
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.fast)])
def test_a_lora_save_merged_and_as_peft_is_what_peft_makes_of_the_adapter(tmp_path, tp, peft_merged):
    """The issue's proof: swift's save merged into the HF base is peft's merge of the same adapter, and `--to-format peft`
    is the adapter in PEFT's format (r, lora_alpha, every tensor), whose logits peft gives as transformers gives the merged
    export's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = SWIFT_LORA / f"tp{tp}" / "run"
    convert(run, tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=HF))
    _same_as_peft_merged(tmp_path / "hf", peft_merged)
    convert(run, tmp_path / "peft", Target(format="peft"), hints=SourceHints(base=HF))
    ours, truth = (load_file(str(d / "adapter_model.safetensors")) for d in (tmp_path / "peft", SWIFT_LORA / f"tp{tp}" / "truth"))
    assert sorted(ours) == sorted(truth) and all(np.array_equal(ours[name], truth[name]) for name in truth)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (8, 32, False)
    tokens = np.random.default_rng(0).integers(0, 250, size=(2, 12))
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="float32"), tokens)
    base = AutoModelForCausalLM.from_pretrained(HF, dtype="float32")
    moved = np.abs(_logits(base, tokens) - merged).max()
    diff = np.abs(_logits(PeftModel.from_pretrained(base, tmp_path / "peft"), tokens) - merged).max()
    assert moved > 0.1 and diff < 1e-4, (moved, diff)


def test_merged_into_a_megatron_base_at_tp2_from_a_tp2_save_is_the_same(tmp_path, peft_merged):
    """A Megatron base at TP2: each shard of the base merges with its rows of the TP2 save's adapter."""
    convert(HF, tmp_path / "mcore", Target(format="torch_dist", layout=LayoutChange(tp=2)))
    convert(SWIFT_LORA / "tp2" / "run", tmp_path / "merged", Target(format="torch_dist", layout=LayoutChange(tp=1)),
            hints=SourceHints(base=tmp_path / "mcore"))
    convert(tmp_path / "merged", tmp_path / "hf", Target(format="hf"))
    _same_as_peft_merged(tmp_path / "hf", peft_merged)


@pytest.mark.parametrize("mistake", ["two layers' lora_A swapped", "fc1's lora_B read as the base's [gate; up]"])
def test_a_wrong_reading_of_the_lora_save_fails_the_oracle(tmp_path, monkeypatch, peft_merged, mistake):
    """The comparison can fail: layer 0's lora_A taken for layer 1's and back, or the TP2 save's linear_fc1 lora_B read as
    if its rows were the base's [gate; up] rather than each rank's own."""
    if mistake.startswith("two layers"):
        read = lora.MergedReader.a

        def swapped(self, stem, lead, cols):  # the save's two layers' lora_A, exchanged
            (start, stop), *_ = lead
            return read(self, stem, [(0, 2)], cols)[::-1][start:stop]

        monkeypatch.setattr(lora.MergedReader, "a", swapped)
    else:
        monkeypatch.setattr(lora, "SWIFT", replace(lora.SWIFT, fc1_b_per_rank=False))
    convert(SWIFT_LORA / "tp2" / "run", tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=HF))
    with pytest.raises(AssertionError, match="mlp" if "fc1" in mistake else "layers"):
        _same_as_peft_merged(tmp_path / "hf", peft_merged)


# --- an MoE model's routed experts (fixtures/golden/ms_swift_lora/qwen3_moe: one adapter per expert, saved at EP1 and EP2)
SWIFT_MOE, MOE_BASE = SWIFT_LORA / "qwen3_moe", GOLDEN / "lora" / "qwen3_moe" / "hf"


def _transformers_state(model) -> dict[str, np.ndarray]:
    return {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def peft_merged_moe():
    """The oracle: peft 0.21.2 loads the drawn per-expert adapter (`truth/`) onto transformers' Qwen3-MoE, whose experts
    are fused (`gate_up_proj`, `down_proj`), and merges it there (`merge_and_unload`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(MOE_BASE, dtype="float32")
    return _transformers_state(PeftModel.from_pretrained(base, SWIFT_MOE / "ep1" / "truth").merge_and_unload())


def _same_as_peft_merged_moe(hf_dir, expected) -> None:
    """The merged export, loaded by transformers (which fuses its per-expert weights), holds peft's merged weights."""
    from transformers import AutoModelForCausalLM

    ours = _transformers_state(AutoModelForCausalLM.from_pretrained(hf_dir, dtype="float32"))
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert np.allclose(ours[name], tensor, rtol=0, atol=1e-6), (name, np.abs(ours[name] - tensor).max())


# the fast tier keeps EP2 (the experts' adapters on two ranks); EP1 is the full tier's
@pytest.mark.parametrize("ep", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.fast)])
def test_experts_lora_merged_and_as_peft_is_what_peft_makes_of_the_adapter(tmp_path, ep, peft_merged_moe):
    """swift's save of an MoE model's LoRA (`all-linear`: attention and every routed expert's linear_fc1 / linear_fc2)
    merged into the HF base is peft's merge of the same adapter onto transformers' fused experts, from the EP1 and the
    EP2 save alike; `--to-format peft` is the adapter itself, per expert."""
    run, truth = SWIFT_MOE / f"ep{ep}" / "run", SWIFT_MOE / f"ep{ep}" / "truth"
    convert(run, tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=MOE_BASE))
    _same_as_peft_merged_moe(tmp_path / "hf", peft_merged_moe)
    expert, base = "model.layers.1.mlp.experts.3.down_proj.weight", load_file(str(MOE_BASE / "model.safetensors"))
    assert np.abs(load_file(str(tmp_path / "hf" / "model.safetensors"))[expert] - base[expert]).max() > 0.01
    convert(run, tmp_path / "peft", Target(format="peft"), hints=SourceHints(base=MOE_BASE))
    ours, theirs = (load_file(str(d / "adapter_model.safetensors")) for d in (tmp_path / "peft", truth))
    assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[name], theirs[name]) for name in theirs)


def test_experts_lora_merged_into_a_megatron_base_at_ep2_is_the_same(tmp_path, peft_merged_moe):
    """A Megatron base at EP2: each rank's experts merge with their own adapters of the EP1 save."""
    convert(MOE_BASE, tmp_path / "mcore", Target(format="torch_dist", layout=LayoutChange(ep=2)))
    convert(SWIFT_MOE / "ep1" / "run", tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=tmp_path / "mcore"))
    _same_as_peft_merged_moe(tmp_path / "hf", peft_merged_moe)


def test_two_experts_lora_swapped_fail_the_oracle(tmp_path, monkeypatch, peft_merged_moe):
    """The comparison can fail: the EP2 save's experts 0 and 1 given each other's lora_B."""
    read = lora.MergedReader.b

    def swapped(self, stem, lead, rows):
        if len(lead) < 2:  # not an expert's
            return read(self, stem, lead, rows)
        layers, (start, stop) = lead
        return read(self, stem, [layers, (0, 4)], rows)[:, [1, 0, 2, 3]][:, start:stop]

    monkeypatch.setattr(lora.MergedReader, "b", swapped)
    convert(SWIFT_MOE / "ep2" / "run", tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=MOE_BASE))
    with pytest.raises(AssertionError, match="mlp.experts"):
        _same_as_peft_merged_moe(tmp_path / "hf", peft_merged_moe)


def _lora_save(tmp_path, **args):
    """The TP1 LoRA save with args.json's fields changed."""
    save = tmp_path / "save"
    shutil.copytree(SWIFT_LORA / "tp1" / "run" / "checkpoint-1", save)
    file = save / "args.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | args))
    return save


@pytest.mark.parametrize("args, words", [
    ({"lora_rank": 4}, ("at rank 4", "give the base model")),
    ({"use_rslora": True}, ("use_rslora", "does not merge", "--merge_lora")),
    ({"modules_to_save": ["output_layer"]}, ("modules_to_save", "does not merge")),
    ({"lora_bias": "all"}, ("lora_bias", "does not merge")),
])
def test_bad_or_unmerged_lora_saves_are_refused_in_one_line(tmp_path, monkeypatch, capsys, args, words):
    save = _lora_save(tmp_path, **args)
    for to in ("hf", "peft"):
        refused_cli(monkeypatch, capsys, ["convert", save, tmp_path / "out", "--to-format", to, "--base", HF, "-q"], *words,
                    untouched=(save,))
    assert not (tmp_path / "out").exists()


def test_a_lora_save_needs_its_base(tmp_path, monkeypatch, capsys):
    other = GOLDEN / "families" / "minimax_m2" / "hf"  # a base of other shapes than the one trained on
    run = SWIFT_LORA / "tp1" / "run"
    refused_cli(monkeypatch, capsys, ["convert", run, tmp_path / "hf", "--to-format", "hf", "-q"], "LoRA adapter save", "--base")
    refused_cli(monkeypatch, capsys, ["convert", run, tmp_path / "hf", "--to-format", "hf", "--base", other, "-q"], "give the base model")
    assert not (tmp_path / "hf").exists()


def test_a_lora_save_without_its_args_json_is_refused_not_resharded(tmp_path, monkeypatch, capsys):
    """Without args.json the save would open as a model of adapter tensors: resharded, linear_fc1's lora_B would keep
    the TP2 ranks' [gate0; up0; gate1; up1] under a TP1 layout."""
    source = tmp_path / "checkpoint-1"
    shutil.copytree(SWIFT_LORA / "tp2" / "run" / "checkpoint-1", source)
    (source / "args.json").unlink()
    refused_cli(monkeypatch, capsys, ["convert", source, tmp_path / "out", "--to-tp", "1", "-q"], "ms-swift's LoRA adapter", "args.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("base, golden, tp, ep", [(HF, "tp1", 1, 1), (HF, "tp2", 2, 1), (MOE_BASE, "qwen3_moe/ep2", 1, 2)],
                         ids=["tp1", "tp2", "qwen3_moe-ep2"])
def test_the_lora_golden_is_what_the_fixture_writes(tmp_path, base, golden, tp, ep):
    """fixtures/ms_swift.py (megatron-core under torchrun) writes the committed save again, byte for byte but the DCP
    .metadata's save id (args.json names the base as the committed one does: from the repository's root)."""
    save_lora(tmp_path, base.relative_to(REPO), tp, ep)
    golden = SWIFT_LORA / golden
    files = [p.relative_to(golden) for p in golden.rglob("*") if p.is_file() and p.name != ".metadata"]
    assert len(files) == 6 + tp * ep
    for path in files:
        assert (tmp_path / path).read_bytes() == (golden / path).read_bytes(), path
