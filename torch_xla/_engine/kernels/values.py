"""Values on the device: transfers from and to the CPU, constants, resizing inner tensors."""
from __future__ import annotations

from typing import Optional, Union

import torch

from .. import executor, ir, telemetry, pjrt
from ..lowering import LOWERINGS
from ..tensor import make_tensor, replace_state, state_of


# View ops whose result a host read computes from the base's host copy instead of compiling
# a program: reading the rows of a device tensor one by one (`for row in x: row.cpu()`)
# would otherwise compile one program per row index.
_HOST_VIEWS = frozenset({"aten::select_copy.int", "aten::slice_copy.Tensor", "aten::t_copy", "aten::view_copy",
                         "aten::transpose_copy.int", "aten::permute_copy", "aten::squeeze_copy.dim",
                         "aten::unsqueeze_copy", "aten::alias_copy", "aten::expand_copy",
                         "aten::unbind_copy.int", "aten::split_copy.Tensor", "aten::split_with_sizes_copy"})
_HOST_VIEW_MAX_BYTES = 64 << 20


def _view_chain(s) -> Optional[tuple]:
    """(base DeviceData, [(view node, output index)] from the base up) when `s` is a few view
    ops of device data."""
    chain, n, idx = [], s.node, s.idx
    while type(n) is not ir.DeviceData:
        if n.op not in _HOST_VIEWS or len(n.operands) != 1 or len(chain) == 4 or n.lowering is None:
            return None
        chain.append((n, idx))
        n, idx = n.operands[0]
    if not chain or n.array.nbytes > _HOST_VIEW_MAX_BYTES or len(n.array.sharding.device_set) != 1:
        return None
    return n, chain[::-1]


def _host_view(s) -> Optional[torch.Tensor]:
    found = _view_chain(s)
    if found is None:
        return None
    base, chain = found
    with telemetry.timed("TransferFromDeviceTime"):
        host = pjrt.fetch(base.array)
    telemetry.add_sample("InboundData", host.nbytes)
    v = pjrt.from_numpy(host, base.avals[0][1])
    for n, idx in chain:
        name, _, overload = n.op[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, name), overload or "default")
        args, kwargs = [], {}
        for a, spec in zip(n.args, op._schema.arguments):
            a = v if type(a) is ir.Ref else a
            if spec.kwarg_only:
                kwargs[spec.name] = a
            else:
                args.append(a)
        v = op(*args, **kwargs)
        if isinstance(v, (tuple, list)):
            v = v[idx]
    return v.contiguous()


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """Materialises an XLA tensor on the CPU (a host read)."""
    s = state_of(t)
    if type(s.node) is not ir.DeviceData:
        v = _host_view(s)
        if v is not None:
            executor.inspect_checks()
            return v
    arr = executor.materialize(s)
    with telemetry.timed("TransferFromDeviceTime"):
        host = pjrt.fetch(arr)
    executor.inspect_checks()  # the read waited anyway: index errors of the programs so far
    telemetry.add_sample("InboundData", host.nbytes)  # into the host, from the device
    return pjrt.from_numpy(host, s.dtype)


def from_cpu(t: torch.Tensor, dtype: Optional[torch.dtype] = None, placement=None) -> torch.Tensor:
    """A new inner XLA tensor holding a copy of CPU tensor `t` (placed on `placement`, a
    jax device or sharding, or where new data goes by default)."""
    with telemetry.timed("TensorToData"):
        return _from_cpu(t, dtype, placement)


def _from_cpu(t, dtype, placement):
    if dtype is not None and dtype != t.dtype:
        t = t.to(dtype)
    if t.layout != torch.strided:
        raise RuntimeError(f"{t.layout} tensors are not supported on the xla device: XLA holds dense arrays only")
    if not pjrt.is_supported_dtype(t.dtype):
        raise TypeError(f"dtype {t.dtype} is not supported on the xla device")
    host = pjrt.to_numpy(t)
    dd = pjrt.device_dtype(t.dtype)
    if host.dtype != dd:
        host = host.astype(dd)
    arr = pjrt.put(host, placement)  # times the transfer (none yet for SPMD host data)
    telemetry.add_sample("OutboundData", host.nbytes)  # out of the host, to the device
    telemetry.inc("CreateDataHandles")
    aval = (tuple(t.shape), t.dtype)
    return make_tensor(ir.DeviceData(arr, aval), 0, aval[0], aval[1])


def set_data(t: torch.Tensor, cpu: torch.Tensor) -> None:
    """Replaces the value of inner XLA tensor `t` with CPU data (fallback write-back)."""
    if tuple(t.shape) != tuple(cpu.shape):
        resize_(t, cpu.shape)
    replace_state(t, from_cpu(cpu.to(t.dtype))._xla)


def const_tensor(shape, dtype, value):
    """A tensor of `shape` filled with a constant (no device memory until used)."""
    shape = tuple(int(s) for s in shape)
    node = ir.Constant(value, ((), dtype))
    full = ir.Node("xla::broadcast", ((node, 0),), (ir.ref(0), shape), ((shape, dtype),),
                   LOWERINGS["xla::broadcast"], None)
    return make_tensor(full, 0, shape, dtype)


def resize_(self, size, memory_format=None):
    """Resizing an inner tensor: new sizes, contents undefined (zeros), as for `out=` tensors."""
    size = tuple(int(v) for v in size)
    if tuple(self.shape) == size:
        return self
    new = const_tensor(size, self.dtype, 0)
    self.data = new  # takes the new sizes; the Python object (and its attributes) stays
    self._xla = new._xla
    return self


def check_device(device: Optional[Union[str, torch.device]], unindexed_as_0: bool = False) -> None:
    """Refuses an xla device other than this process's one device (`xla:<index>`,
    runtime.device_index): naming another process's device, or another device of this
    process, is an error at the op that names it.

    `unindexed_as_0`: the device may be `xla` without an index that PyTorch completed
    with the device guard's current index before the kernel, always 0 for a Python
    guard (`Tensor.to`, `torch.tensor(..., device=...)`), so `xla:0` there means this
    process's device."""
    if device is None:
        return
    if isinstance(device, str):
        device = torch.device(device)
    if (isinstance(device, torch.device) and device.type == "xla" and device.index is not None
            and device.index != pjrt.device_index() and not (unindexed_as_0 and device.index == 0)):
        raise RuntimeError(pjrt.device_error(device))
