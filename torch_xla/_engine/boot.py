"""The runtime's start-up order, in one place (run once, at the first use of jax).

1. jax's options from the PJRT variables (`PJRT_DEVICE`, `CPU_NUM_DEVICES`) and the XLA
   flags this project sets by default, before jax reads them;
2. on CPU, the host-memory policy, before the CPU client's threads first allocate;
3. `import jax` with 64-bit types on;
4. this process joins its job (`job.join`: jax.distributed, warm-up) when it is one of
   several;
5. the process patches that must see the loaded modules (`patches.after_jax_start`:
   the garbage collector's tuning);
6. the `after_start` hooks (SPMD mode when `XLA_USE_SPMD` is set).

What `import torch_xla` itself does (device, kernels, import-time patches) is in
`torch_xla/__init__.py`; every change to the process is listed in `patches.REGISTRY`.
"""
from __future__ import annotations

import threading

from . import config, job, patches

_PLATFORMS = {"CPU": "cpu", "CUDA": "cuda", "GPU": "cuda", "TPU": "tpu"}
_lock = threading.Lock()
_jax = []
# Called once jax has started (6. in the order above): modes that need devices (SPMD).
after_start = []


def _configure_env() -> None:
    """Sets the jax options implied by the PJRT environment variables, before jax starts."""
    pjrt = config.get("PJRT_DEVICE").upper()
    if pjrt == "CPU":
        config.set_default("JAX_PLATFORMS", "cpu")
        n = config.get("CPU_NUM_DEVICES")
        # In a single process, or one process per host of an SPMD job (XLA_USE_SPMD); in a
        # multi-process replication job each process owns one device.
        if n and (job.world_size() <= 1 or (config.get("XLA_USE_SPMD") and not job.in_launched_child())):
            config.add_xla_flag(f"xla_force_host_platform_device_count={int(n)}")
    elif pjrt in _PLATFORMS:
        config.set_default("JAX_PLATFORMS", _PLATFORMS[pjrt])
    # XLA's CPU scheduler favours concurrency by default, which keeps more buffers alive:
    # on the decoder training step (bench/) the memory-minimising order cut the step's
    # temporary buffers from 1.20 to 1.08 GB at the same step time.
    config.add_xla_flag("xla_cpu_enable_concurrency_optimized_scheduler=false")


def start_jax():
    """Returns the initialised `jax` module, starting it the first time (steps above)."""
    if _jax:
        return _jax[0]
    with _lock:
        if not _jax:
            _configure_env()
            if (config.get("JAX_PLATFORMS") or "").lower() == "cpu":
                from .platform import cpu
                cpu.prepare_process()
            import jax
            jax.config.update("jax_enable_x64", True)
            job.join(jax)
            patches.after_jax_start()
            _jax.append(jax)
            started_now = True
        else:
            started_now = False
    if started_now:
        for fn in after_start:
            fn()
    return _jax[0]


def started() -> bool:
    return bool(_jax)
