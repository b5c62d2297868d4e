"""`torch_xla.utils.utils` (xu): small helpers used by training scripts.

Synthetic data sources (`SampleGenerator`, `FnDataGenerator`), the `DataWrapper`
protocol understood by the device loaders, nested-structure helpers and
debug-print/timing helpers.
"""
from __future__ import annotations

import collections
import copy
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, List, Optional

from .._engine import env_vars as _config


# ---- synthetic data ----------------------------------------------------------------------------

class SampleGenerator:
    """An iterable returning the same `data` `sample_count` times.

    Can be used in place of a PyTorch `DataLoader` to produce synthetic data. Each
    `iter()` of the generator starts over, so one generator serves several epochs;
    `next()` on the generator itself also works (it counts its own samples).

    Args:
      data: the value returned at every step (e.g. an ``(images, labels)`` tuple).
      sample_count (int): how many times `data` is returned per iteration.
    """

    def __init__(self, data: Any, sample_count: int):
        self._data = data
        self._sample_count = int(sample_count)
        self._count = 0

    def __iter__(self) -> "_Iterator":
        return _Iterator(SampleGenerator(self._data, self._sample_count))

    def __len__(self) -> int:
        return self._sample_count

    def __next__(self):
        return self.next()

    def next(self):
        if self._count >= self._sample_count:
            raise StopIteration
        self._count += 1
        return self._data


class _Iterator:
    """One pass over a generator (a proper iterator: `iter()` returns itself)."""

    def __init__(self, gen):
        self._gen = gen

    def __iter__(self) -> "_Iterator":
        return self

    def __next__(self):
        return self._gen.next()

    def next(self):
        return self._gen.next()

    def __len__(self) -> int:
        return len(self._gen)


class FnDataGenerator:
    """An iterable of ``(data, func(data))`` pairs with fresh `data` at every step.

    Args:
      func: computes the target from the data.
      batch_size (int): the leading dimension of every generated data tensor.
      gen_tensor: called as ``gen_tensor(batch_size, *dims)`` (e.g. `torch.randn`).
      dims (sequence of int, optional): the remaining data dimensions. Default: ``[1]``.
      count (int): how many pairs one iteration yields. Default: 1.
    """

    def __init__(self, func: Callable, batch_size: int, gen_tensor: Callable, dims=None, count: int = 1):
        self._func = func
        self._batch_size = batch_size
        self._gen_tensor = gen_tensor
        self._dims = list(dims) if dims else [1]
        self._count = int(count)
        self._emitted = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> "_Iterator":
        return _Iterator(FnDataGenerator(self._func, self._batch_size, self._gen_tensor, self._dims, self._count))

    def __next__(self):
        return self.next()

    def next(self):
        if self._emitted >= self._count:
            raise StopIteration
        data = self._gen_tensor(self._batch_size, *self._dims)
        target = self._func(data)
        self._emitted += 1
        return data, target


class DataWrapper:
    """Base class of custom batch containers that the device loaders can move.

    A subclass tells the loaders which tensors it holds (`get_tensors`) and how to
    rebuild itself from their device copies (`from_tensors`, returning the new object).
    """

    def __init__(self):
        pass

    def get_tensors(self):
        raise NotImplementedError("DataWrapper.get_tensors() must return a list of tensors")

    def from_tensors(self, tensors):
        raise NotImplementedError("DataWrapper.from_tensors(tensors) must return the rebuilt object")


# ---- nested structures -------------------------------------------------------------------------

def as_list(t) -> list:
    """`t` as a list (lists and tuples are converted, anything else is wrapped)."""
    return list(t) if isinstance(t, (list, tuple)) else [t]


def list_copy_append(ilist, item) -> list:
    """A copy of `ilist` with `item` appended."""
    return list(ilist) + [item]


def shape(inputs) -> list:
    """The shape of a regular nested list/tuple structure (leaves count as scalars).

    ``shape([[1, 2, 3], [4, 5, 6]]) == [2, 3]``; sub-structures must agree.
    """
    cshape = []
    if isinstance(inputs, (list, tuple)):
        lshape = None
        for item in inputs:
            ishape = shape(item)
            if lshape is None:
                lshape = ishape
            elif lshape != ishape:
                raise ValueError(f"irregular nested structure: shapes {lshape} and {ishape}")
        cshape.extend([len(inputs)] + (lshape or []))
    return cshape


def flatten_nested_tuple(inputs) -> tuple:
    """The leaves of nested lists/tuples, in order, as one flat tuple."""
    flat = []
    if isinstance(inputs, (list, tuple)):
        for item in inputs:
            flat.extend(flatten_nested_tuple(item))
    else:
        flat.append(inputs)
    return tuple(flat)


def _rebuild_sequence(orig, items):
    if isinstance(orig, tuple) and hasattr(orig, "_fields"):
        return type(orig)(*items)
    try:
        return type(orig)(items)
    except TypeError:
        return list(items) if isinstance(orig, list) else tuple(items)


def _walks_attributes(value) -> bool:
    import torch
    return (hasattr(value, "__dict__") and not isinstance(value, (type, torch.Tensor))
            and not callable(value))


def _for_each_instance(value, select_fn: Callable, fn: Callable, seen: set) -> None:
    # Every object is visited once (by identity): shared and interned values too.
    if id(value) in seen:
        return
    seen.add(id(value))
    if select_fn(value):
        fn(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _for_each_instance(k, select_fn, fn, seen)
            _for_each_instance(v, select_fn, fn, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _for_each_instance(v, select_fn, fn, seen)
    elif isinstance(value, DataWrapper):
        for v in value.get_tensors():
            _for_each_instance(v, select_fn, fn, seen)
    elif _walks_attributes(value):
        for v in list(vars(value).values()):
            _for_each_instance(v, select_fn, fn, seen)


def for_each_instance(value, select_fn: Callable, fn: Callable) -> None:
    """Calls `fn(x)` on every `x` in the nested structure `value` with `select_fn(x)` true.

    Walks lists, tuples, sets, dicts (keys and values), `DataWrapper` tensors and plain
    objects' attributes, visiting each object once (by identity).
    """
    _for_each_instance(value, select_fn, fn, set())


def _rewrite(value, select_fn, fn, memo):
    # memo: id -> (original, copy); containers are registered before their contents so
    # that cycles through dicts, lists and objects close on the copy.
    key = id(value)
    if key in memo:
        return memo[key][1]
    if select_fn(value):
        out = fn(value)
    elif isinstance(value, dict):
        try:
            out = type(value)(value.default_factory) if isinstance(value, collections.defaultdict) else type(value)()
        except TypeError:
            out = {}
        memo[key] = (value, out)
        for k, v in list(value.items()):
            k = _rewrite(k, select_fn, fn, memo)  # keys first, as for_each_instance visits them
            out[k] = _rewrite(v, select_fn, fn, memo)
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata
    elif type(value) is list:
        out = []
        memo[key] = (value, out)
        out.extend(_rewrite(v, select_fn, fn, memo) for v in value)
    elif isinstance(value, (list, tuple)):
        out = _rebuild_sequence(value, [_rewrite(v, select_fn, fn, memo) for v in value])
    elif isinstance(value, (set, frozenset)):
        out = type(value)(_rewrite(v, select_fn, fn, memo) for v in value)
    elif isinstance(value, DataWrapper):
        out = value.from_tensors([_rewrite(v, select_fn, fn, memo) for v in value.get_tensors()])
    elif _walks_attributes(value):
        out = copy.copy(value)
        memo[key] = (value, out)
        for k, v in list(vars(out).items()):
            vars(out)[k] = _rewrite(v, select_fn, fn, memo)
    else:
        out = value
    memo[key] = (value, out)
    return out


def for_each_instance_rewrite(value, select_fn: Callable, fn: Callable):
    """A copy of nested `value` where each `x` with `select_fn(x)` is replaced by `fn(x)`.

    Lists, tuples (named ones too), sets and dicts (keeping their type and a state
    dict's `_metadata`) are rebuilt, `DataWrapper`s rebuilt with `from_tensors`, plain
    objects shallow-copied with their attributes rewritten; an object reached twice is
    converted once (cycles are kept).
    """
    return _rewrite(value, select_fn, fn, {})


# ---- environment -------------------------------------------------------------------------------

def getenv_as(name: str, vtype: type, defval=None):
    """Environment variable `name` converted to `vtype` (`defval` when unset).

    Booleans accept 1/0, true/false, yes/no, on/off (any case).
    """
    return _config.getenv_as(name, vtype, defval)


class TmpFolder:
    """A temporary directory, removed when the object is deleted (or leaves a `with`)."""

    def __init__(self):
        self.name = tempfile.mkdtemp()

    def __enter__(self) -> "TmpFolder":
        return self

    def __exit__(self, *exc):
        self.cleanup()
        return False

    def cleanup(self) -> None:
        if self.name is not None:
            shutil.rmtree(self.name, ignore_errors=True)
            self.name = None

    def __del__(self):
        self.cleanup()


# ---- printing and timing -----------------------------------------------------------------------

def null_print(*args, **kwargs) -> None:  # noqa: ARG001 (print's signature, to print nothing)
    """A print function that prints nothing."""
    return None


def eprint(*args, **kwargs) -> None:
    """`print` to standard error."""
    print(*args, file=sys.stderr, **kwargs)


def get_print_fn(debug: Optional[bool] = None) -> Callable:
    """`eprint` when debugging (by default: the DEBUG environment variable is set to non-zero), else `null_print`."""
    if debug is None:
        debug = getenv_as("DEBUG", bool, False)
    return eprint if debug else null_print


def timed(fn: Callable, msg: str = "", printfn: Optional[Callable] = eprint):
    """Runs `fn()`, prints ``f"{msg}{milliseconds:.3f}ms"`` with `printfn` and returns the result.

    With ``printfn=None`` the print function is `get_print_fn()` (silent unless DEBUG).
    """
    if printfn is None:
        printfn = get_print_fn()
    start = time.time()
    result = fn()
    printfn("{}{:.3f}ms".format(msg, 1000.0 * (time.time() - start)))
    return result


class TimedScope:
    """A context manager printing ``f"{msg}{milliseconds:.3f}ms"`` at exit, unless
    `set_error` was called (``printfn=None``: `get_print_fn()`)."""

    def __init__(self, msg: str = "", printfn: Optional[Callable] = eprint):
        self._msg = msg
        self._printfn = printfn if printfn is not None else get_print_fn()
        self._error = None

    def __enter__(self) -> "TimedScope":
        self._start = time.time()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._error is None:
            self._printfn("{}{:.3f}ms".format(self._msg, 1000.0 * (time.time() - self._start)))

    def set_error(self, error) -> None:
        self._error = error


def get_free_tcp_ports(n: int = 1) -> List[int]:
    """`n` distinct TCP ports that are free on this host now (the OS picks them; each
    socket stays bound until all are chosen, so the ports differ)."""
    import socket
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
