"""Conversions between formats and layouts: bit-identical tensors, atomic output, dry runs."""

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from fixtures.models import TINY_LLAMA, TINY_MOE
from fixtures.synthetic import SyntheticReader, write_synthetic
from reshard.buffers import Pool
from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.layout import Layout
from reshard.plan import make_plan
from reshard.request import LayoutChange, Run, SourceHints, Target
from reshard.sharding import full_region
from reshard.streaming import read_slab
from reshard.torchfile import dcp_metadata
from tests.arrays import same, tensors

MHA = TINY_LLAMA.replace(num_query_groups=4)  # four query groups, so TP=4 is possible


def test_round_trip_dist_zarr_legacy_dist_is_bit_identical(tmp_path):
    write_synthetic(tmp_path / "a", MHA, Layout(tp=2, pp=2), "torch_dist", dtype="bfloat16")
    convert(tmp_path / "a", tmp_path / "b.zarr", Target(format="zarr"))
    convert(tmp_path / "b.zarr", tmp_path / "c", Target(format="legacy", layout=Layout(tp=4, pp=1)))
    convert(tmp_path / "c", tmp_path / "d", Target(format="torch_dist", layout=Layout(tp=1, pp=4)))
    source = SyntheticReader(MHA, dtype="bfloat16")
    final = tensors(tmp_path / "d")
    assert set(final) == set(source.specs)
    for name, spec in source.specs.items():
        expected = source.read(name, full_region(spec.shape))
        rows = MHA.vocab_size if spec.vocab else None  # TP4 padded the vocabulary to 512 and back
        assert same(final[name][:rows], expected[:rows]), name
    # and PyTorch's own DCP loader agrees
    state = {n: torch.empty_like(t) for n, t in final.items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "d" / "iter_0000010"), no_dist=True)
    assert all(same(state[n], final[n]) for n in final)


def test_vocabulary_is_repadded_for_the_target_tp(tmp_path):
    write_synthetic(tmp_path / "a", MHA, Layout(tp=1), "torch_dist")
    result = convert(tmp_path / "a", tmp_path / "b", Target(layout=Layout(tp=4)))
    assert result.plan.config.padded_vocab_size == 512  # 250 rounded up to 128 * 4
    emb = tensors(tmp_path / "b")["embedding.word_embeddings.weight"]
    source = tensors(tmp_path / "a")["embedding.word_embeddings.weight"]
    assert emb.shape == (512, 64) and same(emb[:256], source) and torch.count_nonzero(emb[256:]) == 0


def test_without_the_true_vocabulary_a_tp_change_keeps_only_a_padding_megatron_would_make(tmp_path):
    """256 saved rows, true vocabulary unknown: Megatron-LM pads to a multiple of 128 x TP from its
    tokenizer, so at TP2 the rows stay; at TP4 (512) it needs the true size to pad."""
    write_synthetic(tmp_path / "a", MHA.replace(vocab_size=None), Layout(tp=1), "torch_dist")
    assert convert(tmp_path / "a", tmp_path / "tp2", Target(layout=Layout(tp=2))).plan.config.padded_vocab_size == 256
    with pytest.raises(ReshardError, match="pass --vocab-size"):
        convert(tmp_path / "a", tmp_path / "tp4", Target(layout=Layout(tp=4)), dry_run=True)
    known = convert(tmp_path / "a", tmp_path / "tp4", Target(layout=Layout(tp=4)), hints=SourceHints(vocab_size=250), dry_run=True)
    assert known.plan.config.padded_vocab_size == 512


def test_read_slab_zeroes_vocabulary_padding_in_a_reused_buffer(tmp_path):
    write_synthetic(tmp_path / "a", MHA, Layout(tp=1), "torch_dist")
    with open_checkpoint(tmp_path / "a") as reader:
        plan = make_plan(reader, tmp_path / "b", Target(format="torch_dist", layout=Layout(tp=4)))
        move = next(m for m in plan.moves if m.target.vocab)
        pool = Pool()
        dirty = pool.array([move.target.numel], np.dtype(np.float32))
        dirty[...] = 7.0
        pool.give(dirty)  # a dirty buffer to reuse
        slab = full_region(move.target.shape)
        out = pool.array([b - a for a, b in slab], np.dtype(np.float32))
        read_slab(reader, move, slab, out)
        rows = move.source.shape[0]
        assert same(out[:rows], reader.read(move.source.name, full_region(move.source.shape)))
        assert out.shape[0] == 512 and np.count_nonzero(out[rows:]) == 0


def test_moe_expert_parallel_round_trip_with_optimizer(tmp_path):
    write_synthetic(tmp_path / "a", TINY_MOE, Layout(ep=2), "torch_dist", optimizer=True)
    convert(tmp_path / "a", tmp_path / "b", Target(layout=Layout(ep=4)))
    convert(tmp_path / "b", tmp_path / "c", Target(layout=Layout(ep=1, pp=2)))
    first, last = tensors(tmp_path / "a"), tensors(tmp_path / "c")
    assert set(first) == set(last) and any(n.startswith("optimizer.state.exp_avg.") for n in last)
    assert all(same(first[n], last[n]) for n in first)


def test_dry_run_writes_nothing_and_reports_the_plan(tmp_path):
    write_synthetic(tmp_path / "a", MHA, Layout(tp=2), "torch_dist")
    result = convert(tmp_path / "a", tmp_path / "b", Target(layout=Layout(tp=4, pp=2)), dry_run=True)
    assert not (tmp_path / "b").exists()
    plan = result.plan.to_json()
    assert plan["bytes_moved"] > 0 and plan["peak_memory_estimate"] > 0
    assert len(plan["target_files"]) == 8  # TP4 x PP2 rank files


def test_layout_may_be_a_function_of_the_source_layout(tmp_path):
    """What the CLI's --to-* options give: the source's layout with some degrees changed, without opening
    the source a second time to learn it."""
    write_synthetic(tmp_path / "a", MHA, Layout(tp=2, pp=2), "torch_dist")
    result = convert(tmp_path / "a", tmp_path / "b", Target(layout=LayoutChange(tp=4)), dry_run=True)
    assert result.plan.target_layout == Layout(tp=4, pp=2)


def _file_bytes(root):
    """Every file's bytes except the manifest (which records paths and times)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != "reshard_manifest.json"}


def _assert_same_files(a, b):
    """The same bytes in every file, but for the DCP metadata (the same, though its pickle may share objects
    differently) and a zarr root's attributes (they hold the manifest, with its time)."""
    files_a, files_b = _file_bytes(a), _file_bytes(b)
    for name in [name for name in files_a if name.endswith(".metadata")]:
        assert dcp_metadata.load(a / name) == dcp_metadata.load(b / name)
        del files_a[name], files_b[name]
    if "zarr.json" in files_a:
        del files_a["zarr.json"], files_b["zarr.json"]
    assert files_a == files_b


def test_output_does_not_depend_on_the_number_of_workers(tmp_path):
    write_synthetic(tmp_path / "a", TINY_MOE, Layout(ep=2), "torch_dist", optimizer=True)
    for fmt, layout in (("torch_dist", Layout(ep=4, pp=2)), ("legacy", Layout(ep=1, tp=2))):
        outputs = []
        for workers in (1, 3):
            out = tmp_path / f"{fmt}-{workers}"
            convert(tmp_path / "a", out, Target(format=fmt, layout=layout, optimizer=fmt != "legacy"), run=Run(workers=workers))
            outputs.append(_file_bytes(out))
        assert outputs[0] == outputs[1], fmt


def test_large_slabs_read_in_bands_give_the_same_output(tmp_path, monkeypatch):
    write_synthetic(tmp_path / "a", MHA, Layout(tp=2), "torch_dist", optimizer=True)
    convert(tmp_path / "a", tmp_path / "whole", Target(layout=Layout(tp=4)), run=Run(workers=1))
    monkeypatch.setattr("reshard.streaming.BAND_BYTES", 1 << 10)  # every slab over 2 KiB is read in bands
    convert(tmp_path / "a", tmp_path / "bands", Target(layout=Layout(tp=4)), run=Run(workers=3))
    assert _file_bytes(tmp_path / "whole") == _file_bytes(tmp_path / "bands")
    emb = tensors(tmp_path / "bands")["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 512 and torch.count_nonzero(emb[256:]) == 0  # padding added for TP4 is zero


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy", "zarr"])
def test_slabs_cut_into_units_give_the_same_output_in_less_memory(tmp_path, monkeypatch, fmt):
    """Units follow the target's records (TP pieces, rank tensors, zarr chunks): the bytes written do not change."""
    write_synthetic(tmp_path / "a", MHA, Layout(tp=2), "torch_dist")
    whole = convert(tmp_path / "a", tmp_path / "whole", Target(format=fmt, layout=Layout(tp=4)), run=Run(workers=2))
    monkeypatch.setattr("reshard.plan.UNIT_BYTES", 1 << 10)
    cut = convert(tmp_path / "a", tmp_path / "units", Target(format=fmt, layout=Layout(tp=4)), run=Run(workers=2))
    _assert_same_files(tmp_path / "whole", tmp_path / "units")
    assert cut.plan.max_memory < whole.plan.max_memory  # the default budget follows the largest unit
    embedding = next(m for m in cut.plan.moves if m.target.name == "embedding.word_embeddings.weight")
    assert len(list(cut.plan.units(embedding))) > 1


def test_an_expert_reshard_moves_each_record_in_one_piece(tmp_path, monkeypatch):
    """TP2 EP2 -> EP4: every record is a chunk of the source, so a row-split expert weight (strided in any
    unit of several experts) gets units of one record each; the files are the same as without."""
    write_synthetic(tmp_path / "a", TINY_MOE, Layout(tp=2, ep=2), "torch_dist")
    regrouped = convert(tmp_path / "a", tmp_path / "aligned", Target(layout=Layout(tp=2, ep=4)), run=Run(workers=2))
    fc2 = next(m for m in regrouped.plan.moves if m.target.name.endswith("experts.linear_fc2.weight"))
    units = list(regrouped.plan.units(fc2))
    assert fc2.aligned and all(unit.records == [unit.region] for unit in units)
    assert len(units) == TINY_MOE.num_layers * TINY_MOE.num_experts * 2  # one per expert and TP rank
    monkeypatch.setattr("reshard.plan._records_are_chunks", lambda *_: False)
    convert(tmp_path / "a", tmp_path / "slabs", Target(layout=Layout(tp=2, ep=4)), run=Run(workers=2))
    _assert_same_files(tmp_path / "aligned", tmp_path / "slabs")
    retiled = convert(tmp_path / "a", tmp_path / "tp1", Target(layout=Layout(tp=1, ep=4)), dry_run=True)
    assert not any(m.aligned for m in retiled.plan.moves if m.target.name.endswith("linear_fc2.weight"))


def test_a_cast_to_a_wider_dtype_is_budgeted_at_that_width(tmp_path):
    """HF `--dtype float32` from bf16: units are held at four bytes an element, and the plan says so."""
    write_synthetic(tmp_path / "a", TINY_LLAMA, Layout(), "torch_dist", dtype="bfloat16")
    kept = convert(tmp_path / "a", tmp_path / "b", Target(format="hf"), dry_run=True).plan
    cast = convert(tmp_path / "a", tmp_path / "c", Target(format="hf", dtype="float32"), dry_run=True).plan
    assert {m.target.dtype for m in cast.moves} == {"float32"}
    assert cast.largest_unit_bytes == 2 * kept.largest_unit_bytes and cast.max_memory > kept.max_memory


def test_progress_adds_up_to_the_planned_bytes(tmp_path):
    """What a progress bar is sized by (`planned`) and what it is fed (`progress`) count the same bytes."""
    write_synthetic(tmp_path / "a", TINY_MOE, Layout(ep=2), "torch_dist", dtype="bfloat16", optimizer=True)
    plans, done = [], []
    convert(tmp_path / "a", tmp_path / "b", Target(layout=Layout(ep=4)), run=Run(workers=2), planned=plans.append, progress=done.append)
    assert len(plans) == 1 and sum(done) == plans[0].bytes_moved > 0


def test_memory_budget(tmp_path):
    write_synthetic(tmp_path / "a", MHA, Layout(tp=2), "torch_dist")
    with pytest.raises(ReshardError, match="too small: one slab .* alone takes 64.0 KiB"):
        convert(tmp_path / "a", tmp_path / "b", run=Run(max_memory=200 << 10, workers=1))
    assert not (tmp_path / "b").exists()
    # a budget for a few slabs and the working buffers still converts, reading fewer slabs ahead
    budget = 7 << 20
    result = convert(tmp_path / "a", tmp_path / "b", Target(layout=Layout(tp=4)), run=Run(max_memory=budget, workers=4))
    assert 0 < result.plan.read_ahead() < budget and result.plan.peak_memory <= budget
    sequential = convert(tmp_path / "a", tmp_path / "c", run=Run(max_memory=1600 << 10, workers=4))  # no room to read ahead
    assert sequential.plan.read_ahead() == 0 and sequential.plan.peak_memory <= 1600 << 10
    assert sequential.plan.hash_workers() == 1


def _disk(monkeypatch, free: int) -> None:
    """The destination's filesystem, as os.statvfs reports it, with `free` bytes free (for root and others)."""
    import collections

    stats = collections.namedtuple("statvfs", "f_frsize f_bfree f_bavail")
    monkeypatch.setattr("reshard.convert.os.statvfs", lambda path: stats(1, free, free))


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy", "zarr"])
def test_a_conversion_that_cannot_fit_is_refused_before_it_writes(tmp_path, monkeypatch, fmt):
    """Against the disk's own measure: a disk with room for exactly what a conversion wrote lets it run;
    one short of the tensors' bytes refuses it in one line, leaving nothing behind."""
    write_synthetic(tmp_path / "a", TINY_MOE, Layout(tp=2, ep=2), "torch_dist")
    convert(tmp_path / "a", tmp_path / "measured", Target(layout=Layout(ep=4), format=fmt))
    written = sum(f.stat().st_size for f in (tmp_path / "measured").rglob("*") if f.is_file())
    _disk(monkeypatch, written)
    convert(tmp_path / "a", tmp_path / "fits", Target(layout=Layout(ep=4), format=fmt))
    _disk(monkeypatch, written // 2)
    with pytest.raises(ReshardError, match=r"^not enough free space for .*too-big: .* is free there; free space"):
        convert(tmp_path / "a", tmp_path / "too-big", Target(layout=Layout(ep=4), format=fmt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "fits", "measured"]
    # legacy keeps a dense tensor in each EP rank's file: room for each value once is not enough
    values = convert(tmp_path / "a", tmp_path / "plan", Target(layout=Layout(ep=4), format=fmt), dry_run=True).plan.bytes_moved
    if fmt == "legacy":
        assert written > values * 5 // 4
        _disk(monkeypatch, values)
        with pytest.raises(ReshardError, match=r"^not enough free space"):
            convert(tmp_path / "a", tmp_path / "too-big", Target(layout=Layout(ep=4), format=fmt))
    monkeypatch.undo()
    convert(tmp_path / "a", tmp_path / "unchecked", Target(layout=Layout(ep=4), format=fmt), run=Run(check_space=False))


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_a_resumed_conversion_counts_what_is_left_and_a_refusal_keeps_what_was_done(tmp_path, monkeypatch, fmt):
    """Legacy output repeats tensors in every rank file that holds them: what a resumed run keeps is more
    than its finished tensors' bytes, and none of it is free."""
    write_synthetic(tmp_path / "a", TINY_MOE, Layout(tp=2, ep=2), "torch_dist")
    target = Layout(tp=2, ep=4)
    total = convert(tmp_path / "a", tmp_path / "b", Target(layout=target, format=fmt), dry_run=True).plan.bytes_moved
    slabs = []
    convert(tmp_path / "a", tmp_path / "counted", Target(layout=target, format=fmt), progress=lambda _: slabs.append(1))

    def stop_late(_, calls=[]):  # noqa: B006 (the list counts the calls)
        calls.append(1)
        if len(calls) == len(slabs) * 9 // 10:
            raise KeyboardInterrupt  # as a kill: the partial output stays

    with pytest.raises(KeyboardInterrupt):
        convert(tmp_path / "a", tmp_path / "b", Target(layout=target, format=fmt), progress=stop_late)
    partial = tmp_path / ".b.reshard-partial"
    _disk(monkeypatch, 0)
    with pytest.raises(ReshardError, match="run the same command again \\(it resumes\\)"):
        convert(tmp_path / "a", tmp_path / "b", Target(layout=target, format=fmt))
    assert partial.is_dir()  # kept for the rerun
    _disk(monkeypatch, total - 1)  # less than the whole conversion, more than what is left of it
    convert(tmp_path / "a", tmp_path / "b", Target(layout=target, format=fmt))
    assert not partial.exists() and (tmp_path / "b").is_dir()


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy", "zarr"])
def test_dtype_casts_the_model_and_makes_it_the_recorded_precision(tmp_path, fmt):
    """Against torch's own cast and torch.load of the written args."""
    write_synthetic(tmp_path / "a", MHA, Layout(tp=2), "torch_dist")
    convert(tmp_path / "a", tmp_path / "b", Target(format=fmt, layout=Layout(tp=2, pp=2), dtype="bfloat16"))
    source, cast = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    assert cast.keys() == source.keys()
    for name, tensor in source.items():
        assert cast[name].dtype == torch.bfloat16 and same(cast[name], tensor.to(torch.bfloat16)), name
    with open_checkpoint(tmp_path / "b") as reader:
        assert reader.config.params_dtype == "bfloat16"
    if fmt == "torch_dist":
        args = torch.load(tmp_path / "b" / "iter_0000010" / "common.pt", weights_only=False)["args"]
        assert (args.params_dtype, args.bf16, args.fp16) == (torch.bfloat16, True, False)


def test_a_change_of_precision_with_optimizer_state_is_refused(tmp_path):
    write_synthetic(tmp_path / "a", MHA, Layout(), "torch_dist", dtype="bfloat16", optimizer=True)
    with pytest.raises(ReshardError, match=r"--dtype float32 changes the model's precision .* pass --no-optimizer"):
        convert(tmp_path / "a", tmp_path / "b", Target(dtype="float32"))
    assert not (tmp_path / "b").exists()
    # the optimizer's fp32 state is not the model's precision: bf16 onto a bf16 model changes nothing
    convert(tmp_path / "a", tmp_path / "c", Target(dtype="bfloat16", layout=Layout(tp=2)))
    assert tensors(tmp_path / "c").keys() == tensors(tmp_path / "a").keys()
    convert(tmp_path / "a", tmp_path / "d", Target(dtype="float32", optimizer=False))
    assert all(t.dtype == torch.float32 for t in tensors(tmp_path / "d").values())


def test_a_resume_counts_the_unfinished_tensors_records_as_free(tmp_path, monkeypatch):
    """The partial output holds records of tensors the log lacks (a zarr array half written when the run
    stopped); the resume removes and writes them again, so a disk with room for what the finished output
    holds beyond the partial one lets it run."""
    write_synthetic(tmp_path / "a", TINY_MOE, Layout(tp=2, ep=2), "torch_dist")
    convert(tmp_path / "a", tmp_path / "measured", Target(layout=Layout(ep=4), format="zarr"))

    def stop(_, calls=[]):  # noqa: B006 (the list counts the calls)
        calls.append(1)
        if len(calls) == 20:
            raise KeyboardInterrupt  # as a kill: the partial output stays

    with pytest.raises(KeyboardInterrupt):
        convert(tmp_path / "a", tmp_path / "b", Target(layout=Layout(ep=4), format="zarr"), progress=stop)

    def size(root):
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())

    _disk(monkeypatch, size(tmp_path / "measured") - size(tmp_path / ".b.reshard-partial"))
    convert(tmp_path / "a", tmp_path / "b", Target(layout=Layout(ep=4), format="zarr"))
    assert (tmp_path / "b").is_dir() and not (tmp_path / ".b.reshard-partial").exists()
