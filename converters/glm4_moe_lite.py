"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's multi-latent attention, MoE block and MTP layers under GLM's
names for two config fields, so everything but the config translation is `deepseek_v3`'s.

transformers' GLM-4.7-Flash says which layers are dense with `mlp_layer_types` ("dense" / "sparse" per layer) and,
where config.json gives none, makes the first layer dense and every other one MoE, whatever `first_k_dense_replace`
says: reshard reads the layers as transformers builds them, refuses a `first_k_dense_replace` that contradicts them
(a release edited by hand), and refuses a pattern other than leading dense layers (Megatron-Core's moe_layer_freq could
hold it, HF DeepSeek's first_k_dense_replace on the way back could not). Its rotary embedding reads
`partial_rotary_factor`, which MLA's rotary key dims cannot take: refused where it is not 1.
"""

from __future__ import annotations

from typing import Any

from reshard.converters.base import bad_value, check_values, number, refuse
from reshard.converters.deepseek_moe import dense_layers
from reshard.converters.deepseek_v3 import DeepseekV3

_KINDS = ("dense", "sparse")
# transformers' GLM-4.7-Flash defaults where DeepSeek-V3's (which the shared path assumes) differ, for a config.json
# that leaves these out
_DEFAULTS = {"q_lora_rank": 768, "routed_scaling_factor": 1.8, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752}


def first_dense_layers(hf: dict[str, Any]) -> int:
    """The leading dense layers of a GLM-4.7-Flash config.json, as transformers builds them."""
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        kinds = ["dense"] + ["sparse"] * (layers - 1)  # transformers' default, first_k_dense_replace notwithstanding
    if not isinstance(kinds, list) or len(kinds) != layers or any(kind not in _KINDS for kind in kinds):
        raise bad_value("mlp_layer_types", kinds, f"a list of num_hidden_layers={layers} of 'dense' or 'sparse'")
    dense = kinds.index("sparse") if "sparse" in kinds else layers
    if "dense" in kinds[dense:]:
        raise refuse(f"mlp_layer_types with a dense layer at {kinds.index('dense', dense)} after an MoE one",
                     "HF DeepSeek-style models keep their dense layers first")
    stated = hf.get("first_k_dense_replace")
    if stated is not None and stated != dense:
        raise bad_value("first_k_dense_replace", stated, f"the {dense} leading dense layers mlp_layer_types (or its default) gives")
    return dense


class Glm4MoeLite(DeepseekV3):
    model_type = "glm4_moe_lite"
    architectures = ("Glm4MoeLiteForCausalLM",)

    @staticmethod
    def _as_deepseek(hf: dict[str, Any]) -> dict[str, Any]:
        params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        if factor is not None and number(factor, "partial_rotary_factor") != 1.0:
            raise refuse(f"partial_rotary_factor={factor}", "Megatron-Core's MLA rotates all of its rotary key dims")
        plain = {k: v for k, v in hf.items() if k not in ("mlp_layer_types", "partial_rotary_factor")}
        if params:
            plain["rope_parameters"] = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
        return {**_DEFAULTS, **plain, "first_k_dense_replace": first_dense_layers(hf)}

    def config_from_hf(self, hf):
        check_values(hf)
        return super().config_from_hf(self._as_deepseek(hf))

    def config_to_hf(self, config, saved=None, extras=None):
        out = super().config_to_hf(config, saved, extras)
        dense = dense_layers(config)  # check_megatron_moe has refused a model of any other pattern
        out["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (config.num_layers - dense)
        for alias in ("first_k_dense_replace", "head_dim"):  # transformers' GLM-4.7-Flash config has neither field
            if alias not in (saved or {}):
                out.pop(alias)
        return out
