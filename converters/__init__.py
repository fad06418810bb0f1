"""HuggingFace model families: a registry keyed by HF `architectures` names and `model_type`.

Adding a family: write `converters/<family>.py` with a `Family` subclass (names, mapping table,
config translation) and add it to `_BUILTIN` below.
"""

from __future__ import annotations

import json
from typing import Any

from reshard.config import ModelConfig
from reshard.converters.base import Family
from reshard.converters.deepseek_v3 import DeepseekV3
from reshard.converters.glm4_moe import Glm4Moe
from reshard.converters.glm4_moe_lite import Glm4MoeLite
from reshard.converters.gpt2 import GPT2
from reshard.converters.gpt_oss import GptOss
from reshard.converters.llama import Llama
from reshard.converters.minimax_m2 import MiniMaxM2
from reshard.converters.mistral import Mistral
from reshard.converters.mixtral import Mixtral
from reshard.converters.nemotron_h import NemotronH
from reshard.converters.qwen2 import Qwen2
from reshard.converters.qwen2_5_vl import Qwen2_5_VL
from reshard.converters.qwen2_moe import Qwen2Moe
from reshard.converters.qwen3 import Qwen3
from reshard.converters.qwen3_5 import Qwen3_5
from reshard.converters.qwen3_5_moe import Qwen3_5Moe
from reshard.converters.qwen3_5_vl import Qwen3_5VL, Qwen3_5VLMoe
from reshard.converters.qwen3_moe import Qwen3Moe
from reshard.converters.qwen3_next import Qwen3Next
from reshard.converters.qwen3_vl import Qwen3VL
from reshard.converters.qwen3_vl_moe import Qwen3VLMoe
from reshard.errors import ReshardError

FAMILIES: dict[str, Family] = {}  # model_type -> family
_BY_ARCHITECTURE: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    for name in family.architectures:
        _BY_ARCHITECTURE[name] = family
    return family


# Order matters for `family_for_model`: the first family whose signature matches is the default export.
_BUILTIN = (Llama(), Mistral(), Qwen2(), Qwen3(), Mixtral(), Qwen3Moe(), Qwen2Moe(), DeepseekV3(), GPT2(),
            MiniMaxM2(), Glm4Moe(), GptOss(), Glm4MoeLite(), Qwen2_5_VL(), Qwen3VL(),
            Qwen3VLMoe(), Qwen3Next(), Qwen3_5(), Qwen3_5Moe(), Qwen3_5VL(), Qwen3_5VLMoe(), NemotronH())
for _family in _BUILTIN:
    register(_family)


def family_for_hf(hf_config: dict[str, Any]) -> Family:
    """The family of an HF config.json, by its `architectures` and then its `model_type`."""
    if not isinstance(hf_config, dict):
        raise ReshardError(f"HF config: config.json holds {type(hf_config).__name__}, not an object of settings")
    architectures = hf_config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise ReshardError(f"HF config: architectures={json.dumps(architectures)[:60]} is not a list of class names")
    for name in architectures:
        if name in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[name]
    model_type = hf_config.get("model_type")
    if isinstance(model_type, str) and model_type in FAMILIES and not architectures:
        return FAMILIES[model_type]
    names = ", ".join(architectures or [str(model_type)])
    known = ", ".join(sorted(_BY_ARCHITECTURE))
    raise ReshardError(f"HF architecture {names} is not supported; reshard converts {known}")


def family_by_name(name: str) -> Family:
    """A family by model_type or architecture name."""
    if name in FAMILIES:
        return FAMILIES[name]
    if name in _BY_ARCHITECTURE:
        return _BY_ARCHITECTURE[name]
    raise ReshardError(f"unknown HF family {name!r}; choose one of {', '.join(sorted(FAMILIES))}")


def families_for_model(config: ModelConfig) -> list[Family]:
    """The families whose HF model holds a Megatron model, the default export first."""
    return [family for family in FAMILIES.values() if family.matches(config)]


def family_for_model(config: ModelConfig, args: dict[str, Any]) -> Family:
    """The family to export a Megatron model as: the one it was imported from (its args' `hf_model_type`, refused
    where the model no longer fits it), else the first that fits."""
    saved = args.get("hf_model_type")
    fits = families_for_model(config)
    if saved in FAMILIES:
        if (differs := FAMILIES[saved].mismatch(config)) is not None:
            raise ReshardError(
                f"the checkpoint's args say it was imported from HF {saved} (hf_model_type), but the model has {differs}: "
                "its args were changed since; keep it in a Megatron format"
                + (f", or delete hf_model_type from its args to export it as HF {fits[0].model_type}" if fits else "")
            )
        return FAMILIES[saved].in_form(args.get("hf_form"))
    if fits:
        return fits[0]
    closest = min(FAMILIES.values(), key=lambda family: len(family.mismatches(config)))
    raise ReshardError(
        f"no HF family matches this model; the closest has {'; '.join(closest.mismatches(config))} "
        f"(supported: {', '.join(sorted(FAMILIES))}): keep it in a Megatron format"
    )
