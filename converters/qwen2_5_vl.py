"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): Qwen2's language model with multimodal rotary embeddings
(MRoPE) beside a vision tower, as Megatron-Bridge trains it (its Qwen25VLModel).

- Megatron side (what Bridge 0.6.2 writes in torch_dist): the language model, a megatron-core GPTModel with
  position_embedding_type "mrope", under `language_model.`; the vision tower and its merger, HF modules, under
  their HF names `visual.*`, whole on every TP rank (Bridge's ReplicatedMapping "visual.**") and on the first
  pipeline stage (`config.Tower`).
- HF side: transformers >= 5 builds `model.language_model.*`, `model.visual.*` and `lm_head`, but saves (as Bridge
  reads) `model.layers.*` / `visual.*`: both are read (`for_files`), the latter written. config.json nests
  `text_config` and `vision_config` (older files keep the text fields at the top); `mrope_section` lives in the
  text config's rope_parameters (rope_scaling in older files) and must cover every rotary frequency (head_dim / 2).
- The vision config is carried as the tower's HF config and checked against the tensors: every size a shape shows.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from reshard.config import ModelConfig, Tower
from reshard.converters.base import Rename, bad_value, embeddings_and_head, llama_attention, llama_dense_mlp, under
from reshard.converters.qwen2 import Qwen2
from reshard.errors import ReshardError

LANGUAGE = "language_model."  # Bridge's Megatron prefix of the language model
VISUAL = "visual."  # the vision tower's, Megatron's (Bridge's) and the saved HF files' alike


def check_bridge_vl(config: ModelConfig, family: str, tower: str, prefix: str) -> None:
    """Refuse a Megatron model that is not Bridge's VL model of `family`: its language model under LANGUAGE, one
    `tower` under `prefix`, MRoPE sections that cut the rotary frequencies."""
    if config.language_model_prefix != LANGUAGE or [t.prefix for t in config.towers] != [prefix]:
        raise ReshardError(f"the model is not Megatron-Bridge's {family} (the language model under {LANGUAGE!r}, "
                           f"{tower} under {prefix!r}): keep it in a Megatron format")
    if not config.mrope_section or sum(config.mrope_section) != rotary_frequencies(config):
        raise ReshardError(f"mrope_section={config.mrope_section} does not cut the {rotary_frequencies(config)} rotary frequencies")


def rotary_frequencies(config: ModelConfig) -> int:
    """How many frequencies a head's rotary embedding has: half its rotating dims (partial rotary: a fraction of them)."""
    return round(config.head_dim * config.rotary_percent) // 2
# config.json's own keys beside the nested text and vision configs
_TOP = ("architectures", "model_type", "tie_word_embeddings", "dtype", "torch_dtype", "transformers_version", "image_token_id",
        "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_token_id", "text_config", "vision_config")
# The fields of Megatron-Bridge's provider (its run_config.yaml) this family reads beyond a GPT provider's (Bridge keeps
# the HF vision config object whole: its own fields are kept, PretrainedConfig's not)
TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_token_id")
_VISION_CLASS = "transformers.models.qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLVisionConfig"
_VISION_KEYS = ("depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size", "spatial_merge_size",
                "temporal_patch_size", "tokens_per_second", "window_size", "fullatt_block_indexes", "out_hidden_size",
                "initializer_range", "model_type", "rope_parameters")
# vision_config sizes, by the name transformers reads (older files: in_chans)
_VISION_SIZES = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size", "temporal_patch_size",
                 "spatial_merge_size")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: `text_config` over the top-level keys (older files keep them at the top)."""
    text = hf.get("text_config", {})
    if not isinstance(text, dict):
        raise bad_value("text_config", text, "an object of settings")
    return {**{k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}, **text}


def split_mrope(text: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(the text config with MRoPE taken out of its rope dict, the sections); refuses a config without them."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and "mrope_section" in rope:
            section = rope["mrope_section"]
            if not isinstance(section, list) or not section or any(type(s) is not int or s < 1 for s in section):
                raise bad_value(f"{key}.mrope_section", section, "a list of whole numbers from 1")
            rest = {k: v for k, v in rope.items() if k not in ("mrope_section", "type")}
            return {**text, key: {"rope_type": "default", **rest}}, tuple(section)
    raise bad_value("text_config.rope_parameters", text.get("rope_parameters", text.get("rope_scaling")), "MRoPE's (mrope_section)")


def vision_tensors(vision: dict[str, Any], text_hidden: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The vision tower's tensors (Qwen2_5_VisionTransformerPretrainedModel's) and shapes, for its config."""
    if not isinstance(vision, dict):
        raise bad_value("vision_config", vision, "an object of settings")
    sizes = {}
    for field in (*_VISION_SIZES, "in_channels"):
        value = vision.get(field, vision.get("in_chans", 3) if field == "in_channels" else None)
        if type(value) is not int or not 0 < value < 1 << 31:
            raise bad_value(f"vision_config.{field}", value, "a whole number from 1")
        sizes[field] = value
    h, inner, out = sizes["hidden_size"], sizes["intermediate_size"], sizes["out_hidden_size"]
    if h % sizes["num_heads"]:
        raise bad_value("vision_config.num_heads", sizes["num_heads"], f"a divisor of vision_config.hidden_size={h}")
    if out != text_hidden:  # the merger's output replaces the image tokens' embeddings
        raise bad_value("vision_config.out_hidden_size", out, f"the language model's hidden_size {text_hidden}")
    merged = h * sizes["spatial_merge_size"] ** 2
    patch = sizes["patch_size"]
    shapes: dict[str, tuple[int, ...]] = {"patch_embed.proj.weight": (h, sizes["in_channels"], sizes["temporal_patch_size"], patch, patch)}
    for i in range(sizes["depth"]):
        b = f"blocks.{i}."
        shapes.update({f"{b}norm1.weight": (h,), f"{b}norm2.weight": (h,), f"{b}attn.qkv.weight": (3 * h, h), f"{b}attn.qkv.bias": (3 * h,),
                       f"{b}attn.proj.weight": (h, h), f"{b}attn.proj.bias": (h,)})
        for name, (rows, cols) in (("gate_proj", (inner, h)), ("up_proj", (inner, h)), ("down_proj", (h, inner))):
            shapes.update({f"{b}mlp.{name}.weight": (rows, cols), f"{b}mlp.{name}.bias": (rows,)})
    shapes.update({"merger.ln_q.weight": (h,), "merger.mlp.0.weight": (merged, merged), "merger.mlp.0.bias": (merged,),
                   "merger.mlp.2.weight": (out, merged), "merger.mlp.2.bias": (out,)})
    return tuple((VISUAL + name, shape) for name, shape in shapes.items())


def vision_tower(vision: dict[str, Any], text_hidden: int) -> Tower:
    """The vision tower of `vision` (its HF config), with the parts Bridge's Qwen25VLModel.freeze names: the vision model
    (patch embedding and blocks) and the vision projection (the merger)."""
    parts = (("vision_model", (VISUAL + "patch_embed.", VISUAL + "blocks.")), ("vision_projection", (VISUAL + "merger.",)))
    return Tower(VISUAL, vision_tensors(vision, text_hidden), json.dumps(vision, sort_keys=True), parts=parts)


def from_bridge(model: dict[str, Any]) -> dict[str, Any]:
    """The Megatron args of a Bridge Qwen25VLModelProvider (its run_config.yaml's model section) beyond a GPT
    provider's: the language model's prefix, the vision tower, and the HF config fields an export writes back."""
    vision = model.get("vision_config")
    if not isinstance(vision, dict):
        raise bad_value("run_config.yaml model.vision_config", vision, "Qwen2.5-VL's vision config")
    vision = {key: vision[key] for key in _VISION_KEYS if key in vision}
    tower = vision_tower(vision, model["hidden_size"])
    hf = {"model_type": "qwen2_5_vl", **{key: model[key] for key in TOKEN_FIELDS if type(model.get(key)) is int}, "vision_config": vision}
    return {"language_model_prefix": LANGUAGE, "towers": [tower], "hf_model_type": "qwen2_5_vl", "hf_config": hf}


def to_bridge(config: ModelConfig, hf: dict[str, Any] | None) -> dict[str, Any]:
    """The fields of a Bridge Qwen25VLModelProvider beyond a GPT provider's, for the model and the HF config `hf` it was
    imported from (its token ids): what `from_bridge` reads back."""
    vision = json.loads(next(t for t in config.towers if t.prefix == VISUAL).hf_config)
    tokens = {key: value for key, value in text_config(hf or {}).items() if key in TOKEN_FIELDS}
    return {"mrope_section": list(config.mrope_section or ()), "vision_config": {"_target_": _VISION_CLASS, **vision}, **tokens}


class Qwen2_5_VL(Qwen2):
    model_type = "qwen2_5_vl"
    architectures = ("Qwen2_5_VLForConditionalGeneration",)
    signature = {**Qwen2.signature, "position_embedding_type": "mrope"}
    ignored = (*Qwen2.ignored, r"\.rotary_pos_emb\.inv_freq$")

    def __init__(self, text: str = "model.", visual: str = VISUAL):
        self.text, self.visual = text, visual  # the two towers' HF prefixes in the files (`for_files`)

    def config_from_hf(self, hf):
        text, section = split_mrope(text_config(hf))
        config, extras = super().config_from_hf(text)
        if sum(section) != config.head_dim // 2:
            raise bad_value("text_config.rope_parameters.mrope_section", list(section),
                            f"sections of the {config.head_dim // 2} rotary frequencies (head_dim / 2) in all")
        vision = hf.get("vision_config")
        tower = vision_tower(vision, config.hidden_size)
        return config.replace(position_embedding_type="mrope", mrope_section=section, language_model_prefix=LANGUAGE,
                              towers=(tower,)), extras

    def for_files(self, config, stored):
        if any(name.startswith("model.language_model.") for name in stored):  # as transformers >= 5 builds it
            return Qwen2_5_VL("model.language_model.", "model.visual."), config, []
        return self, config, []

    def check_megatron(self, config: ModelConfig) -> None:
        super().check_megatron(config)
        check_bridge_vl(config, "Qwen2.5-VL", "a vision tower", VISUAL)

    def mappings(self, config):
        text = [*embeddings_and_head(config, self.text), *llama_attention(config, self.text, qkv_bias=True), *llama_dense_mlp(self.text)]
        tower = next(t for t in config.towers if t.prefix == VISUAL)
        return [*(under(LANGUAGE, m) for m in text),
                *(Rename(name, self.visual + name.removeprefix(VISUAL)) for name, _ in tower.tensors)]

    def config_to_hf(self, config, saved=None, extras=None):
        saved = copy.deepcopy(saved) if saved and saved.get("model_type") == self.model_type else {}
        flat = super().config_to_hf(config, {**text_config(saved), "model_type": self.model_type}, extras)
        return nested_hf_config(flat, config, saved, "qwen2_5_vl_text", {"mrope_section": list(config.mrope_section), "type": "mrope"})


def nested_hf_config(flat: dict[str, Any], config: ModelConfig, saved: dict[str, Any], text_type: str, mrope: dict[str, Any]) -> dict[str, Any]:
    """A VL model's config.json: `flat` (its language model's, as the text family writes it from `saved`, the imported
    config) nested as `text_config` with the MRoPE fields `mrope` in its rope_parameters, beside its one tower's
    vision_config."""
    text = {k: v for k, v in flat.items() if k not in _TOP and k not in ("rope_scaling", "rope_theta")}
    if "head_dim" not in text_config(saved) and config.head_dim == config.hidden_size // config.num_attention_heads:
        del text["head_dim"]  # transformers derives it, and does not save it
    if "tie_word_embeddings" in (saved.get("text_config") or {}):  # transformers >= 5.24's Qwen3-VL saves it in both
        text["tie_word_embeddings"] = flat["tie_word_embeddings"]
    text.update(model_type=text_type, rope_parameters={**mrope, "rope_theta": config.rotary_base, "rope_type": "default"})
    top = {k: v for k, v in flat.items() if k in _TOP}
    return {**top, "text_config": text, "vision_config": json.loads(config.towers[0].hf_config)}
