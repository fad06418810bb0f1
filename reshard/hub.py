"""The Hugging Face Hub as a place checkpoints come from and go to: which argument names a Hub repository,
the token (found as the `hf` CLI finds it, never shown), the Hub's errors as one actionable line, and the
download of a model's files through huggingface_hub's cache.

A download takes only what a conversion reads: config.json, the safetensors weights (those the index
names, or model.safetensors), the tokenizer and generation files and a reshard manifest. Never PyTorch
pickles (.bin, .pt: loading one can run code) nor code files, and only plain top-level names, so that
nothing the repository lists can reach outside the snapshot. Downloaded files count as untrusted input:
reshard parses them (JSON, safetensors headers), never runs them.

huggingface_hub is imported only when the Hub is used (it costs a conversion's cold start otherwise).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.errors import ReshardError
from reshard.formats.base import MANIFEST_NAME, Manifest
from reshard.formats.hf import CONFIG, INDEX, SINGLE, TOKENIZER_FILES

SCHEME = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# A file name the download accepts: top level, no glob characters (the names double as patterns), no dot-files.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


@dataclass(frozen=True)
class HubRepo:
    """A model repository on the Hub, at a revision (None: its default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{SCHEME}{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


def parse_source(text: str | Path) -> Path | HubRepo:
    """What a SOURCE argument names. `hf://org/model[@revision]` is a Hub repository; otherwise a local path
    that exists wins, and `org/model[@revision]` that is no local path is a Hub repository. Anything else is
    a local path (whose reader then says that it does not exist)."""
    if isinstance(text, Path):
        return text
    if text.startswith(SCHEME):
        repo = _parse_repo(text[len(SCHEME):])
        if repo is None:
            raise ReshardError(f"{text} does not name a Hub repository: write hf://org/model or hf://org/model@revision")
        return repo
    path = Path(text)
    if path.exists() or text.startswith((".", "/", "~")):
        return path
    return _parse_repo(text) or path


def _parse_repo(text: str) -> HubRepo | None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    name, at, revision = text.partition("@")
    if name.count("/") != 1 or (at and not _REVISION.match(revision)) or ".." in revision:
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return HubRepo(name, revision or None)


def check_repo_id(repo_id: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ReshardError(f"{repo_id!r} is not a Hub repository id (user/name): {str(exc).splitlines()[0]}") from None
    if repo_id.count("/") != 1:
        raise ReshardError(f"{repo_id!r} is not a Hub repository id: write it as user/name or org/name")


class Access:
    """How to reach the Hub: its URL and the token. The token is resolved as the `hf` CLI does: `token` if
    given (--token), else HF_TOKEN, else the login saved by `hf auth login`. It is never part of a repr or
    of a message: errors name where it came from instead."""

    def __init__(self, token: str | None = None, endpoint: str | None = None):
        if token is not None and (not token or not token.isascii() or not token.isprintable() or " " in token):
            raise ReshardError("the token given with --token holds whitespace or characters a token cannot have; copy it again")
        self._token = token
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")

    def __repr__(self) -> str:
        return f"Access(endpoint={self.endpoint!r}, token from {self.token_source or 'nowhere'})"

    @property
    def token_source(self) -> str | None:
        """Where the token comes from, in words (None: there is none)."""
        if self._token is not None:
            return "--token"
        for name in ("HF_OIDC_RESOURCE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
            if os.environ.get(name, "").strip():
                return name
        return "the login saved by `hf auth login`" if self._token_value() else None

    def _token_value(self) -> str | None:
        if self._token is not None:
            return self._token
        from huggingface_hub import get_token

        return get_token()

    def api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self._token, library_name="reshard")

    def redact(self, text: str) -> str:
        """`text` without the token (one of a few characters, as in tests, would only mangle words)."""
        token = self._token_value()
        return text.replace(token, "<token>") if token and len(token) >= 6 else text

    def check_write_token(self) -> str:
        """The account the token belongs to; refuses a missing, rejected or read-only token before any work
        is done."""
        if self.token_source is None:
            raise ReshardError("no Hub token: set HF_TOKEN, run `hf auth login`, or pass --token (a token with write access)")
        with self.errors("check the token at"):
            info = self.api().whoami()
        role = ((info.get("auth") or {}).get("accessToken") or {}).get("role")
        if role == "read":
            raise ReshardError(f"the token from {self.token_source} is read-only; use a token with write access")
        return info["name"]

    @contextmanager
    def errors(self, doing: str, repo: str | HubRepo | None = None) -> Iterator[None]:
        """The Hub client's errors, as one line that says what to do (and never holds the token)."""
        try:
            yield
        except ReshardError:
            raise
        except Exception as exc:
            raise ReshardError(self.redact(self._message(exc, doing, repo))) from None

    def _message(self, exc: Exception, doing: str, repo: str | HubRepo | None) -> str:
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            OfflineModeIsEnabled,
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        repo_id = repo.repo_id if isinstance(repo, HubRepo) else repo
        where = f"{doing} {repo_id}" if repo_id else f"{doing} {self.endpoint}"
        token = f"the token from {self.token_source}" if self.token_source else "no token"
        if isinstance(exc, GatedRepoError):
            return (f"{repo_id} is gated: ask for access at {self.endpoint}/{repo_id} and use a token of an account that "
                    f"has it (now {token}; set HF_TOKEN, run `hf auth login` or pass --token)")
        if isinstance(exc, RevisionNotFoundError):
            revision = repo.revision if isinstance(repo, HubRepo) else None
            if revision is None:  # not even its default branch has a commit
                return f"{where}: {repo_id} has no commits yet on {self.endpoint}"
            return f"{repo_id} has no revision {revision!r} on {self.endpoint}: give a branch, tag or commit it has"
        if isinstance(exc, RemoteEntryNotFoundError):
            return f"{where}: a file the repository lists cannot be downloaded ({_first_line(exc)})"
        if isinstance(exc, RepositoryNotFoundError):
            return (f"{where}: {self.endpoint} has no model {repo_id}, or it is private and {token} cannot see it "
                    "(check the name, or set HF_TOKEN / pass --token)")
        if isinstance(exc, HfHubHTTPError):
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status == 401:
                return (f"{where}: the Hub rejected {token}, which is invalid or expired; set HF_TOKEN, "
                        "run `hf auth login` or pass --token")
            if status == 403:
                return f"{where}: {token} is not allowed to do this (403); use a token with write access to {repo_id}"
            return f"{where} failed: {_first_line(exc)}"
        if isinstance(exc, OfflineModeIsEnabled):
            return f"{where}: HF_HUB_OFFLINE is set; unset it to reach the Hub"
        if _is_network_error(exc):
            return (f"cannot reach the Hub at {self.endpoint} ({exc.__class__.__name__}: {_first_line(exc)}); "
                    "check --endpoint / HF_ENDPOINT and the network")
        if isinstance(exc, (ValueError, OSError, RuntimeError)) and exc.__class__.__module__.startswith(("huggingface_hub", "builtins")):
            cause = exc.__cause__ or exc.__context__
            if cause is not None and _is_network_error(cause):
                return self._message(cause, doing, repo)
            return f"{where} failed: {exc.__class__.__name__}: {_first_line(exc)}"
        raise exc


@contextmanager
def progress_bars(shown: bool) -> Iterator[None]:
    """huggingface_hub's progress bars hidden (`shown` False) for a while, as they were after."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hide = not shown and not are_progress_bars_disabled()
    if hide:
        disable_progress_bars()
    try:
        yield
    finally:
        if hide:
            enable_progress_bars()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]


def _is_network_error(exc: BaseException) -> bool:
    """A transport error of the Hub client's HTTP stack (httpx or requests, by huggingface_hub release)."""
    stacks = {"httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3"}
    return isinstance(exc, ConnectionError) or any(c.__module__.split(".")[0] in stacks for c in type(exc).__mro__)


# ------------------------------------------------------------------------------------------- download

WANTED = (CONFIG, MANIFEST_NAME, *TOKENIZER_FILES)


def weight_files(repo: HubRepo, listing: dict[str, int], read_index: Callable[[], bytes]) -> list[str]:
    """The safetensors files a conversion reads: those `model.safetensors.index.json` names, or
    model.safetensors. `listing`: the repository's top-level files and sizes. A repository with only
    pickled weights is refused (loading them can run code)."""
    if INDEX in listing:
        try:
            index = json.loads(read_index())
            shards = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ReshardError(f"{repo}: {INDEX} is not a safetensors index (no weight_map of tensor -> file)") from None
        for shard in shards:
            if not isinstance(shard, str) or not _SAFE_NAME.match(shard) or not shard.endswith(".safetensors"):
                raise ReshardError(f"{repo}: {INDEX} names {shard!r}, not a safetensors file at the top of the repository; refusing it")
            if shard not in listing:
                raise ReshardError(f"{repo}: {INDEX} names {shard}, which the repository does not have")
        return [INDEX, *shards]
    if SINGLE in listing:
        return [SINGLE]
    pickles = sorted(n for n in listing if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ReshardError(f"{repo} has its weights only as PyTorch pickles ({', '.join(pickles[:3])}), which reshard does "
                           "not load (loading a pickle can run code); use a revision with safetensors weights")
    raise ReshardError(f"{repo} has no {SINGLE} and no {INDEX}: not a model reshard can read")


def download(repo: HubRepo, access: Access, report: Callable[[str], None] | None = None, named: str | None = None) -> Path:
    """Download what a conversion of `repo` reads into huggingface_hub's cache (files already there are not
    fetched again; a dropped connection resumes where it stopped) and return the snapshot directory.
    `named`: the argument, when it was a bare org/model that is no local path (a failure to find the
    repository then says both)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    api = access.api()
    try:
        with access.errors("download", repo):
            commit = api.model_info(repo.repo_id, revision=repo.revision).sha
    except ReshardError as exc:
        if named is None:
            raise
        raise ReshardError(f"there is no local path {named}, and as a Hub repository: {exc}") from None
    with access.errors("download", repo), progress_bars(report is not None):
        listing = _listing(api, repo, commit, access.endpoint)
        if CONFIG not in listing:
            raise ReshardError(f"{repo} has no {CONFIG}: not a transformers model reshard can read")

        def fetch(name: str) -> Path:
            return Path(hf_hub_download(repo.repo_id, name, revision=commit, endpoint=access.endpoint, token=access._token))

        fetch(CONFIG)  # first: a gated repository or a rejected token fails here, before anything else
        files = [n for n in WANTED if n in listing] + weight_files(repo, listing, lambda: fetch(INDEX).read_bytes())
        files = sorted(set(files), key=files.index)
        if report:
            from reshard.plan import human_bytes

            size = sum(listing[n] for n in files)
            report(f"downloading {repo} (commit {commit[:12]}): {len(files)} files, {human_bytes(size)}, "
                   f"into the Hugging Face cache (files already there are not fetched again)")
        folder = Path(snapshot_download(repo.repo_id, revision=commit, allow_patterns=files, endpoint=access.endpoint,
                                        token=access._token))
    _check_snapshot(repo, folder, {n: listing[n] for n in files})
    return folder


def _listing(api: Any, repo: HubRepo, commit: str | None, endpoint: str) -> dict[str, int]:
    """The repository's files and sizes at `commit`, the one its model_info named: none named, or one it cannot
    list, is a repository without commits."""
    from huggingface_hub.errors import RevisionNotFoundError
    from huggingface_hub.hf_api import RepoFile

    if commit is not None:
        try:
            return {f.path: f.size for f in api.list_repo_tree(repo.repo_id, revision=commit) if isinstance(f, RepoFile)}
        except RevisionNotFoundError:
            pass
    raise ReshardError(f"{repo} has no commits yet on {endpoint}: there is no model in it to download; push one "
                       "first or give another repository")


def _check_snapshot(repo: HubRepo, folder: Path, expected: dict[str, int]) -> None:
    """Every file is there, as large as the Hub said, and resolves inside the cache's folder for the repo;
    a reshard manifest must parse (the reader trusts it to check what it reads)."""
    store = folder.parent.parent.resolve()  # models--org--name: snapshots/<commit> and blobs/
    for name, size in expected.items():
        path = folder / name
        real = path.resolve()
        if not real.is_relative_to(store) or not real.is_file():
            raise ReshardError(f"{repo}: {name} in the cache at {folder} does not lead to a downloaded file; remove that snapshot and retry")
        if real.stat().st_size != size:
            raise ReshardError(f"{repo}: {name} in the cache has {real.stat().st_size} bytes, the Hub says {size}; "
                               f"remove {folder} and run the same command again")
    if MANIFEST_NAME in expected:
        try:
            Manifest.from_json(json.loads((folder / MANIFEST_NAME).read_text()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ReshardError(f"{repo}: its {MANIFEST_NAME} is malformed; it cannot be trusted to check the weights") from None


def local_source(text: str | Path, access: Access | None = None, report: Callable[[str], None] | None = None) -> Path:
    """A SOURCE argument as a local directory: a Hub repository is downloaded first (see `parse_source`)."""
    source = parse_source(text)
    if isinstance(source, Path):
        return source
    return download(source, access or Access(), report, named=None if str(text).startswith(SCHEME) else str(text))
