"""Resumable conversions: a work log of finished tensors in the partial output directory.

After each tensor the log gets one JSON line: its checksums (as written and as read) and the writer's
state at that point (for torch_dist: every file's length and the chunks written). A re-run of the same
conversion finds the partial directory, checks that the log was made by the same plan from the same
source files, truncates the files to the last logged state (a half-written chunk is never trusted)
and converts only the tensors the log lacks. The final read-back verification covers every tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.checksum import Checksum
from reshard.plan import ConversionPlan

LOG_NAME = "reshard_worklog.jsonl"


def fingerprint(plan: ConversionPlan, options: dict[str, Any]) -> str:
    """Identifies a conversion: the source files (names, sizes, times), the target and every move."""
    source = sorted(
        (str(p.relative_to(plan.source)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in plan.source.rglob("*")
        if p.is_file()
    ) if plan.source.is_dir() else []
    payload = {
        "source": source,
        "format": plan.target_format,
        "layout": str(plan.target_layout),
        "moves": [(m.source.name, m.target.name, m.target.shape, m.target.dtype) for m in plan.moves],
        "options": sorted((k, repr(v)) for k, v in options.items()),
    }
    return hashlib.sha256(json.dumps(payload, default=str).encode()).hexdigest()


@dataclass
class Done:
    name: str
    written: Checksum
    read: Checksum


class WorkLog:
    def __init__(self, directory: Path, fingerprint: str):
        self.path = directory / LOG_NAME
        self.fingerprint = fingerprint

    def resume(self) -> tuple[list[Done], Any]:
        """Tensors already done and the writer state after the last of them; nothing if the log is foreign."""
        if not self.path.is_file():
            return [], None
        lines = self.path.read_text().splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
        except ValueError:
            return [], None
        if header.get("fingerprint") != self.fingerprint:
            return [], None
        done, state = [], None
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except ValueError:
                break  # the line being written when the run stopped
            done.append(Done(entry["name"], Checksum.from_json(entry["written"]), Checksum.from_json(entry["read"])))
            state = entry["state"]
        return done, state

    def start(self) -> None:
        self.path.write_text(json.dumps({"fingerprint": self.fingerprint}) + "\n")

    def record(self, done: Done, state: Any) -> None:
        line = {"name": done.name, "written": done.written.to_json(), "read": done.read.to_json(), "state": state}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
