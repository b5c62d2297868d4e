"""`_foreach_*` ops (what torch.optim and clip_grad_norm_ use with foreach=True).

Under functionalization the in-place forms (`_foreach_add_.List`, ...) reach the
backend as their functional forms (`_foreach_add.List`, ...). Without a kernel of
ours PyTorch would run its CompositeExplicitAutograd slow path (one aten op per
tensor); lowering them here makes each call one IR node returning a list.

Each list element is computed in its own dtype (bf16/f16 in f32, rounded once, as
the CPU kernels' opmath does); the executor casts every output to the dtype the
meta kernel predicted.

`Scalar[]` arguments: the dispatcher treats a `Scalar[]` as a static argument (its
values would be part of the graph hash, so Adam's per-step bias corrections would
recompile every step). Until the engine turns scalar lists into graph parameters,
the `.ScalarList` overloads get small Python kernels that re-express the call with
tensors (0-d CPU tensors become graph parameters; a 1-d list becomes a device
tensor), see `kernels/handwritten.foreach_scalarlist_kernels`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .table import lowering, matmul_precision, out_dtype

_HALF = (jnp.bfloat16, jnp.float16)


def _cdt(i):
    """The compute dtype of output i."""
    dt = jnp.dtype(out_dtype(i))
    if dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return jnp.dtype(jnp.float32)
    return dt


def _c(v, dt):
    if isinstance(v, (int, float, bool)):
        return jnp.asarray(v, dt)
    return jnp.asarray(v).astype(dt)


# ---- unary -------------------------------------------------------------------------------

def _frac(x):
    return x - jnp.trunc(x)


def _round(x):
    return jnp.round(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x


def _sign(x):
    return jnp.sign(x)


_UNARY = {
    "abs": jnp.abs, "acos": jnp.arccos, "asin": jnp.arcsin, "atan": jnp.arctan, "ceil": jnp.ceil,
    "cos": jnp.cos, "cosh": jnp.cosh, "erf": lax.erf, "erfc": lax.erfc, "exp": jnp.exp,
    "expm1": jnp.expm1, "floor": jnp.floor, "frac": _frac, "lgamma": lax.lgamma, "log": jnp.log,
    "log10": jnp.log10, "log1p": jnp.log1p, "log2": jnp.log2, "neg": jnp.negative,
    "reciprocal": lambda x: 1 / x, "round": _round, "rsqrt": lax.rsqrt, "sigmoid": jax.nn.sigmoid,
    "sign": _sign, "sin": jnp.sin, "sinh": jnp.sinh, "sqrt": jnp.sqrt, "tan": jnp.tan,
    "tanh": jnp.tanh, "trunc": jnp.trunc,
}


def _unary_lowering(f):
    def low(xs):
        return [f(x.astype(_cdt(i))) for i, x in enumerate(xs)]
    return low


for _n, _f in _UNARY.items():
    lowering(f"aten::_foreach_{_n}")(_unary_lowering(_f))


@lowering("aten::_foreach_zero")
def foreach_zero(xs):
    return [jnp.zeros(x.shape, out_dtype(i)) for i, x in enumerate(xs)]


@lowering("aten::_foreach_clone")
def foreach_clone(xs, memory_format=None):
    return list(xs)


@lowering("aten::_foreach_copy")
def foreach_copy(xs, srcs, non_blocking=False):
    return [jnp.broadcast_to(s.astype(out_dtype(i)), x.shape) for i, (x, s) in enumerate(zip(xs, srcs))]


# ---- binary ------------------------------------------------------------------------------

def _lerp(x, end, w):
    # PyTorch's formula: the weight < 0.5 branch starts from x, the other from end.
    return jnp.where(jnp.abs(w) < 0.5, x + w * (end - x), end - (end - x) * (1 - w))


def _pow(x, y):
    return jnp.power(x, y)


_BINARY = {
    "mul": lambda x, y: x * y,
    "div": lambda x, y: x / y,
    "maximum": jnp.maximum,
    "minimum": jnp.minimum,
    "clamp_min": jnp.maximum,
    "clamp_max": jnp.minimum,
    "pow": _pow,
}


def _binary_lowering(f, other_kind):
    """other_kind: 'scalar' (one Scalar), 'list' (Tensor[]), 'tensor' (one Tensor)."""
    def low(xs, other):
        out = []
        for i, x in enumerate(xs):
            dt = _cdt(i)
            y = other[i] if other_kind == "list" else other
            out.append(f(x.astype(dt), _c(y, dt)))
        return out
    return low


for _n, _f in _BINARY.items():
    lowering(f"aten::_foreach_{_n}.Scalar")(_binary_lowering(_f, "scalar"))
    lowering(f"aten::_foreach_{_n}.List")(_binary_lowering(_f, "list"))
    if _n in ("mul", "div"):
        lowering(f"aten::_foreach_{_n}.Tensor")(_binary_lowering(_f, "tensor"))


def _add_sub(sign):
    def scalar(xs, s):
        return [x.astype(_cdt(i)) + sign * _c(s, _cdt(i)) for i, x in enumerate(xs)]

    def lst(xs, ys, alpha=1):
        out = []
        for i, (x, y) in enumerate(zip(xs, ys)):
            dt = _cdt(i)
            y = _c(y, dt)
            if not (isinstance(alpha, (int, float)) and alpha == 1):
                y = y * _c(alpha, dt)
            out.append(x.astype(dt) + y if sign > 0 else x.astype(dt) - y)
        return out

    def tensor(xs, y, alpha=1):
        return lst(xs, [y] * len(xs), alpha)
    return scalar, lst, tensor


for _n, _sign in (("add", 1), ("sub", -1)):
    _s, _l, _t = _add_sub(_sign)
    lowering(f"aten::_foreach_{_n}.Scalar")(_s)
    lowering(f"aten::_foreach_{_n}.List")(_l)
    if _n == "add":
        lowering(f"aten::_foreach_{_n}.Tensor")(_t)


@lowering("aten::_foreach_pow.ScalarAndTensor")
def foreach_pow_scalar_and_tensor(s, xs):
    return [jnp.power(_c(s, _cdt(i)), x.astype(_cdt(i))) for i, x in enumerate(xs)]


# ---- ternary -----------------------------------------------------------------------------

def _addcmul(x, a, b, v):
    return x + v * a * b


def _addcdiv(x, a, b, v):
    return x + v * a / b


def _ternary_lowering(f, kind):
    def low(xs, t1, t2, value=1):
        out = []
        for i, x in enumerate(xs):
            dt = _cdt(i)
            v = value[i] if kind == "tensor" else value
            out.append(f(x.astype(dt), t1[i].astype(dt), t2[i].astype(dt), _c(v, dt)))
        return out
    return low


def _meta_addcmul(xs, t1, t2, scalars):
    import torch
    return torch.ops.aten._foreach_addcmul.Scalar(xs, t1, t2, 1)


def _meta_addcdiv(xs, t1, t2, scalars):
    import torch
    return torch.ops.aten._foreach_addcdiv.Scalar(xs, t1, t2, 1)


lowering("aten::_foreach_addcmul.Scalar")(_ternary_lowering(_addcmul, "scalar"))
lowering("aten::_foreach_addcdiv.Scalar")(_ternary_lowering(_addcdiv, "scalar"))
# .Tensor: `scalars` is a 1-d tensor with one value per list element (its meta kernel
# insists on a CPU tensor, hence our own shape function).
lowering("aten::_foreach_addcmul.Tensor", meta=_meta_addcmul)(_ternary_lowering(_addcmul, "tensor"))
lowering("aten::_foreach_addcdiv.Tensor", meta=_meta_addcdiv)(_ternary_lowering(_addcdiv, "tensor"))


@lowering("aten::_foreach_lerp.Scalar")
def foreach_lerp_scalar(xs, ends, weight):
    return [_lerp(x.astype(_cdt(i)), e.astype(_cdt(i)), _c(weight, _cdt(i))) for i, (x, e) in enumerate(zip(xs, ends))]


@lowering("aten::_foreach_lerp.List")
def foreach_lerp_list(xs, ends, weights):
    return [_lerp(x.astype(_cdt(i)), e.astype(_cdt(i)), _c(w, _cdt(i)))
            for i, (x, e, w) in enumerate(zip(xs, ends, weights))]


# ---- reductions --------------------------------------------------------------------------

def _norm(x, p):
    a = jnp.abs(x)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a))
    if p == 1:
        return jnp.sum(a)
    if p == float("inf"):
        return jnp.max(a) if x.size else jnp.zeros((), a.dtype)
    if p == float("-inf"):
        return jnp.min(a)
    if p == 0:
        return jnp.sum((a != 0).astype(a.dtype))
    return jnp.sum(a ** p) ** (1.0 / p)


@lowering("aten::_foreach_norm.Scalar", static=("ord",))
def foreach_norm(xs, ord=2, dtype=None):
    p = float(ord)
    return [_norm(x.astype(_cdt(i)), p) for i, x in enumerate(xs)]


@lowering("aten::_foreach_max")
def foreach_max(xs):
    return [jnp.max(x) for x in xs]


@lowering("aten::_foreach_mm")
def foreach_mm(xs, ys):
    return [jnp.matmul(x, y, precision=matmul_precision(), preferred_element_type=_cdt(i))
            for i, (x, y) in enumerate(zip(xs, ys))]
