"""Nobody else gets in: the coordination service of a single-host job listens on loopback
only, host data crosses replicas without pickle, and the persistent cache loads none."""
from __future__ import annotations

import fcntl
import os
import pickle
import socket
import struct
import sys

import pytest
import torch

from torch_xla._engine import comm, job, launcher

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mp_scripts import safety_workers  # noqa: E402


def _non_loopback_ipv4():
    """This machine's IPv4 addresses outside 127.0.0.0/8 (from the interfaces)."""
    found = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
        addr = socket.inet_ntoa(packed[20:24])
        if not addr.startswith("127."):
            found.append(addr)
    return found


def test_service_addresses_single_host_is_loopback(monkeypatch):
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCH_XLA_JAX_WORLD_SIZE", "TORCH_XLA_JAX_LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_XLA_JAX_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCH_XLA_JAX_LOCAL_WORLD_SIZE", "2")
    # torchrun on one host naming the machine's address: still loopback
    assert job.service_addresses("10.1.2.3:1234") == ("127.0.0.1:1234", "127.0.0.1:1234")
    assert job.service_addresses("localhost:99") == ("127.0.0.1:99", "127.0.0.1:99")
    # a multi-host job: the named host is reached by the other hosts
    monkeypatch.setenv("TORCH_XLA_JAX_WORLD_SIZE", "4")
    assert job.service_addresses("10.1.2.3:1234") == ("10.1.2.3:1234", "[::]:1234")
    assert job.service_addresses("127.0.0.1:5") == ("127.0.0.1:5", "127.0.0.1:5")


def test_coordinator_refuses_other_addresses():
    outside = _non_loopback_ipv4()
    res = launcher.spawn(safety_workers.probe_coordinator, args=(outside,), nprocs=2, return_results=True)
    r0 = res[0]
    # the port is the coordinator's: loopback reaches it
    assert r0["loopback"] == "connected"
    # every socket listening on it is bound to 127.0.0.1 (0100007F, or IPv4-mapped in
    # tcp6), whatever the interfaces are
    assert r0["listening"], "nothing listens on the coordinator's port"
    loopback = ("0100007F", "0000000000000000FFFF00000100007F")
    assert all(addr in loopback for _, addr in r0["listening"]), r0["listening"]
    # and from this machine's other addresses, the connection is refused
    assert r0["outside"] == {a: "refused" for a in outside}
    want = [{"t": torch.full((2,), float(r + 1)), "n": r + 1, "s": f"r{r}", "l": [r, None]} for r in range(2)]
    for r in range(2):
        got = res[r]["mesh_reduce"]
        assert len(got) == 2
        for g, w in zip(got, want):
            assert set(g) == set(w)
            torch.testing.assert_close(g["t"], w["t"])
            assert (g["n"], g["s"], g["l"]) == (w["n"], w["s"], w["l"])


class _Evil:
    ran = []

    def __reduce__(self):
        return (_Evil.ran.append, ("code ran",))


def test_mesh_reduce_payload_never_runs_code():
    payload = pickle.dumps(("s", _Evil()))
    with pytest.raises(pickle.UnpicklingError):
        comm.decode_host(payload)
    assert _Evil.ran == []


def test_mesh_reduce_encoding_round_trip_and_refusal():
    import numpy as np
    v = {"a": [1, 2.5, "x", None, b"q", (torch.arange(3),)], 3: np.arange(6.0).reshape(2, 3),
         "g": np.int16(7), "z": torch.Size([2]), "d": torch.bfloat16, "c": 1 + 2j}
    got = comm.decode_host(comm.encode_host(v))
    assert got["a"][:5] == v["a"][:5]
    torch.testing.assert_close(got["a"][5][0], v["a"][5][0])
    np.testing.assert_array_equal(got[3], v[3])
    assert got[3].dtype == v[3].dtype
    assert got["g"] == v["g"] and type(got["g"]) is np.int16
    assert (got["z"], got["d"], got["c"]) == (v["z"], v["d"], v["c"])
    with pytest.raises(TypeError, match="mesh_reduce cannot exchange a value of type _Evil"):
        comm.encode_host([_Evil()])


def test_persistent_cache_loads_no_pickle(tmp_path, monkeypatch):
    import torch_xla.debug.metrics as met
    from torch_xla._engine import executor
    from torch_xla._engine.executor import persistent

    # an entry in the old pickled format (or planted by someone else) is a miss, never unpickled
    persistent.configure(str(tmp_path))
    try:
        (tmp_path / "txj-planted.exe").write_bytes(pickle.dumps(_Evil()))
        assert persistent.load("planted") is None and _Evil.ran == []

        def run():
            x = torch.arange(6.0, device="xla")
            return (x[torch.tensor([1, 5], device="xla")] * 3).cpu()

        want = run()
        executor.clear_cache()   # the next run must come from the disk

        def no_pickle(*a, **k):
            raise AssertionError("the persistent cache unpickled something")
        monkeypatch.setattr(pickle, "load", no_pickle)
        monkeypatch.setattr(pickle, "loads", no_pickle)
        monkeypatch.setattr(pickle, "Unpickler", no_pickle)
        hits = met.counter_value("PersistentExecutableHit") or 0
        torch.testing.assert_close(run(), want)
        assert (met.counter_value("PersistentExecutableHit") or 0) == hits + 1
        torch.testing.assert_close(want, torch.tensor([3.0, 15.0]))
        # the stored program keeps its index checks
        x = torch.arange(6.0, device="xla")
        with pytest.raises(IndexError, match="index 9 is out of bounds for dimension 0 with size 6"):
            (x[torch.tensor([1, 9], device="xla")] * 3).cpu()
    finally:
        persistent.configure(None)
        executor.clear_cache()


def _is_loopback(addr: str) -> bool:
    import ipaddress
    a = ipaddress.ip_address(addr)
    return a.is_loopback or bool(getattr(a, "ipv4_mapped", None) and a.ipv4_mapped.is_loopback)


def test_gloo_address_single_and_multi_host(monkeypatch):
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", *job.ENV_KEYS):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_XLA_JAX_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCH_XLA_JAX_LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCH_XLA_JAX_COORDINATOR", "10.1.2.3:1234")
    assert job.gloo_hostname() == "127.0.0.1"   # one host, whatever address it was named by
    monkeypatch.setenv("TORCH_XLA_JAX_WORLD_SIZE", "4")
    # several hosts: gloo binds the address of this machine's host name, which the others reach
    assert job.gloo_hostname() is None
    monkeypatch.setenv("TORCH_XLA_JAX_COORDINATOR", "127.0.0.1:1234")
    assert job.gloo_hostname() == "127.0.0.1"


def test_every_listener_of_a_single_host_job_is_loopback(tmp_path):
    """A real 2-process job, read after its all-reduce (gloo's listeners exist then). Where
    the machine allows it the job runs under a host name that resolves to one of this
    machine's other addresses, where gloo would listen if it were left to choose."""
    import json
    import subprocess
    outside = _non_loopback_ipv4()
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", *job.ENV_KEYS)}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "mp_scripts", "listener_workers.py"), str(tmp_path),
                           *outside[:1]], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # Without the right to a host name of its own (unshare), the job runs under the machine's
    # name: the listeners are still checked, where that name points.
    listening = out["listening"]
    # rank 0: the coordination service and gloo; rank 1: gloo
    assert len(listening["0"]) >= 2 and len(listening["1"]) >= 1, listening
    assert all(_is_loopback(a) for socks in listening.values() for a, _ in socks), listening
    # results and errors travel through a folder only this user reads
    assert out["workdir_mode"] == 0o700
    want = torch.full((3,), 1.0) + torch.full((3,), 2.0)
    for r in ("0", "1"):
        torch.testing.assert_close(torch.tensor(out["results"][r]), want)
