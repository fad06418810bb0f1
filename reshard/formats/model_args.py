"""The architecture of a Megatron checkpoint that carries no Megatron-LM `args`, as the args reshard's
readers take: from Megatron-Bridge's `run_config.yaml` (its model provider's fields), or from a file the
user names (`--config`: an HF config.json, or a YAML of Megatron-LM arguments) for a bare directory that
`dist_checkpointing.save` wrote.

YAML is read with `yaml.safe_load`: a provider's `_target_` entries are names, never imported or called.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reshard.errors import ReshardError

RUN_CONFIG = "run_config.yaml"

# Megatron-Bridge keeps megatron-core's TransformerConfig names where Megatron-LM's arguments differ.
_RENAMED = {"layernorm_epsilon": "norm_epsilon", "num_moe_experts": "num_experts"}
# Options that change what the tensors mean; a provider that sets one is refused rather than misread.
_REFUSED = {"multi_latent_attention": False, "mtp_num_layers": None, "pipeline_model_parallel_layout": None}


def _yaml(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ReshardError(f"{path} is not valid YAML ({str(exc).splitlines()[0]})") from None


def _target(value: Any) -> str | None:
    """The dotted name a provider field refers to (`{_target_: torch.float32}` -> 'torch.float32')."""
    return value.get("_target_") if isinstance(value, dict) else None


def bridge_args(path: Path) -> dict[str, Any]:
    """Megatron-LM args from the `model:` section of a Megatron-Bridge `run_config.yaml`."""
    data = _yaml(path)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise ReshardError(f"{path} has no model section: not a Megatron-Bridge run config")
    args = {_RENAMED.get(k, k): v for k, v in model.items() if not isinstance(v, (dict, list))}
    for key, default in _REFUSED.items():
        if model.get(key, default) not in (default, False, None):
            raise ReshardError(f"{path}: model.{key} is {model[key]!r}, which reshard does not read yet")
    activation = _target(model.get("activation_func")) or "torch.nn.functional.gelu"
    gated = bool(model.get("gated_linear_unit"))
    if gated and not activation.endswith(".silu"):
        raise ReshardError(f"{path}: a gated MLP with {activation} is not a SwiGLU, which is the only gated MLP reshard maps")
    args["swiglu"] = gated
    args["untie_embeddings_and_output_weights"] = not model.get("share_embeddings_and_output_weights", False)
    args["group_query_attention"] = model.get("num_query_groups") is not None
    dtype = _target(model.get("params_dtype"))
    if dtype:
        args["params_dtype"] = dtype.removeprefix("torch.")
    if model.get("max_position_embeddings") is None and model.get("seq_length") is not None:
        args["max_position_embeddings"] = model["seq_length"]
    if model.get("should_pad_vocab") is False and model.get("vocab_size") is not None:
        args["padded_vocab_size"] = model["vocab_size"]  # Bridge stores the vocabulary unpadded
    return args


def args_from_file(path: Path) -> dict[str, Any]:
    """Megatron-LM args from `--config`: an HF config.json (mapped by its family's converter), a Megatron-
    Bridge run config, or a YAML mapping of Megatron-LM argument names."""
    if not path.is_file():
        raise ReshardError(f"--config {path} does not exist")
    if path.suffix == ".json":
        from reshard.converters import family_for_hf

        try:
            hf = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ReshardError(f"--config {path} is not valid JSON ({exc})") from None
        if not isinstance(hf, dict):
            raise ReshardError(f"--config {path} is not an HF config.json (not a mapping)")
        family = family_for_hf(hf)
        try:
            config, extras = family.config_from_hf(hf)
        except (KeyError, TypeError, ValueError) as exc:
            raise ReshardError(f"--config {path} does not describe a {family.model_type} model ({exc})") from None
        return {**config.megatron_args(), **extras}
    data = _yaml(path)
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        return bridge_args(path)
    if not isinstance(data, dict):
        raise ReshardError(f"--config {path} is neither an HF config.json nor a YAML mapping of Megatron arguments")
    return data
