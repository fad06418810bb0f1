"""tests/launch.py: ranks forked from a warm process get torchrun's environment and run the module as `python -m`
does; one rank failing stops the others, and its traceback comes back as torchrun's would show it.

Run as a module (`python -m tests.test_launch OUT [fail|hang]`), this file is the rank under test: it joins a gloo
group from the launcher's environment, all-reduces its rank and writes what it saw to OUT.rank<r>.json; then with
`fail` rank 1 raises, with `hang` it waits forever, and rank 0 waits forever in both.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests import launch


def test_ranks_get_torchruns_environment_and_form_a_gloo_group(tmp_path):
    launch.run("tests.test_launch", [tmp_path / "seen"], nproc=2)
    seen = [json.loads((tmp_path / f"seen.rank{r}.json").read_text()) for r in range(2)]
    assert [s["rank"] for s in seen] == [0, 1] and [s["local_rank"] for s in seen] == [0, 1]
    assert {s["world_size"] for s in seen} == {2} and len({s["master_port"] for s in seen}) == 1
    assert all(s["sum_of_ranks"] == 1 for s in seen), "the all-reduce saw both ranks"
    assert all(s["argv"] == [str(tmp_path / "seen")] and s["name"] == "__main__" for s in seen)
    assert len({s["pid"] for s in seen}) == 2 and os.getpid() not in {s["pid"] for s in seen}


def test_a_failing_rank_stops_the_others_and_its_traceback_is_shown(tmp_path):
    with pytest.raises(RuntimeError) as failed:
        launch.run("tests.test_launch", [tmp_path / "seen", "fail"], nproc=2)
    message = str(failed.value)
    assert message.startswith("exit statuses [-9, 1]: python -m tests.test_launch"), message[:200]
    assert "[rank1]: Traceback" in message and "ValueError: rank 1 fails on purpose" in message


def test_a_run_past_its_timeout_is_stopped(tmp_path):
    with pytest.raises(RuntimeError, match=r"^timed out after 1s: python -m tests.test_launch .* \(2 forked ranks\)"):
        launch.run("tests.test_launch", [tmp_path / "seen", "hang"], nproc=2, timeout=1)


def _rank(out: str, mode: str | None) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([rank])
    dist.all_reduce(total)
    Path(f"{out}.rank{rank}.json").write_text(json.dumps({
        "rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "world_size": dist.get_world_size(),
        "master_port": os.environ["MASTER_PORT"], "sum_of_ranks": int(total), "argv": sys.argv[1:], "name": __name__,
        "pid": os.getpid(),
    }))
    if mode == "fail" and rank == 1:
        raise ValueError("rank 1 fails on purpose")
    if mode in ("fail", "hang"):
        signal.pause()  # no collective that could notice the other rank's end: only the launcher ends this rank
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
