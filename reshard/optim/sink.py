"""The writer's seam: a format writer *composes* an optimizer sink and hands it the pieces of the optimizer tensors;
the sink lays them out in one of the DistributedOptimizer's buffer forms (`dp_reshardable` buckets in torch_dist's
files, `distrib_optim.pt` beside legacy rank files) for the target layout, at the target run's data-parallel size.
Neither subclasses the other: the writer asks its sink where a piece goes (`DpReshardableSink.placements`) or
leaves the writing of the pieces to it (`DistribOptimPtSink`), as its format's files allow. A writer learns its form
(`Form`, and with it the sink) and the target's data-parallel size from the plan (`WriteOptions.optimizer`, an
`OptimizerOutput` of `reshard.optim.forms`' table)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.layout import Layout, RankCoord
from reshard.logical import TensorSpec
from reshard.optim.buffers import BufferLayout, Gbuf, Placed, flat_span, run_args
from reshard.sharding import Piece, Region
from reshard.torchfile.pickles import named


@dataclass(frozen=True)
class Placement:
    """Where one target piece goes in a torch_dist output: a chunk of stored tensor `key` (None: the piece's own
    logical tensor) at `offsets`, of `shape`, in the file of model-parallel rank `rank`."""

    piece: Piece
    rank: RankCoord
    key: str | None
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    vouched: bool = True  # its checksum counts as the tensor's as written (one copy of each value does)


class OptimizerSink:
    """What the buffer forms share: the target run's buffers (`BufferLayout` of the writer's tensors, its target args
    and the data-parallel size `dp`), which pieces have a place of their own there and where."""

    written_as: ClassVar[str]  # how a refusal names the output

    def __init__(
        self, specs: dict[str, TensorSpec], config: ModelConfig, layout: Layout, args: dict[str, Any], objects: Mapping[str, Any],
        extra: dict[str, Any], dp: int,
    ):
        self.extra_args = self.run_args(dp, layout)  # what the sink adds to the writer's target args
        self.args = args | self.extra_args
        self.config, self.layout = config, layout
        self.objects, self.extra = objects, extra  # the writer's common state's, as the form needs them (`CommonState`)
        self.buffer_layout = BufferLayout(specs, config, layout, self.args)
        self.grad_dtype = "float32" if self.args.get("grad_reduce_in_fp32") else config.params_dtype
        self.dtype_key = (named("torch", config.params_dtype), named("torch", self.grad_dtype))  # as the saved state keys them

    @staticmethod
    def run_args(dp: int, layout: Layout) -> dict[str, Any]:
        """The args that make the target a DistributedOptimizer run at data-parallel size `dp`."""
        return run_args(dp, layout)

    @classmethod
    def whole_regions(cls, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> list[Region]:
        """Every rank's copy of a piece is one place of its own in that rank's buffer (`CheckpointWriter.whole_regions`)."""
        return list(dict.fromkeys(p.region for p in pieces))

    def own_pieces(self, spec: TensorSpec, pieces: list[Piece]) -> list[Piece]:
        """The pieces of optimizer tensor `spec` that have a place of their own in a buffer."""
        return self.buffer_layout.own_pieces(self.buffer_layout.model_specs[spec.param], pieces)

    def place(self, spec: TensorSpec, piece: Piece) -> tuple[Gbuf, Placed, int]:
        """The buffer and place of a piece of optimizer tensor `spec`, and where the piece starts in that place."""
        gbuf, place = self.buffer_layout.place_of(self.buffer_layout.model_specs[spec.param], piece)
        span = flat_span(piece)
        if span is None:
            raise ReshardError(f"{spec.name}: a target piece is not one run of its rank's parameter; not written {self.written_as}")
        return gbuf, place, span[0]


@dataclass(frozen=True)
class Form:
    """One form a target format can hold the optimizer state in."""

    name: str  # in a plan's words
    sink: type[OptimizerSink] | None = None  # what lays it out (None: the format writer's own per-parameter tensors)
    requested_as: str = ""  # how a refusal names the request for it


@dataclass(frozen=True)
class OptimizerOutput:
    """How a conversion writes the optimizer state: in `form`, for a target run at data-parallel size `dp` where the
    form is bound to one (its buffers), from the source's form `read` (in words)."""

    form: Form
    dp: int | None
    read: str

    @property
    def written(self) -> str:
        return self.form.name if self.dp is None else f"{self.form.name} (DP {self.dp})"
