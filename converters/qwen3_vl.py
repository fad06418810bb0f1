"""Qwen3-VL (Qwen3VLForConditionalGeneration, dense): Qwen3's language model (q/k norms, no biases) with interleaved
multimodal rotary embeddings beside a vision model in Megatron form, as Megatron-Bridge trains it (its Qwen3VLModel).

- Megatron side (Bridge 0.6.2's torch_dist): the language model, a megatron-core GPTModel with position_embedding_type
  "mrope", under `language_model.`; the vision model under `vision_model.` as Bridge builds it with Transformer
  Engine's layers: its blocks a megatron-core TransformerBlock (`decoder.layers.*`, stacked on a leading axis of
  blocks, q/k/v fused per head as `linear_qkv`, LayerNorms fused into the linear layers), the DeepStack mergers
  stacked likewise (`decoder.deepstack_merger_list.*`), the final merger, the patch embedding (a 3-D convolution) and
  the learned position embeddings. The linear layers split over TP as megatron-core splits them (q/k/v and fc1
  by output rows with their biases, proj and fc2 by input columns, their biases whole); the rest is whole. All of it
  is on the first pipeline stage (`config.Tower`).
- HF side (transformers >= 5): `model.language_model.*`, `model.visual.*`, `lm_head`; config.json nests `text_config`
  (its rope_parameters: `mrope_section`, `mrope_interleaved`) and `vision_config` (carried as the tower's HF config and
  checked against the tensors: every size a shape shows).
- MRoPE here is interleaved (transformers' Qwen3-VL rotates frequency i by the temporal, height or width position as
  i mod 3 says, within the sections' lengths); megatron-core 0.16.1's "mrope" cuts the frequencies into contiguous
  sections (Qwen2.5-VL's), so its GPTModel is no oracle of this language model: Bridge brings its own rotary.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from reshard.config import ModelConfig, Tower
from reshard.converters.base import (
    FusedQKV,
    L,
    Mapping,
    Rename,
    bad_value,
    embeddings_and_head,
    llama_attention,
    llama_dense_mlp,
    refuse,
    under,
)
from reshard.converters.qwen2_5_vl import (
    LANGUAGE,
    TOKEN_FIELDS,
    check_bridge_vl,
    nested_hf_config,
    rotary_frequencies,
    split_mrope,
    text_config,
)
from reshard.converters.qwen3 import Qwen3

VISION = "vision_model."  # Bridge's Megatron prefix of the vision model
_BLOCKS, _DEEPSTACK = f"{VISION}decoder.layers.", f"{VISION}decoder.deepstack_merger_list."
# The fields of Bridge's provider's vision config object (run_config.yaml) kept: its own, not PretrainedConfig's
_VISION_CLASS = "transformers.models.qwen3_vl.configuration_qwen3_vl.Qwen3VLVisionConfig"
_VISION_KEYS = ("depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size", "spatial_merge_size",
                "temporal_patch_size", "out_hidden_size", "num_position_embeddings", "deepstack_visual_indexes", "initializer_range",
                "model_type")
# vision_config sizes, by the name transformers reads
_VISION_SIZES = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size", "temporal_patch_size",
                 "spatial_merge_size", "in_channels", "num_position_embeddings")


def _vision_sizes(vision: Any) -> dict[str, Any]:
    if not isinstance(vision, dict):
        raise bad_value("vision_config", vision, "an object of settings")
    sizes: dict[str, Any] = {}
    for field in _VISION_SIZES:
        value = vision.get(field)
        if type(value) is not int or not 0 < value < 1 << 31:
            raise bad_value(f"vision_config.{field}", value, "a whole number from 1")
        sizes[field] = value
    indexes = vision.get("deepstack_visual_indexes", [])
    if not isinstance(indexes, list) or any(type(i) is not int or not 0 <= i < sizes["depth"] for i in indexes):
        raise bad_value("vision_config.deepstack_visual_indexes", indexes, f"a list of block indexes below depth={sizes['depth']}")
    if sizes["hidden_size"] % sizes["num_heads"]:
        raise bad_value("vision_config.num_heads", sizes["num_heads"], f"a divisor of vision_config.hidden_size={sizes['hidden_size']}")
    if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise bad_value("vision_config.hidden_act", vision.get("hidden_act"), "gelu_pytorch_tanh (Bridge's vision model's)")
    return {**sizes, "deepstack": len(indexes)}


def _merger(prefix: str, norm: int, merged: int, out: int, lead: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], str | None]]:
    """A patch merger's tensors (Qwen3VLVisionPatchMerger): norm, then fc1 column- and fc2 row-parallel."""
    return [(f"{prefix}patch_norm.weight", (*lead, norm), None), (f"{prefix}patch_norm.bias", (*lead, norm), None),
            (f"{prefix}linear_fc1.weight", (*lead, merged, merged), "column"), (f"{prefix}linear_fc1.bias", (*lead, merged), "column"),
            (f"{prefix}linear_fc2.weight", (*lead, out, merged), "row"), (f"{prefix}linear_fc2.bias", (*lead, out), None)]


def vision_tower(vision: Any, text_hidden: int) -> Tower:
    """The vision model (Bridge's Qwen3VLVisionModel) as a tower: its tensors, their TP splits, its stacked blocks."""
    s = _vision_sizes(vision)
    h, inner, out, depth = s["hidden_size"], s["intermediate_size"], s["out_hidden_size"], (s["depth"],)
    if out != text_hidden:  # the mergers' outputs replace (and add to) the image tokens' hidden states
        raise bad_value("vision_config.out_hidden_size", out, f"the language model's hidden_size {text_hidden}")
    merged, patch = h * s["spatial_merge_size"] ** 2, s["patch_size"]
    a, m = f"{_BLOCKS}self_attention.", f"{_BLOCKS}mlp."
    table = [(f"{VISION}patch_embed.proj.weight", (h, s["in_channels"], s["temporal_patch_size"], patch, patch), None),
             (f"{VISION}patch_embed.proj.bias", (h,), None), (f"{VISION}pos_embed.weight", (s["num_position_embeddings"], h), None),
             (f"{a}linear_qkv.layer_norm_weight", (*depth, h), None), (f"{a}linear_qkv.layer_norm_bias", (*depth, h), None),
             (f"{a}linear_qkv.weight", (*depth, 3 * h, h), "column"), (f"{a}linear_qkv.bias", (*depth, 3 * h), "column"),
             (f"{a}linear_proj.weight", (*depth, h, h), "row"), (f"{a}linear_proj.bias", (*depth, h), None),
             (f"{m}linear_fc1.layer_norm_weight", (*depth, h), None), (f"{m}linear_fc1.layer_norm_bias", (*depth, h), None),
             (f"{m}linear_fc1.weight", (*depth, inner, h), "column"), (f"{m}linear_fc1.bias", (*depth, inner), "column"),
             (f"{m}linear_fc2.weight", (*depth, h, inner), "row"), (f"{m}linear_fc2.bias", (*depth, h), None),
             *(_merger(_DEEPSTACK, merged, merged, out, (s["deepstack"],)) if s["deepstack"] else []),
             *_merger(f"{VISION}merger.", h, merged, out, ())]
    return Tower(VISION, tuple((name, shape) for name, shape, _ in table), json.dumps(vision, sort_keys=True),
                 splits=tuple((name, split) for name, _, split in table if split), stacked=(_BLOCKS, _DEEPSTACK),
                 tp_units=(("vision attention heads (vision_config.num_heads)", s["num_heads"]),
                           ("vision FFN size (vision_config.intermediate_size)", inner),
                           ("vision merger width (vision_config.hidden_size x spatial_merge_size^2)", merged)),
                 extra_state=_extra_state(bool(s["deepstack"])),
                 # Qwen3VLModel.freeze: freeze_vision_model freezes the whole vision model but gives the mergers back
                 # their gradients unless freeze_vision_projection froze them (model.py:482-497)
                 parts=(("vision_model", (f"{VISION}patch_embed.", f"{VISION}pos_embed.", _BLOCKS)),
                        ("vision_projection", (_DEEPSTACK, f"{VISION}merger."))))


def _extra_state(deepstack: bool) -> tuple[str, ...]:
    """The vision model's modules whose (empty) extra state Bridge's Transformer Engine layers save."""
    mergers = ((_DEEPSTACK,) if deepstack else ()) + (f"{VISION}merger.",)
    return (*(f"{_BLOCKS}self_attention.{module}" for module in ("linear_qkv", "linear_proj", "core_attention")),
            f"{_BLOCKS}mlp.linear_fc1", f"{_BLOCKS}mlp.linear_fc2", *(f"{merger}linear_fc{i}" for merger in mergers for i in (1, 2)))


def vision_mappings(tower: Tower, hf: str) -> list[Mapping]:
    """Bridge's Qwen3-VL vision names <-> HF's under `hf` (`model.visual.`); q/k/v fused per head as Bridge's
    ConcatenatedQKVMapping fuses them."""
    vision = json.loads(tower.hf_config)
    heads = (vision["num_heads"], vision["hidden_size"] // vision["num_heads"])
    a, m, b = f"{_BLOCKS}self_attention.", f"{_BLOCKS}mlp.", f"{hf}blocks.{L}."
    out: list[Mapping] = [Rename(f"{VISION}patch_embed.proj.weight", f"{hf}patch_embed.proj.weight"),
                          Rename(f"{VISION}patch_embed.proj.bias", f"{hf}patch_embed.proj.bias"),
                          Rename(f"{VISION}pos_embed.weight", f"{hf}pos_embed.weight")]
    for kind in ("weight", "bias"):
        out += [Rename(f"{a}linear_qkv.layer_norm_{kind}", f"{b}norm1.{kind}"),
                FusedQKV(f"{a}linear_qkv.{kind}", f"{b}attn.qkv.{kind}", conv1d=False, heads=heads),
                Rename(f"{a}linear_proj.{kind}", f"{b}attn.proj.{kind}"),
                Rename(f"{m}linear_fc1.layer_norm_{kind}", f"{b}norm2.{kind}"),
                *(Rename(f"{m}{fc}.{kind}", f"{b}mlp.{fc}.{kind}") for fc in ("linear_fc1", "linear_fc2"))]
        for megatron, module in ((_DEEPSTACK, f"{hf}deepstack_merger_list.{L}."), (f"{VISION}merger.", f"{hf}merger.")):
            out += [Rename(f"{megatron}patch_norm.{kind}", f"{module}norm.{kind}"),
                    *(Rename(f"{megatron}{fc}.{kind}", f"{module}{fc}.{kind}") for fc in ("linear_fc1", "linear_fc2"))]
    names = dict(tower.tensors)
    return [mapping for mapping in out if mapping.megatron in names]  # no DeepStack mergers: none of theirs


def from_bridge(model: dict[str, Any], model_type: str = "qwen3_vl") -> dict[str, Any]:
    """The Megatron args of a Bridge Qwen3VLModelProvider (its run_config.yaml's model section) beyond a GPT provider's:
    the language model's prefix, the vision model, and the HF config fields an export writes back (HF `model_type`'s:
    Qwen3-VL-MoE's provider is read alike)."""
    vision = model.get("vision_config")
    if not isinstance(vision, dict):
        raise bad_value("run_config.yaml model.vision_config", vision, "Qwen3-VL's vision config")
    vision = {key: vision[key] for key in _VISION_KEYS if key in vision}
    hf = {"model_type": model_type, **{key: model[key] for key in TOKEN_FIELDS if type(model.get(key)) is int}, "vision_config": vision}
    return {"language_model_prefix": LANGUAGE, "towers": [vision_tower(vision, model["hidden_size"])], "hf_model_type": model_type,
            "hf_config": hf}


def to_bridge(config: ModelConfig, hf: dict[str, Any] | None, vision_class: str = _VISION_CLASS) -> dict[str, Any]:
    """The fields of a Bridge Qwen3VLModelProvider beyond a GPT provider's (what `from_bridge` reads back); its vision
    config's class `vision_class`."""
    vision = json.loads(config.towers[0].hf_config)
    tokens = {key: value for key, value in text_config(hf or {}).items() if key in TOKEN_FIELDS}
    return {"mrope_section": list(config.mrope_section or ()), "vision_config": {"_target_": vision_class, **vision}, **tokens}


class BridgeVL:
    """Megatron-Bridge's Qwen3VLModel around a text family's language model (the class after this one in a family's
    bases: Qwen3's here, Qwen3.5's in `converters.qwen3_5_vl`): its config nested in `text_config`, its HF names under
    `text_prefix` and Megatron's under `language_model.`, interleaved MRoPE, Qwen3-VL's vision model under
    `vision_model.`."""

    model_type: str
    name: str
    text_prefix, visual_prefix = "model.language_model.", "model.visual."
    text_type: str  # text_config's model_type

    def config_from_hf(self, hf):
        text = text_config(hf)
        rope = text.get("rope_parameters")
        if isinstance(rope, dict) and rope.get("mrope_interleaved", True) is not True:
            raise bad_value("text_config.rope_parameters.mrope_interleaved", rope["mrope_interleaved"],
                            f"true ({self.name}'s rotary interleaves its sections)")
        if isinstance(rope, dict):
            text = {**text, "rope_parameters": {k: v for k, v in rope.items() if k != "mrope_interleaved"}}
        text, section = split_mrope(text)
        config, extras = super().config_from_hf(text)
        if sum(section) != rotary_frequencies(config):
            raise bad_value("text_config.rope_parameters.mrope_section", list(section),
                            f"sections of the {rotary_frequencies(config)} rotary frequencies in all")
        return config.replace(position_embedding_type="mrope", mrope_section=section, language_model_prefix=LANGUAGE,
                              towers=(vision_tower(hf.get("vision_config"), config.hidden_size),)), extras

    def check_hf(self, hf):
        if hf.get("mtp_num_hidden_layers") and not self.holds_mtp:  # Qwen3.5-VL's text family maps its release's MTP layer
            raise refuse(f"mtp_num_hidden_layers={hf['mtp_num_hidden_layers']}", f"{self.name} has no MTP layer; set it to 0 and "
                         "remove mtp.* to convert the rest")
        super().check_hf(hf)

    def check_megatron(self, config: ModelConfig) -> None:
        super().check_megatron(config)
        check_bridge_vl(config, self.name, "a vision model", VISION)

    def text_mappings(self, config: ModelConfig) -> list[Mapping]:
        """The language model's mappings, HF names under `text_prefix`: the text family's."""
        return super().mappings(config)

    def mappings(self, config):
        return [*(under(LANGUAGE, m) for m in self.text_mappings(config)), *vision_mappings(config.towers[0], self.visual_prefix)]

    def config_to_hf(self, config, saved=None, extras=None):
        saved = copy.deepcopy(saved) if saved and saved.get("model_type") == self.model_type else {}
        flat = super().config_to_hf(config, {**text_config(saved), "model_type": self.model_type}, extras)
        rope = {k: v for k, v in (flat.get("rope_parameters") or {}).items() if k not in ("rope_theta", "rope_type")}
        return nested_hf_config(flat, config, saved, self.text_type,
                                {**rope, "mrope_interleaved": True, "mrope_section": list(config.mrope_section)})


class Qwen3VL(BridgeVL, Qwen3):
    model_type = "qwen3_vl"
    architectures = ("Qwen3VLForConditionalGeneration",)
    name = "Qwen3-VL"
    signature = {**Qwen3.signature, "position_embedding_type": "mrope"}
    text_type = "qwen3_vl_text"

    def text_mappings(self, config: ModelConfig) -> list[Mapping]:
        """Qwen3's mappings under `text_prefix` (Qwen3-VL-MoE's differ: `converters.qwen3_vl_moe`)."""
        return [*embeddings_and_head(config, self.text_prefix), *llama_attention(config, self.text_prefix),
                *llama_dense_mlp(self.text_prefix)]

    def adjust_to_hf(self, out, config):
        out["attention_bias"] = False  # Qwen3VLTextConfig has no sliding window to switch off
