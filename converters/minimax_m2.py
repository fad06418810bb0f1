"""MiniMax-M2 (MiniMaxM2ForCausalLM; M2.1, M2.5 and M2.7 share it): every layer a top-k MoE in `block_sparse_moe`
(gate; e_score_correction_bias; experts.N.w1/w3/w2), q/k norms over the whole projection, partial rotary.

- q_norm [heads * head_dim] and k_norm [groups * head_dim] are RMSNorms over every head of the projection at once
  (transformers normalises q_proj's output before splitting it into heads). Megatron-Core has only per-head q/k norms
  ([head_dim]); `qk_layernorm_full_width` says these are the others. They split over TP by head, as linear_qkv's
  rows do (`reshard.logical`'s rule for them), and the model is built with a norm module of its own
  (`reshard.trainer.full_width_norm`), as Megatron-Bridge builds it (minimax_m2_provider.py).
- Routing is Megatron-Core's sigmoid router with an expert bias: sigmoid scores, `e_score_correction_bias` (its
  `router.expert_bias`, a buffer) added for the choice of the top k only, the chosen scores renormalised.
- The rotary embedding covers the first `rotary_dim` dims of each head (the released config's field; transformers
  5 also writes it as rope_parameters.partial_rotary_factor): Megatron's rotary_percent, both rotating halves.
- Released fp8 weights (block-scaled, quantization_config.fmt "float8_e4m3fn") are read dequantized by
  `reshard.fp8_blocks`, as DeepSeek-V3's are.

transformers' MiniMaxM2 computes these whatever config.json says of them (use_qk_norm, qk_norm_type, scoring_func,
use_routing_bias, attn_type_list, shared_intermediate_size are not read): a config that says otherwise describes
another model, and is refused naming the field. Multi-token-prediction weights (use_mtp, num_mtp_modules) are not
mapped: transformers never builds them, and reshard refuses a file that holds them by the tensor's name.
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.converters.base import (
    LLAMA_SIGNATURE,
    Family,
    L,
    Rename,
    bad_value,
    embeddings_and_head,
    expert_count,
    llama_attention,
    moe_mlp,
    refuse,
)
from reshard.converters.partial_rotary import check_rotary_dims, rotary_fraction

# What transformers' MiniMaxM2 computes whatever these fields say; the values its configs give them.
_FIXED = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True}
_ROUTER = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}


class MiniMaxM2(Family):
    model_type = "minimax_m2"
    architectures = ("MiniMaxM2ForCausalLM",)
    signature = {**LLAMA_SIGNATURE, **_ROUTER, "qk_layernorm": True, "qk_layernorm_full_width": True, "moe": True,
                 "moe_dense_layers": False, "shared_experts": False, "router_pre_softmax": False}

    def check_hf(self, hf):
        super().check_hf({k: v for k, v in hf.items() if k != "partial_rotary_factor"})  # read by rotary_fraction
        for field, value in _FIXED.items():
            if field in hf and hf[field] != value:
                raise refuse(f"{field}={hf[field]!r}", f"transformers' MiniMax-M2 always computes {field}={value!r}")
        if hf.get("shared_intermediate_size"):
            raise refuse(f"shared_intermediate_size={hf['shared_intermediate_size']}", "MiniMax-M2 has no shared experts")
        kinds = hf.get("attn_type_list") or [1]
        if not isinstance(kinds, list) or set(kinds) != {1}:
            raise refuse(f"attn_type_list={str(kinds)[:40]}", "MiniMax-M2 has full softmax attention (1) on every layer; "
                         "lightning attention (0) is MiniMax-Text-01's")
        experts, topk = expert_count(hf), hf.get("num_experts_per_tok", 8)
        if type(topk) is not int or not 0 < topk <= experts:
            raise bad_value("num_experts_per_tok", topk, f"a whole number from 1 to the {experts} experts")
        rotary_fraction(hf)

    def adjust_from_hf(self, config, hf):
        return config.replace(
            **_ROUTER,
            qk_layernorm=True,
            qk_layernorm_full_width=True,
            rotary_percent=rotary_fraction(hf),
            num_experts=expert_count(hf),
            moe_router_topk=int(hf.get("num_experts_per_tok", 8)),
            moe_ffn_hidden_size=int(hf["intermediate_size"]),
        )

    def check_megatron(self, config: ModelConfig) -> None:
        super().check_megatron(config.replace(rotary_percent=1.0))  # partial rotary is this family's (below)
        check_rotary_dims(config, "MiniMax-M2")

    def mappings(self, config):
        return [
            *embeddings_and_head(config),
            *llama_attention(config),  # its q/k norms' names are MiniMax-M2's; their shapes the config's
            *moe_mlp(config, "block_sparse_moe", "gate", "w1", "w3", "w2"),
            Rename("decoder.layers.mlp.router.expert_bias", f"model.layers.{L}.block_sparse_moe.e_score_correction_bias"),
        ]

    def adjust_to_hf(self, out, config):
        out.update(_FIXED, num_local_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                   intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
                   rotary_dim=int(config.head_dim * config.rotary_percent))
        if isinstance(out.get("rope_parameters"), dict):  # transformers 5 writes the fraction there too
            out["rope_parameters"]["partial_rotary_factor"] = config.rotary_percent
        if "partial_rotary_factor" in out:  # the imported config's own spelling, kept in agreement
            out["partial_rotary_factor"] = config.rotary_percent
