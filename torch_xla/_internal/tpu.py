"""Facts about the TPU host this process runs on, read before the runtime starts.

They come from the Cloud TPU VM's metadata server (its `tpu-env` and
`worker-network-endpoints` attributes), or, with `TPU_SKIP_MDS_QUERY` set (GKE and other
hosts without that server), from the `TPU_*` environment variables; chips are counted on
the PCI bus. `configure_topology` turns them into the variables libtpu reads to give each
local process one chip.
"""
from __future__ import annotations

import functools
import glob
import operator
import os
import re
import urllib.request
from typing import Dict, List, NamedTuple, Optional

from torch_xla._engine import env_vars

_GCE_METADATA_ROOT_URL = "http://metadata.google.internal/computeMetadata/v1"
_METADATA_TIMEOUT_S = 30

# v2 and v3 metadata names no process bounds: the host grid of each slice size.
_ACCELERATOR_TYPE_TO_HOST_BOUNDS = {
    "v2-8": "1,1,1", "v2-32": "2,2,1", "v2-128": "4,4,1", "v2-256": "4,8,1", "v2-512": "8,8,1",
    "v3-8": "1,1,1", "v3-32": "2,2,1", "v3-64": "2,4,1", "v3-128": "4,4,1", "v3-256": "4,8,1",
    "v3-512": "8,8,1", "v3-1024": "8,16,1", "v3-2048": "16,16,1",
}

_GOOGLE_PCI_VENDOR_ID = "0x1ae0"
# PCI device ids of TPU chips: v2/v3, v4, v5e, v6e, two test parts, 7x.
_TPU_PCI_DEVICE_IDS = ["0x0027", "0x005e", "0x0063", "0x006f", "0x0056", "0x0062", "0x0076"]

# Keys of the `tpu-env` record (the names of `torch_xla.core.xla_env_vars` as well).
_ACCELERATOR_TYPE = "ACCELERATOR_TYPE"
_PROCESS_BOUNDS = "TPU_PROCESS_BOUNDS"
_CHIPS_PER_PROCESS_BOUNDS = "TPU_CHIPS_PER_PROCESS_BOUNDS"
_WORKER_ID = "WORKER_ID"

TpuEnv = Dict[str, str]


class MeshShape(NamedTuple):
    """A 3-D grid of chips, hosts or processes ('2,2,1')."""
    x: int
    y: int
    z: int

    @classmethod
    def from_string(cls, mesh: str) -> "MeshShape":
        dims = tuple(int(d) for d in mesh.split(","))
        if len(dims) != 3:
            raise ValueError(f"Mesh shape '{mesh}' should be length 3")
        return cls(*dims)

    @property
    def size(self) -> int:
        return functools.reduce(operator.mul, self)

    def __mul__(self, other) -> "MeshShape":
        return MeshShape(*(a * b for a, b in zip(self, other)))


def _get_metadata(key: str) -> str:
    """An attribute of this VM from the GCE metadata server (OSError when unreachable)."""
    req = urllib.request.Request(f"{_GCE_METADATA_ROOT_URL}/instance/attributes/{key}",
                                 headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(req, timeout=_METADATA_TIMEOUT_S) as resp:
        return resp.read().decode()


def _parse_tpu_env(text: str) -> TpuEnv:
    """The `tpu-env` attribute: one `KEY: 'value'` per line."""
    env = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        if not sep or not key:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def process_bounds_size() -> Optional[int]:
    """Number of processes over all TPU hosts (`TPU_PROCESS_BOUNDS`), None if unset."""
    bounds = env_vars.get("TPU_PROCESS_BOUNDS")
    return MeshShape.from_string(bounds).size if bounds else None


def num_available_chips() -> int:
    """Number of TPU chips on this host's PCI bus."""
    n = 0
    for vendor_path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        with open(vendor_path) as f:
            if f.read().strip() != _GOOGLE_PCI_VENDOR_ID:
                continue
        with open(os.path.join(os.path.dirname(vendor_path), "device")) as f:
            if f.read().strip() in _TPU_PCI_DEVICE_IDS:
                n += 1
    return n


def num_logical_cores_per_chip() -> int:
    """Devices per chip: two TensorCores are two devices up to v3, one device from v4."""
    return 2 if version() <= 3 else 1


def num_available_devices() -> int:
    """Number of TPU devices on this host (without starting the runtime)."""
    return num_available_chips() * num_logical_cores_per_chip()


def num_expected_global_devices() -> int:
    """Number of TPU devices of the slice, from this host's count and the worker count."""
    return num_available_devices() * num_tpu_workers()


def num_local_processes() -> int:
    """Processes to start on this host: one per chip, at most the job's process count."""
    chips = num_available_chips()
    total = process_bounds_size()
    return min(chips, total) if total else chips


def task_id() -> Optional[int]:
    """This process's index among all TPU worker processes (`CLOUD_TPU_TASK_ID`), if set."""
    return env_vars.get("CLOUD_TPU_TASK_ID")


def worker_id() -> int:
    """The index of this TPU host (worker) in its slice."""
    return int(get_tpu_env()[_WORKER_ID])


def _using_env_vars() -> bool:
    if not env_vars.get("TPU_SKIP_MDS_QUERY"):
        return False
    # jax's import sets TPU_SKIP_MDS_QUERY=1 by itself on every host without a TPU chip
    # (and torch_xla imports jax): there, the flag alone describes no TPU, and the
    # variables are used only once they name the accelerator.
    return env_vars.get("TPU_ACCELERATOR_TYPE") is not None or num_available_chips() > 0


def build_tpu_env_from_vars() -> TpuEnv:
    """The `tpu-env` record from the `TPU_*` variables (per-process values first, the
    per-host ones as defaults)."""
    return {
        _ACCELERATOR_TYPE: env_vars.get("TPU_ACCELERATOR_TYPE"),
        _PROCESS_BOUNDS: env_vars.get("TPU_PROCESS_BOUNDS") or env_vars.get("TPU_HOST_BOUNDS"),
        _CHIPS_PER_PROCESS_BOUNDS: (env_vars.get("TPU_CHIPS_PER_PROCESS_BOUNDS")
                                    or env_vars.get("TPU_CHIPS_PER_HOST_BOUNDS")),
        _WORKER_ID: env_vars.raw("CLOUD_TPU_TASK_ID") or env_vars.get("TPU_WORKER_ID"),
    }


def get_tpu_env() -> TpuEnv:
    """This host's `tpu-env` record (accelerator type, bounds, worker id, zone...)."""
    if _using_env_vars():
        return build_tpu_env_from_vars()
    return _parse_tpu_env(_get_metadata("tpu-env"))


def _accelerator_type() -> str:
    try:
        return get_tpu_env()[_ACCELERATOR_TYPE]
    except OSError as e:
        raise EnvironmentError("Failed to get TPU metadata") from e


def version() -> int:
    """The TPU generation of this host (4 for 'v4-16', 5 for 'v5litepod-16')."""
    m = re.match(r"^(?:v|tpu)(\d)[A-Za-z]{0,7}-\d+$", _accelerator_type() or "")
    if not m:
        raise EnvironmentError("Failed to parse TPU version from metadata")
    return int(m.group(1))


def get_tpu_type() -> str:
    """The accelerator type without its size: 'v6e' for 'v6e-8'."""
    acc = _accelerator_type()
    return acc.split("-", 1)[0] if "-" in acc else acc


def get_worker_ips() -> List[str]:
    """The addresses of the slice's TPU hosts in worker order (['localhost'] for one)."""
    if _using_env_vars():
        hosts = (env_vars.get("TPU_WORKER_HOSTNAMES") or "").split(",")
    else:
        # 'hostname:uid:ip,hostname:uid:ip,...'
        hosts = [w.split(":")[2] for w in _get_metadata("worker-network-endpoints").split(",")]
    return hosts if len(hosts) > 1 else ["localhost"]


def num_tpu_workers() -> int:
    """Number of TPU hosts in the slice."""
    return len(get_worker_ips())


def configure_one_chip_topology() -> None:
    """Gives this process one chip, unless the variables say otherwise (before the runtime starts)."""
    env_vars.set_default("TPU_VISIBLE_CHIPS", "0")
    env_vars.set_default("TPU_CHIPS_PER_PROCESS_BOUNDS", "1,1,1")
    env_vars.set_default("TPU_PROCESS_BOUNDS", "1,1,1")


def configure_topology(local_rank: int, local_world_size: int, base_port: int = 8476) -> None:
    """Sets libtpu's topology variables for process `local_rank` of `local_world_size` on
    this host, one chip per process (variables already set are kept). Call before the
    runtime starts; ports [base_port, base_port + local_world_size) must be free on
    every host."""
    tpu_env = get_tpu_env()
    tpu_version = version()
    if tpu_version >= 4:
        host_bounds = MeshShape.from_string(tpu_env[_PROCESS_BOUNDS])
        chips_per_process = MeshShape.from_string(tpu_env[_CHIPS_PER_PROCESS_BOUNDS])
    else:
        host_bounds = MeshShape.from_string(_ACCELERATOR_TYPE_TO_HOST_BOUNDS[tpu_env[_ACCELERATOR_TYPE]])
        chips_per_process = MeshShape(2, 2, 1)
    bounds = ",".join(str(d) for d in host_bounds * chips_per_process)
    if tpu_version == 7:
        bounds += ",2"  # a 7x chip is two devices: a fourth bound
    env_vars.set_default("TPU_CHIPS_PER_PROCESS_BOUNDS", "1,1,1")
    env_vars.set_default("TPU_PROCESS_BOUNDS", bounds)
    # Every host runs the same number of processes on the same ports.
    env_vars.set_default("CLOUD_TPU_TASK_ID", str(int(tpu_env[_WORKER_ID]) * local_world_size + local_rank))
    ports = list(range(base_port, base_port + local_world_size))
    addresses = ",".join(f"{ip}:{port}" for ip in get_worker_ips() for port in ports)
    env_vars.set_default("TPU_PROCESS_ADDRESSES", addresses)
    env_vars.set_default("TPU_VISIBLE_CHIPS", str(local_rank))
    env_vars.set_default("TPU_PROCESS_PORT", str(ports[local_rank]))


def discover_master_worker_ip(use_localhost: bool = True) -> str:
    """The address of the host running the job's process 0 ('localhost' for one host).

    use_localhost: kept for compatibility; one host is always 'localhost'."""
    del use_localhost
    ips = get_worker_ips()
    if len(ips) == 1:
        return "localhost"
    import torch_xla.core.xla_model as xm
    ids = xm.rendezvous("torch_xla.tpu.master_worker", str(worker_id()).encode())
    return ips[int(ids[0].decode())]
