"""Jax functions called on xla tensors inside the lazy graph (`xla_builder.call_jax`).

A call is one IR node (`xla::call_jax`, `torch_xla/_engine/lowering/jax_call.py`) whose
static argument is a `JaxFunction`: the function traced once per input structure, avals,
static leaves, name and jax configuration, kept in `_JAX_TO_XLA_COMPUTATION_CACHE`.
`call_jax_flat` / `jax_function` + `apply_jax_function` are the entry for code that
has a jax function of flat arrays (with its vjp as the backward).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from .._engine import pjrt
from .._engine.kernels import engine_op
from .._engine.lowering import jax_call
from .._engine.lowering.jax_call import differentiable

# One entry per trace of a jax function: (function or override_hash, input tree, static
# leaves, name, input avals, jax trace context) -> its `JaxFunction`.
_JAX_TO_XLA_COMPUTATION_CACHE: Dict[tuple, Any] = {}


class _TensorSlot:
    """Marks where a tensor sits among a call's static leaves."""
    __slots__ = ()

    def __repr__(self):
        return "<tensor>"


_TENSOR = _TensorSlot()


def _jax_to_xla_computation_cache_elements() -> int:
    """How many traces of jax functions the cache holds (one per miss since it was last cleared)."""
    return len(_JAX_TO_XLA_COMPUTATION_CACHE)


def _xla_aval(t, what: str, i: int) -> tuple:
    """(shape, device dtype) of xla tensor `t`, argument `i` of `what`."""
    if not isinstance(t, torch.Tensor) or t.device.type != "xla":
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"xla:{pjrt.device_index()} and {where}! (when checking argument {i} for {what})")
    return tuple(t.shape), pjrt.device_dtype(t.dtype)


def jax_function(flat_fn: Callable, in_avals: Sequence[Tuple[tuple, Any]], key: Hashable, name: str):
    """The `JaxFunction` (`torch_xla/_engine/lowering/jax_call.py`) of `flat_fn` for these
    input avals ((shape, numpy dtype) each) under the jax configuration in force, traced on
    the first call for them and then taken from `_JAX_TO_XLA_COMPUTATION_CACHE`.

    `flat_fn(*arrays)` returns a pytree of arrays; `key` identifies it (a function object
    compares by identity: a closure made anew at each call would be traced each time).
    The result's `out_avals` and `out_tree` describe its outputs."""
    ctx = jax_call.trace_context()
    full = (key, tuple(in_avals), name, ctx)
    try:
        fn = _JAX_TO_XLA_COMPUTATION_CACHE.get(full)
    except TypeError as e:
        raise TypeError(f"call_jax: every non-tensor argument is part of the cache key and must be "
                        f"hashable: {e}") from None
    if fn is None:
        fn = _JAX_TO_XLA_COMPUTATION_CACHE[full] = jax_call.JaxFunction(flat_fn, in_avals, full, name, ctx)
    return fn


def apply_jax_function(fn, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Applies a `JaxFunction` to xla tensors as one IR node: its flat outputs as tensors.

    Differentiable: when grad mode is on and an input requires grad, the call records a
    backward that is another such node, `fn.vjp(...)` (twice differentiable the same way)."""
    tensors = list(tensors)
    avals = tuple(_xla_aval(t, fn.name, i) for i, t in enumerate(tensors))
    if avals != fn.in_avals:
        raise ValueError(f"{fn.name}: inputs {list(avals)} do not match the avals it was traced for, "
                         f"{list(fn.in_avals)}")
    return _apply(fn, tensors)


def call_jax_flat(flat_fn: Callable, tensors: Sequence[torch.Tensor], *, key: Optional[Hashable] = None,
                  name: Optional[str] = None) -> List[torch.Tensor]:
    """`flat_fn(*arrays)` (a jax function of one array per tensor) applied to xla tensors
    inside the lazy graph: its outputs as a flat list of tensors (`jax.tree.leaves` order).

    Traced once per key (`key`, else `flat_fn` itself), input avals, `name` and jax
    configuration (`jax_function`); differentiable (`apply_jax_function`). `name` (default:
    the function's name) scopes its operations in the program."""
    tensors = list(tensors)
    avals = [_xla_aval(t, "call_jax_flat", i) for i, t in enumerate(tensors)]
    name = name or getattr(flat_fn, "__name__", None) or "jax_func"
    return _apply(jax_function(flat_fn, avals, flat_fn if key is None else key, name), tensors)


def _apply(fn, tensors: list) -> List[torch.Tensor]:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_JaxCall.apply(fn, *tensors))
    return _jax_node(fn, tensors)


def _jax_node(fn, tensors) -> List[torch.Tensor]:
    # No autograd op runs here (the node only reads the inputs' lazy values), so the inputs
    # need no detaching.
    return engine_op("xla::call_jax", tensors, (fn,), fn.out_torch)


class _JaxCall(torch.autograd.Function):
    """A `JaxFunction` node whose backward is the node of its vjp."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        outs = _jax_node(fn, tensors)
        ctx.fn = fn
        ctx.save_for_backward(*tensors)
        ctx.mark_non_differentiable(*[o for o, (_, d) in zip(outs, fn.out_avals) if not differentiable(d)])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *cts):
        fn = ctx.fn
        primals = ctx.saved_tensors
        # An input the outputs do not depend on gets no gradient (None), as PyTorch gives
        # an input its function never used.
        diff_in = tuple(bool(need and used and differentiable(d))
                        for need, used, (_, d) in zip(ctx.needs_input_grad[1:], fn.used, fn.in_avals))
        if not any(diff_in):
            return (None,) * (1 + len(primals))
        diff_out = tuple(differentiable(d) for _, d in fn.out_avals)
        cts = [c for c, m in zip(cts, diff_out) if m]
        vjp = fn.vjp(diff_in, diff_out)
        # the backward's trace is an entry of the cache too (counted as the original counts lowerings)
        _JAX_TO_XLA_COMPUTATION_CACHE.setdefault(vjp.key, vjp)
        grads = iter(_apply(vjp, list(primals) + cts))
        return (None,) + tuple(next(grads) if m else None for m in diff_in)


def call_jax(jax_func: Callable, args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None,
             name: Optional[str] = None, override_hash: Optional[Hashable] = None) -> Any:
    """Calls jax function `jax_func(*args, **kwargs)` inside the lazy graph.

    Tensors anywhere in the pytree of `args` and `kwargs` (jax's pytrees) must be xla
    tensors; the function receives them as jax arrays of their device dtype. Every other
    leaf (numbers, strings, dtypes; torch dtypes become numpy ones) is passed as it is and
    is part of the cache key, so it must be hashable. The call is one IR node; its outputs
    come back as the same pytree with xla tensors for arrays. Differentiable when an input
    requires grad (the backward is the node of `jax.vjp`).

    The function is traced when it is first called with a given input structure, input
    shapes and dtypes, static leaves, `name` and jax configuration (e.g.
    `jax_default_matmul_precision`, which then applies to that call however late its graph
    is compiled); later such calls reuse the trace and keep the graph's compiled program.
    The cache keys on the function object: a function defined anew at every step is
    traced at every step unless `override_hash` names it instead.
    `name` (default: the function's name) scopes its operations in the program (HLO
    `op_name` metadata, profiles).

    Example::

        def f(a, b):
            import jax.numpy as jnp
            return a + jnp.sin(b)

        a = torch.ones((3, 3), device='xla')
        b = xb.call_jax(f, (a, a))   # torch.sin(a) + a, computed by jax in the graph
    """
    jax = pjrt.jax_module()
    kwargs = kwargs or {}
    leaves, treedef = jax.tree.flatten((args, kwargs))
    tx = sys.modules.get("torchax")
    if tx is not None and any(isinstance(x, tx.tensor.Tensor) for x in leaves):
        return tx.interop.call_jax(jax_func, *args, **kwargs)
    tensors, statics, avals = [], [], []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            avals.append(_xla_aval(x, "call_jax", len(statics)))
            tensors.append(x)
            statics.append(_TENSOR)
        else:
            statics.append(pjrt.numpy_dtype(x) if isinstance(x, torch.dtype) else x)
    # The type too: 1, 1.0 and True are equal keys but trace differently.
    static_key = tuple(s if s is _TENSOR else (type(s), s) for s in statics)
    key = (jax_func if override_hash is None else override_hash, treedef, static_key)
    name = name or getattr(jax_func, "__name__", None) or "jax_func"

    def flat_fn(*arrays):
        it = iter(arrays)
        a, kw = jax.tree.unflatten(treedef, [next(it) if s is _TENSOR else s for s in statics])
        return jax_func(*a, **kw)

    fn = jax_function(flat_fn, avals, key, name)
    return jax.tree.unflatten(fn.out_tree, _apply(fn, tensors))
