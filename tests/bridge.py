"""Megatron-Bridge 0.6.2 run from its own venv (`../shared/peers/setup_bridge.sh`; BRIDGE_VENV), as the oracle some
tests run (CI has it): skipped, visibly, where that venv is absent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.launch import free_port

REPO = Path(__file__).resolve().parents[1]
BRIDGE_PYTHON = Path(os.environ.get("BRIDGE_VENV", "/work/peers/bridge")) / "bin" / "python"


def require_bridge() -> None:
    if not BRIDGE_PYTHON.is_file():
        pytest.skip(f"Megatron-Bridge's venv is not here ({BRIDGE_PYTHON}; BRIDGE_VENV, ../shared/peers/setup_bridge.sh)")


def bridge(*args, script: str = "bridge_qwen2_5_vl.py") -> None:
    """fixtures/`script` under Megatron-Bridge 0.6.2's venv. A run that fails is run once more on another port: the
    kernel's free port can be taken before the fixture's rendezvous binds it (a full-tier run failed on EADDRINUSE so);
    a failure of the fixture itself fails both."""
    require_bridge()
    failed = []
    for _ in range(2):
        proc = subprocess.run([str(BRIDGE_PYTHON), str(REPO / "fixtures" / script), *map(str, args)],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": "", "MASTER_PORT": str(free_port())})  # two may run at once (xdist)
        if proc.returncode == 0:
            if failed:
                print(f"Bridge's {script} passed on its second run; the first failed with:\n{failed[0]}")
            return
        failed.append(proc.stderr[-3000:])
    pytest.fail("\n--- second run ---\n".join(failed))


# The hybrid models Bridge imports (fixtures/bridge_hybrid.py): Qwen3-Next with every MLP MoE (Bridge 0.6.2 reads no
# mlp_only_layers), without and with the release's MTP layer, Qwen3.5 and Qwen3.5-MoE with it, Qwen3.5-MoE's experts fused
# as released, Nemotron-H dense, MoE and latent MoE
HYBRIDS = ("qwen3_next_all_moe", "qwen3_next_all_moe_mtp", "qwen3_5_mtp", "qwen3_5_moe_mtp", "qwen3_5_moe_fused", "nemotron_h",
           "nemotron_h_moe", "nemotron_h_latent")


def hybrid_imports(folder: Path) -> Path:
    """For each of HYBRIDS, under folder/<name>: its tiny HF model (hf), reshard's torch_dist `--for bridge` of it (m),
    and from ONE Bridge run (its start is most of its cost), Bridge's own import of the HF model (bridge/ckpt) and the
    HF weights Bridge exports from reshard's checkpoint (bridge/export.safetensors). Share it with `tests.cache.built`."""
    from click.testing import CliRunner

    from reshard.cli import main
    from tests.converters.hf_models import build

    require_bridge()
    models = []
    for name in HYBRIDS:
        source, ours = build(name, folder / name / "hf"), folder / name / "m"
        result = CliRunner().invoke(main, ["convert", str(source), str(ours), "--to-format", "torch_dist", "--for", "bridge", "-q"])
        assert result.exit_code == 0, result.output
        models += ["--model", source, folder / name / "bridge", ours / "iter_0000000"]
    bridge(*models, script="bridge_hybrid.py")
    return folder
