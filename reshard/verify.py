"""Checksums of a whole checkpoint, recomputed region by region as it is stored, and their comparison."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from reshard.buffers import Pool
from reshard.checksum import Checksum, TensorChecksum
from reshard.dtypes import itemsize, numpy_dtype
from reshard.errors import ReshardError
from reshard.formats.base import CheckpointReader, StoredRecord
from reshard.logical import TensorSpec
from reshard.pipeline import ordered_map
from reshard.plan import UNIT_BYTES
from reshard.sharding import Region, bands, region_size, split_by_slab


def compute_checksums(
    reader: CheckpointReader,
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
    names: Iterable[str] | None = None,
    pool: Pool | None = None,
    written: dict[StoredRecord, TensorChecksum] | None = None,
    vocab_rows: int | None = None,
) -> dict[str, Checksum]:
    """Layout-invariant checksums of every logical tensor, reading one stored region (a chunk, or a slab)
    at a time per worker. Buffers come from `pool` (a conversion passes the one its writing used, already
    faulted in).

    `written` (a conversion's `CheckpointWriter.written_records`) spares reading back the values of a
    record the reader finds, from the metadata and headers on disk, exactly where the writer put it, with
    the same tensor, region and dtype: its checksum as written counts instead. Every other record, and
    every record of a format that cannot say where its values lie, is read back.

    Vocabulary tensors count their first `vocab_rows` rows (default: the reader's true vocabulary; every row
    where it opened without an architecture), so that checksums ignore padding."""
    pool = pool or Pool()
    if vocab_rows is None and reader.config is not None:
        vocab_rows = reader.config.vocab_rows

    def content(spec: TensorSpec) -> int | None:
        return vocab_rows if spec.vocab else None

    def hash_region(job: tuple[TensorSpec, Region]) -> tuple[str, TensorChecksum, int]:
        spec, region = job
        data = pool.array([b - a for a, b in region], numpy_dtype(spec.dtype))
        try:
            reader.read_into(spec.name, region, data)
            part = TensorChecksum(spec.shape, spec.dtype, content(spec))
            part.add(region, data)
        finally:
            pool.give(data)
        return spec.name, part, data.nbytes

    wanted = sorted(reader.specs if names is None else names)
    sums = {name: TensorChecksum(reader.specs[name].shape, reader.specs[name].dtype, content(reader.specs[name])) for name in wanted}

    def to_read(name: str) -> Iterator[Region]:
        records = reader.stored_records(name) if written else None
        if records is None:
            yield from reader.stored_regions(name)
            return
        for record in records:
            part = written.get(record)
            if part is None:
                yield from split_by_slab(reader.specs[name], record.region)
            else:  # a record listed twice counts twice, and the coverage check below refuses it
                sums[name].merge(part)

    def in_units(name: str) -> Iterator[Region]:
        """What `to_read` gives, a large region in bands of about UNIT_BYTES (the sum does not care)."""
        spec = reader.specs[name]
        for region in to_read(name):
            nbytes = region_size(region) * itemsize(spec.dtype)
            yield from bands(region, -(-nbytes // UNIT_BYTES))

    jobs = ((reader.specs[name], region) for name in wanted for region in in_units(name))
    for name, part, size in ordered_map(hash_region, jobs, workers, 2 * workers):
        sums[name].merge(part)
        if progress:
            progress(size)
    for name, acc in sums.items():  # a missing chunk of zeros would not change the sum
        if not acc.complete:
            raise ReshardError(f"{name}: the checkpoint's pieces do not cover the tensor exactly once; it is incomplete or damaged")
    return {name: acc.result() for name, acc in sorted(sums.items())}


@dataclass
class Comparison:
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # in the reference, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the reference
    dtype_differs: list[str] = field(default_factory=list)
    matched: int = 0

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.missing or self.unexpected or self.dtype_differs)

    def summary(self) -> str:
        parts = []
        for label, names in (
            ("differ", self.mismatched),
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("have another dtype", self.dtype_differs),
        ):
            if names:
                parts.append(f"{len(names)} tensor(s) {label} (first: {names[0]})")
        return "; ".join(parts) if parts else f"all {self.matched} tensors match"

    def raise_if_bad(self, message: str) -> None:
        if not self.ok:
            raise ReshardError(f"{message}: {self.summary()}")


def compare(
    actual: dict[str, Checksum],
    reference: dict[str, Checksum],
    actual_label: str = "checkpoint",
    reference_label: str = "reference",
    *,
    subset: bool = False,
) -> Comparison:
    """Compare digests and dtypes (shapes may differ only by vocabulary padding, which digests ignore).

    With `subset`, names the reference lacks are not reported (e.g. when optimizer state was dropped).
    """
    result = Comparison()
    for name in sorted(set(actual) | set(reference)):
        if name not in reference:
            if not subset:
                result.unexpected.append(name)
        elif name not in actual:
            if not subset:
                result.missing.append(name)
        elif actual[name].dtype != reference[name].dtype:
            result.dtype_differs.append(name)
        elif actual[name].digest != reference[name].digest:
            result.mismatched.append(name)
        else:
            result.matched += 1
    return result


@dataclass
class VerifyReport:
    comparison: Comparison
    reference_label: str

    def to_json(self) -> dict:
        c = self.comparison
        return {
            "ok": c.ok,
            "reference": self.reference_label,
            "matched": c.matched,
            "mismatched": c.mismatched,
            "missing": c.missing,
            "unexpected": c.unexpected,
            "dtype_differs": c.dtype_differs,
        }


def verify(path, against=None, config_file=None) -> VerifyReport:
    """Recompute `path`'s checksums; compare with its recorded ones, or with checkpoint `against`.
    `config_file` gives the architecture of a `path` that records none; none is needed (the tensors are
    global), but without one the vocabulary's padding counts unless `against` knows the true size."""
    from reshard.formats import open_checkpoint
    from reshard.inspect import screen_objects

    with open_checkpoint(path, config_file=config_file, need_architecture=False) as reader:
        screen_objects(reader)
        if against is None:
            if reader.manifest is None:
                raise ReshardError(f"{path} has no recorded checksums; compare it with another checkpoint using --against")
            return VerifyReport(compare(compute_checksums(reader), reader.manifest.checksums, str(path), "recorded"),
                                "against the checksums recorded at save")
        with open_checkpoint(against, need_architecture=False) as other:
            screen_objects(other)
            rows = None  # each side's own true vocabulary, where it knows it; else the other's tells both
            if (reader.config is None) != (other.config is None):
                rows = (reader.config or other.config).vocab_rows
            actual = compute_checksums(reader, vocab_rows=rows)
            reference = compute_checksums(other, vocab_rows=rows)
    label = f"against {against}"
    # An HF export or a --no-optimizer copy holds no optimizer state: compare the model then.
    if not any(spec_is_optimizer(n) for n in actual) or not any(spec_is_optimizer(n) for n in reference):
        actual = {n: c for n, c in actual.items() if not spec_is_optimizer(n)}
        reference = {n: c for n, c in reference.items() if not spec_is_optimizer(n)}
        label += " (model tensors; one side has no optimizer state)"
    return VerifyReport(compare(actual, reference, str(path), str(against)), label)


def spec_is_optimizer(name: str) -> bool:
    return name.startswith("optimizer.")
