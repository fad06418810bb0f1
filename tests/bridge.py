"""Megatron-Bridge 0.6.2 run from its own venv (`../shared/peers/setup_bridge.sh`; BRIDGE_VENV), as the oracle some
tests run: skipped, visibly, where that venv is absent (as in CI)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.launch import free_port

REPO = Path(__file__).resolve().parents[1]
BRIDGE_PYTHON = Path(os.environ.get("BRIDGE_VENV", "/work/peers/bridge")) / "bin" / "python"


def bridge(*args, script: str = "bridge_qwen2_5_vl.py") -> None:
    """fixtures/`script` under Megatron-Bridge 0.6.2's venv."""
    if not BRIDGE_PYTHON.is_file():
        pytest.skip(f"Megatron-Bridge's venv is not here ({BRIDGE_PYTHON}; BRIDGE_VENV, ../shared/peers/setup_bridge.sh)")
    proc = subprocess.run([str(BRIDGE_PYTHON), str(REPO / "fixtures" / script), *map(str, args)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": "", "MASTER_PORT": str(free_port())})  # two may run at once (xdist)
    assert proc.returncode == 0, proc.stderr[-3000:]
