"""`torch_xla.runtime` (xr): the PJRT runtime's view of devices, processes and caches."""
from __future__ import annotations

import sys
from typing import Dict, List, Optional

from ._engine import pjrt as _rt
from ._engine import job as _pg
from ._engine import env_vars as _config
from ._engine import mode as _mode
from ._engine import partitioning as _sharding
from ._engine import auto_sharding as _auto_sharding
from ._engine.executor import persistent as _persistent


def device_type() -> Optional[str]:
    """The PJRT device type: `PJRT_DEVICE` as set (its part before any `_`), else the
    platform the runtime picks; None when `PJRT_DEVICE` is unset and
    `PJRT_SELECT_DEFAULT_DEVICE=0` asks for no default."""
    chosen = _config.raw("PJRT_DEVICE")
    if chosen:
        return chosen.split("_")[0].upper()
    if not _config.get("PJRT_SELECT_DEFAULT_DEVICE"):
        return None
    return _rt.platform()


def set_device_type(pjrt_device: str) -> None:
    """Sets `PJRT_DEVICE` for this process (CPU, CUDA, TPU). Once the runtime has started,
    only the type already in use is accepted (RuntimeError otherwise)."""
    # Through the public `_XLAC` entry point (callers patch it), which the package's
    # __init__ has imported; an import here would close an import cycle.
    if sys.modules["torch_xla._XLAC"]._xla_runtime_is_initialized() and _config.raw("PJRT_DEVICE") != pjrt_device:
        raise RuntimeError(f"Can't change the device type to {pjrt_device!r}: the XLA runtime is "
                           f"already initialized with PJRT_DEVICE={_config.raw('PJRT_DEVICE')!r}")
    _config.update({"PJRT_DEVICE": pjrt_device})


def host_index() -> int:
    """The index of this host in the job (hosts ordered as their processes' ranks)."""
    return _pg.global_ordinal() // max(1, _pg.local_process_count())


def using_pjrt() -> bool:
    return True


def local_process_count() -> int:
    """Number of processes running on this host."""
    return _pg.local_process_count()


def local_device_count() -> int:
    """Number of devices on this host."""
    return _pg.local_process_count() * addressable_device_count()


def addressable_device_count() -> int:
    """Number of devices visible to this process (SPMD: the one virtual device)."""
    return _rt.device_count()


def global_device_count() -> int:
    """Total number of devices across all processes and hosts."""
    return _pg.world_size() * addressable_device_count()


def global_runtime_device_count() -> int:
    """Total number of runtime devices across all processes and hosts (SPMD: all of them)."""
    return len(_sharding.global_devices())


def world_size() -> int:
    """Number of participating processes (replicas)."""
    return _pg.world_size()


def global_ordinal() -> int:
    """Global ordinal of this process."""
    return _pg.global_ordinal()


def local_ordinal() -> int:
    """Ordinal of this process on its host."""
    return _pg.local_ordinal()


def process_index() -> int:
    return _pg.global_ordinal()


def process_count() -> int:
    return _pg.world_size()


def get_master_ip() -> str:
    """The IP address of the master (coordinator) host."""
    return _pg.master_ip()


def use_spmd(auto: Optional[bool] = False) -> None:
    """Switches to SPMD mode: one logical device, `xla:0`, over all devices of the job.

    Tensors are then placed replicated on every device unless annotated with
    `torch_xla.distributed.spmd.mark_sharding`; each graph compiles into one program that
    XLA partitions. Data already on the device joins the mesh at its next use.

    `auto`: automatic sharding, for the rest of the process: each program's unannotated
    inputs are laid out over the mesh (`XLA_AUTO_SPMD_MESH`) by a rule on their shapes and
    XLA propagates the rest (docs/auto_sharding.md); sets `XLA_AUTO_SPMD`."""
    _config.update({"XLA_USE_SPMD": "1"})
    try:
        _sharding.enable()
    except BaseException:
        _config.update({"XLA_USE_SPMD": ""})
        raise
    if auto:
        _auto_sharding.enable()
        _config.update({"XLA_AUTO_SPMD": "1"})


def is_spmd() -> bool:
    """Whether SPMD mode is on (`use_spmd()` sets `XLA_USE_SPMD`, which this reads)."""
    return _mode.modes.spmd and bool(_config.get("XLA_USE_SPMD"))


def addressable_runtime_device_count() -> int:
    """The devices this process drives (SPMD: all of this host's devices)."""
    return len(_rt.local_devices())


def global_runtime_device_attributes() -> List[Dict[str, object]]:
    """One dict per device of the job: name (`CPU:0`), kind, process index, coordinates."""
    out = []
    for i, d in enumerate(_sharding.global_devices()):
        attrs = {"name": f"{_rt.platform()}:{i}", "kind": d.device_kind, "process_index": d.process_index}
        # TPU topology (CPU devices report a slice index too, meaningless there).
        for k in (("coords", "core_on_chip", "slice_index") if _rt.platform() == "TPU" else ()):
            v = getattr(d, k, None)
            if v is not None:
                attrs[k] = list(v) if isinstance(v, (list, tuple)) else v
        out.append(attrs)
    return out


def runtime_device_attributes(device: str) -> Dict[str, object]:
    """The attributes of one device, by name (`CPU:0`)."""
    for a in global_runtime_device_attributes():
        if a["name"] == device:
            return a
    raise ValueError(f"no device named {device!r}")


class _CacheInit:
    """`path`: where `initialize_cache` put the persistent cache (None before). Written by
    the thread that calls it, without a lock."""
    __slots__ = ("path",)

    def __init__(self):
        self.path: Optional[str] = None


_cache_init = _CacheInit()


def initialize_cache(path: str, readonly: bool = False) -> None:
    """Initialises the persistent compilation cache at `path` (before any computation).
    `path` is created with mode 0700 if missing; RuntimeError if it is owned by another
    user or writable by group or others (it holds native code this process runs).
    `readonly`: entries are loaded, never written (e.g. on every rank but one)."""
    jax = _rt.jax_module()
    if _cache_init.path is not None and _cache_init.path != path:
        raise RuntimeError("the persistent cache is already initialised at " + _cache_init.path)
    _persistent.initialize(jax, path, readonly)
    _cache_init.path = path
