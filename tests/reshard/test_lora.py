"""A LoRA adapter save as Megatron-Bridge writes it (fixtures/golden/lora/: Bridge 0.6.2's own save_checkpoint with
`cfg.peft`, adapter weights only) is a source together with the model it adapts (`--base`, HF or Megatron). The oracle
is Bridge's own merged export of the same model (`export_hf_weights(merge_adapter_weights=True)`) and its own PEFT
adapter (`save_hf_adapter`), from saves at TP1 and TP2; and `peft`, loading the adapter onto the HF base."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from reshard import lora
from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.logical import Split, TensorSpec, describe
from reshard.request import LayoutChange, SourceHints, Target
from reshard.sharding import pieces
from tests.bridge import bridge
from tests.cli import refused_cli
from tests.reshard.formats.test_golden import GOLDEN, HF

LORA = GOLDEN / "lora" / "tp1"
ADAPTER = LORA / "adapter"
SAVES = ["tp1", "tp2"]
MOE = GOLDEN / "lora" / "qwen3_moe"  # a Qwen3-MoE with every expert adapted; Bridge's HF exports are those of its EP1 save


def _same_as_bridge_merged(hf_dir: Path, save: str = "tp1") -> None:
    ours, bridge = load_file(str(hf_dir / "model.safetensors")), load_file(str(GOLDEN / "lora" / save / "merged.safetensors"))
    assert sorted(ours) == sorted(bridge)
    for name, tensor in bridge.items():
        assert ours[name].dtype == tensor.dtype and np.array_equal(ours[name], tensor), name


@pytest.mark.parametrize("save", SAVES)
def test_merged_into_an_hf_base_is_bridges_merged_export(tmp_path, save):
    convert(GOLDEN / "lora" / save / "adapter", tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=HF))
    _same_as_bridge_merged(tmp_path / "hf", save)
    base = load_file(str(HF / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"]
    assert not np.array_equal(load_file(str(tmp_path / "hf" / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"], base)


def test_merged_into_a_megatron_base_at_tp2_is_the_same(tmp_path):
    """The base as a Megatron checkpoint at TP2: the adapter (saved at TP1) merges per shard of the base's layout; the
    merged model written as torch_dist at TP1 holds the same weights; the PEFT adapter names the family it was imported
    from."""
    convert(HF, tmp_path / "mcore", Target(format="torch_dist", layout=LayoutChange(tp=2)))
    convert(ADAPTER, tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=tmp_path / "mcore"))
    _same_as_bridge_merged(tmp_path / "hf")
    convert(ADAPTER, tmp_path / "merged", Target(format="torch_dist", layout=LayoutChange(tp=1)), hints=SourceHints(base=tmp_path / "mcore"))
    convert(tmp_path / "merged", tmp_path / "hf1", Target(format="hf"))
    _same_as_bridge_merged(tmp_path / "hf1")
    convert(ADAPTER, tmp_path / "peft", Target(format="peft"), hints=SourceHints(base=tmp_path / "mcore"))
    ours, bridge = (load_file(str(d / "peft" / "adapter_model.safetensors")) for d in (tmp_path, LORA))
    assert sorted(ours) == sorted(bridge) and all(np.array_equal(ours[name], bridge[name]) for name in bridge)


def test_a_wrong_merge_fails_the_oracle(tmp_path, monkeypatch):
    """The comparison can fail: linear_qkv's B with its rows of the two GQA groups swapped (q/k/v of one group taken for
    the other's) is caught."""
    read = lora.MergedReader.read

    def swapped(self, name, region):
        out = read(self, name, region)
        return np.concatenate([out[:, 64:], out[:, :64]], axis=1) if name.endswith("linear_qkv.weight") else out

    monkeypatch.setattr(lora.MergedReader, "read", swapped)
    convert(ADAPTER, tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=HF))
    with pytest.raises(AssertionError, match="q_proj|k_proj|v_proj"):
        _same_as_bridge_merged(tmp_path / "hf")


def test_the_peft_section_is_read():
    assert lora.lora_config(ADAPTER) == lora.LoraConfig(dim=4, alpha=8.0)
    assert lora.lora_config(ADAPTER).scale == 2.0
    assert lora.lora_config(GOLDEN / "bridge-torch_dist-tp1") is None
    # ms-swift's args.json (fixtures/golden/ms_swift_lora): its rank, alpha and TP, under peft's names
    swift = lora.lora_config(GOLDEN / "ms_swift_lora" / "tp2" / "run")
    assert swift == lora.LoraConfig(dim=8, alpha=32.0, names=lora.SWIFT, saved_tp=2) and swift.scale == 4.0


def test_bad_input_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    refused_cli(monkeypatch, capsys, ["convert", ADAPTER, out, "--to-format", "hf", "-q"], "LoRA adapter save", "--base")
    refused_cli(monkeypatch, capsys, ["convert", HF, out, "--to-format", "torch_dist", "--base", HF, "-q"], "--base is for a LoRA")
    refused_cli(monkeypatch, capsys, ["convert", HF, out, "--to-format", "peft", "-q"], "--to-format peft writes a LoRA adapter")
    other = GOLDEN / "families" / "minimax_m2" / "hf"  # a base of other shapes than the one trained on
    for to in ("hf", "peft"):
        refused_cli(monkeypatch, capsys, ["convert", ADAPTER, out, "--to-format", to, "--base", other, "-q"], "give the base model")
    assert not out.exists()
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    refused_cli(monkeypatch, capsys, ["convert", ADAPTER, out, "--to-format", "peft", "--base", HF, "-q"], "not empty", "--overwrite",
                untouched=(out,))


@pytest.mark.parametrize("save", SAVES)
def test_the_peft_adapter_is_bridges_own(tmp_path, save):
    """`--to-format peft` writes the tensors Bridge's own `save_hf_adapter` wrote, bit for bit, and its r and alpha."""
    bridge_dir = GOLDEN / "lora" / save
    convert(bridge_dir / "adapter", tmp_path / "peft", Target(format="peft"), hints=SourceHints(base=HF))
    ours, bridge = (load_file(str(d / "peft" / "adapter_model.safetensors")) for d in (tmp_path, bridge_dir))
    assert sorted(ours) == sorted(bridge) and all(np.array_equal(ours[name], bridge[name]) for name in bridge)
    config, theirs = (json.loads((d / "peft" / "adapter_config.json").read_text()) for d in (tmp_path, bridge_dir))
    assert {k: v for k, v in config.items() if k != "base_model_name_or_path"} == {k: v for k, v in theirs.items()
                                                                                    if k in config and k != "base_model_name_or_path"}


def _logits(model, tokens) -> np.ndarray:
    import torch

    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()


def _peft_logits(adapter: Path, tokens) -> np.ndarray:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(HF, dtype="float32")
    return _logits(PeftModel.from_pretrained(base, adapter), tokens)


# the fast tier keeps the proof itself (its ~5 s are transformers' and peft's imports); the sabotaged cases are the full tier's
@pytest.mark.parametrize("sabotage", [pytest.param(None, marks=pytest.mark.fast),
                                      pytest.param("k/v rows of lora_B swapped", marks=pytest.mark.slow),
                                      pytest.param("lora_alpha doubled", marks=pytest.mark.slow)])
def test_peft_loads_the_adapter_onto_the_hf_base_with_the_merged_models_logits(tmp_path, sabotage):
    """The issue's proof: `peft` (with transformers' Llama) loads the exported adapter onto the HF base and gives the
    logits of transformers' model of reshard's merged export; a deliberate error in the adapter fails it."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    convert(ADAPTER, tmp_path / "peft", Target(format="peft"), hints=SourceHints(base=HF))
    convert(ADAPTER, tmp_path / "merged", Target(format="hf"), hints=SourceHints(base=HF))
    adapter = tmp_path / "peft"
    if sabotage == "k/v rows of lora_B swapped":
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        k, v = (f"base_model.model.model.layers.1.self_attn.{p}_proj.lora_B.weight" for p in "kv")
        tensors[k], tensors[v] = tensors[v], tensors[k]
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
    elif sabotage == "lora_alpha doubled":
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 2 * config["lora_alpha"]}))
    tokens = np.random.default_rng(0).integers(0, 250, size=(2, 12))
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype="float32"), tokens)
    base = _logits(AutoModelForCausalLM.from_pretrained(HF, dtype="float32"), tokens)
    diff, moved = np.abs(_peft_logits(adapter, tokens) - merged).max(), np.abs(base - merged).max()
    assert moved > 0.1  # the adapter changes the model's logits well beyond the tolerance
    assert (diff < 1e-4) == (sabotage is None), (diff, moved)


def test_a_nemo_rl_step_of_a_lora_run_is_an_adapter_save(tmp_path):
    """NeMo-RL's Megatron policy with `megatron_cfg.peft.enabled` saves through Bridge's save_checkpoint with `cfg.peft` set
    (nemo_rl/models/megatron/setup.py), into `step_N/policy/weights/`: the step is the adapter save."""
    step = tmp_path / "run" / "step_3"
    shutil.copytree(ADAPTER, step / "policy" / "weights")
    (step / "training_info.json").write_text(json.dumps({"step": 3}))
    convert(tmp_path / "run", tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=HF))
    _same_as_bridge_merged(tmp_path / "hf")


@dataclass
class _Adapter:  # an adapter save's tensor names, as `lora.adapted` reads them
    names: list[str]
    path: Path = Path("ADAPTER")

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return {name: describe(name, (2, 4, 8, 8), "float32", None) for name in self.names}


def test_what_reshard_does_not_merge_is_refused_by_name(tmp_path):
    q_proj = "decoder.layers.self_attention.linear_q_proj"  # MLA's
    with pytest.raises(ReshardError) as refused:
        lora.adapted(_Adapter([q_proj + lora.IN, q_proj + lora.OUT]))
    assert all(word in str(refused.value) for word in ("linear_q_proj.adapter", "does not merge")), refused.value
    with pytest.raises(ReshardError, match=r"no adapter\.linear_out\.weight beside it"):
        lora.adapted(_Adapter(["decoder.layers.mlp.linear_fc2" + lora.IN]))
    # ms-swift's: `all-router`'s router, RLHF's second adapter `ref_adapter`, `all-embedding`'s embedding
    for name in ("decoder.layers.mlp.router.lora_A.default.weight", "decoder.layers.mlp.linear_fc1.lora_A.ref_adapter.weight",
                 "embedding.word_embeddings.lora_embedding_A.default"):
        with pytest.raises(ReshardError, match="does not merge"):
            lora.adapted(_Adapter([name]), lora.SWIFT)
    save = tmp_path / "save"
    shutil.copytree(MOE / "ep1" / "adapter", save)
    run_config = save / "iter_0000000" / "run_config.yaml"
    for field in ("normalize_moe_lora", "experts_shared_outer_loras"):  # experts' adapters of other ranks or shapes
        run_config.write_text(run_config.read_text().replace(f"{field}: false", f"{field}: true"))
        with pytest.raises(ReshardError, match=f"peft.{field} is true.*merge_adapter_weights"):
            lora.lora_config(save)
        run_config.write_text(run_config.read_text().replace(f"{field}: true", f"{field}: false"))
    assert lora.lora_config(save) == lora.LoraConfig(dim=4, alpha=8.0)


@pytest.mark.slow
@pytest.mark.parametrize("base, golden", [(HF, LORA), (MOE / "hf", MOE / "ep1")], ids=["llama-tp1", "qwen3_moe-ep1"])
def test_the_golden_is_what_bridge_saves(tmp_path, base, golden):
    """fixtures/bridge_lora.py under Megatron-Bridge's venv writes the committed TP1 (and MoE EP1) golden again: the
    same adapter tensors, merged export and PEFT adapter, byte for byte (skipped, visibly, where that venv is absent,
    as in CI)."""
    bridge(base, tmp_path, script="bridge_lora.py")
    for path in ("adapter/iter_0000000/__0_0.distcp", "merged.safetensors", "peft/adapter_model.safetensors"):
        assert (tmp_path / path).read_bytes() == (golden / path).read_bytes(), path


def test_the_adapters_partition_rules_are_how_bridge_splits_them_at_tp2():
    """Bridge's TP2 save holds each adapter tensor in the chunks its ranks own: reshard's rules (`logical`) cut each
    where Bridge did (linear_in over the rank or the input, linear_out over the outputs, per gate/up half), and the other
    split would not."""
    reader = open_checkpoint(GOLDEN / "lora" / "tp2" / "adapter")

    def cut(spec):
        return sorted({piece.region for piece in pieces(spec, reader.config, reader.layout) if piece.primary})

    assert len(reader.specs) == 8
    for name, spec in reader.specs.items():
        assert cut(spec) == sorted(reader.stored_regions(name)), name
        other = Split.ROW if spec.split is Split.COLUMN else Split.COLUMN
        assert cut(replace(spec, split=other, gated=False)) != sorted(reader.stored_regions(name)), name
        if spec.gated:  # fc1's linear_out: each rank holds its rows of the gate and of the up half, not one run of rows
            assert cut(replace(spec, gated=False)) != sorted(reader.stored_regions(name)), name


def _same_as_bridges_moe(ours: dict[str, np.ndarray], file: str) -> None:
    theirs = load_file(str(MOE / "ep1" / file))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and np.array_equal(ours[name], tensor), name


@pytest.mark.parametrize("save", ["ep1", "ep2"])
def test_experts_lora_merged_and_as_peft_is_bridges_own(tmp_path, save):
    """An MoE model's experts' LoRA (one adapter per expert: Bridge's `linear_fc1`/`linear_fc2` targets on
    SequentialMLP's experts), saved at EP1 and at EP2 (the experts' adapters on two ranks, the same values): merged into
    the HF base it is Bridge's merged export, and `--to-format peft` is Bridge's `save_hf_adapter`, bit for bit."""
    convert(MOE / save / "adapter", tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=MOE / "hf"))
    merged = load_file(str(tmp_path / "hf" / "model.safetensors"))
    _same_as_bridges_moe(merged, "merged.safetensors")
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert not np.array_equal(merged[expert], load_file(str(MOE / "hf" / "model.safetensors"))[expert])
    convert(MOE / save / "adapter", tmp_path / "peft", Target(format="peft"), hints=SourceHints(base=MOE / "hf"))
    _same_as_bridges_moe(load_file(str(tmp_path / "peft" / "adapter_model.safetensors")), "peft/adapter_model.safetensors")


def test_experts_lora_merged_into_a_megatron_base_at_ep2_is_the_same(tmp_path):
    """The base as a Megatron checkpoint at EP2: each rank's experts merge with their own adapters (saved at EP1)."""
    convert(MOE / "hf", tmp_path / "mcore", Target(format="torch_dist", layout=LayoutChange(ep=2)))
    convert(MOE / "ep1" / "adapter", tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=tmp_path / "mcore"))
    _same_as_bridges_moe(load_file(str(tmp_path / "hf" / "model.safetensors")), "merged.safetensors")


def test_two_experts_adapters_swapped_fail_the_oracle(tmp_path, monkeypatch):
    """The comparison can fail: the merge given expert 1's adapters for expert 0 and expert 0's for expert 1."""
    read = lora.MergedReader.read

    class Swapped:  # the adapter save with experts 0 and 1 exchanged
        def __init__(self, adapter):
            self.adapter, self.specs = adapter, adapter.specs

        def read(self, name, region):
            if not self.specs[name].experts:
                return self.adapter.read(name, region)
            whole = self.adapter.read(name, [(0, d) for d in self.specs[name].shape])[:, [1, 0, 2, 3]]
            return whole[tuple(slice(start, stop) for start, stop in region)]

        def close(self):
            self.adapter.close()

    def swapped(self, name, region):
        if not isinstance(self.adapter, Swapped):
            self.adapter = Swapped(self.adapter)
        return read(self, name, region)

    monkeypatch.setattr(lora.MergedReader, "read", swapped)
    convert(MOE / "ep1" / "adapter", tmp_path / "hf", Target(format="hf"), hints=SourceHints(base=MOE / "hf"))
    with pytest.raises(AssertionError, match=r"experts\.[01]\."):
        _same_as_bridges_moe(load_file(str(tmp_path / "hf" / "model.safetensors")), "merged.safetensors")


def test_the_experts_adapters_partition_rules_are_how_bridge_splits_them_at_ep2():
    """Bridge's EP2 save holds each expert's adapters on the rank that owns the expert: reshard's cut (`sharding.pieces`)
    of every adapter tensor is where Bridge stored it."""
    reader = open_checkpoint(MOE / "ep2" / "adapter")
    assert sum(spec.experts for spec in reader.specs.values()) == 4
    for name, spec in reader.specs.items():
        cut = sorted({piece.region for piece in pieces(spec, reader.config, reader.layout) if piece.primary})
        assert cut == sorted(reader.stored_regions(name)), name


@pytest.mark.slow
@pytest.mark.parametrize("sabotage", [None, "two experts' lora_B swapped"])
def test_peft_loads_the_experts_adapter_onto_transformers_moe_with_the_merged_models_logits(tmp_path, sabotage):
    """peft 0.21.2 loads the per-expert adapter (`experts.{e}.gate_proj.lora_A`, ...) onto transformers 5.24's fused
    experts (`gate_up_proj`, `down_proj`, as its target_parameters) and gives the logits of transformers' model of the
    merged export; two experts' adapters swapped fail it."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    convert(MOE / "ep1" / "adapter", tmp_path / "peft", Target(format="peft"), hints=SourceHints(base=MOE / "hf"))
    convert(MOE / "ep1" / "adapter", tmp_path / "merged", Target(format="hf"), hints=SourceHints(base=MOE / "hf"))
    if sabotage:
        tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
        one, two = (f"base_model.model.model.layers.1.mlp.experts.{e}.down_proj.lora_B.weight" for e in (0, 1))
        tensors[one], tensors[two] = tensors[two], tensors[one]
        save_file(tensors, str(tmp_path / "peft" / "adapter_model.safetensors"))
    tokens = np.random.default_rng(0).integers(0, 250, size=(2, 12))
    merged = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype="float32"), tokens)
    base = AutoModelForCausalLM.from_pretrained(MOE / "hf", dtype="float32")
    moved = np.abs(_logits(base, tokens) - merged).max()
    diff = np.abs(_logits(PeftModel.from_pretrained(base, tmp_path / "peft"), tokens) - merged).max()
    assert moved > 0.1
    assert (diff < 1e-4) == (sabotage is None), (diff, moved)
