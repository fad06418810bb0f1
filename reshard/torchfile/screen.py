"""Every pickle of a checkpoint read through reshard's allow-list (`pickles.SAFE_GLOBALS`) before torch or
Megatron-Core loads any of it.

They load DCP's objects (`load_bytes`) and, in older versions or Megatron-LM's legacy loader, `common.pt`
and rank files with `torch.load(weights_only=False)`, and `.metadata` with plain `pickle.load`: a global
such as `os.system` in any of them runs on `--load`. Reading them here first, as stand-ins, runs nothing
and refuses the checkpoint by the file and the global.
"""

from __future__ import annotations

from pathlib import Path

from reshard.errors import ReshardError
from reshard.paths import confined
from reshard.torchfile import PARSE_ERRORS, dcp_metadata
from reshard.torchfile.archive_reader import RecordFile
from reshard.torchfile.payloads import EXTRA_STATE, load_screened, screen_payloads

TORCH_SAVE_SUFFIXES = (".pt", ".pth")  # common.pt, model_optim_rng.pt, distrib_optim.pt, Bridge's train_state.pt


def screen(directory: Path) -> None:
    """Read every `.metadata` under `directory` (a checkpoint's iteration directory, or any directory torch
    is about to load from), the objects its `.distcp` files hold, and every `torch.save` file; a ReshardError
    in one line for a global off the allow-list or a file that cannot be read."""
    for found in sorted(directory.rglob("*")):
        if found.name == ".metadata" or found.suffix in TORCH_SAVE_SUFFIXES:
            path = confined(directory, str(found.relative_to(directory)))  # a link leading out is refused, not read
            if not path.is_file():
                continue
            if path.name == ".metadata":
                _objects(path)
            else:
                load_screened(path, str(path))


def _objects(path: Path) -> None:
    """The objects DCP would `torch.load` from the files `.metadata` at `path` names (tensors it loads
    with `weights_only=True`), and the pickles inside them (`payloads`: TE's `_extra_state`)."""
    files: dict[Path, RecordFile] = {}
    try:
        for (fqn, offsets), info in dcp_metadata.load(path).storage.items():
            if offsets is not None:
                continue
            if info.transformed:
                raise ReshardError(f"{path.parent / info.relative_path}: DCP stream transforms (compression) are not supported")
            blob = confined(path.parent, info.relative_path)  # .metadata names it: untrusted
            if blob not in files:
                files[blob] = RecordFile(blob)
            try:
                value = files[blob].unpickle(info.offset, info.length)
            except PARSE_ERRORS as exc:
                raise ReshardError(f"{blob}: an object cannot be decoded ({exc.__class__.__name__}); the file is damaged") from None
            screen_payloads(value, f"{blob} ({fqn})", extra_state=EXTRA_STATE in fqn)
    except FileNotFoundError as exc:
        raise ReshardError(f"{exc.filename} is missing: the checkpoint is incomplete") from None
    finally:
        for file in files.values():
            file.close()
