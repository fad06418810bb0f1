"""What a conversion will do, computed before any byte moves (`reshard convert --dry-run` prints it)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from reshard.checksum import CHECKSUM_BLOCK_BYTES
from reshard.config import ModelConfig
from reshard.dtypes import itemsize
from reshard.errors import ReshardError
from reshard.formats import WRITERS, NemoRlWriter, writer_for
from reshard.formats.base import CheckpointReader, CheckpointWriter, CommonState, WriteOptions, precision_args
from reshard.layout import Layout
from reshard.logical import OPTIMIZER_PREFIX, TensorSpec
from reshard.naming import default_extra_state, is_layout_bound, uses_te_names
from reshard.optim import forms
from reshard.optim.state import check_states, described, other_kind
from reshard.request import Run, Target
from reshard.sharding import Piece, Region, contiguous_offset, intersect, pieces, pieces_by_slab, region_size, shift, slab_of, slabs, units


def worker_overhead(slab_bytes: int, scratch_bytes: int) -> int:
    """A worker's reused buffers besides its slab: a strided record read (at most the reader's
    `scratch_bytes`), the checksum's float64 block (at most 1 MiB: 4 bytes per byte hashed), small ones."""
    return min(scratch_bytes, slab_bytes) + min(CHECKSUM_BLOCK_BYTES, 4 * slab_bytes) + (1 << 20)


# A slab at least twice this large is read and hashed in bands by helper threads: the slab of a tensor
# that is not stacked per layer (a 128k vocabulary's embedding is 0.5-2 GiB) would otherwise stream
# in one thread while the others wait.
BAND_BYTES = 64 << 20
# A larger slab is cut into units of work of at most this size wherever its target's records allow
# (`CheckpointWriter.whole_regions`): memory then follows the target's pieces, not the model's width.
UNIT_BYTES = 64 << 20


def reading_threads(workers: int, largest_unit_bytes: int) -> int:
    """Threads that read and hash during a conversion: the workers, and as many helpers when some slab
    is large enough to be read in bands."""
    return 2 * workers if workers > 1 and largest_unit_bytes >= 2 * BAND_BYTES else workers


def default_budget(largest_unit_bytes: int, workers: int) -> int:
    """The slab being written and its staged pieces, plus room to read ahead: a unit per worker, at least
    256 MiB, at most an eighth of RAM. With a fixed 256 MiB, 8 workers on 16 cores kept too few units in
    flight to keep busy; more than a unit each gained nothing (benchmarks/README.md, "Measurements behind defaults")."""
    read_ahead = max(256 << 20, workers * UNIT_BYTES)
    return 2 * largest_unit_bytes + min(read_ahead, psutil.virtual_memory().total // 8)


@dataclass(frozen=True)
class TensorMove:
    """One logical tensor: read from `source` (its spec in the source), written as `target`."""

    source: TensorSpec
    target: TensorSpec
    # Every record the target writes is a chunk the source stores (an EP or PP reshard regroups them):
    # a record is then read, hashed and written in one piece, in a unit of its own (`ConversionPlan.units`).
    aligned: bool = False

    @property
    def bytes(self) -> int:
        return self.target.numel * itemsize(self.target.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element of a unit's buffers (the source's dtype is read, the target's written)."""
        return max(itemsize(self.source.dtype), itemsize(self.target.dtype))


@dataclass(frozen=True)
class Unit:
    """One unit of work: a slab or a part of one, with the target pieces inside it and the regions its
    writer records whole there (`CheckpointWriter.whole_regions`)."""

    region: Region
    pieces: list[Piece]
    records: list[Region]

    def runs(self) -> list[Region] | None:
        """The records in memory order, if each is one contiguous run of the unit's buffer and together
        they tile it (each byte in exactly one); None otherwise (some record is strided there)."""
        shape = [b - a for a, b in self.region]
        starts = []
        for region in self.records:
            start = contiguous_offset(shape, shift(region, self.region))
            if start is None:
                return None
            starts.append((start, region))
        starts.sort()
        ends = [start + region_size(region) for start, region in starts]
        if [start for start, _ in starts] != [0, *ends[:-1]] or ends[-1:] != [region_size(self.region)]:
            return None
        return [region for _, region in starts]

    def by_record(self) -> list[Unit] | None:
        """The unit cut into one unit per record region (with the pieces inside each), if the regions cover
        it once (disjoint, and as large together as it); ranks that each write the same region (a
        replicated tensor in the legacy format) share its unit."""
        regions = list(dict.fromkeys(self.records))
        if sum(map(region_size, regions)) != region_size(self.region):
            return None
        if any(intersect(a, b) is not None for i, a in enumerate(regions) for b in regions[i + 1 :]):
            return None
        return [Unit(region, [p for p in self.pieces if intersect(p.region, region) == p.region], [region]) for region in regions]


@dataclass
class ConversionPlan:
    source: Path
    source_format: str
    source_layout: Layout
    target: Path
    writer: type[CheckpointWriter]  # the target format's
    target_layout: Layout
    config: ModelConfig | None  # the target's (padded vocabulary follows the target TP); None: not recorded (global tensors only)
    moves: list[TensorMove]
    common: CommonState  # what the target carries besides tensors
    options: WriteOptions = WriteOptions()
    dropped: list[str] = field(default_factory=list)
    workers: int = 1
    max_memory: int = 0  # bytes of working memory; make_plan fills in the default
    scratch_bytes: int = 0  # the source reader's staging buffer per reading thread
    bytes_read: int = 0  # what the source's files hold of the tensors moved (`CheckpointReader.stored_bytes`)

    @property
    def target_format(self) -> str:
        return self.writer.format_name

    @property
    def optimizer_forms(self) -> tuple[str, str] | None:
        """The optimizer state's form as read and as written, if carried."""
        optimizer = self.options.optimizer
        return None if optimizer is None else (optimizer.read, optimizer.written)

    def new_writer(self, rank: int = 0) -> CheckpointWriter:
        """The target's writer, for this process's share (`rank`) of the plan."""
        return self.writer(self.target, self.config, self.target_layout, {m.target.name: m.target for m in self.moves},
                           self.common, self.options, rank)

    @property
    def bytes_moved(self) -> int:
        return sum(m.bytes for m in self.moves)

    @property
    def bytes_stored(self) -> int:
        """What the target's files hold of these tensors: `bytes_moved`, and the copies legacy keeps (a
        dense tensor in every EP rank's file, a norm in every TP rank's)."""
        return sum(self.target_files().values())

    def units(self, move: TensorMove, first_slab_only: bool = False) -> Iterator[Unit]:
        """The move's units of work in order: its slabs, a large one cut where the target's writer allows
        (every piece it writes lies in one of its whole regions)."""
        optimizer = self.options.optimizer
        # optimizer state in a buffer form is written where its sink places it
        writer = optimizer.form.sink if optimizer is not None and optimizer.form.sink and move.target.is_optimizer else self.writer
        by_slab = pieces_by_slab(pieces(move.target, self.config, self.target_layout), move.target)
        for slab in slabs(move.target):
            slab_pieces = by_slab.get(slab_of(move.target, slab), [])
            whole = writer.whole_regions(move.target, slab, slab_pieces)
            for region in units(slab, whole, UNIT_BYTES // move.itemsize):
                inside = [p for p in slab_pieces if intersect(p.region, region) == p.region]
                unit = Unit(region, inside, [r for r in whole if intersect(r, region) == r])
                # records strided in the unit, but each one chunk of the source: read into a buffer of
                # its own, a record needs no staging on either side and is hashed once
                cut = unit.by_record() if move.aligned and len(unit.records) > 1 and unit.runs() is None else None
                yield from cut or [unit]
            if first_slab_only:
                return

    def largest_unit(self) -> tuple[TensorMove | None, int]:
        """The move with the largest unit of work, and that unit's bytes (every slab of a tensor is cut
        alike, so its first slab tells)."""
        sizes = [(max(region_size(u.region) for u in self.units(m, first_slab_only=True)) * m.itemsize, i) for i, m in enumerate(self.moves)]
        size, index = max(sizes, default=(0, -1))
        return (self.moves[index] if index >= 0 else None), size

    @property
    def largest_unit_bytes(self) -> int:
        """Bytes of the largest unit of work: what one reader holds at a time."""
        return self.largest_unit()[1]

    def read_ahead(self, workers: int | None = None) -> int:
        """Bytes of slabs the workers may read ahead of the writer: the budget less the slab being written,
        its staged pieces and the workers' buffers. 0 means one slab at a time, in this thread."""
        workers = self.workers if workers is None else workers
        if workers <= 1:
            return 0
        largest = self.largest_unit_bytes
        return max(0, self.max_memory - 2 * largest - reading_threads(workers, largest) * self.worker_overhead(largest))

    def hash_workers(self) -> int:
        """Threads for the read-back verification within the budget: each holds one slab and its buffers."""
        largest = self.largest_unit_bytes
        return max(1, min(self.workers, self.max_memory // max(1, largest + self.worker_overhead(largest))))

    def worker_overhead(self, slab_bytes: int) -> int:
        return worker_overhead(slab_bytes, self.scratch_bytes)

    @property
    def peak_memory(self) -> int:
        """Estimated working memory: the slabs read ahead, the one being written and its staged pieces,
        and the buffers of each thread reading."""
        largest = self.largest_unit_bytes
        ahead = self.read_ahead()
        return 2 * largest + ahead + self.worker_overhead(largest) * (reading_threads(self.workers, largest) if ahead else 1)

    def target_files(self) -> dict[str, int]:
        """Bytes each target file (or group of files) receives, as the target's writer stores them."""
        return self.writer.file_bytes([(m.target, itemsize(m.target.dtype)) for m in self.moves], self.config, self.target_layout)

    def seconds_at(self, copy_speed: float) -> float:
        """The least time the conversion can take on a disk that copies `copy_speed` bytes a second (reading
        and writing each byte once, as `cp` does): its bytes read and written at that speed, nothing for
        the work between (benchmarks/README.md measures how far above it conversions run)."""
        return (self.bytes_read + self.bytes_stored) / 2 / copy_speed

    def to_json(self, copy_speed: float | None = None) -> dict[str, Any]:
        estimate = {} if copy_speed is None else {"copy_bytes_per_s": copy_speed, "seconds_at_copy_speed": round(self.seconds_at(copy_speed), 1)}
        return {
            "source": str(self.source),
            "source_format": self.source_format,
            "source_layout": str(self.source_layout),
            "target": str(self.target),
            "target_format": self.target_format,
            "target_layout": str(self.target_layout),
            "tensors": len(self.moves),
            "bytes_moved": self.bytes_moved,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_stored,
            "peak_memory_estimate": self.peak_memory,
            "workers": self.workers,
            "target_files": self.target_files(),
            "dropped": self.dropped,
            "optimizer_forms": self.optimizer_forms,
            **estimate,
            "moves": [
                {"name": m.target.name, "source_shape": list(m.source.shape), "target_shape": list(m.target.shape), "dtype": m.target.dtype}
                for m in self.moves
            ],
        }

    def render(self, copy_speed: float | None = None) -> str:
        """The plan for a reader; `copy_speed` (bytes/s, `reshard.disk_speed`) adds the least time it takes."""
        files = self.target_files()
        lines = [
            f"{self.source} ({self.source_format}, {self.source_layout}) -> {self.target} ({self.target_format}, {self.target_layout})",
            f"{len(self.moves)} tensors, {human_bytes(self.bytes_moved)} to move, estimated peak memory {human_bytes(self.peak_memory)}",
            f"reads {human_bytes(self.bytes_read)}, writes {human_bytes(self.bytes_stored)} in {len(files)} parts (a model-parallel rank's files)",
        ]
        if copy_speed is not None:
            lines.append(f"at least {human_seconds(self.seconds_at(copy_speed))} at this disk's copy speed of {copy_speed / 1e6:.0f} MB/s")
        if len(files) > MAX_LISTED_FILES:
            lines.append(f"  {len(files)} parts of {human_bytes(min(files.values()))} to {human_bytes(max(files.values()))}")
            files = {}
        for name, size in files.items():
            lines.append(f"  {name}: {human_bytes(size)}")
        for move in self.moves:
            if move.source.shape != move.target.shape:
                lines.append(f"  resize {move.target.name}: {list(move.source.shape)} -> {list(move.target.shape)} (vocabulary padding)")
        if self.optimizer_forms:
            optimizer_bytes = sum(m.bytes for m in self.moves if m.target.is_optimizer)
            lines.append(f"optimizer state: {self.optimizer_forms[0]} -> {self.optimizer_forms[1]}, {human_bytes(optimizer_bytes)}; "
                         f"{described(self.common.args)}")
        for name in self.dropped:
            lines.append(f"  drop {name}")
        return "\n".join(lines)


# A plan lists its target's parts (`CheckpointWriter.file_bytes`) one by one up to this many (a 671B model at EP64 has thousands).
MAX_LISTED_FILES = 64


def human_seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def target_config(config: ModelConfig, layout: Layout, source_tp: int) -> ModelConfig:
    """The model config at the target layout: only the vocabulary padding depends on it. Without the true
    vocabulary size the padding stays, which at another TP is right only if it is what Megatron-LM would
    pad to there, a multiple of make_vocab_size_divisible_by x TP: it pads from its tokenizer, and a
    checkpoint with other rows does not load."""
    padded = config.padded_vocab_for(layout.tp)
    multiple = config.make_vocab_size_divisible_by * layout.tp
    if config.vocab_size is None and layout.tp != source_tp and padded % multiple:
        raise ReshardError(
            f"the true vocabulary size is unknown (the checkpoint's args lack vocab_size), and at TP={layout.tp} "
            f"Megatron pads it to a multiple of {multiple}, which the saved {padded} rows are not: pass --vocab-size"
        )
    return config.replace(padded_vocab_size=padded)


def bridge_config(config: ModelConfig, layout: Layout, format_name: str) -> ModelConfig:
    """The target config for Megatron-Bridge, which keeps the true vocabulary rows (`should_pad_vocab: false`)."""
    if format_name != "torch_dist":
        raise ReshardError(f"--for bridge writes torch_dist, the one format Megatron-Bridge loads, not {format_name}")
    if config.vocab_size is None:
        raise ReshardError("--for bridge stores the true vocabulary, which the checkpoint does not record: pass --vocab-size")
    if config.vocab_size % layout.tp:
        raise ReshardError(f"--for bridge: the vocabulary of {config.vocab_size} rows does not split over TP={layout.tp}; choose another TP")
    return config.replace(padded_vocab_size=config.vocab_size)


# Formats that hold a model's tensors whole (global), whatever its architecture: a checkpoint that records none
# converts between them.
GLOBAL_FORMATS = ("torch_dist", "zarr")


def _refuse_what_needs_an_architecture(reader: CheckpointReader, format_name: str, layout: Layout, target: Target) -> None:
    """A checkpoint that records no architecture converts as it is: its global tensors into torch_dist or zarr
    at its own layout. Anything else cuts or renames tensors by the model's shape (QKV by head counts, fc1 by
    its gating, the vocabulary by its true size)."""
    needs = [
        what
        for what, asked in (
            (f"--to-format {format_name}", format_name not in GLOBAL_FORMATS),
            (f"a change of layout (to {layout})", layout != reader.layout),
            ("--dtype", target.dtype is not None),
            ("--for bridge", target.for_bridge),
        )
        if asked
    ]
    if needs:
        # --config completes a torch_dist checkpoint only; a zarr copy of one goes back to torch_dist first
        where = "" if reader.format_name == "torch_dist" else "convert it to torch_dist (no --config needed) and there "
        raise ReshardError(
            f"{reader.path} records no architecture, which {needs[0]} needs (head counts, gating, vocabulary): {where}"
            f"{reader.architecture_hint}"
        )


def _records_are_chunks(plan: ConversionPlan, move: TensorMove, reader: CheckpointReader) -> bool:
    """Whether every record the target writes of `move` is a region the source stores whole, judged by its
    first slab: every slab of a tensor is cut alike (as `largest_unit` assumes), and a wrong answer would
    cost speed, not data (`Unit.by_record` cuts only where the records cover a unit once)."""
    chunks = set(reader.stored_regions(move.source.name))
    return all(set(unit.records) <= chunks for unit in plan.units(move, first_slab_only=True))


def make_plan(reader: CheckpointReader, destination: Path, target: Target = Target(), run: Run = Run()) -> ConversionPlan:
    """What converting `reader` to `destination` as `target` will do. `target.dtype` casts the model's
    tensors as they are written and makes it the target's precision (its args, an HF config's dtype); the
    plan's memory and checksums follow what is written."""
    format_name = target.format or reader.format_name
    if format_name not in WRITERS:
        raise ReshardError(f"unknown format {format_name!r}; choose one of {', '.join(sorted(WRITERS))}")
    for flag, asked in (("--to-fp8-blocks", target.fp8_blocks), ("--to-mxfp4", target.mxfp4)):
        if asked and format_name != "hf":
            raise ReshardError(f"{flag} writes HF safetensors, not {format_name}; add --to-format hf")
    writer = writer_for(reader, target.format)
    if writer is NemoRlWriter:  # a NeMo-RL step holds Megatron-Bridge's save: the vocabulary unpadded, as Bridge loads it
        target = replace(target, for_bridge=True)
    if target.fp8_blocks and target.mxfp4:
        raise ReshardError("--to-fp8-blocks and --to-mxfp4 each say how to quantize the weights: choose one")
    layout = target.layout_for(reader.layout)
    dtype = target.dtype or reader.default_dtype
    config = _target_config(reader, format_name, layout, target, dtype)
    dropped = list(reader.common.dropped)
    moves = _moves(reader, config, target.optimizer, dtype, dropped)
    te_names = None if target.naming is None else target.naming == "te"
    common = _target_common(reader, layout, WRITERS[format_name], target.optimizer, te_names, dropped)
    if target.for_bridge and common.iteration == "release":
        common.iteration = 0
    if dtype is not None:
        common.args.update(precision_args(dtype))
    form = forms.requested(format_name, target)
    optimizer = None
    if any(m.target.is_optimizer for m in moves):
        optimizer = forms.output(form, format_name, reader, {m.target.name: m.target for m in moves}, common, target, layout)
    plan = ConversionPlan(
        source=reader.path,
        source_format=reader.format_name,
        source_layout=reader.layout,
        target=destination,
        writer=writer,
        target_layout=layout,
        config=config,
        moves=moves,
        common=common,
        options=WriteOptions(te_names=te_names, dtype=dtype, max_shard_bytes=target.max_shard_bytes, fp8_blocks=target.fp8_blocks,
                             mxfp4=target.mxfp4, tokenizer_from=reader.tokenizer_dir, tokenizer_in_iteration=reader.tokenizer_in_iteration,
                             optimizer=optimizer),
        dropped=dropped,
        workers=run.workers,
        scratch_bytes=reader.scratch_bytes,
    )
    _budget(plan, reader, run)
    return plan


def _target_config(reader: CheckpointReader, format_name: str, layout: Layout, target: Target, dtype: str | None) -> ModelConfig | None:
    """The model config at the target layout and precision (None: the source records no architecture, which only a
    conversion of its global tensors as they are needs)."""
    if reader.config is None:
        _refuse_what_needs_an_architecture(reader, format_name, layout, target)
        return None
    layout.validate(reader.config)
    config = target_config(reader.config, layout, reader.layout.tp)
    if target.for_bridge:
        config = bridge_config(config, layout, format_name)
    return config if dtype is None else config.replace(params_dtype=dtype)


def _moves(reader: CheckpointReader, config: ModelConfig | None, optimizer: bool, dtype: str | None, dropped: list[str]) -> list[TensorMove]:
    """Every tensor the target carries, at its vocabulary padding and precision (the optimizer state only where
    `optimizer`, and only as it was saved); what it leaves behind is added to `dropped`."""
    unsupported, refused = reader.unsupported_optimizer, reader.optimizer_refusal
    if refused is None and (unsupported or any(spec.is_optimizer for spec in reader.specs.values())):
        refused = other_kind(reader.common.args, reader.path)
    if optimizer and refused is not None:
        raise refused.error()
    if optimizer:  # whatever form it was read from, its moments must be those of the optimizer its args name
        found = {match["state"] for name in reader.specs if (match := OPTIMIZER_PREFIX.match(name))}
        check_states(reader.common.args, found, f"{reader.path}'s optimizer state", complete=False,
                     way_on="; pass --no-optimizer to convert the model without it")
    if optimizer and unsupported:
        raise ReshardError(
            f"the optimizer state ({unsupported[0]}, ...) is stored in a layout-bound form reshard cannot reshard; "
            "pass --no-optimizer to convert the model without it"
        )
    dropped.extend([*unsupported, *([refused.stored] if refused else [])])
    moves = []
    for name, spec in sorted(reader.specs.items()):
        if spec.is_optimizer and not optimizer:
            dropped.append(name)
            continue
        shape = spec.shape
        if spec.vocab and config is not None:
            if config.padded_vocab_size < reader.config.vocab_rows:
                raise ReshardError(f"{name}: the target vocabulary padding would cut real vocabulary rows")
            shape = (config.padded_vocab_size, *shape[1:])
        target_spec = spec.with_shape(shape)
        if dtype is not None and not spec.is_optimizer:  # optimizer state keeps its (fp32) precision
            target_spec = replace(target_spec, dtype=dtype)
        moves.append(TensorMove(spec, target_spec))
    recast = [m for m in moves if m.source.dtype != m.target.dtype]
    if recast and any(m.target.is_optimizer for m in moves):
        raise ReshardError(
            f"--dtype {dtype} changes the model's precision ({recast[0].source.name} is {recast[0].source.dtype}), and "
            "the optimizer state was saved for the old one: pass --no-optimizer"
        )
    if not moves:
        raise ReshardError(f"{reader.path} holds no model tensors")
    return moves


def _budget(plan: ConversionPlan, reader: CheckpointReader, run: Run) -> None:
    """The plan's units of work (records the source stores whole, read as they are), bytes read and memory budget,
    refused where one unit alone does not fit in `--max-memory`."""
    plan.moves = [replace(move, aligned=_records_are_chunks(plan, move, reader)) for move in plan.moves]
    plan.bytes_read = reader.stored_bytes if reader.stored_bytes is not None else sum(m.source.numel * itemsize(m.source.dtype) for m in plan.moves)
    biggest, largest = plan.largest_unit()
    plan.max_memory = default_budget(largest, run.workers) if run.max_memory is None else run.max_memory
    if biggest is not None:
        needed = 2 * largest + plan.worker_overhead(largest)
        if needed > plan.max_memory:
            raise ReshardError(
                f"--max-memory {human_bytes(plan.max_memory)} is too small: one slab (or the part of one written at once) of "
                f"{biggest.target.name} alone takes {human_bytes(largest)}; allow at least {human_bytes(needed)}"
            )


def _same_ranks(a: Layout, b: Layout, config: ModelConfig | None) -> bool:
    if config is None:  # no architecture: only an unchanged layout is planned
        return a == b
    return (a.tp, a.pp, a.ep, a.expert_tp, a.vpp) == (b.tp, b.pp, b.ep, b.expert_tp, b.vpp) and a.stage_layers(
        config.num_layers
    ) == b.stage_layers(config.num_layers)


def _target_common(
    reader: CheckpointReader, layout: Layout, writer: type[CheckpointWriter], optimizer: bool, te_names: bool | None, dropped: list[str]
) -> CommonState:
    """Non-tensor state for the target: layout-bound objects only survive an unchanged layout;
    Megatron targets get the empty `_extra_state` entries Megatron's loader insists on."""
    source = reader.common
    objects = {}
    for key, value in source.objects.items():
        if is_layout_bound(key) and not _same_ranks(reader.layout, layout, reader.config):
            dropped.append(key)
        else:
            objects[key] = value
    # Each module's own where the source has it; an empty one where not: an HF source has none, and Megatron-LM 0.18's
    # --ckpt-drop-redundant-extra-state saves only some, while a run loading without that flag asks for every one.
    # Without an architecture the module names are unknown: the source's own entries are all there is.
    if writer.needs_extra_state and reader.config is not None:
        te = uses_te_names(source.args) if te_names is None else te_names
        objects = {**default_extra_state(reader.config, te), **objects}
    extra = dict(source.extra)
    if not optimizer and "optimizer" in extra:
        dropped.append("optimizer (common part)")
        del extra["optimizer"]
    return CommonState(args=dict(source.args), iteration=source.iteration, extra=extra, objects=objects, dropped=list(source.dropped),
                       integrity=source.integrity)
