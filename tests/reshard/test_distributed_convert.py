"""`reshard convert` under torchrun: ranks split the tensors, rank 0 writes the metadata last."""

import json
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fixtures.models import TINY_LLAMA, TINY_MOE
from fixtures.synthetic import write_synthetic
from fixtures.torchrun import REPO, run
from reshard.collective import shares
from reshard.convert import convert
from reshard.layout import Layout
from reshard.request import Target
from tests.arrays import same, tensors
from tests.reshard.test_resume import _files


@pytest.mark.slow  # launches reshard's ranks under torchrun
@pytest.mark.parametrize("fmt", [pytest.param("torch_dist", marks=pytest.mark.fast), "zarr", "legacy"])  # fast: one multi-rank run
def test_two_ranks_write_what_one_process_writes(tmp_path, fmt):
    write_synthetic(tmp_path / "src", TINY_MOE, Layout(ep=2), "torch_dist", optimizer=fmt != "legacy")
    run("reshard", ["convert", tmp_path / "src", tmp_path / "multi", "--to-ep", 4, "--to-pp", 2, "--to-format", fmt], nproc=2)
    convert(tmp_path / "src", tmp_path / "single", Target(format=fmt, layout=Layout(ep=4, pp=2)))
    multi, single = tensors(tmp_path / "multi"), tensors(tmp_path / "single")
    assert multi.keys() == single.keys() and all(same(multi[n], single[n]) for n in single)
    if fmt == "legacy":  # every rank file filled by both ranks, finished by rank 0: the bytes one process writes
        assert _files(tmp_path / "multi") == _files(tmp_path / "single")
    if fmt == "torch_dist":
        directory = tmp_path / "multi" / "iter_0000010"
        assert list(directory.glob("__*_1.distcp")), "rank 1 wrote no files"
        state = {n: torch.empty_like(t) for n, t in multi.items()}
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)  # PyTorch's own reader agrees
        assert all(same(state[n], multi[n]) for n in multi)
    assert not list(tmp_path.glob(".multi.reshard-*"))


@pytest.mark.slow  # launches reshard's ranks under torchrun
@pytest.mark.parametrize("fmt", ["torch_dist", "zarr", "legacy", "hf"])
def test_a_killed_multi_rank_conversion_resumes_where_each_rank_stopped(tmp_path, fmt):
    write_synthetic(tmp_path / "src", TINY_MOE, Layout(ep=2), "torch_dist", optimizer=fmt in ("torch_dist", "zarr"))
    layout_args = ["--to-ep", 4, "--to-pp", 2] if fmt != "hf" else []
    convert_args = ["convert", tmp_path / "src", tmp_path / "out", *layout_args, "--to-format", fmt]
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    with pytest.raises(RuntimeError):
        run("fixtures.faulty_convert", ["--kill-rank", 1, "--kill-after", 5, "--moves-log", first, "--", *convert_args], nproc=2)
    partial = tmp_path / ".out.reshard-partial"
    assert not (tmp_path / "out").exists()
    logs = {r: (partial / f"reshard_worklog.rank{r}.jsonl").read_text().splitlines()[1:] for r in range(2)}
    logged = {r: {json.loads(line)["name"] for line in lines} for r, lines in logs.items()}
    assert len(logged[1]) == 5 and logged[0], "each rank had finished some tensors"
    if fmt == "torch_dist":
        with open(next(partial.glob("iter_*/__0_1.distcp")), "ab") as f:  # a kill mid-write leaves half a chunk
            f.write(b"half a chunk")

    run("fixtures.faulty_convert", ["--moves-log", second, "--", *convert_args], nproc=2)
    for r in range(2):  # each rank converted only what its log lacked
        given = set((first / f"rank{r}.txt").read_text().split())
        again = set((second / f"rank{r}.txt").read_text().split())
        assert given - again == logged[r] and again < given, r
    assert (second / "rank1.txt").read_text(), "rank 1 had tensors left"
    assert not partial.exists()
    single, out = tensors(tmp_path / "src"), tensors(tmp_path / "out")
    if fmt != "zarr":  # byte for byte what an uninterrupted run writes
        run("reshard", [*convert_args[:2], tmp_path / "fresh", *convert_args[3:]], nproc=2)
        assert _files(tmp_path / "out") == _files(tmp_path / "fresh")
    if fmt == "hf":  # no vocabulary padding to compare with the source's: safetensors reads the bytes compared above
        from safetensors.torch import load_file

        assert len(load_file(tmp_path / "out" / "model.safetensors")) > 2
        return
    if fmt == "torch_dist":
        out = {n: torch.empty_like(t) for n, t in out.items()}
        dcp.load(out, checkpoint_id=str(tmp_path / "out" / "iter_0000010"), no_dist=True)  # PyTorch's own reader
    assert out.keys() == single.keys() and all(same(out[n], single[n]) for n in single)


@pytest.mark.slow  # launches reshard's ranks under torchrun
def test_multi_rank_free_space_is_checked_for_every_ranks_share(tmp_path):
    """Under torchrun rank 0 measures the disk against every rank's share: too little refuses the
    conversion on every rank in one line, before writing; after a kill, a refusal keeps the partial
    output and a disk with room for what is left lets the same command resume."""
    write_synthetic(tmp_path / "src", TINY_MOE, Layout(ep=2), "torch_dist", optimizer=True)
    convert_args = ["convert", tmp_path / "src", tmp_path / "out", "--to-ep", 4, "--to-pp", 2]
    convert(tmp_path / "src", tmp_path / "measured", Target(layout=Layout(ep=4, pp=2)))
    written = sum(f.stat().st_size for f in (tmp_path / "measured").rglob("*") if f.is_file())
    logs = tmp_path / "moves"
    logs.mkdir()

    def faulty(*args):
        run("fixtures.faulty_convert", ["--moves-log", logs, *args, "--", *convert_args], nproc=2)

    with pytest.raises(RuntimeError) as refused:
        faulty("--free", written // 2)
    errors = [line for line in str(refused.value).splitlines() if "not enough free space" in line]
    assert len(errors) == 2 and all(e.startswith("reshard: error: rank 0: not enough free space") for e in errors), errors
    # A frame in the repository's own code is a rank's traceback; torchrun's own (its frames in site-packages, which
    # may lie under a folder named `reshard`, as `git clone` names it) may follow the error lines.
    ours = re.compile(rf'File "{re.escape(str(REPO))}/(reshard|fixtures|converters|trainer)/')
    assert not ours.search(str(refused.value)), "no rank printed a traceback"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["measured", "moves", "src"]
    assert not (logs / "rank0.txt").exists(), "refused before any tensor was converted"

    with pytest.raises(RuntimeError):
        faulty("--kill-rank", 1, "--kill-after", 5)
    partial = tmp_path / ".out.reshard-partial"
    with pytest.raises(RuntimeError, match="run the same command again \\(it resumes\\)"):
        faulty("--free", 1000)
    assert (partial / "reshard_worklog.rank1.jsonl").is_file(), "the refusal kept the partial output"
    faulty("--free", written)
    assert not partial.exists()
    out, source = tensors(tmp_path / "out"), tensors(tmp_path / "src")
    assert out.keys() == source.keys() and all(same(out[n], source[n]) for n in source)


@pytest.mark.slow  # launches reshard's ranks under torchrun
def test_two_ranks_export_to_hf_what_one_process_exports(tmp_path):
    """Both ranks write their tensors into the one safetensors file, each at its own place; safetensors
    reads every tensor of it."""
    from safetensors.torch import load_file

    write_synthetic(tmp_path / "src", TINY_LLAMA, Layout(tp=2), "torch_dist")
    run("reshard", ["convert", tmp_path / "src", tmp_path / "multi", "--to-format", "hf", "--to-tp", 1], nproc=2)
    convert(tmp_path / "src", tmp_path / "single", Target(format="hf", layout=Layout()))
    assert _files(tmp_path / "multi") == _files(tmp_path / "single")
    multi = load_file(tmp_path / "multi" / "model.safetensors")
    assert len(multi) > 2 and all(torch.isfinite(t).all() for t in multi.values())


def test_shares_balance_bytes_deterministically():
    from fixtures.synthetic import SyntheticReader
    from reshard.plan import make_plan

    reader = SyntheticReader(TINY_MOE, optimizer=True)
    moves = make_plan(reader, reader.path, Target(format="torch_dist", layout=Layout())).moves
    split = shares(moves, 3)
    assert sorted(m.target.name for part in split for m in part) == sorted(m.target.name for m in moves)
    loads = [sum(m.bytes for m in part) for part in split]
    assert max(loads) - min(loads) <= max(m.bytes for m in moves)
    assert split == shares(moves, 3)
