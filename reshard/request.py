"""What a user asks of a conversion, as types: the target to write, what they assert of the source, and
how to run it. The CLI builds these from its flags; a Python caller builds them directly:

    convert("ckpts/run1", "ckpts/run1-hf", Target(format="hf", dtype="bf16", optimizer=False))
    convert("ckpts/run1", "ckpts/run1-tp8", Target(layout=LayoutChange(tp=8)), hints=SourceHints(tp=4))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from reshard.errors import ReshardError
from reshard.layout import Layout
from reshard.logical import normalize_dtype


@dataclass(frozen=True)
class LayoutChange:
    """Degrees to change in the source's layout (None: keep), as the CLI's --to-* flags give them."""

    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    etp: int | None = None
    vpp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def apply(self, source: Layout) -> Layout:
        return source.retarget(**dataclasses.asdict(self))


@dataclass(frozen=True)
class Target:
    """What a conversion writes; every field left out follows the source."""

    format: str | None = None  # torch_dist, legacy, zarr or hf
    layout: Layout | LayoutChange | None = None  # a whole layout, or changes to the source's
    dtype: str | None = None  # cast the model's weights and record it as the precision ("bf16", "torch.bfloat16", ...)
    optimizer: bool = True  # False: leave the optimizer state behind
    naming: Literal["te", "local"] | None = None  # Megatron output: Transformer-Engine or local-spec names
    max_shard_bytes: int | None = None  # HF output: the largest safetensors file
    # torch_dist output for Megatron-Bridge: the vocabulary unpadded, as Bridge saves, loads and exports it, and
    # a release checkpoint as its iteration 0 (Bridge's loader finds iter_* directories only)
    for_bridge: bool = False
    # HF output: the decoder's linear weights re-quantized to fp8 per block, as DeepSeek-V3 releases them (lossy:
    # the output is held to an error bound, not to the source's checksums)
    fp8_blocks: bool = False
    # HF output: the experts' weights re-quantized to MXFP4 where the family is released so (gpt-oss), lossy as above
    mxfp4: bool = False
    # torch_dist output: the DistributedOptimizer state per parameter (any layout), or as the buckets of the target
    # layout's DistributedOptimizer at data-parallel size `dp` (None: the source's), Megatron-LM's default form
    optimizer_form: Literal["fully_reshardable", "dp_reshardable"] = "fully_reshardable"
    dp: int | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None:
            object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.optimizer_form not in ("fully_reshardable", "dp_reshardable"):
            raise ReshardError(f"unknown optimizer form {self.optimizer_form!r}; choose fully_reshardable or dp_reshardable")
        if self.dp is not None and self.dp < 1:  # whether the form written is bound to a DP size is the plan's to say
            raise ReshardError(f"--to-dp {self.dp}: a data-parallel size is at least 1")

    def layout_for(self, source: Layout) -> Layout:
        if self.layout is None:
            return source
        return self.layout.apply(source) if isinstance(self.layout, LayoutChange) else self.layout


@dataclass(frozen=True)
class SourceHints:
    """What the user says of the source: degrees it must be saved at (a conversion of another checkpoint
    than the one meant is refused), and the true vocabulary size where its args do not record it."""

    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    vocab_size: int | None = None
    config: Path | None = None  # the architecture of a checkpoint that records none (HF config.json or Megatron args YAML)
    base: Path | None = None  # the base model (HF or Megatron) of a LoRA adapter save (`reshard.lora`)


@dataclass(frozen=True)
class Run:
    """How to run a conversion; the output is the same whatever these are."""

    workers: int = 1  # threads reading, hashing and writing units of work
    max_memory: int | None = None  # bytes of working memory (default: see `reshard.plan.default_budget`)
    reread: bool = False  # verify by reading every written value back, not only the records' placement
    check_space: bool = True  # refuse up front what does not fit in the free space
