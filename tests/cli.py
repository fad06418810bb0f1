"""The `reshard` command run in the test's own process, as a user runs it."""

from __future__ import annotations

import sys

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
