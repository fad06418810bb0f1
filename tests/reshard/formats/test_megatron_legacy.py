"""Legacy rank files are checked with plain torch.load and slicing written here, independent of sharding.py."""

import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from fixtures.models import TINY_LLAMA, TINY_MOE, TINY_TIED
from fixtures.synthetic import SyntheticReader, rewrite_args, write_synthetic
from reshard.cli import main
from reshard.convert import convert
from reshard.dtypes import to_torch
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.layout import Layout
from reshard.request import Target
from reshard.sharding import full_region
from tests.arrays import same
from tests.cli import refused_by_every_command
from tests.converters.hf_models import build
from tests.launch import run
from tests.megatron import CKPT, layout_args


def _global(source, name):
    return to_torch(source.read(name, full_region(source.specs[name].shape)))


def _rank(path, tp, pp=None, ep=None):
    name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pp is not None else "") + (f"_{ep:03d}" if ep is not None else "")
    return torch.load(path / "iter_0000010" / name / "model_optim_rng.pt", weights_only=False)


def test_dense_rank_files_hold_megatron_shards(tmp_path, dtype):
    write_synthetic(tmp_path / "ckpt", TINY_LLAMA, Layout(tp=2, pp=2), "legacy", dtype=dtype)
    src = SyntheticReader(TINY_LLAMA, Layout(tp=2, pp=2), dtype)
    qkv = _global(src, "decoder.layers.self_attention.linear_qkv.weight")
    fc1 = _global(src, "decoder.layers.mlp.linear_fc1.weight")
    proj = _global(src, "decoder.layers.self_attention.linear_proj.weight")
    emb = _global(src, "embedding.word_embeddings.weight")
    norm = _global(src, "decoder.layers.self_attention.linear_qkv.layer_norm_weight")
    for tp in range(2):
        first, second = _rank(tmp_path / "ckpt", tp, 0), _rank(tmp_path / "ckpt", tp, 1)
        assert first["args"].tensor_model_parallel_size == 2 and first["args"].pipeline_model_parallel_size == 2
        assert same(first["model"]["embedding.word_embeddings.weight"], emb.chunk(2)[tp])
        # stage 1 holds global layers 2 and 3 as local layers 0 and 1
        m = second["model"]
        assert same(m["decoder.layers.1.self_attention.linear_qkv.weight"], qkv[3].chunk(2)[tp])
        assert same(m["decoder.layers.0.self_attention.linear_proj.weight"], proj[2].chunk(2, dim=1)[tp])
        gate, up = fc1[2].chunk(2)
        assert same(m["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate.chunk(2)[tp], up.chunk(2)[tp]]))
        # Transformer Engine naming (Megatron-LM's default) fuses the norm into linear_qkv
        assert same(m["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"], norm[2])
        assert "output_layer.weight" in m and "output_layer.weight" not in first["model"]
        assert m["decoder.layers.0.self_attention.linear_qkv._extra_state"] is None


def test_local_spec_names_and_tied_embedding_copy(tmp_path):
    from reshard.convert import convert

    write_synthetic(tmp_path / "te", TINY_TIED, Layout(pp=2), "legacy")
    convert(tmp_path / "te", tmp_path / "local", Target(naming="local"))
    src = SyntheticReader(TINY_TIED, Layout(pp=2))
    emb = _global(src, "embedding.word_embeddings.weight")
    first, last = _rank(tmp_path / "local", 0, 0)["model"], _rank(tmp_path / "local", 0, 1)["model"]
    assert "decoder.layers.0.input_layernorm.weight" in first and "decoder.layers.0.pre_mlp_layernorm.weight" in first
    # tied embeddings: the last stage keeps its own copy as output_layer.weight, as Megatron does
    assert same(last["output_layer.weight"], emb)
    assert _rank(tmp_path / "local", 0, 0)["args"].transformer_impl == "local"


def test_experts_are_numbered_per_rank(tmp_path):
    write_synthetic(tmp_path / "ckpt", TINY_MOE, Layout(ep=2), "legacy")
    src = SyntheticReader(TINY_MOE, Layout(ep=2))
    fc2 = _global(src, "decoder.layers.mlp.experts.experts.linear_fc2.weight")
    router = _global(src, "decoder.layers.mlp.router.weight")
    for ep in range(2):
        m = _rank(tmp_path / "ckpt", 0, None, ep)["model"]
        for j in range(2):
            assert same(m[f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc2.weight"], fc2[1, ep * 2 + j])
        assert same(m["decoder.layers.1.mlp.router.weight"], router[1])


def test_reader_reads_tensor_bytes_with_pread_not_through_the_map(tmp_path):
    from reshard.formats.megatron_legacy import LegacyReader

    layout = Layout(tp=2, pp=2)
    write_synthetic(tmp_path / "ckpt", TINY_LLAMA, layout, "legacy")
    source = SyntheticReader(TINY_LLAMA, layout)
    with LegacyReader(tmp_path / "ckpt") as reader:
        for name, spec in reader.specs.items():
            assert same(reader.read(name, full_region(spec.shape)), source.read(name, full_region(spec.shape))), name
        assert len(reader._files) == 4  # every rank file was read with pread (the mapped fallback opens none)


def _edit_rank_files(root, edit):
    for f in sorted((root / "iter_0000010").glob("mp_rank_*/model_optim_rng.pt")):
        state = torch.load(f, weights_only=False)
        edit(f.parent.name, state)
        torch.save(state, f)


@pytest.mark.parametrize("layout_string", [None, "Et*3|t*1L"])
def test_stages_split_otherwise_than_the_args_say_are_refused(tmp_path, layout_string):
    """Saved as 3+1 layers; the args say an even split, or state it in a form reshard does not read.
    Read by the args, stage 1's layer would land on layer 2 and layer 3 would be gone."""
    write_synthetic(tmp_path / "ckpt", TINY_LLAMA, Layout(pp=2, first_stage_layers=3), "legacy")

    def restate(_, state):
        state["args"].decoder_first_pipeline_num_layers = None
        state["args"].pipeline_model_parallel_layout = layout_string

    _edit_rank_files(tmp_path / "ckpt", restate)
    with pytest.raises(ReshardError, match="pipeline_model_parallel_layout" if layout_string else "stage sizes in the args"):
        open_checkpoint(tmp_path / "ckpt")


def test_a_layer_missing_from_a_rank_file_is_refused(tmp_path):
    write_synthetic(tmp_path / "ckpt", TINY_LLAMA, Layout(pp=2), "legacy")

    def drop(name, state):
        if name == "mp_rank_00_001":
            del state["model"]["decoder.layers.1.mlp.linear_fc2.weight"]

    _edit_rank_files(tmp_path / "ckpt", drop)
    with pytest.raises(ReshardError, match=r"linear_fc2.weight is missing for layer\(s\) \[3\]"):
        open_checkpoint(tmp_path / "ckpt")


def test_expert_tp_below_tp_reads_the_files_megatron_writes(tmp_path):
    """Megatron names a legacy rank file by its writer's TP and EP ranks (megatron/training/checkpointing.py,
    get_checkpoint_name), and only expert-data-parallel rank 0 writes: with ETP < TP not every pair is a
    rank. TP2 EP2 ETP1 on 4 GPUs writes mp_rank_00_000 and mp_rank_01_001 only; those two read as the
    whole model, and without either some weights are in no file."""
    import shutil

    layout = Layout(tp=2, ep=2, etp=1)
    write_synthetic(tmp_path / "ckpt", TINY_MOE, layout, "legacy")  # every pair: a superset of Megatron's
    iteration = tmp_path / "ckpt" / "iter_0000010"
    for name in ("mp_rank_00_001", "mp_rank_01_000"):
        shutil.rmtree(iteration / name)
    src = SyntheticReader(TINY_MOE, layout)
    with open_checkpoint(tmp_path / "ckpt") as reader:
        assert reader.specs.keys() == src.specs.keys()
        for name in src.specs:
            assert same(_global(reader, name), _global(src, name)), name
        assert {r.file.split("/")[0] for name in reader.specs for r in reader.stored_records(name)} == {"mp_rank_00_000", "mp_rank_01_001"}
    convert(tmp_path / "ckpt", tmp_path / "dist", Target(format="torch_dist", layout=Layout(tp=1, ep=4, etp=1)))
    with open_checkpoint(tmp_path / "dist") as converted:
        for name in src.specs:
            assert same(_global(converted, name), _global(src, name)), name
    shutil.rmtree(iteration / "mp_rank_01_001")
    with pytest.raises(ReshardError, match=r"mp_rank_0\d_00\d/model_optim_rng.pt is missing but args say TP2PP1EP2ETP1"):
        open_checkpoint(tmp_path / "ckpt")


def test_a_rank_file_linked_from_outside_the_checkpoint_is_refused(tmp_path):
    """A rank file that is a symlink to a file elsewhere is refused in one line; the link target is not read."""
    source, elsewhere = tmp_path / "src", tmp_path / "elsewhere"
    write_synthetic(source, TINY_LLAMA, Layout(tp=2), "legacy")
    rank_file = next(source.rglob("mp_rank_01/model_optim_rng.pt"))
    elsewhere.mkdir()
    shutil.move(rank_file, elsewhere / rank_file.name)
    rank_file.symlink_to(elsewhere / rank_file.name)
    with pytest.raises(ReshardError, match="leads outside the checkpoint"):
        convert(source, tmp_path / "out", Target(format="zarr"))
    assert not (tmp_path / "out").exists()


NAMED_LIKE = "and expert_model_parallel_size=1, but it has rank directories named like"
HOLD = "but its rank directories"
MISSING = "is missing but args say"


@pytest.mark.parametrize("config, saved, args, words", [
    (TINY_LLAMA, Layout(tp=2), dict(tensor_model_parallel_size=4), f"mp_rank_02/model_optim_rng.pt {MISSING} TP4PP1EP1"),
    (TINY_LLAMA, Layout(tp=2), dict(tensor_model_parallel_size=1), f"tensor_model_parallel_size=1, {HOLD} (mp_rank_00 to mp_rank_01) hold 2"),
    (TINY_LLAMA, Layout(tp=2), dict(pipeline_model_parallel_size=2), f"pipeline_model_parallel_size=2 {NAMED_LIKE} mp_rank_00"),
    (TINY_LLAMA, Layout(pp=2), dict(pipeline_model_parallel_size=1), f"pipeline_model_parallel_size=1 {NAMED_LIKE} mp_rank_00_000"),
    (TINY_LLAMA, Layout(pp=2), dict(pipeline_model_parallel_size=4), f"mp_rank_00_002/model_optim_rng.pt {MISSING} TP1PP4EP1"),
    (TINY_LLAMA, Layout(tp=2, pp=2), dict(tensor_model_parallel_size=1), f"tensor_model_parallel_size=1, {HOLD}"),
    (TINY_MOE, Layout(ep=4), dict(expert_model_parallel_size=2), f"expert_model_parallel_size=2, {HOLD} (mp_rank_00_000 to mp_rank_00_003) hold 4"),
    (TINY_MOE, Layout(tp=2, pp=2, ep=2), dict(expert_model_parallel_size=1),
     "expert_model_parallel_size=1, but it has rank directories named like mp_rank_00_000_000"),
], ids=lambda v: str(v)[:30] if isinstance(v, dict) else None)
def test_args_that_contradict_the_rank_directories_are_refused_by_name(tmp_path, monkeypatch, capsys, config, saved, args, words):
    """The files say the layout: a checkpoint whose args name its mp_rank_* directories otherwise, or fewer ranks
    than there are, is refused naming the arg (more ranks than there are: naming the rank file missing, for the
    checkpoint may be incomplete), by inspect, verify and convert alike, and left as it was."""
    source = tmp_path / "src"
    write_synthetic(source, config, saved, "legacy")
    rewrite_args(source, **args)
    refused_by_every_command(monkeypatch, capsys, source, tmp_path / "out", words, "the args do not describe these files")


@pytest.mark.slow  # a torchrun of Megatron-Core and three conversions
@pytest.mark.parametrize("name,layout", [("qwen3_next", dict(tp=2)), ("nemotron_h", dict(tp=2, pp=2))], ids=["gdn-tp2", "mamba-tp2pp2"])
def test_megatron_cores_own_rank_files_of_a_hybrid_model_export_its_hf_model_bit_identical(tmp_path, name, layout):
    """Megatron-Core's GatedDeltaNet and MambaMixer save their input projection and convolution as one tensor per rank (its
    share of each part in turn): their own state_dict() per rank, saved as Megatron-LM's legacy files, is read by reshard
    and exported to the HF model the weights came from, bit for bit (Nemotron-H's stage cut between an attention layer and
    a Mamba one)."""
    source = build(name, tmp_path / "hf")
    runner = CliRunner()
    result = runner.invoke(main, ["convert", str(source), str(tmp_path / "base"), "--to-format", "torch_dist", "--naming", "local", "-q"],
                           standalone_mode=False)
    assert result.exception is None, result.exception
    run(CKPT, [*layout_args(**layout), "--from", tmp_path / "base", "--out", tmp_path / "own", "--format", "legacy"],
        nproc=layout.get("tp", 1) * layout.get("pp", 1))
    with open_checkpoint(tmp_path / "own") as reader:
        assert (reader.layout.tp, reader.layout.pp, reader.format_name) == (layout["tp"], layout.get("pp", 1), "legacy")
    result = runner.invoke(main, ["convert", str(tmp_path / "own"), str(tmp_path / "back"), "--to-format", "hf", "-q"], standalone_mode=False)
    assert result.exception is None, result.exception
    original, exported = ({key: value for file in sorted(directory.glob("*.safetensors")) for key, value in load_file(file).items()}
                          for directory in (source, tmp_path / "back"))
    assert exported.keys() == original.keys()
    assert all(exported[key].dtype == value.dtype and torch.equal(exported[key], value) for key, value in original.items())
