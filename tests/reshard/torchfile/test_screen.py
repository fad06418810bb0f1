"""`screen` reads a checkpoint's pickles before torch does; the files it reads must lie inside the checkpoint."""

import shutil

import pytest

from fixtures.models import TINY_MOE
from fixtures.synthetic import write_synthetic
from reshard.errors import ReshardError
from reshard.layout import Layout
from reshard.torchfile import dcp_metadata
from reshard.torchfile.dcp_metadata import Storage
from reshard.torchfile.screen import screen


@pytest.fixture()
def iteration(tmp_path):
    write_synthetic(tmp_path / "ckpt", TINY_MOE, Layout(ep=2), "torch_dist")
    return next(p for p in (tmp_path / "ckpt").iterdir() if p.is_dir())


def test_a_checkpoint_of_known_globals_passes(iteration):
    screen(iteration)


def test_an_object_file_named_outside_the_checkpoint_is_refused(iteration, tmp_path):
    metadata = dcp_metadata.load(iteration / ".metadata")
    objects = [key for key, info in metadata.storage.items() if key[1] is None]
    assert objects  # the screen reads these
    (tmp_path / "outside").mkdir()
    for key in objects:
        info = metadata.storage[key]
        shutil.copyfile(iteration / info.relative_path, tmp_path / "outside" / info.relative_path)
        metadata.storage[key] = Storage(f"../../outside/{info.relative_path}", info.offset, info.length)
    dcp_metadata.save(iteration / ".metadata", metadata)
    with pytest.raises(ReshardError, match="outside the checkpoint"):
        screen(iteration)


def test_a_torch_file_linked_from_outside_is_refused(iteration, tmp_path):
    common = iteration / "common.pt"
    shutil.move(common, tmp_path / "common.pt")
    common.symlink_to(tmp_path / "common.pt")
    with pytest.raises(ReshardError, match="leads outside the checkpoint"):
        screen(iteration)


def _moved_out(iteration, tmp_path, name) -> str:
    """A copy of the checkpoint's `name` outside it, named as `.metadata` would name it: the path given."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    shutil.copyfile(iteration / name, outside / name)
    return str(outside / name)


@pytest.mark.parametrize("spelling", ["dotdot", "absolute", "symlink"])
def test_a_tensor_file_named_outside_the_checkpoint_is_refused(iteration, tmp_path, spelling):
    """DCP joins every storage path `.metadata` gives to the checkpoint's directory and opens it (tensors too, with
    `weights_only=True`): one leading out of the checkpoint is refused before torch reads any of it."""
    metadata = dcp_metadata.load(iteration / ".metadata")
    name = next(info.relative_path for (_, offsets), info in metadata.storage.items() if offsets is not None)
    target = _moved_out(iteration, tmp_path, name)
    if spelling == "symlink":
        (iteration / name).unlink()
        (iteration / name).symlink_to(target)
    else:
        path = target if spelling == "absolute" else f"../../outside/{name}"
        for key, info in metadata.storage.items():
            if key[1] is not None and info.relative_path == name:
                metadata.storage[key] = Storage(path, info.offset, info.length)
        dcp_metadata.save(iteration / ".metadata", metadata)
    with pytest.raises(ReshardError, match="outside the checkpoint") as refused:
        screen(iteration)
    assert "\n" not in str(refused.value)
