"""Debugging entry points users call as `torch_xla._XLAC._...`."""
from __future__ import annotations

import io
from typing import List, Optional

import torch

from ._engine import executor, ir, metrics, tensor as _tensor
from ._engine.executor import dumps as _dumps
from ._engine.metrics_report import format_report
from ._engine.tensor import state_of


def _roots(tensors: Optional[List[torch.Tensor]]):
    if tensors is None:
        states = _tensor.pending.take_live()
        _tensor.pending.restore(states)
    else:
        states = [state_of(t) for t in tensors]
    return [(s.node, s.idx) for s in states]


def _get_xla_tensors_text(tensors: List[torch.Tensor]) -> str:
    """The IR graph computing `tensors`, one node per line (with each op's source line
    when XLA_IR_DEBUG or `_set_ir_debug(True)` recorded it)."""
    roots = _roots(tensors)
    return _dumps.ir_text(executor.Graph(roots).order, roots)


def _get_xla_tensors_dot(tensors: List[torch.Tensor]) -> str:
    """The IR graph computing `tensors` in Graphviz's dot format."""
    roots = _roots(tensors)
    return _dumps.ir_dot(executor.Graph(roots).order, roots)


_dt = _dumps.dtype_text


def _get_ir_debug() -> bool:
    """Whether new IR nodes record the Python source line that created them."""
    return ir.RECORDING[0]


def _set_ir_debug(enable: bool) -> None:
    """Turns the recording of each new IR node's source line on or off (XLA_IR_DEBUG)."""
    ir.record_sources(bool(enable))


def _get_xla_tensors_hlo(tensors: Optional[List[torch.Tensor]]) -> str:
    """The program computing `tensors`, as XLA HLO text (before SPMD partitioning)."""
    return executor.lower_text(_roots(tensors), dialect="hlo")


def _get_stablehlo_text(tensors: Optional[List[torch.Tensor]]) -> str:
    """The program computing `tensors`, as StableHLO text."""
    return executor.lower_text(_roots(tensors))


def _get_stablehlo_bytecode(tensors: Optional[List[torch.Tensor]]) -> bytes:
    lowered = executor.lowered(_roots(tensors))
    ir_module = lowered.compiler_ir("stablehlo")
    buf = io.BytesIO()
    ir_module.operation.write_bytecode(buf)
    return buf.getvalue()


def _xla_metrics_report() -> str:
    return format_report(sorted(metrics.metrics), sorted(metrics.counters))


def _xla_sync_multi(tensors, devices=(), wait=True, sync_xla_data=True):
    executor.sync(wait=wait, states=[state_of(t) for t in tensors])


def _xla_get_default_device() -> str:
    return "xla:0"


def _xla_graph_executor_cache_size() -> int:
    return executor.cache_size()


# ---- SPMD ------------------------------------------------------------------------------------

def _get_xla_sharding_spec(t: torch.Tensor) -> str:
    """The sharding of xla tensor `t` as HLO text (`{devices=[4,1]0,1,2,3}`), '' if none."""
    from .distributed.spmd.xla_sharded_tensor import sharding_text
    return sharding_text(getattr(t, "global_tensor", t))


def _get_xla_sharding_type(t: torch.Tensor) -> Optional[int]:
    """The OpSharding type of `t`'s annotation (None when it has none)."""
    from ._engine import sharding as _sh
    from .distributed.spmd.mesh import sharding_type_of
    g = getattr(t, "global_tensor", t)
    kind = sharding_type_of(_sh.annotation(g), g.dim())
    return None if kind is None else int(kind)


def _xla_get_auto_sharding() -> bool:
    """Whether XLA chooses shardings automatically (it does not: annotations decide)."""
    return False


def _get_xla_tensor_debug_info(t: torch.Tensor) -> str:
    """What the engine holds for `t`: its IR value or device data, and its sharding."""
    from ._engine import mode as _mode, sharding as _sh
    g = getattr(t, "global_tensor", t)
    if not (isinstance(g, torch.Tensor) and g.device.type == "xla"):
        return "Not a XLATensor\n"
    s = state_of(g)
    lines = ["XLATensor {", f"TensorID: {id(s)}",
             f"Device: {'SPMD:0' if _mode.SPMD[0] else 'xla:0'}",
             f"XLA Shape: {_dt(s.dtype)}[{','.join(map(str, s.shape))}]"]
    from ._engine import runtime as _rt
    if type(s.node) is ir.DeviceData and type(s.node.array) is _rt.HostArray:
        lines.append("IR: None")
        lines.append("XLAData: None")
        lines.append("ShardingSpec: None")
        lines.append(f"Tensor on host: with size [{', '.join(map(str, s.shape))}]")
        lines.append("}")
        return "\n".join(lines) + "\n"
    if type(s.node) is ir.DeviceData:
        arr = s.node.array
        sharded = _mode.SPMD[0] and len(arr.sharding.device_set) > 1
        # A program's result has no IR; transferred data is a device-data leaf.
        lines.append("IR: None" if s.node.computed else "IR: xla::device_data")
        lines.append("XLAShardedData" if sharded else "XLAData:")
        lines.append(f"  Data Handle: {'Deleted' if arr.is_deleted() else id(arr)}")
        lines.append(f"  Data Device: {'SPMD:0' if _mode.SPMD[0] else 'xla:0'}")
        lines.append(f"  Data Shape: {_dt(s.dtype)}[{','.join(map(str, s.shape))}]")
        if sharded:
            sh = _sh.annotation(g) or arr.sharding
            lines.append(f"  OpSharding: {_sh.spec_text(sh, len(s.shape)) or '{replicated}'}")
            lines.append(f"  NumShards: {len(arr.sharding.device_set)}")
    else:
        lines.append(f"IR: {s.node.op}")
        lines.append("XLAData: None")
        ann = _sh.annotation(g)
        lines.append(f"ShardingSpec: {_sh.spec_text(ann, len(s.shape)) if ann is not None else 'None'}")
    lines.append("Tensor on host: None")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _get_local_shards(tensors: List[torch.Tensor]):
    """Per tensor: [(CPU shard, device name)] for this process's devices."""
    from .distributed.spmd.xla_sharded_tensor import local_shards_of
    return [[(s.data, s.shard_device) for s in local_shards_of(getattr(t, "global_tensor", t))]
            for t in tensors]


def _global_tensor_from_cpu_shards(shards, sharding, global_shape=None) -> torch.Tensor:
    """An xla tensor from one CPU piece per device, laid out as `sharding` (an OpSharding)."""
    from .distributed.spmd.xla_sharding import global_tensor_from_cpu_shards
    return global_tensor_from_cpu_shards(shards, sharding, global_shape)


# ---- the coordination service and preemption (distributed checkpoints) ------------------------

def _ensure_xla_coordinator_initialized(global_rank: int, world_size: int, master_addr: str,
                                        port: Optional[int] = None) -> None:
    """Starts the job's coordination service: the runtime joins it when it starts (jax.distributed);
    nothing is left to do here."""
    from ._engine import runtime as _rt
    _rt.jax_module()


def _activate_preemption_sync_manager() -> None:
    from .experimental.distributed_checkpoint import _preemption
    _preemption.activate()


def _deactivate_preemption_sync_manager() -> None:
    from .experimental.distributed_checkpoint import _preemption
    _preemption.deactivate()


def _sync_point_reached(step: int) -> bool:
    from .experimental.distributed_checkpoint import _preemption
    return _preemption.sync_point_reached(step)


def _spmd_full_to_shard_shape(t: torch.Tensor) -> torch.Tensor:
    """Each device's piece of annotated tensor `t`, as a per-device value (manual region)."""
    from ._engine import sharding as _sh
    return _sh.full_to_shard(getattr(t, "global_tensor", t))


def _spmd_shard_to_full_shape(t: torch.Tensor, sharding, full_shape, dtype=None) -> torch.Tensor:
    """The global tensor of `full_shape` whose per-device pieces are the values of manual `t`."""
    from ._engine import sharding as _sh
    return _sh.shard_to_full(getattr(t, "global_tensor", t), sharding.jax_sharding, tuple(full_shape))


def OpSharding(tile_assignment, group_assignment, replication_groups, sharding_type):
    """A concrete sharding from the original's pieces: REPLICATED, or TILED with a tile
    assignment (the nested list of device ids, one axis per tensor dimension)."""
    import numpy as np
    from .distributed.spmd.mesh import Mesh, OpSharding as _OpSharding, ShardingType
    from ._engine import sharding as _sh
    kind = ShardingType(int(sharding_type))
    if kind == ShardingType.REPLICATED:
        return _OpSharding(_sh.replicated_sharding(), 0)
    if kind == ShardingType.TILED:
        tiles = np.asarray(tile_assignment)
        names = tuple(f"_t{i}" for i in range(tiles.ndim))
        mesh = Mesh(tiles.reshape(-1), tiles.shape, names)
        return mesh.get_op_sharding(names)
    raise ValueError(f"OpSharding of type {kind.name} cannot be built from its pieces here; use "
                     f"Mesh.get_op_sharding(partition_spec)")


def _xla_increment_counter(name: str, value: int = 1) -> None:
    """Adds `value` to the metrics counter `name`."""
    metrics.inc(name, value)


def _xla_get_tensor_id(tensor: torch.Tensor) -> int:
    """An id of the value `tensor` holds: that of its device data leaf once materialised
    (what `_get_tensors_xla_device_data_node` reports), else of its lazy state."""
    s = state_of(tensor)
    return id(s.node) if type(s.node) is ir.DeviceData else id(s)


def _get_tensors_xla_device_data_node(tensors: List[torch.Tensor]):
    """(ids, values) of the device data leaves the graph computing `tensors` reads."""
    graph = executor.Graph(_roots(tensors))
    ids, values = [], []
    for p in graph.params:
        if type(p) is ir.DeviceData:
            shape, dtype = p.avals[0]
            ids.append(id(p))
            values.append(_tensor.wrap_user(_tensor.make_tensor(p, 0, shape, dtype)))
    return ids, values


def _get_graph_hash(tensors: List[torch.Tensor]) -> bytes:
    """The key of the graph computing `tensors` (equal for equal graphs); inside
    `alias_with_buffer_donor_config()`, which inputs are buffer donors counts too."""
    graph, _ = executor.walk(_roots(tensors))
    key = graph.key
    from .core import dynamo_bridge
    if dynamo_bridge.donor_config():
        key = hash((key, tuple(s for s, p in enumerate(graph.params) if p in ir.DONORS)))
    return key.to_bytes(8, "little", signed=True)


def _set_buffer_donation(tensor: torch.Tensor, should_donate: bool) -> bool:
    """Marks the device buffer of `tensor` as one a compiled graph may donate (overwrite
    with an output). False (and nothing done) when `tensor` is not device data."""
    s = state_of(tensor)
    if type(s.node) is not ir.DeviceData:
        return False
    if should_donate:
        ir.DONORS.add(s.node)
    else:
        ir.DONORS.discard(s.node)
    metrics.inc("XlaSetBufferDonation")
    return True


def _get_buffer_donation(tensor: torch.Tensor) -> bool:
    """Whether the device buffer of `tensor` is marked as a donor."""
    s = state_of(tensor)
    return type(s.node) is ir.DeviceData and s.node in ir.DONORS


def _init_computation_client() -> None:
    """Starts the runtime (jax and its PJRT client) now rather than at the first use."""
    from ._engine import runtime
    runtime.local_devices()
