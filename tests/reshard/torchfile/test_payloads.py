"""The pickles inside a checkpoint's pickles (Transformer Engine's `_extra_state`) are screened by the allow-list:
TE loads its uint8 tensor with plain `pickle.loads` and its older BytesIO with `torch.load`, and a tensor pickled
plainly names `torch.storage._load_from_bytes`, which `torch.load`s its bytes with `weights_only=False`."""

from __future__ import annotations

import contextlib
import hashlib
import io
import pickle
from pathlib import Path

import pytest
import torch

from fixtures.models import TINY_LLAMA
from fixtures.synthetic import write_synthetic
from reshard.errors import ReshardError
from reshard.formats import open_checkpoint
from reshard.layout import Layout
from reshard.torchfile.screen import screen
from tests.trainer.test_hostile_pickles import _into_object, _System

KEY = "decoder.layers.self_attention.linear_qkv._extra_state"


class _LegacyStorage:
    """Pickles as a storage does under plain pickle: `_load_from_bytes` of a pre-zip torch.save file, here one
    holding the payload."""

    def __init__(self, payload):
        self.payload = payload

    def __reduce__(self):
        buffer = io.BytesIO()
        torch.save(self.payload, buffer, _use_new_zipfile_serialization=False)
        return torch.storage._load_from_bytes, (buffer.getvalue(),)


def te_tensor(state) -> torch.Tensor:
    """What TE's `get_extra_state` returns: the pickled state in a uint8 tensor."""
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def te_bytes_io(state) -> io.BytesIO:
    """What older TE returned: the state saved by torch.save into a BytesIO."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer


def fp8_state() -> dict:
    """The part of TE's extra state that no TE is needed to build: its FP8 scaling tensors and plain values."""
    return {
        "scale_fwd": torch.ones(3),
        "amax_history_fwd": torch.zeros(16, 3),
        "scale_bwd": torch.ones(2),
        "amax_history_bwd": torch.zeros(16, 2),
        "extra_fp8_variables": {"num_gemms": 1, "fp8_max_fwd": 448.0},
    }


@contextlib.contextmanager
def _te_recipe():
    """TE's `DelayedScaling` recipe as its module spells it (`transformer_engine.common.recipe`; TE needs a GPU),
    importable while the context lasts (Megatron-Core would take it for TE installed)."""
    import dataclasses
    import enum
    import sys
    import types
    from typing import NamedTuple

    module = types.ModuleType("transformer_engine.common.recipe")

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
        HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: object = "max"

    for cls in (_FormatHelper, Format, DelayedScaling):
        cls.__module__ = module.__name__
        cls.__qualname__ = cls.__name__
        setattr(module, cls.__name__, cls)
    names = ("transformer_engine", "transformer_engine.common", module.__name__)
    assert not any(name in sys.modules for name in names)
    sys.modules.update({name: types.ModuleType(name) for name in names[:2]}, **{module.__name__: module})
    try:
        yield DelayedScaling
    finally:
        for name in names:
            del sys.modules[name]


def _with_recipe(**fields) -> torch.Tensor:
    with _te_recipe() as recipe:
        return te_tensor({**fp8_state(), "recipe": recipe(**fields)})


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


@pytest.fixture()
def iteration(tmp_path):
    write_synthetic(tmp_path / "ckpt", TINY_LLAMA, Layout(), "torch_dist")
    return next(p for p in (tmp_path / "ckpt").iterdir() if p.is_dir())


def _hostile(marker: Path) -> dict:
    return {
        "pickle in a uint8 tensor": te_tensor({**fp8_state(), "extra_fp8_variables": {"hook": _System(marker)}}),
        "torch.save in a BytesIO": te_bytes_io({"extra_fp8_variables": [_System(marker)]}),
        "storage bytes in the pickle": te_tensor({"scale_fwd": _LegacyStorage(_System(marker))}),
        "BytesIO in the pickle": te_tensor({"nested": te_bytes_io(_System(marker))}),
        "callable in TE's recipe": _with_recipe(amax_compute_algo=_System(marker)),
    }


@pytest.mark.parametrize("case", sorted(set(_hostile(Path("x"))) - {"BytesIO in the pickle"}))  # that one needs a second load
def test_what_te_would_unpickle_runs_the_payload_without_the_screen(tmp_path, case):
    """The attack, as TE's `set_extra_state` meets it: the marker is made (`torch.load` of the BytesIO with
    `weights_only=False`, as TE 1.x on torch < 2.6 did)."""
    marker = tmp_path / "ran"
    value = _hostile(marker)[case]
    if isinstance(value, torch.Tensor):
        with _te_recipe():
            pickle.loads(value.numpy().tobytes())
    else:
        value.seek(0)
        torch.load(value, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("case", sorted(_hostile(Path("x"))))
def test_an_inner_pickle_naming_a_global_off_the_list_is_refused(iteration, tmp_path, case):
    marker = tmp_path / "ran"
    _into_object(iteration, _hostile(marker)[case], prefix=KEY)
    before = _digest(iteration)
    with pytest.raises(ReshardError, match=r"__0_0\.distcp \(" + KEY + r"/shard_0_4\) \(a pickle inside it\) pickles posix\.system,") as info:
        screen(iteration)
    assert "\n" not in str(info.value)
    reader = open_checkpoint(iteration.parent)
    with pytest.raises(ReshardError, match=r"\(a pickle inside it\) pickles posix\.system,"):  # the reader carrying it too
        dict(reader.common.objects.items())
    assert not marker.exists() and _digest(iteration) == before


@pytest.mark.parametrize(
    "value",
    [
        None,
        torch.empty(0, dtype=torch.uint8),
        te_tensor(None),
        te_tensor(fp8_state()),
        te_bytes_io(fp8_state()),
        _with_recipe(),
    ],
    ids=["None", "empty tensor", "pickled None", "pickled fp8 state", "BytesIO of fp8 state", "with TE's recipe"],
)
def test_what_te_writes_passes(iteration, value):
    _into_object(iteration, value, prefix=KEY)
    screen(iteration)
    reader = open_checkpoint(iteration.parent)
    assert KEY + "/shard_0_4" in dict(reader.common.objects.items())


def test_a_uint8_tensor_elsewhere_is_data_not_a_pickle(iteration, tmp_path):
    """Torch keeps its RNG state in a uint8 tensor: outside `_extra_state` such bytes are never unpickled, by
    torch or Megatron-Core, nor by the screen."""
    marker = tmp_path / "ran"
    common = iteration / "common.pt"
    state = torch.load(common, weights_only=False)
    state["rng_state"] = {"torch_rng_state": te_tensor(_System(marker))}
    torch.save(state, common)
    screen(iteration)
    state[KEY] = te_tensor(_System(marker))  # the same bytes where TE's pickle lies
    torch.save(state, common)
    with pytest.raises(ReshardError, match=r"common\.pt \(a pickle inside it\) pickles posix\.system,"):
        screen(iteration)
    assert not marker.exists()
