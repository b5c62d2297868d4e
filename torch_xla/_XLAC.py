"""Debugging entry points users call as `torch_xla._XLAC._...`."""
from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch

from ._engine import executor, ir, telemetry, tensor as _tensor
from ._engine.executor import dumps as _dumps, hlo_proto as _hlo_proto
from ._engine.metrics_report import format_report
from ._engine.tensor import state_of


def _roots(tensors: Optional[List[torch.Tensor]]):
    from ._engine import mode, partitioning
    if mode.modes.spmd:
        # The constraints the next barrier adds (annotated tensors updated since they were
        # annotated keep their layout): the dumps show the program that will run.
        partitioning.constrain_annotated()
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
    return ir.recording.on


def _set_ir_debug(enable: bool) -> None:
    """Turns the recording of each new IR node's source line on or off (XLA_IR_DEBUG)."""
    ir.record_sources(bool(enable))


def _get_xla_tensors_hlo(tensors: Optional[List[torch.Tensor]]) -> str:
    """The program computing `tensors`, as XLA HLO text (before SPMD partitioning; with
    XLA_DUMP_POST_OPTIMIZATIONS, the compiled program after XLA's passes)."""
    from ._engine import env_vars
    if env_vars.get("XLA_DUMP_POST_OPTIMIZATIONS"):
        from ._engine.executor import barrier, hlo_text
        return hlo_text.optimized_graph(*barrier.walk(_roots(tensors)))
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


def _xla_mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Declares dimension `dim` of device data `t` unbounded: the StableHLO text of the
    graphs reading it (`xm.get_stablehlo`) has that size as `?`; running them does not
    change."""
    from ._engine.executor import unbounded
    rank = t.dim()
    if not -rank <= dim < max(rank, 1) or rank == 0:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], "
                         f"but got {dim})")
    node = state_of(t).node
    if type(node) is not ir.DeviceData:
        raise ValueError("_xla_mark_dynamic: the tensor must be device data (a tensor moved to the device or "
                         "materialized by a sync), not the pending result of ops")
    unbounded.mark(node, dim % rank)


def _xla_metrics_report() -> str:
    telemetry.settle()
    return format_report(sorted(telemetry.metrics), sorted(telemetry.counter_items()))


def _xla_sync_multi(tensors, devices=(),  # noqa: ARG001 (the tensors name their devices)
                    wait=True,
                    sync_xla_data=True):  # noqa: ARG001 (lets the original donate; a partial sync never does)
    """Computes the pending values of `tensors` (`wait`: until they exist). PyTorch/XLA's
    `sync_xla_data` only allows donating input buffers, which a sync of some tensors
    never does here: other pending IR may still read them."""
    executor.sync(wait=wait, states=[state_of(t) for t in tensors])


def _xla_get_default_device() -> str:
    from ._engine import pjrt
    return f"xla:{pjrt.device_index()}"


def _xla_graph_executor_cache_size() -> int:
    return executor.cache_size()


# ---- SPMD ------------------------------------------------------------------------------------

def _get_xla_sharding_spec(t: torch.Tensor) -> str:
    """The sharding of xla tensor `t` as HLO text (`{devices=[4,1]0,1,2,3}`), '' if none."""
    from .distributed.spmd.xla_sharded_tensor import sharding_text
    return sharding_text(getattr(t, "global_tensor", t))


def _get_xla_sharding_type(t: torch.Tensor) -> Optional[int]:
    """The OpSharding type of `t`'s annotation (None when it has none)."""
    from ._engine import partitioning as _sh
    from .distributed.spmd.mesh import sharding_type_of
    g = getattr(t, "global_tensor", t)
    kind = sharding_type_of(_sh.annotation(g), g.dim())
    return None if kind is None else int(kind)


def _xla_get_auto_sharding() -> bool:
    """Whether automatic sharding is on (`xr.use_spmd(auto=True)` or `XLA_AUTO_SPMD`)."""
    from ._engine import auto_sharding
    return auto_sharding.enabled()


def _xla_set_auto_sharding(enable: bool) -> None:
    """Turns automatic sharding on or off (on: `xr.use_spmd(auto=True)` without the mode switch)."""
    from ._engine import auto_sharding
    if enable:
        auto_sharding.enable()
    else:
        auto_sharding.disable()


def _get_xla_tensor_debug_info(t: torch.Tensor) -> str:
    """What the engine holds for `t`: its IR value or device data, and its sharding."""
    from ._engine import mode as _mode, partitioning as _sh
    g = getattr(t, "global_tensor", t)
    if not (isinstance(g, torch.Tensor) and g.device.type == "xla"):
        return "Not a XLATensor\n"
    s = state_of(g)
    lines = ["XLATensor {", f"TensorID: {id(s)}",
             f"Device: {'SPMD:0' if _mode.modes.spmd else g.device}",
             f"XLA Shape: {_dt(s.dtype)}[{','.join(map(str, s.shape))}]"]
    from ._engine import pjrt as _rt
    if type(s.node) is ir.DeviceData and type(s.node.array) is _rt.HostArray:
        lines.append("IR: None")
        lines.append("XLAData: None")
        lines.append("ShardingSpec: None")
        lines.append(f"Tensor on host: with size [{', '.join(map(str, s.shape))}]")
        lines.append("}")
        return "\n".join(lines) + "\n"
    if type(s.node) is ir.DeviceData:
        arr = s.node.array
        sharded = _mode.modes.spmd and len(arr.sharding.device_set) > 1
        # A program's result has no IR; transferred data is a device-data leaf.
        lines.append("IR: None" if s.node.computed else "IR: xla::device_data")
        lines.append("XLAShardedData" if sharded else "XLAData:")
        lines.append(f"  Data Handle: {'Deleted' if arr.is_deleted() else id(arr)}")
        lines.append(f"  Data Device: {'SPMD:0' if _mode.modes.spmd else g.device}")
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

def _ensure_xla_coordinator_initialized(
        global_rank: int, world_size: int, master_addr: str,  # noqa: ARG001 (the runtime's own, see below)
        port: Optional[int] = None) -> None:  # noqa: ARG001 (the runtime's own, see below)
    """Starts the job's coordination service: the runtime joins it when it starts (jax.distributed),
    from the job's own rank, size and address, so the arguments (the original's signature) are
    those the runtime already has, and nothing is left to do but start it (the original's call
    is likewise a no-op once its service runs)."""
    from ._engine import pjrt as _rt
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
    from ._engine import partitioning as _sh
    return _sh.full_to_shard(getattr(t, "global_tensor", t))


def _spmd_shard_to_full_shape(t: torch.Tensor, sharding, full_shape, dtype=None) -> torch.Tensor:
    """The global tensor of `full_shape` and `dtype` (None: `t`'s) whose per-device pieces are
    the values of manual `t`."""
    from ._engine import partitioning as _sh
    t = getattr(t, "global_tensor", t)
    if dtype is not None and dtype != t.dtype and _sh.is_manual(t):
        # Converted per device, inside the region, so that the result keeps its annotation.
        t = _sh.mark_manual(t.to(dtype))
    return _sh.shard_to_full(t, sharding.jax_sharding, tuple(full_shape))


def OpSharding(tile_assignment, group_assignment, replication_groups,  # noqa: ARG001 (PARTIAL's, refused below)
               sharding_type):
    """A concrete sharding from the original's pieces: REPLICATED, or TILED with a tile
    assignment (the nested list of device ids, one axis per tensor dimension); the group
    arguments describe PARTIAL shardings, which are built with `Mesh.get_op_sharding`."""
    import numpy as np
    from .distributed.spmd.mesh import Mesh, OpSharding as _OpSharding, ShardingType
    from ._engine import partitioning as _sh
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
    telemetry.inc(name, value)


def _xla_get_tensor_id(tensor: torch.Tensor) -> int:
    """An id of the value `tensor` holds: that of its device data leaf once materialised
    (what `_get_tensors_xla_device_data_node` reports), else of its lazy state."""
    s = state_of(tensor)
    return id(s.node) if type(s.node) is ir.DeviceData else id(s)


def _get_tensors_xla_device_data_node(tensors: List[torch.Tensor], uncloned_tensors: List[torch.Tensor] = ()):
    """(ids, values) of the device data leaves the graph computing `tensors` reads, one
    per buffer, in the input order of `_run_cached_graph`. A leaf held by one of
    `uncloned_tensors` is given as that tensor, any other as a new tensor on the leaf."""
    from .core import dynamo_bridge
    given = {_xla_get_tensor_id(t): t for t in uncloned_tensors}
    ids, values = [], []
    for p in dynamo_bridge.graph_inputs(_roots(tensors)):
        shape, dtype = p.avals[0]
        ids.append(id(p))
        t = given.get(id(p))
        values.append(t if t is not None else _tensor.wrap_user(_tensor.make_tensor(p, 0, shape, dtype)))
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
    from ._engine.executor import donation
    return donation.set_donor(tensor, should_donate)


def _get_buffer_donation(tensor: torch.Tensor) -> bool:
    """Whether the device buffer of `tensor` is marked as a donor."""
    s = state_of(tensor)
    return type(s.node) is ir.DeviceData and s.node in ir.DONORS


def _xla_set_enable_alias_with_buffer_donor_config(enable_user_config_alias: bool = False,
                                                   device: str = "") -> None:  # noqa: ARG001 (one setting for all devices)
    """On: every execution (partial syncs and host reads too, not only a full barrier)
    donates the buffers marked by `_set_buffer_donation`, and graph hashes count them."""
    from ._engine.executor import donation
    from .core import dynamo_bridge
    donation.config.alias = bool(enable_user_config_alias)
    dynamo_bridge._donor_config.alias = bool(enable_user_config_alias)


def _xla_get_enable_alias_with_buffer_donor_config(device: str = "") -> bool:  # noqa: ARG001
    from ._engine.executor import donation
    return donation.config.alias


def _xla_create_placeholder_tensor(shape) -> torch.Tensor:
    """An xla tensor of XLA shape `shape` (`{'type': 'f32', 'sizes': (2, 3)}`) with no
    device buffer: device data the graphs that read it take as a parameter, for printing
    their programs; reading its value raises RuntimeError."""
    from .core import xla_builder
    return xla_builder._placeholder(shape)


def _is_placecholder(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is device data without a buffer: a placeholder, or a buffer that
    a program deleted (donated). (The original's spelling.)"""
    s = state_of(tensor)
    if type(s.node) is not ir.DeviceData:
        return False
    arr = s.node.array
    from .core.xla_builder import _NoBuffer
    return type(arr) is _NoBuffer or arr.is_deleted()


def _get_tensors_handle(tensors: List[torch.Tensor]) -> List[int]:
    """An id of the device buffer each tensor holds (equal for tensors sharing one).
    RuntimeError for a tensor whose value is pending or whose buffer was deleted."""
    from .core.xla_builder import _NoBuffer
    out = []
    for t in tensors:
        s = state_of(t)
        if type(s.node) is not ir.DeviceData:
            raise RuntimeError("_get_tensors_handle: the tensor holds no device data (its value is pending)")
        arr = s.node.array
        if type(arr) is not _NoBuffer and arr.is_deleted():
            raise RuntimeError("_get_tensors_handle: the tensor's device buffer is deleted (donated to a program)")
        out.append(id(arr))
    return out


def _replace_xla_tensor(self: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`self` takes `source`'s current value, shape and dtype (as `set_` does, outside
    autograd: a parameter's data can change shape, the way FSDP swaps a full parameter and
    its shard), and returns `self`. Later in-place writes to one do not reach the other."""
    for name, t in (("self", self), ("source", source)):
        if not isinstance(t, torch.Tensor) or t.device.type != "xla":
            raise RuntimeError(f"_replace_xla_tensor: {name} must be an xla tensor, got "
                               f"{t.device if isinstance(t, torch.Tensor) else type(t).__name__}")
    with torch.no_grad():
        self.set_(source.clone())
    return self


def _init_computation_client() -> None:
    """Starts the runtime (jax and its PJRT client) now rather than at the first use."""
    from ._engine import pjrt
    pjrt.local_devices()


# ---- computations built by hand (torch_xla.core.xla_builder) ----------------------------

def _xla_user_computation(opname: str, inputs: List[torch.Tensor], computation) -> List[torch.Tensor]:
    """Applies an `xla_builder` computation to xla tensors (one result per tuple element)."""
    from .core import xla_builder
    return xla_builder.user_computation(opname, inputs, computation)


def _xla_computation_text(computation) -> str:
    return computation.hlo_text()


def _xla_op_computation_from_module_proto(name: str, module_proto: bytes):
    """`xla_builder.computation_from_module_proto`: a computation of a serialized module."""
    from .core import _flat_calls
    return _flat_calls.computation_from_module_proto(name, module_proto)


# ---- DLPack (torch_xla.utils.dlpack) -----------------------------------------------------

def _to_dlpack(t: torch.Tensor):
    """A DLPack capsule of the device buffer holding `t`'s value (CPU device)."""
    from ._engine import pjrt
    arr = executor.materialize(state_of(t))
    want = pjrt.numpy_dtype(t.dtype)
    if arr.dtype != want:  # XLA_USE_BF16 / XLA_DOWNCAST_BF16 storage
        arr = arr.astype(want)
    return arr.__dlpack__()


def _from_dlpack(ext):
    """An xla tensor holding a copy of a DLPack capsule's (or `__dlpack__` object's) data."""
    return torch.utils.dlpack.from_dlpack(ext).to("xla")


def _xla_tensors_from_aten(tensors: List[torch.Tensor], devices: List[str]) -> List[torch.Tensor]:
    """Copies of CPU tensors on the given xla devices."""
    return [t.to(torch.device(d)) for t, d in zip(tensors, devices)]


def _xla_real_devices(devices: List[str]) -> List[str]:
    """The hardware devices (`CPU:0`, `TPU:1`...) behind xla devices."""
    from ._api import _real_devices_of
    return _real_devices_of(devices)


def _get_xla_tensor_dimension_size(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The size of dimension `dim` of `t` as a 0-d int32 xla tensor (a bounded dynamic
    size is its device value: no host read)."""
    from ._engine.kernels import bounded
    return bounded.dimension_size(t, dim)


def _get_xla_tensor_shape_type(t: torch.Tensor) -> str:
    """The XLA element type of `t` on the device ('f32', 'bf16', ...)."""
    from ._engine import pjrt
    return _dt(pjrt.torch_dtype(pjrt.device_dtype(t.dtype)))


def _get_executed_fallback_ops() -> List[str]:
    """The ops that ran on the CPU fallback so far (`aten::<op>` counters)."""
    return sorted(k for k in telemetry.counters if k.startswith("aten::"))


def _init_xla_lazy_backend() -> None:
    """The backend is set up by `import torch_xla`; calling this again does nothing."""


def _get_git_revs() -> dict:
    """Versions of the pieces: `xla` (the XLA in jaxlib), `torch`, `torch_xla`."""
    import jaxlib
    return {"xla": f"jaxlib {jaxlib.__version__}", "torch": torch.version.git_version or torch.__version__,
            "torch_xla": _project_version()}


def _project_version() -> str:
    try:
        from importlib.metadata import version
        return version("torch-xla-jax")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source tree)
        return "unknown"


def _unsafe_buffer_pointer(t: torch.Tensor) -> int:
    """The address of the device buffer holding `t` (its pending graph runs first)."""
    arr = executor.materialize(state_of(t))
    arr.block_until_ready()
    return int(arr.addressable_data(0).unsafe_buffer_pointer())


def _aten_type_name(t: torch.Tensor) -> str:
    """The tensor's ATen type as PyTorch's C++ names it (`CPUBFloat16Type`)."""
    scalar = t.type().rsplit(".", 1)[-1][:-len("Tensor")]
    return f"{t.device.type.upper()}{scalar}Type"


def _dot_general_dims(dimension_numbers) -> list:
    """[lhs contracting, rhs contracting, lhs batch, rhs batch] from the nested tuples,
    checked as the original binding checks them."""
    if not isinstance(dimension_numbers, tuple) or len(dimension_numbers) != 2:
        raise RuntimeError("dimension_numbers must be a tuple of 2 elements")
    dims = []
    for i, pair in enumerate(dimension_numbers):
        if not isinstance(pair, tuple):
            raise RuntimeError(f"_xla_dot_general: Dimension_numbers[{i}] must be a tuple")
        if len(pair) not in (0, 2):
            raise RuntimeError("_xla_dot_general: Contracting/batch dims must be specified for both lhs and rhs "
                               "or neither")
        if not pair:
            dims += [[], []]
            continue
        for dim_list in pair:
            if not isinstance(dim_list, list):
                raise RuntimeError("_xla_dot_general: lhs/rhs contracting/batch dims must be a list")
            if not all(isinstance(d, int) for d in dim_list):
                raise RuntimeError("_xla_dot_general: lhs/rhs contracting/batch dims must be a list of integers")
            dims.append(list(dim_list))
    return dims


def _canonical_dim(d: int, rank: int) -> int:
    if not -rank <= d < rank:
        raise RuntimeError(f"Value out of range (expected to be in range of [{-rank}, {rank - 1}], but got {d})")
    return d % rank


def _xla_dot_general(lhs: torch.Tensor, rhs: torch.Tensor, dimension_numbers,
                     precision_config: Optional[str] = None,
                     preferred_element_type: Optional[torch.dtype] = None) -> torch.Tensor:
    """XLA's DotGeneral of two xla tensors, their element types kept (`int8 x int8` with
    `preferred_element_type=torch.int32` is an integer dot). `dimension_numbers` is
    (([lhs contracting], [rhs contracting]), ([lhs batch], [rhs batch])), `()` for none.
    The result holds the batch dims, then lhs's free dims, then rhs's."""
    from ._engine import pjrt
    from ._engine.kernels import engine_op
    dims = _dot_general_dims(dimension_numbers)
    if precision_config is not None:
        raise RuntimeError("_xla_dot_general: precision_config is not supported yet, default precision setting "
                           "will be applied.")
    for t, position in ((lhs, "first argument"), (rhs, "second argument")):
        if not isinstance(t, torch.Tensor) or t.device.type != "xla":
            got = _aten_type_name(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise RuntimeError(f"Expected input tensor ({position}) to be an actual XLA tensor. Got: {got}. "
                               f"Consider moving it ({position}) to XLA.")
    lc, rc, lb, rb = ([_canonical_dim(d, t.dim()) for d in ds]
                      for ds, t in zip(dims, (lhs, rhs, lhs, rhs)))
    if len(lc) != len(rc) or [lhs.shape[d] for d in lc] != [rhs.shape[d] for d in rc]:
        raise RuntimeError(f"_xla_dot_general: contracting dimension sizes are not compatible: "
                           f"lhs {list(lhs.shape)} dims {lc}, rhs {list(rhs.shape)} dims {rc}")
    if len(lb) != len(rb) or [lhs.shape[d] for d in lb] != [rhs.shape[d] for d in rb]:
        raise RuntimeError(f"_xla_dot_general: batch dimension sizes must match for lhs/rhs: "
                           f"lhs {list(lhs.shape)} dims {lb}, rhs {list(rhs.shape)} dims {rb}")
    if len(set(lc + lb)) != len(lc + lb) or len(set(rc + rb)) != len(rc + rb):
        raise RuntimeError("_xla_dot_general: a dimension is both contracting and batch, or repeated")
    shape = (tuple(lhs.shape[d] for d in lb)
             + tuple(s for d, s in enumerate(lhs.shape) if d not in lc and d not in lb)
             + tuple(s for d, s in enumerate(rhs.shape) if d not in rc and d not in rb))
    out_dtype = preferred_element_type or torch.promote_types(lhs.dtype, rhs.dtype)
    dn = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    (out,) = engine_op("xla::typed_dot_general", [lhs, rhs], (dn, pjrt.device_dtype(out_dtype)),
                       [(shape, out_dtype)])
    return out


def _xla_set_mat_mul_precision(precision: str) -> None:
    """Precision of matrix products and convolutions in programs compiled from now on."""
    from ._engine.lowering.table import matmul_precision, set_matmul_precision
    if precision not in ("default", "high", "highest"):
        raise ValueError(f"Invalid precision: {precision!r}. Expected one of 'default', 'high', 'highest'.")
    if precision != matmul_precision():
        set_matmul_precision(precision)
        # Graph keys do not include it: programs lowered with the old one must go.
        executor.clear_cache()


def _xla_get_mat_mul_precision() -> str:
    from ._engine.lowering.table import matmul_precision
    return matmul_precision()


# ---- the runtime ------------------------------------------------------------------------------

def _xla_runtime_is_initialized() -> bool:
    """Whether this process's runtime (jax and its PJRT client) has started."""
    from ._engine import boot
    return boot.started()


def _xla_get_all_devices() -> List[str]:
    """Every device of the job, by runtime name (`CPU:0`, `CPU:1`, ...)."""
    from ._engine import job, pjrt
    return [f"{pjrt.platform()}:{i}" for i in range(job.world_size() * pjrt.device_count())]


def _on_ready_callback(tensor: torch.Tensor, callback) -> None:
    """Calls `callback()` on a helper thread once `tensor`'s device buffer holds its value."""
    executor.on_ready(state_of(tensor), callback)


def _set_allow_execution(allow: bool) -> None:
    """False: any graph execution raises RuntimeError (for code that must only trace)."""
    from ._engine.executor import barrier
    barrier.execution.allowed = bool(allow)


def _xla_tensors_report(nodes_threshold: int, device: str) -> str:
    """The live tensors whose graph has more than `nodes_threshold` nodes (pending values
    and device data): per tensor its id, shape, device and node count, with XLA_IR_DEBUG /
    XLA_HLO_DEBUG the frames that created it (`Frames:`), and its IR text (each node made
    inside a profiler `Trace` with `scope=<name>.<n>`)."""
    from ._engine.executor import ir_debug
    live = _tensor.pending.take_live()
    _tensor.pending.restore(live)
    seen = {id(s) for s in live}
    live += [s for s in list(_tensor.data_states) if id(s) not in seen and type(s.node) is ir.DeviceData]
    out = []
    for s in live:
        roots = [(s.node, s.idx)]
        order = executor.Graph(roots).order
        if len(order) <= nodes_threshold:
            continue
        out.append(f"Tensor: id={id(s)}, shape={_dt(s.dtype)}[{','.join(map(str, s.shape))}], device={device}, "
                   f"ir_nodes={len(order)}\n")
        frames = ir_debug.frames_text(order)
        if frames:
            out.append(frames)
        out.append(_dumps.ir_text(order, roots) + "\n\n")
    return "".join(out)


class LoweringContext:
    """`torch_xla._XLAC.lowering.LoweringContext(name)`: the program computing some
    tensors as XLA's `HloModuleProto` (serialized, protobuf text, protobuf JSON), with
    the tensors bound to its parameters. Nothing runs on the device."""

    def __init__(self, name: str = ""):
        self._name = name
        self._proto: Optional[bytes] = None
        self._params: list = []
        self._fields = None

    def build(self, tensors: List[torch.Tensor]) -> None:
        proto, self._params = executor.hlo_module(_roots(tensors))
        self._proto = _hlo_proto.renamed(proto, self._name) if self._name else proto
        self._fields = None

    def _decoded(self):
        if self._proto is None:
            raise RuntimeError("LoweringContext: call build(tensors) first")
        if self._fields is None:
            self._fields = _hlo_proto.decode(self._proto)
        return self._fields

    def hlo(self) -> bytes:
        """The serialized `xla.HloModuleProto`."""
        self._decoded()
        return self._proto

    def hlo_text(self) -> str:
        """The module in protobuf text format."""
        return _hlo_proto.to_text(self._decoded())

    def hlo_json(self) -> str:
        """The module in protobuf's JSON mapping."""
        return _hlo_proto.to_json(self._decoded())

    def device_parameter_id_tensor_mapping(self) -> Dict[int, torch.Tensor]:
        """{parameter number: xla tensor holding the value bound to it} (no transfer)."""
        self._decoded()
        out = {}
        for i, p in enumerate(self._params):
            shape, dtype = p.avals[0]
            out[i] = _tensor.wrap_user(_tensor.make_tensor(p, 0, shape, dtype))
        return out

    def parameter_id_tensor_mapping(self) -> Dict[int, torch.Tensor]:
        """{parameter number: CPU copy of the value bound to it}."""
        return {i: t.cpu() for i, t in self.device_parameter_id_tensor_mapping().items()}

    def tensor_parameter_id(self, tensor: torch.Tensor) -> int:
        """The number of the parameter bound to `tensor`'s device data, -1 if none is."""
        self._decoded()
        node = state_of(tensor).node
        if type(node) is not ir.DeviceData:
            return -1
        for i, p in enumerate(self._params):
            # A barrier since `build` may have re-wrapped the same buffer in a new leaf.
            if p is node or (type(p) is ir.DeviceData and p.array is node.array):
                return i
        return -1


lowering = SimpleNamespace(LoweringContext=LoweringContext)


# ---- the helpers of the original's dynamo bridge ---------------------------------------------

_SEED_INFO_ID = -127389   # the id `_get_tensors_xla_device_data_node` gives the original's seed


def _get_seed_info_id() -> int:
    """The tensor id the original's `_get_tensors_xla_device_data_node` reports for the
    random seed's device data."""
    return _SEED_INFO_ID


def _get_base_seed_as_tensor(device: str) -> torch.Tensor:
    """The random number generator's current seed (`xm.set_rng_state`'s value at the start
    of a step) as an int64 tensor on `device`."""
    from ._engine import rng
    return torch.tensor(rng.snapshot()[0], dtype=torch.int64, device=device)


def _check_tensor_need_materialization(tensors: List[torch.Tensor]) -> List[bool]:
    """Per tensor, whether its value needs a computation (pending IR); False for device
    data and for tensors off the xla device."""
    return [isinstance(t, torch.Tensor) and t.device.type == "xla" and not state_of(t).is_data
            for t in tensors]


def _clear_pending_irs(device: str) -> None:  # noqa: ARG001 (one device per process)
    """Drops the pending IR of every live tensor (use with care: those tensors hold no
    value afterwards, reading them raises)."""
    from .core import dynamo_bridge
    dynamo_bridge.clear_pending_irs()


def _xla_warm_up_cache(tensors: List[torch.Tensor], devices: List[str]) -> None:  # noqa: ARG001
    """Compiles the graph computing `tensors` without running it, for `_run_cached_graph`
    under the graph's `_get_graph_hash`; the tensors stay pending."""
    from .core import dynamo_bridge
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"]
    dynamo_bridge.warm_up_cache(_get_graph_hash(tensors), _roots(tensors))


def _run_cached_graph(hash: bytes, graph_inputs: List[torch.Tensor]) -> List[torch.Tensor]:  # noqa: A002
    """Runs the graph `_xla_warm_up_cache` compiled under `hash` on `graph_inputs` (in
    `_get_tensors_xla_device_data_node` order; CPU tensors are sent to the device);
    returns its outputs, the warmed-up tensors that were not device data, each value once."""
    from .core import dynamo_bridge
    return dynamo_bridge.run_cached_graph(bytes(hash), graph_inputs)
