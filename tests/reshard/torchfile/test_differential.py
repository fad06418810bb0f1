"""reshard's reading of a `torch.save` blob against torch's own (issue 33, item 1): over a corpus of malformed
and adversarial archives and pickles (`fixtures/hostile_archives.py`), each is either refused by reshard, by
every one of its entry points (an in-memory blob, a file, a DCP object at an offset of a `.distcp` file), or
read by each to the very objects `torch.load(weights_only=True)` gives. A case that torch's full unpickler
runs code for is shown to run there (its marker file appears) and not through reshard."""

from __future__ import annotations

import io
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fixtures.hostile_archives import corpus
from reshard.errors import ReshardError
from reshard.torchfile import PARSE_ERRORS
from reshard.torchfile.archive_reader import RecordFile, archive_tensor
from reshard.torchfile.archive_writer import Stored
from reshard.torchfile.payloads import load_screened, screen_payloads
from reshard.torchfile.pickles import Call, Named
from tests.arrays import as_numpy, same

NAMES = [case.name for case in corpus(Path("marker"))]
OFFSET = 100  # where the blob lies in the .distcp-like file: DCP objects sit anywhere in theirs


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    marker = tmp_path_factory.mktemp("differential") / "ran"
    return marker, {case.name: case for case in corpus(marker)}


def _readers(blob: bytes, tmp_path: Path) -> dict[str, Callable[[], Any]]:
    """Each of reshard's entry points reading the blob (a refusal raises), as plain values."""
    alone, inside = tmp_path / "alone.pt", tmp_path / "inside.distcp"
    alone.write_bytes(blob)
    inside.write_bytes(b"\0" * OFFSET + blob + b"\0" * 16)
    return {
        "bytes": lambda: _plain(load_screened(io.BytesIO(blob), "blob")),
        "file": lambda: _plain(load_screened(alone, str(alone)), RecordFile(alone)),
        "object": lambda: _object(inside, len(blob)),
    }


def _object(path: Path, length: int) -> Any:
    """As `screen` and the torch_dist reader read a DCP object (both refuse what the parsers raise in one line)."""
    file = RecordFile(path)
    try:
        value = file.unpickle(OFFSET, length)
        screen_payloads(value, str(path))
        return _plain(value, file)
    except PARSE_ERRORS as exc:
        raise ReshardError(f"{path}: an object cannot be decoded ({exc.__class__.__name__})") from None
    finally:
        file.close()


def _plain(value: Any, file: RecordFile | None = None) -> Any:
    """reshard's stand-ins as plain values: a tensor as its numpy values, read from where its record says."""
    record = archive_tensor(value)
    if record is not None:
        if record.loaded is not None:
            return record.loaded
        out = np.empty(record.shape, dtype=as_numpy(torch.empty(0, dtype=getattr(torch, record.dtype))).dtype)
        file.read_into(record, tuple((0, d) for d in record.shape), out)
        return out
    if isinstance(value, Call) and repr(value.function) == "torch.Size":
        return tuple(value.args[0])
    if isinstance(value, Named):
        return repr(value)
    if isinstance(value, Stored):
        return value.read()
    return _containers(value, lambda v: _plain(v, file))


def _torch_plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return as_numpy(value)
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, torch.dtype):
        return str(value)
    return _containers(value, _torch_plain)


def _containers(value: Any, plain) -> Any:
    if isinstance(value, (dict, OrderedDict)):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and same(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


def test_the_corpus_is_large_and_mixed(cases):
    _, by_name = cases
    assert len(by_name) >= 50
    assert sum(not c.refused for c in by_name.values()) >= 10 and sum(c.runs for c in by_name.values()) >= 8


@pytest.mark.parametrize("name", NAMES)
def test_reshard_refuses_or_reads_what_torch_reads(cases, name, tmp_path):
    marker, by_name = cases
    case = by_name[name]
    marker.unlink(missing_ok=True)
    if case.refused:
        for entry, read in _readers(case.blob, tmp_path).items():
            with pytest.raises(ReshardError) as refused:
                read()
            assert "\n" not in str(refused.value), entry
        assert not marker.exists()
    else:
        theirs = _torch_plain(torch.load(io.BytesIO(case.blob), weights_only=True, map_location="cpu"))
        for entry, read in _readers(case.blob, tmp_path).items():
            ours = read()
            assert _equal(ours, theirs), (entry, ours, theirs)
    if case.runs:  # the case is what it claims: torch's full unpickler runs it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                torch.load(io.BytesIO(case.blob), weights_only=False)
            except Exception:  # noqa: BLE001 (what it does after running the payload does not matter)
                pass
        assert marker.exists()
        marker.unlink()
