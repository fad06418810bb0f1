"""Pickles of other packages' objects, read and written back without importing those packages.

Megatron keeps a checkpoint's arguments, iteration and per-module objects (RNG states, extra states)
as pickles naming torch, numpy and Megatron classes. A conversion rewrites a few arguments and passes
the rest through, so it need not build any of those objects: `Unpickler` gives every class or function
a pickle names a stand-in (`named`) that only remembers its name, and every object built by calling
one a `Call` that only remembers the call, its state and its items. `Pickler` writes them back as the
same opcodes. Nothing in the file runs (unlike `torch.load(weights_only=False)`), and nothing is
imported: importing torch was a fifth of a 3 GB conversion (benchmarks/README.md, "Measurements behind defaults").

Only the globals of `SAFE_GLOBALS` are read; any other is refused by name (`UnsafeGlobal`): torch and
Megatron-Core load these files with `weights_only=False` or plain `pickle` in places (DCP's objects and
`.metadata`), where a global such as `os.system` would run, and reshard must neither carry one into
what it writes nor vouch for a checkpoint holding one (`screen`).

`argparse.Namespace` and `collections.OrderedDict` are built for real: readers look into the arguments.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import contextvars
import functools
import pickle
from argparse import Namespace
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from reshard.dtypes import DTYPE_NAMES
from reshard.errors import ReshardError

_UNSET = object()

# torch pickles a storage by the name of its legacy typed class ("BFloat16Storage") where the dtype has
# one; newer dtypes (float8, unsigned ints) as an UntypedStorage of bytes, the dtype in `_rebuild_tensor_v3`
# (a test checks this table against torch's `_dtype_to_storage_type_map`).
LEGACY_STORAGE_TYPES: dict[str, str] = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
    "qint8": "QInt8Storage",
    "qint32": "QInt32Storage",
    "quint8": "QUInt8Storage",
    "quint4x2": "QUInt4x2Storage",
    "quint2x4": "QUInt2x4Storage",
}
# What a checkpoint's pickles may name: each harmless for torch to call with any arguments (a type that only
# keeps its arguments, an enum looked up by value, torch's tensor rebuilders). It is torch's own `weights_only`
# list and megatron-core's `safe_globals.SAFE_GLOBALS` (which megatron-core adds to it), less what those
# hold that no checkpoint does (tensor subclasses, devices).
SAFE_GLOBALS = frozenset(
    {
        ("argparse", "Namespace"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),  # how protocol 2 pickles a set, bytes and a complex number
        ("_codecs", "encode"),
        ("builtins", "complex"),
        ("types", "SimpleNamespace"),
        ("pathlib", "PosixPath"),
        ("_io", "BytesIO"),
        ("signal", "Signals"),
        ("torch", "Size"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("torch.serialization", "_get_layout"),
        *(("torch", name) for name in (*DTYPE_NAMES, *LEGACY_STORAGE_TYPES.values())),
        ("torch.storage", "UntypedStorage"),  # of the dtypes without a legacy storage
        ("numpy.core.multiarray", "_reconstruct"),  # numpy 1's name, and numpy 2's
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.dtypes", "UInt32DType"),
        ("megatron.core.enums", "ModelType"),
        ("megatron.core.transformer.enums", "AttnBackend"),
        ("megatron.core.transformer.enums", "CudaGraphScope"),
        ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"),
        *(("megatron.core.rerun_state_machine", name) for name in ("RerunDiagnostic", "RerunMode", "RerunState")),
    }
)


class UnsafeGlobal(ReshardError):
    """A pickle names a global off the allow-list: refused before anything is built from it."""

    def __init__(self, what: str, module: str, name: str):
        super().__init__(
            f"{what} pickles {module}.{name}, which is not on reshard's list of what a checkpoint may hold "
            "(loading it with torch could run code): refusing the checkpoint; if you trust it, load it with torch "
            "and save it again without that object"
        )


class Named(type):
    """The type of a stand-in: a class or function of another package, by name. Calling it (a pickle's
    REDUCE) records the call."""

    module: str
    qualname: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Call:
        return Call(cls, args, kwargs, new=False)

    def __repr__(cls) -> str:
        return f"{cls.module}.{cls.qualname}"

    __str__ = __repr__


class _Standin(metaclass=Named):
    def __new__(cls, *args: Any, **kwargs: Any) -> Call:  # a pickle's NEWOBJ: cls.__new__(cls, *args)
        return Call(cls, args, kwargs, new=True)


@functools.cache
def named(module: str, qualname: str) -> Named:
    """The stand-in for `module.qualname` (one per name, so stand-ins compare by name)."""
    return Named(qualname, (_Standin,), {"module": module, "qualname": qualname})


class Call:
    """An object a pickle builds from a stand-in: `function(*args)` (or `function.__new__`), then its state
    (BUILD) and the items appended to it or set in it. Compared and hashed by identity, as it is mutable
    and used as a dict key (DCP's `MetadataIndex`: a hash of its call's arguments, the same for every
    index, made writing a 12 GB checkpoint's `.metadata` quadratic)."""

    def __init__(self, function: Named, args: tuple, kwargs: dict[str, Any], new: bool):
        self.function, self.args, self.kwargs, self.new = function, args, kwargs, new
        self.state: Any = _UNSET
        self.items: list[Any] = []
        self.entries: list[tuple[Any, Any]] = []

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.entries.append((key, value))

    def __repr__(self) -> str:
        return f"{self.function!r}{self.args!r}"


_REAL = {("argparse", "Namespace"): Namespace, ("collections", "OrderedDict"): OrderedDict}


class Foreign(_Standin):
    """A stand-in's base for a global off the allow-list, read only where `tolerating_foreign` is in effect."""


@functools.cache
def foreign(module: str, qualname: str) -> Named:
    return Named(qualname, (Foreign,), {"module": module, "qualname": qualname})


def is_foreign(value: Any) -> bool:
    function = value.function if isinstance(value, Call) else value
    return isinstance(function, Named) and issubclass(function, Foreign)


# Where set, a global off the allow-list is read as a `foreign` stand-in (nothing is built or imported either way)
# for the caller to drop, instead of refused, and noted in the list: see `payloads.load_args_screened`.
_TOLERATE_FOREIGN: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar("tolerate_foreign", default=None)


@contextlib.contextmanager
def tolerating_foreign() -> Iterator[list[tuple[str, str]]]:
    """Within it, globals off the allow-list are read as stand-ins; the list it gives names them, in order read."""
    found: list[tuple[str, str]] = []
    token = _TOLERATE_FOREIGN.set(found)
    try:
        yield found
    finally:
        _TOLERATE_FOREIGN.reset(token)


class Unpickler(pickle.Unpickler):
    """`what` names the file in the refusal of a global off the allow-list."""

    def __init__(self, file: Any, what: str):
        super().__init__(file)
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        module, name = python3_name(module, name)
        if (module, name) not in SAFE_GLOBALS:
            if (found := _TOLERATE_FOREIGN.get()) is not None:
                found.append((module, name))
                return foreign(module, name)
            raise UnsafeGlobal(self.what, module, name)
        return _REAL.get((module, name)) or named(module, name)

    def load(self) -> Any:
        """The pickle's object. What the pickle machine raises itself, applying the file's opcodes to what
        they name (calling a number, appending to a string, a length past memory), is the file's fault and
        becomes an UnpicklingError; what our own methods raise (`find_class`, the stand-ins') propagates."""
        try:
            return super().load()
        except (TypeError, AttributeError, MemoryError, OverflowError) as exc:
            if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
                raise  # raised in a frame below this one: Python code of ours, not the C pickle machine
            raise pickle.UnpicklingError(f"{exc.__class__.__name__}: {exc}") from exc


def python3_name(module: str, name: str) -> tuple[str, str]:
    """A global as Python 3 names it: protocol 2 (torch.save's) spells Python 2's (`__builtin__.set`), which
    `pickle`'s own `find_class` maps back as here."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def nonnegative_ints(values: Any) -> tuple[int, ...]:
    """A shape, strides or offsets a pickle holds, as a tuple; a ValueError (the file is damaged) for
    anything but a tuple or list of non-negative ints, before any of it is used as one."""
    if not isinstance(values, (tuple, list)) or not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(f"{values!r:.80} where sizes or offsets were expected")
    return tuple(values)


class Pickler(pickle._Pickler):  # the Python pickler: its dispatch table can take the stand-ins
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_named(self, obj: Named) -> None:
        if self.proto >= 4:
            self.save(obj.module)
            self.save(obj.qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.qualname}\n".encode())
        self.memoize(obj)

    def _save_call(self, obj: Call) -> None:
        self.save(obj.function)
        self.save(obj.args)
        if obj.new and obj.kwargs:
            self.save(obj.kwargs)
            self.write(pickle.NEWOBJ_EX)
        else:
            self.write(pickle.NEWOBJ if obj.new else pickle.REDUCE)
        self.memoize(obj)
        if obj.items:
            self.write(pickle.MARK)
            for item in obj.items:
                self.save(item)
            self.write(pickle.APPENDS)
        if obj.entries:
            self.write(pickle.MARK)
            for key, value in obj.entries:
                self.save(key)
                self.save(value)
            self.write(pickle.SETITEMS)
        if obj.state is not _UNSET:
            self.save(obj.state)
            self.write(pickle.BUILD)

    dispatch[Named] = _save_named
    dispatch[Call] = _save_call
