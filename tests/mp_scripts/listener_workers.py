"""A 2-process job held open after a collective, so that its listening sockets can be read
(tests/test_security.py). Run as a script: `listener_workers.py SIGNAL_DIR [HOSTNAME]`
prints one JSON line; with HOSTNAME, the job runs in its own UTS namespace under that host
name (where the machine allows it), so that a listener bound to "the host name's address"
would show."""
from __future__ import annotations

import ipaddress
import json
import os
import sys
import time

import torch


def _wait_for(path: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.02)


def hold_after_collective(rank: int, signal_dir: str):
    """An all-reduce (gloo's pairs are connected), then held open until the parent has read
    this process's sockets."""
    import torch_xla.core.xla_model as xm
    x = torch.full((3,), float(rank + 1), device=xm.xla_device())
    got = xm.all_reduce(xm.REDUCE_SUM, x).cpu()
    with open(os.path.join(signal_dir, f"ready-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    _wait_for(os.path.join(signal_dir, "release"), 60)
    return got


def _decode(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6} (32-bit words in host order, little-endian here)."""
    raw = bytes.fromhex(hex_addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


def _descendants(pids):
    """`pids` and every process below them."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = set(), list(pids)
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo.extend(c for c, pp in parent.items() if pp == p)
    return sorted(found)


def listening_sockets(pid: int):
    """[(address, port)] of the TCP sockets process `pid` holds that listen."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:   # LISTEN, and this process's
                addr, port = cols[1].split(":")
                found.append((_decode(addr), int(port, 16)))
    return found


def _own_host_name(name: str) -> bool:
    """This process (and its children) in a UTS namespace of its own, named `name`."""
    import ctypes
    import socket
    CLONE_NEWUTS = 0x04000000
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:
        return False
    socket.sethostname(name)
    return True


def main(signal_dir: str, hostname: str = "") -> None:
    renamed = _own_host_name(hostname) if hostname else False
    from torch_xla._engine import launcher
    ctx = launcher.start_processes(hold_after_collective, args=(signal_dir,), nprocs=2)
    out = {"renamed": renamed, "workdir_mode": os.stat(ctx.workdir).st_mode & 0o777}
    try:
        ready = [os.path.join(signal_dir, f"ready-{r}") for r in range(2)]
        end = time.monotonic() + 60
        while not all(os.path.exists(p) for p in ready):
            if any(p.exitcode is not None for p in ctx.processes) or time.monotonic() > end:
                break
            time.sleep(0.02)
        out["listening"] = {str(r): [s for p in _descendants([pid]) for s in listening_sockets(p)]
                            for r, pid in enumerate(ctx.pids())}
    finally:
        open(os.path.join(signal_dir, "release"), "w").close()
    ctx.join(60)
    out["results"] = {str(r): t.tolist() for r, t in ctx.results().items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
