"""Pickles inside a checkpoint's pickles, read through the allow-list as the outer ones are.

Transformer Engine keeps a module's `_extra_state` (its FP8 scaling state) as `pickle.dumps(state)` in a
uint8 tensor, which it loads with plain `pickle.loads`, or, in older versions, as `torch.save(state)` in a
BytesIO; Megatron-Core saves either as a pickled object. Whoever loads the model unpickles those bytes too,
and a tensor pickled with plain pickle names `torch.storage._load_from_bytes`, whose bytes `torch.load` reads
with `weights_only=False`. `screen_payloads` reads each such inner pickle (and each of theirs) with the
allow-list, so a hostile one is refused by name before anything loads it.
"""

from __future__ import annotations

import io
import math
import pickle
from argparse import Namespace
from pathlib import Path
from typing import Any, BinaryIO

from reshard.errors import ReshardError
from reshard.torchfile import PARSE_ERRORS
from reshard.torchfile.archive_reader import archive_tensor, load_archive
from reshard.torchfile.pickles import Call, Unpickler, UnsafeGlobal, is_foreign, named, tolerating_foreign

_BYTES_IO = named("_io", "BytesIO")
_ENCODE = named("_codecs", "encode")
_LOAD_FROM_BYTES = ("torch.storage", "_load_from_bytes")
# TE's FP8 recipe, which its extra state pickles: dataclasses, named tuples and enums of plain values, harmless to
# build (an `amax_compute_algo` callable would name a function, and be refused as such)
TE_RECIPE = frozenset(
    ("transformer_engine.common.recipe", name)
    for name in (
        "DelayedScaling",
        "Float8CurrentScaling",
        "MXFP8BlockScaling",
        "Float8BlockScaling",
        "Format",
        "_FormatHelper",
        "_OverrideLinearPrecision",
        "MMParams",
        "QParams",
    )
)
_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of a pre-zip `torch.save` file
EXTRA_STATE = "_extra_state"


class _InnerUnpickler(Unpickler):
    """The allow-list, TE's recipe classes, and `torch.storage._load_from_bytes`, whose argument `screen_payloads`
    screens in turn."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _LOAD_FROM_BYTES or (module, name) in TE_RECIPE:
            return named(module, name)
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:  # a pre-zip torch.save's storages: only noted
        return None


def load_screened(source: Path | BinaryIO, what: str) -> Any:
    """`load_archive(source, what)`, the pickles it holds screened too: a legacy rank file's or a common
    state's TE `_extra_state`, a BytesIO."""
    value = load_archive(source, what)
    screen_payloads(value, what)
    return value


def load_args_screened(source: Path | BinaryIO, what: str) -> tuple[Any, list[str]]:
    """`load_screened` for a file that holds Megatron-LM's `args` (common.pt, a legacy rank file), and the arguments
    dropped from it. An argument whose value holds an instance of a class off the allow-list (an RL framework's
    own: slime keeps its eval datasets' config dataclasses among the args) is dropped, instead of refusing the
    checkpoint: it describes the run, not the model, and writing it back would have whoever loads the copy import
    and build it. Only an instance made as pickle makes any object (the class's `__new__`, then its state) is
    dropped so; a class off the list called (the pickle's REDUCE, how `os.system` is run) or held as a value,
    and any of them outside the args, is refused as `load_screened` refuses it."""
    with tolerating_foreign() as named:
        try:
            value = load_archive(source, what)
        except ReshardError:
            if named:  # a stand-in called as a function (`getattr(os, "system")(...)`): what the strict read refuses
                raise UnsafeGlobal(what, *named[0]) from None
            raise
    dropped = []
    args = value.get("args") if isinstance(value, dict) else None
    if isinstance(args, Namespace):
        for name, arg in list(vars(args).items()):
            found = _foreign_in(arg)
            if found and all(isinstance(item, Call) and item.new for item in found):
                delattr(args, name)
                dropped.append(f"args.{name} ({found[0].function.module}.{found[0].function.qualname})")
    found = _foreign_in(value)
    if found:
        function = found[0].function if isinstance(found[0], Call) else found[0]
        raise UnsafeGlobal(what, function.module, function.qualname)
    screen_payloads(value, what)
    return value, dropped


def _foreign_in(value: Any) -> list[Any]:
    """The `pickles.foreign` stand-ins in `value`: objects built from one (Calls), and ones held as values."""
    found, seen, stack = [], set(), [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if is_foreign(item):
            found.append(item)
        if isinstance(item, dict):
            stack.extend((*item.keys(), *item.values()))
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, Namespace):
            stack.extend(vars(item).values())
        elif isinstance(item, Call):
            stack.extend((*item.args, *item.kwargs.values(), item.state, *item.items, *(x for kv in item.entries for x in kv)))
    return found


def screen_payloads(value: Any, what: str, extra_state: bool = False) -> None:
    """Screen the pickles held in `value` (stand-ins as the torchfile readers give them): a BytesIO's bytes, a
    storage's `_load_from_bytes` bytes, and, inside a `_extra_state` entry (or everywhere with `extra_state`),
    a uint8 tensor's bytes. A ReshardError in one line for a global off the allow-list or an undecodable one."""
    seen: set[int] = set()
    stack = [(value, extra_state)]
    while stack:
        item, inside = stack.pop()
        if id(item) in seen:  # a pickle's memo can make cycles
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            stack.extend((v, inside or (isinstance(k, str) and k.endswith(EXTRA_STATE))) for k, v in item.items())
            continue
        if isinstance(item, (list, tuple, set, frozenset)):
            stack.extend((v, inside) for v in item)
            continue
        if not isinstance(item, Call):
            continue
        inner = _inner_bytes(item, inside)
        if inner:
            stack.append((_unpickle(inner, what), True))
        stack.extend((v, inside) for v in (*item.args, *item.kwargs.values(), item.state, *item.items, *item.entries))


def _inner_bytes(call: Call, extra_state: bool) -> bytes | None:
    if call.function is _BYTES_IO:
        state = call.state if isinstance(call.state, tuple) and call.state else call.args
        return _as_bytes(state[0]) if state else None
    if (call.function.module, call.function.qualname) == _LOAD_FROM_BYTES:
        return _as_bytes(call.args[0]) if call.args else None
    if extra_state:
        record = archive_tensor(call)
        if record is not None and record.dtype == "uint8":
            if record.loaded is not None:
                return record.loaded.tobytes()
            storage = call.args[0]
            start = record.offset - storage.offset
            return storage.read()[start : start + math.prod(record.shape)]
    return None


def _as_bytes(value: Any) -> bytes | None:
    """bytes as a pickle gives them: protocol 2 spells them `_codecs.encode(text, "latin1")`."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, Call) and value.function is _ENCODE and len(value.args) == 2 and isinstance(value.args[0], str):
        try:
            return value.args[0].encode(value.args[1])
        except (LookupError, TypeError, UnicodeError):
            raise ReshardError("a pickle's bytes cannot be decoded: the checkpoint is damaged") from None
    return None


def _unpickle(data: bytes, what: str) -> Any:
    """What `torch.load` or `pickle.loads` would build from `data`, as stand-ins, deciding as `torch.load` does
    (`_is_zipfile`): a `torch.save` zip archive, or else a pre-zip `torch.save` file (its pickles: magic number,
    protocol, system info, the object, its storage keys), whose first pickle is also what `pickle.loads`
    reads. (`torch.load` tries the older tar format first only for a real file, never for these bytes.)"""
    where = f"{what} (a pickle inside it)"
    if data[:4] == b"PK\x03\x04":
        return load_archive(io.BytesIO(data), where)
    stream = io.BytesIO(data)
    try:
        first = _InnerUnpickler(stream, where).load()
        if first != _MAGIC:
            return first
        return [_InnerUnpickler(stream, where).load() for _ in range(4)]
    except (*PARSE_ERRORS, pickle.PickleError) as exc:
        raise ReshardError(f"{where} cannot be decoded ({exc.__class__.__name__}): the checkpoint is damaged") from None
