"""tests/cache.py: a build asked for by several processes of one test run (pytest-xdist's workers) runs once, and
every caller gets its result; a failed build is built again; other arguments or another builder build apart."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from tests.cache import built


@pytest.fixture(autouse=True)
def _not_a_worker(monkeypatch):
    """These tests say where an xdist worker is themselves (`_worker`): the run's own worker, if any, is not theirs."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


class _Factory:
    """The one thing `built` asks of pytest's tmp_path_factory."""

    def __init__(self, base: Path):
        self.base = base
        base.mkdir(parents=True, exist_ok=True)

    def getbasetemp(self) -> Path:
        return self.base


def made_here(folder: Path, label: str) -> dict:
    """A builder that leaves a record of every time it ran (beside the cache's folders)."""
    with open(folder.parent.parent / "builds.log", "a") as log:
        log.write(f"{label} {os.getpid()}\n")
    (folder / "made").write_text(label)
    return {"made": folder / "made", "by": os.getpid()}


def other_builder(folder: Path, label: str) -> dict:
    return made_here(folder, label)


def _worker(run: Path, name: str, results) -> None:
    os.environ["PYTEST_XDIST_WORKER"] = name  # as xdist sets it: the shared folder is beside the worker's own
    results.put(built(_Factory(run / f"popen-{name}"), made_here, "a"))


def test_concurrent_workers_build_once_and_share_the_result(tmp_path):
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    workers = [context.Process(target=_worker, args=(tmp_path, f"gw{i}", results)) for i in range(3)]
    for w in workers:
        w.start()
    got = [results.get() for _ in workers]
    for w in workers:
        w.join()
    assert [w.exitcode for w in workers] == [0, 0, 0]
    (builds,) = (tmp_path / "builds.log").read_text().splitlines()  # exactly one build
    assert all(g == got[0] for g in got) and builds == f"a {got[0]['by']}"
    assert got[0]["made"].read_text() == "a" and got[0]["made"].is_relative_to(tmp_path / "built")


def fails_once(folder: Path, runs: str) -> list[str]:
    """Stops halfway the first time it runs (a file left in its folder); after that builds, and says what it found
    in its folder. `runs` counts its runs."""
    with open(runs, "a") as log:
        log.write("run\n")
    found = sorted(p.name for p in folder.iterdir())
    if Path(runs).read_text().count("run") == 1:
        (folder / "half").write_text("a build stopped halfway")
        raise OSError("the build failed")
    return found


def test_a_failed_build_is_built_again_from_an_empty_folder(tmp_path):
    factory, runs = _Factory(tmp_path / "run"), str(tmp_path / "runs")
    with pytest.raises(OSError, match="the build failed"):
        built(factory, fails_once, runs)
    assert built(factory, fails_once, runs) == []  # what the failed run left was removed first
    assert built(factory, fails_once, runs) == []
    assert Path(runs).read_text().count("run") == 2


def test_other_arguments_and_another_builder_build_apart(tmp_path):
    factory = _Factory(tmp_path / "run")
    a, b, other = built(factory, made_here, "a"), built(factory, made_here, "b"), built(factory, other_builder, "a")
    assert len({a["made"].parent, b["made"].parent, other["made"].parent}) == 3
    assert [a["made"].read_text(), b["made"].read_text(), other["made"].read_text()] == ["a", "b", "a"]
    assert built(factory, made_here, "b") == b
    assert len((tmp_path / "run" / "builds.log").read_text().splitlines()) == 3
