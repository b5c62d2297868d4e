"""Sharding annotations for SPMD: meshes, partition specs, `mark_sharding`.

A `Mesh` lays device ids out in a logical n-d array with named axes; a partition spec
says, per tensor dimension, which mesh axes (by index or name, or a tuple of them)
split it, `None` for none. `mark_sharding` records the annotation on the tensor; XLA's
partitioner compiles the program with it (see `torch_xla/_engine/partitioning.py`).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from torch_xla._engine import capture as _capture
from torch_xla._engine import mode as _mode
from torch_xla._engine import partitioning as _sh
from torch_xla._engine import patches as _patches
from torch_xla._engine import tensor as _tensor
from torch_xla._engine.kernels import library as _library

from .mesh import (HybridMesh, Mesh, OpSharding, PartitionSpec, ShardingError, ShardingType,  # noqa: F401
                   get_1d_mesh, get_global_mesh, set_global_mesh, sharding_type_of)
from .xla_sharded_tensor import XLAShardedTensor
from .. import _mark_sharding_in_graph as _in_graph
from .._patched_linear import XLAPatchedLinear, apply_xla_patch_to_nn_linear, xla_patched_nn_linear_forward  # noqa: F401

def _require_spmd(what: str) -> None:
    if not _mode.modes.spmd:
        raise RuntimeError(f"{what} needs SPMD mode: call torch_xla.runtime.use_spmd() first")


def _check_spec(t: torch.Tensor, partition_spec) -> tuple:
    spec = tuple(partition_spec)
    if len(spec) != t.dim():
        raise ShardingError(f"Partition spec length ({len(spec)}) should be equal to the input rank "
                            f"({t.dim()}).")
    return spec


def _raw(t):
    return t.global_tensor if isinstance(t, XLAShardedTensor) else t


def mark_sharding(t: Union[torch.Tensor, XLAShardedTensor], mesh: Mesh,
                  partition_spec: PartitionSpec) -> XLAShardedTensor:
    """Annotates `t` with a layout over `mesh` and returns it as an `XLAShardedTensor`.

    Device data is resharded at once; a pending value gets a sharding constraint in the
    graph. An annotation over a replicated one is allowed; changing a tiled annotation
    needs `clear_sharding` first (or `annotate_custom_sharding`).
    """
    _require_spmd("mark_sharding")
    raw = _raw(t)
    spec = _mark(raw, mesh, partition_spec)
    return XLAShardedTensor(raw, mesh_shape=mesh.mesh_shape, partition_spec=spec)


def _mark(raw: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec, in_graph: bool = False) -> tuple:
    if raw.device.type != "xla":
        raise RuntimeError(f"mark_sharding: the tensor is on {raw.device}; move it to the xla device first")
    spec = _check_spec(raw, partition_spec)
    new = mesh.sharding(spec)
    old = _sh.annotation(raw)
    if old is not None and not old.is_equivalent_to(new, raw.dim()) and not _sh.is_replicated(old):
        raise RuntimeError(
            f"mark_sharding: the tensor is already sharded as {_sh.spec_text(old, raw.dim())}; "
            f"clear_sharding() it first, or use annotate_custom_sharding() to reshard it in the graph")
    _sh.annotate(raw, new, in_graph=in_graph)
    return spec


def annotate_custom_sharding(t: Union[torch.Tensor, XLAShardedTensor], mesh: Mesh,
                             partition_spec: PartitionSpec) -> XLAShardedTensor:
    """Lays `t` out anew inside the graph (a sharding constraint on its current value),
    whatever its present sharding."""
    _require_spmd("annotate_custom_sharding")
    raw = _raw(t)
    spec = _check_spec(raw, partition_spec)
    new = mesh.sharding(spec)
    _sh.annotate(raw, new, in_graph=True)
    return XLAShardedTensor(raw, mesh_shape=mesh.mesh_shape, partition_spec=spec)


def clear_sharding(t: Union[torch.Tensor, XLAShardedTensor]) -> torch.Tensor:
    """Removes the annotation of `t` (its data returns to the replicated layout)."""
    raw = _raw(t)
    _sh.clear(raw)
    return raw


# ---- torch.ops.xla.dynamo_mark_sharding ------------------------------------------------------
#
# A sharding annotation that Dynamo records as an op of its graph (the mesh and the spec as
# plain values: device ids, mesh shape, and the axis names and partition spec as Python
# literals in text). Run eagerly it is `mark_sharding` on its input; in a compiled graph
# the bridge's trace runs it on the graph's lazy values, so its input, an activation or a
# graph input, is constrained to the layout inside the program. The input is annotated in
# place (its later uses in the graph see the layout, whether or not the result is used);
# the result holds the same value.

DYNAMO_MARK_SHARDING = ("dynamo_mark_sharding(Tensor input, int[] device_ids, int[] mesh_shape, str axis_names, "
                        "str partition_spec) -> Tensor")


def _literal(text: str, what: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"dynamo_mark_sharding: {what} must be a Python literal, got {text!r}") from e


def _dynamo_layout(device_ids, mesh_shape, axis_names: str, partition_spec: str):
    names = _literal(axis_names, "axis_names")
    mesh = Mesh(list(device_ids), tuple(mesh_shape), None if names is None else tuple(names))
    spec = _literal(partition_spec, "partition_spec")
    return mesh, tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)


def _dynamo_mark_sharding_xla(input, device_ids, mesh_shape, axis_names, partition_spec):
    _require_spmd("dynamo_mark_sharding")
    mesh, spec = _dynamo_layout(device_ids, mesh_shape, axis_names, partition_spec)
    # While a graph is captured, a constraint inside the program, even on a graph input
    # (whose data the caller keeps as it is laid out).
    _mark(input, mesh, spec, in_graph=_capture.tracing())
    s = input._xla
    return _tensor.make_tensor(s.node, s.idx, s.shape, s.dtype)


def _dynamo_mark_sharding_meta(input, device_ids, mesh_shape, axis_names, partition_spec):  # noqa: ARG001
    return torch.empty_like(input)


def _dynamo_mark_sharding_other(input, device_ids, mesh_shape, axis_names, partition_spec):  # noqa: ARG001
    # Not an xla tensor: nothing to lay out.
    return input.clone()


def _dynamo_mark_sharding_setup(ctx, inputs, output):
    pass


def _dynamo_mark_sharding_backward(ctx, grad):  # noqa: ARG001
    # The layout of the gradient is left to XLA's propagation.
    return grad, None, None, None, None


def _register_dynamo_mark_sharding() -> None:
    if hasattr(torch.ops.xla, "dynamo_mark_sharding"):
        return
    _library.define("xla", DYNAMO_MARK_SHARDING)
    _library.impl_ns("xla", "dynamo_mark_sharding", _dynamo_mark_sharding_xla, "PrivateUse1")
    _library.impl_ns("xla", "dynamo_mark_sharding", _dynamo_mark_sharding_meta, "Meta")
    _library.impl_ns("xla", "dynamo_mark_sharding", _dynamo_mark_sharding_other, "CompositeExplicitAutograd")
    _library.derivative("xla", "dynamo_mark_sharding", _dynamo_mark_sharding_backward, _dynamo_mark_sharding_setup)


_register_dynamo_mark_sharding()


# Inside torch.compile, `mark_sharding` is an op of the graph (patch `mark_sharding_in_graph`;
# it also keeps the op when its result is unused, which the input's annotation needs).
_in_graph.set_target(mark_sharding)
_patches.install("mark_sharding_in_graph")


class MarkShardingFunction(torch.autograd.Function):
    """`mark_sharding` in forward, the same annotation on the gradient in backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec) -> torch.Tensor:
        ctx.mesh, ctx.spec = mesh, tuple(partition_spec)
        if _traced(t):
            return _graph_op(t, mesh, ctx.spec)
        out = t.clone() if t.requires_grad or _tensor.is_functional(t) else t
        mark_sharding(out, mesh, partition_spec)
        return out

    @staticmethod
    def backward(ctx, grad):
        if _traced(grad):
            return _graph_op(grad, ctx.mesh, ctx.spec), None, None
        grad = grad.clone()
        mark_sharding(grad, ctx.mesh, ctx.spec)
        return grad, None, None


def _traced(t: torch.Tensor) -> bool:
    """Whether `t` is a tracer's stand-in (aot_autograd / export), not an xla tensor."""
    return type(t).__name__ in ("FunctionalTensor", "FakeTensor")


def _graph_op(t: torch.Tensor, mesh: Mesh, spec: tuple) -> torch.Tensor:
    """The annotation as an op of the traced graph (`torch.ops.xla.mark_sharding`)."""
    _check_spec(t, spec)
    key = _sh.layout_key(mesh.device_ids, mesh.mesh_shape, mesh._jax_names(), mesh.jax_spec(spec))
    return torch.ops.xla.mark_sharding(t, key)


def mark_sharding_with_gradients(t: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec) -> torch.Tensor:
    """`mark_sharding` that also annotates the gradient flowing back through `t`.

    Returns a new tensor (use it in place of `t`): the annotation on the backward pass
    is a node of the autograd graph."""
    _require_spmd("mark_sharding_with_gradients")
    _check_spec(_raw(t), partition_spec)
    return MarkShardingFunction.apply(_raw(t), mesh, partition_spec)


def shard_as(a, b):
    """Gives `b` the sharding of `a` (tensors, or pytrees of tensors matched leaf by leaf)."""
    import torch.utils._pytree as pytree
    la, spec_a = pytree.tree_flatten(a)
    lb, spec_b = pytree.tree_flatten(b)
    if len(la) != len(lb):
        raise ValueError(f"shard_as: {len(la)} tensors against {len(lb)}")
    for x, y in zip(la, lb):
        sh = _sh.annotation(_raw(x)) or _sh.data_sharding(_raw(x))
        if sh is not None and tuple(x.shape) == tuple(y.shape):
            _sh.annotate(_raw(y), sh, in_graph=True)
    return a, b


def wrap_as_sharded_tensor(t: Union[torch.Tensor, XLAShardedTensor], mesh_shape=None,
                           partition_spec=None) -> XLAShardedTensor:
    if isinstance(t, XLAShardedTensor):
        if mesh_shape is not None:
            t.mesh_shape = mesh_shape
        if partition_spec is not None:
            t.partition_spec = partition_spec
        return t
    return XLAShardedTensor(t, mesh_shape=mesh_shape, partition_spec=partition_spec)


def unwrap_sharded_tensor(t: Union[torch.Tensor, XLAShardedTensor]) -> torch.Tensor:
    return _raw(t)


def wrap_if_sharded(x: Any) -> Any:
    """`x` as an XLAShardedTensor when it is an xla tensor with a sharding annotation."""
    if (isinstance(x, torch.Tensor) and not isinstance(x, XLAShardedTensor) and x.device.type == "xla"
            and _sh.annotation(x) is not None):
        return XLAShardedTensor(x)
    return x


@dataclass
class ShardingSpec:
    """A reusable annotation: a mesh and a partition spec (e.g. a data loader's `input_sharding`).

    `minibatch=True`: the loader's batch is this host's part of the global batch (many
    hosts); dimension 0 of the global tensor is then the batch of all hosts together.
    """
    mesh: Mesh
    partition_spec: PartitionSpec
    minibatch: Optional[bool] = False
    _sharding: Any = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.partition_spec = tuple(self.partition_spec)
        self._sharding = self.mesh.sharding(self.partition_spec)

    def xla_spec(self, t: torch.Tensor) -> Optional[OpSharding]:
        if not self.can_apply(t):
            return None
        return OpSharding(self._sharding, t.dim())

    def can_apply(self, t: torch.Tensor) -> bool:
        return len(t.shape) == len(self.partition_spec)

    def apply(self, t: torch.Tensor) -> XLAShardedTensor:
        _check_spec(t, self.partition_spec)
        return mark_sharding(t, self.mesh, self.partition_spec)

    @property
    def jax_sharding(self):
        return self._sharding


def send_sharded(t: torch.Tensor, spec: ShardingSpec) -> torch.Tensor:
    """CPU tensor `t` sent to the device already laid out as `spec` says (one transfer)."""
    _require_spmd("input_sharding")
    if t.device.type == "xla":
        spec.apply(t)
        return t
    if spec.minibatch:
        return _send_minibatch(t, spec.jax_sharding)
    return _send_laid_out(t, spec.jax_sharding)


def _send_laid_out(t: torch.Tensor, sh) -> torch.Tensor:
    """CPU tensor `t` on the device with layout `sh` (replicated in memory if uneven)."""
    from torch_xla._engine.kernels import values as _values
    placement = sh if _sh.divisible(sh, tuple(t.shape)) else None
    out = _tensor.wrap_user(_values.from_cpu(t, placement=placement))
    _sh.annotate(out, sh)
    return out


def _send_minibatch(t: torch.Tensor, sh) -> torch.Tensor:
    """This host's part of a global batch: dimension 0 of the global tensor is every host's
    batch, in process order."""
    from torch_xla._engine import ir as _ir
    from torch_xla._engine import pjrt as _rt
    local = len(_rt.local_devices())
    if t.dim() == 0 or t.shape[0] % local:
        raise RuntimeError("When minibatch is configured, the per-host batch size must be divisible by local "
                           f"runtime device count. Per host input data shape = {tuple(t.shape)}, local runtime "
                           f"device count = {local}")
    jax = _rt.jax_module()
    host = _rt.to_numpy(t).astype(_rt.device_dtype(t.dtype))
    arr = jax.make_array_from_process_local_data(sh, host)
    shape = tuple(arr.shape)
    inner = _tensor.make_tensor(_ir.DeviceData(arr, (shape, t.dtype)), 0, shape, t.dtype)
    out = _tensor.wrap_user(inner)
    _sh.annotate(out, sh)
    return out


def apply_backward_optimization_barrier(m: torch.nn.Module) -> torch.nn.Module:
    """Puts one optimization barrier on `m`'s backward results, the gradients of its
    parameters computed so far and those leaving it, so that XLA neither hoists the next
    layer's all-gathers over this layer's computation nor defers this layer's gradients
    (either would keep several layers' full buffers alive at once)."""
    from torch_xla._engine import comm as _coll

    def barrier(module, grad_input, _grad_output):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        grads += [g for g in grad_input if isinstance(g, torch.Tensor)]
        if grads:
            _coll.optimization_barrier_(grads)
        return grad_input

    m.register_full_backward_hook(barrier)
    return m


def global_tensor_from_cpu_shards(shards, op_sharding: OpSharding, global_shape=None) -> torch.Tensor:
    """An xla tensor assembled from one CPU piece per device (logical id order, padded as
    `local_shards` gives them), laid out as `op_sharding`. `global_shape` defaults to the
    pieces put together; a smaller one treats the rest as padding."""
    _require_spmd("_global_tensor_from_cpu_shards")
    sh = op_sharding.jax_sharding
    if _sh.is_replicated(sh):  # replication fits any rank
        sh = _sh.replicated_sharding()
    n = len(_sh.global_devices())
    if len(shards) != n:
        raise RuntimeError(f"expected {n} shards (one per device), got {len(shards)}")
    piece = tuple(shards[0].shape)
    if any(tuple(s.shape) != piece for s in shards):
        raise RuntimeError("every shard must have the same shape")
    parts = _sh.dim_parts(sh, len(piece))
    if global_shape is None:
        global_shape = tuple(p * k for p, k in zip(piece, parts))
    global_shape = tuple(int(d) for d in global_shape)
    if len(global_shape) != len(piece):
        raise RuntimeError(f"global shape {global_shape} and shard shape {piece} differ in rank")
    for g, p, k in zip(global_shape, piece, parts):
        if -(-g // k) != p:
            raise RuntimeError(f"global shape {global_shape} does not split into shards of shape {piece} "
                               f"over {parts} pieces")
    out = torch.empty(global_shape, dtype=shards[0].dtype)
    for (dev, index, rep, padded), s in zip(_sh.shard_layout(sh, global_shape), shards):
        out[index] = s[tuple(slice(0, i.stop - i.start) for i in index)]
    return _send_laid_out(out, sh)


def _mark_manual_sharding(t: Union[torch.Tensor, XLAShardedTensor]) -> XLAShardedTensor:
    """Declares a computed value per-device: each device's piece is what it computed."""
    _require_spmd("_mark_manual_sharding")
    return XLAShardedTensor(_sh.mark_manual(_raw(t)))


def enable_manual_sharding(t: Union[torch.Tensor, XLAShardedTensor], partition_spec: PartitionSpec, *,
                           mesh: Optional[Mesh] = None) -> XLAShardedTensor:
    """Enters a manual region: `t` is laid out by `partition_spec` and each device then
    computes on its own piece (per-device shapes) until `disable_manual_sharding`."""
    _require_spmd("enable_manual_sharding")
    mesh = mesh or get_global_mesh()
    if mesh is None:
        raise RuntimeError("enable_manual_sharding needs a mesh (the mesh= argument or xs.set_global_mesh)")
    raw = _raw(t)
    spec = _check_spec(raw, partition_spec)
    if _sh.annotation(raw) != mesh.sharding(spec):
        if _sh.annotation(raw) is not None:
            _sh.clear(raw)
        mark_sharding(raw, mesh, spec)
    return XLAShardedTensor(_sh.full_to_shard(raw))


def disable_manual_sharding(t: Union[torch.Tensor, XLAShardedTensor], partition_spec: PartitionSpec,
                            full_shape, *, mesh: Optional[Mesh] = None) -> XLAShardedTensor:
    """Leaves a manual region: the per-device pieces `t` form a global tensor of
    `full_shape` laid out by `partition_spec`."""
    _require_spmd("disable_manual_sharding")
    mesh = mesh or get_global_mesh()
    if mesh is None:
        raise RuntimeError("disable_manual_sharding needs a mesh (the mesh= argument or xs.set_global_mesh)")
    raw = _sh.mark_manual(_raw(t))
    full = _sh.shard_to_full(raw, mesh.sharding(tuple(partition_spec)), tuple(full_shape))
    return XLAShardedTensor(full, mesh_shape=mesh.mesh_shape, partition_spec=tuple(partition_spec))
