"""Control flow: loops whose body is compiled once (`lax.scan`, `lax.while_loop`) and calls
of traced functions. The bodies are traced subgraphs (`_engine/subgraph.py`), called here
on jax values; the node's last argument is their `Spec`.

Operands, in order: `xla::scan` the initial carry, the scanned inputs, the body's outer
values, then the step's seed when the body draws random numbers; `xla::while_loop` the
carried values, the additional inputs, the condition's outer values, the body's outer
values; `xla::call_subgraph` the inputs, the outer values, the seed when drawn from.
"""
from __future__ import annotations

from .table import lowering


def _iteration_seed(seed, i):
    """A distinct seed per iteration (its low 32 bits key the random ops of the body)."""
    import jax.numpy as jnp
    s = seed.astype(jnp.int64)
    return s * jnp.int64(6364136223846793005) + (i.astype(jnp.int64) + 1) * jnp.int64(1442695040888963407)


@lowering("xla::scan")
def scan(*args):
    import jax.numpy as jnp
    from jax import lax
    spec = args[-1]
    vals = args[:-1]
    body = spec.bodies[0]
    nc, nx, no = spec.n_carry, spec.n_x, len(body.outer)
    init, xs, outer = vals[:nc], vals[nc:nc + nx], vals[nc + nx:nc + nx + no]
    seed = vals[nc + nx + no] if body.seeded else None
    salt = jnp.int64(spec.salt)

    def step(carry, x_i):
        x, i = x_i
        s = _iteration_seed(seed + salt, i) if seed is not None else None
        outs = body(list(carry) + list(x), outer, s)
        return tuple(outs[:nc]), tuple(outs[nc:])

    final, ys = lax.scan(step, tuple(init), (tuple(xs), jnp.arange(spec.length, dtype=jnp.int32)),
                         length=spec.length, reverse=spec.reverse)
    return tuple(final) + tuple(ys)


@lowering("xla::while_loop")
def while_loop(*args):
    from jax import lax
    spec = args[-1]
    vals = args[:-1]
    cond, body = spec.bodies
    nc, na = spec.n_carry, spec.n_additional
    carried, extra = vals[:nc], list(vals[nc:nc + na])
    k = nc + na
    cond_outer = vals[k:k + len(cond.outer)]
    body_outer = vals[k + len(cond.outer):k + len(cond.outer) + len(body.outer)]

    def c(state):
        return cond(list(state) + extra, cond_outer)[0].reshape(())

    def b(state):
        return tuple(body(list(state) + extra, body_outer))

    return tuple(lax.while_loop(c, b, tuple(carried)))


@lowering("xla::call_subgraph")
def call_subgraph(*args):
    spec = args[-1]
    vals = args[:-1]
    body = spec.bodies[0]
    n, no = body.n_in, len(body.outer)
    seed = vals[n + no] if body.seeded else None
    return tuple(body(list(vals[:n]), vals[n:n + no], seed))
