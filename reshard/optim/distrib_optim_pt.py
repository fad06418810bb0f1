"""Legacy output (`--ckpt-format torch`) for a run with Megatron's DistributedOptimizer: beside each
`mp_rank_*/model_optim_rng.pt`, the `distrib_optim.pt` that megatron-core's `save_parameter_state` writes and its
`load_parameter_state` reads, for the target TP/PP and data-parallel size (`--to-dp`, default the source's).

Per model-parallel rank, `{"buckets_coalesced": True, <gbuf idx>: {(<param dtype>, <grad dtype>): {"param",
"exp_avg", "exp_avg_sq": fp32 1-D, "numel_unpadded": int}}}`: each buffer's buckets laid end to end without their
end padding, the 64-element alignment gaps between parameters zero (megatron-core 0.16's
`get_parameter_state_dp_zero`). Where each parameter lies is the reader's derivation (`buffers.BufferLayout`,
`Buffer.coalesced_start`), so what is written here decodes back by the same rules. The rank file's `optimizer`
entry is the DistributedOptimizer's `state_dict()`: its param groups (with `step`), no parameter state.

An MoE model at EP > 1 has megatron-core's ChainedOptimizer, whose `save_parameter_state` writes the list of its
optimizers' states `[dense, experts]`, each in the file of that optimizer's data-parallel rank 0
(`BufferLayout.holder`), None in the other's place; a file neither writes to is not written. The rank files'
`optimizer` entry is then the list of both `state_dict()`s. At EP1 the experts are in the one dense optimizer.

Each target piece of a logical optimizer tensor is written where it lies in its rank's buffer as its slab streams
by (memory: one parameter's state); the three records of a buffer are sealed at `finish`, their CRC-32 combined
from their parts' (`torchfile.crc32`). A rank's file is its buffers' 12 bytes per local parameter, plus alignment
gaps: torch.save of it needs no memory here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from isal.isal_zlib import crc32

from reshard.checksum import HashedParts
from reshard.errors import ReshardError
from reshard.formats.base import CheckpointReader, CommonState, Manifest
from reshard.formats.megatron_legacy import OPTIM_FILE, LegacyWriter
from reshard.layout import Layout
from reshard.logical import TensorSpec
from reshard.naming import uses_te_names
from reshard.optim.buffers import STATE_KEYS, BufferLayout, Gbuf, flat_span, run_args
from reshard.optim.dp_reshardable import DpReshardableWriter, param_groups
from reshard.optim.dp_reshardable import prepare_target as prepare_dp_target
from reshard.request import Target
from reshard.sharding import Piece, Region, shift, to_slices
from reshard.torchfile.archive_writer import Slot, StreamingTorchSave
from reshard.torchfile.crc32 import crc32_of_parts
from reshard.torchfile.pickles import named

_TAG = "distrib_optim"  # marks this writer's facts among the rank files'


def prepare_target(
    reader: CheckpointReader, specs: dict[str, TensorSpec], common: CommonState, target: Target, layout: Layout
) -> type[LegacyDistribOptimWriter]:
    """The writer of legacy output with DistributedOptimizer state, the target's data-parallel size recorded in
    `common`'s args. What the state needs (all three states of every parameter, an architecture, param groups, an
    expert data-parallel size) is the dp_reshardable writer's check: the buffers are the same. Transformer-Engine names
    are refused here (their buffer order is proven for torch_dist output only)."""
    if reader.config is not None and reader.config.is_moe and layout.ep > 1:
        param_groups(common.extra.get("optimizer"), True, "--to-format legacy with the DistributedOptimizer's state")
    prepare_dp_target(reader, "torch_dist", specs, common, target, layout)  # its format check is for its own output
    if uses_te_names(common.args) if target.naming is None else target.naming == "te":
        raise ReshardError(
            "legacy output of DistributedOptimizer state with Transformer-Engine names: its distrib_optim.pt in the TE "
            "buffer order is not verified against megatron-core; write local-spec names (--naming local) or torch_dist, "
            "or pass --no-optimizer"
        )
    return LegacyDistribOptimWriter


class LegacyDistribOptimWriter(LegacyWriter):
    """LegacyWriter whose optimizer tensors go into each model-parallel rank's `distrib_optim.pt`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        target_args = self._target_args()
        grad = "float32" if target_args.get("grad_reduce_in_fp32") else self.config.params_dtype
        dtype_key = (named("torch", self.config.params_dtype), named("torch", grad))
        self.buffer_layout = BufferLayout(self.specs, self.config, self.layout, target_args)
        chains = self.buffer_layout.chains  # [None] or [dense, experts]
        self._optim: dict[str, StreamingTorchSave] = {}  # rank directory -> its distrib_optim.pt
        self._records: dict[tuple[Gbuf, str], Slot] = {}  # (buffer, state) -> its record
        self._parts: dict[tuple[Gbuf, str], dict[int, tuple[int, int]]] = {}  # -> {byte offset: (length, CRC-32)}
        self._states: dict[str, Any] = {}  # rank directory -> what its file pickles: one optimizer's state, or the chain's
        for chain, group in self.buffer_layout.optimizers():
            dirname = self._dirname(chain, group)
            stream = self._optim.setdefault(dirname, StreamingTorchSave(self.directory / dirname / OPTIM_FILE))
            state: dict[Any, Any] = {"buckets_coalesced": True}
            for gbuf in self.buffer_layout.rank_buffers(chain, group):
                numel = sum(self.buffer_layout.buffers[gbuf].sizes)
                tensors: dict[str, Any] = {}
                for key in STATE_KEYS:
                    tensors[key] = (slot := stream.reserve((numel,), "float32")).stub
                    self._records[(gbuf, key)], self._parts[(gbuf, key)] = slot, {}
                state[gbuf.index] = {dtype_key: {**tensors, "numel_unpadded": numel}}
            if chain is None:
                self._states[dirname] = state
            else:
                self._states.setdefault(dirname, [None] * len(chains))[chain] = state
        groups = param_groups(self.common.extra["optimizer"], chains != [None])  # `prepare_target` checked they are there
        saved = {"optimizer": groups[None]} if chains == [None] else [{"optimizer": groups[chain]} for chain in chains]
        self.common = replace(self.common, extra={**self.common.extra, "optimizer": saved})

    def _dirname(self, chain: int | None, group: int) -> str:
        return self.buffer_layout.holder(chain, group).legacy_dirname(self.layout)

    def _target_args(self) -> dict[str, Any]:
        """A run at the recorded data-parallel size with the DistributedOptimizer, saving the legacy format."""
        return super()._target_args() | run_args(int(self.common.args["data_parallel_size"]), self.layout)

    @classmethod
    def whole_regions(cls, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> list[Region]:
        if not spec.is_optimizer:
            return super().whole_regions(spec, slab, pieces)
        return DpReshardableWriter.whole_regions(spec, slab, pieces)  # every rank's copy has its own place, as in buckets

    def _own_pieces(self, spec: TensorSpec, pieces: list[Piece]) -> list[Piece]:
        return self.buffer_layout.own_pieces(self.buffer_layout.model_specs[spec.param], pieces)

    def _place(self, spec: TensorSpec, piece: Piece) -> tuple[tuple[Gbuf, str], int]:
        """The record a piece of an optimizer tensor goes to, and its element offset there."""
        gbuf, place = self.buffer_layout.place_of(self.buffer_layout.model_specs[spec.param], piece)
        span = flat_span(piece)
        if span is None:
            raise ReshardError(f"{spec.name}: a target piece is not one run of its rank's parameter; not written to {OPTIM_FILE}")
        return (gbuf, spec.name.split(".")[2]), self.buffer_layout.buffers[gbuf].coalesced_start(place) + span[0]

    def reserve(self, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> Any:
        if not spec.is_optimizer:
            return super().reserve(spec, slab, pieces)
        return [self._place(spec, piece) for piece in self._own_pieces(spec, pieces)]

    def prepare(
        self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], reserved: Any = None, hashed: HashedParts | None = None
    ) -> Any:
        """Each piece flattened (row-major, as its rank's parameter is) into its place; the written parts and their
        CRC-32s for `write`. The checksums of the copies the reader decodes (primary pieces) are vouched for as written,
        where the reader finds them (`DistribOptimFiles.stored_records`)."""
        if not spec.is_optimizer:
            return super().prepare(spec, slab, data, pieces, reserved, hashed)
        written = []
        for piece, ((gbuf, key), offset) in zip(self._own_pieces(spec, pieces), reserved, strict=True):
            flat = np.ascontiguousarray(data[to_slices(shift(piece.region, slab))], dtype=np.float32).reshape(-1)
            slot, dirname = self._records[(gbuf, key)], self._dirname(gbuf.chain, gbuf.group)
            self._optim[dirname].write_part(slot, offset * 4, flat)
            written.append([_TAG, gbuf.chain, gbuf.group, gbuf.index, key, offset * 4, flat.nbytes, crc32(memoryview(flat).cast("B"))])
            if piece.primary and piece.alias is None:
                values = flat.reshape([b - a for a, b in piece.region])
                self.vouch(spec, piece.region, f"{dirname}/{OPTIM_FILE}", slot.data_offset + offset * 4, values, hashed)
        return written

    def write(self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], prepared: Any = None) -> None:
        if not spec.is_optimizer:
            return super().write(spec, slab, data, pieces, prepared)
        self.restore(prepared)

    def restore(self, facts: list[Any]) -> None:
        """The rank files' facts to LegacyWriter; a distrib_optim.pt part's: `[tag, chain, dp_group_idx, gbuf_idx, state,
        byte offset, length, CRC-32]`."""
        super().restore([fact for fact in facts if fact[0] != _TAG])
        for fact in (fact for fact in facts if fact[0] == _TAG):
            chain, group, index, key, offset, length, crc = fact[1:]
            self._parts[(Gbuf(chain, group, index), key)][offset] = (length, crc)
            self._facts.append(fact)

    def sync(self) -> None:
        super().sync()
        for stream in self._optim.values():
            stream.sync()

    def part(self) -> list[Any]:
        facts = super().part()
        if self.rank != 0:
            for stream in self._optim.values():
                stream.close()
        return facts

    def finish(self, manifest: Manifest, parts: list[Any] | None = None) -> None:
        """Zeros into each buffer's alignment gaps, every record sealed with its whole CRC-32, each distrib_optim.pt
        pickled; then the rank files, manifest and tracker (LegacyWriter's), last."""
        for part in parts or []:
            self.restore(part)
        for (gbuf, key), written in self._parts.items():
            slot, dirname = self._records[(gbuf, key)], self._dirname(gbuf.chain, gbuf.group)
            nbytes = sum(self.buffer_layout.buffers[gbuf].sizes) * 4
            at = 0
            for offset, (length, _) in [*sorted(written.items()), (nbytes, (0, 0))]:
                if offset > at:  # a gap: at most an alignment's 63 elements
                    zeros = np.zeros(offset - at, np.uint8)
                    self._optim[dirname].write_part(slot, at, zeros)
                    written[at] = (zeros.nbytes, crc32(zeros))
                at = max(at, offset + length)
            self._optim[dirname].seal(slot, crc32_of_parts(written, nbytes, f"{dirname}/{OPTIM_FILE} {gbuf} {key}"))
        for dirname, stream in self._optim.items():
            stream.finish(self._states[dirname])
        super().finish(manifest, None)
