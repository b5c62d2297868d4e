"""`XLAShardedTensor`: an xla tensor seen with its sharding (a DTensor for PyTorch).

The sharded tensor wraps the global tensor: every op unwraps it, runs on the global
xla tensor (XLA partitions the program) and wraps tensor results again. Its shards are
read from the device buffers, one per device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate
from torch.utils._pytree import tree_map

from torch_xla._engine import executor as _executor
from torch_xla._engine import pjrt as _rt
from torch_xla._engine import partitioning as _sh
from torch_xla._engine import tensor as _tensor

from .mesh import Mesh, ShardingType, sharding_type_of, split_placements, xla_mesh


@dataclass
class XLAShard:
    """One device's piece of a sharded tensor, on the CPU.

    `indices`: the slices of the global tensor it holds (`...` when it holds all of it);
    `data` may be padded past the global tensor's end (uneven layouts)."""
    data: torch.Tensor
    indices: Union[type(Ellipsis), List[slice]]
    shard_device: str
    replica_id: int

    def _unpadded_index(self):
        if self.indices is Ellipsis:
            return Ellipsis
        return tuple(slice(0, s.stop - s.start) for s in self.indices)

    @property
    def unpadded_data(self) -> torch.Tensor:
        return self.data[self._unpadded_index()]

    @unpadded_data.setter
    def unpadded_data(self, t: torch.Tensor) -> None:
        self.data[self._unpadded_index()] = t


def _layout_sharding(g: torch.Tensor):
    """The sharding that describes `g`'s pieces: its annotation, else its data's layout."""
    return _sh.annotation(g) or _sh.data_sharding(g) or _sh.replicated_sharding()


def local_shards_of(g: torch.Tensor) -> List[XLAShard]:
    """The pieces of xla tensor `g` held by this process's devices, in device id order."""
    state = _tensor.state_of(g)
    arr = _executor.materialize(state)
    sh = _layout_sharding(g)
    shape = tuple(g.shape)
    pieces = []
    if _sh.divisible(sh, shape) and type(arr) is not _rt.HostArray and arr.sharding == sh:
        by_dev = {s.device: s for s in arr.addressable_shards}
        for dev, index, rep, _ in _sh.shard_layout(sh, shape):
            if dev not in by_dev:
                continue
            pieces.append((dev, _rt.fetch(by_dev[dev].data), index, rep))
    else:
        host = _rt.fetch(arr)
        for dev, index, rep, padded in _sh.shard_layout(sh, shape):
            if dev.process_index != _rt.jax_module().process_index():
                continue
            piece = host[index]
            if piece.shape != padded:
                piece = np.pad(piece, [(0, p - n) for p, n in zip(padded, piece.shape)])
            pieces.append((dev, piece, index, rep))
    out = []
    for dev, data, index, rep in pieces:
        whole = all(s.start == 0 and s.stop == n for s, n in zip(index, shape))
        idx = Ellipsis if _sh.is_replicated(sh) or whole else list(index)
        out.append(XLAShard(_rt.from_numpy(data, g.dtype), idx, f"{_rt.platform()}:{_sh.logical_id(dev)}", rep))
    return out


def load_local_shards(g: torch.Tensor, shards: List[XLAShard]) -> None:
    """Replaces the value of sharded tensor `g` with `shards` (as returned by `local_shards`)."""
    sh = _layout_sharding(g)
    shape = tuple(g.shape)
    if _sh.is_replicated(sh):
        raise RuntimeError("load_local_shards_: the tensor is replicated; assign to it instead")
    layout = [r for r in _sh.shard_layout(sh, shape)
              if r[0].process_index == _rt.jax_module().process_index()]
    if len(shards) != len(layout):
        raise RuntimeError(f"load_local_shards_: expected {len(layout)} shards (one per local device), "
                           f"got {len(shards)}")
    for (dev, index, rep, padded), s in zip(layout, shards):
        if tuple(s.data.shape) != padded:
            raise RuntimeError(f"load_local_shards_: the shard for device {_sh.logical_id(dev)} has shape "
                               f"{tuple(s.data.shape)}, expected {padded}")
    jax = _rt.jax_module()
    dd = _rt.device_dtype(g.dtype)
    if _sh.divisible(sh, shape):
        arrays = [jax.device_put(_rt.to_numpy(s.data).astype(dd), dev) for (dev, *_), s in zip(layout, shards)]
        arr = jax.make_array_from_single_device_arrays(shape, sh, arrays)
    else:
        host = np.zeros(shape, dd)
        for (dev, index, rep, padded), s in zip(layout, shards):
            host[index] = _rt.to_numpy(s.data).astype(dd)[tuple(slice(0, i.stop - i.start) for i in index)]
        arr = _sh.put(host, sh)
    _sh.set_array(g, arr)


class XLAShardedTensor(DTensor):
    """An xla tensor with a sharding: `global_tensor`, `local_shards`, `sharding_spec`.

    Built by `mark_sharding`; also a `torch.distributed.tensor.DTensor` whose placements
    come from the mesh shape and partition spec it was made with. A tensor with `Partial`
    placements (`distribute_tensor(..., [Partial()])`, `from_local`) keeps each device's
    partial value (`_PartialValue`); its `global_tensor` is their reduction.
    """

    @staticmethod
    def __new__(cls, elem: torch.Tensor, mesh_shape=None, partition_spec=None, *args, **kwargs):
        requires_grad = kwargs.get("requires_grad", False)
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=elem.device, requires_grad=requires_grad)
        inner = elem.global_tensor if isinstance(elem, XLAShardedTensor) else elem
        r._partial = None
        r._global = inner.detach() if requires_grad else inner
        r._mesh_shape = mesh_shape or getattr(elem, "mesh_shape", None)
        r._partition_spec = partition_spec or getattr(elem, "partition_spec", None)
        r._cached_spec = None
        return r

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def _of_partial(cls, partial: "_PartialValue", partition_spec: tuple) -> "XLAShardedTensor":
        stack = partial.stack
        shape = tuple(stack.shape[len(partial.dims):])
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=_contiguous_strides(shape), dtype=stack.dtype, device=stack.device)
        r._partial = partial
        r._global = None
        r._mesh_shape = partial.mesh.mesh_shape
        r._partition_spec = tuple(partition_spec)
        r._cached_spec = None
        return r

    @property
    def global_tensor(self) -> torch.Tensor:
        if self._global is None:  # pending reduction of a Partial tensor, made at first use
            self._global = self._partial.reduce(self._partial.dims, self._partition_spec)
        return self._global

    @global_tensor.setter
    def global_tensor(self, t: torch.Tensor) -> None:
        self._global = t
        self._partial = None
        self._cached_spec = None

    # The layout the DTensor view (`_spec`, `placements`) describes; changing it (as
    # `wrap_as_sharded_tensor` does) drops the spec made from the old one.
    @property
    def mesh_shape(self) -> Optional[Tuple[int, ...]]:
        return self._mesh_shape

    @mesh_shape.setter
    def mesh_shape(self, value) -> None:
        self._mesh_shape = None if value is None else tuple(value)
        self._cached_spec = None

    @property
    def partition_spec(self) -> Optional[tuple]:
        return self._partition_spec

    @partition_spec.setter
    def partition_spec(self, value) -> None:
        self._partition_spec = None if value is None else tuple(value)
        self._cached_spec = None

    @property
    def local_shards(self) -> List[XLAShard]:
        if self._partial is not None:
            return self._partial.local_shards()
        return local_shards_of(self.global_tensor)

    def load_local_shards_(self, shards: List[XLAShard]) -> None:
        load_local_shards(self.global_tensor, shards)
        self._cached_spec = None

    @property
    def sharding_spec(self) -> str:
        return sharding_text(self.global_tensor)

    @property
    def sharding_type(self):
        if _sh.is_manual(self.global_tensor):
            return ShardingType.MANUAL
        t = sharding_type_of(_sh.annotation(self.global_tensor) or _sh.data_sharding(self.global_tensor),
                             self.global_tensor.dim())
        return ShardingType.REPLICATED if t is None else t

    def __repr__(self, *, tensor_contents=None) -> str:
        if not hasattr(self, "_global"):
            return "XLAShardedTensor(<uninitialized>)"
        if self._partial is not None:
            return f"XLAShardedTensor(partial={self._partial.placement_text()}, shape={self._logical_shape()})"
        return f"XLAShardedTensor({self.global_tensor})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.global_tensor if isinstance(x, XLAShardedTensor) else x

        # Reached below __torch_function__ only (the autograd engine, custom Functions'
        # internals): results are plain xla tensors, since autograd makes shallow copies of
        # subclass results (views, custom Functions) that would lose the global tensor.
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Plain tensor semantics (DTensor's own rules do not apply): the op runs on the
        # global tensors, so autograd records it as on any xla tensor, and its xla tensor
        # results come back as sharded tensors over them (`as_subclass` would make sharded
        # tensors without a global tensor).
        with torch._C.DisableTorchFunctionSubclass():
            if func in _OWN:
                own = func(*args)
                if own is not None:
                    return own
            out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {}))
        if func in _KEEP_PLAIN:
            return out
        wrap = _host_copy if func in _TRANSFERS else _wrap_result
        return tree_map(wrap, out) if isinstance(out, (tuple, list)) else wrap(out)

    @property
    def _spec(self):
        if self._cached_spec is None:
            self._cached_spec = _dtensor_spec(self)
        return self._cached_spec

    @property
    def placements(self):
        try:
            return self._spec.placements
        except ValueError as e:
            raise ValueError(f"Placements not available: {e}") from None

    def invalidate_spec_cache(self) -> None:
        self._cached_spec = None

    def redistribute(self, device_mesh=None, placements=None, *, async_op: bool = False,
                     **_dtypes) -> "XLAShardedTensor":  # noqa: ARG002 (DTensor's forward/backward_dtype)
        """The tensor laid out with `placements` over `device_mesh`.

        Shard / Replicate set the layout (XLA moves the data: all-gather, all-to-all,
        slicing); a `Partial` source is reduced over its mesh dimensions: to Replicate an
        all-reduce, to Shard a reduce-scatter (XLA:CPU, which has no pass forming
        reduce-scatters, runs an all-reduce and keeps each device's slice). A Partial target
        must be the source's own placement on that mesh dimension (redistributing to
        Partial is not implemented)."""
        if placements is None:
            raise RuntimeError("placements is needed for redistribute!")
        if device_mesh is None:
            device_mesh = self._own_mesh()
        mesh = xla_mesh(device_mesh)
        placements = list(placements)
        if len(placements) != len(mesh.mesh_shape):
            raise ValueError(f"Number of placements ({len(placements)}) must match mesh dimensions "
                             f"({len(mesh.mesh_shape)})")
        source = dict(zip(self._partial.dims, self._partial.ops)) if self._partial is not None else {}
        for i, p in enumerate(placements):
            if isinstance(p, Partial) and source.get(i) != p.reduce_op:
                raise NotImplementedError(
                    f"Can not redistribute from {self._placement_text(i)} to {p}: redistributing to Partial "
                    "is not implemented (a Partial tensor comes from distribute_tensor or from_local)")
        spec, partial = split_placements(placements, len(self._logical_shape()), len(mesh.mesh_shape))
        if self._partial is not None:
            if mesh != self._partial.mesh:
                raise NotImplementedError("redistributing a Partial tensor to another device mesh is not implemented")
            return self._partial.redistribute(spec, tuple(d for d, _ in partial), async_op)
        g = self.global_tensor.clone() if async_op else self.global_tensor
        _sh.annotate(g, mesh.sharding(spec), in_graph=True)
        return XLAShardedTensor(g, mesh_shape=mesh.mesh_shape, partition_spec=spec)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:  # noqa: ARG002 (DTensor's signature)
        """The whole tensor, replicated on every device (a Partial one reduced)."""
        n = len(self.mesh_shape) if self.mesh_shape is not None else 1
        # A copy (async_op): the tensor itself keeps its layout.
        return self.redistribute(self._own_mesh(), [Replicate()] * n, async_op=True).global_tensor

    def _own_mesh(self):
        if self._partial is not None:
            return self._partial.mesh
        if self.mesh_shape is None:
            raise ValueError("the tensor has no device mesh (mark_sharding it, or give device_mesh)")
        return Mesh(np.arange(int(np.prod(self.mesh_shape))), self.mesh_shape)

    def _logical_shape(self) -> Tuple[int, ...]:
        # Asked without reducing a Partial tensor (`self.shape` would run on its global value).
        if self._partial is not None:
            return tuple(self._partial.stack.shape[len(self._partial.dims):])
        return tuple(self.global_tensor.shape)

    def _placement_text(self, mesh_dim: int) -> str:
        try:
            return str(self.placements[mesh_dim])
        except (ValueError, IndexError):
            return "its placement"

    @staticmethod
    def from_local(local_tensor: torch.Tensor, device_mesh, placements: Sequence, *, shape=None,
                   stride=None, run_check: bool = False) -> "XLAShardedTensor":  # noqa: ARG004
        """The sharded tensor whose piece on each device of `device_mesh` is that device's
        `local_tensor`, placed by `placements` (DTensor's `from_local` in SPMD terms).

        `local_tensor` is a per-device value of a manual region (`enable_manual_sharding`,
        or computed from one); a plain xla tensor is the same local value on every device.
        Shard concatenates the pieces, Replicate takes them as equal copies and
        `Partial(op)` keeps them all, pending the reduction `redistribute` performs."""
        mesh = xla_mesh(device_mesh)
        placements = list(placements)
        spec, partial = split_placements(placements, local_tensor.dim(), len(mesh.mesh_shape))
        local = local_tensor.global_tensor if isinstance(local_tensor, XLAShardedTensor) else local_tensor
        if local.device.type != "xla":
            local = local.to("xla")
        if not _per_device(local):
            # The same value on every device: a replicated layout, entered as a manual region.
            _sh.annotate(local, mesh.sharding((None,) * local.dim()), in_graph=True)
            local = _sh.full_to_shard(local)
        parts = _sh.dim_parts(mesh.sharding(spec), local.dim()) if local.dim() else []
        full = tuple(n * k for n, k in zip(local.shape, parts))
        if shape is not None and tuple(shape) != full:
            raise ValueError(f"from_local: shape {tuple(shape)} is not that of the pieces put together {full}")
        dims = tuple(d for d, _ in partial)
        stack_shape = tuple(mesh.mesh_shape[d] for d in dims) + full
        piece = local.reshape((1,) * len(dims) + tuple(local.shape)) if dims else local
        piece = _sh.mark_manual(piece)
        value = _sh.shard_to_full(piece, mesh.sharding(dims + spec), stack_shape)
        if not dims:
            return XLAShardedTensor(value, mesh_shape=mesh.mesh_shape, partition_spec=spec)
        return XLAShardedTensor._of_partial(
            _PartialValue(mesh, dims, tuple(op for _, op in partial), value, spec), spec)


def _per_device(t: torch.Tensor) -> bool:
    """Whether `t` is a value of an open manual region (computed from one of its entries)."""
    if _sh.is_manual(t):
        return True
    if not _sh.manual_regions.used:
        return False
    seen, stack = set(), [_tensor.state_of(t).node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        op = getattr(n, "op", None)
        if op in ("xla::full_to_shard", "xla::manual"):
            return True
        if op != "xla::shard_to_full":  # a closed region's result is a global value
            stack.extend(o for o, _ in getattr(n, "operands", ()))
    return False


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


class _PartialValue:
    """The per-device values of a Partial tensor, stacked: `stack` has one leading
    dimension per Partial mesh dimension (`dims`, reduce ops `ops`), laid out over that
    mesh dimension, so that each device holds its own value; the other dimensions are the
    tensor's, laid out by `spec`. Reducing a leading dimension is a reduction across the
    devices of its mesh dimension, which XLA's partitioner writes as a collective."""

    __slots__ = ("mesh", "dims", "ops", "stack", "spec")

    def __init__(self, mesh, dims: Tuple[int, ...], ops: Tuple[str, ...], stack: torch.Tensor, spec: tuple):
        self.mesh, self.dims, self.ops, self.stack, self.spec = mesh, dims, ops, stack, spec

    @classmethod
    def partition(cls, t: torch.Tensor, mesh, partial: Tuple[Tuple[int, str], ...], spec: tuple) -> "_PartialValue":
        """Replicated `t` split into partial values (PyTorch's `Partial._partition_value`:
        a sum's values are `t / n`, avg / min / max ones `t` itself)."""
        v = t
        for d, op in partial:
            if op == "sum":
                v = v / mesh.mesh_shape[d]
            elif op not in ("avg", "min", "max"):
                raise ValueError(f"Replicate to Partial({op}) conversion is not supported.")
        dims = tuple(d for d, _ in partial)
        stack = v.expand(tuple(mesh.mesh_shape[d] for d in dims) + tuple(v.shape)).clone()
        _sh.annotate(stack, mesh.sharding(dims + spec), in_graph=True)
        return cls(mesh, dims, tuple(op for _, op in partial), stack, spec)

    def reduce(self, dims: Tuple[int, ...], spec: tuple, copy: bool = False) -> torch.Tensor:
        """The stack reduced over mesh dimensions `dims` (all of `self.dims` or some),
        laid out with the remaining ones and `spec`."""
        keep = tuple(d for d in self.dims if d not in dims)
        out = self.stack.clone() if copy else self.stack
        # Highest stack position first, so that the lower positions stay where they are.
        for pos in sorted((i for i, d in enumerate(self.dims) if d in dims), reverse=True):
            out = _reduce_dim(out, pos, self.ops[pos])
        _sh.annotate(out, self.mesh.sharding(keep + tuple(spec)), in_graph=True)
        return out

    def redistribute(self, spec: tuple, keep: Tuple[int, ...], copy: bool) -> XLAShardedTensor:
        reduced = tuple(d for d in self.dims if d not in keep)
        out = self.reduce(reduced, spec, copy=copy)
        if not keep:
            return XLAShardedTensor(out, mesh_shape=self.mesh.mesh_shape, partition_spec=spec)
        ops = tuple(op for d, op in zip(self.dims, self.ops) if d in keep)
        return XLAShardedTensor._of_partial(_PartialValue(self.mesh, keep, ops, out, spec), spec)

    def local_shards(self) -> List[XLAShard]:
        """Each local device's partial value (the stack's leading dimensions dropped)."""
        p = len(self.dims)
        out = []
        for s in local_shards_of(self.stack):
            data = s.data.reshape(tuple(s.data.shape[p:]))
            idx = s.indices if s.indices is Ellipsis else s.indices[p:]
            if idx is not Ellipsis and all(i.start == 0 and i.stop == n for i, n in zip(idx, self.stack.shape[p:])):
                idx = Ellipsis
            out.append(XLAShard(data, idx, s.shard_device, s.replica_id))
        return out

    def placement_text(self) -> str:
        return ", ".join(f"mesh dim {d}: Partial({op})" for d, op in zip(self.dims, self.ops))


def _reduce_dim(t: torch.Tensor, dim: int, op: str) -> torch.Tensor:
    if op == "sum":
        return t.sum(dim, dtype=t.dtype)
    if op == "avg":
        if t.is_floating_point() or t.is_complex():
            return t.mean(dim)
        return torch.div(t.sum(dim, dtype=t.dtype), t.shape[dim], rounding_mode="trunc")
    if op == "max":
        return t.amax(dim)
    if op == "min":
        return t.amin(dim)
    if op == "product":
        return t.prod(dim, dtype=t.dtype)
    raise NotImplementedError(f"Partial({op}) reduction is not implemented on the xla device")


class _Wrap(torch.autograd.Function):
    """Identity from an xla tensor to a sharded tensor over it, for autograd paths that
    take the sharded tensor itself (custom Functions such as module backward hooks)."""

    @staticmethod
    def forward(ctx, t):  # noqa: ARG004 (autograd.Function's signature)
        return XLAShardedTensor(t)

    @staticmethod
    def backward(ctx, g):  # noqa: ARG004 (autograd.Function's signature)
        return g.global_tensor if isinstance(g, XLAShardedTensor) else g


class _Unwrap(torch.autograd.Function):
    """Identity from a sharded tensor that autograd recorded itself to its global tensor."""

    @staticmethod
    def forward(ctx, w):  # noqa: ARG004 (autograd.Function's signature)
        return w.global_tensor.detach()

    @staticmethod
    def backward(ctx, g):  # noqa: ARG004 (autograd.Function's signature)
        return g


_grad_fn = torch.Tensor.grad_fn.__get__
_requires_grad = torch.Tensor.requires_grad.__get__


def _unwrap(x):
    if not isinstance(x, XLAShardedTensor):
        return x
    # The global tensor carries the history, unless autograd recorded the sharded tensor
    # itself (a leaf that requires grad, or a custom Function's output such as a backward
    # hook's): then gradients must pass through it.
    if _requires_grad(x) and torch.is_grad_enabled():
        fn = _grad_fn(x)
        if fn is None or type(fn).__name__ != "_WrapBackward":
            return _Unwrap.apply(x)
    return x.global_tensor


def _wrap_result(x):
    if type(x) is not torch.Tensor or x.device.type != "xla":
        return x
    if x.requires_grad and torch.is_grad_enabled():
        return _Wrap.apply(x)
    return XLAShardedTensor(x)


def _host_copy(x):
    if type(x) is not torch.Tensor or x.device.type == "xla":
        return _wrap_result(x)
    # PyTorch/XLA wraps a host copy too, its `global_tensor` the whole CPU tensor. It stays
    # a plain tensor here (PyTorch's comparisons refuse a DTensor against a plain tensor)
    # and carries `global_tensor`, plain data, for code that reads it.
    x.global_tensor = x.detach()
    return x


# Results given as they are: the tensor's gradient and data.
_KEEP_PLAIN = frozenset([torch.Tensor.grad.__get__, torch.Tensor.data.__get__])
# Asked of the sharded tensor itself when autograd recorded it (custom Function outputs).
_OWN = frozenset([torch.Tensor.grad_fn.__get__, torch.Tensor.grad.__get__])
# Copies to another device whose results are wrapped whatever their device.
_TRANSFERS = frozenset([torch.Tensor.cpu, torch.Tensor.to])


def _dtensor_spec(t: XLAShardedTensor):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
    from torch.distributed.tensor.placement_types import Shard
    if t.mesh_shape is None or t.partition_spec is None:
        raise ValueError("XLAShardedTensor requires mesh_shape and partition_spec to be set. "
                         "Use mark_sharding() to properly initialize sharding information.")
    n = int(np.prod(t.mesh_shape))
    mesh = DeviceMesh("xla", torch.arange(n).reshape(t.mesh_shape))
    partial = dict(zip(t._partial.dims, t._partial.ops)) if t._partial is not None else {}
    # Tensor dim -> the mesh dims that split it, in the order the partition spec names them
    # (the order its pieces are laid out in: DTensor's shard order).
    order = {}
    for d, m in enumerate(t.partition_spec):
        # Axis names cannot be told apart without the mesh (only its shape is kept).
        ms = tuple(int(a) for a in (m if isinstance(m, (tuple, list)) else (m,))
                   if isinstance(a, (int, np.integer)))
        if ms:
            order[d] = ms
    placements = []
    for mesh_dim in range(len(t.mesh_shape)):
        dims = [d for d, ms in order.items() if mesh_dim in ms]
        if mesh_dim in partial:
            placements.append(Partial(partial[mesh_dim]))
        else:
            placements.append(Shard(dims[0]) if dims else Replicate())
    shape = t._logical_shape()
    meta = TensorMeta(shape=torch.Size(shape), stride=_contiguous_strides(shape) if t._partial is not None
                      else t.global_tensor.stride(), dtype=t.dtype)
    shard_order = tuple(ShardOrderEntry(tensor_dim=d, mesh_dims=ms) for d, ms in sorted(order.items()))
    return DTensorSpec(mesh=mesh, placements=tuple(placements), tensor_meta=meta, shard_order=shard_order)


def sharding_text(g: torch.Tensor) -> str:
    """The original's sharding text of xla tensor `g` ('' when it has no sharding)."""
    if _sh.is_manual(g):
        return "{manual}"
    sh = _sh.annotation(g)
    if sh is None:
        data = _sh.data_sharding(g)
        computed = getattr(_tensor.state_of(g).node, "computed", False)
        if data is not None and len(data.device_set) > 1 and (computed or not _sh.is_replicated(data)):
            sh = data
    return _sh.spec_text(sh, g.dim()) if sh is not None else ""
