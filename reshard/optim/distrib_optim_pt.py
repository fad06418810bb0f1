"""Megatron's DistributedOptimizer state in the legacy format (`--ckpt-format torch`): beside each
`mp_rank_*/model_optim_rng.pt`, the `distrib_optim.pt` that megatron-core's `save_parameter_state` writes and its
`load_parameter_state` reads, bound to the saving run's TP/PP and data-parallel size. Read (`DistribOptimFiles`,
the legacy reader's optimizer state) and written (`DistribOptimPtSink`, which the legacy writer composes) for the
target TP/PP and data-parallel size (`--to-dp`, default the source's).

Per model-parallel rank, `{"buckets_coalesced": True, <gbuf idx>: {(<param dtype>, <grad dtype>): {"param",
"exp_avg", "exp_avg_sq" (Lion's: no exp_avg_sq): fp32 1-D, "numel_unpadded": int}}}`: each buffer's buckets laid end to end without their
end padding, the 64-element alignment gaps between parameters zero (megatron-core 0.16's
`get_parameter_state_dp_zero`). Where each parameter lies is `buffers.BufferLayout`'s derivation
(`Buffer.coalesced_start`), so what is written here decodes back by the same rules. The rank file's `optimizer`
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

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from isal.isal_zlib import crc32

from reshard.cache import cached
from reshard.checksum import HashedParts
from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.layout import Layout
from reshard.logical import TensorSpec
from reshard.optim.buffers import DENSE_CHAIN, BufferLayout, Gbuf, Placed, flat_span
from reshard.optim.common import fully_reshardable_common, param_groups
from reshard.optim.sink import OptimizerSink
from reshard.optim.state import OptimizerState, StoredForm, check_states
from reshard.paths import confined
from reshard.records import StoredRecord
from reshard.sharding import Piece, Region, pieces, shift, to_slices
from reshard.torchfile.archive_reader import RecordFile, TensorRecord, archive_tensor
from reshard.torchfile.archive_writer import Slot, StreamingTorchSave
from reshard.torchfile.crc32 import crc32_of_parts
from reshard.torchfile.payloads import load_screened

OPTIM_FILE = "distrib_optim.pt"
_TAG = "distrib_optim"  # marks this sink's facts among the rank files'
# what keeps a piece's checksum as written: (spec, region, file, offset, values, hashed), `CheckpointWriter.vouch`
Vouch = Callable[[TensorSpec, Region, str, int, np.ndarray, "HashedParts | None"], None]


class DistribOptimFiles(OptimizerState):
    """The DistributedOptimizer's `distrib_optim.pt` of every model-parallel rank, read as the logical optimizer
    tensors of Megatron's fully_reshardable form (`optimizer.state.<param|exp_avg|exp_avg_sq>.<model key>`).

    megatron-core's `save_parameter_state` (0.16: `get_parameter_state_dp_zero`) gathers the buffers on DP rank 0,
    which writes `{"buckets_coalesced": True, <gbuf_idx>: {(param dtype, grad dtype): {"param"|"exp_avg"|
    "exp_avg_sq": 1-D float32 tensor, "numel_unpadded": n}}}`: each buffer's buckets end to end without their
    padding. Where a parameter lies comes from `BufferLayout` (its bucket's start in that tensor: the unpadded
    lengths of the buckets before it); every length must agree with the derived layout. Refused by name: the older
    per-bucket layout (no `buckets_coalesced`).

    An MoE model's ChainedOptimizer writes the list of its optimizers' states `[dense, experts]`, each written by
    that optimizer's DP rank 0 (None in the other files; `BufferLayout.holder` names its file, at any expert TP): the
    dense state in the EP rank 0 file of each TP/PP rank where ETP = TP, the experts' in every EP rank's file; the rank
    files' `optimizer` entry is the list of their `state_dict()`s."""

    from_buffers = True

    def __init__(
        self,
        directory: Path,  # the iteration directory, holding the rank directories
        rank_file: Path,  # the first rank's file, whose `optimizer` entry is the DistributedOptimizer's state_dict()
        saved_optimizer: Any,  # that entry
        model_specs: dict[str, TensorSpec],
        config: ModelConfig,
        layout: Layout,
        args: dict[str, Any],
    ):
        self.buffer_layout = BufferLayout(model_specs, config, layout, args)
        chains = self.buffer_layout.chains  # [None] or [dense, experts]
        chained = chains != [None]
        saved = saved_optimizer if chained and isinstance(saved_optimizer, list) else [saved_optimizer]
        if not (len(saved) == len(chains) and all(isinstance(s, dict) and isinstance(s.get("optimizer"), dict) for s in saved)):
            raise ReshardError(
                f"{rank_file} holds no DistributedOptimizer state_dict{' per chained optimizer' if chained else ''} beside "
                f"{OPTIM_FILE} (its `optimizer` entry is {type(saved_optimizer).__name__}): the checkpoint is damaged"
            )
        self.param_groups = {chain: s["optimizer"] for chain, s in zip(chains, saved)}
        self.specs = self.buffer_layout.optimizer_specs()
        self.paths: dict[tuple[int | None, int], Path] = {}  # (chain, dp_group_idx) -> the file holding its state
        self.records: dict[tuple[int | None, int, int, str], TensorRecord] = {}  # (chain, dp_group_idx, gbuf_idx, state) -> tensor
        self.names: dict[tuple[int | None, int], str] = {}  # the same, relative to the iteration directory
        self._files: dict[Path, RecordFile] = {}
        loaded: dict[Path, Any] = {}
        for chain, group in self.buffer_layout.optimizers():
            dirname = self.buffer_layout.holder(chain, group).legacy_dirname(layout)
            path = self.paths[(chain, group)] = confined(directory, f"{dirname}/{OPTIM_FILE}")  # may not lead out of it
            self.names[(chain, group)] = f"{dirname}/{OPTIM_FILE}"
            if not path.is_file():
                raise ReshardError(f"{path} is missing beside the first rank's: the checkpoint is incomplete")
            state = cached(loaded, path, lambda p=path: load_screened(p, str(p)))
            if chain is not None:
                if not (isinstance(state, list) and len(state) == 2):
                    raise ReshardError(f"{path} does not hold the states of an MoE model's two chained optimizers: the file is foreign or damaged")
                state = state[chain]
            self._index(chain, group, state)

    def _index(self, chain: int | None, group: int, state: Any) -> None:
        path = self.paths[(chain, group)]
        which = "" if chain is None else f" ({'dense' if chain == DENSE_CHAIN else 'expert'} optimizer)"
        if not isinstance(state, dict):
            raise ReshardError(f"{path} does not hold one DistributedOptimizer's parameter state{which}: the file is foreign or damaged")
        if state.get("buckets_coalesced") is not True:
            raise ReshardError(
                f"{path} holds the older per-bucket layout of distrib_optim.pt (no buckets_coalesced), which reshard does not "
                "decode: load and save it once with a newer megatron-core, or convert with --no-optimizer"
            )
        gbufs = self.buffer_layout.rank_buffers(chain, group)
        found = [k for k in state if k != "buckets_coalesced"]
        if found != list(range(len(gbufs))):
            raise ReshardError(
                f"{path} holds buffers {[str(k) for k in found]}{which} where the layout derived from the model has "
                f"{len(gbufs)}: the optimizer state cannot be decoded safely"
            )
        for gbuf in gbufs:
            by_dtype = state[gbuf.index]
            if not (isinstance(by_dtype, dict) and len(by_dtype) == 1 and isinstance(next(iter(by_dtype.values())), dict)):
                raise ReshardError(f"{path}: buffer {gbuf.index}{which} is not one buffer of one dtype: not decoded yet")
            tensors = next(iter(by_dtype.values()))
            buffer = self.buffer_layout.buffers[gbuf]
            derived = sum(buffer.sizes)
            check_states(self.buffer_layout.args, set(tensors) - {"numel_unpadded"}, f"{path}: buffer {gbuf.index}{which}")
            for key in self.buffer_layout.state_keys:
                record = archive_tensor(tensors.get(key))
                if record is None or record.dtype != "float32" or record.shape != (derived,) or tensors.get("numel_unpadded") != derived:
                    stored = "no tensor" if record is None else f"{record.dtype} {record.shape}"
                    raise ReshardError(
                        f"{buffer.last[-1]}: the DistributedOptimizer layout derived from the model makes buffer {gbuf.index}{which} of "
                        f"{path} {derived} elements long, but it records numel_unpadded {tensors.get('numel_unpadded')!r} and "
                        f"stores {key} as {stored}; the optimizer state cannot be decoded safely"
                    )
                self.records[(chain, group, gbuf.index, key)] = record

    def _read_place(self, gbuf: Gbuf, place: Placed, state: str, first: int, out: np.ndarray) -> None:
        path = self.paths[(gbuf.chain, gbuf.group)]
        file = cached(self._files, path, lambda: RecordFile(path))
        start = self.buffer_layout.buffers[gbuf].coalesced_start(place) + first
        file.read_into(self.records[(gbuf.chain, gbuf.group, gbuf.index, state)], ((start, start + out.size),), out)

    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        self.buffer_layout.read_into(name, region, out, self._read_place)

    def stored_records(self, name: str) -> list[StoredRecord] | None:
        """Each primary piece of logical tensor `name` where its file places it as one run (what a conversion's
        writer vouches for, so that verifying it need not read the values back); None where one is not one run."""
        state, model_name = name.split(".", 3)[2:]
        model = self.buffer_layout.model_specs[model_name]
        records = []
        for piece in pieces(model, self.buffer_layout.config, self.buffer_layout.layout):
            if not piece.primary or piece.alias is not None:
                continue
            gbuf, place = self.buffer_layout.place_of(model, piece)
            span = flat_span(piece)
            record = self.records[(gbuf.chain, gbuf.group, gbuf.index, state)]
            if span is None or record.offset < 0:
                return None
            start = self.buffer_layout.buffers[gbuf].coalesced_start(place) + span[0]
            records.append(StoredRecord(name, piece.region, "float32", self.names[(gbuf.chain, gbuf.group)], record.offset + start * record.itemsize))
        return records

    @property
    def form(self) -> StoredForm:
        buckets = sum(len(buffer.sizes) for buffer in self.buffer_layout.buffers.values())
        return StoredForm(OPTIM_FILE, self.buffer_layout.dp, buckets, len(self.paths))

    @property
    def described(self) -> str:
        return f"{OPTIM_FILE} buffers (DP {self.buffer_layout.dp})"

    def common(self, extra: dict[str, Any]) -> dict[str, Any]:
        return dict(extra, optimizer=fully_reshardable_common(self.param_groups))

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()


class DistribOptimPtSink(OptimizerSink):
    """The optimizer tensors' pieces of legacy output, written into each model-parallel rank's `distrib_optim.pt`
    (the legacy writer routes them here, and these files' facts among its own)."""

    written_as = f"to {OPTIM_FILE}"

    def __init__(
        self, specs: dict[str, TensorSpec], config: ModelConfig, layout: Layout, args: dict[str, Any], objects: Mapping[str, Any],
        extra: dict[str, Any], dp: int, directory: Path,  # the iteration directory, holding the rank directories
    ):
        super().__init__(specs, config, layout, args, objects, extra, dp)
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
                for key in self.buffer_layout.state_keys:
                    tensors[key] = (slot := stream.reserve((numel,), "float32")).stub
                    self._records[(gbuf, key)], self._parts[(gbuf, key)] = slot, {}
                state[gbuf.index] = {self.dtype_key: {**tensors, "numel_unpadded": numel}}
            if chain is None:
                self._states[dirname] = state
            else:
                self._states.setdefault(dirname, [None] * len(chains))[chain] = state
        groups = param_groups(extra["optimizer"], chains != [None])  # the forms table checked they are there
        saved = {"optimizer": groups[None]} if chains == [None] else [{"optimizer": groups[chain]} for chain in chains]
        self.extra = {**extra, "optimizer": saved}

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
