"""The architecture of a model, independent of how its checkpoint is laid out.

Field names follow Megatron-LM's argument names so that a checkpoint's `args` Namespace maps
onto a `ModelConfig` one to one; HF configs are mapped by the converters in `converters/`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from reshard.errors import ReshardError


def pad_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by * tp`."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


# Megatron-LM options that change a model's math, with their defaults: a model that sets one otherwise
# reshards like any other, but no HF family here computes the same logits.
_UNMODELED: dict[str, Any] = {
    "rotary_interleaved": False,
    "rotary_seq_len_interpolation_factor": None,
}


# The precisions a model can be in, by their torch names and short aliases (the CLI's --dtype choices,
# HF config dtypes).
PRECISIONS = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# Values no tensor's shape pins down that the model's math divides by, raises to powers or scales with: out of
# range, the model computes inf, NaN, or flipped signs (a negative epsilon, rotary_base 0, a negative routing scale).
_POSITIVE = ("norm_epsilon", "rotary_base", "rope_scaling_factor", "rotary_scaling_factor", "moe_router_topk_scaling_factor",
             "activation_func_clamp_value")
# Counts no tensor's shape pins down either (positions, the vocabulary's padding unit, experts and groups chosen),
# and the sizes shapes are computed from, which must be counts before they can be compared with any shape.
_COUNTS = ("max_position_embeddings", "original_max_position_embeddings", "make_vocab_size_divisible_by", "moe_router_topk",
           "moe_router_num_groups", "moe_router_group_topk",
           "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "padded_vocab_size", "num_query_groups",
           "kv_channels", "vocab_size", "num_experts", "moe_ffn_hidden_size", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
           "qk_pos_emb_head_dim", "v_head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
           "linear_num_key_heads", "linear_num_value_heads", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
           "moe_latent_size")


# The sizes of megatron-core's Gated DeltaNet (TransformerConfig's names and defaults, which are transformers' Qwen3-Next's).
LINEAR_ATTENTION_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                           "linear_num_value_heads")

# Fields Megatron's args and JSON give as lists, kept as tuples so the config stays hashable.
_PATTERNS = ("moe_layer_freq", "window_size", "window_attn_skip_freq", "linear_attention_freq", "mrope_section")


def _plain_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The MLATransformerConfig fields a multi-latent-attention model is built with (besides rope_type).
MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


# A hybrid (Mamba) model's layers by megatron-core's pattern symbols (hybrid_override_pattern): a Mamba-2 mixer,
# self-attention, a dense MLP or a mixture of experts, each a layer of its own.
HYBRID_SYMBOLS = {"M": ("mamba", False, False), "*": ("attention", False, False), "-": (None, False, True), "E": (None, True, True)}


@dataclass(frozen=True)
class LayerKind:
    """What one decoder layer is: its token mixer ("attention": softmax self-attention, "gated_delta_net": linear
    attention, "mamba": a Mamba-2 mixer; None: none) and its MLP (mixture of experts or dense; `mlp` False: none, as
    a hybrid model's mixer layers have). Layers of one kind have the same tensors."""

    mixer: str | None = "attention"
    moe: bool = False
    mlp: bool = True


def _no_model(name: str, value: Any, want: str) -> ReshardError:
    return ReshardError(f"the model's {name} is {value!r}, not {want}: no model computes with it; fix it where the "
                        "checkpoint records it (its args, run_config.yaml or config)")


@dataclass(frozen=True)
class Tower:
    """A model beside the language model (a vision encoder and its merger), carried as its own tensors under its
    own names, on the first pipeline stage where the language model's embedding is. A tensor is whole on every
    tensor-parallel rank (as Megatron-Bridge keeps Qwen2.5-VL's HF vision modules) unless `splits` names it: a
    tower in Megatron form (Bridge's Qwen3-VL vision model) splits its linear layers over TP as megatron-core does.
    Tensors under a prefix in `stacked` carry a leading axis of blocks (megatron-core stacks a homogeneous block's
    layers so), one HF tensor each. A family declares its towers (`converters.qwen2_5_vl`, `converters.qwen3_vl`);
    they travel with the model's args, so a Megatron checkpoint describes them without its HF config."""

    prefix: str  # e.g. "visual."
    # full name -> global shape, in the order the tower registers them (the DistributedOptimizer's buffers are laid out by it)
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    hf_config: str = "{}"  # the tower's own HF config (JSON), which an HF export writes back
    splits: tuple[tuple[str, str], ...] = ()  # full name -> "column" | "row" (`logical.Split`); others whole
    stacked: tuple[str, ...] = ()  # name prefixes whose tensors lead with an axis of blocks
    tp_units: tuple[tuple[str, int], ...] = ()  # (what, count): the counts TP must divide where `splits` cut (heads, widths)
    extra_state: tuple[str, ...] = ()  # modules that keep an (empty) `_extra_state` megatron-core's loader asks for
    # (part, name prefixes): the tensors a Megatron-Bridge `freeze_<part>` flag freezes (no gradient, so no optimizer state)
    parts: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self):  # JSON and Megatron's args give lists
        object.__setattr__(self, "tensors", tuple((str(name), tuple(int(d) for d in shape)) for name, shape in self.tensors))
        object.__setattr__(self, "splits", tuple((str(name), str(split)) for name, split in self.splits))
        object.__setattr__(self, "stacked", tuple(self.stacked))
        object.__setattr__(self, "tp_units", tuple((str(what), int(count)) for what, count in self.tp_units))
        object.__setattr__(self, "extra_state", tuple(self.extra_state))
        object.__setattr__(self, "parts", tuple((str(part), tuple(prefixes)) for part, prefixes in self.parts))
        names = dict(self.tensors)
        if any(not name.startswith(self.prefix) for name in names):
            raise ReshardError(f"tower {self.prefix!r}: a tensor of it is named outside its prefix")
        if any(name not in names or split not in ("column", "row") for name, split in self.splits):
            raise ReshardError(f"tower {self.prefix!r}: a split names no tensor of it, or is neither 'column' nor 'row'")

    def is_stacked(self, name: str) -> bool:
        return name.startswith(self.stacked)

    def blocks(self, name: str) -> int | None:
        """How many blocks a stacked tensor or module `name` is one of (None: not stacked)."""
        stack = next((prefix for prefix in self.stacked if name.startswith(prefix)), None)
        return None if stack is None else next(shape[0] for tensor, shape in self.tensors if tensor.startswith(stack))


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    padded_vocab_size: int
    num_query_groups: int | None = None  # None: plain multi-head attention
    kv_channels: int | None = None  # head dim; None: hidden_size // num_attention_heads
    vocab_size: int | None = None  # true vocabulary; None when the checkpoint does not say
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 4096
    position_embedding_type: str = "rope"  # "rope" | "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: bool = False
    # Multimodal rotary embeddings (position_embedding_type "mrope", Qwen2.5-VL): the rotary frequencies cut into
    # temporal, height and width sections of these many (each section rotated by its own position id).
    mrope_section: tuple[int, ...] | None = None
    rope_scaling_factor: float = 8.0
    normalization: str = "RMSNorm"  # "RMSNorm" | "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    openai_gelu: bool = False  # non-gated MLPs: tanh-approximated GELU (HF gelu_new) instead of exact GELU
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    # every norm's weight stored as its scale less one (Qwen3-Next's; Megatron-LM's --apply-layernorm-1p)
    layernorm_zero_centered_gamma: bool = False
    # each attention head's output scaled by the sigmoid of a gate, its rows in linear_qkv after its group's queries
    attention_output_gate: bool = False
    # q/k norms over the whole projection ([heads * head_dim], [groups * head_dim]; MiniMax-M2) instead of per head
    # ([head_dim]): the weights split over TP by head. No Megatron-LM option; reshard's args carry it.
    qk_layernorm_full_width: bool = False
    untie_embeddings_and_output_weights: bool = True
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False  # the shared experts' output scaled by sigmoid(gate_weight . x)
    # the routed experts compute in a latent of this width: the MoE layer projects its input down to it before dispatch
    # and the experts' combined output back up (mlp.fc1_latent_proj / fc2_latent_proj; Nemotron 3's latent MoE)
    moe_latent_size: int | None = None
    moe_router_pre_softmax: bool = False  # softmax over all experts, then top-k (no renormalising)
    moe_layer_freq: int | tuple[int, ...] = 1  # an MoE layer every N layers, or a 0/1 (dense/MoE) per layer
    # Routing (DeepSeek-V3's): sigmoid scores, a per-expert bias added for the choice only, group-limited top-k,
    # the chosen weights renormalised (sigmoid with top-k > 1) and scaled.
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    # Multi-latent attention (DeepSeek-V2/V3), under Megatron-LM's argument names and defaults.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries projected straight from the hidden state (linear_q_proj)
    kv_lora_rank: int = 32
    qk_head_dim: int = 128  # the per-head query/key dims without position embedding
    qk_pos_emb_head_dim: int = 64  # the decoupled rotary dims, shared by all heads on the key side
    v_head_dim: int = 128
    rope_type: str | None = None  # "rope" | "yarn"; None: yarn with MLA, rope otherwise (Megatron-LM)
    rotary_scaling_factor: float = 1.0  # YaRN's factor
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # GPT (non-MLA) YaRN (position_embedding_type "yarn") reads the YaRN fields above; it may leave YaRN's correction
    # range unrounded (HF's truncate false: gpt-oss). No Megatron-LM option; reshard's args carry it.
    yarn_correction_range_round_to_int: bool = True
    # gpt-oss: a learnable per-head logit in every softmax's denominator (attention sinks: core_attention.softmax_offset),
    # sliding-window attention (window_size (W-1, 0)) on the layers window_attn_skip_freq says (an int N: all but
    # every Nth; a 0/1 per layer: 1 windowed), and the clamped SwiGLU (quick_geglu: x * sigmoid(1.702 x) gating
    # up + glu_linear_offset, both clamped at activation_func_clamp_value). Megatron-LM's names and defaults.
    softmax_type: str = "vanilla"
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    quick_geglu: bool = False
    activation_func_clamp_value: float | None = None
    glu_linear_offset: float = 0.0
    # Linear attention (Qwen3-Next's Gated DeltaNet) on the layers linear_attention_freq says (an int N: all but every
    # Nth; a 0/1 per layer: 1 linear), softmax attention on the others. Megatron-LM's names and defaults.
    experimental_attention_variant: str | None = None  # "gated_delta_net"
    linear_attention_freq: int | tuple[int, ...] | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # A hybrid (Mamba) model (megatron-core's MambaModel: Nemotron-H): one layer per symbol of the pattern
    # (`HYBRID_SYMBOLS`; Megatron-LM >= 0.18 names the option hybrid_layer_pattern), its Mamba-2 mixers of
    # mamba_num_heads heads of mamba_head_dim, mamba_num_groups groups of B/C of mamba_state_dim. Megatron's names and defaults.
    hybrid_override_pattern: str | None = None
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int | None = None  # None: hidden_size * 2 // mamba_head_dim (megatron-core's expand 2)
    # Non-gated MLPs with squared ReLU (Megatron-LM's --squared-relu: Nemotron-H's relu2)
    squared_relu: bool = False
    # Multi-token prediction (DeepSeek-V3): this many MTP layers (`mtp.layers.{i}.`) after the decoder, on its last stage.
    mtp_num_layers: int | None = None
    params_dtype: str = "float32"
    # A model of several towers (a vision-language model): the language model's tensors under this prefix
    # (Megatron-Bridge's "language_model."), the other towers' under their own (`Tower`).
    language_model_prefix: str = ""
    towers: tuple[Tower, ...] = ()
    # Megatron options set away from their defaults that change the model's math in ways this tool does
    # not model (`_UNMODELED`): resharding carries them in the args; an HF export refuses them.
    unmodeled: tuple[str, ...] = ()

    def __post_init__(self):
        for name in _PATTERNS:
            if isinstance(getattr(self, name), list):  # Megatron's args and JSON give a list; the config stays hashable
                object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "towers", tuple(t if isinstance(t, Tower) else Tower(**t) for t in self.towers))
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and not (_plain_number(value) and 0 < value < math.inf):
                raise _no_model(name, value, "a positive number")
        for name in _COUNTS:
            value = getattr(self, name)
            if value is not None and not (type(value) is int and value > 0):
                raise _no_model(name, value, "a whole number of at least 1")
        if not (_plain_number(self.rotary_percent) and 0 < self.rotary_percent <= 1):
            raise _no_model("rotary_percent", self.rotary_percent, "a fraction in (0, 1]")
        self._check_hybrid()
        if self.params_dtype not in PRECISIONS.values():  # it becomes a torch dtype in the args Megatron unpickles
            raise _no_model("params_dtype", self.params_dtype, f"one of {', '.join(sorted(set(PRECISIONS.values())))}")

    def _check_hybrid(self) -> None:
        pattern = self.hybrid_override_pattern
        if pattern is None:
            return
        if not isinstance(pattern, str) or len(pattern) != self.num_layers or set(pattern) - set(HYBRID_SYMBOLS):
            raise _no_model("hybrid_override_pattern", pattern, f"one of {''.join(HYBRID_SYMBOLS)} for each of the {self.num_layers} layers")
        if "E" in pattern and not self.is_moe:
            raise _no_model("num_experts", self.num_experts, f"a number of experts for the MoE layers (E) of {pattern!r}")
        if "M" in pattern and self.mamba_heads % self.mamba_num_groups:
            raise _no_model("mamba_num_heads", self.mamba_heads, f"a multiple of mamba_num_groups={self.mamba_num_groups}")

    def language_name(self, name: str) -> str:
        """A language-model tensor's name without the model's language_model_prefix (as a plain GPT model names it)."""
        return name.removeprefix(self.language_model_prefix)

    def tower_of(self, name: str) -> Tower | None:
        """The tower (other than the language model) whose tensor `name` is."""
        return next((t for t in self.towers if name.startswith(t.prefix)), None)

    def tower_blocks(self, name: str) -> range | list[None]:
        """The blocks of tower tensor `name` stacked on its leading axis (`Tower.stacked`); [None] for any other."""
        tower = self.tower_of(name)
        blocks = tower.blocks(name) if tower is not None else None
        return [None] if blocks is None else range(blocks)

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def mla_rope_type(self) -> str:
        return self.rope_type or ("yarn" if self.multi_latent_attention else "rope")

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def moe_layers(self) -> list[bool]:
        """Which layers are mixture-of-experts layers (Megatron's reading of moe_layer_freq)."""
        if not self.is_moe:
            return [False] * self.num_layers
        if self.hybrid_override_pattern is not None:  # a hybrid model's MoE layers are its pattern's, moe_layer_freq unread
            return [kind.moe for kind in self.layer_kinds]
        if isinstance(self.moe_layer_freq, int):
            return [i % self.moe_layer_freq == 0 for i in range(self.num_layers)]
        if len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1}:
            raise ReshardError(f"moe_layer_freq={list(self.moe_layer_freq)} is not a 0 or 1 for each of the {self.num_layers} layers")
        return [bool(flag) for flag in self.moe_layer_freq]

    @property
    def linear_attention_layers(self) -> list[bool]:
        """Which layers are linear-attention layers (Megatron-Core's reading of linear_attention_freq)."""
        if self.experimental_attention_variant is None:
            return [False] * self.num_layers
        if self.experimental_attention_variant != "gated_delta_net":
            raise _no_model("experimental_attention_variant", self.experimental_attention_variant, '"gated_delta_net"')
        freq = self.linear_attention_freq
        if type(freq) is int and freq > 0:
            return [(i + 1) % freq != 0 for i in range(self.num_layers)]
        if not isinstance(freq, tuple) or len(freq) != self.num_layers or set(freq) - {0, 1}:
            raise ReshardError(f"linear_attention_freq={freq!r} is neither a whole number from 1 nor a 0 or 1 for each of the "
                               f"{self.num_layers} layers")
        return [bool(flag) for flag in freq]

    @property
    def layer_kinds(self) -> list[LayerKind]:
        """Each decoder layer's kind, in order."""
        if self.hybrid_override_pattern is not None:
            return [LayerKind(*HYBRID_SYMBOLS[symbol]) for symbol in self.hybrid_override_pattern]
        return [LayerKind("gated_delta_net" if linear else "attention", moe)
                for linear, moe in zip(self.linear_attention_layers, self.moe_layers)]

    @property
    def mamba_heads(self) -> int:
        return self.mamba_num_heads or self.hidden_size * 2 // self.mamba_head_dim

    @property
    def per_layer_names(self) -> bool:
        """Megatron-Core keys every layer apart (`decoder.layers.{i}.`, no layer axis) in torch_dist when layers of
        different kinds may mix: for any list moe_layer_freq or linear_attention_freq and any frequency above 1."""
        mixed_mlp = self.is_moe and (isinstance(self.moe_layer_freq, tuple) or self.moe_layer_freq > 1)
        freq = self.linear_attention_freq
        mixed_mixer = self.experimental_attention_variant is not None and (isinstance(freq, tuple) or (freq or 1) > 1)
        return mixed_mlp or mixed_mixer or self.hybrid_override_pattern is not None  # MambaStack keys every layer apart

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding that carry information (the rest is padding)."""
        return self.vocab_size or self.padded_vocab_size

    def padded_vocab_for(self, tp: int) -> int:
        """The padded vocabulary a model at tensor-parallel degree `tp` would have."""
        if self.vocab_size is None:
            return self.padded_vocab_size
        return pad_vocab(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["unmodeled"] = tuple(values.get("unmodeled", ()))  # a JSON list
        return cls(**values)

    @classmethod
    def from_megatron_args(cls, args: argparse.Namespace | dict[str, Any]) -> ModelConfig:
        """Read the architecture out of the `args` a Megatron checkpoint was saved with."""
        a = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
        missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if a.get(k) is None]
        if missing:
            raise ReshardError(f"checkpoint args lack {', '.join(missing)}: not a Megatron GPT checkpoint?")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if a.get(f.name) is not None:
                values[f.name] = a[f.name]
        # Megatron keeps grouped-query attention behind a flag.
        if not a.get("group_query_attention", values.get("num_query_groups") is not None):
            values.pop("num_query_groups", None)
        values.setdefault("ffn_hidden_size", 4 * a["hidden_size"])
        if "rope_scaling" not in values and a.get("use_rope_scaling") is not None:  # Megatron-LM's name for it
            values["rope_scaling"] = bool(a["use_rope_scaling"])
        if a.get("apply_layernorm_1p"):  # the option's name; Megatron-LM 0.17's validate_args saves it renamed
            values["layernorm_zero_centered_gamma"] = True
        if a.get("hybrid_layer_pattern") is not None:  # Megatron-LM >= 0.18's name for hybrid_override_pattern
            values["hybrid_override_pattern"] = a["hybrid_layer_pattern"]
        if "hybrid_override_pattern" not in values and (a.get("hybrid_attention_ratio") or a.get("hybrid_mlp_ratio")):
            raise ReshardError("checkpoint args give hybrid_attention_ratio/hybrid_mlp_ratio without hybrid_override_pattern: "
                               "megatron-core allocates such layers by its own rounding; save the pattern it printed in the args")
        if "norm_epsilon" not in values and a.get("layernorm_epsilon") is not None:  # Megatron-LM's (core_v0.17.1: TransformerConfig's)
            values["norm_epsilon"] = a["layernorm_epsilon"]
        values["unmodeled"] = tuple(k for k, default in _UNMODELED.items() if a.get(k, default) != default)
        if "padded_vocab_size" not in values:
            if a.get("vocab_size") is None:
                raise ReshardError("checkpoint args have neither padded_vocab_size nor vocab_size")
            values["padded_vocab_size"] = a["vocab_size"]
        if "params_dtype" in values:  # a torch.dtype (or its stand-in: torchfile.pickles) in real args
            values["params_dtype"] = str(values["params_dtype"]).removeprefix("torch.")
        return cls(**values)

    def megatron_args(self) -> dict[str, Any]:
        """The Megatron-LM arguments that rebuild this architecture."""
        out = self.to_dict()
        out["group_query_attention"] = self.num_query_groups is not None
        out["num_query_groups"] = self.groups
        out["kv_channels"] = self.head_dim
        out["use_rope_scaling"] = self.rope_scaling
        out["layernorm_epsilon"] = self.norm_epsilon  # Megatron-LM's name (core_v0.17.1: TransformerConfig's)
        del out["unmodeled"]  # the source's own values of those options travel in its args
        if self.hybrid_override_pattern is not None:  # both spellings: Megatron-LM >= 0.18 reads hybrid_layer_pattern
            out.update(hybrid_layer_pattern=self.hybrid_override_pattern, is_hybrid_model=True)
        for name in _PATTERNS:
            if isinstance(out[name], tuple):
                out[name] = list(out[name])
        out["towers"] = [{"prefix": t.prefix, "tensors": [[name, list(shape)] for name, shape in t.tensors], "hf_config": t.hf_config,
                          **({"splits": [list(s) for s in t.splits], "stacked": list(t.stacked), "tp_units": [list(u) for u in t.tp_units],
                              "extra_state": list(t.extra_state)}
                             if t.splits or t.stacked else {}),
                          **({"parts": [[part, list(prefixes)] for part, prefixes in t.parts]} if t.parts else {})}
                         for t in self.towers]
        for name in ("mrope_section", "language_model_prefix", "towers"):  # a plain GPT model's args stay as they were
            if not out[name]:
                del out[name]
        return out
