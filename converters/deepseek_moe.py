"""DeepSeek-V3's mixture-of-experts block, which GLM-4.5 and Kimi-K2 share: its HF config fields and mapping table.

The MoE layers map onto Megatron-Core's sigmoid router: `e_score_correction_bias` is its `expert_bias` (added for
the choice only; a buffer, not a parameter), n_group/topk_group its group-limited top-k (transformers ranks a group
by its top two scores, Megatron by its top topk/group_topk: they agree when topk = 2 * topk_group),
routed_scaling_factor its topk scaling factor; Megatron renormalises the chosen sigmoid weights whenever top-k > 1,
so norm_topk_prob must say the same. The shared experts are one shared-expert MLP of n_shared_experts *
moe_intermediate_size. The first first_k_dense_replace layers are dense (Megatron's moe_layer_freq as a list); a
model that mixes them is keyed layer by layer (`decoder.layers.{i}.`), as Megatron-Core's torch_dist keys it.
"""

from __future__ import annotations

from typing import Any

from reshard.config import ModelConfig
from reshard.converters.base import GatedMLP, L, Mapping, Rename, bad_value, moe_mlp, refuse

# Megatron's router settings a DeepSeek-style MoE model fixes.
MOE_ROUTER = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}


def deepseek_moe(config: ModelConfig, prefix: str = "model.") -> list[Mapping]:
    """Routed experts, the router's correction bias, and the shared experts of MoE layer {layer}."""
    m, p = "decoder.layers.mlp.", f"{prefix}layers.{L}.mlp."
    return [
        *moe_mlp(config, "mlp", "gate", "gate_proj", "up_proj", "down_proj", prefix),
        Rename(f"{m}router.expert_bias", f"{p}gate.e_score_correction_bias"),
        GatedMLP(f"{m}shared_experts.linear_fc1.weight", f"{p}shared_experts.gate_proj.weight", f"{p}shared_experts.up_proj.weight"),
        Rename(f"{m}shared_experts.linear_fc2.weight", f"{p}shared_experts.down_proj.weight"),
    ]


def dense_layers(config: ModelConfig) -> int | None:
    """HF's first_k_dense_replace of a model: its leading dense layers, all others MoE (None: not so laid out)."""
    kinds = config.moe_layers
    first = kinds.index(True) if True in kinds else len(kinds)
    return first if all(kinds[first:]) else None


def check_hf_moe(hf: dict[str, Any]) -> int:
    """Refuse a DeepSeek-style config's MoE fields Megatron-Core cannot route alike; its first_k_dense_replace."""
    layers, dense = int(hf["num_hidden_layers"]), hf.get("first_k_dense_replace")
    if type(dense) is not int or dense < 0:
        raise bad_value("first_k_dense_replace", dense, "a whole number of leading dense layers")
    if dense >= layers:
        return dense
    check_hf_routing(hf)
    if type(hf.get("n_shared_experts")) is not int or not 0 < hf["n_shared_experts"] < 1 << 31:
        raise bad_value("n_shared_experts", hf.get("n_shared_experts"), "a whole number from 1")
    return dense


def check_hf_routing(hf: dict[str, Any]) -> None:
    """Refuse DeepSeek-style routing fields (sigmoid scores, n_group/topk_group) Megatron-Core cannot route alike."""
    experts, topk = hf.get("n_routed_experts"), hf.get("num_experts_per_tok")
    for field in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"):
        if type(hf.get(field)) is not int or not 0 < hf[field] < 1 << 31:
            raise bad_value(field, hf.get(field), "a whole number from 1")
    if topk > experts:
        raise bad_value("num_experts_per_tok", topk, f"at most the {experts} experts")
    groups, group_topk = hf["n_group"], hf["topk_group"]
    if experts % groups or group_topk > groups:
        raise bad_value("n_group", groups, f"a divisor of n_routed_experts={experts} of at least topk_group={group_topk}")
    if groups > 1 and topk != 2 * group_topk:
        raise refuse(
            f"num_experts_per_tok={topk} with topk_group={group_topk}",
            "transformers ranks a group by its best two experts, Megatron-Core by its best topk/topk_group: "
            "only topk = 2 * topk_group maps exactly",
        )
    if bool(hf.get("norm_topk_prob", True)) != (topk > 1):
        raise refuse(
            f"norm_topk_prob={hf.get('norm_topk_prob')} with num_experts_per_tok={topk}",
            "Megatron-Core renormalises the chosen sigmoid weights exactly when top-k > 1",
        )


def moe_from_hf(hf: dict[str, Any], default_scaling: float) -> dict[str, Any]:
    """The ModelConfig fields of a DeepSeek-style MoE config (none where every layer is dense); `default_scaling` is
    the family's routed_scaling_factor where config.json gives none."""
    dense, layers = hf["first_k_dense_replace"], hf["num_hidden_layers"]
    if dense >= layers:
        return {}
    ffn = int(hf["moe_intermediate_size"])
    return dict(
        routing_from_hf(hf, default_scaling),
        moe_layer_freq=(0,) * dense + (1,) * (layers - dense) if dense else 1,
        moe_ffn_hidden_size=ffn,
        moe_shared_expert_intermediate_size=ffn * hf["n_shared_experts"],
    )


def routing_from_hf(hf: dict[str, Any], default_scaling: float) -> dict[str, Any]:
    """The ModelConfig fields of DeepSeek-style routing (`check_hf_routing`)."""
    return dict(
        MOE_ROUTER,
        num_experts=hf["n_routed_experts"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_router_num_groups=hf["n_group"] if hf["n_group"] > 1 else None,
        moe_router_group_topk=hf["topk_group"] if hf["n_group"] > 1 else None,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", default_scaling)),
    )


def check_megatron_moe(config: ModelConfig, family: str) -> None:
    """Refuse a Megatron MoE model HF `family` (DeepSeek-style routing) cannot hold."""
    shared, ffn = config.moe_shared_expert_intermediate_size, config.moe_ffn_hidden_size or config.ffn_hidden_size
    if dense_layers(config) is None or not shared or shared % ffn:
        raise refuse(
            f"a MoE model with moe_layer_freq={config.moe_layer_freq}, shared experts of {shared}",
            f"HF {family} has its MoE layers after its dense ones, with shared experts of a multiple of moe_ffn_hidden_size",
        )
    check_megatron_routing(config, family)


def check_megatron_routing(config: ModelConfig, family: str) -> None:
    """Refuse Megatron routing HF `family` (DeepSeek-style: sigmoid with an expert bias, groups) cannot hold."""
    routing = {key: getattr(config, key) for key in MOE_ROUTER}
    if routing != MOE_ROUTER:
        raise refuse(f"a MoE model with {routing}", f"HF {family} routes by sigmoid with an expert bias on every MoE layer")
    groups, group_topk = config.moe_router_num_groups or 1, config.moe_router_group_topk or 1
    if groups > 1 and config.moe_router_topk != 2 * group_topk:
        raise refuse(f"moe_router_topk={config.moe_router_topk} with moe_router_group_topk={group_topk}",
                     f"HF {family} ranks a group by its best two experts")


def moe_to_hf(out: dict[str, Any], config: ModelConfig) -> None:
    """The MoE fields of a DeepSeek-style config.json."""
    out["first_k_dense_replace"] = dense_layers(config)
    if not config.is_moe:
        return
    ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
    routing_to_hf(out, config)
    out.update(moe_intermediate_size=ffn, n_shared_experts=config.moe_shared_expert_intermediate_size // ffn)


def routing_to_hf(out: dict[str, Any], config: ModelConfig) -> None:
    """The routing fields of a DeepSeek-style config.json (`routing_from_hf`'s inverse)."""
    out.update(
        n_routed_experts=config.num_experts,
        num_experts_per_tok=config.moe_router_topk,
        n_group=config.moe_router_num_groups or 1,
        topk_group=config.moe_router_group_topk or 1,
        routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
        norm_topk_prob=config.moe_router_topk > 1,
    )
