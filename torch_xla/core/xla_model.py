"""`torch_xla.core.xla_model` (xm): devices, barriers, collectives, saving."""
from __future__ import annotations

import os
import tempfile
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

import torch_xla
from .. import runtime as xr
from .._api import _real_devices_of
from .._engine import collectives as _coll, executor, ir, rng, runtime
from .._engine.executor import analysis as _analysis

REDUCE_SUM = "sum"
REDUCE_MUL = "mul"
REDUCE_AND = "and"
REDUCE_OR = "or"
REDUCE_MIN = "min"
REDUCE_MAX = "max"



def xla_device(n: Optional[int] = None, devkind: Optional[str] = None) -> torch.device:
    """Returns a given instance of an XLA device."""
    if devkind is not None:
        warnings.warn("devkind is deprecated and ignored", DeprecationWarning, stacklevel=2)
    return torch_xla.device(n)


def get_xla_supported_devices(devkind: Optional[str] = None, max_devices: Optional[int] = None) -> List[str]:
    """This process's xla devices (`['xla:2']` for process 2 of a multi-process CPU job)."""
    devs = [str(d) for d in torch_xla.devices()]
    return devs[:max_devices] if max_devices else devs


def set_replication(device: Union[str, torch.device], devices: Optional[Sequence] = None) -> None:
    """Declares the devices this process replicates over (`device` among them).

    Replication here is the job's: one process per device, each replica's collectives
    span every process (`xmp.spawn`, `torch_xla.launch`, torchrun). This checks that
    `device` is an xla device of this process and that `devices`, when given, are this
    process's devices of one kind and include it; an empty list means no replication.
    """
    device = torch.device(device)
    if device.type != "xla":
        raise RuntimeError(f"set_replication: {device} is not an xla device")
    if device.index is not None and device not in torch_xla.devices():
        raise RuntimeError(f"set_replication: {device} is not a device of this process "
                           f"({', '.join(map(str, torch_xla.devices()))})")
    names = [str(torch.device(d)) for d in (devices or ())]
    if not names:
        return
    kinds = {n.split(":")[0] for n in names}
    if kinds != {"xla"}:
        raise RuntimeError(f"Cannot replicate across different device types: devices={names}")
    supported = get_xla_supported_devices()
    if len(names) != len(supported):
        raise RuntimeError(f"Cannot replicate if number of devices ({len(names)}) is different from "
                           f"{len(supported)}")
    here = str(device if device.index is not None else torch_xla.device())
    if here not in names:
        raise RuntimeError(f"set_replication: {here} is not among {names}")


def xla_device_hw(device: Union[str, torch.device]) -> str:
    """Returns the hardware type of the given device: CPU, CUDA or TPU."""
    device = torch.device(device)
    if device.type != "xla":
        raise ValueError(f"{device} is not an xla device")
    return runtime.platform()


def xla_replication_devices(local_devices: Optional[List[Union[str, torch.device]]] = None) -> List[str]:
    """The real devices a replicated program runs on, for these local xla devices."""
    real = xla_real_devices(local_devices)
    if len(real) != len(set(real)):
        raise RuntimeError(f"the devices {local_devices} map to the same real device more than once")
    return real


def xla_real_devices(devices: Optional[List[Union[str, torch.device]]] = None) -> List[str]:
    if devices is None:
        return torch_xla.real_devices()
    return _real_devices_of(devices)


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    return torch_xla.is_xla_tensor(tensor)


# ---- ordinals (one process = one device) -----------------------------------------------------

def get_ordinal(defval: int = 0) -> int:
    """The global ordinal of this process's device."""
    return xr.global_ordinal()


def get_local_ordinal(defval: int = 0) -> int:
    return xr.local_ordinal()


def xrt_world_size(defval: int = 1) -> int:
    """Deprecated alias of `torch_xla.runtime.world_size()`."""
    warnings.warn("xm.xrt_world_size() is deprecated; use torch_xla.runtime.world_size()",
                  DeprecationWarning, stacklevel=2)
    return xr.world_size()


def is_master_ordinal(local: bool = True) -> bool:
    """Whether this process is the (local or global) master ordinal."""
    ordinal = xr.local_ordinal() if local else xr.global_ordinal()
    return ordinal == 0


def master_print(*args, fd=None, finalize: bool = False, **kwargs) -> None:
    """Prints only on the master ordinal."""
    if is_master_ordinal(local=False):
        import sys
        print(*args, file=fd or sys.stdout, **kwargs)
        (fd or sys.stdout).flush()


# ---- barriers ----------------------------------------------------------------------------------

def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """The barrier: compiles and launches the pending graph of all live tensors.

    wait: block until the programs have run. reset_scope: refuse to run inside a profiler
    `Trace` region (RuntimeError: the graph would be cut inside the region); False skips
    that check."""
    if reset_scope:
        ir.reset_scopes()
    with _analysis.cause("user xm.mark_step"):
        executor.sync(wait=wait)


def wait_device_ops(devices: Sequence = ()) -> None:
    """Waits for all the asynchronous operations on the devices to complete."""
    executor.sync(wait=False)
    runtime.wait_all_buffers()
    executor.inspect_checks()


def add_step_closure(closure: Callable, args: tuple = (), run_async: bool = False) -> None:
    """Queues `closure(*args)` to run after the next barrier, when tensors are materialised."""
    executor.add_step_closure(closure, args, run_async)


# ---- random numbers ---------------------------------------------------------------------------

def set_rng_state(seed: int, device: Optional[str] = None) -> None:
    """Sets the device random number generator state."""
    rng.set_seed(seed)


def get_rng_state(device: Optional[str] = None) -> int:
    """The current device random number generator state, as an integer: `set_rng_state`
    of it returns to this position (random ops drawn before it are not repeated)."""
    return rng.state()


# ---- memory ------------------------------------------------------------------------------------

def get_memory_info(device: Optional[torch.device] = None) -> Dict[str, int]:
    """Device memory usage: bytes_used, bytes_limit (and kb_free/kb_total for old callers)."""
    return runtime.memory_info()


# ---- collectives (this process's view; see torch_xla.distributed for many processes) ---------

def _collectives():
    return _coll


def all_reduce(reduce_type: str, inputs, scale: float = 1.0, groups=None, pin_layout: bool = True):
    """Reduces `inputs` across replicas. A list is reduced in place and returned.

    pin_layout: accepted; every replica runs the same compiled program, so the layouts of
    a collective's operands always agree across replicas (what pinning guarantees)."""
    if isinstance(inputs, torch.Tensor) and torch.compiler.is_compiling():
        # Inside torch.compile: an op of the graph (torch.ops.xla.all_reduce).
        if reduce_type not in (REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX):
            raise ValueError(f"invalid reduce type {reduce_type!r}")
        return torch.ops.xla.all_reduce(inputs, reduce_type, float(scale), [list(g) for g in groups or ()])
    return _collectives().all_reduce(reduce_type, inputs, scale=scale, groups=groups)


def all_gather(value: torch.Tensor, dim: int = 0, groups=None, output=None, pin_layout: bool = True):
    """Gathers `value` from all replicas along `dim`."""
    return _collectives().all_gather(value, dim=dim, groups=groups, output=output)


def reduce_scatter(reduce_type: str, input, scale: float, scatter_dim: int, shard_count: int,
                   groups=None, output=None, pin_layout: bool = True):
    """Reduces across replicas and keeps this replica's shard along `scatter_dim`."""
    return _collectives().reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count,
                                         groups=groups, output=output)


def all_gather_bucketized(input_list: List[torch.Tensor], dim: int = 0, groups=None, output=None,
                          pin_layout: bool = False, bucket_cap_mb: float = 160) -> List[torch.Tensor]:
    """`all_gather` of a list, in buckets of at most `bucket_cap_mb` MiB."""
    return _collectives().bucketized(lambda i, o: all_gather(i, dim=dim, groups=groups, output=o),
                                     input_list, output, bucket_cap_mb)


def reduce_scatter_bucketized(reduce_type: str, input_list, scale: float, scatter_dim: int, shard_count: int,
                              groups=None, output=None, pin_layout: bool = False,
                              bucket_cap_mb: float = 160) -> List[torch.Tensor]:
    """`reduce_scatter` of a list, in buckets of at most `bucket_cap_mb` MiB."""
    return _collectives().bucketized(
        lambda i, o: reduce_scatter(reduce_type, i, scale, scatter_dim, shard_count, groups=groups, output=o),
        input_list, output, bucket_cap_mb)


def optimization_barrier_(tensors: List[torch.Tensor]) -> None:
    """Blocks the XLA compiler from moving computations across this point (in place):
    keeps common-subexpression elimination from undoing gradient checkpointing."""
    _collectives().optimization_barrier_(tensors)


def all_to_all(value, split_dimension: int, concat_dimension: int, split_count: int, groups=None,
               pin_layout: bool = True):
    """XLA AllToAll over the replicas."""
    return _collectives().all_to_all(value, split_dimension, concat_dimension, split_count, groups=groups)


def collective_permute(value, pairs):
    """Sends `value` from source to target replica for each (source, target) pair."""
    return _collectives().collective_permute(value, pairs)


def _fetch_gradients(optimizer) -> List[torch.Tensor]:
    """The gradients of `optimizer`'s parameters (those that have one)."""
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def reduce_gradients(optimizer, groups=None, pin_layout: bool = True) -> None:
    """Averages the gradients of `optimizer`'s parameters over all replicas."""
    count = xr.world_size()
    if count <= 1:
        return
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if grads:
        all_reduce(REDUCE_SUM, grads, scale=1.0 / count, groups=groups)


def optimizer_step(optimizer, barrier: bool = False, optimizer_args: dict = {}, groups=None,
                   pin_layout: bool = True):
    """Reduces gradients over replicas, runs `optimizer.step(**optimizer_args)`, optionally the barrier."""
    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    loss = optimizer.step(**optimizer_args)
    if barrier:
        mark_step()
    return loss


def collective_broadcast(tensors: List[torch.Tensor], root_ordinal: int = 0, groups=None,
                         pin_layout: bool = True) -> None:
    """Overwrites `tensors`, in place, with the values of replica `root_ordinal`'s."""
    with torch.no_grad():
        for t in tensors:
            # Every replica traces the same graph: the root is chosen by a device value,
            # not by Python control flow.
            mine = torch.tensor(xr.global_ordinal() == root_ordinal).to(t.device)
            t.copy_(all_reduce(REDUCE_SUM, torch.where(mine, t, torch.zeros_like(t)), groups=groups))


def rendezvous(tag: str, payload: bytes = b"", replicas: list = []) -> List[bytes]:
    """Waits for all replicas at `tag`; returns every replica's payload, by ordinal."""
    return _collectives().rendezvous(tag, payload, replicas)


def mesh_reduce(tag: str, data, reduce_fn: Callable):
    """Out-of-graph reduction: `reduce_fn` receives every replica's `data`."""
    return _collectives().mesh_reduce(tag, data, reduce_fn)


def broadcast_master_param(model: torch.nn.Module) -> None:
    """Copies the master replica's parameters and buffers to every replica."""
    _collectives().broadcast_master_param(model)


# ---- saving ------------------------------------------------------------------------------------

def _to_cpu_tree(data):
    if isinstance(data, torch.Tensor):
        return data.cpu() if data.device.type == "xla" else data
    if isinstance(data, dict):
        return type(data)((k, _to_cpu_tree(v)) for k, v in data.items()) if not hasattr(data, "_metadata") \
            else _copy_meta(data, type(data)((k, _to_cpu_tree(v)) for k, v in data.items()))
    if isinstance(data, list):
        return [_to_cpu_tree(v) for v in data]
    if isinstance(data, tuple):
        items = [_to_cpu_tree(v) for v in data]
        return type(data)(*items) if hasattr(data, "_fields") else tuple(items)
    if isinstance(data, set):
        return {_to_cpu_tree(v) for v in data}
    return data


def _copy_meta(src, dst):
    dst._metadata = src._metadata
    return dst


def _maybe_convert_to_cpu(data, convert: bool = True):
    return _to_cpu_tree(data) if convert else data


def save(data, file_or_path, master_only: bool = True, global_master: bool = False) -> None:
    """Moves `data` to the CPU and saves it with `torch.save`.

    A path is written atomically (a temporary file in the same directory, then a rename),
    so an interrupted save never leaves a half-written checkpoint.
    """
    should_write = is_master_ordinal(local=not global_master) if master_only else True
    cpu_data = _to_cpu_tree(data)
    if should_write:
        atomic_save(cpu_data, file_or_path)
    if xr.world_size() > 1:
        rendezvous("torch_xla.core.xla_model.save")


def atomic_save(obj, file_or_path) -> None:
    if not isinstance(file_or_path, (str, os.PathLike)):
        torch.save(obj, file_or_path)
        return
    path = os.fspath(file_or_path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def send_cpu_data_to_device(datas, device, input_sharding=None):
    """Moves every tensor in a nested structure to `device`.

    `input_sharding` (SPMD, a `ShardingSpec`): tensors it applies to are sent shard by
    shard with that layout."""
    def move(x):
        if isinstance(x, torch.Tensor):
            if input_sharding is not None and input_sharding.can_apply(x):
                from torch_xla.distributed.spmd.xla_sharding import send_sharded
                return send_sharded(x, input_sharding)
            return x.to(device)
        if isinstance(x, dict):
            return type(x)((k, move(v)) for k, v in x.items())
        if isinstance(x, DataWrapper):
            return x.from_tensors([move(v) for v in x.get_tensors()])
        if isinstance(x, (list, tuple)):
            items = [move(v) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        return x
    from ..utils.utils import DataWrapper
    if type(datas) is torch.Tensor:
        datas = [datas]
    return move(datas)


# ---- debugging ---------------------------------------------------------------------------------

def get_stablehlo(tensors: Optional[List[torch.Tensor]] = None) -> str:
    """The StableHLO text of the graph computing `tensors` (all pending tensors if None)."""
    return torch_xla._XLAC._get_stablehlo_text(tensors)


def get_stablehlo_bytecode(tensors: Optional[List[torch.Tensor]] = None) -> bytes:
    """The StableHLO of the graph computing `tensors`, as MLIR bytecode."""
    return torch_xla._XLAC._get_stablehlo_bytecode(tensors)


def __getattr__(name: str):
    if name == "RateTracker":
        from ._rate import RateTracker
        return RateTracker
    if name == "ToXlaTensorArena":
        from ._arena import ToXlaTensorArena
        return ToXlaTensorArena
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
