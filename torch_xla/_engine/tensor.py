"""XLA tensors: plain `torch.Tensor`s on `xla:<index>` whose lazy state rides on the Python object.

A tensor made here has sizes and strides but no storage. Its state, `t._xla`, is an
`XlaState`: an IR value (node, output index) that is either a `DeviceData` leaf
(materialised) or a pending op. User-visible tensors are wrapped in PyTorch's
functionalization, which turns views and in-place ops into functional ops before
they reach the backend; the engine itself only ever sees the inner tensors.

Every tensor of a process is on its one device, `xla:<index>`. The index is 0 unless the
runtime numbers the process's device otherwise (`runtime.device_index`: a multi-process
job on CPU names process i's device `xla:i`). It is fixed before the process's first
tensor, so the per-op path only calls the creation function chosen then.
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Callable, Optional

import torch

from . import ir, telemetry

# PyTorch's constructor of a storage-less PrivateUse1 tensor: always on device index 0.
_EMPTY_ON_0 = torch._C._acc.create_empty_tensor
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


CREATED = _CREATED = telemetry.cell("CreateXlaTensor")
_DESTROYED = telemetry.cell("DestroyXlaTensor")


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


# ---- the device index ---------------------------------------------------------------------

class _DeviceIndex:
    """This process's device index: `value` is None until fixed (`device_index()`), decided
    by `resolver` (set by the runtime, which knows the job and platform). Fixed by the first
    thread that makes a tensor, before any other can; changed only by `set_device_index`
    (SPMD mode, before any tensor)."""
    __slots__ = ("value", "resolver")

    def __init__(self):
        self.value: Optional[int] = None
        self.resolver: Optional[Callable[[], int]] = None


decided_index = _DeviceIndex()


def set_index_resolver(fn: Callable[[], int]) -> None:
    decided_index.resolver = fn


def device_index() -> int:
    """This process's device index, decided at its first use."""
    i = decided_index.value
    if i is None:
        i = decided_index.resolver() if decided_index.resolver is not None else 0
        decided_index.value = i
    return i


def tensors_made() -> bool:
    """Whether this process has made an xla tensor (the index is then fixed for good)."""
    return _create_empty is not _first_empty


def set_device_index(index: Optional[int]) -> None:
    """Fixes the index (None: decide again at the next use). Refused once a tensor was made
    on another index: tensors of one process must all be on its one device."""
    if tensors_made() and index != decided_index.value:
        raise RuntimeError(f"this process's tensors are on xla:{decided_index.value} already; its device "
                           f"cannot become {'undecided' if index is None else f'xla:{index}'}")
    decided_index.value = index


def _first_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """The creation function until the first tensor: it fixes the index and installs the
    function every later tensor is made with."""
    return creation_function()(shape, dtype)


def creation_function() -> Callable:
    """The function that makes this process's tensors (installed at its first call)."""
    global _create_empty
    if _create_empty is _first_empty:
        i = device_index()
        _create_empty = _EMPTY_ON_0 if i == 0 else _indexed_empty(i)
    return _create_empty


_create_empty = _first_empty


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLManagedTensor(ctypes.Structure):
    # DLPack's DLTensor followed by its manager context and deleter (DLPack 0.8 layout).
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_DL_EXT_DEV = 12   # DLPack's device type of an extension device: PyTorch's PrivateUse1
# Prototypes of our own: `ctypes.pythonapi`'s function objects are shared with every
# library of the process, which may set other argtypes on them (jax.ffi.pycapsule does).
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_raw_malloc = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(("PyMem_RawMalloc", ctypes.pythonapi))
_DL_DTYPES = {}


def _dl_dtype(dtype: torch.dtype) -> tuple:
    """DLPack's (code, bits, lanes) of a dtype, as PyTorch's own exporter writes it."""
    d = _DL_DTYPES.get(dtype)
    if d is None:
        cap = torch._C._to_dlpack(torch.empty(0, dtype=dtype))
        t = _DLManagedTensor.from_address(_capsule_pointer(cap, b"dltensor")).dtype
        d = _DL_DTYPES[dtype] = (t.code, t.bits, t.lanes)
    return d


def _dl_record(index: int, like: torch.Tensor) -> int:
    """The address of a DLPack record describing a storage-less tensor on `xla:<index>`
    with the sizes, strides and dtype of `like`.

    PyTorch makes no such tensor from Python without dispatching to the device's kernels
    (`create_empty_tensor` always says device 0; a factory would come back here), except
    through DLPack, whose extension device is PrivateUse1 with the index we write. Every
    import of the record makes a new tensor with its own (empty) storage: tensors must not
    share a storage, which PyTorch reads as aliasing (custom-op checks, aot_autograd's
    input analysis, `torch.save`'s storage table). The record has no deleter, so PyTorch
    never touches it after the import and one record serves every tensor of its
    (sizes, dtype); it is raw memory, never freed (one per (sizes, dtype) of the process, and
    one per (sizes, strides, dtype) of `with_strides`).
    """
    shape, strides = tuple(like.shape), like.stride()
    n = len(shape)
    size = ctypes.sizeof(_DLManagedTensor) + 16 * max(n, 1)
    addr = _raw_malloc(size)
    if not addr:
        raise MemoryError("no memory for a DLPack record")
    ctypes.memset(addr, 0, size)
    rec = _DLManagedTensor.from_address(addr)
    dims = (ctypes.c_int64 * max(n, 1)).from_address(addr + ctypes.sizeof(_DLManagedTensor))
    steps = (ctypes.c_int64 * max(n, 1)).from_address(addr + ctypes.sizeof(_DLManagedTensor) + 8 * max(n, 1))
    for k in range(n):
        dims[k], steps[k] = shape[k], strides[k]
    rec.device = _DLDevice(_DL_EXT_DEV, index)
    rec.ndim = n
    rec.dtype = _DLDataType(*_dl_dtype(like.dtype))
    rec.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    rec.strides = ctypes.cast(steps, ctypes.POINTER(ctypes.c_int64))
    return addr


_from_dlpack = torch._C._from_dlpack
_DLTENSOR = b"dltensor"


def _indexed_empty(index: int) -> Callable:
    """The creation function of tensors on `xla:<index>`, index > 0: an import of the
    DLPack record of (sizes, dtype) (`_dl_record`, made once per (sizes, dtype); ~0.55 us
    a tensor against ~0.35 us for PyTorch's device-0 constructor)."""
    records = {}

    def record(shape, dtype: torch.dtype) -> int:
        """The DLPack record of (sizes, dtype) on `xla:<index>`."""
        key = (tuple(shape), dtype)
        r = records.get(key)
        if r is None:
            r = records[key] = _dl_record(index, _EMPTY_ON_0(shape, dtype))
        return r

    def create(shape, dtype: torch.dtype, _records=records, _new=_capsule_new, _import=_from_dlpack,
               _name=_DLTENSOR) -> torch.Tensor:
        try:
            r = _records[shape, dtype]
        except (KeyError, TypeError):   # a new (sizes, dtype), or sizes given as a list
            r = record(shape, dtype)
        return _import(_new(r, _name, None))

    create.record = record
    return create


_STRIDED_RECORDS: dict = {}


def with_strides(t: torch.Tensor, strides: tuple) -> torch.Tensor:
    """Inner tensor `t` (its state moved) on a tensor reporting `strides`, unless they are
    its own. Transpositions report the strides eager PyTorch gives them: autograd's matrix
    product derivatives read them to choose the product whose result needs no transpose
    (a weight's gradient then reaches the optimizer in its own layout)."""
    strides = tuple(strides)
    if strides == t.stride():
        return t
    shape, dtype = tuple(t.shape), t.dtype
    key = (shape, strides, dtype)
    r = _STRIDED_RECORDS.get(key)
    if r is None:
        like = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
        r = _STRIDED_RECORDS[key] = _dl_record(device_index(), like)
    out = _from_dlpack(_capsule_new(r, _DLTENSOR, None))
    out._xla = t._xla
    return out


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
