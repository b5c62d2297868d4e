"""Debugging entry points users call as `torch_xla._XLAC._...`."""
from __future__ import annotations

import io
from typing import List, Optional

import torch

from ._engine import executor, ir, metrics, tensor as _tensor
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
    """The IR graph computing `tensors`, one node per line."""
    roots = _roots(tensors)
    order = executor.Graph(roots).order
    names = {}
    lines = ["IR {"]
    for n in order:
        names[id(n)] = f"%{len(names)}"
        shapes = ", ".join(f"{_dt(d)}[{','.join(map(str, s))}]" for s, d in
                           (a for a in n.avals if a is not None))
        if type(n) is ir.DeviceData:
            desc = "xla::device_data()"
        elif type(n) is ir.ScalarParam:
            desc = f"xla::device_data(), scalar={n.value}"
        elif type(n) is ir.Constant:
            desc = f"prim::Constant(), value={n.value}"
        else:
            ops = ", ".join(f"{names[id(o)]}" + (f".{i}" if len(o.avals) > 1 else "") for o, i in n.operands)
            statics = [a for a in n.args if not isinstance(a, ir.Ref) and not (isinstance(a, tuple) and a and isinstance(a[0], ir.Ref))]
            desc = f"{n.op}({ops})" + (f", args={statics}" if statics else "")
        lines.append(f"  {names[id(n)]} = {shapes} {desc}")
    lines.append("  ROOT = (" + ", ".join(f"{names[id(n)]}" for n, _ in roots) + ")")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dt(d):
    return {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16",
            torch.int64: "s64", torch.int32: "s32", torch.int16: "s16", torch.int8: "s8",
            torch.uint8: "u8", torch.bool: "pred"}.get(d, str(d).replace("torch.", ""))


def _get_xla_tensors_hlo(tensors: Optional[List[torch.Tensor]]) -> str:
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


def _get_xla_tensor_debug_info(tensor: torch.Tensor) -> str:
    """A description of the tensor's lazy state: its IR value, or its device data."""
    s = state_of(tensor)
    lines = [f"XLA Shape: {_dt(s.dtype)}[{','.join(map(str, s.shape))}]"]
    if type(s.node) is ir.DeviceData:
        deleted = s.node.array.is_deleted()
        lines += ["IR: None", "XLAData: ", f"  Data Handle: {'Deleted' if deleted else id(s.node.array)}"]
    else:
        lines += [f"IR: {s.node.op}", "XLAData: None"]
    return "\n".join(lines) + "\n"
