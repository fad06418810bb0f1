"""A plan from an HF config.json alone (`reshard convert --dry-run CONFIG.json ...`): the real DeepSeek-V3's
against DeepSeek's published parameter count and the architecture's arithmetic done here, and a tiny model's
against the plan of the same model's weights as transformers saved them."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.torchrun import pythonpath
from reshard.convert import convert
from reshard.errors import ReshardError
from reshard.request import LayoutChange, Target
from tests.converters.hf_models import build
from tests.fp8_models import make_fp8

REPO = Path(__file__).resolve().parents[3]
DEEPSEEK_V3 = REPO / "fixtures" / "deepseek_v3" / "config.json"
# The layout of DeepSeek-V3's Megatron recipes: EP64 over 256 experts, 16 pipeline stages for 61 layers (uneven)
TP8_PP16_EP64 = LayoutChange(tp=8, pp=16, ep=64, first_stage_layers=3, last_stage_layers=2)


def deepseek_v3_parameters() -> dict[str, int]:
    """DeepSeek-V3's main-model parameters by part, from its architecture (technical report, section 4.2):
    MLA with latent ranks 1536/512, 128 heads of 128+64 / 128 dims; 3 dense layers of 18432; 58 MoE layers of
    256 routed + 1 shared experts of 2048 with a sigmoid router and its bias; a 129280 x 7168 embedding and head;
    and the multi-token-prediction module (section 2.2): one more MoE layer, its [2h -> h] projection and three
    norms, sharing the main model's embedding and head (HF's config.json counts 1 such layer)."""
    h, heads, vocab = 7168, 128, 129280
    attention = (
        h * 1536 + 1536 + 1536 * heads * (128 + 64) + h * (512 + 64) + 512 + 512 * heads * (128 + 128) + heads * 128 * h + 2 * h
    )  # q down/norm/up, kv down(+rope key)/norm/up, out, two layer norms
    dense_mlp, expert = 3 * h * 18432, 3 * h * 2048
    moe_mlp = 256 * expert + expert + 256 * h + 256
    main = {"layers": 61 * attention + 3 * dense_mlp + 58 * moe_mlp, "embedding": vocab * h, "head": vocab * h, "final_norm": h}
    return {**main, "mtp": attention + moe_mlp + 2 * h * h + 3 * h}


@pytest.fixture(scope="module")
def plan():
    return convert(DEEPSEEK_V3, Path("/nonexistent/deepseek-v3-tp8pp16ep64"), Target(format="torch_dist", layout=TP8_PP16_EP64), dry_run=True).plan


@pytest.mark.slow  # plans the real DeepSeek-V3 (671B, 61 layers of 256 experts): a minute or more
def test_deepseek_v3_from_its_config_is_the_published_671b(plan):
    parts = deepseek_v3_parameters()
    params = sum(parts.values())
    # DeepSeek: "671B of the main model weights and 14B of the MTP module", 685B in all on HF (where the MTP layer
    # keeps its own copies of the embedding and head)
    assert round((params - parts["mtp"]) / 1e9) == 671
    assert abs(params + parts["embedding"] + parts["head"] - 685e9) < 1e9
    # torch_dist at TP8 pads the vocabulary to a multiple of 128 x 8, as Megatron-LM does
    padded = math.ceil(129280 / 1024) * 1024
    assert plan.bytes_moved == 2 * (params + 2 * (padded - 129280) * 7168)  # bf16: an fp8 model converts to bf16
    assert plan.target_layout.tp == 8 and plan.target_layout.pp == 16 and plan.target_layout.ep == 64
    # every piece lands in some rank's file, nothing twice
    assert sum(plan.target_files().values()) == plan.bytes_moved
    assert 0 < plan.peak_memory < 4 << 30


@pytest.mark.slow  # plans the real DeepSeek-V3 (671B, 61 layers of 256 experts): a minute or more
def test_deepseek_v3_fp8_bytes_read_are_its_float8_blocks_and_the_rest_in_bf16(plan):
    """What an HF fp8 directory of these weights holds: the linear weights that an fp8 export quantizes (MLA's
    projections, dense and expert MLPs, the MTP layer's and its eh_proj) one byte a value and a float32 scale per
    128x128 block, the rest bf16 (the MTP layer's own copies of the embedding and head included)."""
    h, heads = 7168, 128

    def fp8(rows: int, cols: int) -> int:
        return rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)

    # q down, q up, kv down (with the rope key), kv up, output: (rows, cols) each
    attention = [(1536, h), (heads * 192, 1536), (576, h), (heads * 256, 512), (h, heads * 128)]
    mlp = lambda ffn: [(ffn, h), (ffn, h), (h, ffn)]  # noqa: E731 gate, up, down
    layers = 62 * attention + 3 * mlp(18432) + 59 * 257 * mlp(2048) + [(h, 2 * h)]  # 61 layers and the MTP one
    quantized = sum(fp8(rows, cols) for rows, cols in layers)
    quantized_params = sum(rows * cols for rows, cols in layers)
    parts = deepseek_v3_parameters()
    rest = sum(parts.values()) - quantized_params + parts["embedding"] + parts["head"]
    assert plan.bytes_read == quantized + 2 * rest


@pytest.mark.parametrize("name", ["deepseek_v3_mixed", "fp8_llama"])
def test_a_config_plans_what_its_weights_plan(tmp_path, name):
    """The plan from config.json alone equals the plan from the same model's files (saved by transformers;
    quantized in blocks by the tests' torch recipe), and its bytes read are what those files hold."""
    if name == "fp8_llama":
        model = make_fp8(build("llama", tmp_path / "bf16"), tmp_path / "model", (48, 40))
    else:
        model = build(name, tmp_path / "model")
    target = Target(format="torch_dist", layout=LayoutChange(tp=2, ep=2 if "deepseek" in name else None))
    weights = convert(model, tmp_path / "a", target, dry_run=True).plan
    config = convert(model / "config.json", tmp_path / "b", target, dry_run=True).plan
    assert [(m.source, m.target) for m in config.moves] == [(m.source, m.target) for m in weights.moves]
    assert config.target_files() == weights.target_files() and config.peak_memory == weights.peak_memory
    held = 0
    for file in model.glob("*.safetensors"):
        with open(file, "rb") as f:
            header = struct.unpack("<Q", f.read(8))[0]
        held += file.stat().st_size - 8 - header
    assert config.bytes_read == held
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def reshard(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=pythonpath())
    return subprocess.run([sys.executable, "-m", "reshard", *args], capture_output=True, text=True, env=env, cwd=REPO)


@pytest.mark.slow  # plans the real DeepSeek-V3 (671B, 61 layers of 256 experts): a minute or more
def test_the_cli_plans_from_a_config_and_refuses_to_convert_one(tmp_path):
    out = reshard(
        "convert",
        "--dry-run",
        "--json",
        str(DEEPSEEK_V3),
        str(tmp_path / "out"),
        "--to-format",
        "torch_dist",
        "--to-tp",
        "2",
        "--to-ep",
        "8",
        "--disk-speed",
        "1GB",
    )
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout)
    assert said["dry_run"] and said["bytes_moved"] == 2 * sum(deepseek_v3_parameters().values())
    assert said["seconds_at_copy_speed"] == pytest.approx((said["bytes_read"] + said["bytes_written"]) / 2 / 1e9, abs=0.1)
    assert not (tmp_path / "out").exists()
    for args, message in [
        ((), "config.json without weights: pass --dry-run"),
        (("--disk-speed", "probe"), "--disk-speed is for the time estimate of --dry-run"),
        (("--dry-run", "--disk-speed", "fast"), "neither a speed nor 'probe'"),
    ]:
        out = reshard("convert", str(DEEPSEEK_V3), str(tmp_path / "out"), *args)
        assert out.returncode == 1 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "out").exists()


def test_a_config_without_weights_is_never_read(tmp_path):
    with pytest.raises(ReshardError, match="pass --dry-run"):
        convert(DEEPSEEK_V3, tmp_path / "out")
