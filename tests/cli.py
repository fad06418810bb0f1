"""The `reshard` command run in the test's own process, as a user runs it, and what a refusal must leave behind."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from reshard import cli


def run_cli(monkeypatch, capsys, *args) -> tuple[int, list[str]]:
    """Exit status and stderr lines of `reshard ARGS` (what the test printed before is dropped)."""
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["reshard", *map(str, args)])
    try:
        cli.run()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err.strip().splitlines()


def tree_digest(path: Path) -> str:
    """sha256 of a directory: every entry's name, a symlink's target, a file's bytes (not followed out of it)."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(p.relative_to(path).as_posix().encode() + b"\0")
        if p.is_symlink():
            h.update(b"->" + os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def refused_cli(monkeypatch, capsys, args: list, *words: str, untouched: tuple[Path, ...] = ()) -> str:
    """`reshard ARGS` exits 1 with one `reshard: error:` line holding `words`, and no file under `untouched`
    changes; the line."""
    before = [tree_digest(p) for p in untouched]
    code, lines = run_cli(monkeypatch, capsys, *args)
    assert code == 1 and len(lines) == 1 and lines[0].startswith("reshard: error:"), (code, lines)
    for word in words:
        assert word in lines[0], lines[0]
    assert [tree_digest(p) for p in untouched] == before
    return lines[0]


def refused_by_every_command(monkeypatch, capsys, source: Path, out: Path, *words: str, to: tuple[str, ...] = ()) -> None:
    """inspect, verify and convert (with flags `to`) each refuse `source` as `refused_cli` does, and convert
    writes nothing at `out`."""
    for command in (["inspect", source], ["verify", source], ["convert", source, out, *to, "-q"]):
        refused_cli(monkeypatch, capsys, command, *words, untouched=(source,))
    assert not out.exists()


def refused_config(monkeypatch, capsys, source: Path, tmp_path: Path, change: dict, *words: str) -> None:
    """A copy of HF model `source` whose config.json has the fields `change`: its conversion is refused as `refused_cli`
    says, with `words`, and writes nothing."""
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    (bad / "config.json").write_text(json.dumps({**json.loads((source / "config.json").read_text()), **change}))
    refused_cli(monkeypatch, capsys, ["convert", bad, tmp_path / "out", "--to-format", "torch_dist", "-q"], *words, untouched=(bad,))
    assert not (tmp_path / "out").exists()
