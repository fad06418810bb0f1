"""`reshard upload`: publish an HF export to the Hugging Face Hub, only after it verifies.

The directory must be an HF model written by reshard (it carries reshard_manifest.json); its checksums
are recomputed and compared with the recorded ones first, and nothing is uploaded if they differ. A
README.md model card with the provenance (source checkpoint, layout, format, checksum summary) is
generated unless the directory already has one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.errors import ReshardError
from reshard.formats.base import MANIFEST_NAME

CARD = "README.md"


@dataclass
class UploadResult:
    repo_id: str
    url: str
    files: int
    commit: str | None


def model_card(path: Path, repo_id: str) -> str:
    """A model card from the export's config.json and reshard_manifest.json."""
    manifest: dict[str, Any] = json.loads((path / MANIFEST_NAME).read_text())
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    prov = manifest.get("provenance", {})
    checksums = manifest.get("checksums", {})
    dtypes: dict[str, int] = {}
    for entry in checksums.values():
        dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + 1
    params = 0
    for name, entry in checksums.items():
        n = 1
        for d in entry["shape"]:
            n *= d
        params += n
    arch = ", ".join(config.get("architectures") or [config.get("model_type", "?")])
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
        f"| converted | {prov.get('time', '?')} |",
        f"| HF family | {prov.get('hf_family', config.get('model_type', '?'))} |",
        "",
        "## Checksums",
        "",
        f"{len(checksums)} logical tensors ({params:,} values incl. vocabulary padding as stored in the source), "
        f"dtypes {', '.join(f'{k}: {v}' for k, v in sorted(dtypes.items()))}. Layout-invariant checksums of every "
        f"tensor are in `{MANIFEST_NAME}`; `reshard verify <dir>` recomputes them. They were verified before this upload.",
    ]
    if prov.get("dropped"):
        lines += ["", "Not carried over from the source: " + ", ".join(f"`{d}`" for d in prov["dropped"][:20])]
    return "\n".join(lines) + "\n"


def upload(
    path: Path | str,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    commit_message: str | None = None,
) -> UploadResult:
    """Verify `path`, create `repo_id` if needed and upload the folder, with a model card for `repo_id`
    unless the folder has its own (the card is written for the upload only: the export stays as it was)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from reshard.verify import verify

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ReshardError(f"{repo_id!r} is not a Hub repository id (user/name): {str(exc).splitlines()[0]}") from None
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ReshardError(f"{path} is not an HF model directory (no config.json); export with `reshard convert ... --to-format hf` first")
    if not (path / MANIFEST_NAME).is_file():
        raise ReshardError(f"{path} has no {MANIFEST_NAME}: only reshard exports (whose checksums can be verified) are uploaded")
    report = verify(path)
    if not report.comparison.ok:
        raise ReshardError(f"{path} does not match its recorded checksums ({report.comparison.summary()}); refusing to upload")
    card = None if (path / CARD).exists() else path / CARD
    if card is not None:
        card.write_text(model_card(path, repo_id))

    endpoint = endpoint or os.environ.get("HF_ENDPOINT")
    api = HfApi(endpoint=endpoint, token=token)  # token None: HF_TOKEN or the saved login
    try:
        url = api.create_repo(repo_id, private=private or None, repo_type="model", exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        files = sorted(p for p in path.rglob("*") if p.is_file())
        commit = api.upload_folder(
            folder_path=str(path),
            repo_id=repo_id,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or f"Upload {path.name} (reshard, checksums verified)",
        )
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        hint = " (check the token: HF_TOKEN, --token or `hf auth login`)" if status in (401, 403) else ""
        raise ReshardError(f"upload to {repo_id} failed: {str(exc).splitlines()[0]}{hint}") from None
    except Exception as exc:
        if not _is_network_error(exc):
            raise
        raise ReshardError(f"cannot reach the Hub at {endpoint or 'huggingface.co'} ({exc.__class__.__name__}: {exc}); "
                           "check --endpoint / HF_ENDPOINT and the network") from None
    finally:
        if card is not None:
            card.unlink(missing_ok=True)
    return UploadResult(repo_id, str(url), len(files), getattr(commit, "oid", None))


def _is_network_error(exc: Exception) -> bool:
    """A transport error of the Hub client's HTTP stack (httpx or requests, by huggingface_hub release)."""
    stacks = {"httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3"}
    return isinstance(exc, ConnectionError) or any(c.__module__.split(".")[0] in stacks for c in type(exc).__mro__)
