"""`convert`: a conversion as one transaction: plan, stream into a temporary sibling (resuming an
interrupted run), verify what was written, then rename it into place. One pipeline for a single process
and for the ranks of a multi-rank conversion (`reshard.collective`)."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from reshard import lora
from reshard.atomic import aside, foreign, link_inside, put_back, replace_dir, unlike_ours
from reshard.buffers import Pool
from reshard.checksum import Checksum
from reshard.collective import Collective, joined, shares
from reshard.errors import KeepsPartial, ReshardError
from reshard.formats import detect, open_checkpoint
from reshard.formats.base import CheckpointReader, CheckpointWriter, Manifest
from reshard.formats.config_only import ConfigOnlyReader, is_config_file
from reshard.formats.hf import copy_tokenizer
from reshard.optim import master_weights
from reshard.plan import ConversionPlan, human_bytes, make_plan
from reshard.request import Run, SourceHints, Target
from reshard.streaming import Progress, manifest_for, write_moves
from reshard.verify import compare, compute_checksums
from reshard.worklog import Done, Recorder, Resumed, WorkLog, fingerprint


@dataclass
class ConversionResult:
    plan: ConversionPlan | None  # None for a PEFT adapter, which moves no model tensors (`lora.write_peft`)
    manifest: Manifest | None  # None for a dry run
    seconds: float


def partial_path(target: Path) -> Path:
    """Where a conversion writes until its output verifies: a hidden sibling of the target, by a fixed
    name, so that running the same command again finds it (and resumes or clears it)."""
    return target.with_name(f".{target.name}.reshard-partial")


def check_free_space(partial: Path, target: Path, needed: int, resuming: bool, freed: int = 0) -> None:
    """Refuse up front what cannot fit, instead of failing with a full disk after writing most of it. The
    tensors' bytes alone (as the files hold them, legacy's copies included) are counted: headers and
    metadata add little, so nothing that fits is refused; an old destination given to --overwrite is
    removed only after, so it still takes its space.
    `freed`: what a resumed run's partial output holds that writing the rest removes first (see
    `CheckpointWriter.held_for`). A resumed run's refusal keeps what it had converted."""
    stats = os.statvfs(partial)
    free = stats.f_frsize * (stats.f_bfree if os.geteuid() == 0 else stats.f_bavail) + freed  # root may use the reserve
    if needed > free:
        again = "run the same command again (it resumes)" if resuming else "run the same command again"
        raise (KeepsPartial if resuming else ReshardError)(
            f"not enough free space for {target}: the conversion writes {human_bytes(needed)} more and "
            f"{human_bytes(free)} is free there; free space and {again}, choose another destination, or pass "
            "--no-space-check if this filesystem misreports its free space"
        )


_NOT_A_FILE = {errno.ELOOP: "a symbolic link", errno.EISDIR: "not a plain file"}  # what opening it says, with O_NOFOLLOW


class DestinationLock:
    """Held by the process that writes a destination, from the first check to the last rename: a second
    conversion into the same destination (or its partial output) is refused instead of interleaving with
    it. An flock on a hidden file beside the destination, removed on release; a lock taken on a file that
    a releasing holder had just removed is not kept (the path must still name the locked file)."""

    def __init__(self, target: Path):
        self.path = target.with_name(f".{target.name}.reshard-lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                target = self.path.name.removeprefix(".").removesuffix(".reshard-lock")
                raise ReshardError(
                    f"{self.path.with_name(target)} is being written by another reshard convert ({holder}); "
                    "wait for it to finish or choose another destination"
                ) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
                self.fd = fd
                return
            os.close(fd)

    def _open(self) -> int:
        """The lock file, made or taken over without following a link (`O_NOFOLLOW`), and only as a plain file
        of this user's that no other name shares: its contents are rewritten, which must not reach anything else."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno not in _NOT_A_FILE:
                raise
            raise not_ours(self.path, _NOT_A_FILE[exc.errno]) from None
        why = unlike_ours(os.fstat(fd))
        if why is not None:
            os.close(fd)
            raise not_ours(self.path, why)
        return fd

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def not_ours(path: Path, why: str) -> ReshardError:
    """The refusal of a sibling reshard would make or take over (`atomic.foreign`) that it did not make."""
    return ReshardError(f"{path} is {why}: reshard did not leave it there; remove it, or choose another destination")


def _prepare_destination(target: Path, overwrite: bool, lock: DestinationLock) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as exc:  # not a directory, read-only, no permission: nothing was written
        raise ReshardError(f"cannot write {target}: {exc.strerror} ({exc.filename}); choose another destination") from None
    partial = partial_path(target)
    why = foreign(partial, directory=True)
    link = link_inside(partial) if why is None and partial.is_dir() else None
    if why is not None or link is not None:  # resumed or cleared, it would be written through
        raise not_ours(partial, why) if link is None else not_ours(link, "a symbolic link in the partial output")
    put_back(target, partial)  # a run stopped between the two renames of `replace_dir`: the old checkpoint goes back
    if os.path.lexists(aside(target)) and os.path.lexists(target):  # replacing `target` could move it onto this
        raise not_ours(aside(target), foreign(aside(target), directory=True) or "a directory reshard has not put back")
    if target.exists() and not target.is_dir():
        raise ReshardError(f"{target} exists and is a file; choose another destination")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ReshardError(f"{target} exists and is not empty; pass --overwrite to replace it or choose another destination")


def _start_over(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def transact(
    reader: CheckpointReader, plan: ConversionPlan, overwrite: bool, run: Run, progress: Progress | None, team: Collective
) -> Manifest:
    """Write the plan into a partial sibling of `plan.target`, verify everything written against the
    source, then move it into place; each rank of `team` converts its share of the tensors (all of them
    when alone) into files of its own, and rank 0 writes the metadata last, only after every rank has
    reported its pieces and checksums.

    Each rank logs its finished tensors in the partial output: the same command run again (with as many
    ranks) resumes where a killed or crashed run stopped; anything else about the partial output starts
    it over. A refusal removes the partial output; a stop that keeps it (`KeepsPartial`) or a crash does not."""
    lock = DestinationLock(plan.target)
    try:
        return _transact(reader, plan, overwrite, run, progress, team, lock)
    finally:
        lock.release()


def _transact(
    reader: CheckpointReader,
    plan: ConversionPlan,
    overwrite: bool,
    run: Run,
    progress: Progress | None,
    team: Collective,
    lock: DestinationLock,
) -> Manifest:
    step = _Transaction(reader, plan, run, team)
    first = lambda action: (lambda: action() if team.rank == 0 else None)  # noqa: E731 (a step only rank 0 takes)
    team.together(first(lambda: _prepare_destination(plan.target, overwrite, lock)))  # a refusal leaves a partial output be
    try:
        resuming = all(team.together(step.read_log))  # every rank's log, or none
        if not resuming:
            team.together(first(lambda: _start_over(step.tmp)))
        team.together(lambda: step.open(resuming))
        sizes = team.together(lambda: step.sizes(resuming))
        if run.check_space:
            needed, freed = (sum(column) for column in zip(*sizes))
            team.together(first(lambda: check_free_space(step.tmp, plan.target, needed, resuming, freed)))
        results = team.together(lambda: step.write(progress))
        written = {k: v for _, w, _ in results for k, v in w.items()}
        manifest = manifest_for(plan, written)
        team.together(first(lambda: step.finish(manifest, results)))
        rechecked = {k: v for part in team.together(step.check) for k, v in part.items()}
        mismatch = "the written checkpoint does not match the source"
        team.together(lambda: compare(rechecked, written, "written", "source").raise_if_bad(mismatch))
        team.together(step.log.remove)  # only now: a run stopped while verifying resumes at `finish`, not from the start
        team.together(first(lambda: replace_dir(step.tmp, plan.target)))
    except ReshardError as exc:
        if team.rank == 0 and not isinstance(exc, KeepsPartial):  # a refusal: nothing worth resuming
            shutil.rmtree(step.tmp, ignore_errors=True)
        raise  # interrupted or crashed: the partial directory stays, and the same command resumes it
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise KeepsPartial(
            f"the disk holding {plan.target} is full ({exc.strerror}); free space and run the same command again "
            "(it resumes), or choose another destination"
        ) from exc
    return manifest


class _Transaction:
    """One rank's part of `transact`, step by step; what a step leaves for the next stays here (a writer,
    a log) rather than being gathered."""

    def __init__(self, reader: CheckpointReader, plan: ConversionPlan, run: Run, team: Collective):
        self.reader, self.plan, self.run, self.rank = reader, plan, run, team.rank
        self.tmp = partial_path(plan.target)
        self.here = replace(plan, target=self.tmp)
        self.share = shares(plan.moves, team.size)[team.rank]
        self.log = WorkLog(self.tmp, fingerprint(plan), team.rank, team.size)
        self.found: Resumed | None = None
        self.pool = Pool()  # slab buffers, reused by the verification pass
        self.writer: CheckpointWriter  # from `open` on
        self.done: list[Done] = []  # tensors an earlier run finished
        self.mine = self.here  # what is left to write: `open` says

    def read_log(self) -> bool:
        """Whether this rank's log of the same conversion is there."""
        self.found = self.log.resume() if self.tmp.is_dir() else None
        return self.found is not None

    def open(self, resuming: bool) -> None:
        """The writer, back at this rank's last logged tensor when resuming (before its first: none of its
        files); what is left to write."""
        if not resuming:
            self.found = None
            self.log.start()
        self.writer = self.here.new_writer(self.rank)
        self.done = self.found.done if self.found else []
        if self.found:
            self.writer.restore(self.found.facts)
        finished = {d.name for d in self.done}
        self.mine = replace(self.here, moves=[m for m in self.share if m.target.name not in finished])

    def sizes(self, resuming: bool) -> tuple[int, int]:
        """Bytes this rank has left to write, and what its partial output holds that writing them frees."""
        return self.mine.bytes_stored, self.writer.held_for([m.target.name for m in self.mine.moves]) if resuming else 0

    def write(self, progress: Progress | None) -> tuple[Any, dict[str, Checksum], dict[str, Checksum]]:
        """Stream what is left; this rank's part for `finish`, and the checksums of its tensors as written
        and as read (an earlier run's from the log)."""
        recorder = Recorder(self.log, self.writer)
        try:
            written, as_read = write_moves(
                self.reader, self.mine, self.writer, progress if self.rank == 0 else None, self.run.workers,
                finished=recorder, pool=self.pool,
            )
            if self.rank == 0:
                self.writer.before_finish()  # while the log's last entries wait for the disk
        finally:
            recorder.close()
        written.update({d.name: d.written for d in self.done})
        as_read.update({d.name: d.read for d in self.done})
        return self.writer.part(), written, as_read

    def finish(self, manifest: Manifest, results: list[tuple[Any, dict[str, Checksum], dict[str, Checksum]]]) -> None:
        """Rank 0: the source as read against its recorded checksums, then the metadata, from every rank's part."""
        if self.reader.manifest is not None:
            as_read = {k: v for _, _, r in results for k, v in r.items()}
            compare(as_read, self.reader.manifest.checksums, "source as read", "source's recorded checksums", subset=True).raise_if_bad(
                f"{self.plan.source} does not match the checksums recorded when it was written"
            )
        self.writer.finish(manifest, [part for part, _, _ in results])
        if self.plan.target_format != "hf":  # the HF writer copies them itself, before it records its files' digests
            home = self.writer.tokenizer_home()
            home.mkdir(exist_ok=True)
            copy_tokenizer(self.plan.options.tokenizer_from, home)

    def check(self) -> dict[str, Checksum]:
        """This rank's share of the output opened as any checkpoint is, its checksums recomputed (records
        this run's writer vouches for by their placement, unless `run.reread`)."""
        hash_workers = self.plan.hash_workers()
        self.pool.shrink(hash_workers)
        with open_checkpoint(self.tmp, self.plan.target_format, need_architecture=self.plan.config is not None) as written_back:
            records = None if self.run.reread else self.writer.written_records()  # an earlier run's tensors are read back
            names = [m.target.name for m in self.share]
            return compute_checksums(written_back, workers=hash_workers, names=names, pool=self.pool, written=records)


def convert(
    source: Path | str,
    destination: Path | str,
    target: Target = Target(),
    *,
    hints: SourceHints = SourceHints(),
    run: Run = Run(),
    overwrite: bool = False,
    dry_run: bool = False,
    planned: Callable[[ConversionPlan], None] | None = None,
    progress: Progress | None = None,
) -> ConversionResult:
    """Convert `source` into `destination` as `target` says (by default: the source's format and layout),
    with what the user knows of the source in `hints`, run as `run` says.

    Nothing is written at `destination` unless the whole output verifies against the source's checksums:
    the output is opened as any checkpoint is, and each tensor's checksum is recomputed from what it holds.
    Where the writer can vouch for a record that the metadata on disk puts exactly where it wrote it, the
    checksum of its bytes as written counts and its values are not read back; `run.reread` reads back every
    value regardless (what `reshard verify` always does). An existing, non-empty destination is replaced
    only with `overwrite`, and only once the new output verifies.

    Under a launcher (torchrun: RANK and WORLD_SIZE set) the ranks share the work (see `transact`).
    `planned`, if given, is called with the plan before any byte moves; `progress` is then called with the
    bytes of each unit written, which add up to `plan.bytes_moved` (less what a resumed run finds done).
    """
    start = time.perf_counter()
    source, destination = Path(source), Path(destination)
    if destination.is_symlink():  # replace what the link names, and keep the link
        destination = destination.resolve()
    src, dst = source.resolve(), destination.resolve()
    if src == dst:
        raise ReshardError("source and destination are the same directory; choose another destination")
    # Replacing a destination that holds the source would delete it; writing into the source changes it.
    if src.is_relative_to(dst):
        raise ReshardError(f"{destination} contains the source {source}; choose a destination outside it")
    if dst.is_relative_to(src):
        raise ReshardError(f"{destination} is inside the source {source}; choose a destination outside it")
    with _open_source(source, hints, dry_run) as reader:
        if target.format == "peft":
            return _peft(reader, destination, hints, overwrite, dry_run, start)
        for key in ("tp", "pp", "ep"):
            expected, actual = getattr(hints, key), getattr(reader.layout, key)
            if expected is not None and actual != expected:
                raise ReshardError(f"{source} is saved at {key.upper()}={actual}, not {expected}; fix --{key} or drop it")
        if hints.vocab_size is not None:
            _set_vocab_size(reader, hints.vocab_size)
        plan = make_plan(reader, destination, target, run)
        if planned:
            planned(plan)
        if dry_run:
            return ConversionResult(plan, None, time.perf_counter() - start)
        with joined() as team:
            master_weights.check(reader, plan.moves, team)
            manifest = transact(reader, plan, overwrite, run, progress, team)
    return ConversionResult(plan, manifest, time.perf_counter() - start)


def _open_source(source: Path, hints: SourceHints, dry_run: bool) -> CheckpointReader:
    """The source checkpoint; a config.json alone for a dry run, which plans from it (`formats.config_only`)."""
    if not is_config_file(source):
        # a LoRA save is Bridge's torch_dist (asked of that format only: another's tracker need not name an iter_*)
        adapter = lora.lora_config(source) if source.is_dir() and detect(source) == "torch_dist" else None
        if adapter is not None:
            return _merged(source, hints, adapter)
        if hints.base is not None:
            raise ReshardError(f"--base is for a LoRA adapter save; {source} is none (no peft section in its run_config.yaml): drop it")
        # a checkpoint that records no architecture still converts as global tensors (`plan` refuses the rest)
        reader = open_checkpoint(source, config_file=hints.config, need_architecture=False)
        if any(name.endswith(lora.SWIFT.a) for name in reader.specs):  # its args.json, which says so, is gone
            reader.close()
            raise ReshardError(f"{source} holds ms-swift's LoRA adapter weights but not the args.json of its run, which gives their rank, "
                               "alpha and TP: put args.json back beside its iter_* directory and give the base model with --base")
        return reader
    if not dry_run:
        raise ReshardError(f"{source} is a config.json without weights: pass --dry-run to see the plan, or give the model's directory")
    if hints.config is not None:
        raise ReshardError(f"{source} is the model's config.json already: drop --config")
    return ConfigOnlyReader(source)


def _peft(reader: CheckpointReader, destination: Path, hints: SourceHints, overwrite: bool, dry_run: bool, start: float) -> ConversionResult:
    """A LoRA adapter save written as a PEFT adapter for its base's HF model (`lora.write_peft`)."""
    if not isinstance(reader, lora.MergedReader):
        raise ReshardError(f"--to-format peft writes a LoRA adapter: {reader.path} is a whole model, not an adapter save with --base")
    if dry_run:
        raise ReshardError("--dry-run plans a conversion of tensors; a PEFT adapter export has none to plan: drop --dry-run")
    lora.write_peft(reader, destination, hints.base, overwrite)
    return ConversionResult(None, None, time.perf_counter() - start)


def _merged(source: Path, hints: SourceHints, adapter: lora.LoraConfig) -> CheckpointReader:
    """A LoRA adapter save merged into the base model `hints.base` names."""
    if hints.base is None:
        raise ReshardError(f"{source} is a LoRA adapter save (adapter weights only): give the model it adapts with --base (HF or Megatron)")
    base = open_checkpoint(hints.base, config_file=hints.config)
    opened = [base]
    try:
        opened.append(open_checkpoint(source, need_architecture=False))  # ms-swift's records none: the base's is the one merged into
        return lora.MergedReader(base, opened[1], adapter)
    except BaseException:  # a refused adapter leaves no file open (a library caller goes on)
        for reader in opened:
            reader.close()
        raise


def _set_vocab_size(reader: CheckpointReader, vocab_size: int) -> None:
    if reader.config is None:
        raise ReshardError(f"{reader.path} records no architecture for --vocab-size to complete: pass --config with the model's "
                           "HF config.json or a YAML of its Megatron arguments instead")
    if reader.config.vocab_size not in (None, vocab_size):
        raise ReshardError(f"{reader.path} records a vocabulary of {reader.config.vocab_size}; --vocab-size {vocab_size} "
                           "contradicts it: drop --vocab-size")
    if vocab_size > reader.config.padded_vocab_size:
        raise ReshardError(f"--vocab-size {vocab_size} exceeds the checkpoint's {reader.config.padded_vocab_size} embedding rows")
    reader.config = reader.config.replace(vocab_size=vocab_size)
