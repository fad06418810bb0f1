"""What every checkpoint format provides: a reader of logical tensors and a writer of target pieces."""

from __future__ import annotations

import abc
import functools
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from reshard.cache import cached
from reshard.checksum import Checksum, HashedParts, TensorChecksum
from reshard.config import ModelConfig
from reshard.documents import read_json
from reshard.dtypes import numpy_dtype
from reshard.layout import Layout
from reshard.logical import TensorSpec
from reshard.records import StoredRecord
from reshard.sharding import Piece, Region, pieces, region_size, slabs
from reshard.torchfile.archive_reader import READ_BLOCK
from reshard.torchfile.pickles import named

if TYPE_CHECKING:  # reshard.optim builds on this module
    from reshard.optim.sink import OptimizerOutput
    from reshard.optim.state import OptimizerRefusal, OptimizerState

MANIFEST_NAME = "reshard_manifest.json"
_DEFAULTS = Path(__file__).with_name("megatron_lm_args.json")  # fixtures/golden/make_golden.py --only mlm-args
_GPT = named("megatron.core.enums", "ModelType")(1)  # ModelType.encoder_or_decoder, as Megatron-LM's GPT args hold it
def precision_args(dtype: str) -> dict[str, Any]:
    """The Megatron-LM arguments that say a model's parameters are in `dtype`."""
    return {"params_dtype": named("torch", dtype), "bf16": dtype == "bfloat16", "fp16": dtype == "float16"}


@functools.cache
def _megatron_lm_table() -> dict[str, Any]:
    return json.loads(_DEFAULTS.read_text())


def _from_json(value: Any) -> Any:
    """A default of the table as the args pickle holds it: a torch dtype or an enum as its stand-in."""
    if isinstance(value, dict):
        if "__named__" in value:
            return named(*value["__named__"].rsplit(".", 1))
        module, qualname = value["__call__"].rsplit(".", 1)
        return named(module, qualname)(*value["args"])
    return value


def megatron_lm_defaults() -> dict[str, Any]:
    """Megatron-LM's complete argument set as its checkpoints carry it (megatron_lm_args.json): its parse_args
    defaults, less what its validate_args deletes, with the values validate_args sets whatever the model; what
    validate_args derives from the model or layout (the table's `derived`) is `args_for_layout`'s to set."""
    table = _megatron_lm_table()
    out = {k: _from_json(v) for k, v in table["defaults"].items() if k not in table["deleted"]}
    out.update({k: _from_json(v) for k, v in table["validated"].items()})
    return out


def args_for_layout(args: dict[str, Any], layout: Layout, config: ModelConfig, ckpt_format: str) -> dict[str, Any]:
    """Megatron-LM's complete argument set for the target: its defaults, the model's values over them, the
    source's args over those, then the layout's values and the arguments Megatron-LM derives from them."""
    out = megatron_lm_defaults()
    out.update(config.megatron_args())
    out.update(args)
    for key in _megatron_lm_table()["deleted"]:  # validate_args deletes them (a source's args may still hold them)
        out.pop(key, None)
    out.update(layout.megatron_args(), padded_vocab_size=config.padded_vocab_size, ckpt_format=ckpt_format)
    out.update(precision_args(config.params_dtype))
    if out.get("seq_length") is None:
        out["seq_length"] = config.max_position_embeddings
    out["encoder_seq_length"] = out["seq_length"]
    out["group_query_attention"] = config.num_query_groups is not None
    out["num_query_groups"] = config.groups
    out["encoder_num_layers"] = config.num_layers
    out["transformer_pipeline_model_parallel_size"] = layout.pp
    out["use_dist_ckpt"] = ckpt_format != "torch"  # as Megatron-LM's validate_args sets it
    out.setdefault("model_type", _GPT)
    if out.get("micro_batch_size") is None:  # Megatron-LM's validate_args requires one, as its converters do
        out["micro_batch_size"] = 1
    # as Megatron-LM's validate_args derives them
    if out["bf16"] and not out.get("grad_reduce_in_bf16"):
        out["accumulate_allreduce_grads_in_fp32"] = True
    if not out["add_bias_linear"]:
        out["bias_gelu_fusion"] = False
    for key in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        out.setdefault(key, 0)
    # the smallest world that holds the layout (as Megatron-LM's own converter writes: one data-parallel replica)
    out["world_size"] = math.lcm(layout.tp, layout.ep * layout.expert_tp) * layout.pp
    out["data_parallel_size"] = out["world_size"] // (layout.tp * layout.pp)
    if out.get("global_batch_size") is None:
        out["global_batch_size"] = out["micro_batch_size"] * out["data_parallel_size"]
    return out


class LazyObjects(Mapping[str, Any]):
    """Objects by key, each loaded on first access: opening a checkpoint only to plan, inspect or verify it
    reads none of them (a MoE checkpoint has one per expert and layer)."""

    def __init__(self, keys: Iterable[str], load: Callable[[str], Any]):
        self._keys = dict.fromkeys(keys)  # in order, and found at once
        self._load = load
        self._values: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return cached(self._values, key, lambda: self._load(key))

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@dataclass
class CommonState:
    """Everything in a checkpoint that is not a sharded tensor (Megatron's common.pt)."""

    args: dict[str, Any] = field(default_factory=dict)
    iteration: int | str = 0  # or "release"
    extra: dict[str, Any] = field(default_factory=dict)  # checkpoint_version, opt_param_scheduler, ...
    # per-module state by layout-free key (naming.ObjectKey); a reader may load values on access (LazyObjects)
    objects: dict[str, Any] | LazyObjects = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # non-tensor state not carried, said out loud
    integrity: bool = False  # Megatron-LM's integrity.json was there: a torch_dist copy gets one of its own


@dataclass
class Manifest:
    """What reshard records next to every checkpoint it writes."""

    format: str
    config: ModelConfig | None  # None: written from a checkpoint that records no architecture
    layout: Layout
    checksums: dict[str, Checksum]
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "config": self.config.to_dict() if self.config else None,
            "layout": self.layout.__dict__,
            "checksums": {k: v.to_json() for k, v in sorted(self.checksums.items())},
            "provenance": self.provenance,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        return cls(
            format=data["format"],
            config=ModelConfig.from_dict(data["config"]) if data["config"] is not None else None,
            layout=Layout(**data["layout"]),
            checksums={k: Checksum.from_json(v) for k, v in data["checksums"].items()},
            provenance=data.get("provenance", {}),
        )

    def save(self, directory: Path) -> None:
        (directory / MANIFEST_NAME).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, directory: Path) -> Manifest | None:
        path = directory / MANIFEST_NAME
        return cls.from_json(read_json(path)) if path.exists() else None


class CheckpointReader(abc.ABC):
    """A checkpoint seen as logical tensors: `specs` says what exists, `read` returns any region."""

    format_name: ClassVar[str]
    path: Path
    config: ModelConfig | None  # None only where opened without an architecture (`open_checkpoint`)
    layout: Layout  # the layout it was saved at (Layout() for layout-free formats)
    specs: dict[str, TensorSpec]
    common: CommonState
    manifest: Manifest | None  # checksums recorded when it was written, if any
    optimizer: OptimizerState | None = None  # the optimizer state it decodes from the form stored (`reshard.optim.state`)
    unsupported_optimizer: list[str] = []  # stored keys of optimizer state it does not read (a form that cannot be resharded)
    optimizer_refusal: OptimizerRefusal | None = None  # why a decoder refused the optimizer state it found
    default_dtype: str | None = None  # what a conversion told no dtype writes (None: each tensor's own)
    # what to do where it records no architecture and a conversion needs one (`plan`)
    architecture_hint: str = "pass --config with the model's HF config.json or a YAML of its Megatron arguments"
    # where the tokenizer files (`hf.TOKENIZER_FILES`) it was trained with lie, if anywhere: the trainer saves
    # tokenizer.json beside its iterations, and a run resumed without it would train another (other token ids)
    tokenizer_dir: Path | None = None
    tokenizer_in_iteration: bool = False  # there, in the iteration: Megatron-LM 0.18's tokenizer assets (`megatron_tree`)
    # the buffer each reading thread stages a strided record in, at most (every reader reads records by RecordFile)
    scratch_bytes: ClassVar[int] = READ_BLOCK
    # the bytes its files hold of the model, where the logical tensors' do not tell (fp8 blocks); None: theirs
    stored_bytes: int | None = None

    def read(self, name: str, region: Region) -> np.ndarray:
        """The values of `region` of logical tensor `name`, as a new array (`reshard.dtypes.to_torch` makes
        it a tensor)."""
        out = np.empty([b - a for a, b in region], dtype=numpy_dtype(self.specs[name].dtype))
        self.read_into(name, region, out)
        return out

    def read_into(self, name: str, region: Region, out: np.ndarray) -> None:
        """Fill `out` (shaped like `region`) with its values. Readers implement this or `read`; those that
        can place bytes straight into `out` implement this, which saves the conversion a copy."""
        out[...] = self.read(name, region)

    def prefetch(self, name: str, region: Region) -> None:
        """A hint that `region` of tensor `name` is read next (after the regions hinted before it): a reader
        may start finding it (reading headers) in the background. Nothing is read into memory that counts."""

    def stored_regions(self, name: str) -> list[Region]:
        """Regions that cover tensor `name` once, each no larger than a slab: by default its slabs; a reader
        of a chunked format gives its chunks, in file order, so that each is read back in one piece."""
        return list(slabs(self.specs[name]))

    def stored_records(self, name: str) -> list[StoredRecord] | None:
        """Where tensor `name`'s records lie, found from the metadata and record headers on disk (not the
        values); None for a format whose values are not stored as plain records (the default)."""
        return None

    def close(self) -> None:
        """Release file handles."""

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class WriteOptions:
    """How a writer spells its output, beyond the tensors, layout and common state it is given."""

    te_names: bool | None = None  # Megatron: Transformer-Engine or local-spec names (None: the source's transformer_impl)
    dtype: str | None = None  # the precision recorded for the model (HF config.json's dtype; None: its tensors')
    max_shard_bytes: int | None = None  # HF: the largest safetensors file (None: the writer's default)
    # the source's tokenizer files' directory (`CheckpointReader.tokenizer_dir`): the HF writer copies them before it
    # records its files' digests; for other formats the conversion copies them
    tokenizer_from: Path | None = None
    tokenizer_in_iteration: bool = False  # the source kept them in its iteration: a Megatron copy keeps them in its own
    fp8_blocks: bool = False  # HF: the decoder's linear weights re-quantized to fp8 per block (`reshard.fp8_blocks`)
    mxfp4: bool = False  # HF: the experts' weights re-quantized to MXFP4 as the family is released (`reshard.mxfp4`)
    optimizer: OptimizerOutput | None = None  # the form the optimizer tensors are written in (`reshard.optim.forms`)


class CheckpointWriter(abc.ABC):
    """Writes a checkpoint from slabs of logical tensors, cutting them into the target's pieces. Every
    writer can continue a partial output after a kill (`facts`, `restore`) and take one rank's share of a
    multi-rank conversion (`rank`, `part`)."""

    format_name: ClassVar[str]
    # Megatron's loader insists on an `_extra_state` entry per module; a writer of its formats gets empty ones
    # when the source has none
    needs_extra_state: ClassVar[bool] = False

    def __init__(
        self,
        path: Path,
        config: ModelConfig,
        layout: Layout,
        specs: dict[str, TensorSpec],
        common: CommonState,
        options: WriteOptions = WriteOptions(),
        rank: int = 0,  # of a multi-rank conversion, whose ranks each write their own files
    ):
        self.path = path
        self.config = config
        self.layout = layout
        self.specs = specs
        self.common = common
        self.options = options
        self.rank = rank
        self._written: dict[StoredRecord, TensorChecksum] = {}
        self._facts: list[Any] = []  # see `facts`

    def tokenizer_home(self) -> Path:
        """Where the conversion copies the source's tokenizer files (the HF writer copies them itself)."""
        return self.path

    @classmethod
    def whole_regions(cls, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> list[Region]:
        """Regions of `slab` that must reach the writer in one call: a conversion may cut a large slab into
        units (`reshard.plan.UNIT_BYTES`), never through one of them. By default the slab stays whole;
        below, `slab` names whichever unit the writer is given."""
        return [slab]

    def reserve(self, spec: TensorSpec, slab: Region, pieces: list[Piece]) -> Any:
        """Called in plan order before the slab is read: a writer may plan where its bytes go, so that
        `prepare` can write them from a reader thread, in any order."""
        return None

    def prepare(
        self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], reserved: Any = None, hashed: HashedParts | None = None
    ) -> Any:
        """Work on a slab that a reader thread can do before `write` gets it (it receives the result), so
        that the one thread writing does only the writing. `reserved` is what `reserve` returned; `hashed`,
        `data`'s checksums by part (see `vouch`)."""
        return None

    def stored_dtype(self, spec: TensorSpec) -> str | None:
        """None where the writer stores the values of tensor `spec` it is given. A writer that stores others
        (fp8 blocks) says the dtype its output's reader gives them in, and its `prepare` returns their
        TensorChecksum, which counts as written instead of the given values'."""
        return None

    @abc.abstractmethod
    def write(self, spec: TensorSpec, slab: Region, data: np.ndarray, pieces: list[Piece], prepared: Any = None) -> None:
        """Store `data` (the values of `slab`); `pieces` are the target pieces that lie in that slab."""

    @classmethod
    def file_bytes(cls, moves: Iterable[tuple[TensorSpec, int]], config: ModelConfig | None, layout: Layout) -> dict[str, int]:
        """Bytes each file (or group of files) of the output receives of these tensors, given with their
        itemsizes: by default each rank's, a piece stored once by its primary holder."""
        per_rank: Counter[str] = Counter()
        for spec, size in moves:
            for piece in pieces(spec, config, layout):
                if piece.primary or cls.stores_replicas:
                    per_rank[piece.rank.legacy_dirname(layout)] += region_size(piece.region) * size
        return dict(sorted(per_rank.items()))

    stores_replicas: ClassVar[bool] = False  # every rank's file holds its copy of a replicated piece

    def facts(self, start: int = 0) -> list[Any]:
        """The writer's state (what `restore` needs to continue after the last finished tensor) as a list
        of JSON-able facts, in the order `write` learnt them, from the `start`th on. Facts are only ever
        added, so the work log keeps each tensor's new ones, not the whole state again per tensor (which
        grew as tensors x records). Taken between writes, with everything written so far handed to the OS."""
        return self._facts[start:]

    def sync(self) -> None:
        """Make the bytes handed to the OS durable. Called from another thread while writing goes on."""

    def held_for(self, names: list[str]) -> int:
        """Bytes a restored partial output holds for tensors `names`, which writing them again removes
        first (a resumed run's free-space check counts them as free). None here: records past the last
        finished tensor are cut away by `restore`, or written again in place."""
        return 0

    @abc.abstractmethod
    def restore(self, facts: list[Any]) -> None:
        """Continue after `facts` (an earlier run's, or another rank's at `finish`), taking them as its own."""

    @abc.abstractmethod
    def part(self) -> Any:
        """Close this process's files and return what rank 0's `finish` needs of them (multi-rank runs)."""

    def written_records(self) -> dict[StoredRecord, TensorChecksum]:
        """The records this writer has handed to the OS, with the checksums of their bytes as written, for
        a verification that re-reads where the values lie but not the values (see `verify.compute_checksums`);
        empty for a writer that does not keep them."""
        return dict(self._written)

    def vouch(
        self, spec: TensorSpec, region: Region, file: str, offset: int, values: np.ndarray, hashed: HashedParts | None = None
    ) -> None:
        """Keep the checksum of region `region` of `spec` as written: `values` are its bytes as they went
        to `file` (relative to the iteration directory), starting at `offset`; when they are the memory of
        one of the `hashed` parts, its checksum counts. Reader threads call it."""
        part = hashed.checksum_of(region, values) if hashed is not None else None
        if part is None:
            part = TensorChecksum(spec.shape, spec.dtype, self.config.vocab_rows if spec.vocab and self.config else None)
            part.add(region, values)
        self._written[StoredRecord(spec.name, region, spec.dtype, file, offset)] = part

    def before_finish(self) -> None:
        """Called once every tensor is written, while the last bytes go to the disk: a writer may start
        what `finish` will need (in another thread: the caller goes on to wait for the disk)."""

    @abc.abstractmethod
    def finish(self, manifest: Manifest, parts: list[Any] | None = None) -> None:
        """Write metadata last, so a checkpoint without it is recognisably incomplete. In a multi-rank
        run rank 0 calls it with every rank's `part()`, its own included."""
