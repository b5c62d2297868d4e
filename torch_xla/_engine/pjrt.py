"""The PJRT runtime, through jax: platform selection, devices, dtypes, transfers.

Everything that touches a `jax.Array` buffer directly lives here, so the rest of
the engine speaks only of IR nodes and tensors.
"""
from __future__ import annotations

import contextlib
import os
from typing import List, Tuple

import numpy as np
import ml_dtypes
import torch

from . import boot, env_vars, job, telemetry, mode, patches, tensor
from .platform import policy


class _FromJax:
    """What this process learns from jax at first use: `platform`, `devices` (this
    process's, in ordinal order) and `annotation` (jax's `TraceAnnotation`, for `phase`).
    Looked up by the first thread that asks, without a lock (a race looks the same value
    up twice); read by any thread."""
    __slots__ = ("platform", "devices", "annotation")

    def __init__(self):
        self.platform = None
        self.devices = None
        self.annotation = None


class _Placement:
    """`sharding`: where new device data goes by default (None: this process's device).
    Set by `partitioning.enable` in the thread that turns SPMD on, before its first
    tensor; read by any thread that transfers data."""
    __slots__ = ("sharding",)

    def __init__(self):
        self.sharding = None


_from_jax = _FromJax()
_placement = _Placement()


def jax_module():
    """Returns the initialised `jax` module (x64 on, platform chosen by PJRT_DEVICE)."""
    return boot.start_jax()


def phase(name: str):
    """A profiler annotation of an engine phase (`torch_xla.debug.profiler` traces show it).
    When no trace is being captured it costs one C++ check (~0.3 us): it is used per
    barrier, compile, execution and transfer, never per traced op."""
    if _from_jax.annotation is None:
        if not boot.started():
            return contextlib.nullcontext()   # nothing to trace before jax runs
        from jax.profiler import TraceAnnotation
        _from_jax.annotation = TraceAnnotation
    return _from_jax.annotation(name)


def platform() -> str:
    """The PJRT platform name in the specification's spelling: CPU, CUDA or TPU."""
    if _from_jax.platform is None:
        jax = jax_module()
        p = jax.default_backend()
        _from_jax.platform = {"cpu": "CPU", "gpu": "CUDA", "cuda": "CUDA", "rocm": "ROCM", "tpu": "TPU"}.get(p, p.upper())
    return _from_jax.platform


def local_devices():
    """The jax devices this process owns, in ordinal order."""
    if _from_jax.devices is None:
        jax = jax_module()
        _from_jax.devices = list(jax.local_devices())
    return _from_jax.devices


def device_count() -> int:
    """The `xla:N` devices this process shows: its devices, or one virtual device in SPMD
    mode (where a program spans all of them)."""
    return 1 if mode.modes.spmd else len(local_devices())


def default_device():
    return local_devices()[0]


# ---------------------------------------------------------------------------------------
# the device index: this process's device is `xla:<index>`

def _platform_name() -> str:
    """The platform, from PJRT_DEVICE when set (without starting jax), else jax's."""
    chosen = env_vars.get("PJRT_DEVICE").split("_")[0].upper()
    if chosen:
        return {"GPU": "CUDA"}.get(chosen, chosen)
    return platform()


def index_rule(platform_name: str, world_size: int, global_ordinal: int, spmd: bool) -> Tuple[int, bool]:
    """(device index, whether devices are numbered by ordinal) of a process of a job.

    One process alone, and SPMD mode (one logical device over the job's), use `xla:0`.
    In a multi-process job the platform policy decides: PyTorch/XLA numbers a device by
    its index among the devices of the process that drives it, which on CPU (one process
    with a thread per device there, a process per device here) is the replica's global
    ordinal, and on GPU and TPU (a process per device there too) is 0.
    """
    if spmd or world_size <= 1:
        return 0, False
    pol = policy(platform_name)
    return pol.device_index(global_ordinal), pol.ordinal_device_index


def _decide_device_index() -> int:
    """The index of this process's device, decided once, before its first tensor."""
    spmd = mode.spmd_requested()
    world = job.world_size()
    name = _platform_name() if world > 1 and not spmd else ""
    index, numbered = index_rule(name, world, job.global_ordinal(), spmd)
    if numbered:
        # Every replica of such a job, whatever its index, runs the backward the same way.
        patches.install("inline_backward")
    return index


tensor.set_index_resolver(_decide_device_index)


def device_index() -> int:
    """This process's device index: its device is `xla:<index>` (decided at first use)."""
    return tensor.device_index()


def device_indices() -> List[int]:
    """The indices of this process's `xla` devices (`torch_xla.devices()`): from its
    device index on, one per device it shows."""
    base = device_index()
    return list(range(base, base + device_count()))


def forget_device_index() -> None:
    """Decide the index again at the next use: a launched replica forked from a parent
    that had asked for its device. Tensors made before (the parent's) keep theirs."""
    if not tensor.tensors_made():
        tensor.set_device_index(None)


def device_error(device: torch.device) -> str:
    """Why `device` (an xla device naming another index) cannot be used here."""
    mine = device_index()
    if job.world_size() > 1 and device.index not in device_indices():
        return (f"{device} is not a device of this process: process {job.global_ordinal()} of the "
                f"{job.world_size()}-process job has one device, xla:{mine} (torch_xla.device()); "
                f"each process of a multi-process job computes on its own device. Tensors another "
                f"process saved on its device load here with torch.load(f, map_location="
                f"{{'{device}': 'xla'}}), or map_location='cpu'")
    return (f"{device}: each process of torch-xla-jax computes on one device, xla:{mine}; use one "
            f"process per device (torch_xla.launch / xmp.spawn) to use several")


# ---------------------------------------------------------------------------------------
# dtypes

# complex32 has no XLA type: the device holds it as complex64 whose parts are float16
# values (rounded after every op, `is_complex32`), and transfers convert. The marked dtype
# equals complex64 everywhere (jax, numpy, dict keys); only its metadata tells them apart.
COMPLEX32 = np.dtype(np.complex64, metadata={"torch": "complex32"})

_TORCH_TO_NP = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.bool: np.dtype(np.bool_),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
    torch.complex32: COMPLEX32,
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
}
_NP_TO_TORCH = {v: k for k, v in _TORCH_TO_NP.items() if k is not torch.complex32}


_FLOATS = (torch.float32, torch.float64)
_LONGS = (torch.int64, torch.uint64)


def _storage_overrides(group: tuple) -> dict:
    """The device dtype of each torch dtype of `group` under XLA_USE_BF16 /
    XLA_DOWNCAST_BF16 (floats) or XLA_USE_32BIT_LONG (64-bit integers)."""
    if group is _FLOATS:
        bf16 = np.dtype(ml_dtypes.bfloat16)
        if env_vars.get("XLA_USE_BF16"):
            return {torch.float32: bf16, torch.float64: bf16}
        if env_vars.get("XLA_DOWNCAST_BF16"):
            return {torch.float32: bf16, torch.float64: np.dtype(np.float32)}
    elif env_vars.get("XLA_USE_32BIT_LONG"):
        return {torch.int64: np.dtype(np.int32), torch.uint64: np.dtype(np.uint32)}
    return {t: _TORCH_TO_NP[t] for t in group}


# Each group's variables are read at the first look-up of one of its dtypes, not at import:
# a program that sets them after `import torch_xla` but before its first xla tensor of that
# kind gets the mapping it asked for. Fixed from then on, as tensors already on the device
# were stored with it.
_DEVICE_DTYPE = {k: v for k, v in _TORCH_TO_NP.items() if k not in _FLOATS + _LONGS}


def device_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy/jax dtype that holds a torch dtype on the device."""
    try:
        return _DEVICE_DTYPE[dtype]
    except KeyError:
        group = _FLOATS if dtype in _FLOATS else _LONGS if dtype in _LONGS else None
        if group is None:
            raise TypeError(f"dtype {dtype} is not supported on the xla device") from None
        _DEVICE_DTYPE.update(_storage_overrides(group))
        return _DEVICE_DTYPE[dtype]


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    try:
        return _TORCH_TO_NP[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported on the xla device") from None


def torch_dtype(dtype) -> torch.dtype:
    return _NP_TO_TORCH[np.dtype(dtype)]


def is_supported_dtype(dtype: torch.dtype) -> bool:
    return dtype in _TORCH_TO_NP


def is_complex32(dtype) -> bool:
    """Whether a numpy/jax dtype is the device form of torch.complex32."""
    meta = getattr(dtype, "metadata", None)
    return meta is not None and meta.get("torch") == "complex32"


# ---------------------------------------------------------------------------------------
# transfers

def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A private numpy copy of a CPU tensor (the device must never alias torch memory)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    dt = t.dtype
    if dt not in _TORCH_TO_NP:
        raise TypeError(f"dtype {dt} is not supported on the xla device")
    t = t.contiguous()
    if dt == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    if dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy().view(_TORCH_TO_NP[dt]).copy()
    if dt == torch.complex32:
        return t.to(torch.complex64).numpy().astype(COMPLEX32)
    if dt in (torch.uint16, torch.uint32, torch.uint64):
        return np.array(t.tolist(), dtype=_TORCH_TO_NP[dt]).reshape(tuple(t.shape))
    return t.numpy().copy()


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `dtype` holding a copy of a host array."""
    a = np.asarray(a)
    want = _TORCH_TO_NP[dtype]
    if a.dtype != want:
        a = a.astype(want)
    if dtype == torch.bfloat16:
        bits = np.ascontiguousarray(a).view(np.int16).reshape(a.shape)
        return torch.from_numpy(bits.copy()).view(torch.bfloat16)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        bits = np.ascontiguousarray(a).view(np.uint8).reshape(a.shape)
        return torch.from_numpy(bits.copy()).view(dtype)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        return torch.tensor(a.tolist(), dtype=dtype).reshape(a.shape)
    if dtype == torch.complex32:
        return torch.from_numpy(np.array(a, dtype=np.complex64)).to(torch.complex32)
    return torch.from_numpy(np.array(a, copy=True))


class HostArray:
    """SPMD device data still on the host: it is transferred once, at its first use by a
    program (replicated) or at its annotation (only the pieces each device holds), so a
    model never needs a full copy on every device before it is sharded."""
    __slots__ = ("host", "sharding", "__weakref__")
    is_fully_replicated = True
    is_fully_addressable = True

    def __init__(self, host: np.ndarray, sharding):
        self.host = host
        self.sharding = sharding  # where it goes by default

    @property
    def shape(self):
        return self.host.shape

    @property
    def dtype(self):
        return self.host.dtype

    @property
    def nbytes(self) -> int:
        return self.host.nbytes

    def __array__(self, dtype=None, copy=None):
        return self.host if dtype is None else self.host.astype(dtype)

    def block_until_ready(self):
        return self

    def place(self, sharding=None):
        """The data on the devices, laid out as `sharding` (default: replicated)."""
        telemetry.inc("VirtualDeviceUsage")
        with telemetry.timed("TransferToDeviceTime"):
            return jax_module().device_put(self.host, sharding or self.sharding)


def set_placement(sharding) -> None:
    """Where new device data goes by default (SPMD: replicated over every device, placed
    at its first use)."""
    _placement.sharding = sharding


def put(host: np.ndarray, device=None):
    """Starts an asynchronous host-to-device transfer; returns the jax.Array (in SPMD mode
    without an explicit placement: a `HostArray`, transferred at first use)."""
    if device is None and _placement.sharding is not None:
        return HostArray(host, _placement.sharding)
    jax = jax_module()
    with phase("torch_xla::transfer_to_device"), telemetry.timed("TransferToDeviceTime"):
        return jax.device_put(host, device or default_device())


def fetch(array) -> np.ndarray:
    """Waits for a device buffer and copies it to the host (a sharded one is gathered)."""
    if _placement.sharding is not None and type(array) is not HostArray and len(array.sharding.device_set) > 1:
        # Data of the SPMD device (sharded or replicated) read back as one tensor.
        telemetry.inc("ReplicateShardedData")
        if not array.is_fully_replicated and not array.is_fully_addressable:
            # Other hosts hold some pieces: gather them (every host calls this together).
            from jax.experimental import multihost_utils
            return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    with phase("torch_xla::transfer_from_device"):
        return np.asarray(array)


def wait_all_buffers() -> None:
    """Blocks until every buffer this process has launched work for is ready."""
    jax = jax_module()
    for a in jax.live_arrays():
        try:
            a.block_until_ready()
        except jax.errors.JaxRuntimeError:
            # A buffer donated (another thread's step) since live_arrays() listed it has
            # nothing left to wait for; a failed execution is raised.
            if not a.is_deleted():
                raise


def memory_info(device=None) -> dict:
    """Memory use of the device, from PJRT's statistics (host RSS on CPU, which has none)."""
    dev = default_device()
    stats = None
    try:
        stats = dev.memory_stats()
    except jax_module().errors.JaxRuntimeError:  # a platform without allocator statistics
        stats = None
    if stats:
        used = int(stats.get("bytes_in_use", 0))
        limit = int(stats.get("bytes_limit", 0))
    else:
        jax = jax_module()
        used = sum(a.nbytes for a in jax.live_arrays())
        try:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            pages = 0
        limit = int(pages)
    return {"bytes_used": used, "bytes_limit": limit, "peak_bytes_used": used,
            "kb_free": max(limit - used, 0) // 1024, "kb_total": limit // 1024}


def unspecified_sharding():
    """jax's marker for an output whose sharding XLA chooses (None if this jax has none)."""
    jax_module()
    try:
        from jax._src.sharding_impls import UNSPECIFIED
    except ImportError:
        return None
    return UNSPECIFIED
