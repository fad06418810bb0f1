"""An interrupted conversion resumes: finished tensors are skipped, half-written bytes are cut away."""

import json
import pickle

import pytest

from fixtures.models import TINY_LLAMA, TINY_MOE
from fixtures.synthetic import write_synthetic
from reshard.convert import convert
from reshard.layout import Layout
from reshard.request import Target
from reshard.worklog import LOG_NAME
from tests.arrays import same, tensors


class Stop(Exception):
    pass


def _bomb(after_slabs):
    calls = []

    def progress(_):
        calls.append(1)
        if len(calls) == after_slabs:
            raise Stop  # like a kill: not a ReshardError, so the partial output is kept

    return progress, calls


def _files(root):
    """Every file's bytes (DCP's .metadata unpickled: object sharing changes its bytes, not its content)."""
    return {
        p.relative_to(root).as_posix(): pickle.loads(p.read_bytes()) if p.name == ".metadata" else p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "reshard_manifest.json"
    }


@pytest.mark.parametrize("fmt", ["torch_dist", "zarr"])
def test_interrupted_conversion_resumes_and_matches_a_fresh_one(tmp_path, fmt):
    write_synthetic(tmp_path / "src", TINY_MOE, Layout(ep=2), "torch_dist", optimizer=True)
    layout = Layout(ep=4, pp=2)
    bomb, _ = _bomb(after_slabs=150)
    with pytest.raises(Stop):
        convert(tmp_path / "src", tmp_path / "out", Target(format=fmt, layout=layout), progress=bomb)
    partial = tmp_path / ".out.reshard-partial"
    assert (partial / LOG_NAME).is_file() and not (tmp_path / "out").exists()
    if fmt == "torch_dist":  # garbage after the last logged tensor, as a kill mid-write leaves it
        with open(next(partial.glob("iter_*/__0_0.distcp")), "ab") as f:
            f.write(b"half a chunk")
    counted, calls = _bomb(after_slabs=0)
    convert(tmp_path / "src", tmp_path / "out", Target(format=fmt, layout=layout), progress=counted)
    fresh_calls = []
    convert(tmp_path / "src", tmp_path / "fresh", Target(format=fmt, layout=layout), progress=lambda _: fresh_calls.append(1))
    assert 0 < len(calls) < len(fresh_calls) - 100  # the resumed run skipped what was done
    assert not partial.exists()
    if fmt == "torch_dist":
        assert _files(tmp_path / "out") == _files(tmp_path / "fresh")


@pytest.mark.parametrize("fmt,file", [("hf", "model.safetensors"), ("legacy", "iter_0000010/mp_rank_01/model_optim_rng.pt")])
def test_an_interrupted_export_resumes_and_matches_a_fresh_one(tmp_path, fmt, file):
    """Outputs whose records all have their place before the first is written (HF, legacy)."""
    write_synthetic(tmp_path / "src", TINY_LLAMA, Layout(tp=2), "torch_dist")
    total = []
    convert(tmp_path / "src", tmp_path / "fresh", Target(format=fmt), progress=lambda _: total.append(1))
    bomb, _ = _bomb(after_slabs=len(total) // 2)
    with pytest.raises(Stop):
        convert(tmp_path / "src", tmp_path / "out", Target(format=fmt), progress=bomb)
    partial = tmp_path / ".out.reshard-partial"
    assert len((partial / LOG_NAME).read_text().splitlines()) > 1, "some tensors were logged"
    assert (partial / file).is_file()
    with open(partial / file, "ab") as f:  # bytes past the end, as a file of another run may hold
        f.write(b"stale")
    counted, calls = _bomb(after_slabs=0)
    convert(tmp_path / "src", tmp_path / "out", Target(format=fmt), progress=counted)
    assert 0 < len(calls) < len(total)  # the resumed run skipped what was done
    assert not partial.exists()
    assert _files(tmp_path / "out") == _files(tmp_path / "fresh")


@pytest.mark.parametrize("fmt", ["torch_dist", "hf"])
def test_a_run_stopped_while_verifying_resumes_at_the_metadata(tmp_path, monkeypatch, fmt):
    """Everything was written and logged: the rerun converts nothing, writes the metadata again and verifies."""
    import reshard.convert

    write_synthetic(tmp_path / "src", TINY_LLAMA, Layout(tp=2), "torch_dist")
    verify = reshard.convert.compute_checksums

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(reshard.convert, "compute_checksums", stop)
    with pytest.raises(Stop):
        convert(tmp_path / "src", tmp_path / "out", Target(format=fmt))
    monkeypatch.setattr(reshard.convert, "compute_checksums", verify)
    counted, calls = _bomb(after_slabs=0)
    convert(tmp_path / "src", tmp_path / "out", Target(format=fmt), progress=counted)
    assert calls == []
    convert(tmp_path / "src", tmp_path / "fresh", Target(format=fmt))
    assert _files(tmp_path / "out") == _files(tmp_path / "fresh")


def test_a_changed_source_starts_over(tmp_path):
    write_synthetic(tmp_path / "src", TINY_MOE, Layout(ep=2), "torch_dist")
    bomb, _ = _bomb(after_slabs=50)
    with pytest.raises(Stop):
        convert(tmp_path / "src", tmp_path / "out", Target(layout=Layout(ep=1)), progress=bomb)
    common = next((tmp_path / "src").glob("iter_*/common.pt"))
    common.touch()  # same bytes, new time: the log no longer describes this source
    counted, calls = _bomb(after_slabs=0)
    convert(tmp_path / "src", tmp_path / "out", Target(layout=Layout(ep=1)), progress=counted)
    fresh_calls = []
    convert(tmp_path / "src", tmp_path / "fresh", Target(layout=Layout(ep=1)), progress=lambda _: fresh_calls.append(1))
    assert len(calls) == len(fresh_calls)


def test_a_source_relinked_between_runs_starts_afresh(tmp_path):
    """An iteration directory linked to another run between an interrupted conversion and its rerun: the
    rerun must not keep tensors converted from the first run."""
    import shutil

    for seed in (0, 1):
        write_synthetic(tmp_path / f"run{seed}", TINY_MOE, Layout(ep=2), "torch_dist", seed=seed)
        (tmp_path / f"run{seed}" / "iter_0000010" / "reshard_manifest.json").unlink()  # as Megatron saves it
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(tmp_path / "run0" / "latest_checkpointed_iteration.txt", src)
    (src / "iter_0000010").symlink_to(tmp_path / "run0" / "iter_0000010")
    progress, _ = _bomb(after_slabs=30)
    with pytest.raises(Stop):
        convert(src, tmp_path / "out", Target(layout=Layout(ep=1)), progress=progress)
    (src / "iter_0000010").unlink()
    (src / "iter_0000010").symlink_to(tmp_path / "run1" / "iter_0000010")
    convert(src, tmp_path / "out", Target(layout=Layout(ep=1)))
    convert(tmp_path / "run1", tmp_path / "fresh", Target(layout=Layout(ep=1)))
    assert _files(tmp_path / "out") == _files(tmp_path / "fresh")


def _stored_records(out, fmt):
    """The tensor records of an output, as libraries we did not write list them."""
    if fmt == "torch_dist":
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(next(out.glob("iter_*")))).read_metadata()
        return [i for i in metadata.storage_data if i.offset is not None and i.fqn in metadata.state_dict_metadata
                and hasattr(metadata.state_dict_metadata[i.fqn], "chunks")]
    if fmt == "hf":
        from safetensors import safe_open

        with safe_open(out / "model.safetensors", "pt") as f:
            return list(f.keys())
    import torch

    return [
        (path, key, name)
        for path in sorted(out.rglob("model_optim_rng.pt"))
        for key, model in torch.load(path, weights_only=False).items() if key.startswith("model")
        for name, value in model.items() if isinstance(value, torch.Tensor)
    ]


@pytest.mark.parametrize("fmt", ["torch_dist", "hf", "legacy"])
def test_the_work_log_names_each_record_once(tmp_path, monkeypatch, fmt):
    """Each line carries its tensor's records, not the writer's whole state again: a log that grew as
    tensors x records reached 94 MB for a 32-layer, 32-expert toy model."""
    from reshard.worklog import WorkLog

    write_synthetic(tmp_path / "src", TINY_MOE, Layout(ep=2), "torch_dist")
    kept = tmp_path / "log.jsonl"
    monkeypatch.setattr(WorkLog, "remove", lambda self: self.path.rename(kept))
    convert(tmp_path / "src", tmp_path / "out", Target(format=fmt, layout=Layout(tp=2, ep=2, pp=2) if fmt != "hf" else None))
    lines = [json.loads(line) for line in kept.read_text().splitlines()[1:]]
    facts = [json.dumps(fact) for line in lines for fact in line["facts"]]
    assert len(set(facts)) == len(facts) == len(_stored_records(tmp_path / "out", fmt)) > len(lines) > 1


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy", "hf"])
def test_a_tensor_whose_log_line_failed_is_converted_again(tmp_path, monkeypatch, fmt):
    """A log line lost (the disk failed writing it) while later ones were written: that tensor is not
    done, and its records are not the writer's to keep, so the rerun converts it again and matches a
    fresh run (legacy at PP2 EP4 and HF byte for byte; torch_dist at PP2 EP4 in values)."""
    from reshard.worklog import WorkLog

    write_synthetic(tmp_path / "src", TINY_MOE, Layout(ep=2), "torch_dist", optimizer=fmt == "torch_dist")
    layout = Layout(ep=4, pp=2) if fmt != "hf" else None
    record, calls = WorkLog.record, []

    def failing_third(self, done, facts):
        calls.append(done.name)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        record(self, done, facts)

    monkeypatch.setattr(WorkLog, "record", failing_third)
    with pytest.raises(OSError):
        convert(tmp_path / "src", tmp_path / "out", Target(format=fmt, layout=layout))
    monkeypatch.undo()
    logged = [json.loads(line)["name"] for line in (tmp_path / ".out.reshard-partial" / LOG_NAME).read_text().splitlines()[1:]]
    assert calls[2] not in logged and set(calls[3:]) <= set(logged), "later lines were written"
    counted, converted = _bomb(after_slabs=0)
    convert(tmp_path / "src", tmp_path / "out", Target(format=fmt, layout=layout), progress=counted)
    assert converted, "the lost tensor was converted again"
    convert(tmp_path / "src", tmp_path / "fresh", Target(format=fmt, layout=layout))
    if fmt != "torch_dist":
        assert _files(tmp_path / "out") == _files(tmp_path / "fresh")
        return
    # the lost tensor's records go after the last kept one: its values, as torch's DCP reader finds them, match
    import torch
    import torch.distributed.checkpoint as dcp

    expected = tensors(tmp_path / "fresh")
    state = {name: torch.empty_like(t) for name, t in expected.items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "out" / "iter_0000010"), no_dist=True)
    assert all(same(state[name], expected[name]) for name in expected)


def test_a_torn_log_line_is_cut_away_before_the_rerun_appends(tmp_path):
    """A kill mid-line leaves a torn last line; the rerun's lines must follow the last whole one, or the
    first of them, glued to the torn bytes, would be lost to the resume after."""
    write_synthetic(tmp_path / "src", TINY_MOE, Layout(ep=2), "torch_dist")
    log = tmp_path / ".out.reshard-partial" / LOG_NAME
    total = []
    convert(tmp_path / "src", tmp_path / "fresh", Target(layout=Layout(ep=4)), progress=lambda _: total.append(1))
    bomb, _ = _bomb(after_slabs=len(total) // 3)
    with pytest.raises(Stop):
        convert(tmp_path / "src", tmp_path / "out", Target(layout=Layout(ep=4)), progress=bomb)
    whole = log.read_text().splitlines()
    with open(log, "a") as f:
        f.write('{"name": "decoder.layers.mlp.linear_fc1.weight", "wri')  # as a kill mid-write leaves it
    bomb, _ = _bomb(after_slabs=len(total) // 3)
    with pytest.raises(Stop):
        convert(tmp_path / "src", tmp_path / "out", Target(layout=Layout(ep=4)), progress=bomb)
    lines = log.read_text().splitlines()
    assert lines[: len(whole)] == whole and len(lines) > len(whole)
    assert all(json.loads(line)["name"] for line in lines[1:]), "every line of both runs is whole"
