"""Multi-token-prediction (MTP) layers as DeepSeek-V3's and GLM-4.5's HF releases store them.

MTP layer i is HF's `model.layers.{num_hidden_layers + i}` and Megatron-Core's `mtp.layers.{i}`: enorm, hnorm and
eh_proj by name (both concatenate [normed embedding; normed hidden state]), shared_head.norm is its final_layernorm,
and the rest is a decoder layer of the decoder's last layer's kind (`transformer_layer.*`). HF stores its own copy of
the embedding (`embed_tokens`) and of the output head (`shared_head.head`) in every MTP layer, where Megatron-Core
shares the model's: the copies are read only when equal to the model's (refused otherwise, never dropped) and
written back as copies.

transformers never saves MTP layers (its config keeps `num_nextn_predict_layers`, its `save_pretrained` writes no
`model.layers.{num_hidden_layers}.*`): a model whose files hold none of them is converted without them and says so;
one holding some of them but not all is refused naming the first missing tensor.

Qwen3-Next's and Qwen3.5's releases store their one MTP layer apart, under `mtp.` (`release_mtp_layer`).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from reshard.config import ModelConfig
from reshard.converters.base import E, Mapping, Rename, Tensor, at_layer, bad_value, embeddings_and_head
from reshard.errors import ReshardError


def mtp_count(hf: dict) -> int:
    """The MTP layers an HF config names (`num_nextn_predict_layers`), checked."""
    mtp = hf.get("num_nextn_predict_layers") or 0
    if type(mtp) is not int or not 0 <= mtp < 1 << 16:
        raise bad_value("num_nextn_predict_layers", mtp, "a whole number of MTP layers")
    return mtp


def _same_bytes(a: Tensor, b: Tensor, step: int = 1 << 26) -> bool:
    """Whether two arrays hold the same bytes, compared a bounded run at a time (an embedding is gigabytes)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = (np.ascontiguousarray(t).reshape(-1).view(np.uint8) for t in (a, b))
    return all(np.array_equal(a[i : i + step], b[i : i + step]) for i in range(0, a.size, step))


class Copies(Mapping):
    """One Megatron tensor that HF stores several times (the model's, then each MTP layer's copy): read, every
    copy must hold the model's bytes; written, each gets them."""

    def __init__(self, megatron: str, *hf: str):
        object.__setattr__(self, "megatron", megatron)
        object.__setattr__(self, "hf", hf)

    def to_megatron(self, tensors: list[Tensor], config: ModelConfig) -> Tensor:
        for name, other in zip(self.hf[1:], tensors[1:]):
            if not _same_bytes(tensors[0], other):
                raise ReshardError(
                    f"HF tensor {name} differs from {self.hf[0]}: Megatron-Core's MTP layers share the model's "
                    "embedding and output layer, so a model whose MTP copies differ cannot be converted without losing one"
                )
        return tensors[0]

    def to_hf(self, tensor: Tensor, config: ModelConfig) -> list[Tensor]:
        return [tensor] * len(self.hf)


def mtp_layers(config: ModelConfig, layer: list[Mapping]) -> list[Mapping]:
    """The MTP layers' own tensors, `layer` being the decoder layer mappings of their transformer layers' kind."""
    out: list[Mapping] = []
    for i in range(config.mtp_num_layers or 0):
        m, p = f"mtp.layers.{i}.", f"model.layers.{config.num_layers + i}."
        out += [
            Rename(f"{m}enorm.weight", f"{p}enorm.weight"),
            Rename(f"{m}hnorm.weight", f"{p}hnorm.weight"),
            Rename(f"{m}eh_proj.weight", f"{p}eh_proj.weight"),
            Rename(f"{m}final_layernorm.weight", f"{p}shared_head.norm.weight"),
            *(at_layer(mapping, config.num_layers + i, f"{m}transformer_layer.") for mapping in layer),
        ]
    return out


def release_mtp_layer(config: ModelConfig, layer: list[Mapping]) -> list[Mapping]:
    """Qwen3-Next's and Qwen3.5's one MTP layer as their releases store it, under `mtp.` (Megatron-Bridge 0.6.2's
    qwen3_next_bridge and qwen35_bridge tables): `fc` its eh_proj, `pre_fc_norm_embedding` and `pre_fc_norm_hidden`
    its enorm and hnorm, `norm` its final_layernorm, `mtp.layers.0.*` its transformer layer, `layer` being that
    layer's mappings with HF names under `mtp.`."""
    if not config.mtp_num_layers:
        return []
    m = "mtp.layers.0."
    return [Rename(f"{m}enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
            Rename(f"{m}hnorm.weight", "mtp.pre_fc_norm_hidden.weight"),
            Rename(f"{m}eh_proj.weight", "mtp.fc.weight"),
            Rename(f"{m}final_layernorm.weight", "mtp.norm.weight"),
            *(at_layer(mapping, 0, f"{m}transformer_layer.") for mapping in layer)]


def copy_names(config: ModelConfig) -> tuple[list[str], list[str]]:
    """The HF names of the MTP layers' copies of the embedding, and of the output head."""
    mtp = [f"model.layers.{config.num_layers + i}." for i in range(config.mtp_num_layers or 0)]
    return [f"{p}embed_tokens.weight" for p in mtp], [f"{p}shared_head.head.weight" for p in mtp]


def embeddings_and_heads(config: ModelConfig) -> list[Mapping]:
    """The embedding, final norm and output layer, with the copies of the embedding and head each MTP layer keeps."""
    table = embeddings_and_head(config)
    if not config.mtp_num_layers:
        return table
    embeds, heads = copy_names(config)
    if config.tied_embeddings:
        return [Copies("embedding.word_embeddings.weight", "model.embed_tokens.weight", *embeds, *heads), *table[1:]]
    return [Copies("embedding.word_embeddings.weight", "model.embed_tokens.weight", *embeds), table[1],
            Copies("output_layer.weight", "lm_head.weight", *heads)]


def without_absent_mtp(config: ModelConfig, table: list[Mapping], stored: Collection[str],
                       field: str = "num_nextn_predict_layers", mtp: tuple[str, ...] = ()) -> tuple[ModelConfig, list[str]]:
    """(config, what is not carried) for files holding `stored` HF names, `table` being the model's mappings: with
    `mtp_num_layers` 0 where config.json names MTP layers (its `field`) and the files hold none of their tensors (as
    transformers saves such a model); a model holding part of them is refused naming the first missing tensor. `mtp`:
    the HF name prefixes of the MTP layers' tensors (DeepSeek-V3's `model.layers.{num_layers + i}.` by default)."""
    count = config.mtp_num_layers or 0
    if not count:
        return config, []
    mtp = mtp or tuple(f"model.layers.{config.num_layers + i}." for i in range(count))
    if not any(name.startswith(mtp) for name in stored):
        return config.replace(mtp_num_layers=0), [f"MTP layers ({count} named by {field}, none in the files)"]
    for mapping in table:
        experts = range(config.num_experts or 0) if any(E in name for name in mapping.hf) else [None]
        for name in (name for expert in experts for name in mapping.hf_names(expert=expert)):
            if name.startswith(mtp) and name not in stored:
                raise ReshardError(
                    f"tensor {name} is missing: config.json names {count} MTP layer(s) ({field}) and the files hold "
                    f"some of their tensors but not all; fix the download, or set {field} to 0 and remove the rest to "
                    "convert without them"
                )
    return config, []
