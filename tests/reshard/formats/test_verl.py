"""verl's Megatron checkpoints as a source: a step written as verl's MegatronCheckpointManager writes one
(fixtures/verl.py: megatron-core's own dist_checkpointing saves under verl's keys and directories), read against the
same state saved by megatron-core in Megatron-LM's layout (with its args)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.formats import detect, open_checkpoint
from reshard.formats.verl import find_step
from reshard.request import Target
from tests.arrays import same, tensors
from tests.cache import built
from tests.launch import run
from tests.reshard.test_cli import _one_line_error, reshard

STEP = "global_step_2"
THEN = 2  # steps every run trains on after its saves: the uninterrupted run's, and the resumed run's


def made_verl_step(out: Path, preset: str, layout: str, fully: bool, parallel: tuple) -> dict[str, Path]:
    """`preset` trained two steps by the DistributedOptimizer on 4 ranks at `parallel` (fixtures' layout flags), saved
    by fixtures/verl.py as verl's `layout` saves it ('run') and in Megatron-LM's layout ('mlm'), then trained THEN steps
    on, uninterrupted: each step's loss ('losses')."""
    made = {"run": out / "run", "mlm": out / "mlm", "losses": out / "losses.json"}
    run("fixtures.verl", ["--preset", preset, *parallel, "--layout", layout, *(["--fully-reshardable"] if fully else []),
                          "--out", made["run"], "--mlm-out", made["mlm"], "--then", THEN, "--losses", made["losses"]], nproc=4, timeout=600)
    return made


@pytest.fixture(scope="session")
def verl_step(tmp_path_factory):
    def made(preset="tiny-llama", layout="v2", fully=False, parallel=("--tp", "2")):
        return built(tmp_path_factory, made_verl_step, preset, layout, fully, parallel)

    return made


# (preset, verl's layout, fully_reshardable, parallel flags): DP = 4 / (TP x PP)
SOURCES = {
    "v2-tp2dp2": ("tiny-llama", "v2", False, ("--tp", "2")),
    "v1-fully-tp2dp2": ("tiny-llama", "v1", True, ("--tp", "2")),
    "v2-pp2vpp2dp2": ("tiny-llama", "v2", False, ("--pp", "2", "--vpp", "2")),  # {"model0": ..., "model1": ...}
    "v2-moe-ep2dp4": ("tiny-moe", "v2", False, ("--ep", "2")),  # the ChainedOptimizer's experts' buckets
}


def _hf_tensors(path: Path) -> dict:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.slow  # a DistributedOptimizer run of megatron-core on 4 forked ranks
@pytest.mark.parametrize("source", SOURCES.values(), ids=SOURCES.keys())
def test_a_verl_step_reads_as_the_same_state_saved_by_megatron_lm(verl_step, source):
    """Every tensor, the model's and the decoded optimizer state's, equals megatron-core's Megatron-LM save of it,
    whichever directory of the run is given. The architecture is the HF config's: an MoE model's dense FFN size,
    which it lacks and no layer uses, is the one difference from the args."""
    made = verl_step(*source)
    want = tensors(made["mlm"])
    assert any(name.startswith("optimizer.state.exp_avg.") for name in want)
    for path in (made["run"], made["run"] / STEP, made["run"] / STEP / "actor"):
        assert detect(path) == "verl"
        got = tensors(path)
        assert sorted(got) == sorted(want)
        assert all(same(got[name], want[name]) for name in want), [name for name in want if not same(got[name], want[name])][:3]
    with open_checkpoint(made["run"]) as reader, open_checkpoint(made["mlm"]) as oracle:
        dense = oracle.config if not oracle.config.is_moe else oracle.config.replace(ffn_hidden_size=reader.config.ffn_hidden_size)
        assert reader.layout == oracle.layout and reader.config == dense and reader.common.iteration == 2
        assert reader.common.extra["optimizer"] == oracle.common.extra["optimizer"]
        assert reader.common.extra["opt_param_scheduler"] == oracle.common.extra["opt_param_scheduler"]
        assert type(reader.optimizer) is type(oracle.optimizer) and reader.unsupported_optimizer == []  # decoded as the oracle's form


@pytest.mark.slow
def test_hf_and_zarr_exports_of_a_verl_step_equal_those_of_its_megatron_lm_save(verl_step, tmp_path):
    made = verl_step()
    for fmt in ("hf", "zarr"):
        for name in ("run", "mlm"):
            convert(made[name], tmp_path / f"{name}.{fmt}", Target(format=fmt, optimizer=fmt != "hf"))
        if fmt == "hf":
            got, want = _hf_tensors(tmp_path / "run.hf"), _hf_tensors(tmp_path / "mlm.hf")
            assert json.loads((tmp_path / "run.hf" / "config.json").read_text()) == json.loads((tmp_path / "mlm.hf" / "config.json").read_text())
        else:
            got, want = tensors(tmp_path / "run.zarr"), tensors(tmp_path / "mlm.zarr")
        assert got and sorted(got) == sorted(want)
        assert all(same(got[name], want[name]) for name in want), fmt


@pytest.mark.slow
def test_the_cli_inspects_and_exports_a_verl_step(verl_step, tmp_path):
    made = verl_step()
    out = reshard("inspect", made["run"])
    assert out.returncode == 0 and "verl checkpoint, iteration 2, layout TP2PP1EP1" in out.stdout, out.stderr
    assert "optimizer: dp_reshardable, DP 2" in out.stdout
    result = reshard("convert", made["run"] / STEP / "actor", tmp_path / "hf", "--to-format", "hf", "--no-optimizer")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "hf" / "config.json").is_file()


def _damaged(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest, symlinks=True)
    return dest / STEP / "actor"


@pytest.mark.slow
@pytest.mark.parametrize("path", ["../../../mlm/iter_0000002", "/etc", "model/../../actor/model/dist_ckpt"])
def test_a_manifest_naming_a_path_outside_the_step_is_refused(verl_step, tmp_path, path):
    actor = _damaged(verl_step()["run"], tmp_path / "run")
    manifest = json.loads((actor / "ckpt_contents.json").read_text())
    manifest["contents"]["model"]["path"] = path
    (actor / "ckpt_contents.json").write_text(json.dumps(manifest))
    result = reshard("convert", actor, tmp_path / "out", "--to-format", "hf", "--no-optimizer")
    _one_line_error(result, "a path outside the checkpoint", repr(path))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_transformer_config_that_contradicts_the_hf_config_is_refused_naming_the_field(verl_step, tmp_path):
    actor = _damaged(verl_step()["run"], tmp_path / "run")
    config = json.loads((actor / "transformer_config.json").read_text())
    config["num_layers"] += 1
    (actor / "transformer_config.json").write_text(json.dumps(config))
    result = reshard("convert", actor, tmp_path / "out", "--to-format", "hf", "--no-optimizer")
    _one_line_error(result, "transformer_config.json: num_layers is 5", "disagree")
    assert not (tmp_path / "out").exists()


def _manifest_only(tmp_path: Path, **changes) -> Path:
    """A step directory holding only a manifest (what find_step reads first)."""
    actor = tmp_path / "run" / STEP / "actor"
    actor.mkdir(parents=True)
    manifest = {"schema_version": 2, "world_size": 4, "global_step": 2,
                "contents": {"model": {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint"}}} | changes
    (actor / "ckpt_contents.json").write_text(json.dumps(manifest))
    return actor


def test_a_manifest_of_another_schema_is_refused_naming_it(tmp_path):
    with pytest.raises(ReshardError, match="schema_version is 3"):
        find_step(_manifest_only(tmp_path, schema_version=3))


def test_an_mbridge_step_whose_model_is_hf_weights_is_refused_pointing_at_them(tmp_path):
    actor = _manifest_only(tmp_path, contents={"model": {"path": "model/huggingface", "format": "huggingface"}})
    (actor / "model" / "huggingface").mkdir(parents=True)
    with pytest.raises(ReshardError, match="already HF weights; convert that directory"):
        find_step(tmp_path / "run")


def test_an_absolute_manifest_path_is_refused_by_name(tmp_path):
    actor = _manifest_only(tmp_path, contents={"model": {"path": str(tmp_path), "format": "megatron_dist_checkpoint"}})
    with pytest.raises(ReshardError, match="a path outside the checkpoint"):
        find_step(actor)


@pytest.mark.slow
def test_a_v1_steps_dp_reshardable_optimizer_decodes_by_the_ranks_that_wrote_it(verl_step, tmp_path):
    """Layout v1 records no world size: the ranks that wrote its dist_ckpt (TP2 x DP2: four `__<rank>_0.distcp`) give
    the buckets' data-parallel size, and the step reads as megatron-core's save of the same state in Megatron-LM's
    layout, optimizer state included; it converts with it. (verl's own v1 saves fully_sharded_model_space on the
    megatron-core it pins: fixtures/verl.py says why this v1 step carries dp_reshardable.)"""
    made = verl_step(layout="v1")
    want, got = tensors(made["mlm"]), tensors(made["run"])
    assert any(name.startswith("optimizer.state.") for name in want)
    assert sorted(got) == sorted(want) and all(same(got[name], want[name]) for name in want)
    convert(made["run"], tmp_path / "with", Target(format="zarr"))
    assert sorted(tensors(tmp_path / "with")) == sorted(want)


# (the source (SOURCES), reshard convert's flags, the layout megatron-core loads the output at, its ranks, whether the RNG
# state is carried)
RESHARDS = {
    "tp2dp2-to-tp1pp2": ("v2-tp2dp2", ["--to-tp", "1", "--to-pp", "2"], ["--tp", "1", "--pp", "2"], 4, False),
    "tp2dp2-to-tp1dp4": ("v2-tp2dp2", ["--to-tp", "1", "--to-dp", "4"], ["--tp", "1"], 4, False),
    "tp2dp2-to-tp2dp1": ("v2-tp2dp2", ["--to-dp", "1"], ["--tp", "2"], 2, True),
    "moe-ep2dp4-to-ep1": ("v2-moe-ep2dp4", ["--to-ep", "1"], ["--ep", "1"], 4, False),  # the experts' buckets at expert-DP 4
}


def resharded_and_loaded(out: Path, made: dict, preset: str, flags: list, layout: list, ranks: int) -> dict[str, Path]:
    """`made`'s run converted by reshard (`flags`) into out/out in verl's layout ('out'), loaded by megatron-core at
    `layout` on `ranks` forked ranks as verl loads a step (fixtures/verl.py --load) and saved again in Megatron-LM's
    layout ('loaded'), then trained THEN steps on as verl's resumed run: each step's loss ('losses'). Shared with
    `tests.cache.built`."""
    result = reshard("convert", made["run"], out / "out", *flags)
    assert result.returncode == 0 and "checksums verified" in result.stdout, result.stderr
    run("fixtures.verl", ["--preset", preset, *layout, "--load", out / "out" / STEP / "actor", "--mlm-out", out / "loaded",
                          "--then", THEN, "--losses", out / "losses.json"], nproc=ranks, timeout=600)
    return {"out": out / "out", "loaded": out / "loaded", "losses": out / "losses.json"}


@pytest.mark.slow  # megatron-core loads the output on forked ranks
@pytest.mark.parametrize("case", RESHARDS.values(), ids=RESHARDS.keys())
def test_a_resharded_verl_step_is_loaded_by_megatron_core_as_verl_loads_it(verl_step, tmp_path_factory, case):
    """Written back in verl's layout at a new TP/PP/DP (an MoE step: at EP1 from EP2), megatron-core's
    dist_checkpointing.load (fixtures/verl.py --load: verl's keys, the DistributedOptimizer's dp_reshardable buckets at
    the new layout) gets the model, the optimizer state and the LR scheduler the source run saved."""
    source, flags, layout, ranks, rng = case
    made = verl_step(*SOURCES[source])
    paths = built(tmp_path_factory, resharded_and_loaded, made, SOURCES[source][0], flags, layout, ranks)
    got, want, actor = tensors(paths["loaded"]), tensors(made["mlm"]), paths["out"] / STEP / "actor"
    assert any(name.startswith("optimizer.state.exp_avg_sq.") for name in want) and sorted(got) == sorted(want)
    assert all(same(got[name], want[name]) for name in want), [name for name in want if not same(got[name], want[name])][:3]
    with open_checkpoint(paths["loaded"]) as loaded, open_checkpoint(made["mlm"]) as oracle:
        assert loaded.common.extra["opt_param_scheduler"] == oracle.common.extra["opt_param_scheduler"]
    source_actor = made["run"] / STEP / "actor"
    assert (actor / "model" / "huggingface" / "config.json").read_bytes() == (source_actor / "model" / "huggingface" / "config.json").read_bytes()
    manifest, config = json.loads((actor / "ckpt_contents.json").read_text()), json.loads((actor / "transformer_config.json").read_text())
    sizes = {flag: int(value) for flag, value in zip(layout[::2], layout[1::2])}
    assert manifest["world_size"] == ranks and config["tensor_model_parallel_size"] == sizes.get("--tp", 1)
    assert config["expert_model_parallel_size"] == sizes.get("--ep", 1)
    assert (actor / "extra" / "dist_ckpt").is_dir() == rng == ("rng_state" in manifest["contents"]) == ("extra" in manifest["save_contents"])
    assert (paths["out"] / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def _worst_relative(losses: dict, reference: dict) -> float:
    return max(abs(loss - reference[step]) / abs(reference[step]) for step, loss in losses.items())


@pytest.mark.slow  # megatron-core trains on from the output on forked ranks
def test_a_resharded_verl_step_resumes_with_the_uninterrupted_runs_losses(verl_step, tmp_path_factory, tmp_path):
    """The TP2 DP2 run saved at step 2 in verl's layout, written back by reshard at TP1 PP2 (DP2: the same tokens per
    step), loaded as verl's load_checkpoint loads it (model, DistributedOptimizer state, and the LR scheduler, as with
    verl's use_checkpoint_opt_param_scheduler) and trained on:
    steps 3-4 have the uninterrupted run's losses (1e-5 relative, as the Megatron-LM resume tests). The control: the
    same resume with a fresh optimizer and LR schedule (--no-load-optim) misses them by more than 1e-3."""
    source, flags, layout, ranks, _ = RESHARDS["tp2dp2-to-tp1pp2"]
    made = verl_step(*SOURCES[source])
    paths = built(tmp_path_factory, resharded_and_loaded, made, SOURCES[source][0], flags, layout, ranks)
    uninterrupted = {int(step): loss for step, loss in json.loads(made["losses"].read_text()).items()}
    resumed = {int(step): loss for step, loss in json.loads(paths["losses"].read_text()).items()}
    assert sorted(uninterrupted) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert _worst_relative(resumed, uninterrupted) <= 1e-5, (resumed, uninterrupted)
    run("fixtures.verl", ["--preset", SOURCES[source][0], *layout, "--load", paths["out"] / STEP / "actor", "--no-load-optim",
                          "--mlm-out", tmp_path / "loaded", "--then", THEN, "--losses", tmp_path / "losses.json"], nproc=ranks, timeout=600)
    fresh = {int(step): loss for step, loss in json.loads((tmp_path / "losses.json").read_text()).items()}
    assert sorted(fresh) == [3, 4] and _worst_relative(fresh, uninterrupted) > 1e-3, (fresh, uninterrupted)


def _experts_swapped(values: dict, first: int, second: int) -> dict:
    """`values` with experts `first` and `second` traded (the expert axis follows the layer axis), their optimizer state too."""
    out = dict(values)
    for name, tensor in values.items():
        if ".mlp.experts." in name:
            out[name] = tensor.clone()
            out[name][:, [first, second]] = tensor[:, [second, first]]
    return out


@pytest.mark.slow  # megatron-core loads the output on forked ranks
def test_a_verl_moe_step_at_ep1_exports_as_its_megatron_lm_save_and_swapped_experts_fail(verl_step, tmp_path_factory, tmp_path):
    """The MoE step written back at EP1 (the case above) exports to the HF weights its Megatron-LM save exports (each
    expert under its own HF index). The control: megatron-core's loaded state with two experts traded in memory (model
    and optimizer state) no longer equals the source's save: the comparison above tells the experts apart (the traded
    experts are not written to files and loaded again)."""
    source, flags, layout, ranks, _ = RESHARDS["moe-ep2dp4-to-ep1"]
    made = verl_step(*SOURCES[source])
    paths = built(tmp_path_factory, resharded_and_loaded, made, SOURCES[source][0], flags, layout, ranks)
    got, want = tensors(paths["loaded"]), tensors(made["mlm"])
    assert all(same(got[name], want[name]) for name in want)
    swapped = _experts_swapped(got, 0, 1)
    differ = sorted(name for name in want if not same(swapped[name], want[name]))
    assert differ == sorted(name for name in want if ".mlp.experts." in name) and len(differ) == 8, differ
    for name, path in (("out", paths["out"]), ("mlm", made["mlm"])):
        convert(path, tmp_path / f"{name}.hf", Target(format="hf", optimizer=False))
    exported, oracle = _hf_tensors(tmp_path / "out.hf"), _hf_tensors(tmp_path / "mlm.hf")
    assert sum(".experts." in name for name in oracle) == 4 * 4 * 3 and sorted(exported) == sorted(oracle)
    assert all(same(exported[name], oracle[name]) for name in oracle)


@pytest.mark.slow
def test_a_verl_output_from_another_format_is_refused(verl_step, tmp_path):
    result = reshard("convert", verl_step()["mlm"], tmp_path / "out", "--to-format", "verl")
    _one_line_error(result, "writes a verl step from a verl step")
    assert not (tmp_path / "out").exists()


def test_a_step_whose_save_did_not_finish_is_refused_by_name(tmp_path):
    actor = tmp_path / "run" / STEP / "actor"
    (actor / "model" / "dist_ckpt").mkdir(parents=True)
    assert detect(tmp_path / "run") == "verl"
    with pytest.raises(ReshardError, match="no ckpt_contents.json, which verl writes last: the save did not finish"):
        find_step(actor)
