"""Collectives across replicas, lowered to XLA collectives over the replica axis.

In a multi-process job the executor compiles a graph that holds a collective as an
SPMD program over the mesh of all processes' devices (axis 'r'); each process feeds
its own buffers as its shard. With one replica there is no axis: a collective is the
identity, unless XLA_ALWAYS_ALLREDUCE asks to keep it or its replica groups name more
replicas than the process has (a program traced for a larger world). Then it is lowered
to the XLA collective itself (`_replica_op`) with those replica groups: its text can be
printed, and the executor refuses to run groups that name missing replicas.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .table import ctx, lowering


def _members(groups, world):
    """(world, group size) table: row r lists the replicas of r's group, in group order."""
    if not groups:
        return np.arange(world)[None, :].repeat(world, 0)
    size = len(groups[0])
    if any(len(g) != size for g in groups):
        raise ValueError(f"replica groups must all have the same size: {groups}")
    table = np.zeros((world, size), np.int32)
    seen = set()
    for g in groups:
        for r in g:
            if r in seen or not 0 <= r < world:
                raise ValueError(f"invalid replica groups {groups} for world size {world}")
            seen.add(r)
            table[r] = g
    if len(seen) != world:
        raise ValueError(f"replica groups {groups} do not cover all {world} replicas")
    return table


def _gather_group(x, axis, groups):
    """Stack of the values of my group's members: (group size, *x.shape)."""
    world = ctx.world
    allx = lax.all_gather(x, axis)  # (world, ...)
    if not groups:
        return allx
    table = jnp.asarray(_members(groups, world))
    mine = table[lax.axis_index(axis)]
    return jnp.take(allx, mine, axis=0)


_REDUCERS = {
    "sum": (lax.psum, lambda a: jnp.sum(a, 0)),
    "max": (lax.pmax, lambda a: jnp.max(a, 0)),
    "min": (lax.pmin, lambda a: jnp.min(a, 0)),
    "mul": (None, lambda a: jnp.prod(a, 0)),
    "and": (None, lambda a: jnp.all(a, 0) if a.dtype == jnp.bool_ else jnp.bitwise_and.reduce(a, axis=0)),
    "or": (None, lambda a: jnp.any(a, 0) if a.dtype == jnp.bool_ else jnp.bitwise_or.reduce(a, axis=0)),
}


def _reduce(x, reduce_type, axis, groups):
    fast, slow = _REDUCERS[reduce_type]
    if fast is not None and not groups and x.dtype != jnp.bool_:
        return fast(x, axis)
    return slow(_gather_group(x, axis, groups)).astype(x.dtype)


# ---- XLA collectives over the replicas of a one-process program ------------------------

def _replica_prim():
    """A jax primitive lowered to one XLA collective (all-reduce, all-gather or
    reduce-scatter) over explicit replica groups, outside any mapped axis."""
    global _PRIM
    if _PRIM is not None:
        return _PRIM
    from jax.extend import core as jcore
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo
    from jax._src import core

    prim = jcore.Primitive("xla_replica_collective")
    prim.multiple_results = True

    def abstract(*xs, kind, reduce_type, groups, dim, n):
        out = []
        for x in xs:
            shape = list(x.shape)
            if kind == "all_gather":
                shape[dim] *= n
            elif kind == "reduce_scatter":
                shape[dim] //= n
            out.append(core.ShapedArray(tuple(shape), x.dtype))
        return out

    def groups_attr(groups):
        arr = np.asarray(groups, np.int64) if groups else np.zeros((0, 0), np.int64)
        return ir.DenseIntElementsAttr.get(arr, type=ir.IntegerType.get_signless(64), shape=arr.shape)

    def reducer(op, ctx_, dtype, reduce_type):
        scalar = core.ShapedArray((), dtype)
        ty = mlir.aval_to_ir_type(ctx_.module_context, scalar)
        block = op.regions[0].blocks.append(ty, ty)
        with ir.InsertionPoint(block):
            fn = mlir.lower_fun(_SCALAR_REDUCERS[reduce_type], multiple_results=False)
            out = fn(ctx_.replace(primitive=None, avals_in=[scalar, scalar], avals_out=[scalar]),
                     *block.arguments)
            flat, _ = mlir.ir_tree_registry.flatten(out)
            hlo.return_(flat)

    def lower(ctx_, *xs, kind, reduce_type, groups, dim, n):
        types = [mlir.aval_to_ir_type(ctx_.module_context, a) for a in ctx_.avals_out]
        if kind == "all_reduce":
            op = hlo.AllReduceOp(types, list(xs), replica_groups=groups_attr(groups))
            reducer(op, ctx_, ctx_.avals_in[0].dtype, reduce_type)
            return list(op.results)
        if kind == "all_gather":
            return list(hlo.AllGatherOp(types, list(xs), all_gather_dim=mlir.i64_attr(dim),
                                        replica_groups=groups_attr(groups)).results)
        op = hlo.ReduceScatterOp(types[0], xs[0], scatter_dimension=mlir.i64_attr(dim),
                                 replica_groups=groups_attr(groups))
        reducer(op, ctx_, ctx_.avals_in[0].dtype, reduce_type)
        return [op.result]

    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, lower)
    _PRIM = prim
    return prim


_PRIM = None

_SCALAR_REDUCERS = {
    "sum": lambda a, b: a + b if a.dtype != jnp.bool_ else a | b,
    "mul": lambda a, b: a * b if a.dtype != jnp.bool_ else a & b,
    "max": jnp.maximum,
    "min": jnp.minimum,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
}


def _keeps_op(groups, always) -> bool:
    """Whether a collective outside a replica axis is lowered to the XLA collective."""
    return ctx.axis is None and (bool(always) or bool(groups and len(groups[0]) > 1))


def _replica_op(xs, kind, groups, reduce_type="sum", dim=0, n=1):
    # One-member groups behave as the single replica: `{}` (all replicas) runs everywhere.
    g = groups if groups and len(groups[0]) > 1 else ()
    return _replica_prim().bind(*xs, kind=kind, reduce_type=reduce_type, groups=g, dim=dim, n=n)


@lowering("xla::all_reduce")
def all_reduce(x, reduce_type, scale, groups, always=False):
    axis = ctx.axis
    if _keeps_op(groups, always):
        (y,) = _replica_op([x], "all_reduce", groups, reduce_type)
    else:
        y = x if axis is None else _reduce(x, reduce_type, axis, groups)
    if scale != 1.0:
        y = (y * scale).astype(x.dtype)
    return y


@lowering("xla::all_gather")
def all_gather(x, dim, groups, always=False):
    axis = ctx.axis
    if _keeps_op(groups, always):
        n = len(groups[0]) if groups else 1
        if x.ndim == 0:
            (y,) = _replica_op([jnp.reshape(x, (1,))], "all_gather", groups, dim=0, n=n)
            return y
        (y,) = _replica_op([x], "all_gather", groups, dim=dim, n=n)
        return y
    if axis is None:
        return x
    g = _gather_group(x, axis, groups)  # (n, ...)
    parts = [g[i] for i in range(g.shape[0])]
    return jnp.concatenate(parts, axis=dim) if x.ndim else jnp.stack(parts)


@lowering("xla::all_gather_coalesced")
def all_gather_coalesced(*args):
    """Several tensors gathered by one collective (a tuple-shaped all-gather)."""
    xs, (dim, groups, always) = args[:-3], args[-3:]
    if _keeps_op(groups, always) and xs and all(x.ndim and dim % x.ndim == dim % xs[0].ndim for x in xs):
        n = len(groups[0]) if groups else 1
        return tuple(_replica_op(list(xs), "all_gather", groups, dim=dim % xs[0].ndim, n=n))
    return tuple(all_gather(x, dim % max(x.ndim, 1), groups, always) for x in xs)


@lowering("xla::reduce_scatter")
def reduce_scatter(x, reduce_type, scale, dim, shard_count, groups, always=False):
    axis = ctx.axis
    if _keeps_op(groups, always):
        (y,) = _replica_op([x], "reduce_scatter", groups, reduce_type, dim=dim, n=shard_count)
    elif axis is None:
        y = x
    elif reduce_type == "sum" and not groups and x.dtype != jnp.bool_:
        # One reduce-scatter (half an all-reduce's traffic on GPU/TPU), not an all-reduce + slice.
        y = lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
    else:
        total = _reduce(x, reduce_type, axis, groups)
        n = shard_count
        size = x.shape[dim] // n
        table = _members(groups, ctx.world)
        # My position inside my group decides which shard I keep.
        pos_table = np.zeros(ctx.world, np.int32)
        for row in table:
            for p, r in enumerate(row):
                pos_table[r] = p
        pos = jnp.asarray(pos_table)[lax.axis_index(axis)]
        y = lax.dynamic_slice_in_dim(total, pos * size, size, axis=dim)
    if scale != 1.0:
        y = (y * scale).astype(x.dtype)
    return y


@lowering("xla::all_to_all")
def all_to_all(x, split_dimension, concat_dimension, split_count, groups):
    axis = ctx.axis
    if axis is None:
        return x
    g = _gather_group(x, axis, groups)  # (n, ...): every member's full input
    n = g.shape[0]
    table = _members(groups, ctx.world)
    pos_table = np.zeros(ctx.world, np.int32)
    for row in table:
        for p, r in enumerate(row):
            pos_table[r] = p
    pos = jnp.asarray(pos_table)[lax.axis_index(axis)]
    size = x.shape[split_dimension] // split_count
    # From member j take its pos-th chunk along split_dimension; concatenate over j.
    chunks = [lax.dynamic_slice_in_dim(g[j], pos * size, size, axis=split_dimension) for j in range(n)]
    return jnp.concatenate(chunks, axis=concat_dimension)


@lowering("xla::collective_permute")
def collective_permute(x, pairs):
    axis = ctx.axis
    if axis is None:
        return x if any(s == t for s, t in pairs) else jnp.zeros_like(x)
    return lax.ppermute(x, axis, perm=list(pairs))


@lowering("xla::optimization_barrier")
def optimization_barrier(*xs):
    """The values unchanged, but XLA may not move computations across (nor CSE through)."""
    return tuple(lax.optimization_barrier(tuple(xs)))
