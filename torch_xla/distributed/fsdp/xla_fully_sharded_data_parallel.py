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

`coalesce_all_gather_ops` gathers all of a wrapper's shards with one (coalesced)
all-gather; `reduce_scatter_bucket_size_mb` collects the gradients of several shards
until they exceed that size and reduce-scatters them as one concatenated tensor (the
rest at the end of the backward). Arguments of PyTorch/XLA's implementation that cannot
change anything here warn once per process when given a non-default value.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ... import _api, runtime as xr
from ..._engine import comm as _coll, executor, ir
from ..._engine.tensor import state_of
from .utils import apply_xla_patch_to_nn_linear
from .wrap import recursive_wrap

__all__ = ["XlaFullyShardedDataParallel"]

_tls = threading.local()

# Arguments already warned about (once per argument per process).
_WARNED = set()


def _no_effect(arg: str, value: Any, why: str) -> None:
    if arg not in _WARNED:
        _WARNED.add(arg)
        warnings.warn(f"XlaFullyShardedDataParallel: {arg}={value!r} has no effect here: {why}", UserWarning,
                      stacklevel=3)


_DEBUG_DEFAULTS = {"_debug_dummy_forward_pass": False, "_debug_msg": "xla_fsdp", "_debug_print": False,
                   "_debug_dummy_all_gather_op": False, "_debug_dummy_all_reduce_op": False,
                   "_debug_dummy_reduce_scatter_op": False, "_debug_dummy_optimization_barrier_op": False}


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
        return fsdp._gather_shards([group], [shard], after, fsdp.optimization_barrier_in_forward)[0]

    @staticmethod
    def backward(ctx, grad):
        return ctx.fsdp._reduce_grad(ctx.group, grad, ctx.dtype), None, None, None


class _AllGatherCoalesced(torch.autograd.Function):
    """Every shard of a wrapper -> padded full values by one coalesced all-gather; the
    gradients go the way `_AllGather`'s do, shard by shard."""

    @staticmethod
    def forward(ctx, fsdp, after, *shards):
        ctx.fsdp = fsdp
        ctx.dtypes = [s.dtype for s in shards]
        ctx.set_materialize_grads(False)  # an unused parameter keeps no gradient, as with _AllGather
        outs = fsdp._gather_shards(list(range(len(shards))), list(shards), after,
                                   fsdp.optimization_barrier_in_forward)
        frozen = [o for o, g in zip(outs, fsdp._groups) if not g.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        f = ctx.fsdp
        res = [None if g is None or not ctx.needs_input_grad[2 + i] else f._reduce_grad(i, g, ctx.dtypes[i])
               for i, g in enumerate(grads)]
        return (None, None, *res)


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
    within these replica groups (sharding_rank / sharding_world_size, when given, must
    agree with them). execute_sharding_on_init: compute the shards now, not at the next
    barrier; sync_on_finalization: `torch_xla.sync()` at the end of the root wrapper's
    backward; coalesce_all_gather_ops, reduce_scatter_bucket_size_mb: see the module
    docstring; _shard_size_multiple: pad each flattened shard to a multiple of this
    many elements and gather it as rows of that width (PyTorch/XLA uses 128 for TPU
    tiling; the default here, 1, pads only to the world size); _use_xla_patched_linear:
    patch `nn.Linear`s so that resharding can recognise their saved weights.
    pin_layout_in_collective_ops=False and the `_debug_*` switches warn once and change
    nothing. Unknown keyword arguments are a TypeError."""

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
                 param_init_fn: Optional[Callable[[nn.Module], None]] = None, _shard_size_multiple: int = 1,
                 _use_xla_patched_linear: bool = True, _debug_dummy_forward_pass: bool = False,
                 _debug_msg: str = "xla_fsdp", _debug_print: bool = False, _debug_dummy_all_gather_op: bool = False,
                 _debug_dummy_all_reduce_op: bool = False, _debug_dummy_reduce_scatter_op: bool = False,
                 _debug_dummy_optimization_barrier_op: bool = False):
        if isinstance(module, XlaFullyShardedDataParallel):
            raise RuntimeError("Cannot wrap a module that is already wrapped with FSDP. For nested FSDP, first wrap "
                               "the inner child modules before wrapping the outer parent module.")
        fwd = getattr(type(module), "forward", None)
        if fwd is None or fwd is nn.Module.forward:
            raise RuntimeError("The module wrapped by FSDP *must define a `forward` method*; do not wrap "
                               "`nn.ModuleList` or `nn.ModuleDict`.")
        debug = dict(_debug_dummy_forward_pass=_debug_dummy_forward_pass, _debug_msg=_debug_msg,
                     _debug_print=_debug_print, _debug_dummy_all_gather_op=_debug_dummy_all_gather_op,
                     _debug_dummy_all_reduce_op=_debug_dummy_all_reduce_op,
                     _debug_dummy_reduce_scatter_op=_debug_dummy_reduce_scatter_op,
                     _debug_dummy_optimization_barrier_op=_debug_dummy_optimization_barrier_op)
        for name, value in debug.items():
            if value != _DEBUG_DEFAULTS[name]:
                _no_effect(name, value, "a debugging switch of PyTorch/XLA's implementation (dummy "
                           "collectives, a dummy forward, trace prints), which this implementation does not have")
        if not pin_layout_in_collective_ops:
            _no_effect("pin_layout_in_collective_ops", pin_layout_in_collective_ops, _PIN_LAYOUT_WHY)
        bucket_mb = 0 if reduce_scatter_bucket_size_mb is None else reduce_scatter_bucket_size_mb
        if bucket_mb < 0:
            raise ValueError(f"reduce_scatter_bucket_size_mb must be >= 0, got {bucket_mb}")
        if int(_shard_size_multiple) != _shard_size_multiple or _shard_size_multiple < 1:
            raise ValueError(f"_shard_size_multiple must be a positive integer, got {_shard_size_multiple}")
        super().__init__()
        wrapper_kwargs = dict(
            reshard_after_forward=reshard_after_forward, flatten_parameters=flatten_parameters,
            execute_sharding_on_init=execute_sharding_on_init,
            optimization_barrier_in_forward=optimization_barrier_in_forward,
            optimization_barrier_in_backward=optimization_barrier_in_backward,
            sync_on_finalization=sync_on_finalization,
            disable_reshard_on_root=disable_reshard_on_root, compute_dtype=compute_dtype, buffer_dtype=buffer_dtype,
            fp32_reduce_scatter=fp32_reduce_scatter, sharding_groups=sharding_groups, sharding_rank=sharding_rank,
            sharding_world_size=sharding_world_size, shard_param_on_dim_0=shard_param_on_dim_0,
            pin_layout_in_collective_ops=pin_layout_in_collective_ops,
            reduce_scatter_bucket_size_mb=reduce_scatter_bucket_size_mb,
            coalesce_all_gather_ops=coalesce_all_gather_ops, param_init_fn=param_init_fn,
            _shard_size_multiple=_shard_size_multiple, _use_xla_patched_linear=_use_xla_patched_linear, **debug)
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
            # PyTorch/XLA takes both from the caller; here the groups decide, and values
            # that disagree with them would have sharded wrongly there.
            if sharding_world_size is not None and sharding_world_size != self.world_size:
                raise ValueError(f"sharding_world_size={sharding_world_size} but the sharding groups have "
                                 f"{self.world_size} replicas")
            if sharding_rank is not None and sharding_rank != self.rank:
                raise ValueError(f"sharding_rank={sharding_rank} but replica {me} is at position {self.rank} of "
                                 f"its sharding group {list(group)}")
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
        self.sync_on_finalization = sync_on_finalization
        self.coalesce_all_gather_ops = coalesce_all_gather_ops
        self._shard_size_multiple = 1 if shard_param_on_dim_0 else int(_shard_size_multiple)
        self._bucket_bytes = bucket_mb * 1024 * 1024
        self._bucket: List[Tuple[int, torch.Tensor, torch.dtype]] = []
        self._bucket_size = 0
        self._flush_queued = False
        self._sync_at_end = False
        self.xla_device = _api.device()
        if param_init_fn is not None and any(p.is_meta for p in module.parameters()):
            param_init_fn(module)
        params = [p for _, p in self._managed(module)]
        self.compute_dtype = compute_dtype or (params[0].dtype if params else torch.float32)
        self.buffer_dtype = buffer_dtype or self.compute_dtype
        if self.fp32_reduce_scatter and compute_dtype is None:
            raise ValueError("fp32_reduce_scatter requires compute_dtype")
        if _use_xla_patched_linear:
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
        if execute_sharding_on_init:
            # Compute the shards (and cast buffers) now, so the full values they were cut
            # from can be freed before the first step.
            held = [state_of(t) for t in [g.shard for g in self._groups] + list(module.buffers())
                    if t.device.type == "xla"]
            todo = [st for st in held if type(st.node) is not ir.DeviceData]
            if todo:
                executor.sync(states=todo)

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
        pad = (-flat.numel()) % (n * self._shard_size_multiple)
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

    def _gather_shards(self, gis: List[int], shards: List[torch.Tensor], after: Optional[torch.Tensor],
                       barrier: bool) -> List[torch.Tensor]:
        """The padded full values of the shards of groups `gis` (no autograd): cast to
        compute_dtype, behind one optimization barrier (ordered after `after` if given),
        all-gathered on dim 0 (one coalesced collective with coalesce_all_gather_ops)."""
        xs = [s if s.dtype == self.compute_dtype else s.to(self.compute_dtype) for s in shards]
        if after is not None:
            xs = _coll.optimization_barrier(xs + [after])[:-1]
        elif barrier:
            xs = _coll.optimization_barrier(xs)
        m = self._shard_size_multiple
        rows = [m > 1 and not self._groups[gi].dim0 for gi in gis]
        # Rows of the multiple's width: the layout PyTorch/XLA gathers for TPU tiling.
        xs = [x.view(-1, m) if r else x for x, r in zip(xs, rows)]
        if self.coalesce_all_gather_ops and len(xs) > 1:
            outs = _coll.all_gather(xs, 0, self.sharding_groups)
        else:
            outs = [_coll.all_gather(x, 0, self.sharding_groups) for x in xs]
        return [o.reshape(-1) if r else o for o, r in zip(outs, rows)]

    def _gather(self, after: Optional[torch.Tensor] = None) -> List[List[torch.Tensor]]:
        """The full parameters, per group (differentiable when grad mode is on). `after`:
        a re-gather in the backward, ordered after that tensor (the output's gradient)."""
        if after is not None and not self.optimization_barrier_in_backward:
            after = None
        groups = self._groups
        grad = torch.is_grad_enabled()
        if self.coalesce_all_gather_ops and len(groups) > 1:
            if grad and any(g.requires_grad for g in groups):
                fulls = list(_AllGatherCoalesced.apply(self, after, *[g.shard for g in groups]))
            else:
                fulls = self._gather_shards(list(range(len(groups))), [g.shard.detach() for g in groups], after,
                                            False)
        else:
            fulls = []
            for gi, g in enumerate(groups):
                if grad and g.requires_grad:
                    fulls.append(_AllGather.apply(g.shard, self, after, gi))
                else:
                    fulls.append(self._gather_shards([gi], [g.shard.detach()], after, False)[0])
        out = []
        for g, full in zip(groups, fulls):
            if g.dim0:
                out.append([full[:g.sizes[0][0]]])
            else:
                parts = full[:sum(g.numels)].split(g.numels)
                out.append([t.view(sz) for t, sz in zip(parts, g.sizes)])
        return out

    # ---- gradient reduction ---------------------------------------------------------------

    def _reduce_grad(self, gi: int, grad: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The shard gradient of group `gi` from the full one (averaged over the replicas),
        or None when it is held back: inside no_sync(), or collected into a bucket that
        writes `.grad` itself when it is reduced."""
        held = self._unsynced_grads.pop(gi, None)
        if held is not None:
            grad = grad + held
        if not self._sync_grads:
            # Inside no_sync(): keep the full gradient here, reduce it with a later one.
            self._unsynced_grads[gi] = grad
            return None
        if self.fp32_reduce_scatter and grad.dtype != torch.float32:
            grad = grad.float()
        if self._bucket_bytes:
            self._bucket_add(gi, grad, dtype)
            return None
        r = _coll.reduce_scatter("sum", grad, 1.0 / self.world_size, 0, self.world_size, self.sharding_groups)
        return r.to(dtype)

    def _bucket_add(self, gi: int, grad: torch.Tensor, dtype: torch.dtype) -> None:
        if self._bucket and self._bucket[0][1].dtype != grad.dtype:
            self._flush_bucket()  # one concatenation holds one dtype
        self._bucket.append((gi, grad, dtype))
        self._bucket_size += grad.numel() * grad.element_size()
        if not self._flush_queued:
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush_at_end)
        if self._bucket_size > self._bucket_bytes:
            self._flush_bucket()

    def _flush_at_end(self) -> None:
        self._flush_queued = False
        self._flush_bucket()

    @torch.no_grad()
    def _flush_bucket(self) -> None:
        """One reduce-scatter of the bucket's gradients, each seen as (world size, -1)
        rows and concatenated along the rows, so replica r receives the r-th row of every
        one: its shard of each. The shards' `.grad` accumulate the results."""
        bucket, self._bucket, self._bucket_size = self._bucket, [], 0
        if not bucket:
            return
        n = self.world_size
        mats = [g.reshape(n, -1) for _, g, _ in bucket]
        whole = mats[0] if len(mats) == 1 else torch.cat(mats, 1)
        r = _coll.reduce_scatter("sum", whole, 1.0 / n, 0, n, self.sharding_groups)
        parts = r.reshape(-1).split([m.shape[1] for m in mats])
        for (gi, _, dtype), part in zip(bucket, parts):
            shard = self._groups[gi].shard
            value = part.reshape(shard.shape).to(dtype, copy=True)
            if shard.grad is None:
                shard.grad = value
            else:
                shard.grad.add_(value)

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
        if self._sync_at_end:
            # The root's backward is over: reduce what the buckets still hold (theirs run
            # later in the queue), then one barrier before the optimizer's ops.
            for m in self.modules():
                if isinstance(m, XlaFullyShardedDataParallel):
                    m._flush_bucket()
            _api.sync()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        root = _depth() == 0
        if self.compute_dtype != torch.float32:
            args, kwargs = _cast_floats((args, kwargs), self.compute_dtype)
        fulls = self._gather()
        self._install(fulls)
        reshard = (self.reshard_after_forward and torch.is_grad_enabled()
                   and not (root and self.disable_reshard_on_root))
        self._sync_at_end = root and self.sync_on_finalization and torch.is_grad_enabled()
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
        if torch.is_grad_enabled() and (reshard or self._checkpointed or self._sync_at_end):
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
                f"reshard_after_forward={self.reshard_after_forward}, compute_dtype={self.compute_dtype}, "
                f"coalesce_all_gather_ops={self.coalesce_all_gather_ops}, "
                f"reduce_scatter_bucket_size_mb={self._bucket_bytes / (1024 * 1024):g}")


_PIN_LAYOUT_WHY = ("every replica runs the same compiled program, so the layouts of a collective's operands "
                   "agree on all replicas (what pinning guarantees) and no layout is constrained (what "
                   "unpinning would relax)")


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
