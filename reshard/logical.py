"""Logical tensors: every tensor of a model known by its canonical Megatron-Core name and global shape.

The canonical name is the key Megatron-Core's torch_dist format uses (Transformer-Engine style norm
names, homogeneous layers stacked on a leading layer axis, experts on a global-expert axis), so a
torch_dist checkpoint *is* the logical view and every other format maps onto it.

How a tensor is split across ranks is a property of its name, given by the table `PARTITION_RULES`.
A name no rule knows is refused: guessing "replicated" is how converters silently corrupt weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum

from reshard.config import PRECISIONS, ModelConfig
from reshard.errors import ReshardError


class Split(Enum):
    NONE = "replicated"
    COLUMN = "column"  # split on the parameter's first dimension (output features)
    ROW = "row"  # split on the parameter's second dimension (input features)



def normalize_dtype(value: str) -> str:
    """A model precision by its torch name ("bf16", "torch.bfloat16" -> "bfloat16")."""
    key = str(value).lower().removeprefix("torch.")
    if key not in PRECISIONS:
        raise ReshardError(f"dtype {value!r} is not one of {', '.join(sorted(PRECISIONS))}")
    return PRECISIONS[key]


@dataclass(frozen=True)
class Rule:
    split: Split
    gated: bool = False  # SwiGLU fc1: [gate; up] halves are split separately when the model is gated
    vocab: bool = False  # rows are the (padded) vocabulary
    # the rule holds only for models this says yes to (a name whose split depends on the architecture); a tensor
    # read without one never matches it
    when: Callable[[ModelConfig], bool] | None = None


def _full_width_qk_norm(config: ModelConfig) -> bool:
    return config.qk_layernorm_full_width


# Suffix of the parameter name (after any layer/expert prefix) -> how it is partitioned.
# Checked in order; the first match wins.
PARTITION_RULES: tuple[tuple[str, Rule], ...] = (
    (r"embedding\.word_embeddings\.weight$", Rule(Split.COLUMN, vocab=True)),
    (r"^output_layer\.weight$", Rule(Split.COLUMN, vocab=True)),
    (r"embedding\.position_embeddings\.weight$", Rule(Split.NONE)),
    # Megatron-Bridge's LoRA adapters (a PEFT save, `reshard.lora`): linear_in is a column-parallel layer over the rank
    # under a column-parallel base and a row-parallel one over the base's input under a row-parallel base; linear_out
    # is column-parallel over the base's outputs, split per gate/up half under a gated fc1 as the base is
    (r"(linear_qkv|linear_fc1)\.adapter\.linear_in\.weight$", Rule(Split.COLUMN)),
    (r"(linear_proj|linear_fc2)\.adapter\.linear_in\.weight$", Rule(Split.ROW)),
    (r"linear_fc1\.adapter\.linear_out\.weight$", Rule(Split.COLUMN, gated=True)),
    (r"(linear_qkv|linear_proj|linear_fc2)\.adapter\.linear_out\.weight$", Rule(Split.COLUMN)),
    # ms-swift's (mcore-bridge's LoraParallelLinear, `reshard.lora.SWIFT`): lora_A is whole on every rank under a column-parallel
    # base and split by the input under a row-parallel one; lora_B split by the outputs, or whole; fc1's lora_B is plain
    # row chunks (each rank's own [gate; up]), not split per half
    (r"(linear_qkv|linear_fc1)\.lora_A\.default\.weight$", Rule(Split.NONE)),
    (r"(linear_proj|linear_fc2)\.lora_A\.default\.weight$", Rule(Split.ROW)),
    (r"(linear_qkv|linear_fc1)\.lora_B\.default\.weight$", Rule(Split.COLUMN)),
    (r"(linear_proj|linear_fc2)\.lora_B\.default\.weight$", Rule(Split.NONE)),
    (r"linear_qkv\.(weight|bias)$", Rule(Split.COLUMN)),
    # Multi-latent attention: the up projections split by heads. The down projections are column-parallel in
    # the local spec (their outputs gathered before the latent norms); Transformer Engine's spec keeps them
    # whole on every rank, which only per-rank (legacy) files show (`megatron_legacy` refuses that case).
    (r"(linear_q_proj|linear_q_up_proj|linear_kv_up_proj|linear_q_down_proj|linear_kv_down_proj)\.weight$", Rule(Split.COLUMN)),
    (r"linear_fc1\.(weight|bias)$", Rule(Split.COLUMN, gated=True)),
    # Multi-token prediction's projection of [embedding; hidden] is column-parallel (its output gathered)
    (r"^mtp\.layers\.\d+\.eh_proj\.weight$", Rule(Split.COLUMN)),
    (r"(linear_proj|linear_fc2)\.weight$", Rule(Split.ROW)),
    (r"(linear_proj|linear_fc2)\.bias$", Rule(Split.NONE)),  # row-parallel biases are added after the reduce
    # MiniMax-M2's q/k norms cover every head of the projection, so they split by head as linear_qkv's rows do;
    # per-head norms (Qwen3, GLM: [head_dim]) of the same name are whole on every rank (the rule below)
    (r"self_attention\.(q|k)_layernorm\.(weight|bias)$", Rule(Split.COLUMN, when=_full_width_qk_norm)),
    (r"layer_norm_(weight|bias)$", Rule(Split.NONE)),
    # Mamba-2: the gated output norm is grouped by B/C group and split with the heads (before the plain norms' rule)
    (r"mixer\.norm\.weight$", Rule(Split.COLUMN)),
    (r"(layernorm|norm)\.(weight|bias)$", Rule(Split.NONE)),
    (r"router\.(weight|bias|expert_bias)$", Rule(Split.NONE)),
    # gpt-oss's attention sinks: one logit per head, split with the heads
    (r"self_attention\.core_attention\.softmax_offset$", Rule(Split.COLUMN)),
    (r"shared_experts\.gate_weight$", Rule(Split.NONE)),
    # latent MoE's projections around the experts: Transformer Engine linears in "duplicated" mode, whole on every rank
    (r"mlp\.fc(1|2)_latent_proj\.(weight|bias)$", Rule(Split.NONE)),
    # Gated DeltaNet: torch_dist keys each part of the fused input projection and of the depthwise convolution
    # (one channel per row) apart, each split by heads over TP; so are the per-value-head decay and time-step bias.
    (r"self_attention\.in_proj\.weight\.(query|key|value|z|beta|alpha)$", Rule(Split.COLUMN)),
    (r"self_attention\.conv1d\.(weight|bias)\.(query|key|value)$", Rule(Split.COLUMN)),
    (r"self_attention\.(A_log|dt_bias)$", Rule(Split.COLUMN)),
    (r"self_attention\.out_proj\.weight$", Rule(Split.ROW)),
    # Mamba-2 (a hybrid model's mixer): torch_dist keys in_proj's z, x, B, C, dt and the convolution's x, B, C channels
    # apart, each split by heads (B, C by group) over TP; so are the per-head decay, skip and time-step bias
    (r"mixer\.in_proj\.weight\.(z|x|B|C|dt)$", Rule(Split.COLUMN)),
    (r"mixer\.conv1d\.(weight|bias)\.(x|B|C)$", Rule(Split.COLUMN)),
    (r"mixer\.(A_log|D|dt_bias)$", Rule(Split.COLUMN)),
    (r"mixer\.out_proj\.weight$", Rule(Split.ROW)),
)

OPTIMIZER_PREFIX = re.compile(r"^optimizer\.state\.(?P<state>[A-Za-z0-9_]+)\.(?P<param>.+)$")
_LAYER = re.compile(r"^(?P<head>(?:.*\.)?decoder\.layers\.)(?P<index>\d+\.)?(?P<tail>.+)$")
_EXPERT = re.compile(r"(?<!shared_)experts\.")


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor: where it lives in the model and how any layout cuts it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix
    split: Split
    gated: bool = False
    vocab: bool = False
    stacked: bool = False  # leading axis is the global layer index
    layer: int | None = None  # fixed global layer for `decoder.layers.{i}.` names
    experts: bool = False  # the axis after the layer axis is the global expert index
    param: str = ""  # the model parameter this tensor belongs to (differs for optimizer state)

    @property
    def prefix_axes(self) -> int:
        """Axes before the parameter's own dimensions (layer, expert)."""
        return int(self.stacked) + int(self.experts)

    @property
    def tp_axis(self) -> int | None:
        if self.split is Split.NONE:
            return None
        axis = self.prefix_axes + (0 if self.split is Split.COLUMN else 1)
        return axis if axis < len(self.shape) else None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_optimizer(self) -> bool:
        return self.name != self.param

    def with_shape(self, shape: tuple[int, ...]) -> TensorSpec:
        return replace(self, shape=tuple(shape))


def param_name(name: str) -> str:
    """The model parameter behind a logical name (strips `optimizer.state.<kind>.`)."""
    match = OPTIMIZER_PREFIX.match(name)
    return match.group("param") if match else name


def describe(name: str, shape: tuple[int, ...], dtype: str, config: ModelConfig | None) -> TensorSpec:
    """Build the spec of a logical tensor from its name, refusing names the partition table lacks. `config`
    is None for a checkpoint read without its architecture (global tensors, never split)."""
    param = param_name(name)
    stacked, layer = False, None
    layer_match = _LAYER.match(param)
    if layer_match:
        if layer_match.group("index"):
            layer = int(layer_match.group("index")[:-1])
        else:
            stacked = True
    experts = bool(_EXPERT.search(param)) and ".router." not in param
    tower = config.tower_of(param) if config is not None else None
    if tower is not None and param in dict(tower.tensors):  # a tower says how its tensors split (`config.Tower`)
        return TensorSpec(name=name, shape=tuple(int(d) for d in shape), dtype=dtype, split=Split(dict(tower.splits).get(param, "replicated")),
                          stacked=tower.is_stacked(param), param=param)
    bare = config.language_name(param) if config is not None else param
    for pattern, rule in () if tower else PARTITION_RULES:  # noqa: B007 (the rule that matched is used below)
        if re.search(pattern, bare) and (rule.when is None or (config is not None and rule.when(config))):
            break
    else:
        if re.search(r"\.adapter\.|\.lora_(embedding_)?[AB]\.", bare):  # the rules above name every LoRA target reshard merges (`reshard.lora`)
            raise ReshardError(f"LoRA adapter tensor {name!r} adapts a module reshard does not merge (it merges linear_qkv, linear_proj, "
                               "linear_fc1, linear_fc2; one adapter), or is a second adapter; merge it with the framework that saved it")
        raise ReshardError(
            f"tensor {name!r} is not in reshard's partition table, so it cannot be resharded safely; "
            "please report it (or convert with --no-optimizer if it is optimizer state)"
        )
    gated = rule.gated and config is not None and config.swiglu  # unknown without an architecture: never split then
    if rule.split is Split.COLUMN and len(shape) - int(stacked) - int(experts) < 1:
        raise ReshardError(f"tensor {name!r} has shape {tuple(shape)}, too few dimensions for its partition")
    return TensorSpec(
        name=name,
        shape=tuple(int(d) for d in shape),
        dtype=dtype,
        split=rule.split,
        gated=gated,
        vocab=rule.vocab,
        stacked=stacked,
        layer=layer,
        experts=experts,
        param=param,
    )
