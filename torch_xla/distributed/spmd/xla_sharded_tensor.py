"""`XLAShardedTensor`: an xla tensor seen with its sharding (a DTensor for PyTorch).

The sharded tensor wraps the global tensor: every op unwraps it, runs on the global
xla tensor (XLA partitions the program) and wraps tensor results again. Its shards are
read from the device buffers, one per device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from torch_xla._engine import executor as _executor
from torch_xla._engine import pjrt as _rt
from torch_xla._engine import partitioning as _sh
from torch_xla._engine import tensor as _tensor

from .mesh import ShardingType, sharding_type_of, spec_from_placements, xla_mesh


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
    come from the mesh shape and partition spec it was made with.
    """

    global_tensor: torch.Tensor
    mesh_shape: Optional[Tuple[int, ...]]
    partition_spec: Optional[tuple]

    @staticmethod
    def __new__(cls, elem: torch.Tensor, mesh_shape=None, partition_spec=None, *args, **kwargs):
        requires_grad = kwargs.get("requires_grad", False)
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=elem.device, requires_grad=requires_grad)
        inner = elem.global_tensor if isinstance(elem, XLAShardedTensor) else elem
        r.global_tensor = inner.detach() if requires_grad else inner
        r.mesh_shape = mesh_shape or getattr(elem, "mesh_shape", None)
        r.partition_spec = partition_spec or getattr(elem, "partition_spec", None)
        r._cached_spec = None
        return r

    def __init__(self, *args, **kwargs):
        pass

    @property
    def local_shards(self) -> List[XLAShard]:
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
        if not hasattr(self, "global_tensor"):
            return "XLAShardedTensor(<uninitialized>)"
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
        return tree_map(_wrap_result, out) if isinstance(out, (tuple, list)) else _wrap_result(out)

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

    def redistribute(self, device_mesh, placements, *, async_op: bool = False) -> "XLAShardedTensor":
        """The tensor laid out with `placements` (Shard / Replicate) over `device_mesh`."""
        mesh = xla_mesh(device_mesh)
        spec = spec_from_placements(placements, self.global_tensor.dim(), len(mesh.mesh_shape))
        g = self.global_tensor.clone() if async_op else self.global_tensor
        _sh.annotate(g, mesh.sharding(spec), in_graph=True)
        return XLAShardedTensor(g, mesh_shape=mesh.mesh_shape, partition_spec=spec)


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


# Results given as they are: the tensor's gradient and data.
_KEEP_PLAIN = frozenset([torch.Tensor.grad.__get__, torch.Tensor.data.__get__])
# Asked of the sharded tensor itself when autograd recorded it (custom Function outputs).
_OWN = frozenset([torch.Tensor.grad_fn.__get__, torch.Tensor.grad.__get__])


def _dtensor_spec(t: XLAShardedTensor):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.placement_types import Replicate, Shard
    if t.mesh_shape is None or t.partition_spec is None:
        raise ValueError("XLAShardedTensor requires mesh_shape and partition_spec to be set. "
                         "Use mark_sharding() to properly initialize sharding information.")
    n = int(np.prod(t.mesh_shape))
    mesh = DeviceMesh("xla", torch.arange(n).reshape(t.mesh_shape))
    placements = []
    for mesh_dim in range(len(t.mesh_shape)):
        dims = [d for d, m in enumerate(t.partition_spec)
                if m == mesh_dim or (isinstance(m, tuple) and mesh_dim in m)]
        placements.append(Shard(dims[0]) if dims else Replicate())
    g = t.global_tensor
    meta = TensorMeta(shape=g.shape, stride=g.stride(), dtype=g.dtype)
    return DTensorSpec(mesh=mesh, placements=tuple(placements), tensor_meta=meta)


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
