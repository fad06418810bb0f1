"""The order of a rank's parameters in megatron-core's `named_parameters()`, by their checkpoint (canonical) names:
where the DistributedOptimizer's buffers (`reshard.optim.buffers`) lay each of them out, in reverse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.logical import TensorSpec
from reshard.naming import FUSED_PARTS

# A hybrid model's layers of other kinds register their mixer where an attention layer has its self_attention
# (megatron-core 0.16.1; the norm first in each LayerNormLinear, as TE registers it: megatron-core builds these modules
# in the TE spec only). A module's own parameters come before its submodules' in named_parameters(), whatever order
# __init__ assigns them in: GatedDeltaNet's dt_bias, A_log (ssm/gated_delta_net.py:183,192), then in_proj, conv1d,
# out_norm, out_proj (:146,166,202,209), its input norm in_proj's own (the layer's input_layernorm an IdentityOp).
# MambaLayer registers its mixer (mamba_layer.py:77; its norm an IdentityOp, fused into in_proj): dt_bias, A_log, D
# (ssm/mamba_mixer.py:330,341,345), then in_proj, conv1d (weight, bias), norm, out_proj (:268,296,355,367). torch_dist
# keys in_proj's and conv1d's parts apart (`_split_tensor_factory`); each part is a tensor of its own here, the parts of
# one parameter in its row order (`parameter_of`).
_GATED_DELTA_NET = (
    "self_attention.dt_bias",
    "self_attention.A_log",
    "self_attention.in_proj.layer_norm_weight",
    *(f"self_attention.in_proj.weight.{part}" for part in FUSED_PARTS["self_attention.in_proj.weight"]),
    *(f"self_attention.conv1d.weight.{part}" for part in FUSED_PARTS["self_attention.conv1d.weight"]),
    "self_attention.out_norm.weight",
    "self_attention.out_proj.weight",
)
_MAMBA_MIXER = (
    "mixer.dt_bias",
    "mixer.A_log",
    "mixer.D",
    "mixer.in_proj.layer_norm_weight",
    *(f"mixer.in_proj.weight.{part}" for part in FUSED_PARTS["mixer.in_proj.weight"]),
    *(f"mixer.conv1d.{kind}.{part}" for kind in ("weight", "bias") for part in FUSED_PARTS[f"mixer.conv1d.{kind}"]),
    "mixer.norm.weight",
    "mixer.out_proj.weight",
)
# A transformer layer's parameters in megatron-core's module order (local spec: input_layernorm,
# self_attention.{linear_proj, linear_qkv, q_layernorm, k_layernorm}, pre_mlp_layernorm, mlp.{fc1, fc2};
# an MoE layer's mlp: router, (experts,) shared_experts with its own gate_weight before its submodules'),
# by their checkpoint (canonical) names. A hybrid model's MoE layer is such a layer of pre_mlp_layernorm and mlp only
# (MambaStack's moe_layer spec, megatron-core 0.16.1): its order is this one's.
_LAYER_ORDER = (
    "self_attention.linear_qkv.layer_norm_weight",  # input_layernorm.weight
    "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.core_attention.softmax_offset",  # attention sinks: core_attention registers before linear_proj
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight",
    "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight",
    "self_attention.k_layernorm.bias",
    *_GATED_DELTA_NET,  # a linear-attention layer's self_attention
    *_MAMBA_MIXER,  # a hybrid model's Mamba layer's (its only module)
    "mlp.linear_fc1.layer_norm_weight",  # pre_mlp_layernorm.weight
    "mlp.linear_fc1.layer_norm_bias",
    "pre_mlp_layernorm.weight",  # an MoE layer's
    "pre_mlp_layernorm.bias",
    "mlp.router.weight",
    "mlp.router.bias",
    "mlp.fc1_latent_proj.weight",  # a latent MoE's projections (moe_layer.py:172,183), between its router and experts
    "mlp.fc2_latent_proj.weight",
    "mlp.experts",  # the experts, where they share the dense buffer (EP1)
    "mlp.shared_experts.gate_weight",
    "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.linear_fc1.bias",
    "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_experts.linear_fc2.bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
)
# The same layer with the Transformer-Engine spec (megatron-core 0.17.1, gpt_layer_specs.py:310-316): no
# input_layernorm module (TransformerLayerSubmodules' IdentityOp); it is linear_qkv's own, a TE LayerNormLinear,
# which registers layer_norm_weight, layer_norm_bias, weight, bias in that order (TE v2.14.1, the version
# megatron-core 0.17.1 pins: pytorch/module/layernorm_linear.py:1262,1271,1358,1373; the same since TE 1.x).
# Attention registers core_attention (no parameters here), then linear_proj (attention.py:318,349), and
# SelfAttention then linear_qkv, q_layernorm, k_layernorm (attention.py:1278,1292,1301): the norm moves after
# linear_proj. mlp.linear_fc1 is a LayerNormLinear too, registered where the local pre_mlp_layernorm was (just
# before fc1's weight), and TE's Linear registers weight before bias (linear.py:1268,1283), so the rest is alike.
_TE_LAYER_ORDER = (
    "self_attention.core_attention.softmax_offset",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.layer_norm_bias",
    *(name for name in _LAYER_ORDER if not name.startswith(("self_attention.linear_proj.", "self_attention.linear_qkv.layer_norm_",
                                                             "self_attention.core_attention."))),
)
_MLP_ORDER = _LAYER_ORDER[_LAYER_ORDER.index("mlp.linear_fc1.layer_norm_weight") :]  # the same in every table
# A multi-latent-attention layer (megatron-core 0.16.1; alike in 0.17.1 and 0.19.2): TransformerLayer registers
# input_layernorm (a module of its own in both specs), self_attention, pre_mlp_layernorm, mlp (transformer_layer.py:
# 287,304,334,370). Attention.__init__ builds linear_proj (attention.py:349; MultiLatentAttention's rebuild at
# multi_latent_attention.py:169 keeps its place) before MLASelfAttention builds linear_q_proj (no q_lora_rank) or
# linear_q_down_proj and linear_q_up_proj, then linear_kv_down_proj, linear_kv_up_proj, q_layernorm, kv_layernorm
# (multi_latent_attention.py:393,419,438,464,483,498,505). MLA's projections have no bias.
_MLA_HEAD = (
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "self_attention.linear_q_proj.weight",
    "self_attention.linear_q_down_proj.weight",
)
# The local spec's latent norms are q_layernorm and kv_layernorm (gpt_layer_specs.py:383-384), canonically the up
# projections' layer_norm_*: last in the attention.
_MLA_LAYER_ORDER = (
    *_MLA_HEAD,
    "self_attention.linear_q_up_proj.weight",
    "self_attention.linear_kv_down_proj.weight",
    "self_attention.linear_kv_up_proj.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight",  # q_layernorm.weight
    "self_attention.linear_q_up_proj.layer_norm_bias",
    "self_attention.linear_kv_up_proj.layer_norm_weight",  # kv_layernorm.weight
    "self_attention.linear_kv_up_proj.layer_norm_bias",
    *_MLP_ORDER,
)
# The Transformer-Engine spec (gpt_layer_specs.py:233-265): input_layernorm a TENorm, q/kv_layernorm IdentityOp; with
# qk_layernorm the up projections are TE LayerNormLinears, which register their norm before their weight (as
# linear_qkv above). The down projections are TELinear(parallel_mode="duplicated"): whole on every TP rank.
_MLA_TE_LAYER_ORDER = (
    *_MLA_HEAD,
    "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.linear_q_up_proj.layer_norm_bias",
    "self_attention.linear_q_up_proj.weight",
    "self_attention.linear_kv_down_proj.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight",
    "self_attention.linear_kv_up_proj.layer_norm_bias",
    "self_attention.linear_kv_up_proj.weight",
    *_MLP_ORDER,
)
# One expert's parameters (SequentialMLP's local_experts.<i>), in the expert optimizer's own buffer (EP > 1).
_EXPERT_ORDER = (
    "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.experts.linear_fc1.bias",
    "mlp.experts.experts.linear_fc2.weight",
    "mlp.experts.experts.linear_fc2.bias",
)
_TOP_ORDER = (
    "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight",
    None,  # the decoder's layers
    "decoder.final_layernorm.weight",
    "decoder.final_layernorm.bias",
    "decoder.final_norm.weight",  # a hybrid model's (MambaStack's final_norm, mamba_block.py:166)
    "mtp",  # the multi-token-prediction layers, each in `_MTP_ORDER`
    "output_layer.weight",
)
# Megatron-Bridge 0.6.2's vision-language models register their vision tower before the language model: Qwen25VLModel
# builds `visual` (the HF Qwen2_5_VisionTransformerPretrainedModel) then `language_model` (modeling_qwen25_vl.py:
# 107-110), Qwen3VLModel `vision_model` then `language_model` (modelling_qwen3_vl/model.py:319,340; both set to None
# first, which registers nothing). So the towers' parameters come first (0), the language model's after them (1).
# Within Qwen3VLVisionModel: patch_embed, pos_embed, then its decoder (vision_model.py:144,145,156), a TransformerBlock
# whose layers (each a Transformer-Engine layer, get_vit_layer_with_transformer_engine_spec: `_TE_LAYER_ORDER`) come in
# turn before its deepstack_merger_list (transformer_block.py:90, after TransformerBlock.__init__), then the merger
# (vision_model.py:168); a merger registers patch_norm, linear_fc1, linear_fc2 (utils.py:133,140). `Tower.tensors`
# lists them so, a stacked tensor once for all its blocks.
TOWERS_AT = 0
FREEZABLE = ("language_model", "vision_model", "vision_projection")  # the parts Bridge's VL providers can freeze (freeze_<part>)
# An MTP layer (megatron-core 0.16.1 multi_token_prediction.py: MultiTokenPredictionLayer registers enorm, hnorm,
# eh_proj, then its transformer layer (a decoder layer's parameters in the layer order), then final_layernorm).
_MTP_ORDER = ("enorm.weight", "enorm.bias", "hnorm.weight", "hnorm.bias", "eh_proj.weight", "transformer_layer",
              "final_layernorm.weight", "final_layernorm.bias")


# What megatron-core registers as a module buffer, not a parameter: in the model's state, never in named_parameters()
# and so never in the DistributedOptimizer's (the sigmoid router's expert_bias, updated from token counts).
_BUFFERS = re.compile(r"\.mlp\.router\.expert_bias$")


# A model tensor that is a part of a megatron-core parameter, torch_dist keying the parts apart (Gated DeltaNet's and
# the Mamba mixer's in_proj.weight.<part>, conv1d.<weight|bias>.<part>): the parameter has one place in the buffers,
# its parts in it one after the other, as `LAYER_ORDERS` lists them.
_PART = re.compile(r"\.(weight|bias)\.\w+$")


def parameter_of(name: str) -> str:
    """The megatron-core parameter that model tensor `name` is, or is a part of."""
    return name.rsplit(".", 1)[0] if _PART.search(name) else name


def is_parameter(name: str) -> bool:
    """Whether model tensor `name` is a parameter (has a place in the optimizer's buffers), not a module buffer."""
    return not _BUFFERS.search(name)


def _unknown_place(param: str) -> ReshardError:
    return ReshardError(
        f"{param}: where megatron-core places this parameter in the DistributedOptimizer's buffer is not "
        "known to reshard; its dp_reshardable optimizer state cannot be decoded (convert with --no-optimizer)"
    )


MULTI_HEAD, MULTI_LATENT = "multi-head", "multi-latent"
# A transformer layer's parameters in registration order, by what selects them: the module spec the saving run was
# built with (its args' transformer_impl) and the layer's attention. This is the one place a parameter's place is
# known: a model family whose layers register parameters of their own puts them in their place here (or adds the
# entry of a new attention), and its DistributedOptimizer state is decoded and written in every form.
LAYER_ORDERS: dict[tuple[str, str], tuple[str, ...]] = {
    ("local", MULTI_HEAD): _LAYER_ORDER,
    ("transformer_engine", MULTI_HEAD): _TE_LAYER_ORDER,
    ("local", MULTI_LATENT): _MLA_LAYER_ORDER,
    ("transformer_engine", MULTI_LATENT): _MLA_TE_LAYER_ORDER,
}


def attention_of(config: ModelConfig) -> str:
    """The attention of a model's layers, as `LAYER_ORDERS` keys it."""
    return MULTI_LATENT if config.multi_latent_attention else MULTI_HEAD


def _frozen(args: dict[str, Any], config: ModelConfig | None) -> tuple[str, ...]:
    """The name prefixes of the parameters a run with `args` froze: Megatron-Bridge's VL providers' `freeze_<part>` (in
    run_config.yaml's model section) sets requires_grad=False on a part's parameters, and megatron-core's DDP gives
    those no place in its buffers (distributed_data_parallel.py: `if not param.requires_grad: continue`). The language
    model is under the model's prefix; the other parts are the towers' (`Tower.parts`)."""
    frozen: list[str] = []
    for part in FREEZABLE:
        if not args.get(f"freeze_{part}"):
            continue
        if part == "language_model" and config is not None and config.language_model_prefix:
            frozen.append(config.language_model_prefix)
            continue
        named = [prefixes for tower in (config.towers if config is not None else ()) for name, prefixes in tower.parts if name == part]
        if not named:
            raise ReshardError(f"freeze_{part}: the run froze a part the model does not name; its DistributedOptimizer state "
                               "cannot be placed (convert with --no-optimizer)")
        frozen += [prefix for prefixes in named for prefix in prefixes]
    return tuple(frozen)


def _in_tower(names: tuple[str, ...], stacks: tuple[str, ...], param: str, block: int | None) -> tuple[int, int, int]:
    """Where a tower's parameter comes in its named_parameters(): in `names`' order, but a stacked tensor's `block` with
    that block's other parameters (the blocks in turn), a transformer layer's in Transformer Engine's layer order."""
    stack = next((prefix for prefix in stacks if param.startswith(prefix)), None)
    if stack is None:
        return (names.index(param), 0, 0)
    tail = param.removeprefix(stack)
    within = _TE_LAYER_ORDER.index(tail) if tail in _TE_LAYER_ORDER else names.index(param)
    return (next(i for i, name in enumerate(names) if name.startswith(stack)), block or 0, within)


@dataclass(frozen=True)
class ParamOrder:
    """The order of a rank's parameters in `named_parameters()`, as the saving run's modules register them."""

    spec: str  # the module spec: "transformer_engine" (Megatron-LM's default transformer_impl) or "local"
    attention: str = MULTI_HEAD
    grouped_experts: bool = False  # TEGroupedMLP experts (moe_grouped_gemm with TE), not SequentialMLP
    language_model_prefix: str = ""  # a vision-language model's (`ModelConfig.language_model_prefix`)
    towers: tuple[tuple[str, ...], ...] = ()  # each other tower's parameters in its registration order (`Tower.tensors`)
    stacks: tuple[tuple[str, ...], ...] = ()  # each tower's name prefixes of stacked blocks (`Tower.stacked`)
    frozen: tuple[str, ...] = ()  # name prefixes of the parameters the run froze (`_frozen`): in no buffer

    @classmethod
    def of(cls, args: dict[str, Any], attention: str = MULTI_HEAD, config: ModelConfig | None = None) -> ParamOrder:
        """The order of a run with saved `args`, of a model whose layers have `attention` (and, beside its language
        model, the towers of `config`)."""
        impl = args.get("transformer_impl", "transformer_engine")
        if (impl, attention) not in LAYER_ORDERS:
            raise ReshardError(
                f"DistributedOptimizer state of a transformer_impl={impl} model with {attention} attention is not decoded "
                "(convert with --no-optimizer)"
            )
        for flag, what in (("use_te_op_fuser", "Transformer-Engine's fused-op MLP"), ("fp8_param_gather", "FP8 parameters"),
                           ("moe_use_legacy_grouped_gemm", "the legacy GroupedMLP experts"),
                           ("mla_down_proj_fusion", "multi-latent attention's fused q/kv down projection")):
            if args.get(flag):
                raise ReshardError(f"DistributedOptimizer state of a model with {what} ({flag}) is not decoded yet (convert with --no-optimizer)")
        towers = config.towers if config is not None else ()
        prefix = config.language_model_prefix if config is not None else ""
        # the local spec builds SequentialMLP whatever moe_grouped_gemm says (backends.py, LocalSpecProvider)
        return cls(impl, attention, impl == "transformer_engine" and bool(args.get("moe_grouped_gemm")), prefix,
                   tuple(tuple(name for name, _ in tower.tensors) for tower in towers), tuple(tower.stacked for tower in towers),
                   _frozen(args, config))

    def trains(self, name: str) -> bool:
        """Whether model tensor `name` is a trained parameter: one with optimizer state (a place in the buffers)."""
        return is_parameter(name) and not name.startswith(self.frozen)

    @property
    def transformer_engine(self) -> bool:
        return self.spec == "transformer_engine"

    @property
    def layer(self) -> tuple[str, ...]:
        """A transformer layer's parameters in registration order."""
        return LAYER_ORDERS[(self.spec, self.attention)]

    def key(self, spec: TensorSpec, layer: int | None, expert: int | None) -> tuple[int, ...]:
        """Where parameter `spec` (at global `layer` and `expert`, or tower block `layer`) comes in the rank's
        named_parameters()."""
        for index, names in enumerate(self.towers):
            if spec.param in names:
                return (TOWERS_AT, index, *_in_tower(names, self.stacks[index] if self.stacks else (), spec.param, layer))
        if not spec.param.startswith(self.language_model_prefix):
            raise _unknown_place(spec.param)
        return (1 - TOWERS_AT, *self._in_language_model(spec, layer, expert))

    def _in_language_model(self, spec: TensorSpec, layer: int | None, expert: int | None) -> tuple[int, ...]:
        """Where a parameter of the language model (a GPTModel's) comes in its named_parameters()."""
        param = spec.param.removeprefix(self.language_model_prefix)
        if mtp := re.match(r"mtp\.layers\.(\d+)\.(transformer_layer\.)?(.+)$", param):
            index, in_layer, tail = mtp.groups()
            if in_layer:
                return (_TOP_ORDER.index("mtp"), int(index), _MTP_ORDER.index("transformer_layer"),
                        *self._in_layer(param, tail, spec.experts, expert))
            if tail not in _MTP_ORDER:
                raise _unknown_place(param)
            return (_TOP_ORDER.index("mtp"), int(index), _MTP_ORDER.index(tail))
        if not param.startswith("decoder.layers."):
            if param not in _TOP_ORDER:
                raise _unknown_place(param)
            return (_TOP_ORDER.index(param), 0, 0, 0, 0)
        tail = re.sub(r"^decoder\.layers\.(\d+\.)?", "", param)
        layer = layer if layer is not None else spec.layer
        return (_TOP_ORDER.index(None), layer, *self._in_layer(param, tail, spec.experts, expert))

    def _in_layer(self, param: str, tail: str, experts: bool, expert: int | None) -> tuple[int, int, int]:
        """Where parameter `tail` of a transformer layer comes in the layer's named_parameters()."""
        order = _EXPERT_ORDER if experts else self.layer
        if tail not in order:
            raise _unknown_place(param)
        if experts:
            experts_at = self.layer.index("mlp.experts")
            if self.grouped_experts:
                # TEGroupedMLP registers linear_fc1, then linear_fc2 (experts.py:185,203), each a TE GroupedLinear that
                # registers weight<i> then bias<i> for each local expert i in turn (grouped_linear.py:704-736)
                module, kind = divmod(order.index(tail), 2)
                return (experts_at, module, 2 * (expert or 0) + kind)
            return (experts_at, expert or 0, order.index(tail))
        return (order.index(tail), 0, 0)
