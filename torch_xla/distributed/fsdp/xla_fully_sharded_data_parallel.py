"""`XlaFullyShardedDataParallel`: fully sharded data parallelism over the replicas of a
multi-process job (ZeRO-2/3).

Each process keeps 1/N of every parameter of the wrapped module (a "shard", registered
on the wrapper as `_fsdp_shard_<k>`; with `flatten_parameters` one shard per wrapper).
At each forward the full parameters are all-gathered from the shards into the
submodules, and their gradients are reduce-scattered back into the shards' `.grad`
(averaged over the replicas), all as collectives in the step's graph. The optimizer is
built on `model.parameters()`, the shards, and needs no gradient reduction.

With `reshard_after_forward` (inner wrappers; the root keeps its parameters when
`disable_reshard_on_root`), the full parameters are not kept for the backward: autograd
saves a reference to the shard instead, and the backward all-gathers it again, after
the gradient of the wrapper's output exists (an optimization barrier orders the two), so
at most a few wrappers' full parameters are alive at once.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ... import _api, runtime as xr
from ..._engine import collectives as _coll
from .utils import apply_xla_patch_to_nn_linear
from .wrap import recursive_wrap

__all__ = ["XlaFullyShardedDataParallel"]

_tls = threading.local()


def _depth() -> int:
    return getattr(_tls, "depth", 0)


class _Group:
    """One shard: the parameters it holds (locations, names, sizes) and how it is cut."""

    def __init__(self, locations, names, sizes, dim0: bool, requires_grad: bool):
        self.locations = locations  # per parameter: [(submodule, attribute name), ...]
        self.names = names
        self.sizes = sizes
        self.dim0 = dim0
        self.requires_grad = requires_grad
        self.numels = [int(torch.Size(s).numel()) for s in sizes]
        self.shard: Optional[nn.Parameter] = None
        self.shard_name = ""


class _AllGather(torch.autograd.Function):
    """shard -> padded full value (all-gather on dim 0); gradient: reduce-scatter, averaged."""

    @staticmethod
    def forward(ctx, shard, fsdp, after=None, group=0):
        ctx.fsdp = fsdp
        ctx.group = group
        ctx.dtype = shard.dtype
        x = shard if shard.dtype == fsdp.compute_dtype else shard.to(fsdp.compute_dtype)
        if after is not None:
            x = _coll.optimization_barrier([x, after])[0]
        elif fsdp.optimization_barrier_in_forward:
            (x,) = _coll.optimization_barrier([x])
        return _coll.all_gather(x, 0, fsdp.sharding_groups)

    @staticmethod
    def backward(ctx, grad):
        f = ctx.fsdp
        held = f._unsynced_grads.pop(ctx.group, None)
        if held is not None:
            grad = grad + held
        if not f._sync_grads:
            # Inside no_sync(): keep the full gradient here, reduce it with a later one.
            f._unsynced_grads[ctx.group] = grad
            return None, None, None, None
        if f.fp32_reduce_scatter and grad.dtype != torch.float32:
            grad = grad.float()
        r = _coll.reduce_scatter("sum", grad, 1.0 / f.world_size, 0, f.world_size, f.sharding_groups)
        return r.to(ctx.dtype), None, None, None


class _Saved:
    __slots__ = ("group", "index")

    def __init__(self, group: int, index: int):
        self.group, self.index = group, index


class XlaFullyShardedDataParallel(nn.Module):
    """Shards `module`'s parameters over the replicas (see the module docstring).

    compute_dtype: dtype of the gathered parameters and of floating inputs (default: the
    parameters' dtype); buffer_dtype: of floating buffers (default compute_dtype);
    fp32_reduce_scatter: reduce gradients in float32; shard_param_on_dim_0: cut each
    parameter along dim 0 instead of flattened; auto_wrap_policy /
    auto_wrapper_callable: wrap submodules first (`fsdp.wrap`); sharding_groups: shard
    within these replica groups."""

    _xla_fsdp_wrapper = True

    def __init__(self, module: nn.Module, reshard_after_forward: bool = True, flatten_parameters: bool = False,
                 execute_sharding_on_init: bool = True, optimization_barrier_in_forward: bool = True,
                 optimization_barrier_in_backward: bool = True, sync_on_finalization: bool = False,
                 disable_reshard_on_root: bool = True, compute_dtype: Optional[torch.dtype] = None,
                 buffer_dtype: Optional[torch.dtype] = None, fp32_reduce_scatter: bool = False,
                 sharding_groups: Optional[List[List[int]]] = None, sharding_rank: Optional[int] = None,
                 sharding_world_size: Optional[int] = None, shard_param_on_dim_0: bool = False,
                 pin_layout_in_collective_ops: bool = True, reduce_scatter_bucket_size_mb: Optional[int] = 0,
                 coalesce_all_gather_ops: bool = False, auto_wrap_policy: Optional[Callable] = None,
                 auto_wrapper_callable: Optional[Callable] = None,
                 param_init_fn: Optional[Callable[[nn.Module], None]] = None, **kwargs: Any):
        if isinstance(module, XlaFullyShardedDataParallel):
            raise RuntimeError("Cannot wrap a module that is already wrapped with FSDP. For nested FSDP, first wrap "
                               "the inner child modules before wrapping the outer parent module.")
        fwd = getattr(type(module), "forward", None)
        if fwd is None or fwd is nn.Module.forward:
            raise RuntimeError("The module wrapped by FSDP *must define a `forward` method*; do not wrap "
                               "`nn.ModuleList` or `nn.ModuleDict`.")
        super().__init__()
        wrapper_kwargs = dict(
            reshard_after_forward=reshard_after_forward, flatten_parameters=flatten_parameters,
            optimization_barrier_in_forward=optimization_barrier_in_forward,
            optimization_barrier_in_backward=optimization_barrier_in_backward,
            disable_reshard_on_root=disable_reshard_on_root, compute_dtype=compute_dtype, buffer_dtype=buffer_dtype,
            fp32_reduce_scatter=fp32_reduce_scatter, sharding_groups=sharding_groups, sharding_rank=sharding_rank,
            sharding_world_size=sharding_world_size, shard_param_on_dim_0=shard_param_on_dim_0,
            pin_layout_in_collective_ops=pin_layout_in_collective_ops, param_init_fn=param_init_fn, **kwargs)
        if auto_wrap_policy is not None:
            wrapper = auto_wrapper_callable or XlaFullyShardedDataParallel
            recursive_wrap(module, auto_wrap_policy, wrapper, set(), set(), only_wrap_children=True,
                           **wrapper_kwargs)
        if sharding_groups:
            me = xr.global_ordinal()
            group = next((g for g in sharding_groups if me in g), None)
            if group is None:
                raise ValueError(f"replica {me} is in none of the sharding groups {sharding_groups}")
            self.world_size, self.rank = len(group), list(group).index(me)
        else:
            self.world_size = sharding_world_size or xr.world_size()
            self.rank = xr.global_ordinal() if sharding_rank is None else sharding_rank
        self.sharding_groups = sharding_groups
        self.reshard_after_forward = reshard_after_forward
        self.disable_reshard_on_root = disable_reshard_on_root
        self.flatten_parameters = flatten_parameters
        self.shard_param_on_dim_0 = shard_param_on_dim_0
        self.optimization_barrier_in_forward = optimization_barrier_in_forward
        self.optimization_barrier_in_backward = optimization_barrier_in_backward
        self.fp32_reduce_scatter = fp32_reduce_scatter
        self.xla_device = _api.device()
        if param_init_fn is not None and any(p.is_meta for p in module.parameters()):
            param_init_fn(module)
        params = [p for _, p in self._managed(module)]
        self.compute_dtype = compute_dtype or (params[0].dtype if params else torch.float32)
        self.buffer_dtype = buffer_dtype or self.compute_dtype
        if self.fp32_reduce_scatter and compute_dtype is None:
            raise ValueError("fp32_reduce_scatter requires compute_dtype")
        apply_xla_patch_to_nn_linear(module)
        self._groups: List[_Group] = []
        self._shard(module)
        self._buffer_info: Dict[str, torch.dtype] = {}
        for name, b in module.named_buffers():
            if b.is_floating_point() and b.dtype != self.buffer_dtype:
                self._buffer_info[name] = b.dtype
        module.to(self.xla_device)
        for name, b in list(module.named_buffers()):
            if name in self._buffer_info:
                owner, _, attr = name.rpartition(".")
                sub = module.get_submodule(owner)
                sub._buffers[attr] = b.to(self.buffer_dtype)
        self._fsdp_wrapped_module = module
        self._full_ids: Dict[int, Tuple[torch.Tensor, _Saved]] = {}
        self._regathered: Optional[List[List[torch.Tensor]]] = None
        self._in_backward = False
        self._resharded = False
        self._checkpointed = any(hasattr(m, "_xla_checkpointed_forward_original") for m in self._own_modules(module))
        self._sync_grads = True
        self._unsynced_grads: Dict[int, torch.Tensor] = {}

    # ---- sharding -----------------------------------------------------------------------

    @staticmethod
    def _managed(module: nn.Module):
        """(qualified name, parameter) of the parameters not inside a nested wrapper."""
        out, seen = [], set()

        def walk(m, prefix):
            for n, p in m._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    out.append((prefix + n, p))
            for n, c in m._modules.items():
                if c is not None and not getattr(c, "_xla_fsdp_wrapper", False):
                    walk(c, prefix + n + ".")
        walk(module, "")
        return out

    @staticmethod
    def _own_modules(module: nn.Module) -> List[nn.Module]:
        """`module` and its submodules, not entering nested wrappers."""
        out = [module]
        for c in module._modules.values():
            if c is not None and not getattr(c, "_xla_fsdp_wrapper", False):
                out.extend(XlaFullyShardedDataParallel._own_modules(c))
        return out

    def _locations(self, module: nn.Module):
        """{id(param): [(submodule, attribute)...]} for every place a managed param sits."""
        locs: Dict[int, list] = {}

        def walk(m):
            for n, p in m._parameters.items():
                if p is not None:
                    locs.setdefault(id(p), []).append((m, n))
            for c in m._modules.values():
                if c is not None and not getattr(c, "_xla_fsdp_wrapper", False):
                    walk(c)
        walk(module)
        return locs

    def _cut(self, full: torch.Tensor, dim0: bool) -> torch.Tensor:
        n = self.world_size
        if dim0:
            pad = (-full.shape[0]) % n
            if pad:
                full = torch.cat([full, full.new_zeros((pad,) + tuple(full.shape[1:]))])
            return full.chunk(n)[self.rank].clone()
        flat = full.reshape(-1)
        pad = (-flat.numel()) % n
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.chunk(n)[self.rank].clone()

    @torch.no_grad()
    def _shard(self, module: nn.Module) -> None:
        managed = self._managed(module)
        locs = self._locations(module)
        dim0 = self.shard_param_on_dim_0
        if self.flatten_parameters and managed:
            batches = [managed]
            dim0 = False
        else:
            batches = [[np] for np in managed]
        for k, batch in enumerate(batches):
            ps = [p for _, p in batch]
            g = _Group([locs[id(p)] for p in ps], [n for n, _ in batch], [tuple(p.shape) for p in ps],
                       dim0 and ps[0].dim() > 0, any(p.requires_grad for p in ps))
            full = ps[0].detach() if len(ps) == 1 else torch.cat([p.detach().reshape(-1) for p in ps])
            data = self._cut(full.cpu() if full.device.type != "xla" else full, g.dim0).to(self.xla_device)
            g.shard = nn.Parameter(data, requires_grad=g.requires_grad)
            g.shard_name = f"flat_param_{k}" if self.flatten_parameters else f"_fsdp_shard_{k}"
            self.register_parameter(g.shard_name, g.shard)
            for loc in g.locations:
                for sub, attr in loc:
                    del sub._parameters[attr]
                    object.__setattr__(sub, attr, None)
            self._groups.append(g)

    # ---- forward / backward -------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        """Attributes this wrapper lacks come from the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fsdp_wrapped_module":
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> nn.Module:
        return self._fsdp_wrapped_module.__getitem__(key)

    @property
    def sharded_params(self) -> List[nn.Parameter]:
        return [g.shard for g in self._groups]

    def _gather(self, after: Optional[torch.Tensor] = None) -> List[List[torch.Tensor]]:
        """The full parameters, per group (differentiable when grad mode is on). `after`:
        a re-gather in the backward, ordered after that tensor (the output's gradient)."""
        out = []
        if after is not None and not self.optimization_barrier_in_backward:
            after = None
        for gi, g in enumerate(self._groups):
            s = g.shard
            if torch.is_grad_enabled() and g.requires_grad:
                full = _AllGather.apply(s, self, after, gi)  # casts to compute_dtype inside
            else:
                s = s.detach() if s.dtype == self.compute_dtype else s.detach().to(self.compute_dtype)
                x = s if after is None else _coll.optimization_barrier([s, after])[0]
                full = _coll.all_gather(x, 0, self.sharding_groups)
            if g.dim0:
                out.append([full[:g.sizes[0][0]]])
            else:
                parts = full[:sum(g.numels)].split(g.numels)
                out.append([t.view(sz) for t, sz in zip(parts, g.sizes)])
        return out

    def _install(self, fulls: Optional[List[List[torch.Tensor]]]) -> None:
        for gi, g in enumerate(self._groups):
            for pi, loc in enumerate(g.locations):
                v = None if fulls is None else fulls[gi][pi]
                for sub, attr in loc:
                    object.__setattr__(sub, attr, v)

    def _pack(self, t: torch.Tensor):
        hit = self._full_ids.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        return t

    def _unpack(self, x):
        if isinstance(x, _Saved):
            if self._regathered is None:
                self._regathered = self._gather()
            return self._regathered[x.group][x.index]
        return x

    def _pre_backward(self, grad: torch.Tensor) -> None:
        """The first gradient of an output: re-gather what the backward needs, after it."""
        if self._in_backward:
            return
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)
        if self._resharded or self._checkpointed:
            # Checkpointed submodules run their forward again: they need the parameters
            # installed, with their gradients flowing to the shards.
            with torch.set_grad_enabled(self._checkpointed):
                self._regathered = self._gather(after=grad.detach())
            if self._checkpointed:
                self._install(self._regathered)

    def _post_backward(self) -> None:
        if self._checkpointed:
            self._install(None)
        self._regathered = None
        self._in_backward = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        root = _depth() == 0
        if self.compute_dtype != torch.float32:
            args, kwargs = _cast_floats((args, kwargs), self.compute_dtype)
        fulls = self._gather()
        self._install(fulls)
        reshard = (self.reshard_after_forward and torch.is_grad_enabled()
                   and not (root and self.disable_reshard_on_root))
        _tls.depth = _depth() + 1
        try:
            self._resharded, self._regathered, self._in_backward = reshard, None, False
            if reshard:
                self._full_ids = {id(t): (t, _Saved(gi, pi)) for gi, ts in enumerate(fulls) for pi, t in enumerate(ts)}
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    out = self.module(*args, **kwargs)
            else:
                out = self.module(*args, **kwargs)
        finally:
            _tls.depth = _depth() - 1
            self._full_ids = {}
            self._install(None)  # autograd keeps what the backward needs; nothing else does
        if torch.is_grad_enabled() and (reshard or self._checkpointed):
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(self._pre_backward)
        return out

    # ---- utilities ------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of the backward passes run inside are not reduced over the replicas:
        each wrapper keeps them whole (as much memory as the full parameters) and adds
        them to the gradient of the first backward after the context, which reduces the
        sum. For gradient accumulation without a reduce-scatter per micro-batch."""
        wrappers = [m for m in self.modules() if isinstance(m, XlaFullyShardedDataParallel)]
        before = [m._sync_grads for m in wrappers]
        for m in wrappers:
            m._sync_grads = False
        try:
            yield
        finally:
            for m, b in zip(wrappers, before):
                m._sync_grads = b

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, groups=None) -> torch.Tensor:
        """Clips the gradients of all shards (this wrapper and nested ones) by their global
        norm over the replicas; returns that norm."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm_type = float(norm_type)
        groups = groups if groups is not None else self.sharding_groups
        if not grads:
            return torch.zeros((), device=self.xla_device)
        if norm_type == float("inf"):
            local = torch.stack([g.detach().abs().max().float() for g in grads]).max()
            total = _coll.all_reduce("max", local, groups=groups)
        else:
            local = torch.stack([g.detach().float().norm(norm_type) ** norm_type for g in grads]).sum()
            total = _coll.all_reduce("sum", local, groups=groups) ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def get_shard_metadata(self) -> Dict[str, Any]:
        """What `consolidate_sharded_model_checkpoints` needs besides `state_dict()`."""
        shard_info, buffer_info = {}, {}
        for prefix, m in self.named_modules():
            if isinstance(m, XlaFullyShardedDataParallel):
                shard_info[prefix] = {
                    g.shard_name: {"_orig_names": list(g.names), "_orig_sizes": [torch.Size(s) for s in g.sizes],
                                   "_dim0": g.dim0}
                    for g in m._groups}
                mod_prefix = prefix + "._fsdp_wrapped_module." if prefix else "_fsdp_wrapped_module."
                for name, dt in m._buffer_info.items():
                    buffer_info[mod_prefix + name] = {"_orig_dtype": dt}
        return {"shard_info": shard_info, "buffer_info": buffer_info, "world_size": self.world_size,
                "rank": self.rank}

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, rank={self.rank}, flatten_parameters={self.flatten_parameters}, "
                f"reshard_after_forward={self.reshard_after_forward}, compute_dtype={self.compute_dtype}")


def _tensors(x) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _cast_floats(x, dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, tuple):
        return tuple(_cast_floats(v, dtype) for v in x)
    if isinstance(x, list):
        return [_cast_floats(v, dtype) for v in x]
    if isinstance(x, dict):
        return {k: _cast_floats(v, dtype) for k, v in x.items()}
    return x
