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

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from reshard.errors import ReshardError

SCHEME = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
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

    def whoami(self) -> str:
        """The account the token belongs to; refuses a missing or rejected token before any work is done."""
        if self.token_source is None:
            raise ReshardError("no Hub token: set HF_TOKEN, run `hf auth login`, or pass --token (a token with write access)")
        with self.errors("check the token at"):
            return self.api().whoami()["name"]

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


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]


def _is_network_error(exc: BaseException) -> bool:
    """A transport error of the Hub client's HTTP stack (httpx or requests, by huggingface_hub release)."""
    stacks = {"httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3"}
    return isinstance(exc, ConnectionError) or any(c.__module__.split(".")[0] in stacks for c in type(exc).__mro__)
