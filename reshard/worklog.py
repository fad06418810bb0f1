"""Resumable conversions: a work log of finished tensors in the partial output directory.

After each tensor the log gets one JSON line, written once the writer's bytes so far are on disk: its
checksums (as written and as read) and the facts of the writer's state learnt since the line before (for
torch_dist: the records written, with their files and offsets). A re-run of the same
conversion finds the partial directory, checks that the log was made by the same plan from the same
source files, truncates the files to the last logged state (a half-written chunk is never trusted)
and converts only the tensors the log lacks. The final verification covers every tensor; those of an
earlier run are read back from the disk (this run's writer cannot vouch for their bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.checksum import Checksum
from reshard.formats.base import CheckpointWriter
from reshard.plan import ConversionPlan

LOG_NAME = "reshard_worklog.jsonl"


def _source_files(root: Path) -> list[tuple[str, str, int, int]]:
    """(name under `root`, real path, size, mtime) of every file under it. Linked folders are followed,
    each real folder once: runs often link iteration directories, and relinking one to another run must
    change the fingerprint."""
    out, seen = [], set()
    for top, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        for name in files:
            path = os.path.join(top, name)
            st = os.stat(path)
            out.append((os.path.relpath(path, root), os.path.realpath(path), st.st_size, st.st_mtime_ns))
    return sorted(out)


def fingerprint(plan: ConversionPlan) -> str:
    """Identifies a conversion: the source files (names, where they really are, sizes, times), the target
    and every move."""
    payload = {
        "source": _source_files(plan.source) if plan.source.is_dir() else [],
        "format": plan.target_format,
        "layout": str(plan.target_layout),
        "moves": [(m.source.name, m.target.name, m.target.shape, m.target.dtype) for m in plan.moves],
        "options": repr(plan.options),
        "log": 2,  # lines carry new facts, not whole states: an older log is not resumed
    }
    return hashlib.sha256(json.dumps(payload, default=str).encode()).hexdigest()


@dataclass
class Done:
    name: str
    written: Checksum
    read: Checksum


@dataclass
class Resumed:
    """What a log of this conversion holds: the tensors done and the writer's facts after the last of them."""

    done: list[Done]
    facts: list[Any]


class WorkLog:
    """One process's log; in a multi-rank conversion each rank keeps its own (`rank`, of `world` ranks),
    since each writes its own files from its own share of the plan."""

    def __init__(self, directory: Path, fingerprint: str, rank: int = 0, world: int = 1):
        self.path = directory / (LOG_NAME if world == 1 else LOG_NAME.replace(".jsonl", f".rank{rank}.jsonl"))
        self.fingerprint = fingerprint if world == 1 else f"{fingerprint} rank {rank} of {world}"

    def resume(self) -> Resumed | None:
        """What the log holds, if it was started by this conversion (finished tensors or not). A line torn
        by the stop is cut away: this run's first line, appended to it, would be lost to the next resume."""
        if not self.path.is_file():
            return None
        text = self.path.read_bytes()
        lines = text.split(b"\n")  # the last is what follows the last newline: nothing, or a torn line
        try:
            header = json.loads(lines[0]) if len(lines) > 1 else {}
        except ValueError:
            return None
        if header.get("fingerprint") != self.fingerprint:
            return None
        resumed, kept = Resumed([], []), len(lines[0]) + 1
        for line in lines[1:-1]:
            try:
                entry = json.loads(line)
            except ValueError:
                break  # the line being written when the run stopped
            resumed.done.append(Done(entry["name"], Checksum.from_json(entry["written"]), Checksum.from_json(entry["read"])))
            resumed.facts.extend(entry["facts"])
            kept += len(line) + 1
        if kept < len(text):
            os.truncate(self.path, kept)
        return resumed

    def start(self) -> None:
        self.path.write_text(json.dumps({"fingerprint": self.fingerprint}) + "\n")

    def record(self, done: Done, facts: list[Any]) -> None:
        line = {"name": done.name, "written": done.written.to_json(), "read": done.read.to_json(), "facts": facts}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


class Recorder:
    """Logs finished tensors off the writing thread: the writer's new facts are taken at once, then a
    background thread waits for its bytes to reach the disk (`sync`) and appends the entry. The disk
    writes back while the next tensors stream, instead of the conversion stopping at every fsync."""

    def __init__(self, log: WorkLog, writer: CheckpointWriter):
        self.log, self.writer = log, writer
        self._logged = len(writer.facts())  # those restored from the log are in it
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-log")
        self._pending: list[Future[None]] = []

    def __call__(self, done: Done) -> None:
        facts = self.writer.facts(self._logged)
        self._logged += len(facts)
        self._pending.append(self._thread.submit(self._record, done, facts))

    def _record(self, done: Done, facts: list[Any]) -> None:
        self.writer.sync()
        self.log.record(done, facts)

    def close(self) -> None:
        """Wait for every entry (before the writer closes its files); raise the first failure."""
        try:
            for future in self._pending:
                future.result()
        finally:
            self._thread.shutdown()
