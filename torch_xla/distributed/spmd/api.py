"""PyTorch's DTensor API on the xla device: `distribute_tensor` / `distribute_module` with
an `xla` DeviceMesh land here (PyTorch imports these names for that device type)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from .mesh import spec_from_placements, xla_mesh
from .xla_sharded_tensor import XLAShardedTensor
from .xla_sharding import mark_sharding

convert_to_xla_mesh = xla_mesh


def xla_distribute_tensor(tensor: torch.Tensor, device_mesh, placements: Optional[Sequence] = None) -> XLAShardedTensor:
    """`torch.distributed.tensor.distribute_tensor` for an `xla` DeviceMesh."""
    from torch.distributed.tensor.placement_types import Replicate
    mesh = xla_mesh(device_mesh)
    placements = list(placements) if placements is not None else [Replicate()] * len(mesh.mesh_shape)
    spec = spec_from_placements(placements, tensor.dim(), len(mesh.mesh_shape))
    t = tensor
    if t.device.type != "xla":
        t = t.to("xla")
    if isinstance(t, XLAShardedTensor):
        t = t.global_tensor
    if t.requires_grad and not t.is_leaf:
        t = t.detach().requires_grad_(True)
    return mark_sharding(t, mesh, spec)


def xla_distribute_module(module: nn.Module, device_mesh=None, partition_fn: Optional[Callable] = None,
                          input_fn: Optional[Callable] = None, output_fn: Optional[Callable] = None) -> nn.Module:
    """`torch.distributed.tensor.distribute_module` for an `xla` DeviceMesh.

    `partition_fn(name, submodule, mesh)` shards parameters (e.g. with `distribute_tensor`);
    without it the module is moved to the device and left to XLA's sharding propagation."""
    if partition_fn is None:
        partition_fn = auto_policy
    for name, sub in module.named_modules():
        partition_fn(name, sub, device_mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, _inputs, outputs: output_fn(mod, outputs, device_mesh))
    return module


def auto_policy(mod_name: str, mod: nn.Module, device_mesh) -> None:  # noqa: ARG001 (a partition_fn's signature)
    """Leaves the layout of `mod`'s parameters to XLA (they are moved to the device)."""
    for p in mod.parameters(recurse=False):
        if p.device.type != "xla":
            p.data = p.data.to("xla")
