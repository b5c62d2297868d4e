"""This process's place in a multi-process job (one process per device).

Set by the launcher through the environment (TORCH_XLA_JAX_* variables) or by
torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); one process alone is
ordinal 0 of 1.
"""
from __future__ import annotations

import os


def _env_int(*names, default: int) -> int:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return default


def world_size() -> int:
    return _env_int("TORCH_XLA_JAX_WORLD_SIZE", "WORLD_SIZE", default=1)


def global_ordinal() -> int:
    return _env_int("TORCH_XLA_JAX_PROCESS_ID", "RANK", default=0)


def local_ordinal() -> int:
    return _env_int("TORCH_XLA_JAX_LOCAL_RANK", "LOCAL_RANK", default=global_ordinal())


def local_process_count() -> int:
    return _env_int("TORCH_XLA_JAX_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", default=world_size())


def master_ip() -> str:
    addr = os.environ.get("TORCH_XLA_JAX_COORDINATOR") or os.environ.get("MASTER_ADDR")
    if addr:
        return addr.split(":")[0]
    return "127.0.0.1"


# ---- the jax distributed runtime -------------------------------------------------------

_dist = {"initialized": False, "mesh": None}


def coordinator_address() -> str | None:
    """host:port of jax's coordination service for this job (None for one process)."""
    addr = os.environ.get("TORCH_XLA_JAX_COORDINATOR")
    if addr:
        return addr
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        # Launched by torchrun: its store listens on MASTER_PORT; the coordinator takes the next port.
        return f"{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
    return None


def collective_timeout_s() -> int:
    """How long a process waits for its peers (XLA_COLLECTIVE_TIMEOUT_S, default 30 minutes)."""
    return int(os.environ.get("XLA_COLLECTIVE_TIMEOUT_S", "1800"))


def initialize(jax) -> None:
    """Joins the multi-process job (jax.distributed) when this process is one of several."""
    if _dist["initialized"] or world_size() <= 1:
        return
    _dist["initialized"] = True
    addr = coordinator_address()
    if addr is None:
        raise RuntimeError(
            f"WORLD_SIZE={world_size()} but no coordinator address: start the job with "
            f"torch_xla.launch / xmp.spawn or torchrun (MASTER_ADDR/MASTER_PORT), or set "
            f"TORCH_XLA_JAX_COORDINATOR=host:port")
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:
        pass
    timeout = collective_timeout_s()
    from . import launcher
    launcher.check_coordinator_port()  # rank 0: clear error if the port is taken
    jax.distributed.initialize(coordinator_address=addr, num_processes=world_size(),
                               process_id=global_ordinal(), initialization_timeout=timeout,
                               heartbeat_timeout_seconds=int(os.environ.get("XLA_HEARTBEAT_TIMEOUT_S", "60")),
                               # a replica that finishes first waits this long for the others at exit
                               shutdown_timeout_seconds=timeout)
    # Every process returns from initialize at about the same time: create gloo's
    # communicator now (its creation waits only 30 s for the peers), not at the first
    # collective of the model, which a replica may reach much later.
    launcher.warm_up(jax)


def is_multiprocess() -> bool:
    return world_size() > 1


def replica_mesh():
    """The 1-d mesh ('r') of every process's device, in global ordinal order."""
    if _dist["mesh"] is None:
        import numpy as np
        from . import runtime
        jax = runtime.jax_module()
        from jax.sharding import Mesh
        devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        _dist["mesh"] = Mesh(np.array(devs), ("r",))
    return _dist["mesh"]


def kv_client():
    """The coordination service client (key-value store and barriers) of this job."""
    from jax._src import distributed
    c = distributed.global_state.client
    if c is None:
        raise RuntimeError("the multi-process runtime is not initialised")
    return c
