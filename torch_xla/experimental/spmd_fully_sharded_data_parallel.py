"""FSDP through SPMD (FSDPv2): every parameter sharded over the mesh's `fsdp` axis.

The module's parameters are annotated once; XLA's partitioner then inserts the
all-gathers before each use and the reduce-scatters of the gradients into the step's
single program, and the optimizer state takes the parameters' layout. No collective is
written by hand and nothing runs on the host.

    mesh = xs.Mesh(np.arange(n), (n, 1), ('fsdp', 'model'))
    model = FSDPv2(model, mesh)            # or FSDPv2(model, mesh=mesh)
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

import torch_xla.distributed.spmd as spmd


def _fsdp_spec(t: torch.Tensor, extra_data_axis: Optional[str] = None, largest: bool = False) -> tuple:
    """Shard one dimension over 'fsdp' (the largest with `largest`, else the first)."""
    spec = [None] * t.dim()
    if not spec:
        return ()
    dim = max(range(t.dim()), key=lambda d: (t.shape[d], -d)) if largest else 0
    spec[dim] = (extra_data_axis, "fsdp") if extra_data_axis else "fsdp"
    return tuple(spec)


def _shard_first_output(output: Any, mesh: spmd.Mesh, extra_data_axis: Optional[str] = None) -> None:
    """The default `shard_output`: the batch dimension of the (first) output over 'fsdp'."""
    out = output
    if isinstance(output, tuple):
        out = output[0] if output and isinstance(output[0], torch.Tensor) else None
        warnings.warn("FSDPv2: the output is a tuple; only its first element is sharded (pass shard_output "
                      "to choose)")
    if not isinstance(out, torch.Tensor):
        raise RuntimeError(f"FSDPv2 cannot shard an output of type {type(output).__name__}; pass "
                           f"shard_output=fn(output, mesh)")
    spmd.mark_sharding(out, mesh, _fsdp_spec(out, extra_data_axis))


class SpmdFullyShardedDataParallel(nn.Module):
    """Wraps `module` so that its parameters are sharded over the `fsdp` axis of `mesh`.

    mesh: positional or keyword; the global mesh (`xs.set_global_mesh`) when omitted.
    shard_output: (positional or keyword) fn(output, mesh) annotating the forward's output (default: dimension
      0 of the first output tensor over 'fsdp', with `extra_data_axis` in front).
    auto_wrap_policy / auto_wrapper_callable: wrap submodules first, as
      `torch_xla.distributed.fsdp.wrap` policies decide.
    extra_data_axis: a mesh axis that also splits the batch (data parallel x FSDP).
    """

    def __init__(self, module: nn.Module, mesh: Optional[spmd.Mesh] = None, shard_output: Optional[Callable] = None,
                 *, auto_wrap_policy: Optional[Callable] = None,
                 auto_wrapper_callable: Optional[Callable] = None, extra_data_axis: Optional[str] = None):
        if isinstance(module, SpmdFullyShardedDataParallel):
            raise RuntimeError("the module is already wrapped with FSDPv2; for nesting, wrap the children "
                               "first, then the parent")
        fwd = getattr(type(module), "forward", None)
        if fwd is None or fwd is nn.Module.forward:
            raise RuntimeError(f"FSDPv2 wraps modules that define forward(); {type(module).__name__} does not "
                               f"(wrap the modules inside an nn.ModuleList / ModuleDict instead)")
        if mesh is None:
            mesh = spmd.get_global_mesh()
            if mesh is None:
                raise ValueError("FSDPv2 needs a mesh: pass one, or set it with xs.set_global_mesh(mesh)")
        if not isinstance(mesh, spmd.Mesh):
            raise TypeError(f"mesh must be a torch_xla.distributed.spmd.Mesh, got {type(mesh).__name__}")
        if mesh.axis_names is None or "fsdp" not in mesh.axis_names:
            raise ValueError(f"FSDPv2 needs a mesh axis named 'fsdp'; the mesh's axes are {mesh.axis_names}")
        if extra_data_axis and extra_data_axis not in mesh.axis_names:
            raise ValueError(f"The provided {extra_data_axis} axis is not in the mesh (extra_data_axis; the "
                             f"mesh's axes are {mesh.axis_names})")
        super().__init__()
        if auto_wrap_policy is not None:
            from torch_xla.distributed.fsdp.wrap import recursive_wrap
            for name, sub in module.named_modules():
                if isinstance(sub, SpmdFullyShardedDataParallel):
                    raise ValueError(f"{name} is already FSDPv2-wrapped; auto_wrap_policy wraps the "
                                     f"submodules itself")
            recursive_wrap(module, auto_wrap_policy, auto_wrapper_callable or SpmdFullyShardedDataParallel,
                           ignored_modules=set(), ignored_params=set(), only_wrap_children=True,
                           mesh=mesh, shard_output=shard_output, extra_data_axis=extra_data_axis)
        self._orig_module = module.to("xla")
        self._mesh = mesh
        self._extra_data_axis = extra_data_axis
        for p in module.parameters():
            if spmd.xla_sharding._sh.annotation(p) is None:
                spmd.mark_sharding(p, mesh, _fsdp_spec(p, largest=True))
        spmd.apply_backward_optimization_barrier(module)
        self._shard_output = shard_output

    @property
    def module(self) -> nn.Module:
        """The wrapped module (as DDP's `.module`)."""
        return self._orig_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self._orig_module(*args, **kwargs)
        if self._shard_output is not None:
            self._shard_output(output, self._mesh)
        else:
            _shard_first_output(output, self._mesh, self._extra_data_axis)
        return output

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_module, name)

    def __getitem__(self, key):
        return self._orig_module[key]


FSDPv2 = SpmdFullyShardedDataParallel
