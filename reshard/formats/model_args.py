"""The architecture of a Megatron checkpoint that carries no Megatron-LM `args`, as the args reshard's
readers take: from Megatron-Bridge's `run_config.yaml` (its model provider's fields), or from a file the
user names (`--config`: an HF config.json, or a YAML of Megatron-LM arguments) for a bare directory that
`dist_checkpointing.save` wrote.

YAML is read with `yaml.safe_load`, its nesting bounded (`reshard.documents`): a provider's `_target_` entries are
names, never imported or called, and those read (params_dtype, activation_func) must name what reshard maps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from reshard.config import _UNMODELED, MLA_FIELDS, ModelConfig, pad_vocab
from reshard.documents import read_json, read_yaml
from reshard.errors import ReshardError
from reshard.layout import Layout
from reshard.optim.order import FREEZABLE

RUN_CONFIG = "run_config.yaml"

# Megatron-Bridge keeps megatron-core's TransformerConfig names where Megatron-LM's arguments differ.
_RENAMED = {
    "layernorm_epsilon": "norm_epsilon",
    "num_moe_experts": "num_experts",
    "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
}
_BRIDGE_NAMES = {megatron: bridge for bridge, megatron in _RENAMED.items()}
# Options that change what the tensors mean; a provider that sets one is refused rather than misread.
_REFUSED = {"pipeline_model_parallel_layout": None}


_PLAIN = (str, int, float, bool, type(None))  # what a YAML value read into args may be (no dates, bytes or sets)
# What a provider's name fields may name: the only dtypes and activations reshard maps (the gated MLP is SwiGLU,
# the other exact GELU); anything else is refused, never carried into the args reshard writes.
_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
_ACTIVATIONS = {True: "torch.nn.functional.silu", False: "torch.nn.functional.gelu"}
QUICK_GELU = "megatron.core.fusions.fused_bias_geglu.quick_gelu"  # gated: gpt-oss's quick_geglu, as Bridge's provider names it
# GPT YaRN: Bridge's provider fields (yarn_*) for the ModelConfig fields MLA's YaRN shares
_YARN = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_LISTS = ("moe_layer_freq", "window_size", "window_attn_skip_freq", "mrope_section", "linear_attention_freq")  # provider fields that may hold a list
# Bridge's layer spec of MiniMax-M2 (q/k norms over every head: `ModelConfig.qk_layernorm_full_width`), which its
# provider names instead of a field
LOCAL_SPEC = "megatron.bridge.models.gpt_provider.local_layer_spec"
MINIMAX_M2_SPEC = "megatron.bridge.models.minimax_m2.minimax_m2_provider.minimax_m2_layer_spec"
QWEN2_5_VL_PROVIDER = "megatron.bridge.models.qwen_vl.qwen25_vl_provider.Qwen25VLModelProvider"
QWEN3_VL_PROVIDER = "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLModelProvider"
QWEN3_VL_MOE_PROVIDER = "megatron.bridge.models.qwen_vl.qwen3_vl_provider.Qwen3VLMoEModelProvider"
# Qwen3.5-VL's (hybrid language models: read, never written, as `save_run_config` says)
QWEN3_5_VL_PROVIDERS = tuple(f"megatron.bridge.models.qwen_vl.qwen35_vl_provider.Qwen35VL{kind}ModelProvider" for kind in ("", "MoE"))
VL_PROVIDERS = (QWEN2_5_VL_PROVIDER, QWEN3_VL_PROVIDER, QWEN3_VL_MOE_PROVIDER, *QWEN3_5_VL_PROVIDERS)


def _vl_family(target: str) -> Any:
    """The family module (its from_bridge / to_bridge) of a Bridge vision-language provider."""
    from reshard.converters import qwen2_5_vl, qwen3_5_vl, qwen3_vl, qwen3_vl_moe

    families = {QWEN2_5_VL_PROVIDER: qwen2_5_vl, QWEN3_VL_PROVIDER: qwen3_vl, QWEN3_VL_MOE_PROVIDER: qwen3_vl_moe}
    return families.get(target, qwen3_5_vl)


def _plain(value: Any) -> bool:
    """A YAML value that may become an argument: a plain scalar, or a list of them (moe_layer_freq)."""
    return isinstance(value, _PLAIN) or isinstance(value, list) and all(isinstance(item, _PLAIN) for item in value)


def _named(path: Path, model: dict[str, Any], key: str, allowed: set[str], default: str) -> str:
    """The dotted name a provider field refers to (`{_target_: torch.float32}` -> 'torch.float32'), refused
    naming the field unless `allowed`."""
    value = model.get(key)
    name = value.get("_target_") if isinstance(value, dict) else default if value is None else value
    if not isinstance(name, str) or name not in allowed:
        said = repr(name)[:80] if isinstance(name, str) else f"a YAML {type(name).__name__}"
        raise ReshardError(f"{path}: model.{key} names {said}; reshard reads {' or '.join(sorted(allowed))} there")
    return name


def _plain_values(path: Path, model: dict[str, Any]) -> dict[str, Any]:
    """The model section's plain values (and moe_layer_freq's list) as Megatron-LM args. A provider's objects (init
    methods, layer specs, enums) are left out; one where reshard reads a value, and any YAML value that is not
    plain (a date, bytes, a set), is refused."""
    read = {f.name for f in dataclasses.fields(ModelConfig)} | set(_UNMODELED) | set(Layout().megatron_args())
    args = {}
    for key, value in model.items():
        name = _RENAMED.get(key, key) if isinstance(key, str) else key
        reads = name in read and key != "params_dtype"  # params_dtype names a dtype: `_named` reads it
        if isinstance(key, str) and isinstance(value, _PLAIN) or name in _LISTS and _plain(value):
            args[name] = value
        elif reads or not isinstance(value, (dict, list)):
            raise ReshardError(f"{path}: model.{key} holds a YAML {type(value).__name__}, not a plain value reshard reads")
    return args


def bridge_args(path: Path) -> dict[str, Any]:
    """Megatron-LM args from the `model:` section of a Megatron-Bridge `run_config.yaml` (and its optimizer's name)."""
    data = read_yaml(path)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise ReshardError(f"{path} has no model section: not a Megatron-Bridge run config")
    args = _plain_values(path, model)
    optimizer = data.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("optimizer"), str):  # whose moments the state holds
        args["optimizer"] = optimizer["optimizer"]
    for key, default in _REFUSED.items():
        if model.get(key, default) not in (default, False, None):
            raise ReshardError(f"{path}: model.{key} is {model[key]!r}, which reshard does not read yet")
    gated = bool(model.get("gated_linear_unit"))
    activation = _named(path, model, "activation_func", {_ACTIVATIONS[gated], *([QUICK_GELU] if gated else [])}, _ACTIVATIONS[False])
    args["swiglu"], args["quick_geglu"] = gated, activation == QUICK_GELU
    if model.get("position_embedding_type") == "yarn" and not model.get("multi_latent_attention"):
        args.update({field: model[f"yarn_{field}"] for field in _YARN if model.get(f"yarn_{field}") is not None})
    if model.get("multi_latent_attention"):  # MLA computes with its own head dims: Bridge's kv_channels means nothing
        args["kv_channels"] = model.get("v_head_dim")
    spec = model.get("transformer_layer_spec")
    args["qk_layernorm_full_width"] = isinstance(spec, dict) and spec.get("_target_") == MINIMAX_M2_SPEC
    if isinstance(spec, dict) and spec.get("_target_") == LOCAL_SPEC:
        # Bridge builds the model by its spec, whatever the provider's transformer_impl field says (it is left at its
        # default): the spec decides the parameters' order in the DistributedOptimizer's buffers
        args["transformer_impl"] = "local"
    args["untie_embeddings_and_output_weights"] = not model.get("share_embeddings_and_output_weights", False)
    args["group_query_attention"] = model.get("num_query_groups") is not None
    if model.get("params_dtype") is not None:
        args["params_dtype"] = _DTYPES[_named(path, model, "params_dtype", set(_DTYPES), "")]
    if model.get("max_position_embeddings") is None and model.get("seq_length") is not None:
        args["max_position_embeddings"] = model["seq_length"]
    if model.get("_target_") in VL_PROVIDERS:  # a vision-language model: its tower and token ids
        args.update(_vl_family(model["_target_"]).from_bridge(model))
    if model.get("vocab_size") is not None:
        if model.get("should_pad_vocab"):  # padded as Megatron-LM pads it, at the saved TP
            tp = model.get("tensor_model_parallel_size") or 1
            args["padded_vocab_size"] = pad_vocab(model["vocab_size"], model.get("make_vocab_size_divisible_by") or 128, tp)
        else:
            args["padded_vocab_size"] = model["vocab_size"]  # Bridge stores the vocabulary unpadded
    return args


def _name(target: str) -> dict[str, Any]:
    """A provider field naming a function or dtype, as Bridge writes one (`_call_: false`: not called)."""
    return {"_target_": target, "_call_": False}


def save_run_config(directory: Path, args: dict[str, Any], config: ModelConfig, layout: Layout, te_names: bool) -> None:
    """Write a Megatron-Bridge `run_config.yaml` whose `model:` section (a GPTModelProvider, or an MLAModelProvider, as
    Bridge's `load_megatron_model` instantiates it) describes this model at this layout: what `bridge_args` reads back."""
    import yaml

    if any(kind.mixer not in ("attention", None) for kind in config.layer_kinds):
        # Bridge's GPT and VL providers describe softmax attention only: a run_config.yaml naming one would have Bridge
        # build another model than these tensors' (Gated DeltaNet, Mamba); without one, its loader stops naming the file
        return
    activation = "torch.nn.functional." + ("silu" if config.swiglu else "gelu")
    padded = config.vocab_size is not None and config.padded_vocab_for(layout.tp) == config.padded_vocab_size
    model = {
        "_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider",
        "transformer_layer_spec": _name(MINIMAX_M2_SPEC if config.qk_layernorm_full_width else
                                        "megatron.bridge.models.gpt_provider.transformer_engine_layer_spec" if te_names else LOCAL_SPEC),
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.groups,
        "kv_channels": config.head_dim,
        "ffn_hidden_size": config.ffn_hidden_size,
        # Bridge pads the vocabulary as Megatron-LM does, or takes the stored rows as they are
        "vocab_size": config.vocab_size if padded else config.padded_vocab_size,
        "should_pad_vocab": padded,
        "make_vocab_size_divisible_by": config.make_vocab_size_divisible_by,
        "seq_length": args.get("seq_length") or config.max_position_embeddings,
        "position_embedding_type": config.position_embedding_type,
        "rotary_base": config.rotary_base,
        "rotary_percent": config.rotary_percent,
        "rope_scaling": config.rope_scaling,
        "rope_scaling_factor": config.rope_scaling_factor,
        "normalization": config.normalization,
        "layernorm_epsilon": config.norm_epsilon,
        "gated_linear_unit": config.swiglu,
        "activation_func": _name(QUICK_GELU if config.quick_geglu else activation),
        "share_embeddings_and_output_weights": config.tied_embeddings,
        "add_bias_linear": config.add_bias_linear,
        "add_qkv_bias": config.add_qkv_bias,
        "qk_layernorm": config.qk_layernorm,
        "params_dtype": _name(f"torch.{config.params_dtype}"),
        "bf16": config.params_dtype == "bfloat16",
        "fp16": config.params_dtype == "float16",
        "num_moe_experts": config.num_experts,
        "moe_router_topk": config.moe_router_topk,
        "moe_ffn_hidden_size": config.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": config.moe_shared_expert_gate,
        "moe_router_pre_softmax": config.moe_router_pre_softmax,
        "moe_layer_freq": config.megatron_args()["moe_layer_freq"],
        "moe_router_score_function": config.moe_router_score_function,
        "moe_router_enable_expert_bias": config.moe_router_enable_expert_bias,
        "moe_router_num_groups": config.moe_router_num_groups,
        "moe_router_group_topk": config.moe_router_group_topk,
        "moe_router_topk_scaling_factor": config.moe_router_topk_scaling_factor,
        "mtp_num_layers": config.mtp_num_layers,  # or Bridge builds the model without its mtp.layers.*
        # gpt-oss's sinks, windows and clamped SwiGLU: TransformerConfig fields, which Bridge's providers take as they are
        **{name: value for name, value in config.megatron_args().items() if name in (
            "softmax_type", "window_size", "window_attn_skip_freq", "activation_func_clamp_value", "glu_linear_offset")},
    }
    if config.position_embedding_type == "yarn" and not config.multi_latent_attention:  # GPT YaRN: the provider's yarn_* fields
        model.update({f"yarn_{field}": getattr(config, field) for field in _YARN},
                     yarn_correction_range_round_to_int=config.yarn_correction_range_round_to_int)
    if config.multi_latent_attention:  # Bridge's MLA provider (its GPT one has no MLA fields) takes MLATransformerConfig's
        model.update({key: getattr(config, key) for key in MLA_FIELDS}, rope_type=config.mla_rope_type, kv_channels=config.v_head_dim,
                     _target_="megatron.bridge.models.mla_provider.MLAModelProvider")
    if config.towers:  # a vision-language model: Bridge's provider of its family (named by its tower), with its vision config
        qwen3 = QWEN3_VL_MOE_PROVIDER if config.is_moe else QWEN3_VL_PROVIDER
        target = qwen3 if config.towers[0].prefix == "vision_model." else QWEN2_5_VL_PROVIDER
        model.update(_target_=target, **_vl_family(target).to_bridge(config, args.get("hf_config")))
        # spelled out: Bridge's Qwen3VLMoEModelProvider freezes the language and vision models when the file says nothing
        model.update({f"freeze_{part}": bool(args.get(f"freeze_{part}")) for part in FREEZABLE})
    chosen = {key: args.get(key, default) for key, default in _UNMODELED.items()} | layout.megatron_args()
    model.update(bridge_fields(chosen))
    (directory / RUN_CONFIG).write_text(yaml.safe_dump({"model": model}, sort_keys=False))


def bridge_fields(args: dict[str, Any]) -> dict[str, Any]:
    """Megatron-LM arguments under the names of Megatron-Bridge's model provider."""
    return {_BRIDGE_NAMES.get(key, key): value for key, value in args.items()}


def args_from_file(path: Path) -> dict[str, Any]:
    """Megatron-LM args from `--config`: an HF config.json (mapped by its family's converter), a Megatron-
    Bridge run config, or a YAML mapping of Megatron-LM argument names."""
    if not path.is_file():
        raise ReshardError(f"--config {path} does not exist")
    if path.suffix == ".json":
        from reshard.converters import family_for_hf

        hf = read_json(path, name=f"--config {path}")
        if not isinstance(hf, dict):
            raise ReshardError(f"--config {path} is not an HF config.json (not a mapping)")
        family = family_for_hf(hf)
        try:
            config, extras = family.config_from_hf(hf)
        except (KeyError, TypeError, ValueError) as exc:
            raise ReshardError(f"--config {path} does not describe a {family.model_type} model ({exc})") from None
        return {**config.megatron_args(), **extras}
    data = read_yaml(path)
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        return bridge_args(path)
    if not isinstance(data, dict):
        raise ReshardError(f"--config {path} is neither an HF config.json nor a YAML mapping of Megatron arguments")
    for key, value in data.items():
        if not isinstance(key, str) or not _plain(value):
            raise ReshardError(f"--config {path}: {key} is a YAML {type(value).__name__}, not a plain value or a list of them")
    return data
