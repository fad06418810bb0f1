"""The logits oracle: an HF model imported by reshard, loaded strictly by Megatron-Core (torchrun), gives the
same logits as the HF model itself (fp32, max abs diff <= 1e-4).

One torchrun launch per case (~15 s each on a small CPU box), so one layout per family plus a few extras.
The checkpoints are written with local-spec names (--naming local), which is what the oracle's model uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from reshard import naming
from reshard.cli import main
from reshard.converters import nemotron_h, qwen3_5, qwen3_5_moe, qwen3_next
from reshard.converters.base import GatedMLP, Rename
from reshard.converters.deepseek_v3 import DeepseekV3
from reshard.converters.glm4_moe import Glm4Moe
from reshard.converters.glm4_moe_lite import Glm4MoeLite
from reshard.converters.gpt_oss import GptOss, InterleavedGated
from reshard.converters.minimax_m2 import MiniMaxM2
from reshard.converters.qwen2_moe import Qwen2Moe
from tests.launch import run

from hf_models import build, load

pytest.importorskip("fixtures.megatron_oracle")
pytestmark = pytest.mark.slow  # every test loads an import into Megatron-Core; one case is kept in the fast tier (FAST)

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
    ("minimax_m2", "torch_dist", dict(tp=2)),  # full-width q/k norms split by head, partial rotary, sigmoid router + bias
    ("minimax_m2", "legacy", dict(ep=2)),
    ("minimax_m2", "torch_dist", dict(pp=2)),
    ("kimi_k2", "torch_dist", dict(ep=2)),  # model_type kimi_k2, rms_norm_eps 1e-5 (the latents' too in Megatron)
    # GLM-4.5: q/k/v biases, q/k norms and half the head dims rotated split by heads, a dense then an MoE layer with a
    # shared expert, and an MTP layer loaded strictly beside them
    ("glm4_moe", "torch_dist", dict(tp=2)),
    ("glm4_moe", "torch_dist", dict(ep=2)),
    ("glm4_moe", "torch_dist", dict(pp=2)),
    # gpt-oss: sinks split by head, a window on layer 1 only, biases (experts' at ETP1, as megatron-core requires),
    # the clamped SwiGLU, YaRN; its experts read from transformers' fused tensors
    ("gpt_oss", "torch_dist", dict(tp=2, etp=1)),
    ("gpt_oss", "torch_dist", dict(ep=2)),
    ("gpt_oss", "legacy", dict(pp=2)),
    # Qwen3-Next: Gated DeltaNet layers (fla's kernels stood in by torch's: reshard.trainer.gated_delta_net) between
    # gated attention ones, zero-centred norms, partial rotary, a dense layer then MoE ones with a gated shared expert;
    # megatron-core's own dist_checkpointing.load of the split in_proj/conv1d keys, by TP and by a stage boundary
    # between a full-attention layer (1) and a Gated DeltaNet one (2)
    ("qwen3_next", "torch_dist", dict(tp=2)),
    ("qwen3_next", "torch_dist", dict(pp=2)),
    # Megatron-LM's per-rank files: each rank's in_proj and conv1d one tensor, its share of each part in turn, loaded strictly
    ("qwen3_next", "legacy", dict(tp=2)),
    ("qwen3_next", "legacy", dict(pp=2)),
    ("qwen3_5", "torch_dist", dict(pp=2)),  # Qwen3.5's text model: dense MLPs, in_proj split four ways, multimodal RoPE on text
    # Qwen3.5-MoE's: Qwen3-Next's MoE block on Qwen3.5's layers, its experts per expert (transformers' save) and fused (the release)
    ("qwen3_5_moe", "torch_dist", dict(ep=2)),
    ("qwen3_5_moe_fused", "torch_dist", dict(tp=2)),
    # Nemotron-H: megatron-core's MambaModel (mamba_ssm's scan and gated norm stood in by torch's: reshard.trainer.mamba)
    # against transformers' torch_forward; in_proj's z/x/B/C/dt and conv1d's x/B/C split by TP, and a stage boundary
    # between an attention layer (1) and a Mamba one (2)
    ("nemotron_h", "torch_dist", dict(tp=2)),
    ("nemotron_h", "torch_dist", dict(pp=2)),
    ("nemotron_h", "legacy", dict(tp=2)),
    ("nemotron_h", "legacy", dict(pp=2)),
    # Nemotron-H's MoE layers: squared-ReLU experts over EP, sigmoid routing with its correction bias in groups, scaled,
    # the shared expert split over TP (with sequence parallel, as megatron-core runs MoE at TP > 1)
    ("nemotron_h_moe", "torch_dist", dict(ep=2)),
    ("nemotron_h_moe", "torch_dist", dict(tp=2)),
    # Nemotron 3's latent MoE: the projections into and out of the experts' latent whole on every rank (TELinear
    # duplicated, stood in by a plain linear: reshard.trainer.mamba), the shared expert over TP, the experts over EP
    ("nemotron_h_latent", "torch_dist", dict(tp=2, ep=2, etp=1)),
]


def run_oracle(tmp_path, name: str, fmt: str, layout: dict) -> tuple[Path, dict]:
    """Import HF model `name` with reshard at `layout`: (the HF model's directory, Megatron-Core's results on it)."""
    source = build(name, tmp_path / "hf")
    target = tmp_path / "megatron"
    opts = [f"--to-{k}={v}" for k, v in layout.items()]
    result = CliRunner().invoke(main, ["convert", str(source), str(target), "--to-format", fmt, *opts, "--naming", "local", "-q"],
                                standalone_mode=False)
    assert result.exception is None, result.exception
    nproc = layout.get("tp", 1) * layout.get("pp", 1) * max(1, layout.get("ep", 1) // layout.get("tp", 1))
    out = tmp_path / "oracle.pt"
    args = ["--load", target, "--out", out, *[a for k, v in layout.items() for a in (f"--{k}", v)]]
    run("fixtures.megatron_oracle", args, nproc=nproc, timeout=300)
    return source, torch.load(out, weights_only=False)


def max_logits_diff(tmp_path, name: str, fmt: str, layout: dict) -> float:
    """Import HF model `name` with reshard at `layout`; max |Megatron-Core's logits - transformers' logits|."""
    source, oracle = run_oracle(tmp_path, name, fmt, layout)
    model = load(source)
    with torch.no_grad():
        logits = model(input_ids=oracle["tokens"][:, :-1]).logits.float()
    assert oracle["logits"].shape == logits.shape == (2, 16, 250)
    return (oracle["logits"] - logits).abs().max().item()


# The fast tier keeps one case: an import loaded by megatron-core's own dist_checkpointing.load, over two stages.
FAST = ("llama", "torch_dist", dict(pp=2))


@pytest.mark.parametrize("name,fmt,layout", [pytest.param(*c, marks=pytest.mark.fast if c == FAST else ()) for c in CASES],
                         ids=[f"{n}-{f}-" + "".join(f"{k}{v}" for k, v in lay.items()) for n, f, lay in CASES])
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


class Negated(Rename):
    """A wrong mapping: the values negated (a sign convention mixed up)."""

    def to_megatron(self, tensors, config):
        return -tensors[0]


def _swap_qk_norms(table):
    swap = {"self_attn.q_norm.weight": "self_attn.k_norm.weight", "self_attn.k_norm.weight": "self_attn.q_norm.weight"}
    return [Rename(m.megatron, m.hf[0][: -len(tail)] + swap[tail]) if (tail := next((t for t in swap if m.hf[0].endswith(t)), None))
            else m for m in table]


def _every_dim_rotated(adjust_from_hf):
    """A wrong config translation: partial rotary read as full (rotary_percent 1)."""
    return lambda self, config, hf: adjust_from_hf(self, config, hf).replace(rotary_percent=1.0)


# Each a mapping error a GLM-4.5 converter could plausibly make; each still loads strictly.
GLM_SABOTAGE = {
    "qk_norms_swapped": ("mappings", lambda original: lambda self, config: _swap_qk_norms(original(self, config))),
    "expert_bias_negated": ("mappings", lambda original: lambda self, config: [
        Negated(m.megatron, m.hf[0]) if m.hf[0].endswith("e_score_correction_bias") else m for m in original(self, config)]),
    "partial_rotary_ignored": ("adjust_from_hf", lambda original: _every_dim_rotated(original)),
}


@pytest.mark.parametrize("sabotage", sorted(GLM_SABOTAGE))
def test_the_oracle_sees_a_wrong_glm_mapping(tmp_path, monkeypatch, sabotage):
    """The GLM-4.5 specifics each move the logits far past the tolerance at TP2: q and k norms swapped (each has the
    other's shape), the router's correction bias negated (other experts chosen), every head dim rotated."""
    method, wrap = GLM_SABOTAGE[sabotage]
    monkeypatch.setattr(Glm4Moe, method, wrap(getattr(Glm4Moe, method)))
    assert max_logits_diff(tmp_path, "glm4_moe", "torch_dist", dict(tp=2)) > 1e-3


def hf_mtp_logits(source: Path, inputs: torch.Tensor) -> torch.Tensor:
    """MTP layer 0's logits at positions 0..s-2, computed with transformers' own modules by DeepSeek-V3's recipe:
    the main model's final hidden state h_t and the next token's embedding e_{t+1} through
    eh_proj([enorm(e_{t+1}); hnorm(h_t)]), then transformers' DeepseekV3DecoderLayer built and loaded by transformers
    for `model.layers.{num_hidden_layers}` (an MoE layer, past first_k_dense_replace), shared_head.norm and
    shared_head.head (the model's lm_head where the MTP layer keeps no copy: GLM-4.6's form). Nothing of reshard's
    mapping is used."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    main = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
    config = AutoConfig.from_pretrained(source)
    n = config.num_hidden_layers
    config.num_hidden_layers = n + 1  # so transformers builds and loads the MTP layer's decoder layer as layer n
    if getattr(config, "mlp_layer_types", None):  # GLM-4.7-Flash says each layer's kind: the MTP layer's is MoE
        config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
    longer, info = AutoModelForCausalLM.from_pretrained(source, config=config, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    weights, p = load_file(source / "model.safetensors"), f"model.layers.{n}."

    def norm(name: str) -> DeepseekV3RMSNorm:
        module = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        module.weight.data.copy_(weights[f"{p}{name}.weight"])
        return module

    with torch.no_grad():
        hidden = main.model(input_ids=inputs).last_hidden_state[:, :-1]
        embedded = main.model.embed_tokens(inputs[:, 1:])
        x = F.linear(torch.cat([norm("enorm")(embedded), norm("hnorm")(hidden)], -1), weights[f"{p}eh_proj.weight"])
        s = x.shape[1]
        positions = torch.arange(s)[None]
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        y = longer.eval().model.layers[n](x, attention_mask=mask, position_ids=positions,
                                          position_embeddings=main.model.rotary_emb(x, positions))
        return F.linear(norm("shared_head.norm")(y), weights.get(f"{p}shared_head.head.weight", weights["lm_head.weight"]))


def mtp_diffs(tmp_path, layout: dict, name: str = "deepseek_v3_mtp") -> tuple[float, float]:
    """(max |main logits diff|, max |MTP logits diff|) of Megatron-Core's GPTModel with mtp_num_layers=1, loaded
    strictly from reshard's torch_dist import at `layout`, against transformers."""
    from transformers import AutoModelForCausalLM

    source, oracle = run_oracle(tmp_path, name, "torch_dist", layout)
    inputs = oracle["tokens"][:, :-1]
    model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=inputs).logits.float()
    (mtp,) = oracle["mtp_logits"]
    assert oracle["logits"].shape == logits.shape == mtp.shape == (2, 16, 250)
    return (oracle["logits"] - logits).abs().max().item(), (mtp[:, :-1] - hf_mtp_logits(source, inputs)).abs().max().item()


@pytest.mark.parametrize("name,layout", [("deepseek_v3_mtp", {}), ("deepseek_v3_mtp", dict(pp=2)), ("deepseek_v3_mtp", dict(ep=2)),
                                         ("glm4_moe", dict(tp=2)), ("glm4_moe_lite", dict(ep=2))],
                         ids=["tp1", "pp2", "ep2", "glm4_moe-tp2", "glm4_moe_lite-ep2"])
def test_multi_token_prediction_matches_transformers(tmp_path, name, layout):
    """DeepSeek-V3 with an MTP layer: Megatron-Core loads every mtp.layers.0.* key strictly (at PP2 on the last
    stage, beside its copy of the embedding; at EP2 its experts split), its main logits equal transformers', and its
    MTP layer's logits equal the ones computed from transformers' modules."""
    main, mtp = mtp_diffs(tmp_path, layout, name)
    assert main <= 1e-4 and mtp <= 1e-4, f"max abs logits diff {main}, MTP logits diff {mtp}"


def hf_release_mtp_logits(source: Path, inputs: torch.Tensor, scratch: Path) -> torch.Tensor:
    """The MTP layer's logits at positions 0..s-2 of a Qwen3-Next or Qwen3.5 with the release's `mtp.*`, computed with
    transformers' own modules by the release's recipe (vLLM's Qwen3NextMTP): the next token's embedding and the main
    model's final hidden state through mtp.fc([pre_fc_norm_embedding(e_{t+1}); pre_fc_norm_hidden(h_t)]), transformers'
    decoder layer (built and loaded by transformers as a full-attention layer num_hidden_layers, from a copy in
    `scratch` storing mtp.layers.0.* there), mtp.norm and lm_head; the norms the model's own class (zero-centred).
    Nothing of reshard's mapping is used."""
    from safetensors.torch import load_file, save_file

    main = load(source)
    weights, config = load_file(source / "model.safetensors"), json.loads((source / "config.json").read_text())
    n = config["num_hidden_layers"]
    scratch.mkdir()
    save_file({k.replace("mtp.layers.0.", f"model.layers.{n}.", 1): v for k, v in weights.items()}, str(scratch / "model.safetensors"),
              metadata={"format": "pt"})
    longer_config = {**config, "num_hidden_layers": n + 1, "layer_types": [*config["layer_types"], "full_attention"]}
    (scratch / "config.json").write_text(json.dumps(longer_config))
    longer = load(scratch)

    def norm(name: str) -> torch.nn.Module:
        module = type(main.model.norm)(main.config.hidden_size, eps=main.config.rms_norm_eps)
        module.weight.data.copy_(weights[f"mtp.{name}.weight"])
        return module

    with torch.no_grad():
        hidden = main.model(input_ids=inputs).last_hidden_state[:, :-1]
        embedded = main.model.embed_tokens(inputs[:, 1:])
        x = F.linear(torch.cat([norm("pre_fc_norm_embedding")(embedded), norm("pre_fc_norm_hidden")(hidden)], -1), weights["mtp.fc.weight"])
        s = x.shape[1]
        positions = torch.arange(s)[None]
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        y = longer.model.layers[n](x, attention_mask=mask, position_ids=positions, position_embeddings=main.model.rotary_emb(x, positions))
        return F.linear(norm("norm")(y[0] if isinstance(y, tuple) else y), weights["lm_head.weight"])


# Qwen3.5's dense MTP layer shares this mapping and the MLP's; its case (qwen3_5_mtp at PP2) is left out for the budget
@pytest.mark.parametrize("name,layout", [("qwen3_next_mtp", dict(tp=2)), ("qwen3_next_mtp", dict(pp=2))])
def test_the_releases_mtp_layer_loads_strictly_and_matches_transformers(tmp_path, name, layout):
    """Qwen3-Next / Qwen3.5 with the release's MTP layer: megatron-core 0.16.1's GPTModel with mtp_num_layers=1 loads every
    mtp.layers.0.* key strictly (at PP2 on the last stage), its main logits equal transformers' (the MTP layer disturbs
    nothing), and its MTP logits equal the ones computed from transformers' modules (`hf_release_mtp_logits`)."""
    source, oracle = run_oracle(tmp_path, name, "torch_dist", layout)
    inputs = oracle["tokens"][:, :-1]
    with torch.no_grad():
        logits = load(source)(input_ids=inputs).logits.float()
    (mtp,) = oracle["mtp_logits"]
    assert oracle["logits"].shape == logits.shape == mtp.shape == (2, 16, 250)
    main_diff = (oracle["logits"] - logits).abs().max().item()
    mtp_diff = (mtp[:, :-1] - hf_release_mtp_logits(source, inputs, tmp_path / "layer")).abs().max().item()
    assert main_diff <= 1e-4 and mtp_diff <= 1e-4, f"max abs logits diff {main_diff}, MTP logits diff {mtp_diff}"


def test_the_oracle_sees_deepseeks_routed_scaling_on_glm_flash(tmp_path, monkeypatch):
    """GLM-4.7-Flash's experts weighted by DeepSeek-V3's routed scaling (2.5, the path it shares) where its config says
    1.8: the main logits move past the tolerance."""
    right = Glm4MoeLite.config_from_hf

    def config_from_hf(self, hf):
        config, extras = right(self, hf)
        return config.replace(moe_router_topk_scaling_factor=2.5), extras

    monkeypatch.setattr(Glm4MoeLite, "config_from_hf", config_from_hf)
    assert mtp_diffs(tmp_path, dict(ep=2), "glm4_moe_lite")[0] > 1e-3


def test_the_mtp_oracle_sees_swapped_norms(tmp_path, monkeypatch):
    """enorm and hnorm swapped (each has the other's shape): the checkpoint still loads strictly, the main logits
    stay right, and the MTP logits move far past the tolerance."""
    right = DeepseekV3.mappings
    swap = {".enorm.weight": ".hnorm.weight", ".hnorm.weight": ".enorm.weight"}

    def mappings(self, config):
        table = right(self, config)
        return [Rename(m.megatron, m.hf[0][: -len(tail)] + swap[tail]) for m in table
                if (tail := next((t for t in swap if m.megatron.endswith(t)), None))] + \
               [m for m in table if not any(m.megatron.endswith(t) for t in swap)]

    monkeypatch.setattr(DeepseekV3, "mappings", mappings)
    main, mtp = mtp_diffs(tmp_path, {})
    assert main <= 1e-4 and mtp > 1e-3, (main, mtp)


class HalvesSwapped(Rename):
    """A wrong full-width norm mapping: its two halves (TP rank 0's heads and rank 1's at TP2) in each other's place."""

    def to_megatron(self, tensors, config):
        return np.concatenate(np.split(tensors[0], 2)[::-1])


def _minimax_with(wrong, hf_tensor):
    return lambda right: lambda self, config: [wrong(m.megatron, m.hf[0]) if m.hf[0].endswith(hf_tensor) else m
                                               for m in right(self, config)]


MINIMAX_SABOTAGE = {  # what MiniMaxM2 gets wrong (the method, a wrapper of the right one), the layout it is loaded at
    "q_norm_tp_halves_swapped": ("mappings", _minimax_with(HalvesSwapped, "q_norm.weight"), dict(tp=2)),
    "expert_bias_negated": ("mappings", _minimax_with(Negated, "e_score_correction_bias"), dict(ep=2)),
    "partial_rotary_ignored": ("adjust_from_hf", _every_dim_rotated, dict()),
}


@pytest.mark.parametrize("sabotage", sorted(MINIMAX_SABOTAGE))
def test_the_oracle_sees_a_wrong_minimax_mapping(tmp_path, monkeypatch, sabotage):
    """Each MiniMax-M2 specific, got wrong in a way that still loads strictly, moves the logits far past the tolerance:
    the full-width q norm's halves in each other's TP rank, the routing bias negated, all head dims rotated."""
    method, wrap, layout = MINIMAX_SABOTAGE[sabotage]
    monkeypatch.setattr(MiniMaxM2, method, wrap(getattr(MiniMaxM2, method)))
    assert max_logits_diff(tmp_path, "minimax_m2", "torch_dist", layout) > 1e-3


class NotInterleaved(InterleavedGated):
    """A wrong gate_up_proj mapping: its columns read as [gate; up] halves, as every other family stores them."""

    def to_megatron(self, tensors, config):
        return np.ascontiguousarray(tensors[0].T if self.transposed else tensors[0])


class ExpertsSwapped(Rename):
    """A wrong expert mapping: experts 0 and 1 each read from the other's slice of the fused tensor."""

    def hf_names(self, layer=None, expert=None):
        return super().hf_names(layer, {0: 1, 1: 0}.get(expert, expert))


def _gpt_oss_with(wrong, hf_tensor):
    return lambda right: lambda self, config: [wrong(m.megatron, m.hf[0]) if m.hf[0].endswith(hf_tensor) else m
                                               for m in right(self, config)]


GPT_OSS_SABOTAGE = {  # what GptOss gets wrong (the method, a wrapper of the right one), the layout it is loaded at
    "sinks_negated": ("mappings", _gpt_oss_with(Negated, "self_attn.sinks"), dict(tp=2, etp=1)),
    "gate_up_interleave_undone": ("mappings", lambda right: lambda self, config: [
        NotInterleaved(m.megatron, m.hf[0], m.transposed) if isinstance(m, InterleavedGated) else m for m in right(self, config)], dict()),
    "expert_biases_swapped": ("mappings", _gpt_oss_with(ExpertsSwapped, "down_proj_bias[{expert}]"), dict()),
    "sliding_window_ignored": ("adjust_from_hf", lambda right: lambda self, config, hf: right(self, config, hf).replace(
        window_size=None, window_attn_skip_freq=None), dict()),
}


@pytest.mark.parametrize("sabotage", sorted(GPT_OSS_SABOTAGE))
def test_the_oracle_sees_a_wrong_gpt_oss_mapping(tmp_path, monkeypatch, sabotage):
    """Each gpt-oss specific, got wrong in a way that still loads strictly, moves the logits far past the tolerance:
    the sinks negated (at TP2, each rank its heads'), gate and up read as halves instead of interleaved, two experts'
    down-projection biases in each other's place, the first layer's window of 8 ignored."""
    method, wrap, layout = GPT_OSS_SABOTAGE[sabotage]
    monkeypatch.setattr(GptOss, method, wrap(getattr(GptOss, method)))
    assert max_logits_diff(tmp_path, "gpt_oss", "torch_dist", layout) > 1e-3


def _flat(rows):
    """A wrong in_proj regrouping: in_proj_qkvz read as [all q; all k; all v; all z] (and in_proj_ba as [all b; all a])
    instead of grouped by key head."""
    flat, start = {}, {"in_proj_qkvz": 0, "in_proj_ba": 0}
    for part, (hf, taken) in rows.items():
        flat[part] = (hf, list(range(start[hf], start[hf] + len(taken))))
        start[hf] += len(taken)
    return flat


def _family_with(wrong, hf_tensor):
    return lambda right: lambda self, config: [wrong(m.megatron, m.hf[0]) if m.hf[0].endswith(hf_tensor) else m
                                               for m in right(self, config)]


QWEN3_NEXT_SABOTAGE = {  # what the family gets wrong: (object, attribute, its wrong value from the right one)
    "in_proj_groups_flat": (qwen3_next, "in_proj_rows", lambda right: lambda config: _flat(right(config))),
    "conv_q_k_channels_swapped": (qwen3_next, "conv_rows", lambda right: lambda config: {
        **right(config), "query": right(config)["key"], "key": right(config)["query"]}),
    "a_log_negated": (qwen3_next.Qwen3Next, "mappings", _family_with(Negated, "linear_attn.A_log")),
    "shared_expert_gate_dropped": (qwen3_next.Qwen3Next, "mappings", _family_with(Dropped, "shared_expert_gate.weight")),
    # Qwen3.5's split in_proj: its b and a (one row per value head each) in each other's place
    "qwen3_5_beta_alpha_swapped": (qwen3_5, "split_in_proj", lambda right: lambda config, *prefix: [
        Rename(m.megatron, m.hf[0].replace("in_proj_b.", "in_proj_@.").replace("in_proj_a.", "in_proj_b.").replace("in_proj_@.", "in_proj_a."))
        if m.megatron.endswith((".beta", ".alpha")) else m for m in right(config, *prefix)]),
    # Qwen3.5-MoE's fused experts: experts 0 and 1 reading each other's slice of gate_up_proj and down_proj
    "qwen3_5_moe_fused_experts_swapped": (qwen3_5_moe, "fused_experts", lambda right: lambda config, *prefix: [
        ExpertsSwapped(m.megatron, m.hf[0]) if ".experts.experts." in m.megatron else m for m in right(config, *prefix)]),
}


class ExpertsSwapped(Rename):
    def hf_names(self, layer=None, expert=None):
        return [t.format(layer=layer, expert={0: 1, 1: 0}.get(expert, expert)) for t in self.hf]


@pytest.mark.parametrize("sabotage", sorted(QWEN3_NEXT_SABOTAGE))
def test_the_oracle_sees_a_wrong_qwen3_next_mapping(tmp_path, monkeypatch, sabotage):
    """Each Qwen3-Next specific, got wrong in a way that still loads strictly, moves the logits far past the tolerance:
    in_proj's q/k/v/z (and b/a) read as flat blocks instead of grouped by key head, the convolution's q and k channels
    in each other's place, the decay's A_log negated, the shared expert's sigmoid gate lost; Qwen3.5's b and a swapped;
    two of Qwen3.5-MoE's fused experts swapped."""
    owner, attribute, wrap = QWEN3_NEXT_SABOTAGE[sabotage]
    monkeypatch.setattr(owner, attribute, wrap(getattr(owner, attribute)))
    name = next((name for name in ("qwen3_5_moe_fused", "qwen3_5") if sabotage.startswith(name)), "qwen3_next")
    assert max_logits_diff(tmp_path, name, "torch_dist", {}) > 1e-3


NEMOTRON_H_SABOTAGE = {  # what the family gets wrong: (object, attribute, its wrong value from the right one)
    "in_proj_z_x_swapped": (nemotron_h, "in_proj_rows", lambda right: lambda config: {
        **right(config), "z": right(config)["x"], "x": right(config)["z"]}),
    "conv_b_c_channels_swapped": (nemotron_h, "conv_rows", lambda right: lambda config: {
        **right(config), "B": right(config)["C"], "C": right(config)["B"]}),
    "a_log_negated": (nemotron_h.NemotronH, "mappings", _family_with(Negated, "mixer.A_log")),
    "d_dropped": (nemotron_h.NemotronH, "mappings", _family_with(Dropped, "mixer.D")),
    # its MoE layers: experts 0 and 1 (up and down projections alike) each read from the other's tensors
    "moe_experts_swapped": (nemotron_h, "moe", lambda right: lambda *latent: [
        ExpertsSwapped(m.megatron, m.hf[0]) if ".experts.experts." in m.megatron else m for m in right(*latent)]),
    "moe_router_bias_negated": (nemotron_h, "moe", lambda right: lambda *latent: [
        Negated(m.megatron, m.hf[0]) if m.megatron.endswith("expert_bias") else m for m in right(*latent)]),
    # Nemotron 3's latent MoE: the projection into the latent with its two halves of latent rows in each other's place
    # (as a duplicated weight cut like a column-parallel one over TP2 would be put back)
    "latent_fc1_halves_swapped": (nemotron_h, "moe", lambda right: lambda *latent: [
        HalvesSwapped(m.megatron, m.hf[0]) if "fc1_latent_proj" in m.megatron else m for m in right(*latent)]),
}


@pytest.mark.parametrize("sabotage", sorted(NEMOTRON_H_SABOTAGE))
def test_the_oracle_sees_a_wrong_nemotron_h_mapping(tmp_path, monkeypatch, sabotage):
    """Each Mamba-2 specific, got wrong in a way that still loads strictly, moves the logits far past the tolerance:
    in_proj's z (the gate) and x in each other's place, the convolution's B and C channels swapped, A_log negated (a
    growing state), the skip D lost; two routed experts of the MoE layers in each other's place, the router's correction bias
    negated (other experts chosen); the latent MoE's projection into the latent with its halves swapped."""
    owner, attribute, wrap = NEMOTRON_H_SABOTAGE[sabotage]
    monkeypatch.setattr(owner, attribute, wrap(getattr(owner, attribute)))
    name = {"moe": "nemotron_h_moe", "latent": "nemotron_h_latent"}.get(sabotage.split("_")[0], "nemotron_h")
    assert max_logits_diff(tmp_path, name, "torch_dist", {}) > 1e-3


@pytest.mark.parametrize("name,fused,parts", [
    ("qwen3_next", "self_attention.in_proj.weight", ("query", "key", "z", "value", "beta", "alpha")),
    ("nemotron_h", "mixer.in_proj.weight", ("x", "z", "B", "C", "dt")),
], ids=["gdn_value_z_swapped", "mamba_z_x_swapped"])
def test_the_oracle_sees_a_wrong_per_rank_fusion(tmp_path, monkeypatch, name, fused, parts):
    """Two parts of equal size in each other's place in each rank's fused in_proj (the per-rank files' order, not the
    family's mapping) still load strictly, and move the logits far past the tolerance."""
    monkeypatch.setitem(naming.FUSED_PARTS, fused, parts)
    assert max_logits_diff(tmp_path, name, "legacy", dict(tp=2)) > 1e-3
