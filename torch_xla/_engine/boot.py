"""The runtime's start-up order, in one place (run once, at the first use of jax).

1. patch phase `JAX_START`: jax's options from the PJRT variables and the XLA flags this
   project sets by default, before jax reads them (`xla_flags`); on CPU, the host-memory
   policy, before the CPU client's threads first allocate (`retain_host_memory`); `import
   jax` with 64-bit types on (`jax_x64`);
2. in a process of a multi-process job, patch phase `JOB_START` (`cpu_collectives_gloo`),
   then the process joins its job (`job.join`: jax.distributed, warm-up);
3. patch phase `STARTED`: the changes that must see every loaded module (`tune_gc`);
4. the `after_start` hooks (SPMD mode when `XLA_USE_SPMD` is set, the persistent cache).

What `import torch_xla` does is patch phase `IMPORT` (`torch_xla/__init__.py`); every
change to the process is an entry of `patches.REGISTRY`.
"""
from __future__ import annotations

import sys
import threading

from . import env_vars, job, patches

_PLATFORMS = {"CPU": "cpu", "CUDA": "cuda", "GPU": "cuda", "TPU": "tpu"}
_lock = threading.Lock()


class _Started:
    """`jax`: the started module, None until `start_jax` finished (set once, under `_lock`;
    read without it: a reference is published whole); `error`: why the start failed."""
    __slots__ = ("jax", "error")

    def __init__(self):
        self.jax = None
        self.error = None


_started = _Started()
# Called once jax has started (4. in the order above): modes that need devices (SPMD), the
# persistent cache.
after_start = []


def configure_env() -> None:
    """Patch `xla_flags`: the jax options implied by the PJRT variables, before jax starts."""
    pjrt = env_vars.get("PJRT_DEVICE").upper()
    if pjrt == "CPU":
        env_vars.set_default("JAX_PLATFORMS", "cpu")
        n = env_vars.get("CPU_NUM_DEVICES")
        # In a single process, or one process per host of an SPMD job (XLA_USE_SPMD); in a
        # multi-process replication job each process owns one device.
        if n and (job.world_size() <= 1 or (env_vars.get("XLA_USE_SPMD") and not job.in_launched_child())):
            env_vars.add_xla_flag(f"xla_force_host_platform_device_count={int(n)}")
    elif pjrt in _PLATFORMS:
        env_vars.set_default("JAX_PLATFORMS", _PLATFORMS[pjrt])
    # jax read JAX_PLATFORMS when the lowerings imported it (at `import torch_xla`), before
    # this: its option is set too, or PJRT_DEVICE would not choose the platform.
    platforms = env_vars.get("JAX_PLATFORMS")
    jax = sys.modules.get("jax")
    if platforms and jax is not None and jax.config.jax_platforms != platforms:
        jax.config.update("jax_platforms", platforms)
    # XLA's CPU scheduler favours concurrency by default, which keeps more buffers alive:
    # on the decoder training step (bench/) the memory-minimising order cut the step's
    # temporary buffers from 1.20 to 1.08 GB at the same step time.
    env_vars.add_xla_flag("xla_cpu_enable_concurrency_optimized_scheduler=false")


def start_jax():
    """Returns the initialised `jax` module, starting it the first time (steps above)."""
    if _started.jax is not None:
        return _started.jax
    with _lock:
        if _started.error is not None:
            # a runtime that failed to start fails the same way at every later use
            raise _started.error
        if _started.jax is None:
            try:
                _check_device_name(env_vars.reread("PJRT_DEVICE"))
                patches.install_phase(patches.JAX_START)
                import jax
                if job.world_size() > 1:
                    patches.install_phase(patches.JOB_START)
                job.join(jax)
                _check_platform(jax)
            except RuntimeError as e:
                _started.error = e
                raise
            patches.install_phase(patches.STARTED)
            _started.jax = jax
            started_now = True
        else:
            started_now = False
    if started_now:
        for fn in after_start:
            fn()
    return _started.jax


_EXTRAS = {"cuda": "torch-xla-jax[cuda]", "tpu": "torch-xla-jax[tpu]"}


def _check_device_name(device: str) -> None:
    """PJRT_DEVICE names a known backend (its part before `_`, as in `CUDA_0`) or is unset."""
    if device and device.split("_")[0].upper() not in _PLATFORMS:
        raise RuntimeError(f"No PjRtPlugin registered for: {device}. Make sure the environment variable "
                           f"PJRT_DEVICE is set to a correct device name ({', '.join(sorted(_PLATFORMS))}).")


def _check_platform(jax) -> None:
    """The platform PJRT_DEVICE chose must start: a missing PJRT plugin is an error, never a
    silent fall back to the CPU."""
    platforms = env_vars.get("JAX_PLATFORMS")
    if not platforms or platforms == "cpu":
        return
    try:
        jax.devices()
    except (RuntimeError, AssertionError) as e:  # jax asserts when no named backend exists at all
        plat = platforms.split(",")[0]
        hint = _EXTRAS.get(plat)
        raise RuntimeError(
            f"PJRT_DEVICE={env_vars.get('PJRT_DEVICE')}: jax cannot start its '{plat}' backend here"
            f"{': ' + str(e) if str(e) else ' (no PJRT plugin for it is installed)'}. "
            + (f"Install {hint} (jax's PJRT plugin for it), " if hint else "")
            + "or set PJRT_DEVICE=CPU.") from e


def limit_malloc_arenas() -> None:
    """Patch `malloc_arena_limit`: at import, when the environment names the CPU platform."""
    if (env_vars.get("PJRT_DEVICE").upper() == "CPU"
            or (env_vars.get("JAX_PLATFORMS") or "").lower() == "cpu"):
        from .platform import host_memory
        host_memory.limit_arenas()


def retain_host_memory() -> None:
    """Patch `retain_host_memory`, on the CPU platform only."""
    if (env_vars.get("JAX_PLATFORMS") or "").lower() == "cpu":
        from .platform import cpu
        cpu.prepare_process()


def started() -> bool:
    return _started.jax is not None
