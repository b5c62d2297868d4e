"""Dynamic dimensions: one graph with some sizes as symbols, from traces at several sizes.

The engine traces with concrete shapes (PyTorch's meta kernels). To export a program
whose input dimensions are symbols (`torch.export.Dim`), the same function is traced at
the example sizes, once more per symbol and per pair of symbols with those changed, and
once with all changed further. Every integer of the graph (a static argument of an op, a
dimension of a value, a Python scalar) that differs between the traces is fitted as a
polynomial with integer coefficients on 1, each symbol and each product of two (B*T of a
flattened batch) and checked against every trace. The graph is
then lowered with those integers as jax symbolic expressions (`jax.export`'s shape
polymorphism). A graph whose structure changes with the sizes, or whose sizes are not
of that form (a division, a square), is refused with the op that showed it; so is an op whose lowering cannot take a symbolic size.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from .. import ir, pjrt
from .graph import Graph
from .lower import lower_node


class DynamicShapeError(ValueError):
    pass


def _ints(x, out: list) -> None:
    """Appends the integers of a static argument tree (not booleans, not operand refs)."""
    t = type(x)
    if t is int:
        out.append(x)
    elif t is ir.Ref:
        return
    elif t is tuple or t is list:
        for e in x:
            _ints(e, out)


def _replace(x, it):
    t = type(x)
    if t is int:
        return next(it)
    if t is ir.Ref:
        return x
    if t is tuple or t is list:
        return t(_replace(e, it) for e in x)
    return x


def _skeleton(x):
    """The argument tree with its integers blanked (what must not change with sizes)."""
    t = type(x)
    if t is int:
        return 0
    if t is ir.Ref:
        return x
    if t is tuple or t is list:
        return t(_skeleton(e) for e in x)
    if isinstance(x, np.ndarray):
        return (x.shape, x.dtype.str)
    return x


def _tree(n) -> tuple:
    """What a node says with integers in it: its args, output shapes and, for a scalar
    parameter, its value."""
    avals = tuple(None if a is None else (tuple(a[0]), a[1]) for a in n.avals)
    return (getattr(n, "args", None), avals, n.value if type(n) is ir.ScalarParam else None)


def _node_items(n):
    """(skeleton, integers) of a node."""
    tree = _tree(n)
    ints: list = []
    _ints(tree, ints)
    if type(n) is ir.Constant:
        tree = tree + (np.asarray(n.value).tobytes(),)
    return _skeleton(tree), ints


class SymbolicGraph:
    """The base graph with each node's integers as symbolic expressions."""

    def __init__(self, graphs: Sequence[Graph], sizes: List[Dict[str, int]], symbols: Dict[str, object]):
        base, names = graphs[0], list(symbols)
        if any(len(g.order) != len(base.order) for g in graphs):
            raise DynamicShapeError("the traced graph changes with the dynamic sizes (its number of ops differs); "
                                    "export it with static shapes")
        self.graph = base
        self.items = {}      # id(node) -> (args, avals) with symbolic integers
        self.scalars = {}    # slot -> symbolic value of a Python scalar that follows the sizes
        slot_of = base.slot
        for k, n in enumerate(base.order):
            others = [g.order[k] for g in graphs]
            items = [_node_items(m) for m in others]
            skel = items[0][0]
            if any(type(m) is not type(n) or getattr(m, "op", None) != getattr(n, "op", None) or it[0] != skel
                   for m, it in zip(others, items)):
                raise DynamicShapeError(f"the traced graph changes with the dynamic sizes at "
                                        f"{getattr(n, 'op', type(n).__name__)}; export it with static shapes")
            columns = list(zip(*[it[1] for it in items]))
            if all(len(set(c)) == 1 for c in columns):
                continue
            if type(n) is ir.Constant:
                raise DynamicShapeError("a constant of the graph changes with the dynamic sizes; "
                                        "export it with static shapes")
            exprs = [_fit(c, sizes, names, symbols, getattr(n, "op", "a parameter")) for c in columns]
            args, avals, scalar = _replace(_tree(n), iter(exprs))
            self.items[id(n)] = (args, avals)
            if type(n) is ir.ScalarParam and scalar is not None and type(scalar) is not int:
                self.scalars[slot_of[id(n)]] = scalar
        for k, n in enumerate(base.order):
            if getattr(n, "op", None) in _SLICES:
                args = self.items.get(id(n), (n.args, n.avals))[0]
                opened = _open_slice_end(n.op, args, [g.order[k] for g in graphs])
                if opened is not None:
                    self.items[id(n)] = (opened, self.items.get(id(n), (None, n.avals))[1])

    def fn(self, n_out: int, constants: Dict[int, np.ndarray]):
        """params -> the first `n_out` roots, with the symbolic sizes (constants: slot ->
        host value compiled in)."""
        import jax.numpy as jnp
        g, items, scalars = self.graph, self.items, self.scalars

        def fn(*params):
            vals = {}
            for n in g.order:
                t = type(n)
                if t is ir.DeviceData or t is ir.ScalarParam:
                    s = g.slot[id(n)]
                    dt = pjrt.device_dtype(n.avals[0][1])
                    if s in scalars:
                        vals[id(n)] = (jnp.asarray(scalars[s]).astype(dt),)
                    elif s in constants:
                        vals[id(n)] = (jnp.asarray(np.asarray(constants[s], dtype=dt)),)
                    else:
                        vals[id(n)] = (params[s],)
                elif t is ir.Constant:
                    vals[id(n)] = (jnp.asarray(np.asarray(n.value, dtype=pjrt.device_dtype(n.avals[0][1]))),)
                else:
                    if n.op in ("xla::mark_tensor", "xla::full_to_shard", "xla::manual", "xla::shard_to_full"):
                        raise DynamicShapeError(f"{n.op} is not supported with dynamic dimensions")
                    ops = [vals[id(o)][i] for o, i in n.operands]
                    args, avals = items.get(id(n), (None, None))
                    try:
                        vals[id(n)] = lower_node(n, ops, args, avals)
                    except Exception as e:
                        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                        raise DynamicShapeError(f"{n.op} cannot be lowered with dynamic dimensions "
                                                f"({type(e).__name__}: {first}); export it with static shapes") from e
            return tuple(vals[id(n)][i] for n, i in g.roots[:n_out])
        return fn


# slice op -> position of its `dim` argument (`start`, `end` follow)
_SLICES = {"aten::slice.Tensor": 1, "aten::slice_copy.Tensor": 1, "aten::slice_scatter": 2}


def _open_slice_end(op: str, args: tuple, traced: list):
    """`args` of a slice with its end as None when it is at or past the sliced size in
    every trace (`x[:, 0:]` gives end = INT64_MAX): a symbolic size cannot be compared
    with the integer; None slices to the size, whatever it is."""
    d = _SLICES[op]
    if len(args) < d + 3 or type(args[d + 2]) is not int:
        return None
    for m in traced:
        x, i = m.operands[0]
        shape = x.avals[i][0]
        dim = m.args[d] if type(m.args[d]) is int else 0
        if m.args[d + 2] < shape[dim % len(shape)]:
            return None
    return args[:d + 2] + (None,) + args[d + 3:]


def _monomials(names: List[str]) -> List[tuple]:
    """1, each symbol, each product of two different symbols."""
    return [()] + [(n,) for n in names] + [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]


def _fit(column: Sequence[int], sizes: List[Dict[str, int]], names: List[str], symbols: Dict[str, object], where):
    """The expression (integer coefficients on 1, each symbol and each product of two)
    that gives `column[k]` at `sizes[k]`: solved on all traces but the last, checked on
    every trace."""
    if len(set(column)) == 1:
        return column[0]
    mons = _monomials(names)
    rows = np.array([[np.prod([sz[n] for n in m]) if m else 1 for m in mons] for sz in sizes], dtype=np.float64)
    sol = np.linalg.solve(rows[:-1], np.asarray(column[:-1], dtype=np.float64))
    coef = [int(round(c)) for c in sol]
    if any(sum(c * int(r) for c, r in zip(coef, row)) != v for row, v in zip(rows, column)):
        raise DynamicShapeError(f"a size in {where} depends on the dynamic dimensions in a way this exporter "
                                "cannot express (not a polynomial of degree one in each size); "
                                "export it with static shapes")
    expr = 0
    for c, m in zip(coef, mons):
        if c:
            term = c
            for n in m:
                term = term * symbols[n]
            expr = expr + term
    return expr


def plan_sizes(ranges: Dict[str, tuple], example: Dict[str, int]) -> List[Dict[str, int]]:
    """The sizes to trace at: the example, one per symbol with that symbol moved, one per
    pair of symbols with both moved, and one with all moved further (each within its
    range, distinct from the example)."""
    def moved(name, step):
        lo, hi = ranges[name]
        v = example[name]
        for cand in (v + step, v - step, v + step + 1, v - step - 1):
            if lo <= cand <= hi and cand != v:
                return cand
        raise DynamicShapeError(f"dimension {name} can only be {v}: export it as a static size")
    step = {name: moved(name, 1) for name in example}
    out = [dict(example, **{n: step[n] for n in m}) for m in _monomials(list(example))]
    out.append({name: moved(name, 2) for name in example})
    return out
