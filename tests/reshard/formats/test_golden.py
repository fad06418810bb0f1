"""Checkpoints written by the peer tools themselves (fixtures/golden, with their provenance and the script
that regenerates them): reshard reads them, reshards them, and exports the weights the HF model they were
made from holds, bit for bit. The oracle is the HF original that transformers saved."""

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.inspect import inspect
from reshard.layout import Layout
from reshard.request import SourceHints, Target
from reshard.verify import verify

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "golden"
HF = GOLDEN / "hf-llama-tiny"


def _same_as_original(export: Path) -> None:
    original, ours = load_file(HF / "model.safetensors"), load_file(export / "model.safetensors")
    assert sorted(ours) == sorted(original)
    for name, value in original.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
        assert np.array_equal(ours[name].view(np.uint8), value.view(np.uint8)), name


@pytest.mark.parametrize(
    "written_by", ["mlm-core-legacy-tp2pp2", "mlm-core-legacy-tp1pp1", "mlm-core-torch_dist-tp1pp1"]
)
def test_megatron_lm_converter_output_exports_the_original_weights(tmp_path, written_by):
    convert(GOLDEN / written_by, tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")


def test_megatron_lm_legacy_output_reshards_and_still_exports_the_original_weights(tmp_path):
    convert(GOLDEN / "mlm-core-legacy-tp2pp2", tmp_path / "dist", Target(format="torch_dist", layout=Layout(tp=1, pp=2)))
    convert(tmp_path / "dist", tmp_path / "legacy", Target(format="legacy", layout=Layout(tp=2, pp=1)))
    convert(tmp_path / "legacy", tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")


def test_a_flipped_bit_in_the_golden_weights_is_caught(tmp_path):
    """The comparison above can fail: one bit of one value changed in the original is found."""
    convert(GOLDEN / "mlm-core-legacy-tp1pp1", tmp_path / "hf", Target(format="hf"))
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name].view(np.uint32)[3, 5] ^= 1
    save_file(tensors, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(AssertionError, match=name):
        _same_as_original(tmp_path / "hf")


@pytest.mark.parametrize("written_by", ["bridge-torch_dist-tp1", "bridge-torch_dist-tp2"])
def test_megatron_bridge_output_exports_the_original_weights_and_config(tmp_path, written_by):
    """megatron-core 0.19 keeps the common state inside the .distcp files and Bridge keeps the architecture in
    run_config.yaml: both are read (rope base and norm epsilon included, which Megatron-LM's defaults lack)."""
    convert(GOLDEN / written_by, tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")
    ours, original = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", HF))
    assert ours["rms_norm_eps"] == original["rms_norm_eps"] == 1e-6
    assert ours["rope_theta"] == original["rope_parameters"]["rope_theta"] == 500000
    assert ours["vocab_size"] == original["vocab_size"]


def test_megatron_bridge_output_reshards_to_megatron_lm_layouts(tmp_path):
    convert(GOLDEN / "bridge-torch_dist-tp2", tmp_path / "pp2", Target(layout=Layout(tp=1, pp=2)))
    convert(tmp_path / "pp2", tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")


def test_a_bare_dist_checkpointing_directory_converts_with_config(tmp_path):
    bare = GOLDEN / "mcore019-torch_dist-bare"
    with pytest.raises(ReshardError, match="records no architecture, which --to-format hf needs .*pass --config"):
        convert(bare, tmp_path / "refused", Target(format="hf"))
    assert not (tmp_path / "refused").exists()
    assert inspect(bare, HF / "config.json").layout == str(Layout())
    convert(bare, tmp_path / "hf", Target(format="hf"), hints=SourceHints(config=HF / "config.json"))
    _same_as_original(tmp_path / "hf")


def test_a_bare_dist_checkpointing_directory_is_inspected_and_verified_without_an_architecture(tmp_path):
    """Its tensors are global: listing them and checksumming them needs no config (the HF side tells the
    true vocabulary, so padding rows do not count), and a changed value in the HF side is still caught."""
    bare = GOLDEN / "mcore019-torch_dist-bare"
    info = inspect(bare)
    assert info.config == {} and info.layout == "not recorded" and "architecture not recorded" in info.render()
    assert {t.name: t.shape for t in info.tensors}["decoder.layers.mlp.linear_fc1.weight"] == (2, 256, 64)
    assert verify(bare, against=HF).comparison.ok
    changed = tmp_path / "hf"
    shutil.copytree(HF, changed)
    tensors = load_file(HF / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"].view(np.uint32)[1, 2] ^= 1
    save_file(tensors, changed / "model.safetensors")
    assert verify(bare, against=changed).comparison.mismatched == ["decoder.layers.mlp.linear_fc2.weight"]


def test_a_config_that_contradicts_the_tensors_is_refused_naming_the_field(tmp_path):
    wrong = json.loads((HF / "config.json").read_text()) | {"intermediate_size": 96}
    (tmp_path / "config.json").write_text(json.dumps(wrong))
    with pytest.raises(ReshardError, match=r"linear_fc1.weight has shape \[2, 256, 64\].*check ffn_hidden_size"):
        convert(GOLDEN / "mcore019-torch_dist-bare", tmp_path / "out", Target(format="hf"), hints=SourceHints(config=tmp_path / "config.json"))
    assert not (tmp_path / "out").exists()


def test_a_run_config_that_contradicts_the_tensors_is_refused_naming_the_field(tmp_path):
    source = tmp_path / "bridge"
    shutil.copytree(GOLDEN / "bridge-torch_dist-tp1", source)
    run_config = source / "iter_0000000" / "run_config.yaml"
    run_config.write_text(run_config.read_text().replace("  num_query_groups: 2\n", "  num_query_groups: 1\n"))
    with pytest.raises(ReshardError, match="linear_qkv.weight has shape .*check num_attention_heads, num_query_groups"):
        inspect(source)


def test_config_is_refused_where_the_checkpoint_records_its_architecture():
    with pytest.raises(ReshardError, match="records its architecture in its args; drop --config"):
        inspect(GOLDEN / "mlm-core-torch_dist-tp1pp1", HF / "config.json")


def test_common_state_in_neither_place_is_refused(tmp_path):
    """A megatron-core 0.18-style directory (no common_state object) whose common.pt is gone."""
    source = tmp_path / "mlm"
    shutil.copytree(GOLDEN / "mlm-core-torch_dist-tp1pp1", source)
    (source / "iter_0000001" / "common.pt").unlink()
    with pytest.raises(ReshardError, match="has neither common.pt nor a common_state object"):
        convert(source, tmp_path / "out", Target(format="hf"))
    assert not (tmp_path / "out").exists()


def _saved(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_megatron_output_carries_megatron_lm_arguments_and_an_int_iteration(tmp_path, fmt):
    """What Megatron-LM's tools/checkpoint needs of the args (its whole argument set, derived values included)
    and of the iteration (an int; a release checkpoint keeps its directory and tracker)."""
    convert(HF, tmp_path / "out", Target(format=fmt, layout=Layout(tp=2, pp=2 if fmt == "legacy" else 1)))
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    name = "mp_rank_00_000/model_optim_rng.pt" if fmt == "legacy" else "common.pt"
    ours = _saved(tmp_path / "out" / "release" / name)
    golden = _saved(GOLDEN / "mlm-core-legacy-tp2pp2" / "iter_0000001" / "mp_rank_00_000" / "model_optim_rng.pt")
    assert ours["iteration"] == 0
    args, theirs = vars(ours["args"]), vars(golden["args"])
    assert set(theirs) - set(args) <= {"blendable_index_path"}  # set by its saver
    assert args["encoder_seq_length"] == args["seq_length"] == 4096
    assert (args["sequence_parallel"], args["apply_query_key_layer_scaling"], args["multi_latent_attention"]) == (False,) * 3
    assert (args["num_query_groups"], args["group_query_attention"], args["padded_vocab_size"]) == (2, True, 256)
    assert (args["rotary_base"], args["norm_epsilon"], args["params_dtype"]) == (500000.0, 1e-6, theirs["params_dtype"])
    assert args["model_type"] == theirs["model_type"] and args["world_size"] == 2 * (2 if fmt == "legacy" else 1)


def test_torch_dist_output_has_a_bridge_run_config_that_reads_back(tmp_path):
    from reshard.config import ModelConfig
    from reshard.formats import open_checkpoint
    from reshard.formats.model_args import bridge_args

    convert(HF, tmp_path / "out", Target(format="torch_dist", layout=Layout(tp=2)))
    args = bridge_args(tmp_path / "out" / "release" / "run_config.yaml")
    with open_checkpoint(tmp_path / "out") as reader:
        assert ModelConfig.from_megatron_args(args) == reader.config
        assert str(Layout.from_megatron_args(args)) == str(reader.layout) == str(Layout(tp=2))


def test_torch_dist_for_bridge_keeps_the_true_vocabulary_and_exports_the_original(tmp_path):
    """Megatron-Bridge saves, loads and exports the vocabulary unpadded (should_pad_vocab: false) and finds
    iter_* directories only: --for bridge writes it so (Bridge loading it: make_golden.py --only peers-load)."""
    from reshard.formats import open_checkpoint
    from reshard.formats.model_args import bridge_args

    convert(HF, tmp_path / "out", Target(format="torch_dist", layout=Layout(tp=2), for_bridge=True))
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    run_config = bridge_args(tmp_path / "out" / "iter_0000000" / "run_config.yaml")
    assert (run_config["vocab_size"], run_config["should_pad_vocab"]) == (250, False)
    with open_checkpoint(tmp_path / "out") as reader:
        assert reader.specs["embedding.word_embeddings.weight"].shape == (250, 64) and reader.common.iteration == 0
    convert(tmp_path / "out", tmp_path / "hf", Target(format="hf"))
    _same_as_original(tmp_path / "hf")


def test_for_bridge_refuses_a_format_bridge_does_not_load(tmp_path):
    with pytest.raises(ReshardError, match="--for bridge writes torch_dist, the one format Megatron-Bridge loads, not legacy"):
        convert(HF, tmp_path / "out", Target(format="legacy", for_bridge=True))
    assert not (tmp_path / "out").exists()


def _dcp_tensors(directory: Path) -> dict:
    """Every tensor of a DCP directory as torch's own DCP reader loads it (no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if hasattr(m, "size")}
    dcp.load(tensors, checkpoint_id=str(directory), no_dist=True)
    return {k: v.numpy() for k, v in tensors.items()}


def _same_bits(ours: np.ndarray, theirs: np.ndarray) -> bool:
    return ours.dtype == theirs.dtype and ours.shape == theirs.shape and np.array_equal(ours.view(np.uint8), theirs.view(np.uint8))


def _zarr_holds(store: Path, tensors: dict) -> None:
    """Each array of the store, opened with plain zarr, is the source's tensor bit for bit."""
    import zarr

    assert sorted(p.name for p in store.iterdir() if p.is_dir()) == sorted(tensors)
    for key, value in tensors.items():
        assert _same_bits(zarr.open_array(str(store / key), mode="r")[...], value), key


@pytest.mark.slow  # launches Megatron-Core to load what it converts
def test_a_bare_checkpoint_goes_to_zarr_and_back_without_an_architecture(tmp_path):
    """The tensors are global: megatron-core 0.19's bare save goes to zarr and back to torch_dist with no
    config, and megatron-core's own dist_checkpointing.load reads the result (each tensor and each layer's
    _extra_state) with the source's values bit for bit (the source read by torch's DCP reader, the store by zarr)."""
    import torch

    from tests.launch import run

    bare = GOLDEN / "mcore019-torch_dist-bare"
    source = _dcp_tensors(bare)
    convert(bare, tmp_path / "zarr", Target(format="zarr"))
    _zarr_holds(tmp_path / "zarr", source)
    convert(tmp_path / "zarr", tmp_path / "dist", Target(format="torch_dist"))
    run("fixtures.megatron_load_all", ["--load", tmp_path / "dist", "--out", tmp_path / "loaded.pt"], nproc=1)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    assert sorted(loaded["tensors"]) == sorted(source)
    for key, value in source.items():
        assert _same_bits(loaded["tensors"][key].numpy(), value), key
    assert len(loaded["objects"]) == 8 and set(loaded["objects"].values()) == {None}  # as the local spec saved them
    assert "args" not in loaded["common"]  # the source recorded no architecture, and neither does its copy


def test_a_bare_checkpoint_saved_at_tp2_goes_to_zarr_whole(tmp_path):
    """Megatron-Bridge's TP2 save without its run_config.yaml is a bare directory of two ranks' chunks:
    zarr gets each tensor whole, as torch's DCP reader assembles it."""
    bare = tmp_path / "bare"
    bridge_only = shutil.ignore_patterns("run_config.yaml", "tokenizer", "*train_state.pt")
    shutil.copytree(GOLDEN / "bridge-torch_dist-tp2" / "iter_0000000", bare, ignore=bridge_only)
    convert(bare, tmp_path / "zarr", Target(format="zarr"))
    _zarr_holds(tmp_path / "zarr", _dcp_tensors(bare))


@pytest.mark.parametrize(
    "flags, needs",
    [(["--to-tp", "2"], "a change of layout \\(to TP2PP1EP1\\)"), (["--to-format", "hf"], "--to-format hf"),
     (["--to-format", "legacy"], "--to-format legacy"), (["--to-format", "zarr", "--dtype", "bf16"], "--dtype")],
)
def test_what_needs_the_architecture_is_refused_in_one_line_without_it(tmp_path, monkeypatch, capsys, flags, needs):
    from tests.cli import run_cli

    code, lines = run_cli(monkeypatch, capsys, "convert", GOLDEN / "mcore019-torch_dist-bare", tmp_path / "out", *flags)
    assert code != 0 and len(lines) == 1 and "Traceback" not in lines[0]
    assert re.search(f"records no architecture, which {needs} needs .*: pass --config", lines[0]), lines[0]
    assert not (tmp_path / "out").exists()


def _peer(variable: str, name: str) -> Path:
    """A peer install (fixtures/golden/README.md, "Regenerating"): $variable, else beside this checkout."""
    return Path(os.environ.get(variable, GOLDEN.parents[2] / "peers" / name))


def megatron_lm_peer():
    """(Megatron-LM's venv, its tree, make_golden.py as a module), or the calling test is skipped with the reason."""
    venv, tree = _peer("MLM_VENV", "mlm-venv"), _peer("MLM_TREE", "mlm-tree")
    if not (venv / "bin" / "torchrun").exists() or not (tree / "tools" / "checkpoint" / "loader_core.py").exists():
        pytest.skip(f"needs Megatron-LM's peer install ({venv}, {tree}; MLM_VENV/MLM_TREE): shared/peers/setup_mlm.sh")
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    make_golden = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_golden)
    return venv, tree.resolve(), make_golden


@pytest.mark.slow  # runs Megatron-LM's own peer install
def test_megatron_lm_loads_reshards_torch_dist_at_tp2_pp2(tmp_path):
    """Megatron-LM's own load_checkpoint (core_v0.17.1 tree, its tools/checkpoint loader's arguments and GPT model,
    one gloo process per rank) reads reshard's torch_dist at TP2 PP2, and each rank's model then holds the HF
    original's weights bit for bit (its TP slice, stage-local layers; the real vocabulary rows)."""
    venv, tree, make_golden = megatron_lm_peer()
    convert(HF, tmp_path / "dist", Target(format="torch_dist", layout=Layout(tp=2, pp=2), naming="local"))
    checked = make_golden.mlm_load_ranks(venv, tree, tmp_path, "dist", 2, 2, HF)
    assert checked.endswith("30 tensors ok at TP2 PP2"), checked


# Where reshard's Megatron args may differ from those Megatron-LM's tools/checkpoint wrote for the same model
# (mlm-core-*): what that converter sets on its own command line and in its saver, ...
_CONVERTER_CHOICES = {
    "bias_dropout_fusion", "masked_softmax_fusion", "gradient_accumulation_fusion", "no_persist_layer_norm", "enable_one_logger",
    "mock_data", "data_path", "blendable_index_path", "no_load_optim", "no_load_rng", "no_save_optim", "no_save_rng",
    "perform_initialization", "use_cpu_initialization", "save", "save_interval", "global_batch_size",
}
_SAID_MISSING = {"no_save_optim", "no_save_rng"}
_ITS_ETP = {"expert_tensor_parallel_size"}  # its loader's 1 at any TP; validate_args' own default is TP, reshard's
# ... the model's facts that its converter loses (fixtures/golden/README.md) and where the tokenizer is, ...
_MODEL_FACTS = {"rotary_base", "layernorm_epsilon", "tokenizer_model"}
# ... and reshard's own record of the model: its HF origin, and ModelConfig fields core_v0.17.1 has no argument for.
_RESHARDS_OWN = {"hf_architecture", "hf_config", "hf_model_type", "hf_source", "norm_epsilon", "rope_scaling",
                 "beta_fast", "beta_slow", "original_max_position_embeddings", "qk_layernorm_full_width",
                 "yarn_correction_range_round_to_int"}


@pytest.mark.parametrize(
    "fmt, layout, golden",
    [("legacy", Layout(tp=2, pp=2), "mlm-core-legacy-tp2pp2/iter_0000001/mp_rank_00_000/model_optim_rng.pt"),
     ("torch_dist", Layout(), "mlm-core-torch_dist-tp1pp1/iter_0000001/common.pt")],
)
def test_megatron_args_are_what_validate_args_makes_of_the_model(tmp_path, fmt, layout, golden):
    """Megatron-LM's checkpoints carry its args after validate_args (derived sizes, dtypes as torch dtypes, deleted
    options gone): against the args Megatron-LM's own converter wrote for the same HF model at the same layout, every
    argument is the same except the ones listed above, each for its reason."""
    convert(HF, tmp_path / "out", Target(format=fmt, layout=layout, naming="local"))
    name = "mp_rank_00_000/model_optim_rng.pt" if fmt == "legacy" else "common.pt"
    ours, theirs = vars(_saved(tmp_path / "out" / "release" / name)["args"]), vars(_saved(GOLDEN / golden)["args"])
    differ = {k for k in ours.keys() | theirs.keys() if k not in ours or k not in theirs or repr(ours[k]) != repr(theirs[k])}
    expected = _CONVERTER_CHOICES | _MODEL_FACTS | _RESHARDS_OWN | (_ITS_ETP if layout.tp > 1 else set())
    if fmt == "torch_dist":  # reshard's torch_dist says what it lacks (an HF model has no RNG or optimizer state), as that converter does
        expected -= _SAID_MISSING
    assert differ == expected, sorted(differ ^ expected)
    assert (ours["layernorm_epsilon"], ours["rotary_base"]) == (1e-6, 500000.0)  # the HF model's, which Megatron-LM builds with


@pytest.mark.parametrize("given", ["root", "weights"])
def test_a_nemo2_checkpoint_is_refused_by_name(tmp_path, monkeypatch, capsys, given):
    """NeMo 2's layout (context/ beside a torch_dist weights/): not read (no NeMo-written checkpoint to prove a
    reader against), and said so in one line rather than read as a bare directory or as not a checkpoint."""
    from tests.cli import run_cli

    nemo = tmp_path / "nemo2"
    shutil.copytree(GOLDEN / "mcore019-torch_dist-bare", nemo / "weights")
    (nemo / "context").mkdir()
    (nemo / "context" / "model.yaml").write_text("_target_: nemo.collections.llm.gpt.model.llama.LlamaModel\n")
    path = nemo if given == "root" else nemo / "weights"
    for command in (["inspect", path], ["convert", path, tmp_path / "out", "--to-format", "zarr"]):
        code, lines = run_cli(monkeypatch, capsys, *command)
        assert code != 0 and lines == [f"reshard: error: {nemo} is a NeMo 2 checkpoint (context/ + weights/), which reshard does "
                                       "not read; export it to HF with NeMo (llm.export_ckpt) and convert that"], lines
    assert not (tmp_path / "out").exists()


def test_megatron_lms_layernorm_epsilon_is_read(tmp_path):
    """core_v0.17.1 names the norm epsilon layernorm_epsilon (its converter leaves it at 1e-5, README): a checkpoint
    whose args say 1e-6 exports rms_norm_eps 1e-6, not reshard's default."""
    import torch

    source = tmp_path / "mlm"
    shutil.copytree(GOLDEN / "mlm-core-legacy-tp1pp1", source)
    rank_file = source / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    saved = _saved(rank_file)
    assert not hasattr(saved["args"], "norm_epsilon")
    saved["args"].layernorm_epsilon = 1e-6
    torch.save(saved, rank_file)
    convert(source, tmp_path / "hf", Target(format="hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rms_norm_eps"] == 1e-6


def test_a_zarr_copy_without_an_architecture_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    """--config completes torch_dist checkpoints only: the refusal for a zarr copy of a bare checkpoint says so,
    and the way it names works (back to torch_dist, then --config to HF: the original weights)."""
    from tests.cli import run_cli

    convert(GOLDEN / "mcore019-torch_dist-bare", tmp_path / "zarr", Target(format="zarr"))
    code, lines = run_cli(monkeypatch, capsys, "convert", tmp_path / "zarr", tmp_path / "hf", "--to-format", "hf")
    assert code != 0 and len(lines) == 1
    assert "needs (head counts, gating, vocabulary): convert it to torch_dist (no --config needed) and there pass --config" in lines[0]
    from reshard.inspect import inspect

    assert "convert it to torch_dist and pass --config there" in inspect(tmp_path / "zarr").render()  # inspect says the same
    convert(tmp_path / "zarr", tmp_path / "dist", Target(format="torch_dist"))
    convert(tmp_path / "dist", tmp_path / "hf", Target(format="hf"), hints=SourceHints(config=HF / "config.json"))
    _same_as_original(tmp_path / "hf")


MLM_TRAIN = GOLDEN / "mlm-distopt-tp2dp2"  # Megatron-LM's own training run, saved at iteration 3 (make_golden.py mlm-train)


def test_megatron_lms_own_dp_reshardable_save_reads_as_its_fully_reshardable_save():
    """What a real Megatron-LM run (--use-distributed-optimizer, TP2 DP2, fp32) writes by default: reshard decodes
    its dp_reshardable buckets into every parameter's master weight, exp_avg and exp_avg_sq equal bit for bit to
    Megatron-LM's own fully_reshardable save of the same state (read alike), and the master weights are the model's."""
    from reshard.torchfile import dcp_metadata
    from tests.reshard.optim.test_dp_reshardable import assert_same, master_weights_are_the_model, optimizer_tensors

    stored = dcp_metadata.load(MLM_TRAIN / "checkpoint" / "iter_0000003" / ".metadata").tensors
    assert any(k.startswith("optimizer.distributed.") for k in stored) and not any(k.startswith("optimizer.state.") for k in stored)
    ours, _ = optimizer_tensors(MLM_TRAIN / "checkpoint")
    theirs, _ = optimizer_tensors(MLM_TRAIN / "oracle")
    assert len(ours) == 3 * 9  # 9 tensors: embedding, output layer, final norm, 6 of the layers (stacked)
    assert_same(ours, theirs)
    assert master_weights_are_the_model(MLM_TRAIN / "checkpoint", ours) == []


def _damaged_bucket(source: Path, dest: Path) -> str:
    """A copy of `source` with one bit changed in the middle of the first stored chunk of an exp_avg_sq bucket."""
    from reshard.torchfile import dcp_metadata

    shutil.copytree(source, dest)
    iter_dir = dest / "iter_0000003"
    metadata = dcp_metadata.load(iter_dir / ".metadata")
    key = next(k for k in metadata.tensors if k.startswith("optimizer.distributed.") and k.endswith("exp_avg_sq"))
    storage = metadata.storage[(key, metadata.tensors[key].chunks[0].offsets)]
    with open(iter_dir / storage.relative_path, "r+b") as f:
        f.seek(storage.offset + storage.length // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x40]))
    return key


def test_a_flipped_bit_in_megatron_lms_buckets_shows_against_its_fully_reshardable_save(tmp_path):
    """The control: one bit of one exp_avg_sq bucket changed in Megatron-LM's file, and the comparison above fails."""
    from tests.reshard.optim.test_dp_reshardable import assert_same, optimizer_tensors

    _damaged_bucket(MLM_TRAIN / "checkpoint", tmp_path / "damaged")
    ours, _ = optimizer_tensors(tmp_path / "damaged")
    with pytest.raises(AssertionError, match=r"optimizer\.state\.exp_avg_sq\..* differs"):
        assert_same(ours, optimizer_tensors(MLM_TRAIN / "oracle")[0])


@pytest.mark.slow  # launches Megatron-Core to load what it converts
def test_megatron_lms_own_save_reshards_to_what_megatron_core_loads(tmp_path):
    """reshard converts Megatron-LM's dp_reshardable save to TP1 PP2 (fully_reshardable), alike to converting its own
    fully_reshardable save; megatron-core 0.16's own dist_checkpointing.load then reads every tensor of the conversion,
    model and optimizer, equal bit for bit to Megatron-LM's fully_reshardable save (read by torch's DCP reader)."""
    import torch

    from tests.launch import run
    from tests.reshard.optim.test_dp_reshardable import assert_converted_alike

    for form in ("checkpoint", "oracle"):
        convert(MLM_TRAIN / form, tmp_path / form, Target(format="torch_dist", layout=Layout(tp=1, pp=2)))
    assert_converted_alike(tmp_path / "checkpoint", tmp_path / "oracle")
    run("fixtures.megatron_load_all", ["--load", tmp_path / "checkpoint", "--out", tmp_path / "loaded.pt"], nproc=1)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    oracle = _dcp_tensors(MLM_TRAIN / "oracle" / "iter_0000003")
    assert set(loaded["tensors"]) ^ set(oracle) == set() and len(oracle) == 4 * 9
    for key, value in oracle.items():
        assert _same_bits(loaded["tensors"][key].numpy(), value), key
    assert loaded["common"]["iteration"] == 3
    assert loaded["common"]["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
