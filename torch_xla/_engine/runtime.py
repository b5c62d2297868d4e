"""The PJRT runtime, through jax: platform selection, devices, dtypes, transfers.

Everything that touches a `jax.Array` buffer directly lives here, so the rest of
the engine speaks only of IR nodes and tensors.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

import numpy as np
import ml_dtypes
import torch

_PLATFORMS = {"CPU": "cpu", "CUDA": "cuda", "GPU": "cuda", "TPU": "tpu"}
_lock = threading.Lock()
_state = {"jax": None, "devices": None, "platform": None}


def _configure_env() -> None:
    """Sets the jax options implied by the PJRT environment variables, before jax starts."""
    pjrt = os.environ.get("PJRT_DEVICE", "").upper()
    if pjrt == "CPU":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        n = os.environ.get("CPU_NUM_DEVICES")
        if n and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            # Only in a single process: in a multi-process job each process owns one device.
            from . import process_group
            if process_group.world_size() <= 1:
                os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                           f" --xla_force_host_platform_device_count={int(n)}").strip()
    elif pjrt in _PLATFORMS:
        os.environ.setdefault("JAX_PLATFORMS", _PLATFORMS[pjrt])
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
        # XLA's CPU scheduler favours concurrency by default, which keeps more buffers
        # alive: on the decoder training step (bench/) the memory-minimising order cut
        # the step's temporary buffers from 1.20 to 1.08 GB at the same step time.
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()


def jax_module():
    """Returns the initialised `jax` module (x64 on, platform chosen by PJRT_DEVICE)."""
    j = _state["jax"]
    if j is not None:
        return j
    with _lock:
        if _state["jax"] is None:
            _configure_env()
            if os.environ.get("JAX_PLATFORMS", "").lower() == "cpu":
                # Before the CPU client's threads first allocate (host_memory).
                from . import host_memory
                host_memory.configure()
            import jax
            jax.config.update("jax_enable_x64", True)
            from . import process_group
            process_group.initialize(jax)
            # Before gc.freeze(), which hides the functions it looks for.
            from . import torch_patches
            torch_patches.lazy_dynamo_disable()
            _tune_gc()
            _state["jax"] = jax
    return _state["jax"]


def _tune_gc() -> None:
    """Keeps Python's cyclic garbage collector from rescanning what tracing piles up.

    Every traced op leaves a few Python objects (IR node, tensor state) alive until the
    barrier, so the collector's full passes rescan the pending graph and the ~370k objects
    of the torch/jax imports again and again: with 20k pending ops, 63% of tracing time was
    collection (`bench/bench_gc.py`). The import-time objects move to the permanent
    generation (`gc.freeze()`; refcounting still frees them) and the youngest generation
    collects every 10,000 net allocations instead of 700. `PT_XLA_TUNE_GC=0` leaves the
    collector as it is; a threshold the program already changed is kept."""
    if os.environ.get("PT_XLA_TUNE_GC", "1") == "0":
        return
    import gc
    gc.freeze()
    t0, t1, t2 = gc.get_threshold()
    if t0 == 700:
        gc.set_threshold(10000, t1, t2)


def platform() -> str:
    """The PJRT platform name in the specification's spelling: CPU, CUDA or TPU."""
    if _state["platform"] is None:
        jax = jax_module()
        p = jax.default_backend()
        _state["platform"] = {"cpu": "CPU", "gpu": "CUDA", "cuda": "CUDA", "rocm": "ROCM", "tpu": "TPU"}.get(p, p.upper())
    return _state["platform"]


_HOST_CPU_FLAGS: Optional[frozenset] = None


def host_cpu_flags() -> frozenset:
    """The host CPU's feature flags as Linux reports them (empty where it does not)."""
    global _HOST_CPU_FLAGS
    if _HOST_CPU_FLAGS is None:
        flags = frozenset()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("flags"):
                        flags = frozenset(line.split(":", 1)[1].split())
                        break
        except OSError:
            pass
        _HOST_CPU_FLAGS = flags
    return _HOST_CPU_FLAGS


def local_devices():
    """The jax devices this process owns, in ordinal order."""
    if _state["devices"] is None:
        jax = jax_module()
        _state["devices"] = list(jax.local_devices())
    return _state["devices"]


def default_device():
    return local_devices()[0]


# ---------------------------------------------------------------------------------------
# dtypes

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
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
}
_NP_TO_TORCH = {v: k for k, v in _TORCH_TO_NP.items()}


def _storage_overrides() -> dict:
    """XLA_USE_BF16 / XLA_DOWNCAST_BF16: the dtype the device computes in for f32/f64."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    if os.environ.get("XLA_USE_BF16", "0") not in ("", "0"):
        return {torch.float32: bf16, torch.float64: bf16}
    if os.environ.get("XLA_DOWNCAST_BF16", "0") not in ("", "0"):
        return {torch.float32: bf16, torch.float64: np.dtype(np.float32)}
    return {}


_DEVICE_DTYPE = dict(_TORCH_TO_NP)
_DEVICE_DTYPE.update(_storage_overrides())


def refresh_dtype_overrides() -> None:
    """Re-reads XLA_USE_BF16 / XLA_DOWNCAST_BF16 (for tests that set them at run time)."""
    _DEVICE_DTYPE.clear()
    _DEVICE_DTYPE.update(_TORCH_TO_NP)
    _DEVICE_DTYPE.update(_storage_overrides())


def device_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy/jax dtype that holds a torch dtype on the device."""
    try:
        return _DEVICE_DTYPE[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported on the xla device") from None


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    try:
        return _TORCH_TO_NP[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported on the xla device") from None


def torch_dtype(dtype) -> torch.dtype:
    return _NP_TO_TORCH[np.dtype(dtype)]


def is_supported_dtype(dtype: torch.dtype) -> bool:
    return dtype in _TORCH_TO_NP


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
    return torch.from_numpy(np.array(a, copy=True))


def put(host: np.ndarray, device=None):
    """Starts an asynchronous host-to-device transfer; returns the jax.Array."""
    jax = jax_module()
    return jax.device_put(host, device or default_device())


def fetch(array) -> np.ndarray:
    """Waits for a device buffer and copies it to the host."""
    return np.asarray(array)


def world_size_env() -> int:
    """How many processes `torch_xla.launch` starts on this host."""
    if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
        return int(os.environ.get("CPU_NUM_DEVICES", "1") or 1)
    return 1


def wait_all_buffers() -> None:
    """Blocks until every buffer this process has launched work for is ready."""
    jax = jax_module()
    for a in jax.live_arrays():
        try:
            a.block_until_ready()
        except Exception:
            pass


def memory_info(device=None) -> dict:
    """Memory use of the device, from PJRT's statistics (host RSS on CPU, which has none)."""
    dev = default_device()
    stats = None
    try:
        stats = dev.memory_stats()
    except Exception:
        stats = None
    if stats:
        used = int(stats.get("bytes_in_use", 0))
        limit = int(stats.get("bytes_limit", 0))
    else:
        import resource
        jax = jax_module()
        used = sum(a.nbytes for a in jax.live_arrays())
        try:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            pages = 0
        limit = int(pages)
    return {"bytes_used": used, "bytes_limit": limit, "peak_bytes_used": used,
            "kb_free": max(limit - used, 0) // 1024, "kb_total": limit // 1024}
