"""Parallel layouts: how a model's tensors are spread over tensor, pipeline and expert ranks."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from reshard.config import ModelConfig
from reshard.errors import ReshardError

# The Megatron-LM `args` fields that describe the parallel layout rather than the model, by Layout field.
_MEGATRON_ARGS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
    "first_stage_layers": "decoder_first_pipeline_num_layers",
    "last_stage_layers": "decoder_last_pipeline_num_layers",
}

# Other ways Megatron-LM can split layers over pipeline stages, with their defaults: stage sizes are read
# only from the two decoder_*_pipeline_num_layers above, so a checkpoint split another way would be misread.
_OTHER_PIPELINE_SPLITS = {
    "pipeline_model_parallel_layout": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
}


def megatron_arg(field: str) -> str:
    """The Megatron-LM argument that records a Layout field ("tp" -> "tensor_model_parallel_size")."""
    return _MEGATRON_ARGS[field]


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None means "same as tp" (Megatron's default)
    vpp: int = 1  # virtual pipeline stages per pipeline rank
    first_stage_layers: int | None = None  # uneven pipelines (Megatron's decoder_first_pipeline_num_layers)
    last_stage_layers: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def __str__(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"EP{self.ep}"]
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"ETP{self.etp}")
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            parts.append(f"uneven({self.first_stage_layers},{self.last_stage_layers})")
        return "".join(parts)

    @classmethod
    def from_megatron_args(cls, args: argparse.Namespace | dict[str, Any], *, any_split: bool = False) -> Layout:
        """The layout a Megatron checkpoint was saved at, read from its `args`. Args that split the stages
        another way are refused, unless `any_split` (a caller that needs only the parallel degrees)."""
        a = vars(args) if isinstance(args, argparse.Namespace) else args
        layout = cls(**{ours: a[theirs] for ours, theirs in _MEGATRON_ARGS.items() if a.get(theirs) is not None})
        if layout.pp > 1 and not any_split:
            for key, default in _OTHER_PIPELINE_SPLITS.items():
                if a.get(key, default) not in (default, None):
                    raise ReshardError(
                        f"the checkpoint's stages are split by {key}={a[key]!r}, which reshard does not read: "
                        "save it with decoder_first/last_pipeline_num_layers instead"
                    )
        return layout

    def megatron_args(self) -> dict[str, Any]:
        """The Megatron-LM arguments that say this layout (ETP and VPP as Megatron spells their defaults)."""
        values = dict(self.__dict__, etp=self.expert_tp, vpp=self.vpp if self.vpp > 1 else None)
        return {theirs: values[ours] for ours, theirs in _MEGATRON_ARGS.items()}

    def retarget(self, **changes: int | None) -> Layout:
        """This layout with the given degrees changed (None: keep). Derived settings follow:
        ETP keeps tracking TP unless set or set apart at the source, and a new PP degree drops
        the source's uneven stage sizes unless new ones are given."""
        given = {k: v for k, v in changes.items() if v is not None}
        values = dict(self.__dict__, **given)
        if "etp" not in given and (self.etp is None or self.etp == self.tp):
            values["etp"] = None
        if "pp" in given and not {"first_stage_layers", "last_stage_layers"} & given.keys():
            values["first_stage_layers"] = values["last_stage_layers"] = None
        return Layout(**values)

    def stage_layers(self, num_layers: int) -> list[range]:
        """Global layer ranges of the pipeline chunks, indexed by `vstage * pp + pp_rank`."""
        chunks = self.pp * self.vpp
        first, last = self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            if num_layers % chunks:
                raise ReshardError(
                    f"{num_layers} layers do not split evenly over PP={self.pp} x VPP={self.vpp}; "
                    "choose a degree that divides the layer count or give --first-stage-layers/--last-stage-layers"
                )
            size = num_layers // chunks
            return [range(i * size, (i + 1) * size) for i in range(chunks)]
        if self.vpp > 1:
            raise ReshardError("uneven first/last pipeline stages with virtual stages are not supported; drop --vpp")
        if self.pp == 1:
            raise ReshardError("--first-stage-layers/--last-stage-layers need PP > 1")
        # every stage holds a layer, as Megatron-Core's TransformerConfig requires (it refuses an empty stage)
        for which, size in (("first", first), ("last", last)):
            if size is not None and size < 1:
                raise ReshardError(f"a {which} pipeline stage of {size} layers (--{which}-stage-layers, Megatron's "
                                   f"decoder_{which}_pipeline_num_layers) cannot exist: a stage holds at least one layer")
        middle_stages = self.pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if rest < 0 or (middle_stages == 0 and rest) or (middle_stages and (rest == 0 or rest % middle_stages)):
            raise ReshardError(
                f"{num_layers} layers cannot be split as first={first}, last={last} over PP={self.pp} "
                "(every stage holds at least one layer, the middle ones alike)"
            )
        sizes = [rest // middle_stages if middle_stages else 0] * self.pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        ranges, start = [], 0
        for size in sizes:
            ranges.append(range(start, start + size))
            start += size
        return ranges

    def chunk_of_layer(self, num_layers: int, layer: int) -> tuple[int, int, int]:
        """(pp_rank, vstage, local index) of a global layer."""
        for index, layers in enumerate(self.stage_layers(num_layers)):
            if layer in layers:
                return index % self.pp, index // self.pp, layer - layers.start
        raise ReshardError(f"layer {layer} is outside the model's {num_layers} layers")

    def validate(self, config: ModelConfig) -> None:
        """Refuse a layout the model cannot be split into, naming the constraint that fails."""
        for name, value in (("TP", self.tp), ("PP", self.pp), ("EP", self.ep), ("ETP", self.expert_tp), ("VPP", self.vpp)):
            if value < 1:
                raise ReshardError(f"{name}={value}: parallel degrees must be positive integers")
        if self.tp % self.expert_tp:
            # expert weights live in the TP ranks' files, each holding one ETP part (ranks past ETP repeat them)
            raise ReshardError(
                f"ETP={self.expert_tp} with TP={self.tp}: expert tensor parallelism must divide TP here; "
                f"choose --to-etp among the divisors of {self.tp}"
            )
        checks = [
            (config.num_attention_heads, self.tp, "attention heads"),
            (config.groups, self.tp, "query groups (GQA)"),
            (config.ffn_hidden_size, self.tp, "FFN hidden size"),
        ]
        if config.multi_latent_attention:  # the local spec's down projections are column-parallel
            if config.q_lora_rank:
                checks.append((config.q_lora_rank, self.tp, "q_lora_rank rows (linear_q_down_proj)"))
            checks.append((config.kv_lora_rank + config.qk_pos_emb_head_dim, self.tp,
                           "kv_lora_rank + qk_pos_emb_head_dim rows (linear_kv_down_proj)"))
        if any(config.linear_attention_layers):  # Gated DeltaNet splits its key and value heads over TP
            checks.append((config.linear_num_key_heads, self.tp, "linear attention key heads (linear_num_key_heads)"))
            checks.append((config.linear_num_value_heads, self.tp, "linear attention value heads (linear_num_value_heads)"))
        if any(kind.mixer == "mamba" for kind in config.layer_kinds):  # Mamba-2 splits its heads and B/C groups over TP
            checks.append((config.mamba_heads, self.tp, "Mamba heads (mamba_num_heads)"))
            checks.append((config.mamba_num_groups, self.tp, "Mamba groups (mamba_num_groups)"))
        if config.is_moe:
            if config.add_bias_linear and self.expert_tp > 1:  # megatron-core's TransformerConfig refuses it
                raise ReshardError(f"ETP={self.expert_tp}: megatron-core gives experts their biases (add_bias_linear, gpt-oss) "
                                   "only without expert tensor parallelism; pass --to-etp 1")
            checks.append((config.num_experts, self.ep, "experts"))
            checks.append((config.moe_ffn_hidden_size or config.ffn_hidden_size, self.expert_tp, "expert FFN hidden size"))
            if config.moe_shared_expert_intermediate_size:
                checks.append((config.moe_shared_expert_intermediate_size, self.tp, "shared-expert FFN size"))
        elif self.ep > 1:
            raise ReshardError(f"EP={self.ep} needs a mixture-of-experts model; this one is dense: use --to-ep 1")
        checks += [(count, self.tp, what) for tower in config.towers for what, count in tower.tp_units]  # where a tower splits
        for total, degree, what in checks:
            if total % degree:
                raise ReshardError(
                    f"TP/EP degree {degree} does not divide the model's {total} {what}; choose a divisor of {total}"
                )
        self.stage_layers(config.num_layers)
        if config.vocab_size is None and config.padded_vocab_size % (config.make_vocab_size_divisible_by * self.tp):
            if config.padded_vocab_size % self.tp:
                raise ReshardError(
                    f"TP={self.tp} does not divide the padded vocabulary {config.padded_vocab_size} and the true "
                    "vocabulary size is unknown: pass --vocab-size"
                )


@dataclass(frozen=True, order=True)
class RankCoord:
    """One model-parallel rank of a layout (data-parallel replicas hold the same files)."""

    pp: int = 0
    tp: int = 0
    ep: int = 0
    vstage: int = 0  # only used to select a model chunk inside a rank; not a separate file

    def legacy_dirname(self, layout: Layout) -> str:
        name = f"mp_rank_{self.tp:02d}"
        if layout.pp > 1:
            name += f"_{self.pp:03d}"
        if layout.ep > 1:
            name += f"_{self.ep:03d}"
        return name


def ranks(layout: Layout) -> Iterator[RankCoord]:
    """Every (pp, tp, ep) rank of a layout, in Megatron's file order."""
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            for ep in range(layout.ep):
                yield RankCoord(pp=pp, tp=tp, ep=ep)
