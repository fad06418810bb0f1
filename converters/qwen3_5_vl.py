"""Qwen3.5-VL (Qwen3_5ForConditionalGeneration, and its MoE, Qwen3_5MoeForConditionalGeneration): Qwen3.5's hybrid
language model (`converters/qwen3_5.py`, `converters/qwen3_5_moe.py`: Gated DeltaNet and gated attention layers,
zero-centred norms, partial rotary) beside Qwen3-VL's vision model without DeepStack mergers, as Megatron-Bridge 0.6.2
trains it (`Qwen35VLBridge` / `Qwen35VLMoEBridge`: its Qwen3VLModel, the language model under `language_model.`, the
vision model under `vision_model.` in Qwen3-VL's Megatron form, `converters/qwen3_vl.py`).

- HF side (transformers 5.24): `model.language_model.*` (the text family's tensors), `model.visual.*`, `lm_head`;
  config.json nests `text_config` (model_type qwen3_5_text / qwen3_5_moe_text) and `vision_config`.
- MRoPE: interleaved as Qwen3-VL's (transformers' Qwen3.5 interleaves always), its sections cutting the rotating
  frequencies only: a quarter of each head's dims rotate (partial_rotary_factor), so the released [11, 11, 10] cut 32
  of a 256-dim head's.
- MoE: experts per expert (as transformers saves them) or fused as released, each read and written back as it came
  (`Qwen3_5Moe.files_form`).
- MTP: the release's one MTP layer (`text_config.mtp_num_hidden_layers`, its tensors top-level `mtp.*`) is the text
  families' (`converters.mtp.release_mtp_layer`) under `language_model.mtp.`, as Bridge's qwen35_vl tables map it.
"""

from __future__ import annotations

from typing import Any

from reshard.converters import qwen3_vl
from reshard.converters.qwen3_5 import Qwen3_5
from reshard.converters.qwen3_5_moe import Qwen3_5Moe
from reshard.converters.qwen3_vl import BridgeVL


class Qwen3_5VL(BridgeVL, Qwen3_5):
    model_type = "qwen3_5"
    architectures = ("Qwen3_5ForConditionalGeneration",)
    name = "Qwen3.5-VL"
    signature = {**Qwen3_5.signature, "position_embedding_type": "mrope"}
    text_type = "qwen3_5_text"


class Qwen3_5VLMoe(BridgeVL, Qwen3_5Moe):
    model_type = "qwen3_5_moe"
    architectures = ("Qwen3_5MoeForConditionalGeneration",)
    name = "Qwen3.5-VL-MoE"
    signature = {**Qwen3_5Moe.signature, "position_embedding_type": "mrope"}
    text_type = "qwen3_5_moe_text"


def from_bridge(model: dict[str, Any]) -> dict[str, Any]:
    """The Megatron args of a Bridge Qwen35VLModelProvider or Qwen35VLMoEModelProvider (run_config.yaml's model section)
    beyond its language model's: Qwen3-VL's (`qwen3_vl.from_bridge`: the vision model, the token ids), under the HF
    model_type of the provider's family."""
    moe = str(model.get("_target_", "")).endswith("MoEModelProvider")
    return qwen3_vl.from_bridge(model, (Qwen3_5VLMoe if moe else Qwen3_5VL).model_type)
