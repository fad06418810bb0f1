"""Every pickle of a checkpoint read through reshard's allow-list (`pickles.SAFE_GLOBALS`) before torch or
Megatron-Core loads any of it.

They load DCP's objects (`load_bytes`) and, in older versions or Megatron-LM's legacy loader, `common.pt`
and rank files with `torch.load(weights_only=False)`, and `.metadata` with plain `pickle.load`: a global
such as `os.system` in any of them runs on `--load`. Reading them here first, as stand-ins, runs nothing
and refuses the checkpoint by the file and the global. What is read here is what torch reads: DCP hands
`torch.load` exactly the bytes `.metadata` places an object at (`FileSystemReader.read_data` through a
`_ReaderView` of [offset, offset + length)), and each archive is read only in the layout where torch's
reader finds the same records (`zip_reader`), so no other reading of those bytes is left for torch.
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
    """Every file `.metadata` at `path` names, each inside the checkpoint (DCP opens them by joining the name to
    the directory, `..`, absolute paths and links and all); the objects DCP would `torch.load` from them
    (tensors it loads with `weights_only=True`), and the pickles inside those (`payloads`: TE's `_extra_state`)."""
    files: dict[str, RecordFile] = {}
    storage = dcp_metadata.load(path).storage
    try:
        for name in {info.relative_path for info in storage.values()}:
            confined(path.parent, name)  # .metadata names it: untrusted
        for (fqn, offsets), info in storage.items():
            if offsets is not None:
                continue
            if info.transformed:
                raise ReshardError(f"{path.parent / info.relative_path}: DCP stream transforms (compression) are not supported")
            if info.relative_path not in files:
                files[info.relative_path] = RecordFile(path.parent / info.relative_path)
            blob = files[info.relative_path]
            try:
                value = blob.unpickle(info.offset, info.length)
            except PARSE_ERRORS as exc:
                raise ReshardError(f"{blob.path}: an object cannot be decoded ({exc.__class__.__name__}); the file is damaged") from None
            screen_payloads(value, f"{blob.path} ({fqn})", extra_state=EXTRA_STATE in fqn)
    except FileNotFoundError as exc:
        raise ReshardError(f"{exc.filename} is missing: the checkpoint is incomplete") from None
    finally:
        for file in files.values():
            file.close()
