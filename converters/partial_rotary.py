"""Partial rotary embeddings: the first fraction of each head's dims rotate (rotate_half), as Megatron-Core's RoPE with
`rotary_percent` does. HF configs spell the fraction three ways; the families with partial rotary (GLM-4.5, MiniMax-M2)
read and check it here."""

from __future__ import annotations

from typing import Any

from reshard.config import ModelConfig
from reshard.converters.base import bad_value, number
from reshard.errors import ReshardError


def rotary_fraction(hf: dict[str, Any], default: float = 1.0) -> float:
    """The fraction of each head's dims that rotate, from rope_parameters.partial_rotary_factor (transformers 5),
    partial_rotary_factor or rotary_dim (releases' spellings), `default` where none is given; refused where they
    disagree or give no even number of dims."""
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    named = (("rope_parameters.partial_rotary_factor", params.get("partial_rotary_factor")),
             ("partial_rotary_factor", hf.get("partial_rotary_factor")))
    field, value = next(((f, v) for f, v in named if v is not None), (None, None))
    fraction = None if field is None else number(value, field)
    rotary_dim = hf.get("rotary_dim")
    if rotary_dim is not None:
        if type(rotary_dim) is not int or not 0 < rotary_dim <= head_dim:
            raise bad_value("rotary_dim", rotary_dim, f"a whole number of dims from 1 to head_dim={head_dim}")
        if fraction is not None and int(head_dim * fraction) != rotary_dim:
            raise bad_value("rotary_dim", rotary_dim, f"{field}={fraction} of head_dim={head_dim}")
        fraction = rotary_dim / head_dim
    fraction = default if fraction is None else fraction
    dims = head_dim * fraction
    if not 0 < fraction <= 1 or dims != int(dims) or int(dims) % 2:
        field, value = ("rotary_dim", rotary_dim) if rotary_dim is not None else (field, fraction)
        raise bad_value(field, value, f"an even number of head_dim={head_dim}'s dims" + (" (as a fraction)" if rotary_dim is None else ""))
    return fraction


def check_rotary_dims(config: ModelConfig, family: str) -> None:
    """Refuse a Megatron rotary_percent that rotates no even number of a head's dims, which no HF config can say."""
    dims = config.head_dim * config.rotary_percent
    if dims != int(dims) or int(dims) % 2:
        raise ReshardError(f"rotary_percent={config.rotary_percent} of kv_channels={config.head_dim} is no even "
                           f"number of dims, which HF {family}'s partial rotary cannot say")
