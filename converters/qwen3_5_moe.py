"""Qwen3.5-MoE, its text model (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): Qwen3.5's hybrid
(`converters/qwen3_5.py`: Gated DeltaNet with in_proj split four ways, gated attention, zero-centred norms) with
Qwen3-Next's MoE block on every layer (`converters/qwen3_next.py`: a softmax router whose top-k weights are always
renormalised, and a shared expert scaled by sigmoid(shared_expert_gate)).

- Experts in either of the two forms the files take, read and written back as they came (`files_form`, recorded in
  the args as `hf_form`): per expert (`mlp.experts.N.{gate,up,down}_proj.weight`, what transformers 5.24 saves), or
  fused as the Hub's release stores them, `mlp.experts.gate_up_proj [E, 2I, H]` (per expert Megatron's linear_fc1
  [gate; up] as it is) and `down_proj [E, H, I]` (linear_fc2), each expert one slice (`at_index`). A Megatron model
  is exported per expert.
- Every layer is MoE: transformers' Qwen3.5-MoE has no dense layers (no mlp_only_layers), so a Megatron model with
  some is refused by name.
"""

from __future__ import annotations

from reshard.config import LayerKind, ModelConfig
from reshard.converters.base import E, L, Mapping, Rename, at_index, bad_value, refuse
from reshard.converters.qwen2_moe import moe_block
from reshard.converters.qwen3_5 import Qwen3_5
from reshard.converters.qwen3_next import Qwen3Next
from reshard.errors import ReshardError

FUSED = "fused experts"  # the release's form (`files_form`)


def fused_experts(config: ModelConfig, prefix: str = "model.") -> list[Mapping]:
    """Qwen3.5-MoE's MoE block with the routed experts fused as released: Qwen2-MoE's block, its experts' tensors
    slices of the fused ones; HF names under `prefix`."""
    x, fused = "decoder.layers.mlp.experts.experts.", f"{prefix}layers.{L}.mlp.experts."
    per_expert = [m for m in moe_block(config, prefix) if not m.megatron.startswith(x)]
    return [*per_expert, Rename(f"{x}linear_fc1.weight", at_index(f"{fused}gate_up_proj", E)),
            Rename(f"{x}linear_fc2.weight", at_index(f"{fused}down_proj", E))]


class Qwen3_5Moe(Qwen3_5):
    model_type = "qwen3_5_moe_text"
    architectures = ("Qwen3_5MoeForCausalLM",)
    name = "Qwen3.5-MoE"
    signature = {**Qwen3_5.signature, "moe": True, "shared_experts": True, "shared_expert_gate": True, "router_pre_softmax": False}

    def __init__(self, fused: bool = False):
        self.fused = fused

    def files_form(self):
        return FUSED if self.fused else None

    def in_form(self, form):
        return type(self)(fused=form == FUSED)  # a subclass (Qwen3.5-VL-MoE) keeps its class

    def for_files(self, config, stored):
        return Qwen3Next.for_files(self.in_form(FUSED if any(name.endswith(".mlp.experts.gate_up_proj") for name in stored) else None),
                                   config, stored)

    def config_from_hf(self, hf):
        # no dense MLP, so no intermediate_size (transformers' config has none): Megatron's ffn_hidden_size is the experts' width
        return super().config_from_hf({**hf, "intermediate_size": hf.get("moe_intermediate_size", 0)})

    def check_mlp(self, hf):
        for field in ("mlp_only_layers", "decoder_sparse_step"):
            if field in hf:
                raise refuse(f"{field} in a Qwen3.5-MoE config", "transformers' Qwen3.5-MoE makes every layer MoE whatever it says")
        if hf.get("norm_topk_prob", True) is not True:
            raise bad_value("norm_topk_prob", hf["norm_topk_prob"], "true (Qwen3.5-MoE's router renormalises its top-k)")
        Qwen3Next.check_mlp(self, hf)

    def mlp_from_hf(self, hf):
        return Qwen3Next.mlp_from_hf(self, {**hf, "num_experts_per_tok": hf.get("num_experts_per_tok", 8)})  # transformers' default

    def check_megatron(self, config):
        super().check_megatron(config)
        if not all(config.moe_layers):
            raise ReshardError(f"layers {[i for i, moe in enumerate(config.moe_layers) if not moe]} have dense MLPs, which HF Qwen3.5-MoE "
                               "has none of (every layer MoE)")

    def mlp(self, config: ModelConfig, kind: LayerKind, prefix: str) -> list[Mapping]:
        return fused_experts(config, prefix) if self.fused else Qwen3Next.mlp(self, config, kind, prefix)

    def mlp_to_hf(self, out, config):
        del out["intermediate_size"]  # config_from_hf's
        out.update(num_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                   moe_intermediate_size=config.moe_ffn_hidden_size, shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size)
