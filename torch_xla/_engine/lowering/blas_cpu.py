"""float32 matrix products as calls of the CPU platform's BLAS handler (platform/cpu_blas.py).

Used by `linalg`'s products when the platform asks for it (`ctx.library_products`: the
executor's single-device programs on CPU) and the product is large enough. The handler
reads an operand transposed where that operand is a transpose node of the graph (`t`,
`transpose`, `permute` swapping the last two dimensions), also behind reshapes of the
leading dimensions (a 4-D `q @ k.transpose(-1, -2)` reaches `bmm` as a view of an expand
of the transpose): it gets the transpose's source and a flag, so neither a weight gradient
`gᵀ·x` nor attention's `kᵀ` and `pᵀ·g` copies its operand.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..platform.base import ALL_PRODUCTS
from ..platform.cpu_blas import TARGET
from . import shape_ops
from .table import ctx

# Products of fewer multiply-adds stay XLA's: fused with their neighbours, and a program
# without a call does not pay the BLAS's one-time start in the process (MNIST's first loss
# was 6-8% later with its three 2M products given to the handler; BENCHMARKS.md).
_MIN_WORK = 1 << 24
_PRODUCTS = {"aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::addmm": (1, 2), "aten::baddbmm": (1, 2)}


def applies(a, b) -> bool:
    """Whether the product a @ b of this node goes to the handler."""
    return ctx.library_products == ALL_PRODUCTS and large(a, b)


def large(a, b) -> bool:
    """Whether a @ b (float32, equal batch dimensions) is large enough for the handler."""
    if a.dtype != jnp.float32 or b.dtype != jnp.float32:
        return False
    if a.ndim < 2 or a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        return False
    return int(np.prod(a.shape)) * b.shape[-1] >= _MIN_WORK


def _swaps_last_two(node) -> bool:
    op, nd = node.op, len(node.avals[0][0])
    if nd < 2:
        return False
    if op == "aten::t_copy":
        return nd == 2
    if op.startswith("aten::transpose_copy"):
        d0, d1 = node.args[1], node.args[2]
        return isinstance(d0, int) and isinstance(d1, int) and {d0 % nd, d1 % nd} == {nd - 2, nd - 1}
    if op.startswith("aten::permute_copy"):
        dims = node.args[1]
        return (all(isinstance(d, int) for d in dims)
                and [d % nd for d in dims] == list(range(nd - 2)) + [nd - 1, nd - 2])
    return False


def _shape_of(operand) -> tuple:
    node, idx = operand
    return tuple(node.avals[idx][0])


def _leading_only(node) -> bool:
    """A node that leaves the last two dimensions as they are and only reshapes the leading
    ones, or copies its operand as it is: a 4-D `matmul` reaches `bmm` through
    `expand` (to the same shape) and `view` (batch dimensions merged)."""
    op = node.op
    if op not in shape_ops.RESHAPE_OPS and op not in shape_ops.EXPAND_OPS:
        return False
    out, src = tuple(node.avals[0][0]), _shape_of(node.operands[0])
    if op in shape_ops.EXPAND_OPS:
        return out == src
    return len(out) >= 2 and len(src) >= 2 and out[-2:] == src[-2:]


def _resolved(operand, value):
    """(value, transposed): `operand` (a (node, index) of the product's node, whose value is
    `value`) read through the transposes of its last two dimensions this program computed
    the sources of, and through reshapes of the leading dimensions between them (a
    transpose's source is then reshaped alike: row-major, a bitcast); `transposed` when
    their number is odd."""
    node, flip = operand[0], False
    while ctx.source is not None and hasattr(node, "op"):
        swap = node
        while hasattr(swap, "op") and not _swaps_last_two(swap) and _leading_only(swap):
            swap = swap.operands[0][0]
        if not (hasattr(swap, "op") and _swaps_last_two(swap)):
            break
        v = ctx.source(*swap.operands[0])
        shape = value.shape[:-2] + (value.shape[-1], value.shape[-2])
        if (v is None or getattr(v, "dtype", None) != jnp.float32 or v.shape[-2:] != shape[-2:]
                or int(np.prod(v.shape[:-2])) != int(np.prod(shape[:-2]))):
            break
        value, flip, node = (v if v.shape == shape else v.reshape(shape)), not flip, swap.operands[0][0]
    return value, flip


def matmul(a, b):
    """a @ b (equal batch dimensions) computed by the handler."""
    ta = tb = False
    node = ctx.node
    pos = _PRODUCTS.get(getattr(node, "op", None))
    if pos is not None:
        refs = [node.args[p] for p in pos]
        if all(isinstance(r, tuple) and len(r) == 2 and r[0] == "%" for r in refs):
            a, ta = _resolved(node.operands[refs[0][1]], a)
            b, tb = _resolved(node.operands[refs[1][1]], b)
    return product(a, b, ta, tb)


def _call(a, b, ta: bool, tb: bool):
    m = a.shape[-1] if ta else a.shape[-2]
    n = b.shape[-2] if tb else b.shape[-1]
    out = jax.ShapeDtypeStruct(a.shape[:-2] + (m, n), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(a, b, trans_a=ta, trans_b=tb)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def product(a, b, ta: bool, tb: bool):
    """op(a) @ op(b) by the handler (op: transposed where the flag says), differentiable to
    any order (lowerings that take `jax.vjp` of a forward, as conv_cpu's and the backward
    lowerings do): each gradient is again such a product, its transposed operands read
    without a copy."""
    return _call(a, b, ta, tb)


def _product_fwd(a, b, ta, tb):
    return product(a, b, ta, tb), (a, b)


def _product_bwd(ta, tb, res, g):
    a, b = res
    if not ta and not tb:     # c = a b
        return product(g, b, False, True), product(a, g, True, False)
    if not ta:                # c = a bᵀ, b stored (n, k)
        return product(g, b, False, False), product(g, a, True, False)
    if not tb:                # c = aᵀ b, a stored (k, m)
        return product(b, g, False, True), product(a, g, False, False)
    return product(b, g, True, True), product(g, a, True, True)   # c = aᵀ bᵀ


product.defvjp(_product_fwd, _product_bwd)
