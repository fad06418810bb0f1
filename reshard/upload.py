"""`reshard upload`: publish a checkpoint to the Hugging Face Hub as an HF model, only once it verifies, in
commits that a rerun after an interruption resumes.

CHECKPOINT may be any format reshard reads. A Megatron (or zarr) checkpoint is exported first to a staging
directory beside it (`<checkpoint>-hf` unless --staging says otherwise), which records what it was made
from: the same command run again reuses it, after recomputing its checksums, as long as the checkpoint has
not changed since. An HF model written by reshard (it carries reshard_manifest.json) is uploaded as it is,
once its checksums verify. The folder uploaded is never modified.

The upload: every file's sha256 is computed, the repository's files are listed, and only those missing or
different go up, in commits of about `commit_bytes` each (weights first; config.json, the index, the
manifest and the model card last, so that the repository reads as a model only once it is whole). Each
commit uploads its large files through huggingface_hub (Xet where it is installed and the Hub offers it,
the LFS protocol otherwise), whose storage keeps a file uploaded by a commit that never happened: a rerun
commits it without sending it again. At the end the repository's files are listed again and each must have
the sha256 (git hash for small files) of the local one.

huggingface_hub 2.4 has no `upload_large_folder`: its resumable multi-commit upload is `upload_folder` when
`hf_xet` is usable, which needs a Hub that speaks Xet, and a single commit otherwise; the commits here are
resumable whatever the transport.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.checksum import file_sha256
from reshard.errors import ReshardError
from reshard.formats.base import MANIFEST_NAME
from reshard.formats.hf import CONFIG, INDEX, model_files, recorded_digests
from reshard.hub import Access, check_repo_id, progress_bars
from reshard.plan import human_bytes

CARD = "README.md"
RECORD = ".reshard-upload.json"  # in a staging export: the checkpoint it was made from
COMMIT_BYTES = 5 << 30  # about one default HF shard per commit
COMMIT_FILES = 100
LAST = (CONFIG, INDEX, MANIFEST_NAME, CARD)  # committed last, in this order

Report = Callable[[str], None]


@dataclass
class Training:
    """What the checkpoint says of its training, and the loss the run's metrics log gave at its iteration."""

    iteration: int | str | None = None
    consumed_samples: int | None = None
    seq_length: int | None = None
    loss: float | None = None
    metrics: str | None = None  # the log the loss came from

    @property
    def tokens(self) -> int | None:
        return self.consumed_samples * self.seq_length if self.consumed_samples and self.seq_length else None


@dataclass
class UploadResult:
    repo_id: str
    url: str
    files: int  # files the repository holds from this upload's folder (the model card included)
    commit: str | None  # the last commit made (None: nothing was missing)
    folder: Path | None = None  # what was uploaded: the checkpoint itself or its staging export
    exported: bool = False  # whether this run made the export
    committed: list[str] = field(default_factory=list)  # files this run committed
    unverified: list[str] = field(default_factory=list)  # files published that no checksum covers (include_unverified)
    bytes_committed: int = 0
    commits: int = 0


# --------------------------------------------------------------------------------------------- model card

def model_card(path: Path, repo_id: str, training: Training | None = None, files: dict[str, tuple[int, str]] | None = None) -> str:
    """A model card from the export's config.json and reshard_manifest.json, with what the training recorded
    and the sha256 of every file (`files`: name -> (bytes, sha256)). Nothing in it changes between two uploads
    of the same export, so a rerun finds it already there."""
    manifest: dict[str, Any] = json.loads((path / MANIFEST_NAME).read_text())
    config = json.loads((path / CONFIG).read_text()) if (path / CONFIG).is_file() else {}
    prov = manifest.get("provenance", {})
    checksums = manifest.get("checksums", {})
    dtypes: dict[str, int] = {}
    for entry in checksums.values():
        dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + 1
    params = 0
    for entry in checksums.values():
        n = 1
        for d in entry["shape"]:
            n *= d
        params += n
    summary = hashlib.sha256(json.dumps(sorted((k, v.get("digest")) for k, v in checksums.items())).encode()).hexdigest()
    arch = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
    from reshard import __version__

    lines = [
        "---",
        "library_name: transformers",
        "tags:",
        "- reshard",
        "- megatron-core",
        "---",
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        f"{arch} weights converted with {prov.get('tool', 'reshard')}.",
        "",
        "## Provenance",
        "",
        "| | |",
        "| --- | --- |",
        f"| source | `{prov.get('source', '?')}` |",
        f"| source format | {prov.get('source_format', '?')} |",
        f"| source layout | {prov.get('source_layout', '?')} |",
    ]
    if training is not None and training.iteration is not None:
        lines.append(f"| iteration | {training.iteration} |")
    lines += [
        f"| converted | {prov.get('time', '?')} |",
        f"| HF family | {prov.get('hf_family', config.get('model_type', '?'))} |",
        f"| converted with | {prov.get('tool', '?')} |",
        f"| uploaded with | reshard {__version__} |",
    ]
    if training is not None and (training.tokens or training.consumed_samples or training.loss is not None):
        lines += ["", "## Training", "", "| | |", "| --- | --- |"]
        if training.consumed_samples:
            lines.append(f"| samples seen | {training.consumed_samples:,} |")
        if training.tokens:
            lines.append(f"| tokens seen | {training.tokens:,} ({training.consumed_samples:,} samples of {training.seq_length} tokens) |")
        if training.loss is not None:
            lines.append(f"| final training loss | {training.loss:.6g} (iteration {training.iteration}, from `{training.metrics}`) |")
    lines += [
        "",
        "## Checksums",
        "",
        f"{len(checksums)} logical tensors ({params:,} values incl. vocabulary padding as stored in the source), "
        f"dtypes {', '.join(f'{k}: {v}' for k, v in sorted(dtypes.items()))}. Layout-invariant checksums of every "
        f"tensor are in `{MANIFEST_NAME}`; `reshard verify <dir>` recomputes them. They were verified before this upload.",
        f"The sha256 of those checksums, by tensor name, is `{summary}`: the same model in any layout or format has it.",
    ]
    if files:
        lines += ["", "| file | bytes | sha256 |", "| --- | ---: | --- |"]
        lines += [f"| {name} | {size:,} | `{digest}` |" for name, (size, digest) in sorted(files.items())]
    if prov.get("dropped"):
        lines += ["", "Not carried over from the source: " + ", ".join(f"`{d}`" for d in prov["dropped"][:20])]
    return "\n".join(lines) + "\n"


def read_training(reader: Any, metrics: Path | None = None) -> Training:
    """The checkpoint's iteration and data position (the trainer's data_state, or Megatron-LM's
    consumed_train_samples), and with `metrics` (the trainer's --metrics JSON lines) the loss logged at that
    iteration, by the run that saved it: the record's consumed_samples must be the checkpoint's."""
    args = reader.common.args or {}
    data_state = reader.common.extra.get("data_state") if isinstance(reader.common.extra, dict) else None
    consumed = data_state.get("consumed_samples") if isinstance(data_state, dict) else None
    consumed = consumed if consumed is not None else args.get("consumed_train_samples")
    seq = args.get("seq_length")
    training = Training(reader.common.iteration, int(consumed) if consumed else None, int(seq) if seq else None)
    if metrics is not None:
        training.loss = _loss_at(metrics, training)
        training.metrics = metrics.name
    return training


def _loss_at(metrics: Path, training: Training) -> float:
    if not metrics.is_file():
        raise ReshardError(f"{metrics} is not a file; give the JSON-lines log the trainer wrote with --metrics")
    found, last = None, None
    with open(metrics) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise ReshardError(f"{metrics}:{number} is not JSON: give the log the trainer wrote with --metrics") from None
            if not isinstance(record, dict) or "loss" not in record or "iteration" not in record:
                continue  # a checkpoint event, not an iteration
            last = record["iteration"]
            if record["iteration"] == training.iteration:
                found = record  # a resumed run logs an iteration again: the last one is the run that saved it
    if found is None:
        raise ReshardError(f"{metrics} has no loss for iteration {training.iteration} (its last iteration is {last}): "
                           "give the metrics of the run that saved this checkpoint, or leave out --metrics")
    if training.consumed_samples is not None and found.get("consumed_samples") not in (None, training.consumed_samples):
        raise ReshardError(f"{metrics} logs iteration {training.iteration} after {found['consumed_samples']} samples, the "
                           f"checkpoint after {training.consumed_samples}: it is another run's log; leave out --metrics or give the right one")
    return float(found["loss"])


# ------------------------------------------------------------------------------------- what is uploaded

def _fingerprint(checkpoint: Path, dtype: str | None, max_shard_bytes: int | None) -> dict[str, Any]:
    """What the staging export was made from: the checkpoint's files as they are (name, size, mtime), and the
    dtype and shard size asked for. Any change to the checkpoint (a new iteration saved into it) makes
    another export."""
    entries = sorted(
        (p.relative_to(checkpoint).as_posix(), st.st_size, st.st_mtime_ns)
        for p in checkpoint.rglob("*") if p.is_file() for st in [p.stat()]
    )
    digest = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
    return {"source": str(checkpoint.resolve()), "files": digest, "dtype": dtype, "max_shard_bytes": max_shard_bytes}


def default_staging(checkpoint: Path) -> Path:
    return checkpoint.with_name(f"{checkpoint.resolve().name}-hf")


def _made_from(staging: Path, checkpoint: Path) -> bool:
    """Whether `staging` is a reshard HF export of `checkpoint` (an earlier state of it)."""
    try:
        source = json.loads((staging / MANIFEST_NAME).read_text())["provenance"]["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return (staging / CONFIG).is_file() and Path(source).resolve() == checkpoint.resolve()


def prepare(
    path: Path,
    *,
    staging: Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    metrics: Path | None = None,
    workers: int = 1,
    report: Report | None = None,
    check: Callable[[], None] | None = None,
    planned: Callable[[Any], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[Path, Training | None, bool]:
    """The HF folder to upload, verified, with what the training recorded; whether it was exported now.
    `check` runs once the local input is known to be usable and before the long work (the token's check)."""
    from reshard.convert import convert
    from reshard.formats import detect, open_checkpoint
    from reshard.request import Run, Target

    say = report or (lambda _: None)
    fmt = detect(path)
    if fmt == "hf":
        if staging is not None or dtype is not None or max_shard_bytes is not None or metrics is not None:
            raise ReshardError(f"{path} is already an HF model: --staging, --dtype, --max-shard-size and --metrics apply "
                               "to a checkpoint that is exported first; upload it without them")
        if not (path / MANIFEST_NAME).is_file():
            raise ReshardError(f"{path} has no {MANIFEST_NAME}: only reshard exports (whose checksums can be verified) are "
                               f"uploaded; `reshard convert {path} <dir> --to-format hf` makes one")
        if check:
            check()
        _verified(path)
        return path, None, False

    with open_checkpoint(path, fmt) as reader:
        training = read_training(reader, metrics)
        described = f"{fmt} {reader.layout}, iteration {reader.common.iteration}"
    staging = Path(staging) if staging is not None else default_staging(path)
    if staging.resolve() == path.resolve() or staging.resolve().is_relative_to(path.resolve()):
        raise ReshardError(f"the staging directory {staging} is inside the checkpoint {path}; choose one beside it with --staging")
    target = Target(format="hf", dtype=dtype, optimizer=False, max_shard_bytes=max_shard_bytes)
    stamp = _fingerprint(path, target.dtype, max_shard_bytes)  # bf16 and bfloat16 ask for the same export
    stale = False
    if staging.exists() and (not staging.is_dir() or any(staging.iterdir())):
        recorded = _read_record(staging)
        if recorded == stamp:
            if check:
                check()
                check = None
            say(f"reusing the export {staging} of {path} ({described}); recomputing its checksums")
            try:
                _verified(staging)
                return staging, training, False
            except ReshardError as exc:
                say(f"{exc}: exporting again")
                stale = True
        elif (recorded or {}).get("source") == stamp["source"] or _made_from(staging, path):
            stale = True  # an export of this checkpoint, as it was before or in another dtype
        else:
            raise ReshardError(f"{staging} exists and is not an export of {path}; remove it or choose another staging "
                               "directory with --staging")
    if check:
        check()
    say(f"exporting {path} ({described}) to {staging}" + (" (replacing an export of an earlier state)" if stale else ""))
    convert(path, staging, target, run=Run(workers=workers),
            overwrite=stale, planned=planned, progress=progress)
    (staging / RECORD).write_text(json.dumps(stamp, indent=1) + "\n")
    return staging, training, True


def _read_record(staging: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((staging / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return {k: record.get(k) for k in ("source", "files", "dtype", "max_shard_bytes")} if isinstance(record, dict) else None


def _verified(folder: Path) -> None:
    from reshard.verify import verify

    report = verify(folder)
    if not report.comparison.ok:
        raise ReshardError(f"{folder} does not match its recorded checksums ({report.comparison.summary()}); refusing to upload")


def local_files(folder: Path) -> dict[str, Path]:
    """The files to upload: everything in the folder but hidden files and directories (reshard's record of
    the export, .cache, .git). A symlink that leads out of the folder is refused: what is uploaded is the
    folder's own."""
    out = {}
    home = folder.resolve()
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_symlink() and not p.resolve().is_relative_to(home):
            raise ReshardError(f"{p} leads outside {folder} (to {p.resolve()}); refusing to upload it")
        if p.is_file():
            out[rel.as_posix()] = p
    return out


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (UnicodeError, ValueError):
        raise ReshardError(f"{path} is not valid JSON; refusing to upload it") from None
    if not isinstance(data, dict):
        raise ReshardError(f"{path} is not a JSON object; refusing to upload it")
    return data


def check_publishable(folder: Path, files: dict[str, Path], allow_code: bool) -> None:
    """Refuse a folder whose config, generation config, tokenizer or index files are not those the export
    recorded (edited or added since), and, unless `allow_code`, one with code a user's `trust_remote_code` would
    run: *.py files, or `auto_map` in config.json or tokenizer_config.json."""
    try:
        recorded = json.loads((folder / MANIFEST_NAME).read_text())["provenance"]["hf_files"]
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None
    if not isinstance(recorded, dict):
        raise ReshardError(f"{folder / MANIFEST_NAME} records no sha256 of config.json and the tokenizer files (an export "
                           "of an older reshard, or edited): export the checkpoint again to upload it")
    now = recorded_digests(folder)
    for name in sorted(set(recorded) | set(now)):
        if name not in now:
            raise ReshardError(f"{folder / name} is missing, though the export wrote it; refusing to upload")
        if name not in recorded:
            raise ReshardError(f"{folder / name} was added after the export (it is not in {MANIFEST_NAME}); refusing to upload")
        if recorded[name] != now[name]:
            raise ReshardError(f"{folder / name} changed after the export (its sha256 is not the one in {MANIFEST_NAME}); "
                               "refusing to upload: export again, or restore it")
    if allow_code:
        return
    code = [name for name in files if name.endswith(".py")]
    for name in ("config.json", "tokenizer_config.json"):
        if name in files and "auto_map" in _json_object(files[name]):
            code.append(f"{name} (auto_map)")
    if code:
        raise ReshardError(f"{folder} holds code that transformers would run with trust_remote_code ({', '.join(code[:3])}); "
                           "refusing to upload it without --allow-code")


def unverified(folder: Path, files: dict[str, Path], allow_code: bool) -> list[str]:
    """The files to upload that nothing checks: not the weights the manifest's checksums cover (the safetensors
    files the model is read from), not a file whose sha256 the export recorded (config, index, tokenizer), not the
    manifest or the model card, nor code that `allow_code` lets through."""
    covered = {MANIFEST_NAME, CARD, *recorded_digests(folder)}
    covered.update(p.relative_to(folder).as_posix() for p in model_files(folder))
    return [name for name in files if name not in covered and not (allow_code and name.endswith(".py"))]


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class _Local:
    """One file to be in the repository: on disk, or (the generated card) in memory."""

    name: str
    size: int
    sha256: str
    path: Path | None = None
    data: bytes | None = None

    def git_sha1(self) -> str:
        return git_sha1(self.data if self.data is not None else self.path.read_bytes())

    def same_as(self, remote: Any) -> bool:
        """Whether the repository's file (huggingface_hub's RepoFile) holds these bytes."""
        if remote is None or remote.size != self.size:
            return False
        if remote.lfs is not None:
            return remote.lfs.sha256 == self.sha256
        return remote.blob_id == self.git_sha1()

    def operation(self) -> Any:
        from huggingface_hub import CommitOperationAdd

        op = CommitOperationAdd(path_in_repo=self.name, path_or_fileobj=self.data if self.data is not None else str(self.path))
        op.upload_info.sha256 = bytes.fromhex(self.sha256)  # hashed once, here
        return op


def commit_batches(todo: list[_Local], commit_bytes: int) -> list[list[_Local]]:
    """Commits of about `commit_bytes` or COMMIT_FILES files, large files first, then the small ones, and the
    files that make the repository a model (LAST) in the final commit."""
    last = sorted((f for f in todo if f.name in LAST), key=lambda f: LAST.index(f.name))
    rest = sorted((f for f in todo if f.name not in LAST), key=lambda f: (-f.size, f.name))
    batches: list[list[_Local]] = []
    current: list[_Local] = []
    size = 0
    for f in rest:
        if current and (size + f.size > commit_bytes or len(current) >= COMMIT_FILES):
            batches.append(current)
            current, size = [], 0
        current.append(f)
        size += f.size
    if current:
        batches.append(current)
    if last:
        batches.append(last)
    return batches


def _remote_files(api: Any, repo_id: str, revision: str | None) -> dict[str, Any]:
    from huggingface_hub.hf_api import RepoFile

    return {f.path: f for f in api.list_repo_tree(repo_id, recursive=True, revision=revision) if isinstance(f, RepoFile)}


# -------------------------------------------------------------------------------------------- upload

def upload(
    path: Path | str,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    commit_message: str | None = None,
    staging: Path | str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    metrics: Path | str | None = None,
    workers: int = 1,
    commit_bytes: int = COMMIT_BYTES,
    report: Report | None = None,
    planned: Callable[[Any], None] | None = None,
    progress: Callable[[int], None] | None = None,
    hashed: Callable[[int, int], None] | None = None,
    allow_code: bool = False,
    include_unverified: bool = False,
) -> UploadResult:
    """Publish `path` (any checkpoint reshard reads) to `repo_id`: export it to HF if it is not an HF model
    (see `prepare`), verify, and upload what the repository lacks, in commits a rerun resumes (see the module
    docstring). The repository is created if needed (`private` then applies), `revision` is a branch made from
    the default one if missing. The folder's own README.md is its model card; without one, a card with the
    provenance, the training's metrics and the checksums is generated for `repo_id` (never written to disk).
    `report` gets a line at each step; `planned` and `progress` follow an export as `convert` has them;
    `hashed` gets (bytes hashed, bytes to hash) after each file. Without `report`, huggingface_hub shows no
    progress bars either. A folder with code files or `auto_map` is refused unless `allow_code`, one whose config
    or tokenizer files are not those the export recorded (`check_publishable`), and one with files no checksum
    covers (`unverified`: notes, extra folders, a stray safetensors file) unless `include_unverified`."""
    say = report or (lambda _: None)
    check_repo_id(repo_id)
    path = Path(path)
    access = Access(token, endpoint)
    folder, training, exported = prepare(
        path, staging=Path(staging) if staging is not None else None, dtype=dtype, max_shard_bytes=max_shard_bytes,
        metrics=Path(metrics) if metrics is not None else None, workers=workers, report=say,
        check=access.check_write_token, planned=planned, progress=progress,
    )

    paths = local_files(folder)
    check_publishable(folder, paths, allow_code)
    extra = unverified(folder, paths, allow_code)
    if extra and not include_unverified:
        raise ReshardError(f"{folder} holds {len(extra)} file(s) no checksum covers ({', '.join(extra[:3])}"
                           f"{', ...' if len(extra) > 3 else ''}): remove them, or pass --include-unverified to publish them anyway")
    if extra:
        say(f"publishing {len(extra)} file(s) no checksum covers: {', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}")
    files = _hashed(paths, workers, say, hashed)
    if CARD not in paths:
        card = model_card(folder, repo_id, training, {f.name: (f.size, f.sha256) for f in files}).encode()
        files.append(_Local(CARD, len(card), hashlib.sha256(card).hexdigest(), data=card))

    api = access.api()
    result = UploadResult(repo_id, "", len(files), None, folder, exported, unverified=extra)
    with access.errors("upload to", repo_id), progress_bars(report is not None):
        result.url = str(api.create_repo(repo_id, private=private or None, repo_type="model", exist_ok=True))
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        message = commit_message or f"Upload {path.name} (reshard, checksums verified)"
        _commit_missing(api, result, files, revision, commit_bytes, message, say)
        remote = _remote_files(api, repo_id, revision)
    differ = [f.name for f in files if not f.same_as(remote.get(f.name))]
    if differ:
        raise ReshardError(f"after the upload, {len(differ)} file(s) on the Hub differ from {folder} (first: {differ[0]}); "
                           "run the same command again")
    return result


def _hashed(paths: dict[str, Path], workers: int, say: Report, hashed: Callable[[int, int], None] | None) -> list[_Local]:
    """The files to upload with their sha256, hashed by `workers` threads; `hashed` gets (done, total) bytes."""
    total = sum(p.stat().st_size for p in paths.values())
    say(f"hashing {len(paths)} files ({human_bytes(total)})")
    done = 0
    digests = {}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for name, digest in zip(paths, pool.map(file_sha256, paths.values())):
            digests[name] = digest
            done += paths[name].stat().st_size
            if hashed:
                hashed(done, total)
    return [_Local(name, p.stat().st_size, digests[name], path=p) for name, p in paths.items()]


def _commit_missing(api: Any, result: UploadResult, files: list[_Local], revision: str | None, commit_bytes: int,
                    message: str, say: Report) -> None:
    """Commit the files the repository lacks (or holds otherwise), in `commit_batches`, counted in `result`."""
    remote = _remote_files(api, result.repo_id, revision)
    todo = [f for f in files if not f.same_as(remote.get(f.name))]
    batches = commit_batches(todo, commit_bytes)
    if len(todo) < len(files):
        say(f"{len(files) - len(todo)} of {len(files)} files are already on the Hub")
    if todo:
        say(f"uploading {len(todo)} files ({human_bytes(sum(f.size for f in todo))}) to {result.repo_id} in {len(batches)} commit(s)")
    for number, batch in enumerate(batches, 1):
        part = f" (part {number}/{len(batches)})" if len(batches) > 1 else ""
        info = api.create_commit(result.repo_id, [f.operation() for f in batch], commit_message=message + part,
                                 revision=revision, repo_type="model")
        result.commit = getattr(info, "oid", None)
        result.commits += 1
        result.committed += [f.name for f in batch]
        result.bytes_committed += sum(f.size for f in batch)
        say(f"commit {number}/{len(batches)}: {len(batch)} files, {human_bytes(sum(f.size for f in batch))} "
            f"({human_bytes(result.bytes_committed)} of {human_bytes(sum(f.size for f in todo))})")
