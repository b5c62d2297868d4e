"""Helpers of the SPMD checkpoint planners: state_dict flattening, shard layouts, CPU shards.

A sharded xla tensor is described by its local layout: one entry per device of this
process, in device id order (the order of `XLAShardedTensor.local_shards`), giving the
slices of the global tensor it holds, its replica id and its padded shape.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.utils._pytree import tree_flatten, tree_unflatten

from torch_xla._engine import ir
from torch_xla._engine import mode as _mode
from torch_xla._engine import pjrt as _rt
from torch_xla._engine import partitioning as _sh
from torch_xla._engine import tensor as _tensor
from torch_xla._engine.executor import barrier as _barrier
from torch_xla.distributed.spmd import XLAShard, XLAShardedTensor

PATH_ITEM = Union[str, int]
OBJ_PATH = Tuple[Any, ...]
FLATTEN_MAPPING = Dict[str, OBJ_PATH]

# Device reads of the planners may come from the storage writer's threads.
device_lock = threading.RLock()


# ---- state_dict flattening --------------------------------------------------------------------

@dataclasses.dataclass
class _CpuShards:
    """A sharded xla tensor copied to the CPU: its replica-0 pieces (unpadded) and its shape."""
    shards: List[XLAShard]
    global_shape: torch.Size


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, _CpuShards)):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_tensors(v) for v in value)
    return False


def flatten_state_dict(state_dict: STATE_DICT_TYPE) -> Tuple[Dict[str, Any], FLATTEN_MAPPING]:
    """A flat {dotted key: value} view of nested dicts / lists, and each key's path.

    Containers holding no tensor (nor `_CpuShards`) stay whole values; path items keep
    their original keys (an optimizer's integer state keys stay integers)."""
    flat: Dict[str, Any] = {}
    mappings: FLATTEN_MAPPING = {}

    def visit(path: OBJ_PATH, value: Any) -> None:
        if isinstance(value, Mapping) and _holds_tensors(value):
            for k, v in value.items():
                visit(path + (k,), v)
        elif isinstance(value, list) and _holds_tensors(value):
            for i, v in enumerate(value):
                visit(path + (i,), v)
        else:
            key = ".".join(map(str, path))
            if key in flat:
                raise ValueError(f"duplicated flattened key {key}")
            flat[key] = value
            mappings[key] = path

    for k, v in state_dict.items():
        visit((k,), v)
    return flat, mappings


def set_element(root: STATE_DICT_TYPE, path: OBJ_PATH, value: Any) -> None:
    """Sets `value` at `path` inside nested dicts / lists (made when missing)."""
    cur: Any = root
    for key, nxt in zip(path[:-1], path[1:]):
        default = [] if isinstance(nxt, int) else {}
        if isinstance(cur, list):
            while len(cur) <= key:
                cur.append(None)
            if cur[key] is None:
                cur[key] = default
            cur = cur[key]
        else:
            cur = cur.setdefault(key, default)
    if isinstance(cur, list):
        while len(cur) <= path[-1]:
            cur.append(None)
    cur[path[-1]] = value


def narrow_tensor_by_index(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of `tensor` starting at `offsets` with extent `sizes`."""
    out = tensor
    for dim, (off, size) in enumerate(zip(offsets, sizes)):
        if off != 0 or size < tensor.size(dim):
            out = out.narrow(dim, off, size)
    return out


# ---- sharded xla tensors ----------------------------------------------------------------------

def _global(t: Any) -> Any:
    return t.global_tensor if isinstance(t, XLAShardedTensor) else t


def is_xla_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "xla"


def xla_sharding(t: Any):
    """The sharding of xla tensor `t` if it is split over several devices, else None."""
    if not _mode.modes.spmd or not is_xla_tensor(t):
        return None
    g = _global(t)
    sh = _sh.annotation(g) or _sh.data_sharding(g)
    if sh is None or not hasattr(sh, "spec") or _sh.is_replicated(sh) or len(sh.device_set) < 2:
        return None
    return sh


def _is_sharded_tensor(x: Any) -> bool:
    """Whether `x` is an XLAShardedTensor whose data is split over several devices."""
    return isinstance(x, XLAShardedTensor) and xla_sharding(x.global_tensor) is not None


def wrap_if_sharded(x: Any) -> Any:
    """`x` as an XLAShardedTensor when it is an xla tensor split over several devices."""
    if isinstance(x, XLAShardedTensor) or xla_sharding(x) is None:
        return x
    return XLAShardedTensor(x)


def local_layout(t: torch.Tensor) -> List[Tuple[Any, Tuple[slice, ...], int, Tuple[int, ...]]]:
    """Per local device of sharded xla tensor `t`: (device, slices, replica id, padded shape)."""
    sh = xla_sharding(t)
    pi = _rt.jax_module().process_index()
    return [r for r in _sh.shard_layout(sh, tuple(t.shape)) if r[0].process_index == pi]


def chunk_of(index: Tuple[slice, ...]) -> Tuple[torch.Size, torch.Size]:
    """(offsets, sizes) of a piece given by its slices."""
    return torch.Size(s.start for s in index), torch.Size(s.stop - s.start for s in index)


def is_empty(index: Tuple[slice, ...]) -> bool:
    return any(s.stop <= s.start for s in index)


def sync_tensors(values: Sequence[Any]) -> None:
    """Runs the pending graphs of the xla tensors among `values` (one execution)."""
    pending = [_tensor.state_of(_global(v)) for v in values if is_xla_tensor(v)]
    pending = [s for s in pending if type(s.node) is not ir.DeviceData]
    if pending:
        with device_lock:
            _barrier.sync(states=pending)


def fetch_pieces(t: torch.Tensor, positions: Sequence[int]) -> Dict[int, torch.Tensor]:
    """Unpadded CPU copies of the local pieces of sharded tensor `t` at `positions` of its
    local layout; each piece comes from its own device buffer (no gather) when it can."""
    g = _global(t)
    layout = local_layout(g)
    with device_lock:
        arr = _barrier.materialize(_tensor.state_of(g))
        by_dev = {s.device: s for s in arr.addressable_shards}
        host = None
        out = {}
        for p in positions:
            dev, index, _, _ = layout[p]
            shard = by_dev.get(dev)
            if shard is not None and _same_index(shard.index, index, g.shape):
                data = np.asarray(shard.data)
            else:
                if host is None:
                    host = np.asarray(arr)
                data = host[index]
            out[p] = _rt.from_numpy(data, g.dtype)
    return out


def _same_index(a: Tuple[slice, ...], b: Tuple[slice, ...], shape) -> bool:
    a = tuple(a) + (slice(None),) * (len(shape) - len(a))
    return all(x.indices(n)[:2] == (y.start, y.stop) for x, y, n in zip(a, b, shape))


def replica0_positions(layout) -> List[int]:
    """Positions of the local pieces that hold replica 0 of a non-empty part of the tensor."""
    return [p for p, (_, index, rep, _) in enumerate(layout) if rep == 0 and not is_empty(index)]


# ---- copies on the CPU (async checkpoints) ------------------------------------------------------

def _cpu_shards(t: torch.Tensor) -> _CpuShards:
    g = _global(t)
    layout = local_layout(g)
    positions = replica0_positions(layout)
    data = fetch_pieces(g, positions)
    shards = [XLAShard(data[p], list(layout[p][1]), f"{_rt.platform()}:{layout[p][0].id}", 0)
              for p in positions]
    return _CpuShards(shards=shards, global_shape=g.shape)


def _sharded_cpu_state_dict(state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
    """`state_dict` with its xla tensors copied to the CPU: sharded ones as `_CpuShards`
    (this process's replica-0 pieces), the others as whole CPU tensors."""
    flat, spec = tree_flatten(state_dict)
    sync_tensors(flat)

    def to_cpu(x: Any) -> Any:
        if xla_sharding(x) is not None:
            return _cpu_shards(x)
        if is_xla_tensor(x):
            with device_lock:
                return _global(x).detach().cpu()
        return x

    return tree_unflatten([to_cpu(x) for x in flat], spec)


def sharded_state_dict_parts(flat: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Splits a flat state_dict into (sharded xla tensors and `_CpuShards`, everything else)."""
    flat = {k: wrap_if_sharded(v) for k, v in flat.items()}
    sharded = {k: v for k, v in flat.items() if _is_sharded_tensor(v) or isinstance(v, _CpuShards)}
    rest = {k: _global(v) for k, v in flat.items() if k not in sharded}
    return sharded, rest


def pieces_numel(layout, positions: Optional[Sequence[int]] = None) -> int:
    ps = range(len(layout)) if positions is None else positions
    return sum(int(np.prod([s.stop - s.start for s in layout[p][1]])) for p in ps)
