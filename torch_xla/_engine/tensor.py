"""XLA tensors: plain `torch.Tensor`s on `xla:0` whose lazy state rides on the Python object.

A tensor made here has sizes and strides but no storage. Its state, `t._xla`, is an
`XlaState`: an IR value (node, output index) that is either a `DeviceData` leaf
(materialised) or a pending op. User-visible tensors are wrapped in PyTorch's
functionalization, which turns views and in-place ops into functional ops before
they reach the backend; the engine itself only ever sees the inner tensors.
"""
from __future__ import annotations

import threading
import weakref

import torch

from . import ir, metrics

create_empty = _create_empty = torch._C._acc.create_empty_tensor
is_functional = torch._is_functional_tensor
_from_functional = torch._from_functional_tensor
_to_functional = torch._to_functional_tensor
_sync_functional = torch._sync
_tls_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_FUNCTIONALIZE = torch._C.DispatchKey.Functionalize


class XlaState:
    """The lazy state of one XLA tensor: an IR value plus its aval."""
    __slots__ = ("node", "idx", "shape", "dtype", "__weakref__")

    def __init__(self, node: ir.Node, idx: int, shape: tuple, dtype: torch.dtype):
        self.node = node
        self.idx = idx
        self.shape = shape
        self.dtype = dtype

    @property
    def is_data(self) -> bool:
        return type(self.node) is ir.DeviceData

    def set_data(self, node: ir.DeviceData) -> None:
        """Points this state at device data (an executed value)."""
        self.node = node
        self.idx = 0
        data_states.add(self)


CREATED = _CREATED = metrics.cell("CreateXlaTensor")
_DESTROYED = metrics.cell("DestroyXlaTensor")


class TensorState(XlaState):
    """The state of a tensor holding a new value (an op's output, transferred data):
    counted by `CreateXlaTensor` when made and `DestroyXlaTensor` when freed."""
    __slots__ = ()

    def __del__(self):
        _DESTROYED[0] += 1


class _Pending:
    """Weak references to the states that hold pending IR (the barrier's roots)."""

    def __init__(self):
        self.refs = []
        self.lock = threading.RLock()

    def add(self, state: XlaState) -> None:
        self.refs.append(weakref.ref(state))

    def take_live(self):
        """Returns the live states with pending IR, and forgets the rest."""
        # Copy then delete the copied prefix: appends racing with this (other threads
        # tracing) land after the prefix and are kept for the next barrier.
        with self.lock:
            refs = self.refs[:]
            del self.refs[:len(refs)]
        out = []
        seen = set()
        for r in refs:
            s = r()
            if s is not None and type(s.node) is not ir.DeviceData and id(s) not in seen:
                seen.add(id(s))
                out.append(s)
        return out

    def restore(self, states) -> None:
        with self.lock:
            self.refs.extend(weakref.ref(s) for s in states)


pending = _Pending()
_pending_refs = pending.refs   # never rebound: take_live deletes a prefix in place
_new = object.__new__
_weak = weakref.ref
# Every state that has pointed at device data since its last barrier: the executor reads
# which DeviceData leaves live tensors hold from here (donation.py).
data_states: "weakref.WeakSet[XlaState]" = weakref.WeakSet()


def make_tensor(node: ir.Node, idx: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A new inner (non-functional) XLA tensor holding IR value (node, idx)."""
    _CREATED[0] += 1
    t = _create_empty(shape, dtype)
    # Made without the class call (once per traced op: `_new` and slot stores cost less).
    t._xla = s = _new(TensorState)
    s.node = node
    s.idx = idx
    s.shape = tuple(shape)
    s.dtype = dtype
    if type(node) is not ir.DeviceData:
        _pending_refs.append(_weak(s))
    else:
        data_states.add(s)
    return t


def make_alias(s: XlaState) -> torch.Tensor:
    """A new inner XLA tensor holding the same value as state `s` (an alias: not counted
    as a new tensor)."""
    t = _create_empty(s.shape, s.dtype)
    t._xla = XlaState(s.node, s.idx, s.shape, s.dtype)
    point_at(t._xla, s)
    return t


def wrap_user(t: torch.Tensor) -> torch.Tensor:
    """Wraps a fresh inner tensor for the user, unless we are inside functionalization."""
    if _tls_excluded(_FUNCTIONALIZE):
        return t
    return _to_functional(t)


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The inner XLA tensor of `t` (syncing a functional wrapper's pending updates)."""
    if is_functional(t):
        _sync_functional(t)
        return _from_functional(t)
    return t


def state_of(t: torch.Tensor) -> XlaState:
    """The lazy state of an XLA tensor, inner or wrapped."""
    try:
        return t._xla
    except AttributeError:
        pass
    inner = unwrap(t)
    try:
        return inner._xla
    except AttributeError:
        raise RuntimeError(
            f"tensor on {t.device} has no XLA data (it was not created by torch_xla)") from None


def replace_state(t: torch.Tensor, src: XlaState) -> None:
    """Points the inner tensor of `t` at another state's value (in-place engine writes)."""
    inner = unwrap(t)
    s = inner._xla
    point_at(s, src)


def point_at(s: XlaState, src: XlaState) -> None:
    """Makes state `s` hold the value of `src` (same shape and dtype)."""
    s.node, s.idx = src.node, src.idx
    if type(s.node) is not ir.DeviceData:
        pending.add(s)
    else:
        data_states.add(s)
