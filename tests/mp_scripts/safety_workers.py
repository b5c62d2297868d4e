"""Replica functions of tests/test_security.py and tests/test_index_checks.py (importable by
spawned processes)."""
from __future__ import annotations

import errno
import socket

import torch


def _connect(host: str, port: int) -> str:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.connect((host, port))
            return "connected"
        except ConnectionRefusedError:
            return "refused"
        except OSError as e:
            return errno.errorcode.get(e.errno, str(e))


def listening_addresses(port: int):
    """Local addresses of the sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    found = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, _, state = line.split()[1:4]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # LISTEN
                found.append((path.rsplit("/", 1)[1], addr))
    return found


def probe_coordinator(rank: int, outside: list):
    """Rank 0 (the coordination service's host) tries to reach its own port."""
    import torch_xla.core.xla_model as xm
    from torch_xla._engine import env_vars, job
    connect, _ = job.service_addresses(env_vars.get("TORCH_XLA_JAX_COORDINATOR"))
    port = int(connect.rpartition(":")[2])
    res = {}
    if rank == 0:
        res["loopback"] = _connect("127.0.0.1", port)
        res["outside"] = {a: _connect(a, port) for a in outside}
        res["listening"] = listening_addresses(port)
    # host data of every kind mesh_reduce documents, exchanged without pickle
    data = {"t": torch.full((2,), float(rank + 1)), "n": rank + 1, "s": f"r{rank}", "l": [rank, None]}
    res["mesh_reduce"] = xm.mesh_reduce("security", data, lambda vs: vs)
    return res


def index_error_in_collective_graph(rank: int):
    """A graph with an all-reduce and an index that is out of range on replica 1 only."""
    import torch_xla.core.xla_model as xm
    dev = xm.xla_device()
    x = torch.arange(4.0, device=dev)
    s = xm.all_reduce(xm.REDUCE_SUM, x * (rank + 1))
    i = torch.tensor([1 if rank == 0 else 7], device=dev)
    y = s[i]
    try:
        return ("ok", y.cpu().tolist())
    except IndexError as e:
        return ("IndexError", str(e), "".join(getattr(e, "__notes__", [])))
