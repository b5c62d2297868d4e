"""`scan`: a function applied along the leading dimension of its inputs, compiled once.

`scan(fn, init, xs)` computes what this loop computes::

    carry = init
    for i in range(len(xs)):
        carry, y_i = fn(carry, xs[i])
    return carry, stack(y_0, y_1, ...)

but `fn` is traced once and the loop is one XLA `while` on the device (`lax.scan`), so
compile time does not grow with the number of iterations. `carry`, `xs` and the `y`s are
pytrees of xla tensors. Gradients flow through the scan: `fn` is split into a forward
and a backward graph by AOTAutograd with `partition_fn` (which decides which activations
the forward saves and which the backward recomputes), and the backward is a reverse scan
over the saved activations.

`fn` must be a function of its arguments: a tensor it reads or modifies must reach it
through `init` or `xs` (an AssertionError says so otherwise), and it must not modify its
inputs in place. With `is_fn_pure=True` (the default) its traced graphs are cached, keyed by
the function, the partition function and the inputs' shapes, dtypes and structure.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, List, Tuple, TypeVar

import torch
from functorch.compile import aot_function, default_partition, make_boxed_func
from torch.utils._pytree import PyTree, tree_flatten, tree_iter, tree_unflatten

from .._engine import subgraph

Carry = TypeVar("Carry")
X = TypeVar("X")
Y = TypeVar("Y")

# fn -> {(partition function id, avals and structure): (forward, alias_input, backward)}
_SCAN_COMPUTATION_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# forward -> the traced bodies of that entry (`_Bodies`)
_BODIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def scan(fn: Callable[[Carry, X], Tuple[Carry, Y]], init: Carry, xs: X,
         partition_fn: Callable = default_partition, is_fn_pure: bool = True) -> Tuple[Carry, Y]:
    """Applies `fn(carry, x) -> (new_carry, y)` over the leading dimension of `xs`.

    Args:
      fn: the step function; `new_carry` must have the structure, shapes and dtypes of
        `carry`. `y` may be any pytree of tensors (or None).
      init: the initial carry (a pytree of xla tensors).
      xs: a pytree of xla tensors scanned along dimension 0 (all of the same length).
      partition_fn: AOTAutograd's partitioner of `fn`'s joint forward/backward graph,
        e.g. `functorch.compile.min_cut_rematerialization_partition` to recompute cheap
        activations in the backward instead of saving them.
      is_fn_pure: cache the traced graphs of `fn` (it depends only on its arguments).

    Returns:
      `(final_carry, ys)`: `ys` stacks the `y`s along a new leading dimension.
    """
    if not callable(fn):
        raise ValueError(f"`fn` {fn} must be callable")
    flat_init, init_spec = tree_flatten(init)
    flat_xs, xs_spec = tree_flatten(xs)
    _check_inputs(flat_init, flat_xs)
    length = flat_xs[0].shape[0]
    forward, alias_input, backward = value_and_grad_partitioned(fn, init, xs, partition_fn, is_fn_pure)
    bodies: _Bodies = _BODIES[forward]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in flat_init + flat_xs)
    if needs_grad:
        outs = _Scan.apply(bodies, length, *flat_init, *flat_xs)
    else:
        outs = _scan_forward(bodies.inference(), length, flat_init, flat_xs)
    nc = len(flat_init)
    carry = tree_unflatten(list(outs[:nc]), init_spec)
    ys = bodies.ys_unflatten(list(outs[nc:nc + bodies.n_y]))
    return carry, ys


def _check_inputs(flat_init: list, flat_xs: list) -> None:
    if not flat_xs:
        raise ValueError("`xs` must contain at least one tensor to scan over")
    for t in flat_init + flat_xs:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"`init` and `xs` must be pytrees of tensors, got a {type(t).__name__}")
        if t.device.type != "xla":
            raise ValueError(f"scan runs on xla tensors; got a tensor on {t.device}")
    lengths = {t.shape[0] if t.dim() else None for t in flat_xs}
    if None in lengths:
        raise ValueError("every tensor of `xs` needs a leading dimension to scan over; got a 0-d tensor")
    if len(lengths) != 1:
        raise ValueError(f"all tensors of `xs` must have the same leading dimension; got lengths {sorted(lengths)}")


def tree_flatten_none(pytree: PyTree) -> Tuple[list, Callable[[list], PyTree]]:
    """Flattens `pytree` into its non-None leaves; returns them and the function that puts
    such a list back in the tree (with its Nones)."""
    leaves, spec = tree_flatten(pytree)
    present = [v is not None for v in leaves]

    def unflatten(flat: list) -> PyTree:
        it = iter(flat)
        return tree_unflatten([next(it) if p else None for p in present], spec)

    return [v for v in leaves if v is not None], unflatten


def _aval(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype)


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


class _Bodies:
    """What a cache entry keeps besides its three functions: counts, the structure of
    the outputs, and the traced bodies (each traced at its first use)."""

    def __init__(self, forward_flat, backward_flat, carry_avals, x_avals, n_y, ys_unflatten, n_partial,
                 aliases, out_diff):
        self.forward_flat = forward_flat      # (*carry, *x) -> (*new_carry, *y, *partial activations)
        self.backward_flat = backward_flat    # (*grad carry, *grad y, *activations) -> (*grad carry, *grad x)
        self.carry_avals = carry_avals
        self.x_avals = x_avals                # of one slice
        self.n_y = n_y
        self.ys_unflatten = ys_unflatten
        self.n_partial = n_partial
        self.aliases = aliases                # activation position -> x input position
        self.out_diff = out_diff              # per (new_carry + y) output: differentiable
        self._fwd = self._inf = self._bwd = None

    def forward(self) -> subgraph.Subgraph:
        if self._fwd is None:
            self._fwd = subgraph.trace(self.forward_flat, self.carry_avals + self.x_avals)
            self._check_carry(self._fwd)
        return self._fwd

    def inference(self) -> subgraph.Subgraph:
        if self._inf is None:
            n = len(self.carry_avals) + self.n_y
            self._inf = subgraph.trace(lambda *a: self.forward_flat(*a)[:n], self.carry_avals + self.x_avals)
            self._check_carry(self._inf)
        return self._inf

    def backward(self, act_avals: List[tuple]) -> subgraph.Subgraph:
        if self._bwd is None:
            nc = len(self.carry_avals)
            y_avals = self.forward().out_avals[nc:nc + self.n_y]
            grads = [a for a in self.carry_avals + y_avals if _differentiable(a[1])]
            self._bwd = subgraph.trace(self.backward_flat, grads + act_avals, seeded=False)
        return self._bwd

    def _check_carry(self, sub: subgraph.Subgraph) -> None:
        got = sub.out_avals[:len(self.carry_avals)]
        for k, (a, b) in enumerate(zip(self.carry_avals, got)):
            if a != b:
                raise ValueError(f"scan: `fn` must return a carry of the same shapes and dtypes as its input; "
                                 f"carry leaf {k} is {list(a[0])} {a[1]} in and {list(b[0])} {b[1]} out")


def value_and_grad_partitioned(fn: Callable[[Carry, X], Tuple[Carry, Y]], init: Carry, xs: X,
                               partition_fn: Callable = default_partition,
                               is_fn_pure: bool = True) -> Tuple[Callable, Callable, Callable]:
    """Traces `fn` into a forward and a backward graph (AOTAutograd, split by `partition_fn`).

    Returns `(forward, alias_input, backward)`:
      `forward(carry, x) -> (new_carry, (y, partial_activations))`;
      `alias_input(partial_activations, x) -> activations`: puts back the activations that
      are inputs of `x` (the scan saves those from `xs` itself instead of stacking copies);
      `backward(grad_new_carry, (grad_y, activations)) -> (grad_carry, grad_x)`.
    `xs` is stacked (the functions take one slice). Cached per `fn` when `is_fn_pure`.
    """
    flat_init, init_spec = tree_flatten(init)
    flat_xs, xs_spec = tree_flatten(xs)
    carry_avals = [_aval(t) for t in flat_init]
    x_avals = [(tuple(t.shape[1:]), t.dtype) for t in flat_xs]
    key = (id(partition_fn), tuple(carry_avals), tuple(x_avals), init_spec, xs_spec)
    if is_fn_pure:
        entry = _SCAN_COMPUTATION_CACHE.get(fn, {}).get(key)
        if entry is not None:
            return entry
    nc, nx = len(flat_init), len(flat_xs)
    traced = {}

    def flat_fn(*flat):
        carry = tree_unflatten(list(flat[:nc]), init_spec)
        x = tree_unflatten(list(flat[nc:]), xs_spec)
        out = fn(carry, x)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ValueError(f"scan: `fn` must return a pair (new_carry, y); got {type(out).__name__}")
        new_carry, y = out
        new_flat, new_spec = tree_flatten(new_carry)
        if new_spec != init_spec:
            raise ValueError(f"scan: `fn` must return a carry of the same structure as `init`: {init_spec} "
                             f"in, {new_spec} out")
        y_flat, y_unflatten = tree_flatten_none(y)
        traced["y"] = (len(y_flat), y_unflatten)
        inputs = {id(t) for t in flat}
        # an output that is an input is returned as a copy: AOTAutograd treats aliases specially
        return tuple(v.clone() if id(v) in inputs else v for v in new_flat + y_flat)

    graphs = {}

    def grab(name):
        def compiler(gm, _example):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    with torch.enable_grad():
        example = [torch.empty(s, dtype=d, device=t.device, requires_grad=_differentiable(d))
                   for (s, d), t in zip(carry_avals + x_avals, flat_init + flat_xs)]
        compiled = aot_function(flat_fn, fw_compiler=grab("fw"), bw_compiler=grab("bw"), partition_fn=partition_fn)
        try:
            outs = compiled(*example)
        except AssertionError as e:
            if "FakeTensor" not in str(e):
                raise
            raise AssertionError(f"scan: `fn` uses a tensor it was not given (it is traced with FakeTensors): pass "
                                 f"the tensors it reads or modifies through `init` or `xs`. {e}") from None
        diff = [o.requires_grad for o in outs]
        if any(diff):
            torch.autograd.backward([o for o, d in zip(outs, diff) if d],
                                    [torch.ones_like(o) for o, d in zip(outs, diff) if d])
        # per output of a differentiable dtype: whether the backward graph takes its gradient
        takes_grad = [o.requires_grad for o in outs if _differentiable(o.dtype)]
        del outs, example
    n_y, ys_unflatten = traced["y"]
    n_out = nc + n_y
    fw_gm, bw_gm = graphs["fw"], graphs.get("bw")
    aliases = _input_aliases(fw_gm, nc, n_out)
    n_act = _n_outputs(fw_gm) - n_out

    def forward_flat(*flat):
        out = fw_gm(*flat)
        acts = out[n_out:]
        return tuple(out[:n_out]) + tuple(v for k, v in enumerate(acts) if k not in aliases)

    def backward_flat(*flat):
        # flat: the gradients of the outputs of differentiable dtypes, then the activations
        n_g = len(takes_grad)
        gs, acts = list(flat[:n_g]), list(flat[n_g:])
        tangents = [g for g, t in zip(gs, takes_grad) if t]
        grads = bw_gm(*acts, *tangents) if bw_gm is not None else [None] * (nc + nx)
        out = []
        for g, (s, d) in zip(grads, carry_avals + x_avals):
            if _differentiable(d):
                out.append(torch.zeros(s, dtype=d, device="xla") if g is None else g)
        return tuple(out)

    def forward(carry, x):
        fc, _ = tree_flatten(carry)
        fx, _ = tree_flatten(x)
        out = forward_flat(*fc, *fx)
        new_carry = tree_unflatten(list(out[:nc]), init_spec)
        y = ys_unflatten(list(out[nc:n_out]))
        return new_carry, (y, tuple(out[n_out:]))

    def alias_input(partial_activations, x):
        fx, _ = tree_flatten(x)
        acts, it = [], iter(partial_activations)
        for k in range(n_act):
            acts.append(fx[aliases[k]] if k in aliases else next(it))
        return tuple(acts)

    def backward(grad_carry, grad_y_and_activations):
        grad_y, activations = grad_y_and_activations
        gc, _ = tree_flatten(grad_carry)
        gy, _ = tree_flatten_none(grad_y)
        tangents = [g for g, d in zip(list(gc) + list(gy), diff) if d]
        grads = bw_gm(*activations, *tangents) if bw_gm is not None else [None] * (nc + nx)
        return (tree_unflatten(list(grads[:nc]), init_spec), tree_unflatten(list(grads[nc:]), xs_spec))

    entry = (forward, alias_input, backward)
    _BODIES[forward] = _Bodies(forward_flat, backward_flat, carry_avals, x_avals, n_y, ys_unflatten,
                               n_act - len(aliases), aliases, diff)
    if is_fn_pure:
        _SCAN_COMPUTATION_CACHE.setdefault(fn, {})[key] = entry
    return entry


def _n_outputs(gm) -> int:
    return len(next(n for n in gm.graph.nodes if n.op == "output").args[0])


def _input_aliases(fw_gm, nc: int, n_out: int) -> dict:
    """Saved activations that are `x` inputs themselves: activation position -> x position."""
    placeholders = [n for n in fw_gm.graph.nodes if n.op == "placeholder"]
    outputs = next(n for n in fw_gm.graph.nodes if n.op == "output").args[0]
    aliases = {}
    for k, v in enumerate(outputs[n_out:]):
        if isinstance(v, torch.fx.Node) and v.op == "placeholder":
            pos = placeholders.index(v)
            if pos >= nc:
                aliases[k] = pos - nc
    return aliases


def _scan_forward(body: subgraph.Subgraph, length: int, flat_init: list, flat_xs: list,
                  reverse: bool = False) -> List[torch.Tensor]:
    """The scan node of `body` over `flat_xs`: final carry, then the stacked outputs."""
    nc = len(flat_init)
    extra = subgraph.outer_operands(body)
    salt = 0
    if body.seeded:
        from .._engine import rng
        salt = rng.next_op()[1]
        extra.append(subgraph.seed_operand())
    spec = subgraph.Spec([body], n_carry=nc, n_x=len(flat_xs), length=length, reverse=reverse, salt=salt)
    out_avals = body.out_avals[:nc] + [((length,) + tuple(s), d) for s, d in body.out_avals[nc:]]
    return subgraph.apply("xla::scan", list(flat_init) + list(flat_xs), extra, spec, out_avals)


class _Scan(torch.autograd.Function):
    """The differentiable scan: the forward scan saves the activations, the backward is a
    reverse scan of the backward graph over them."""

    @staticmethod
    def forward(ctx, bodies: _Bodies, length: int, *flat):
        nc = len(bodies.carry_avals)
        flat_init, flat_xs = flat[:nc], flat[nc:]
        fwd = bodies.forward()
        outs = _scan_forward(fwd, length, flat_init, flat_xs)
        n = nc + bodies.n_y
        result, partial = outs[:n], outs[n:]
        ctx.bodies, ctx.length = bodies, length
        ctx.n_partial = len(partial)
        ctx.save_for_backward(*partial, *flat_xs)
        ctx.mark_non_differentiable(*[o for o in result if not _differentiable(o.dtype)])
        return tuple(result)

    @staticmethod
    def backward(ctx, *grads):
        bodies = ctx.bodies
        saved = ctx.saved_tensors
        partial, flat_xs = saved[:ctx.n_partial], saved[ctx.n_partial:]
        it = iter(partial)
        n_act = ctx.n_partial + len(bodies.aliases)
        acts = [flat_xs[bodies.aliases[k]] if k in bodies.aliases else next(it) for k in range(n_act)]
        nc = len(bodies.carry_avals)
        fwd = bodies.forward()
        out_avals = fwd.out_avals[:nc] + [((ctx.length,) + tuple(s), d) for s, d in fwd.out_avals[nc:nc + bodies.n_y]]
        g = []
        for grad, (s, d) in zip(grads, out_avals):
            if _differentiable(d):
                g.append(torch.zeros(s, dtype=d, device="xla") if grad is None else grad)
        ngc = sum(_differentiable(d) for _, d in bodies.carry_avals)
        act_avals = [(tuple(a.shape[1:]), a.dtype) for a in acts]
        bwd = bodies.backward(act_avals)
        outs = _scan_forward(bwd, ctx.length, g[:ngc], g[ngc:] + acts, reverse=True)
        n_gc = sum(_differentiable(d) for _, d in bodies.carry_avals)
        grad_init, grad_xs = iter(outs[:n_gc]), iter(outs[n_gc:])
        result: List[Any] = [None, None]
        for _, d in bodies.carry_avals:
            result.append(next(grad_init) if _differentiable(d) else None)
        for _, d in bodies.x_avals:
            result.append(next(grad_xs) if _differentiable(d) else None)
        return tuple(result)


__all__ = ["scan", "value_and_grad_partitioned", "tree_flatten_none", "tree_iter"]
