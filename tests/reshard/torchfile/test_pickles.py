"""Other packages' pickles read and written back without them, against `torch.load` of what `torch.save` wrote;
any global off the allow-list refused by name, before anything runs."""

import argparse
import collections
import fractions
import io
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from reshard.torchfile.archive_reader import load_archive
from reshard.torchfile.archive_writer import save_archive
from reshard.torchfile.pickles import LEGACY_STORAGE_TYPES, Call, UnsafeGlobal, named


def _megatron_like_state():
    """What Megatron keeps in common.pt and per-module objects: args with torch dtypes and enums, RNG states
    (numpy and torch), nested containers, a tensor and a view sharing its storage."""
    weights = torch.arange(12, dtype=torch.float32).to(torch.bfloat16)
    args = argparse.Namespace(params_dtype=torch.bfloat16, exit_signal=signal.SIGTERM, lr=3e-4, layers=[2, 2], name="gpt")
    return {
        "args": args,
        "iteration": 10,
        "rng_state": [{"random_rng_state": (3, tuple(range(5)), None), "np_rng_state": np.random.RandomState(0).get_state(),
                       "torch_rng_state": torch.ByteTensor([1, 2, 3])}],
        "extra": {"weights": weights, "tail": weights[4:], "empty": torch.zeros(0, dtype=torch.int64)},
        "containers": (collections.OrderedDict(a=1), {3, 4}, b"\x00\xff", 2 + 3j),
    }


def _round_trip(value):
    saved = io.BytesIO()
    torch.save(value, saved)
    saved.seek(0)
    again = io.BytesIO()
    save_archive(load_archive(saved, "test"), again)
    again.seek(0)
    return torch.load(again, weights_only=False)


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, argparse.Namespace):
        return type(b) is argparse.Namespace and _equal(vars(a), vars(b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple, collections.deque)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_torch_loads_what_we_write_back_as_what_torch_saved():
    state = _megatron_like_state()
    back = _round_trip(state)
    assert _equal(back, state)
    assert back["args"].params_dtype is torch.bfloat16 and back["args"].exit_signal is signal.SIGTERM
    assert back["extra"]["tail"].untyped_storage().data_ptr() == back["extra"]["weights"].untyped_storage().data_ptr()


def test_loading_builds_stand_ins_that_name_the_originals():
    saved = io.BytesIO()
    torch.save(_megatron_like_state(), saved)
    saved.seek(0)
    state = load_archive(saved, "test")
    args = state["args"]
    assert isinstance(args, argparse.Namespace) and str(args.params_dtype) == "torch.bfloat16"
    assert args.params_dtype is named("torch", "bfloat16")
    assert isinstance(args.exit_signal, Call) and (args.exit_signal.function, args.exit_signal.args) == (named("signal", "Signals"), (15,))
    assert args.lr == 3e-4 and args.layers == [2, 2]


def test_a_pickled_call_is_refused_by_name_before_anything_runs(tmp_path):
    """A pickle that calls `os.system` when torch loads it: refused, naming the file and the global; nothing ran
    and nothing was imported."""
    marker = tmp_path / "ran"
    script = f"""
import io, os, sys, pickle, zipfile
class Evil:
    def __reduce__(self):
        return os.system, ("touch {marker}",)
data = io.BytesIO()
with zipfile.ZipFile(data, "w") as zf:
    zf.writestr("archive/data.pkl", pickle.dumps({{"x": Evil()}}, protocol=2))
    zf.writestr("archive/version", "3\\n")
data.seek(0)
from reshard.torchfile.archive_reader import load_archive
from reshard.torchfile.pickles import UnsafeGlobal
try:
    load_archive(data, "common.pt")
    raise SystemExit("not refused")
except UnsafeGlobal as exc:
    assert str(exc).startswith("common.pt pickles posix.system,"), exc
assert not os.path.exists("{marker}"), "the pickle ran"
assert "torch" not in sys.modules, "torch was imported"
"""
    subprocess.run([sys.executable, "-c", script], check=True)
    assert not marker.exists()


def _function():
    """A module-level function: pickled by reference."""


class _Unknown:
    """An instance of a class of a module torch and megatron do not know (this test's)."""


@pytest.mark.parametrize("value, named_global", [
    (_function, f"{__name__}._function"),
    (_Unknown(), f"{__name__}._Unknown"),
    (argparse.Namespace(lr=1e-3, hook=[{"deep": exec}]), "builtins.exec"),
    (collections.defaultdict(list), "collections.defaultdict"),
    (fractions.Fraction(1, 3), "fractions.Fraction"),
    (os.system, "posix.system"),
])
def test_what_the_allow_list_does_not_know_is_refused_by_name(value, named_global):
    """Unknown objects are not carried into output that reshard vouches for: a function, an instance of an unknown
    class, a callable nested inside the args, harmless-looking containers of other modules."""
    saved = io.BytesIO()
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=1), "extra": value}, saved)
    saved.seek(0)
    with pytest.raises(UnsafeGlobal) as refused:
        load_archive(saved, "common.pt")
    assert str(refused.value).startswith(f"common.pt pickles {named_global},") and "\n" not in str(refused.value)


def test_storage_names_match_torch():
    """Our table of torch's legacy storage classes, against torch's own."""
    ours = {getattr(torch, name): storage for name, storage in LEGACY_STORAGE_TYPES.items()}
    assert ours == torch.storage._dtype_to_storage_type_map()


def test_stand_ins_compare_and_hash_by_identity():
    """They are mutable (BUILD sets their state after they are made) and DCP's MetadataIndex objects are dict
    keys: a hash of their call, the same for every index, made writing a large `.metadata` quadratic."""
    index = named("torch.distributed.checkpoint.metadata", "MetadataIndex")
    first, second = index.__new__(index), index.__new__(index)
    assert first != second and len({first: 1, second: 2}) == 2
