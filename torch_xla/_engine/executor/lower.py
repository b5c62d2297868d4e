"""A graph as a pure jax function of its parameters, one lowering per node."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .. import ir, pjrt
from ..lowering import LoweringError, apply, constants as lowering_constants, ctx as lowering_ctx
from . import composites, ir_debug, manual
from .graph import Graph


class GraphCompileError(RuntimeError):
    pass


def _subst(a, vals):
    t = type(a)
    if t is ir.Ref:
        return vals[a[1]]
    if t is tuple or t is list:
        return t(_subst(x, vals) for x in a)
    return a


def lower_node(node: ir.Node, operand_vals: list, args: Optional[tuple] = None,
               avals: Optional[tuple] = None) -> tuple:
    """Applies a node's lowering to jax values; returns its outputs as a tuple. `args` /
    `avals` replace the node's own (sizes as symbolic expressions: `symbolic.py`)."""
    avals = node.avals if avals is None else avals
    out_avals = tuple(None if a is None else (a[0], pjrt.device_dtype(a[1])) for a in avals)
    cdt = pjrt.device_dtype(node.info) if node.lowering.promote and node.info is not None else None
    return apply(node.lowering, _subst(node.args if args is None else args, operand_vals), out_avals, cdt)


# The kinds of the steps of `build_fn`'s plan. A step is (kind, a, operand positions), `a`
# as noted per kind.
PARAMETER = 0       # the parameter's position among the function's arguments
CONSTANT = 1        # its host value (numpy), compiled into the program
NODE = 2            # the node, lowered by its lowering
SPLAT_NODE = 3      # (node, `_splats`): an elementwise node whose scalar constants widen to its shape
COMPOSITE_OUT = 4   # (pattern, output index, host constants): an output of a composite
IN_REGION = 5       # None: a per-device node, lowered inside its manual region
REGION_OUT = 6      # the manual region whose output this is

_OPERAND_POS: dict = {}


def _operand_pos(op: str) -> tuple:
    """The positions of arguments `self` and `other` (the operands, which may be Python
    scalars) in `op`'s schema."""
    if op not in _OPERAND_POS:
        import torch
        name, _, overload = op[len("aten::"):].partition(".")
        try:
            schema = getattr(getattr(torch.ops.aten, name), overload or "default")._schema
            _OPERAND_POS[op] = tuple(k for k, a in enumerate(schema.arguments) if a.name in ("self", "other"))
        except (AttributeError, RuntimeError):
            _OPERAND_POS[op] = ()
    return _OPERAND_POS[op]


def _splats(n: ir.Node, ops: tuple, plan: list) -> Optional[tuple]:
    """For elementwise node `n` with an output that is not 0-d: (per operand, the output
    shape where the operand is a 0-d host constant, else None; the positions of inline
    Python scalar operands). None when there is nothing to widen."""
    shape = n.avals[0][0] if n.avals and n.avals[0] is not None else ()
    if not shape or len(n.avals) != 1 or not n.lowering.fn.__module__.endswith("lowering.elementwise"):
        return None
    out = tuple(tuple(shape) if plan[p][0] == CONSTANT and plan[p][1].ndim == 0 else None for p, _ in ops)
    pos = _operand_pos(n.op) if n.op.startswith("aten::") else ()
    inline = tuple(k for k in pos if k < len(n.args) and type(n.args[k]) in (int, float))
    return (out, inline) if inline or any(s is not None for s in out) else None


def _lower_splats(a, ops, vals, plan) -> tuple:
    """Lowers an elementwise node whose scalar constants are widened to its shape."""
    node, (splats, inline) = a
    shape, dtype = node.avals[0]
    dt = pjrt.device_dtype(node.info if node.lowering.promote and node.info is not None else dtype)
    operands = [vals[p][i] if sp is None else lowering_constants.splat(plan[p][1].astype(dt), sp)
                for (p, i), sp in zip(ops, splats)]
    args = None
    if inline:
        args = list(node.args)
        for k in inline:
            args[k] = lowering_constants.splat(np.asarray(args[k], dtype=dt), shape)
        args = tuple(args)
    return lower_node(node, operands, args)


def build_fn(graph: Graph, patch_convolutions: bool, checks: bool = False, manual_text: bool = False,
             constants: Optional[dict] = None, widen_int4_dots: bool = False, library_products: str = ""):
    """A pure function params -> root values, evaluating the nodes with their lowerings.

    `constants`: parameter slot -> host value compiled into the program instead (the
    function still takes every parameter and ignores those); the StableHLO export's
    form: a scalar constant of an elementwise op is one constant of the op's shape.

    `checks`: when the graph has ops that check their indices (and XLA_CHECK_INDICES is
    on), the function returns one more value, the error vector of `checks.py`, and
    `graph.checks` receives the host side of each check when the function is traced.
    `manual_text`: manual regions are lowered in place, their edges as XLA's SPMD custom
    calls (printable, with per-device values among the results; not for running).
    `library_products`: which float32 products are calls of the platform's BLAS handler
    (`platform.base`: "" none, LONG_REDUCTIONS, ALL_PRODUCTS; lowering/blas_cpu.py;
    executed single-device CPU programs)."""
    import jax.numpy as jnp
    from . import checks as checking
    order, slot, index = graph.order, graph.slot, graph.index
    try:
        regions = None if manual_text else manual.plan(graph)
    except manual.ManualRegionError as e:
        raise GraphCompileError(str(e)) from None
    patterns = composites.plan(graph) if regions is None else None
    if patterns is not None:   # the order evaluates each composite's operands before it
        order = patterns.order
        index = {id(n): k for k, n in enumerate(order)}
    root_pos = [(index[id(n)], i) for n, i in graph.roots]
    plan = []
    for n in order:
        t = type(n)
        if t is ir.DeviceData or t is ir.ScalarParam or t is ir.Placeholder:
            s = slot[id(n)]
            if constants is not None and s in constants:
                plan.append((CONSTANT, np.asarray(constants[s], dtype=pjrt.device_dtype(n.avals[0][1])), None))
            else:
                plan.append((PARAMETER, s, None))
        elif patterns is not None and id(n) in patterns.exits:
            pattern, k = patterns.exits[id(n)]
            deps = tuple((index[id(o)], i) for o, i in pattern.deps())
            # constants are compiled into the composite's decomposition, not passed to it
            host = tuple(plan[p][1] if plan[p][0] == CONSTANT else None for p, _ in deps)
            plan.append((COMPOSITE_OUT, (pattern, k, host), deps))
        elif t is ir.Constant:
            shape, dt = n.avals[0]
            plan.append((CONSTANT, np.asarray(n.value, dtype=pjrt.device_dtype(dt)), None))
        elif regions is not None and id(n) in regions.skip:
            plan.append((IN_REGION, None, None))
        elif regions is not None and id(n) in regions.exits:
            region = regions.exits[id(n)]
            plan.append((REGION_OUT, region, tuple((index[id(o)], i) for o, i in region.inputs)))
        else:
            ops = tuple((index[id(o)], i) for o, i in n.operands)
            splats = _splats(n, ops, plan) if constants is not None else None
            plan.append((NODE, n, ops) if splats is None else (SPLAT_NODE, (n, splats), ops))

    sources = ir.SOURCES
    if sources:
        import jax
    checked = checks and checking.enabled() and any(k == NODE and a.lowering.checked for k, a, _ in plan)
    graph.checks = [] if checked else None

    def fn(*params):
        lowering_ctx.patch_convolutions = patch_convolutions
        lowering_ctx.widen_int4_dots = widen_int4_dots
        lowering_ctx.manual_text = manual_text
        lowering_ctx.library_products = library_products
        recorded = lowering_ctx.checks = [] if checked else None
        try:
            vals = _run(params)
        finally:
            lowering_ctx.checks = lowering_ctx.node = lowering_ctx.source = None
            lowering_ctx.manual_text = False
            lowering_ctx.library_products = ""
        roots = tuple(vals[p][i] for p, i in root_pos)
        if not checked:
            return roots
        graph.checks[:] = checking.infos(recorded)
        return roots + (checking.error_output(recorded),)

    def _run(params):
        vals = [None] * len(plan)
        done = {}   # id(pattern) -> its outputs

        def source(node, i):
            p = index.get(id(node))
            v = vals[p] if p is not None else None
            return v[i] if v is not None else None
        lowering_ctx.source = source if library_products else None
        for pos, (kind, a, ops) in enumerate(plan):
            if kind == NODE:
                lowering_ctx.node = a
                try:
                    src = sources.get(a) if sources else None
                    if ir.DEBUG_INFO:
                        src = ir_debug.hlo_scope(a, src)
                    if src is not None:
                        with jax.named_scope(src):
                            vals[pos] = lower_node(a, [vals[p][i] for p, i in ops])
                        continue
                    vals[pos] = lower_node(a, [vals[p][i] for p, i in ops])
                except LoweringError as e:
                    raise GraphCompileError(str(e)) from e
                except Exception as e:
                    raise GraphCompileError(f"lowering {a.op} failed: {type(e).__name__}: {e}") from e
            elif kind == PARAMETER:
                vals[pos] = (params[a],)
            elif kind == CONSTANT:
                vals[pos] = (jnp.asarray(a),)
            elif kind == SPLAT_NODE:
                lowering_ctx.node = a[0]
                try:
                    vals[pos] = _lower_splats(a, ops, vals, plan)
                except LoweringError as e:
                    raise GraphCompileError(str(e)) from e
                except Exception as e:
                    raise GraphCompileError(f"lowering {a[0].op} failed: {type(e).__name__}: {e}") from e
            elif kind == COMPOSITE_OUT:
                pattern, k, host = a
                outs = done.get(id(pattern))
                if outs is None:
                    args = [vals[p][i] if h is None else h for (p, i), h in zip(ops, host)]
                    n_in = len(pattern.in_marks)
                    outs = done[id(pattern)] = pattern.lower(args[:n_in], args[n_in:], lower_node)
                vals[pos] = (outs[k],)
            elif kind == REGION_OUT:
                # per-device code (inside shard_map): its checks cannot leave the region
                saved, lowering_ctx.checks = lowering_ctx.checks, None
                try:
                    vals[pos] = (a.lower([vals[p][i] for p, i in ops], lower_node),)
                finally:
                    lowering_ctx.checks = saved
            # IN_REGION: its region's lowering computes it
        return vals
    return fn
