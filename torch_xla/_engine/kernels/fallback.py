"""The CPU fallback: an op with no lowering runs in eager PyTorch on the CPU.

Its XLA arguments are read to the host (a sync), the op runs there, and the results
come back as new device data; mutated arguments take the CPU result. Each call counts
as `aten::<op>` in the metrics.
"""
from __future__ import annotations

import torch

from .. import telemetry
from ..tensor import unwrap
from . import cpu_operand, messages
from .values import from_cpu, set_data, to_cpu


_CPU_OPERANDS_OK = frozenset({"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index",
                              "_unsafe_index_put", "copy_", "_copy_from", "_copy_from_and_resize"})


def check_devices(name, args, kwargs, allow_cpu: bool = False):
    """PyTorch's same-device rule: XLA tensors mixed with non-scalar tensors of another
    device (but the CPU when `allow_cpu`) is an error."""
    devs = set()
    xla = []

    def visit(a):
        if isinstance(a, torch.Tensor):
            if a.device.type == "xla":
                if not xla:
                    xla.append(str(a.device))  # every xla tensor of a process is on its one device
            elif a.dim() > 0 and not (allow_cpu and a.device.type == "cpu"):
                devs.add(str(a.device))
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)

    for a in args:
        visit(a)
    for a in kwargs.values():
        visit(a)
    if xla and devs:
        other = sorted(devs)[0]
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                           f"devices, {xla[0]} and {other}! (when checking argument for aten::{name})")


def cpu_fallback(op, args, kwargs):
    """Runs `op` in eager PyTorch on the CPU and moves the results back to the device."""
    namespace, _, name = op._schema.name.rpartition("::")
    if name not in _CPU_OPERANDS_OK:
        # With XLA_CPU_OPERAND=move a CPU operand is welcome: the op runs on the CPU anyway.
        check_devices(name, args, kwargs, allow_cpu=cpu_operand.moves())
    telemetry.inc(f"{namespace or 'aten'}::{name}")
    xla_args = []

    def conv(a):
        if isinstance(a, torch.Tensor) and a.device.type == "xla":
            c = to_cpu(a)
            xla_args.append((a, c))
            return c
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        if isinstance(a, torch.device) and a.type == "xla":
            return torch.device("cpu")
        return a

    cargs = [conv(a) for a in args]
    ckwargs = {k: conv(v) for k, v in kwargs.items()}
    try:
        out = op(*cargs, **ckwargs)
    except IndexError as e:  # also a RuntimeError, as for ops with a meta kernel (shapes.py)
        worded = messages.index_error(e)
        if worded is e:
            raise
        raise worded from None
    # Mutated arguments: write the CPU result back into the XLA tensor.
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor) and v.device.type == "xla":
                c = cargs[i] if i < len(cargs) else ckwargs.get(a.name)
                set_data(unwrap(v), c)
    mutated = {id(c) for i, a in enumerate(op._schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write
               for c in [cargs[i] if i < len(cargs) else ckwargs.get(a.name)]}
    cpu_to_xla = {id(c): a for a, c in xla_args}

    def back(o):
        if isinstance(o, torch.Tensor):
            if id(o) in mutated and id(o) in cpu_to_xla:
                return cpu_to_xla[id(o)]
            return from_cpu(o)
        if isinstance(o, (list, tuple)):
            return type(o)(back(x) for x in o)
        return o

    return back(out)


def fallback_kernel(op, *args, **kwargs):
    return cpu_fallback(op, args, kwargs)
