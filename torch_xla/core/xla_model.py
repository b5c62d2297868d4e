"""`torch_xla.core.xla_model` (xm): devices, barriers, collectives, saving."""
from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, TextIO, Tuple, Union

import torch

import torch_xla
from .. import runtime as xr
from .._api import _device_position, _own_device_position, _real_devices_of, _rng_device, _warn_once
from .._engine import comm as _coll, executor, ir, rng, pjrt
from .._engine.executor import analysis as _analysis
from .._engine.tensor import state_of as _state_of

REDUCE_SUM = "sum"
REDUCE_MUL = "mul"
REDUCE_AND = "and"
REDUCE_OR = "or"
REDUCE_MIN = "min"
REDUCE_MAX = "max"

# Arguments already warned about: each warns once per process.
_WARNED: Set[str] = set()


def _no_effect(fn: str, arg: str, value: Any, why: str, stacklevel: int = 3) -> None:
    """Warns, once per argument per process, that `arg=value` changes nothing here
    (`stacklevel`: the user's call, as `warnings.warn` counts from here)."""
    if arg not in _WARNED:
        _WARNED.add(arg)
        warnings.warn(f"xm.{fn}: {arg}={value!r} has no effect here: {why}", UserWarning, stacklevel=stacklevel)


_PIN_LAYOUT_WHY = ("every replica runs the same compiled program, so the layouts of a collective's operands "
                   "agree on all replicas (what pinning guarantees) and no layout is constrained (what "
                   "unpinning would relax)")
_DEFVAL_WHY = "a process always knows its place in the job (alone, it is ordinal 0 of a world of 1)"


def _pin(fn: str, pin_layout: bool, default: bool) -> None:
    if pin_layout != default:
        _no_effect(fn, "pin_layout", pin_layout, _PIN_LAYOUT_WHY, stacklevel=4)


def _names_platform(devkind: str) -> bool:
    """Whether device kind `devkind` ('CPU', 'TPU', 'CUDA' or 'GPU', ...) is this process's."""
    kind, platform = str(devkind).upper(), pjrt.platform()
    return kind == platform or (kind == "GPU" and platform in ("CUDA", "ROCM"))


def xla_device(n: Optional[int] = None, devkind: Optional[str] = None) -> torch.device:
    """Returns a given instance of an XLA device (`torch_xla.device(n)`).

    devkind (deprecated): a process's devices are all of one kind; naming another kind
    warns once and changes nothing, as PyTorch/XLA ignores it."""
    if devkind is not None and not _names_platform(devkind):
        _no_effect("xla_device", "devkind", devkind, f"this process's devices are all {pjrt.platform()} devices")
    return torch_xla.device(n)


def get_xla_supported_devices(devkind: Optional[Union[str, int]] = None,
                              max_devices: Optional[int] = None) -> List[str]:
    """This process's xla devices of kind `devkind` (any kind if None), at most
    `max_devices`: `['xla:2']` for process 2 of a multi-process CPU job, `[]` for a
    kind it has none of. An integer first argument is `max_devices` (PyTorch/XLA 2.4 on
    dropped `devkind`)."""
    if isinstance(devkind, int) and not isinstance(devkind, bool):
        devkind, max_devices = None, devkind
    if devkind is not None and not _names_platform(devkind):
        return []
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
    return pjrt.platform()


def xla_device_kind(device: Optional[Union[str, torch.device]] = None) -> str:
    """The vendor's name of the kind of `device` (this process's device if None), as
    PJRT reports it: 'cpu' on the CPU, e.g. 'TPU v4' or 'NVIDIA A100-SXM4-40GB' elsewhere."""
    pos = 0
    if device is not None:
        d = torch.device(device)
        if d.type != "xla":
            raise RuntimeError(f"Invalid device format: {device}")
        pos = _device_position(d)  # another process's device: a RuntimeError
    devs = pjrt.local_devices()
    # In SPMD mode the one virtual device spans all of them: they are of one kind.
    return devs[min(pos, len(devs) - 1)].device_kind


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


def unlazy(tensors: List[torch.Tensor]) -> None:
    """Computes the pending values of `tensors` (xla tensors) now and waits until they
    exist. Meant for benchmarks; other pending tensors stay pending."""
    tensors = list(tensors)
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "xla":
            kind = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise RuntimeError(f"unlazy: expected xla tensors, got {kind}")
    executor.sync(wait=True, states=[_state_of(t) for t in tensors])


# ---- ordinals (one process = one device) -----------------------------------------------------

def get_ordinal(defval: int = 0) -> int:
    """The global ordinal of this process's device (`defval`: no effect, warned once)."""
    if defval != 0:
        _no_effect("get_ordinal", "defval", defval, _DEFVAL_WHY)
    return xr.global_ordinal()


def get_local_ordinal(defval: int = 0) -> int:
    """This process's ordinal on its host (`defval`: no effect, warned once)."""
    if defval != 0:
        _no_effect("get_local_ordinal", "defval", defval, _DEFVAL_WHY)
    return xr.local_ordinal()


def xrt_world_size(defval: int = 1) -> int:
    """Deprecated alias of `torch_xla.runtime.world_size()` (`defval`: no effect)."""
    warnings.warn("xm.xrt_world_size() is deprecated; use torch_xla.runtime.world_size()",
                  DeprecationWarning, stacklevel=2)
    if defval != 1:
        _no_effect("xrt_world_size", "defval", defval, _DEFVAL_WHY)
    return xr.world_size()


def is_master_ordinal(local: bool = True) -> bool:
    """Whether this process is the (local or global) master ordinal."""
    ordinal = xr.local_ordinal() if local else xr.global_ordinal()
    return ordinal == 0


def master_print(*args: Any, fd: Optional[TextIO] = None, local: bool = False, flush: bool = False) -> None:
    """`print(*args, file=fd, flush=flush)` on the master ordinal only: the global one, or
    each host's with `local=True`. `fd` defaults to the current `sys.stdout`."""
    if is_master_ordinal(local=local):
        import sys
        print(*args, file=fd if fd is not None else sys.stdout, flush=flush)


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


def wait_device_ops(devices: Sequence[str] = ()) -> None:
    """Waits for all the asynchronous operations on the devices to complete.

    devices: names such as 'xla:0' or 'CPU:0' (a name without `type:ordinal` form is a
    RuntimeError, as in PyTorch/XLA); this waits for every device of the process, those
    named among them."""
    for d in devices:
        kind, _, ordinal = str(d).partition(":")
        if not kind or not ordinal.lstrip("-").isdigit():
            raise RuntimeError(f"Invalid device specification: {d}")
    executor.sync(wait=False)
    pjrt.wait_all_buffers()
    executor.inspect_checks()


def add_step_closure(closure: Callable, args: tuple = (), run_async: bool = False) -> None:
    """Queues `closure(*args)` to run after the next barrier, when tensors are materialised."""
    executor.add_step_closure(closure, args, run_async)


# ---- random numbers ---------------------------------------------------------------------------

def set_rng_state(seed: int, device: Optional[str] = None) -> None:
    """Sets the device random number generator state (`device`: an xla device of this
    process; the default device if None)."""
    _rng_device("set_rng_state", device)
    rng.set_seed(seed)


def get_rng_state(device: Optional[str] = None) -> int:
    """The current device random number generator state, as an integer: `set_rng_state`
    of it returns to this position (random ops drawn before it are not repeated)."""
    _rng_device("get_rng_state", device)
    return rng.state()


@contextlib.contextmanager
def fork_rng(device: Optional[str] = None, enabled: bool = True) -> Iterator[None]:
    """Random ops inside draw from the device generator as usual; on exit it is back
    where it was on entry, so what follows draws the numbers it would have drawn without
    the block. `enabled=False` forks nothing."""
    if not enabled:
        yield
        return
    state = get_rng_state(device)
    try:
        yield
    finally:
        set_rng_state(state, device)


# ---- memory ------------------------------------------------------------------------------------

def get_memory_info(device: Optional[torch.device] = None) -> Dict[str, int]:
    """Device memory usage: bytes_used, bytes_limit (and kb_free/kb_total for old callers).

    device: an xla device of this process (the default device if None); another than the
    first (a process with several devices outside SPMD mode) warns once and reports the
    first device's usage."""
    if device is not None and _own_device_position("get_memory_info", device) != 0:
        _warn_once("memory_info_device", f"xm.get_memory_info: device={str(device)!r}: the statistics are "
                   f"those of this process's first device, {torch_xla.device()}", stacklevel=2)
    return pjrt.memory_info()


# ---- collectives (this process's view; see torch_xla.distributed for many processes) ---------

def _collectives():
    return _coll


def all_reduce(reduce_type: str, inputs, scale: float = 1.0, groups=None, pin_layout: bool = True):
    """Reduces `inputs` across replicas. A list is reduced in place and returned.

    pin_layout: False warns once and changes nothing: every replica runs the same
    compiled program, so the layouts of a collective's operands always agree across
    replicas (what pinning guarantees)."""
    if isinstance(inputs, torch.Tensor) and torch.compiler.is_compiling():
        # Inside torch.compile: an op of the graph (torch.ops.xla.all_reduce).
        if reduce_type not in (REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX):
            raise ValueError(f"invalid reduce type {reduce_type!r}")
        return torch.ops.xla.all_reduce(inputs, reduce_type, float(scale), [list(g) for g in groups or ()])
    _pin("all_reduce", pin_layout, True)
    return _collectives().all_reduce(reduce_type, inputs, scale=scale, groups=groups)


def all_gather(value: torch.Tensor, dim: int = 0, groups=None, output=None, pin_layout: bool = True):
    """Gathers `value` from all replicas along `dim`."""
    _pin("all_gather", pin_layout, True)
    return _collectives().all_gather(value, dim=dim, groups=groups, output=output)


def reduce_scatter(reduce_type: str, input, scale: float, scatter_dim: int, shard_count: int,
                   groups=None, output=None, pin_layout: bool = True):
    """Reduces across replicas and keeps this replica's shard along `scatter_dim`."""
    _pin("reduce_scatter", pin_layout, True)
    return _collectives().reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count,
                                         groups=groups, output=output)


def all_gather_bucketized(input_list: List[torch.Tensor], dim: int = 0, groups=None, output=None,
                          pin_layout: bool = False, bucket_cap_mb: float = 160) -> List[torch.Tensor]:
    """`all_gather` of a list, in buckets of at most `bucket_cap_mb` MiB."""
    _pin("all_gather_bucketized", pin_layout, False)
    return _collectives().bucketized(lambda i, o: all_gather(i, dim=dim, groups=groups, output=o),
                                     input_list, output, bucket_cap_mb)


def reduce_scatter_bucketized(reduce_type: str, input_list, scale: float, scatter_dim: int, shard_count: int,
                              groups=None, output=None, pin_layout: bool = False,
                              bucket_cap_mb: float = 160) -> List[torch.Tensor]:
    """`reduce_scatter` of a list, in buckets of at most `bucket_cap_mb` MiB."""
    _pin("reduce_scatter_bucketized", pin_layout, False)
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
    _pin("all_to_all", pin_layout, True)
    return _collectives().all_to_all(value, split_dimension, concat_dimension, split_count, groups=groups)


def collective_permute(value, pairs):
    """Sends `value` from source to target replica for each (source, target) pair."""
    return _collectives().collective_permute(value, pairs)


def send(value: torch.Tensor, channel_id: int) -> torch.Tensor:
    """Sends `value` to the replica that calls `recv` with the same `channel_id` (one
    sender and one receiver per channel; the k-th send of a channel is the k-th recv's).
    Returns `value` (detached).

    PyTorch/XLA builds an XLA Send into the step's graph. Here every replica's graph with
    a collective must be the same program, which a pipeline stage's is not, so the value
    is computed now and travels through the job's coordination service: the sender does
    not wait for the receiver."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"send(): value must be a Tensor, not {type(value).__name__}")
    _collectives().p2p_send(int(channel_id), value.detach().cpu())
    return value.detach()


def recv(output: torch.Tensor, channel_id: int) -> torch.Tensor:
    """Receives the tensor the matching `send` of `channel_id` sent: a new tensor on
    `output`'s device, of `output`'s shape and dtype (`output` itself is unchanged).
    Waits for the sender up to the job's collective timeout."""
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"recv(): output must be a Tensor, not {type(output).__name__}")
    got = _collectives().p2p_recv(int(channel_id))
    if got.shape != output.shape or got.dtype != output.dtype:
        raise RuntimeError(f"recv on channel {channel_id}: received a {got.dtype} tensor of shape "
                           f"{tuple(got.shape)}, expected {output.dtype} of shape {tuple(output.shape)}")
    res = got.to(output.device)
    if output.requires_grad:
        res.requires_grad_(True)
    return res


def _fetch_gradients(optimizer) -> List[torch.Tensor]:
    """The gradients of `optimizer`'s parameters (those that have one)."""
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def all_reduce_bucketized_gradients(gradients: Iterable[torch.Tensor], scale: float,
                                    groups: Optional[List[List[int]]], pin_layout: bool,
                                    bucket_cap_mb: float = 0) -> None:
    """Sums `gradients` over the replicas in place (times `scale`), in buckets: runs of
    consecutive gradients of one dtype holding at most `bucket_cap_mb` MiB (a larger
    gradient is a bucket of its own; 0: one gradient per bucket). Each bucket is one
    all-reduce of its gradients concatenated."""
    _pin("all_reduce_bucketized_gradients", pin_layout, True)
    grads = list(gradients)
    cap = bucket_cap_mb * 1024 * 1024

    def flush(bucket: List[torch.Tensor]) -> None:
        if len(bucket) == 1:
            all_reduce(REDUCE_SUM, bucket, scale=scale, groups=groups)
            return
        flat = _collectives().all_reduce(REDUCE_SUM, torch.cat([g.detach().reshape(-1) for g in bucket]),
                                         scale=scale, groups=groups)
        with torch.no_grad():
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(part.view(g.shape))

    bucket: List[torch.Tensor] = []
    total = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (total + nbytes > cap or g.dtype != bucket[0].dtype):
            flush(bucket)
            bucket, total = [], 0
        bucket.append(g)
        total += nbytes
    if bucket:
        flush(bucket)


def reduce_gradients(optimizer, groups=None, pin_layout: bool = True) -> None:
    """Averages the gradients of `optimizer`'s parameters over all replicas."""
    _pin("reduce_gradients", pin_layout, True)
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
    _pin("collective_broadcast", pin_layout, True)
    with torch.no_grad():
        for t in tensors:
            # Every replica traces the same graph: the root is chosen by a device value,
            # not by Python control flow.
            mine = torch.tensor(xr.global_ordinal() == root_ordinal).to(t.device)
            t.copy_(all_reduce(REDUCE_SUM, torch.where(mine, t, torch.zeros_like(t)), groups=groups))


def rendezvous(tag: str, payload: bytes = b"", replicas: list = []) -> List[bytes]:
    """Waits for all replicas at `tag`; returns every replica's payload, by ordinal."""
    return _collectives().rendezvous(tag, payload, replicas)


def do_on_ordinals(target: Callable[..., Any], data: Union[Tuple, Any] = (),
                   ordinals: Union[List[int], Set[int], int] = (0,)) -> Optional[Any]:
    """Runs `target(*data)` on the replicas whose ordinal is in `ordinals`, with the xla
    tensors of `data` moved to the CPU; then every replica waits for the others. Returns
    `target`'s result where it ran, None elsewhere. Every replica computes `data`'s
    pending tensors (one program for all, as their collectives need)."""
    if isinstance(ordinals, int):
        ordinals = (ordinals,)
    running = xr.global_ordinal() in ordinals
    pending = []

    def collect(x):
        if isinstance(x, torch.Tensor):
            if x.device.type == "xla":
                pending.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                collect(v)
    collect(data)
    if pending:
        executor.sync(states=[_state_of(t) for t in pending])
    result = target(*_to_cpu_tree(data)) if running else None
    rendezvous("torch_xla.core.xla_model.do_on_ordinals")
    return result


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
