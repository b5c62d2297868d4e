"""PyTorch's DTensor API on the xla device: `distribute_tensor` / `distribute_module` with
an `xla` DeviceMesh land here (PyTorch imports these names for that device type)."""
from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from .mesh import split_placements, xla_mesh
from .xla_sharded_tensor import XLAShardedTensor, _PartialValue
from .xla_sharding import mark_sharding

convert_to_xla_mesh = xla_mesh


def xla_distribute_tensor(tensor: torch.Tensor, device_mesh, placements: Optional[Sequence] = None) -> XLAShardedTensor:
    """`torch.distributed.tensor.distribute_tensor` for an `xla` DeviceMesh.

    `Partial(op)` placements give each device of that mesh dimension PyTorch's partial
    value of the tensor (`t / n` for a sum, `t` for avg / min / max), pending the reduction
    that `redistribute` performs."""
    from torch.distributed.tensor.placement_types import Replicate
    mesh = xla_mesh(device_mesh)
    placements = list(placements) if placements is not None else [Replicate()] * len(mesh.mesh_shape)
    spec, partial = split_placements(placements, tensor.dim(), len(mesh.mesh_shape))
    t = tensor
    if t.device.type != "xla":
        t = t.to("xla")
    if isinstance(t, XLAShardedTensor):
        t = t.global_tensor
    if t.requires_grad and not t.is_leaf:
        t = t.detach().requires_grad_(True)
    if partial:
        return XLAShardedTensor._of_partial(_PartialValue.partition(t, mesh, partial, spec), spec)
    return mark_sharding(t, mesh, spec)


def xla_distribute_module(module: nn.Module, device_mesh=None, partition_fn: Optional[Callable] = None,
                          input_fn: Optional[Callable] = None, output_fn: Optional[Callable] = None) -> nn.Module:
    """`torch.distributed.tensor.distribute_module` for an `xla` DeviceMesh.

    `partition_fn(name, submodule, mesh)` shards parameters (e.g. with `distribute_tensor`);
    without one the parameters stay where they are, replicated once on the device.
    `partition_fn=auto_policy` turns on automatic sharding (`xr.use_spmd(auto=True)`) and
    moves the module, which must be on the CPU, to the device: its parameters are laid out
    by the automatic rule when a program first reads them."""
    if getattr(partition_fn, "__name__", "") == "auto_policy":
        p = next(module.parameters(), None)
        if p is not None and p.device.type == "xla":
            raise RuntimeError("distribute_module with auto_policy needs the module on the CPU: it moves "
                               "the module to the xla device itself")
        from ... import runtime
        runtime.use_spmd(auto=True)
        module = module.to("xla")
    elif partition_fn is not None:
        for name, sub in module.named_modules():
            partition_fn(name, sub, device_mesh)
    if input_fn is not None:
        _check_hook_arity(input_fn, "input_fn")
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        _check_hook_arity(output_fn, "output_fn")
        module.register_forward_hook(lambda mod, _inputs, outputs: output_fn(mod, outputs, device_mesh))
    return module


def _check_hook_arity(fn: Callable, what: str) -> None:
    try:
        n = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature: taken as they are
        return
    if n != 3:
        raise ValueError(f"{what} should take in 3 arguments, but got {n} arguments!")


def auto_policy(mod_name: str, mod: nn.Module, device_mesh) -> None:  # noqa: ARG001 (a partition_fn's signature)
    """Passed to `xla_distribute_module` as `partition_fn`: automatic sharding (nothing is
    done per submodule)."""
