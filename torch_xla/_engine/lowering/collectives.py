"""Collectives across replicas, lowered to XLA collectives over the replica axis.

In a multi-process job the executor compiles a graph that holds a collective as an
SPMD program over the mesh of all processes' devices (axis 'r'); each process feeds
its own buffers as its shard. With one replica there is no axis and every
collective is the identity.
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


@lowering("xla::all_reduce")
def all_reduce(x, reduce_type, scale, groups):
    axis = ctx.axis
    y = x if axis is None else _reduce(x, reduce_type, axis, groups)
    if scale != 1.0:
        y = (y * scale).astype(x.dtype)
    return y


@lowering("xla::all_gather")
def all_gather(x, dim, groups):
    axis = ctx.axis
    if axis is None:
        return x
    g = _gather_group(x, axis, groups)  # (n, ...)
    parts = [g[i] for i in range(g.shape[0])]
    return jnp.concatenate(parts, axis=dim) if x.ndim else jnp.stack(parts)


@lowering("xla::reduce_scatter")
def reduce_scatter(x, reduce_type, scale, dim, shard_count, groups):
    axis = ctx.axis
    if axis is None:
        y = x
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
