"""The logits oracle: an HF model imported by reshard, loaded strictly by Megatron-Core (torchrun), gives the
same logits as the HF model itself (fp32, max abs diff <= 1e-4).

One torchrun launch per case (~15 s each on a small CPU box), so one layout per family plus a few extras.
The checkpoints are written with local-spec names (--naming local), which is what the oracle's model uses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from reshard.cli import main
from reshard.converters.base import GatedMLP, Rename
from reshard.converters.deepseek_v3 import DeepseekV3
from reshard.converters.qwen2_moe import Qwen2Moe

from hf_models import build

torchrun = pytest.importorskip("fixtures.torchrun")
pytest.importorskip("fixtures.megatron_oracle")

CASES = [
    ("llama", "legacy", dict(tp=2)),  # GQA split over TP, llama3 RoPE scaling, vocab padded to 256
    ("llama_tied", "legacy", dict(pp=2)),  # tied embeddings across pipeline stages
    ("mistral", "legacy", dict(tp=2)),  # head_dim != hidden/heads
    ("qwen2", "legacy", dict(tp=2)),  # q/k/v biases
    ("qwen3", "legacy", dict(pp=2)),  # q/k norms
    ("mixtral", "legacy", dict(ep=2)),
    ("qwen3_moe", "legacy", dict(tp=2)),
    ("qwen3_moe_softmax", "legacy", dict(ep=2)),  # norm_topk_prob=false: softmax over all experts, then top-k
    ("qwen2_moe", "legacy", dict(ep=2)),  # shared expert and its sigmoid gate, softmax before top-k, q/k/v biases
    ("qwen2_moe", "torch_dist", dict(pp=2)),
    ("qwen2_moe_topk_norm", "legacy", dict(tp=2)),  # the shared expert split over TP, its gate replicated
    ("qwen2_moe_mixed", "torch_dist", dict(ep=2)),  # a dense MLP after an MoE layer: keyed layer by layer
    ("qwen3_moe_mixed", "legacy", dict(pp=2)),
    ("gpt2", "legacy", dict(pp=2)),  # LayerNorm + biases, learned positions, tied, Conv1D
    ("llama", "torch_dist", dict(pp=2)),  # megatron's own dist_checkpointing.load
    ("deepseek_v3", "torch_dist", dict()),  # multi-latent attention, YaRN on the rotary dims
    ("deepseek_v3", "legacy", dict(tp=2)),  # MLA split by heads, the local spec's down projections by rows
    ("deepseek_v3_q", "torch_dist", dict(pp=2)),  # queries without a latent (q_lora_rank null), plain RoPE
    ("deepseek_v3_moe", "torch_dist", dict(ep=2)),  # sigmoid routing with expert bias and groups, shared experts
    ("deepseek_v3_moe", "legacy", dict(tp=2)),
    ("deepseek_v3_mixed", "torch_dist", dict(ep=2)),  # a dense layer, then an MoE one: keyed layer by layer
    ("deepseek_v3_mixed", "legacy", dict(pp=2)),
]


def max_logits_diff(tmp_path, name: str, fmt: str, layout: dict) -> float:
    """Import HF model `name` with reshard at `layout`; max |Megatron-Core's logits - transformers' logits|."""
    from transformers import AutoModelForCausalLM

    source = build(name, tmp_path / "hf")
    target = tmp_path / "megatron"
    opts = [f"--to-{k}={v}" for k, v in layout.items()]
    result = CliRunner().invoke(main, ["convert", str(source), str(target), "--to-format", fmt, *opts, "--naming", "local", "-q"],
                                standalone_mode=False)
    assert result.exception is None, result.exception
    nproc = layout.get("tp", 1) * layout.get("pp", 1) * max(1, layout.get("ep", 1) // layout.get("tp", 1))
    out = tmp_path / "oracle.pt"
    args = ["--load", target, "--out", out, *[a for k, v in layout.items() for a in (f"--{k}", v)]]
    torchrun.run("fixtures.megatron_oracle", args, nproc=nproc, timeout=300)
    oracle = torch.load(out, weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=oracle["tokens"][:, :-1]).logits.float()
    assert oracle["logits"].shape == logits.shape == (2, 16, 250)
    return (oracle["logits"] - logits).abs().max().item()


@pytest.mark.parametrize("name,fmt,layout", CASES, ids=[f"{n}-{f}-" + "".join(f"{k}{v}" for k, v in lay.items()) for n, f, lay in CASES])
def test_megatron_logits_match_hf(tmp_path, name, fmt, layout):
    diff = max_logits_diff(tmp_path, name, fmt, layout)
    assert diff <= 1e-4, f"max abs logits diff {diff}"


def _swap_shared_gate_and_up(table):
    return [GatedMLP(m.megatron, m.hf[1], m.hf[0]) if "shared_experts.linear_fc1" in m.megatron else m for m in table]


# Each a mapping error a Qwen2-MoE converter could plausibly make, and which still loads strictly.
SABOTAGE = {
    "shared_expert_gate_up_swapped": ("mappings", lambda original: lambda self, config: _swap_shared_gate_and_up(original(self, config))),
    "norm_topk_prob_ignored": ("adjust_from_hf", lambda original: lambda self, config, hf: original(self, config, hf).replace(
        moe_router_pre_softmax=False)),
}


@pytest.mark.parametrize("sabotage", sorted(SABOTAGE))
def test_a_mapping_error_fails_the_logits_check(tmp_path, monkeypatch, sabotage):
    """The oracle is sharp enough to catch the Qwen2-MoE specifics: the shared expert's fused [gate; up] order
    and the router's softmax-then-top-k (norm_topk_prob=false) each move the logits far past the tolerance."""
    method, wrap = SABOTAGE[sabotage]
    monkeypatch.setattr(Qwen2Moe, method, wrap(getattr(Qwen2Moe, method)))
    diff = max_logits_diff(tmp_path, "qwen2_moe", "legacy", {})
    assert diff > 1e-3, f"a wrong mapping gave logits within {diff} of transformers'"


class RopeFirst(Rename):
    """A wrong q_b_proj mapping: each head's rows as [rope; nope] where Megatron wants [nope; rope]."""

    def to_megatron(self, tensors, config):
        heads = tensors[0].reshape(config.num_attention_heads, -1, tensors[0].shape[-1])
        nope, rope = np.split(heads, [config.qk_head_dim], axis=1)
        return np.concatenate([rope, nope], axis=1).reshape(tensors[0].shape)


class Dropped(Rename):
    """A wrong mapping: the values lost (zeros), as a converter that skips a buffer leaves them."""

    def to_megatron(self, tensors, config):
        return np.zeros_like(tensors[0])


@pytest.mark.parametrize("name,hf_tensor,wrong", [
    ("deepseek_v3", "q_b_proj.weight", RopeFirst),
    ("deepseek_v3_moe", "e_score_correction_bias", Dropped),
], ids=["q_rope_first", "expert_bias_dropped"])
def test_the_oracle_sees_a_wrong_deepseek_mapping(tmp_path, monkeypatch, name, hf_tensor, wrong):
    right = DeepseekV3.mappings

    def mappings(self, config):
        return [wrong(m.megatron, m.hf[0]) if m.hf[0].endswith(hf_tensor) else m for m in right(self, config)]

    monkeypatch.setattr(DeepseekV3, "mappings", mappings)
    assert max_logits_diff(tmp_path, name, "torch_dist", {}) > 1e-3
