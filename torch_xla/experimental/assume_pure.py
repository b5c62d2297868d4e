"""`assume_pure`: a PyTorch function traced once, then replayed from its traced program.

Tracing a large function op by op costs host time at every step. A function that depends
only on its arguments can be traced once per input signature: `assume_pure(fn)` traces
`fn` on placeholders (`_engine/subgraph.py`) into a jax function, and every call, the
first included, applies that function as one node of the lazy graph through
`xla_builder.call_jax` machinery, so later calls cost the same whatever the size of `fn`.
Gradients come from jax's vjp of the traced function.

The signature is the tree structure of `(args, kwargs)`, the shapes and dtypes of its
tensors and the values of its other leaves. Tensors `fn` reads from elsewhere are taken
as they were at the trace; random numbers need `add_rng_seed_argument=True`, which adds a
keyword `rng_seed` (an int) deciding them.
"""
from __future__ import annotations

from functools import partial, wraps
from typing import Any, Callable, Dict, Hashable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._engine import ir, partitioning, subgraph
from .._engine.tensor import make_tensor, wrap_user
from ..core import _jax_call

# assume_pure_torch(use_cache=True): function name -> its traced subgraph
_XLA_COMPUTATION_CACHE: Dict[str, Any] = {}


def assume_pure(fn: Callable, *, add_rng_seed_argument: bool = False) -> Callable:
    """Decorates a function of xla tensors that depends only on its arguments: it is traced
    once per input signature and replayed afterwards (see the module docstring).

    `fn` may call other `assume_pure` functions, `xla_builder.call_jax` and
    `mark_sharding`. With `add_rng_seed_argument`, the returned function takes a
    keyword `rng_seed` (int): equal seeds give equal random numbers."""
    traced: Dict[Hashable, tuple] = {}

    @wraps(fn)
    def pure(*args, **kwargs):
        seed = None
        if add_rng_seed_argument:
            seed = kwargs.pop("rng_seed", None)
            assert seed is not None, "Missing keyword argument rng_seed."
        flat, spec = tree_flatten((args, kwargs))
        tensors, key = _split(flat, spec)
        entry = traced.get(key)
        if entry is None:
            entry = traced[key] = _trace(fn, flat, spec, add_rng_seed_argument)
        sub, jax_fn = entry
        inputs = tensors + [_leaf_tensor(p) for p in sub.outer]
        if sub.seeded:
            inputs.append(_leaf_tensor(ir.ScalarParam(int(seed), torch.int64)))
        outs = _jax_call.call_jax_flat(jax_fn, inputs, key=("assume_pure", sub.key, id(sub)),
                                       name=getattr(fn, "__name__", "assume_pure"))
        for out, sharding in zip(outs, sub.root_shardings()):
            if sharding is not None:   # mark_sharding inside: the result keeps the annotation
                partitioning.annotate(out, sharding)
        return sub.outputs(outs)

    return pure


def _split(flat: list, spec) -> tuple:
    """The tensor leaves, and the call's signature (structure, tensor avals, other leaves)."""
    tensors, sig = [], []
    for v in flat:
        if isinstance(v, torch.Tensor):
            if v.device.type != "xla":
                raise ValueError(f"assume_pure: tensor arguments must be xla tensors, got one on {v.device}")
            tensors.append(v)
            sig.append((tuple(v.shape), v.dtype))
        else:
            sig.append(("static", type(v), v))
    return tensors, (spec, tuple(sig))


def _trace(fn: Callable, flat: list, spec, seeded: bool) -> tuple:
    positions = [k for k, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    avals = [(tuple(flat[k].shape), flat[k].dtype) for k in positions]

    def build_args(ph):
        leaves = list(flat)
        for k, p in zip(positions, ph):
            leaves[k] = p
        args, kwargs = tree_unflatten(leaves, spec)
        return args, kwargs

    sub = subgraph.trace(lambda a, k: fn(*a, **k), avals, seeded=seeded, build_args=build_args)
    n, n_outer = sub.n_in, len(sub.outer)

    def jax_fn(*arrays):
        seed = arrays[n + n_outer] if sub.seeded else None
        return sub(list(arrays[:n]), list(arrays[n:n + n_outer]), seed)

    return sub, jax_fn


def _leaf_tensor(node) -> torch.Tensor:
    shape, dtype = node.avals[0]
    return wrap_user(make_tensor(node, 0, shape, dtype))


class PureModule(nn.Module):
    """A module whose forward depends only on its inputs, parameters and buffers, run as
    an `assume_pure` function of them: traced once per input signature."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._module = module
        self._pure_forward = assume_pure(partial(_functional_forward, module))

    def forward(self, *args, **kwargs):
        params = dict(self._module.named_parameters())
        buffers = dict(self._module.named_buffers())
        return self._pure_forward(params, buffers, args, kwargs)


def _functional_forward(module, params, buffers, args, kwargs):
    return torch.func.functional_call(module, (params, buffers), args, kwargs)


def assume_pure_torch(func: Callable, use_cache: bool = False) -> Callable:
    """Forward-only variant: `func` traced into one program node per call (with
    `use_cache`, traced once and cached under the function's name; the caller keeps the
    input shapes the same). Gradients are not supported: grad mode must be off."""
    assert not torch.is_grad_enabled(), "assume_pure_torch supports the forward pass only: disable grad mode"

    @wraps(func)
    def inner(*args, **kwargs):
        flat, spec = tree_flatten((args, kwargs))
        tensors, _ = _split(flat, spec)
        sub = _XLA_COMPUTATION_CACHE.get(func.__name__) if use_cache else None
        if sub is None:
            sub, _ = _trace(func, flat, spec, False)
            if use_cache:
                _XLA_COMPUTATION_CACHE[func.__name__] = sub
        spec_ = subgraph.Spec([sub])
        outs = subgraph.apply("xla::call_subgraph", tensors, subgraph.outer_operands(sub), spec_, sub.out_avals)
        return sub.outputs(outs)

    return inner
