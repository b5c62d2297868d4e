"""The StableHLO of a graph that reads values with unbounded sizes (`_xla_mark_dynamic`).

Only the program's text is dynamic: each marked size of a parameter is a fresh jax
symbol, elementwise ops broadcast their operands at run time (`lowering/dynamic.py`),
ops whose operands all have static sizes lower as usual, and any other op reached by a
dynamic size is refused with its name. Executing the graph uses the data's own sizes.
"""
from __future__ import annotations

import numpy as np

from .. import ir, pjrt
from ..lowering import dynamic
from .graph import Graph
from .lower import GraphCompileError, lower_node


def marked(graph: Graph) -> bool:
    return any(p in ir.DYNAMIC_DIMS for p in graph.params if type(p) is ir.DeviceData)


def mark(node: ir.DeviceData, dim: int) -> None:
    ir.DYNAMIC_DIMS[node] = ir.DYNAMIC_DIMS.get(node, frozenset()) | {dim}


def _elementwise(node) -> bool:
    return node.lowering.fn.__module__.endswith("lowering.elementwise") and len(node.avals) == 1


def lowered(graph: Graph):
    """The jax `Lowered` program of `graph` with the marked sizes symbolic."""
    jax = pjrt.jax_module()
    import jax.numpy as jnp
    from jax import export
    marks = [(s, d) for s, p in enumerate(graph.params) if type(p) is ir.DeviceData
             for d in sorted(ir.DYNAMIC_DIMS.get(p, ()))]
    symbols = export.symbolic_shape(", ".join(f"d{k}" for k in range(len(marks))))
    shapes = [list(p.avals[0][0]) for p in graph.params]
    for (s, d), sym in zip(marks, symbols):
        shapes[s][d] = sym
    avals = [jax.ShapeDtypeStruct(tuple(sh), pjrt.device_dtype(p.avals[0][1]))
             for sh, p in zip(shapes, graph.params)]

    def fn(*params):
        vals = {}
        for n in graph.order:
            t = type(n)
            if t is ir.DeviceData or t is ir.ScalarParam:
                vals[id(n)] = (params[graph.slot[id(n)]],)
                continue
            if t is ir.Constant:
                vals[id(n)] = (jnp.asarray(np.asarray(n.value, dtype=pjrt.device_dtype(n.avals[0][1]))),)
                continue
            ops = [vals[id(o)][i] for o, i in n.operands]
            arrays = [v for v in ops if hasattr(v, "shape")]
            if all(dynamic.is_static(d) for v in arrays for d in v.shape):
                vals[id(n)] = lower_node(n, ops)
                continue
            if not _elementwise(n):
                raise GraphCompileError(f"{n.op}: values of unbounded size (mark_dynamic) are lowered through "
                                        "elementwise ops only")
            shape = dynamic.result_shape([tuple(v.shape) for v in arrays])
            ops = [dynamic.broadcast_to(v, shape) if hasattr(v, "shape") else v for v in ops]
            vals[id(n)] = lower_node(n, ops, avals=((shape, n.avals[0][1]),))
        return tuple(vals[id(n)][i] for n, i in graph.roots)
    return jax.jit(fn, keep_unused=True).lower(*avals)
