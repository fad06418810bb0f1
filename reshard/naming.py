"""How Megatron spells names: canonical logical names vs. the local and Transformer-Engine specs.

Canonical tensor names are Transformer-Engine torch_dist keys. Two spellings differ from them:
- Megatron-Core's local spec keeps separate norm modules. In legacy files they appear as
  `input_layernorm.*` / `pre_mlp_layernorm.*`; in torch_dist the local spec maps them to the TE
  names, except that a MoE layer's pre-MLP norm becomes `mlp.linear_fc1.layer_norm_*` (local) where
  Transformer Engine keeps `pre_mlp_layernorm.*` (our canonical name).
- Legacy files number layers per pipeline stage and experts per rank (`local_experts.{j}`).

Non-tensor module state (`_extra_state`, e.g. Transformer-Engine FP8 metadata) is keyed the way
torch_dist keys its ShardedObjects: `<module>._extra_state/shard_<offsets>_<shape>`, with the
global layer (and expert) index as offsets, so the key is layout-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from reshard.config import LayerKind, ModelConfig

# Canonical layer-level name tail -> spelling, per (format family, implementation, MoE model).
_SPELLINGS: dict[tuple[str, bool, bool], dict[str, str]] = {
    ("dist", False, True): {
        "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
        "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    },
    ("legacy", False, False): {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    },
    ("legacy", False, True): {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    },
}
# Multi-latent attention's local spec keeps its norms as modules and maps no names in either format, where
# Transformer Engine fuses the q/kv latent norms into the up projections and a dense pre-MLP norm into fc1.
_MLA_LOCAL = {
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_bias": "self_attention.q_layernorm.bias",  # LayerNorm's
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_bias": "self_attention.kv_layernorm.bias",
}
_MLA_LOCAL_DENSE = {
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_INDEXED = re.compile(r"^(?:.*\.)?decoder\.layers\.(\d+)\.")
_EXPERT_MODULE = re.compile(r"(?<!shared_)experts\.experts\.")
# A decoder layer's tensors, or a multi-token-prediction layer's transformer layer's (spelled as a decoder layer's).
_LAYER_NAME = re.compile(r"^(?P<head>(?:.*\.)?(?:decoder\.layers\.|mtp\.layers\.\d+\.transformer_layer\.))(?P<index>\d+\.)?(?P<tail>.+)$")
_MTP = re.compile(r"^(?:.*\.)?mtp\.layers\.")
# A tower's blocks (Bridge's Qwen3-VL `vision_model.decoder.layers.*`, as optimizer state too) keep their names whatever
# the language model's MLP is: only the language model's layers are spelled by spec
_TOWER_LAYER = re.compile(r"(?:^|\.)vision_model\.decoder\.layers\.")


def _spelling(family: str, te: bool, moe: bool, mla: bool) -> dict[str, str]:
    if mla:
        return {} if te else {**_MLA_LOCAL, **({} if moe else _MLA_LOCAL_DENSE)}
    return _SPELLINGS.get((family, te, moe), {})


def spell(name: str, family: str, te: bool, moe: bool, mla: bool = False) -> str:
    """Canonical name -> the name a `family` ("dist"/"legacy") checkpoint of that spec uses."""
    match = _LAYER_NAME.match(name)
    if not match or _TOWER_LAYER.search(name):
        return name
    tail = match.group("tail")
    tail = _spelling(family, te, moe, mla).get(tail, tail)
    return f"{match.group('head')}{match.group('index') or ''}{tail}"


def canonical(name: str, family: str, moe: bool, mla: bool = False) -> str:
    """A name as stored (either spec) -> canonical. The two specs never spell different things alike."""
    match = _LAYER_NAME.match(name)
    if not match or _TOWER_LAYER.search(name):
        return name
    tail = match.group("tail")
    for te in (False, True):
        inverse = {spelled: canon for canon, spelled in _spelling(family, te, moe, mla).items()}
        if tail in inverse:
            tail = inverse[tail]
            break
    return f"{match.group('head')}{match.group('index') or ''}{tail}"


def layer_is_moe(config: ModelConfig, name: str) -> bool:
    """Whether `name` (a tensor or object key) belongs to an MoE layer: the model's kind, or its layer's where
    MoE and dense layers mix (the spellings of the pre-MLP norm differ between the two). A hybrid model's MoE layer
    keeps `pre_mlp_layernorm` in either spec (megatron-core's hybrid stack maps no names): spelled as a dense layer."""
    if config.hybrid_override_pattern is not None:
        return False
    match = _INDEXED.match(name)
    if _MTP.match(name):  # an MTP layer's transformer layer is of the decoder's last layer's kind
        return config.moe_layers[-1]
    return config.moe_layers[int(match.group(1))] if match and config.per_layer_names else config.is_moe


def uses_te_names(args: dict) -> bool:
    """Megatron-LM's default implementation is Transformer Engine; `local` is the alternative."""
    return args.get("transformer_impl", "transformer_engine") != "local"


@dataclass(frozen=True)
class ObjectKey:
    """A layout-free key of per-module state: module path (stacked form) plus global offsets."""

    module: str  # e.g. "decoder.layers.self_attention.linear_proj._extra_state"
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.module}/shard_{'.'.join(map(str, self.offsets))}_{'.'.join(map(str, self.shape))}"

    @classmethod
    def parse(cls, key: str) -> ObjectKey | None:
        match = re.match(r"^(?P<module>.+)/shard_(?P<offsets>[\d.]+)_(?P<shape>[\d.]+)$", key)
        if not match:
            return None
        return cls(match["module"], tuple(map(int, match["offsets"].split("."))), tuple(map(int, match["shape"].split("."))))

    @property
    def indexed(self) -> bool:
        """Keyed per layer (`decoder.layers.{i}.`, offsets without a layer axis), as in a model of mixed layers."""
        return bool(_INDEXED.match(self.module))

    @property
    def layer(self) -> int | None:
        if self.indexed:
            return int(_INDEXED.match(self.module).group(1))
        return self.offsets[0] if _LAYER_NAME.match(self.module) and not _MTP.match(self.module) else None

    @property
    def expert(self) -> int | None:
        if self.indexed:
            return self.offsets[0] if _EXPERT_MODULE.search(self.module) else None
        return self.offsets[1] if self.layer is not None and len(self.offsets) >= 2 else None

    @property
    def num_experts(self) -> int | None:
        return None if self.expert is None else self.shape[0 if self.indexed else 1]


def is_layout_bound(key: str) -> bool:
    """Objects that belong to one rank of one layout (RNG states) cannot follow a reshard."""
    return key.startswith("rng_state")


def mixer_linears(config: ModelConfig, kind: LayerKind) -> list[str]:
    """The linear modules of a layer's token mixer (self-attention, Gated DeltaNet, a hybrid model's Mamba mixer; none)."""
    if kind.mixer is None:
        return []
    if kind.mixer == "mamba":
        return ["mixer.in_proj", "mixer.out_proj"]
    if kind.mixer == "gated_delta_net":
        names = ["in_proj", "out_proj"]
    elif not config.multi_latent_attention:
        names = ["linear_qkv", "linear_proj"]
    else:
        queries = ["linear_q_down_proj", "linear_q_up_proj"] if config.q_lora_rank else ["linear_q_proj"]
        names = [*queries, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    return [f"self_attention.{name}" for name in names]


def default_extra_state(config: ModelConfig, te: bool) -> dict[str, None]:
    """The `_extra_state` entries Megatron-Core expects, for sources that have none (HF, synthetic).

    Linear layers carry an (empty) extra state in both specs; Transformer Engine's attention too.
    Megatron's loader refuses a checkpoint that lacks them, and `None` is what an unused one holds.
    """
    prefix = config.language_model_prefix
    # GPTModel drops its output layer's (old GPT checkpoints lack it); megatron-core's MambaModel keeps it
    head = {str(ObjectKey("output_layer._extra_state", (0,), (1,))): None} if config.hybrid_override_pattern else {}
    out = {prefix + key: None for key in {**_decoder_extra_state(config, te), **_mtp_extra_state(config, te), **head}}
    for tower in config.towers:  # a tower's in Megatron form (Qwen3-VL's), stacked as its blocks are; HF modules keep none
        for module in tower.extra_state:
            n = tower.blocks(module)
            out.update({str(ObjectKey(f"{module}._extra_state", (i,), (n or 1,))): None for i in range(n or 1)})
    return out


def _decoder_extra_state(config: ModelConfig, te: bool) -> dict[str, None]:
    if config.per_layer_names:
        return _per_layer_extra_state(config, te)
    return _stacked_extra_state(config, te, config.layer_kinds[0])


def _stacked_extra_state(config: ModelConfig, te: bool, kind: LayerKind) -> dict[str, None]:
    """The extra states of `config.num_layers` layers of `kind`, on a leading layer axis."""
    L = config.num_layers
    modules = mixer_linears(config, kind)
    if te and kind.mixer == "attention":
        modules.append("self_attention.core_attention")
    keys: list[ObjectKey] = []
    if kind.moe:
        assert config.num_experts is not None
        E = config.num_experts
        for name in ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"):
            keys += [ObjectKey(f"decoder.layers.{name}._extra_state", (i, e), (L, E)) for i in range(L) for e in range(E)]
        if config.moe_shared_expert_intermediate_size:
            modules += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
        if config.moe_latent_size:  # Transformer Engine's linears in either spec (megatron-core has no other)
            modules += ["mlp.fc1_latent_proj", "mlp.fc2_latent_proj"]
    elif kind.mlp:
        modules += ["mlp.linear_fc1", "mlp.linear_fc2"]
    keys += [ObjectKey(f"decoder.layers.{m}._extra_state", (i,), (L,)) for m in modules for i in range(L)]
    return {str(k): None for k in keys}


def _layer_extra_state(config: ModelConfig, te: bool, kind: LayerKind, module: str) -> dict[str, None]:
    """The extra states of one layer of `kind` under `module` (e.g. `decoder.layers.3.`), offsets without a layer
    axis (Megatron-Core saves a dense layer's linear as `decoder.layers.{i}.mlp.linear_fc1._extra_state/shard_0_1`
    and an expert's as `decoder.layers.{i}.mlp.experts.experts.linear_fc1._extra_state/shard_{e}_{E}`)."""
    out: dict[str, None] = {}
    one = config.replace(num_layers=1, hybrid_override_pattern=None)  # `kind` says what the layer is
    for text in _stacked_extra_state(one, te, kind):
        key = ObjectKey.parse(text)
        assert key is not None
        experts = key.offsets[1:], key.shape[1:]
        offsets, shape = experts if key.expert is not None else ((0,), (1,))
        out[str(ObjectKey(key.module.replace("decoder.layers.", module, 1), offsets, shape))] = None
    return out


def _per_layer_extra_state(config: ModelConfig, te: bool) -> dict[str, None]:
    """`default_extra_state` of a model keyed per layer: each layer's own modules."""
    out: dict[str, None] = {}
    for layer, kind in enumerate(config.layer_kinds):
        out.update(_layer_extra_state(config, te, kind, f"decoder.layers.{layer}."))
    return out


def _mtp_extra_state(config: ModelConfig, te: bool) -> dict[str, None]:
    """Each multi-token-prediction layer's: its projection's and its transformer layer's (the decoder's last kind)."""
    out: dict[str, None] = {}
    for i in range(config.mtp_num_layers or 0):
        out[str(ObjectKey(f"mtp.layers.{i}.eh_proj._extra_state", (0,), (1,)))] = None
        out.update(_layer_extra_state(config, te, config.layer_kinds[-1], f"mtp.layers.{i}.transformer_layer."))
    return out


# megatron-core's parameters that torch_dist keys in parts (`_split_tensor_factory` in ssm/gated_delta_net.py and
# ssm/mamba_mixer.py, 0.16.1): a rank's state_dict() holds one tensor, its share of each part one after the other, in
# this order; reshard's logical tensors are the parts (`architecture._gated_delta_net`, `_mamba`), the DistributedOptimizer's
# order lists them so (`optim.order`).
FUSED_PARTS = {
    "self_attention.in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
    "self_attention.conv1d.weight": ("query", "key", "value"),
    "self_attention.conv1d.bias": ("query", "key", "value"),
    "mixer.in_proj.weight": ("z", "x", "B", "C", "dt"),
    "mixer.conv1d.weight": ("x", "B", "C"),
    "mixer.conv1d.bias": ("x", "B", "C"),
}


def fused_parts(name: str) -> tuple[str, ...]:
    """The parts of megatron-core's fused per-rank parameter `name` (none for other tensors)."""
    return next((parts for tail, parts in FUSED_PARTS.items() if name.endswith("." + tail)), ())
