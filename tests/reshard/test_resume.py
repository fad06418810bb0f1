"""An interrupted conversion resumes: finished tensors are skipped, half-written bytes are cut away."""

import pickle

import pytest

from fixtures.models import TINY_MOE
from fixtures.synthetic import write_synthetic
from reshard.convert import convert
from reshard.layout import Layout
from reshard.worklog import LOG_NAME


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
        convert(tmp_path / "src", tmp_path / "out", to_format=fmt, layout=layout, progress=bomb)
    partial = tmp_path / ".out.reshard-partial"
    assert (partial / LOG_NAME).is_file() and not (tmp_path / "out").exists()
    if fmt == "torch_dist":  # garbage after the last logged tensor, as a kill mid-write leaves it
        with open(next(partial.glob("iter_*/__0_0.distcp")), "ab") as f:
            f.write(b"half a chunk")
    counted, calls = _bomb(after_slabs=0)
    convert(tmp_path / "src", tmp_path / "out", to_format=fmt, layout=layout, progress=counted)
    fresh_calls = []
    convert(tmp_path / "src", tmp_path / "fresh", to_format=fmt, layout=layout, progress=lambda _: fresh_calls.append(1))
    assert 0 < len(calls) < len(fresh_calls) - 100  # the resumed run skipped what was done
    assert not partial.exists()
    if fmt == "torch_dist":
        assert _files(tmp_path / "out") == _files(tmp_path / "fresh")


def test_a_changed_source_starts_over(tmp_path):
    write_synthetic(tmp_path / "src", TINY_MOE, Layout(ep=2), "torch_dist")
    bomb, _ = _bomb(after_slabs=50)
    with pytest.raises(Stop):
        convert(tmp_path / "src", tmp_path / "out", layout=Layout(ep=1), progress=bomb)
    common = next((tmp_path / "src").glob("iter_*/common.pt"))
    common.touch()  # same bytes, new time: the log no longer describes this source
    counted, calls = _bomb(after_slabs=0)
    convert(tmp_path / "src", tmp_path / "out", layout=Layout(ep=1), progress=counted)
    fresh_calls = []
    convert(tmp_path / "src", tmp_path / "fresh", layout=Layout(ep=1), progress=lambda _: fresh_calls.append(1))
    assert len(calls) == len(fresh_calls)
