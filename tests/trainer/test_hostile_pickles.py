"""Checkpoints whose pickles would run code when torch loads them (issue 22): `.metadata` (plain `pickle.load` in
DCP), `common.pt`, the objects in the `.distcp` files (DCP's `torch.load(weights_only=False)`), a legacy rank
file and zarr's common state. `reshard convert` and the trainer's `--load` refuse each in one line naming the
file and the global; the payload never runs and the checkpoint is left as it was."""

from __future__ import annotations

import builtins
import collections
import hashlib
import io
import json
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.corpus import write_corpus
from fixtures.hostile_archives import TAMPERINGS
from fixtures.torchrun import REPO, run
from tests import launch
from tests.trainer.test_resume import assert_one_line

pytestmark = pytest.mark.slow  # every test trains with the trainer (Megatron-Core)

ITER = "iter_0000002"


class _System:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Exec(_System):
    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


class _Touch(_System):
    def __reduce__(self):
        return pathlib.Path(self.marker).touch, ()  # pickled as getattr(PosixPath(marker), "touch")


PAYLOADS = {"os.system": (_System, "posix.system"), "exec": (_Exec, "builtins.exec"), "touch": (_Touch, "builtins.getattr")}


def _into_torch_file(path: Path, payload) -> None:
    state = torch.load(path, weights_only=False)  # our own file, before the payload is in it
    state["extra"] = {"nested": [payload]}
    torch.save(state, path)


def _into_metadata(directory: Path, payload) -> None:
    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.planner_data = {"nested": [payload]}
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _into_object(directory: Path, payload, prefix: str = "rng_state") -> None:
    """The blob of the first object whose key starts with `prefix` replaced by one holding the payload (as
    Megatron saves a ShardedObject: a list of its one value)."""
    blob = io.BytesIO()
    torch.save([payload], blob)
    _replace_object(directory, blob.getvalue(), prefix)


def _object_index(directory: Path, prefix: str):
    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    return metadata, next(i for i in metadata.storage_data if i.fqn.startswith(prefix))


def _object_blob(directory: Path, prefix: str = "rng_state") -> bytes:
    metadata, index = _object_index(directory, prefix)
    info = metadata.storage_data[index]
    with open(directory / info.relative_path, "rb") as f:
        return os.pread(f.fileno(), info.length, info.offset)


def _replace_object(directory: Path, blob: bytes, prefix: str = "rng_state") -> None:
    """The first object whose key starts with `prefix` replaced by `blob`, appended to its .distcp file."""
    metadata, index = _object_index(directory, prefix)
    info = metadata.storage_data[index]
    target = directory / info.relative_path
    offset = target.stat().st_size
    with open(target, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(blob))
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


EXTRA_STATE = "decoder.layers.self_attention.linear_qkv._extra_state"


def _te_tensor(payload) -> torch.Tensor:
    """What Transformer Engine's `get_extra_state` returns: its state pickled into a uint8 tensor."""
    return torch.frombuffer(bytearray(pickle.dumps({"extra_fp8_variables": {"hook": payload}})), dtype=torch.uint8)


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _reshard(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], cwd=REPO, text=True, capture_output=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt", docs=100, seed=0)


def _train_args(corpus) -> list:
    return ["--data", corpus, "--seq-length", 16, "--micro-batch-size", 2, "--global-batch-size", 4, "--lr", 3e-3,
            "--lr-warmup-iters", 1, "--seed", 7]


@pytest.fixture(scope="module")
def sources(tmp_path_factory, corpus):
    """A trainer checkpoint (torch_dist, with rng_state objects), and reshard's legacy and zarr forms of it."""
    root = tmp_path_factory.mktemp("sources")
    launch.run("reshard.trainer", [*_train_args(corpus), "--train-iters", 2, "--save", root / "dist"], nproc=1)
    for fmt in ("legacy", "zarr"):
        proc = _reshard("convert", root / "dist", root / fmt, "--to-format", fmt, "--no-optimizer", "-q")
        assert proc.returncode == 0, proc.stderr
    return root


KINDS = {
    ".metadata": ("dist", lambda ckpt, p: _into_metadata(ckpt / ITER, p), f"{ITER}/.metadata"),
    "common.pt": ("dist", lambda ckpt, p: _into_torch_file(ckpt / ITER / "common.pt", p), f"{ITER}/common.pt"),
    "distcp object": ("dist", lambda ckpt, p: _into_object(ckpt / ITER, p), f"{ITER}/__0_0.distcp"),
    "legacy rank file": ("legacy", lambda ckpt, p: _into_torch_file(ckpt / ITER / "mp_rank_00" / "model_optim_rng.pt", p),
                         f"{ITER}/mp_rank_00/model_optim_rng.pt"),
    "zarr common.pt": ("zarr", lambda ckpt, p: _into_torch_file(ckpt / "common.pt", p), "zarr/common.pt"),
    # Transformer Engine's form of a module's extra state, which it loads with plain pickle.loads
    "TE extra state": ("dist", lambda ckpt, p: _into_object(ckpt / ITER, _te_tensor(p), prefix=EXTRA_STATE),
                       f"{ITER}/__0_0.distcp ({EXTRA_STATE}/shard_0_4) (a pickle inside it)"),
}


def _hostile(sources: Path, tmp_path: Path, kind: str, payload: str) -> tuple[Path, Path, str]:
    """A copy of the source of `kind` with `payload` planted; its marker file; what the refusal must name."""
    fmt, plant, where = KINDS[kind]
    ckpt = Path(shutil.copytree(sources / fmt, tmp_path / fmt))
    marker = tmp_path / "ran"
    cls, named = PAYLOADS[payload]
    plant(ckpt, cls(marker))
    return ckpt, marker, f"{where.removeprefix('zarr/')} pickles {named},"


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_reshard_refuses_a_pickle_that_would_run(sources, tmp_path, kind, payload):
    ckpt, marker, named = _hostile(sources, tmp_path, kind, payload)
    before = _digest(ckpt)
    proc = _reshard("convert", ckpt, tmp_path / "out", "--to-format", "torch_dist", "-q")  # the same layout: rng_state is carried
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("reshard: error:"), proc.stderr
    assert named in lines[0], lines[0]
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert _digest(ckpt) == before


class _Unknown:
    """An instance of a class of a module that no checkpoint names (this test's)."""


@pytest.mark.parametrize("plant, named", [
    (lambda state: state.update(extra=json.dumps), "json.dumps"),  # a function reference
    (lambda state: state.update(extra={"nested": [_Unknown()]}), f"{__name__}._Unknown"),
    (lambda state: setattr(state["args"], "hook", {"on_load": [collections.Counter("ab")]}), "collections.Counter"),  # inside args
])
def test_reshard_refuses_what_it_does_not_know_rather_than_carry_it(sources, tmp_path, plant, named):
    """A valid checkpoint with an object the allow-list does not know: refused by name, not converted with
    "checksums verified" and the object written into the output's common.pt."""
    ckpt = Path(shutil.copytree(sources / "dist", tmp_path / "dist"))
    common = ckpt / ITER / "common.pt"
    state = torch.load(common, weights_only=False)
    plant(state)
    torch.save(state, common)
    proc = _reshard("convert", ckpt, tmp_path / "out", "--to-tp", 1, "-q")
    assert proc.returncode == 1 and proc.stderr.strip() == proc.stderr.strip().splitlines()[0], proc.stderr
    assert f"common.pt pickles {named}," in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind, payload", [(".metadata", "os.system"), ("common.pt", "exec"), ("distcp object", "touch"),
                                           ("TE extra state", "os.system")])
def test_the_trainer_refuses_to_load_a_pickle_that_would_run(sources, tmp_path, corpus, kind, payload):
    """The trainer screens the checkpoint before torch or Megatron-Core reads any of it (the rng_state object is
    one the resume at the same layout loads)."""
    ckpt, marker, named = _hostile(sources, tmp_path, kind, payload)
    before = _digest(ckpt)
    with pytest.raises(RuntimeError, match="trainer: error: .*" + re.escape(named)) as info:
        run("reshard.trainer", [*_train_args(corpus), "--train-iters", 3, "--load", ckpt], nproc=1)
    assert_one_line(str(info.value))
    assert not marker.exists()
    assert _digest(ckpt) == before


def _tamper_file(path: Path, how: str, marker: Path) -> None:
    path.write_bytes(TAMPERINGS[how](path.read_bytes(), marker))


# Where a blob that torch reads otherwise than a naive zip reader is planted (issue 33, item 1): a DCP object
# (DCP's `torch.load(weights_only=False)` in `--load`), a legacy rank file (Megatron-LM's own loader) and common.pt.
PLACES = {
    "distcp object": ("dist", lambda ckpt, how, marker: _replace_object(ckpt / ITER, TAMPERINGS[how](_object_blob(ckpt / ITER), marker)),
                      f"{ITER}/__0_0.distcp"),
    "legacy rank file": ("legacy", lambda ckpt, how, marker: _tamper_file(ckpt / ITER / "mp_rank_00" / "model_optim_rng.pt", how, marker),
                         f"{ITER}/mp_rank_00/model_optim_rng.pt"),
    "common.pt": ("dist", lambda ckpt, how, marker: _tamper_file(ckpt / ITER / "common.pt", how, marker), f"{ITER}/common.pt"),
}
NOT_READ_ALIKE = re.compile(r"(is not a torch\.save archive as torch writes one|is not a zip-format torch\.save file)")


def _tampered(sources: Path, tmp_path: Path, place: str, how: str) -> tuple[Path, Path, str]:
    fmt, plant, where = PLACES[place]
    ckpt = Path(shutil.copytree(sources / fmt, tmp_path / fmt))
    marker = tmp_path / "ran"
    plant(ckpt, how, marker)
    return ckpt, marker, where


@pytest.mark.parametrize("command", ["verify", "convert"])
@pytest.mark.parametrize("how", sorted(TAMPERINGS))
@pytest.mark.parametrize("place", sorted(PLACES))
def test_reshard_refuses_an_archive_torch_would_read_otherwise(sources, tmp_path, place, how, command):
    """`verify` no longer vouches for it and `convert` does not carry it: refused in one line naming the file."""
    ckpt, marker, where = _tampered(sources, tmp_path, place, how)
    before = _digest(ckpt)
    args = ["verify", ckpt] if command == "verify" else ["convert", ckpt, tmp_path / "out", "--to-format", "torch_dist", "-q"]
    proc = _reshard(*args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("reshard: error:"), proc.stderr
    assert where in lines[0] and NOT_READ_ALIKE.search(lines[0]), lines[0]
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert _digest(ckpt) == before


@pytest.mark.parametrize("how", sorted(TAMPERINGS))
def test_the_trainer_refuses_an_object_torch_would_read_otherwise(sources, tmp_path, corpus, how):
    """The rng_state object, which the resume at the same layout has DCP load with `weights_only=False`: refused
    by the trainer's screen before Megatron-Core reads the checkpoint, so its payload never runs."""
    ckpt, marker, where = _tampered(sources, tmp_path, "distcp object", how)
    before = _digest(ckpt)
    with pytest.raises(RuntimeError, match="trainer: error: .*" + re.escape(where)) as info:
        run("reshard.trainer", [*_train_args(corpus), "--train-iters", 3, "--load", ckpt], nproc=1)
    assert_one_line(str(info.value))
    assert NOT_READ_ALIKE.search(str(info.value))
    assert not marker.exists()
    assert _digest(ckpt) == before


def _tensor_file_outside(ckpt: Path, tmp_path: Path) -> None:
    """Every tensor chunk's storage path in `.metadata` made to lead to a copy of its file outside the checkpoint."""
    iteration = ckpt / ITER
    with open(iteration / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    (tmp_path / "outside").mkdir()
    for index, info in metadata.storage_data.items():
        if index.offset is not None:
            shutil.copyfile(iteration / info.relative_path, tmp_path / "outside" / info.relative_path)
            metadata.storage_data[index] = type(info)(f"../../outside/{info.relative_path}", info.offset, info.length)
    with open(iteration / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _tokenizer_outside(ckpt: Path, tmp_path: Path) -> None:
    """The tokenizer.json beside the iterations replaced by a link to a copy of it outside the checkpoint."""
    shutil.move(ckpt / "tokenizer.json", tmp_path / "tokenizer.json")
    (ckpt / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("lead_out, named", [(_tensor_file_outside, f"{ITER} names '../../outside/"),
                                             (_tokenizer_outside, "dist/tokenizer.json leads outside the checkpoint")],
                         ids=["tensor storage path", "tokenizer link"])
def test_the_trainer_follows_no_path_out_of_the_checkpoint(sources, tmp_path, corpus, lead_out, named):
    """Paths reshard refuses are refused by the trainer too (issue 33, item 2), before anything is read through them."""
    ckpt = Path(shutil.copytree(sources / "dist", tmp_path / "dist", symlinks=True))
    lead_out(ckpt, tmp_path)
    before = _digest(ckpt)
    with pytest.raises(RuntimeError, match="trainer: error: .*" + re.escape(named)) as info:
        run("reshard.trainer", [*_train_args(corpus), "--train-iters", 3, "--load", ckpt], nproc=1)
    assert_one_line(str(info.value))
    assert _digest(ckpt) == before
