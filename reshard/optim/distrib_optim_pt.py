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

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from isal.isal_zlib import crc32

from reshard.checksum import HashedParts
from reshard.config import ModelConfig
from reshard.layout import Layout
from reshard.logical import TensorSpec
from reshard.optim.buffers import STATE_KEYS, Gbuf
from reshard.optim.common import param_groups
from reshard.optim.sink import OptimizerSink
from reshard.sharding import Piece, Region, shift, to_slices
from reshard.torchfile.archive_writer import Slot, StreamingTorchSave
from reshard.torchfile.crc32 import crc32_of_parts

if TYPE_CHECKING:
    from reshard.formats.base import CommonState

OPTIM_FILE = "distrib_optim.pt"
_TAG = "distrib_optim"  # marks this sink's facts among the rank files'
# what keeps a piece's checksum as written: (spec, region, file, offset, values, hashed), `CheckpointWriter.vouch`
Vouch = Callable[[TensorSpec, Region, str, int, np.ndarray, "HashedParts | None"], None]


class DistribOptimPtSink(OptimizerSink):
    """The optimizer tensors' pieces of legacy output, written into each model-parallel rank's `distrib_optim.pt`
    (the legacy writer routes them here, and these files' facts among its own)."""

    written_as = f"to {OPTIM_FILE}"

    def __init__(
        self, specs: dict[str, TensorSpec], config: ModelConfig, layout: Layout, args: dict[str, Any], common: CommonState, dp: int,
        directory: Path,  # the iteration directory, holding the rank directories
    ):
        super().__init__(specs, config, layout, args, common, dp)
        chains = self.buffer_layout.chains  # [None] or [dense, experts]
        self._optim: dict[str, StreamingTorchSave] = {}  # rank directory -> its distrib_optim.pt
        self._records: dict[tuple[Gbuf, str], Slot] = {}  # (buffer, state) -> its record
        self._parts: dict[tuple[Gbuf, str], dict[int, tuple[int, int]]] = {}  # -> {byte offset: (length, CRC-32)}
        self._states: dict[str, Any] = {}  # rank directory -> what its file pickles: one optimizer's state, or the chain's
        for chain, group in self.buffer_layout.optimizers():
            dirname = self._dirname(chain, group)
            stream = self._optim.setdefault(dirname, StreamingTorchSave(directory / dirname / OPTIM_FILE))
            state: dict[Any, Any] = {"buckets_coalesced": True}
            for gbuf in self.buffer_layout.rank_buffers(chain, group):
                numel = sum(self.buffer_layout.buffers[gbuf].sizes)
                tensors: dict[str, Any] = {}
                for key in STATE_KEYS:
                    tensors[key] = (slot := stream.reserve((numel,), "float32")).stub
                    self._records[(gbuf, key)], self._parts[(gbuf, key)] = slot, {}
                state[gbuf.index] = {self.dtype_key: {**tensors, "numel_unpadded": numel}}
            if chain is None:
                self._states[dirname] = state
            else:
                self._states.setdefault(dirname, [None] * len(chains))[chain] = state
        groups = param_groups(common.extra["optimizer"], chains != [None])  # the forms table checked they are there
        saved = {"optimizer": groups[None]} if chains == [None] else [{"optimizer": groups[chain]} for chain in chains]
        self.common = replace(common, extra={**common.extra, "optimizer": saved})

    def _dirname(self, chain: int | None, group: int) -> str:
        return self.buffer_layout.holder(chain, group).legacy_dirname(self.layout)

    def reserve(self, spec: TensorSpec, pieces: list[Piece]) -> list[tuple[tuple[Gbuf, str], int]]:
        """The record each piece with a place of its own goes to, and its element offset there."""
        places = []
        for piece in self.own_pieces(spec, pieces):
            gbuf, place, first = self.place(spec, piece)
            places.append(((gbuf, spec.name.split(".")[2]), self.buffer_layout.buffers[gbuf].coalesced_start(place) + first))
        return places

    def prepare(
        self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], reserved: Any, hashed: HashedParts | None, vouch: Vouch
    ) -> list[list[Any]]:
        """Each piece flattened (row-major, as its rank's parameter is) into its place; the written parts and their
        CRC-32s, as facts for `restore`. The checksums of the copies the reader decodes (primary pieces) are vouched for
        as written, where the reader finds them (`DistribOptimFiles.stored_records`)."""
        written = []
        for piece, ((gbuf, key), offset) in zip(self.own_pieces(spec, pieces), reserved, strict=True):
            flat = np.ascontiguousarray(data[to_slices(shift(piece.region, slab))], dtype=np.float32).reshape(-1)
            slot, dirname = self._records[(gbuf, key)], self._dirname(gbuf.chain, gbuf.group)
            self._optim[dirname].write_part(slot, offset * 4, flat)
            written.append([_TAG, gbuf.chain, gbuf.group, gbuf.index, key, offset * 4, flat.nbytes, crc32(memoryview(flat).cast("B"))])
            if piece.primary and piece.alias is None:
                values = flat.reshape([b - a for a, b in piece.region])
                vouch(spec, piece.region, f"{dirname}/{OPTIM_FILE}", slot.data_offset + offset * 4, values, hashed)
        return written

    @staticmethod
    def owns(fact: list[Any]) -> bool:
        """Whether a fact of the legacy writer's log is this sink's."""
        return fact[0] == _TAG

    def restore(self, facts: list[list[Any]]) -> None:
        """Take the parts `facts` name as written: each `[tag, chain, dp_group_idx, gbuf_idx, state, byte offset, length,
        CRC-32]`."""
        for fact in facts:
            chain, group, index, key, offset, length, crc = fact[1:]
            self._parts[(Gbuf(chain, group, index), key)][offset] = (length, crc)

    def sync(self) -> None:
        for stream in self._optim.values():
            stream.sync()

    def close(self) -> None:
        for stream in self._optim.values():
            stream.close()

    def finish(self) -> None:
        """Zeros into each buffer's alignment gaps, every record sealed with its whole CRC-32, each distrib_optim.pt
        pickled."""
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
