"""This process's place in a job: ranks, the coordinator, jax.distributed, the replica mesh.

One process per device. The launcher (`launcher.py`) sets the TORCH_XLA_JAX_* variables
before a replica starts, or torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE; one process alone is ordinal 0 of 1. When the runtime starts
(`boot.start_jax`), `join` connects this process to jax's coordination service and runs
a tiny all-reduce (`warm_up`), so that gloo's communicator (created at the first
collective, with only a 30 s wait for the peers) is built while the processes are in
step, not at the model's first all-reduce.
"""
from __future__ import annotations

import errno
import socket
from typing import Optional

from . import env_vars, patches

ENV_KEYS = ("TORCH_XLA_JAX_PROCESS_ID", "TORCH_XLA_JAX_WORLD_SIZE", "TORCH_XLA_JAX_LOCAL_RANK",
            "TORCH_XLA_JAX_LOCAL_WORLD_SIZE", "TORCH_XLA_JAX_COORDINATOR")


def _first(*names: str, default: int) -> int:
    for n in names:
        v = env_vars.get(n)
        if v is not None:
            return v
    return default


def world_size() -> int:
    return _first("TORCH_XLA_JAX_WORLD_SIZE", "WORLD_SIZE", default=1)


def global_ordinal() -> int:
    return _first("TORCH_XLA_JAX_PROCESS_ID", "RANK", default=0)


def local_ordinal() -> int:
    return _first("TORCH_XLA_JAX_LOCAL_RANK", "LOCAL_RANK", default=global_ordinal())


def local_process_count() -> int:
    return _first("TORCH_XLA_JAX_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", default=world_size())


def is_multiprocess() -> bool:
    return world_size() > 1


def under_torchrun() -> bool:
    """True when an external launcher (torchrun) already made this process one rank of a job."""
    return (env_vars.is_set("RANK") and env_vars.is_set("WORLD_SIZE")
            and not env_vars.is_set("TORCH_XLA_JAX_PROCESS_ID"))


def in_launched_child() -> bool:
    return env_vars.is_set("TORCH_XLA_JAX_PROCESS_ID") and env_vars.is_set("TORCH_XLA_JAX_WORLD_SIZE")


def master_ip() -> str:
    addr = env_vars.get("TORCH_XLA_JAX_COORDINATOR") or env_vars.get("MASTER_ADDR")
    return addr.split(":")[0] if addr else "127.0.0.1"


def coordinator_address() -> Optional[str]:
    """host:port of jax's coordination service for this job (None for one process)."""
    addr = env_vars.get("TORCH_XLA_JAX_COORDINATOR")
    if addr:
        return addr
    if env_vars.get("MASTER_ADDR") and env_vars.get("MASTER_PORT"):
        # Launched by torchrun: its store listens on MASTER_PORT; the coordinator takes the next port.
        return f"{env_vars.get('MASTER_ADDR')}:{int(env_vars.get('MASTER_PORT')) + 1}"
    return None


def collective_timeout_s() -> int:
    """How long a process waits for its peers (XLA_COLLECTIVE_TIMEOUT_S, default 30 minutes)."""
    return env_vars.get("XLA_COLLECTIVE_TIMEOUT_S")


def check_environment() -> None:
    """Validates the TORCH_XLA_JAX_* / torchrun variables of this process (clear errors, early)."""
    ws_raw = env_vars.raw("TORCH_XLA_JAX_WORLD_SIZE") or env_vars.raw("WORLD_SIZE")
    rk_raw = env_vars.raw("TORCH_XLA_JAX_PROCESS_ID") or env_vars.raw("RANK")
    if ws_raw is None and rk_raw is None:
        return
    try:
        ws = int(ws_raw) if ws_raw is not None else 1
        rk = int(rk_raw) if rk_raw is not None else 0
    except ValueError:
        raise ValueError(f"bad world size / rank in the environment: WORLD_SIZE={ws_raw!r} "
                         f"RANK={rk_raw!r}") from None
    if ws < 1:
        raise ValueError(f"world size {ws} must be at least 1")
    if not 0 <= rk < ws:
        raise ValueError(f"process rank {rk} is out of range for world size {ws}")


_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")


def single_host() -> bool:
    """Every process of the job runs on this host."""
    return local_process_count() >= world_size()


def service_addresses(addr: str):
    """(address the processes connect to, address the coordination service binds) for `addr`.

    In a single-host job the service listens on loopback only (nobody else can reach its
    key-value store); a multi-host job's named host listens on every interface, as the
    other hosts must reach it.
    """
    host, _, port = addr.rpartition(":")
    if host in _LOOPBACK or host.startswith("127.") or single_host():
        return f"127.0.0.1:{port}", f"127.0.0.1:{port}"
    return addr, f"[::]:{port}"


def check_port_free(host: str, port: int) -> None:
    """Raises a clear error when the coordinator's port is already taken on this host."""
    bind = service_addresses(f"{host}:{port}")[1].rpartition(":")[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1" if bind == "127.0.0.1" else "", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # not a local address, or no permission: let the runtime report it
            raise RuntimeError(
                f"the coordinator port {port} on {host} is already in use ({e.strerror}); another job "
                f"may be running. Choose another port (TORCH_XLA_JAX_COORDINATOR=host:port, or "
                f"MASTER_PORT for torchrun, whose coordinator uses MASTER_PORT+1)") from None


def check_coordinator_port() -> None:
    """In the process that hosts jax's coordination service (rank 0), before it starts: a
    clear error if the coordinator's port is taken (jax only says "Failed to start RPC
    server")."""
    if _runtime.joined or world_size() <= 1 or global_ordinal() != 0:
        return
    addr = coordinator_address()
    if addr:
        host, _, port = addr.rpartition(":")
        check_port_free(host, int(port))


# ---- the jax distributed runtime -------------------------------------------------------

class _Runtime:
    """This process's part in the jax distributed runtime. `joined` and `warm`: written by
    `join` / `warm_up` at jax's start, under `boot._lock`. `mesh`: the replica mesh, made
    by the first thread that asks, without a lock (a race makes an equal mesh twice). Read
    by any thread."""
    __slots__ = ("joined", "mesh", "warm")

    def __init__(self):
        self.joined = False
        self.mesh = None
        self.warm = False


_runtime = _Runtime()


def gloo_hostname() -> Optional[str]:
    """The address gloo's listeners bind: loopback in a single-host job (as the coordination
    service); None in a multi-host one, where gloo binds the address this machine's host name
    resolves to, which the other hosts reach."""
    addr = coordinator_address()
    if addr is None:
        return "127.0.0.1"
    return "127.0.0.1" if service_addresses(addr)[0].startswith("127.0.0.1:") else None


def use_gloo_collectives() -> bool:
    """Patch `cpu_collectives_gloo` (before `join`): jax's CPU client runs collectives
    across processes through gloo, whose listeners bind `gloo_hostname()`.

    jax makes gloo's collectives without a host name, so gloo would listen on whatever the
    machine's host name resolves to (often a public interface): the CPU backend's factory is
    replaced by one that passes the job's address and otherwise calls jax's own.
    """
    import jax
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError as e:  # a jax without the option: its CPU collectives stay its default
        return patches.refuse("jax's CPU collectives", str(e))
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax
    make_gloo = getattr(_jax, "make_gloo_tcp_collectives", None)
    registration = xla_bridge._backend_factories.get("cpu")
    if (make_gloo is None or "hostname" not in (make_gloo.__doc__ or "") or registration is None
            or registration.factory is not xla_bridge.make_cpu_client
            or not patches.signature_matches(xla_bridge.make_cpu_client, ["collectives"],
                                             "jax's CPU client factory")):
        # the option is set: gloo's collectives run, listening where jax makes them listen
        patches.refuse("the address of gloo's listeners", "jax's CPU client factory has changed")
        return True

    def make_cpu_client():
        client = distributed.global_state.client
        if client is None:
            return xla_bridge.make_cpu_client()
        return xla_bridge.make_cpu_client(
            collectives=make_gloo(distributed_client=client, hostname=gloo_hostname()))

    registration.factory = make_cpu_client
    return True


def join(jax) -> None:
    """Joins the multi-process job (jax.distributed) when this process is one of several."""
    if _runtime.joined or world_size() <= 1:
        return
    addr = coordinator_address()
    if addr is None:
        raise RuntimeError(
            f"WORLD_SIZE={world_size()} but no coordinator address: start the job with "
            f"torch_xla.launch / xmp.spawn or torchrun (MASTER_ADDR/MASTER_PORT), or set "
            f"TORCH_XLA_JAX_COORDINATOR=host:port")
    check_coordinator_port()
    _runtime.joined = True
    timeout = collective_timeout_s()
    connect, bind = service_addresses(addr)
    jax.distributed.initialize(coordinator_address=connect, coordinator_bind_address=bind,
                               num_processes=world_size(),
                               process_id=global_ordinal(), initialization_timeout=timeout,
                               heartbeat_timeout_seconds=env_vars.get("XLA_HEARTBEAT_TIMEOUT_S"),
                               # a replica that finishes first waits this long for the others at exit
                               shutdown_timeout_seconds=timeout)
    # Every process returns from initialize at about the same time: create gloo's
    # communicator now.
    warm_up(jax)


def replica_mesh(jax):
    """The 1-d mesh ('r') of every process's device, in global ordinal order."""
    if _runtime.mesh is None:
        import numpy as np
        from jax.sharding import Mesh
        devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        _runtime.mesh = Mesh(np.array(devs), ("r",))
    return _runtime.mesh


def warm_up(jax) -> None:
    """A tiny all-reduce over the replica mesh, checked; a no-op for one process."""
    if _runtime.warm or world_size() <= 1:
        return
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = replica_mesh(jax)
    world = mesh.devices.size
    # Device k of the mesh contributes k + 1 (a process may own several devices: SPMD).
    pos = {d: k for k, d in enumerate(mesh.devices.flat)}
    local = sorted(jax.local_devices(), key=lambda d: pos[d])
    x = jax.make_array_from_single_device_arrays(
        (world,), NamedSharding(mesh, P("r")),
        [jax.device_put(np.full((1,), pos[d] + 1, np.int32), d) for d in local])
    fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "r"), mesh=mesh, in_specs=P("r"),
                               out_specs=P("r"), check_vma=False))
    got = int(np.asarray(fn(x).addressable_shards[0].data)[0])
    want = world * (world + 1) // 2
    if got != want:
        raise RuntimeError(f"warm-up all-reduce over {world} replicas returned {got}, expected {want}")
    _runtime.warm = True


def kv_client():
    """The coordination service client (key-value store and barriers) of this job."""
    from jax._src import distributed
    c = distributed.global_state.client
    if c is None:
        raise RuntimeError("the multi-process runtime is not initialised")
    return c


# ---- the coordination service's errors ---------------------------------------------------

def service_error() -> type:
    """The exception type the coordination service's client raises (looked up when needed:
    a client exists only once jax runs)."""
    import jax.errors
    return jax.errors.JaxRuntimeError


def status_code(err: BaseException) -> str:
    """The status code a coordination service error starts with ("NOT_FOUND", ...), or ""."""
    head = str(err).split(":", 1)[0].strip()
    return head if head.isupper() and " " not in head else ""


def first_line(err: BaseException) -> str:
    """The service's first line (it appends pages of gRPC detail after it; the whole text
    stays on the raised error's __cause__)."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def service_failure(what: str, err: BaseException, timeout_s: Optional[float] = None) -> str:
    """`what` failed, in words that name the cause: a timeout, an unreachable service, or the code."""
    code = status_code(err)
    if code == "DEADLINE_EXCEEDED":
        after = f" within {timeout_s:g} s" if timeout_s is not None else ""
        return f"{what} did not complete{after} ({first_line(err)})"
    if code == "UNAVAILABLE":
        return (f"{what} failed: the coordination service is unreachable (has the coordinator, replica 0, "
                f"exited?): {first_line(err)}")
    return f"{what} failed: {first_line(err)}"
