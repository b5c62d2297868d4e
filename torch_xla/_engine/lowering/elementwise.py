"""Pointwise math, comparisons, logic and activations (forward and backward)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..pjrt import is_complex32
from .table import check_nonzero, ctx, lowering, out_dtype, out_shape, round_complex32


def _is_one(v):
    """True for the Python constant 1 (a Scalar that is a graph parameter is never folded)."""
    return isinstance(v, (int, float)) and v == 1


def _is_float(x):
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


# ---- arithmetic -----------------------------------------------------------------------

def _scaled(y, alpha):
    """alpha * y, rounded for complex32, whose CPU kernels round every complex operation."""
    if _is_one(alpha):
        return y
    y = y * alpha
    return round_complex32(y) if is_complex32(out_dtype()) else y


@lowering("aten::add.Tensor", "aten::add.Scalar", promote=True)
def add(x, y, alpha=1):
    return x + _scaled(y, alpha)


@lowering("aten::sub.Tensor", "aten::sub.Scalar", promote=True)
def sub(x, y, alpha=1):
    return x - _scaled(y, alpha)


@lowering("aten::rsub.Tensor", "aten::rsub.Scalar", promote=True)
def rsub(x, y, alpha=1):
    return y - _scaled(x, alpha)


@lowering("aten::mul.Tensor", "aten::mul.Scalar", promote=True)
def mul(x, y):
    return x * y


def _div(x, y, rounding_mode=None):
    if rounding_mode is None:
        return x / y
    if rounding_mode == "trunc":
        if _is_float(x):
            return jnp.trunc(x / y)
        x, y = jnp.broadcast_arrays(x, y)  # lax ops do not broadcast
        return lax.div(x, y)
    if rounding_mode == "floor":
        if _is_float(x):
            return jnp.floor(x / y)
        return jnp.floor_divide(x, y)
    raise ValueError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '{rounding_mode}'")


@lowering("aten::div.Tensor", "aten::div.Scalar", promote=True)
def div(x, y):
    return x / y


def _check_divisor(y) -> None:
    """Integer division by zero is the CPU's RuntimeError, checked on the device (the
    program itself computes XLA's value). The CPU checks the divisors of the elements it
    computes: none when the result is empty, otherwise every element of `y`."""
    if ctx.checks is not None and jnp.issubdtype(out_dtype(), jnp.integer) and math.prod(out_shape()):
        check_nonzero(y, RuntimeError, "ZeroDivisionError")


@lowering("aten::div.Tensor_mode", "aten::div.Scalar_mode", promote=True, checked=True)
def div_mode(x, y, rounding_mode=None):
    if rounding_mode is not None:
        _check_divisor(y)
    return _div(x, y, rounding_mode)


@lowering("aten::floor_divide", "aten::floor_divide.Scalar", promote=True, checked=True)
def floor_divide(x, y):
    _check_divisor(y)
    return _div(x, y, "floor")


@lowering("aten::remainder.Tensor", "aten::remainder.Scalar", "aten::remainder.Scalar_Tensor", promote=True,
          checked=True)
def remainder(x, y):
    _check_divisor(y)
    return jnp.remainder(x, y)


@lowering("aten::fmod.Tensor", "aten::fmod.Scalar", promote=True, checked=True)
def fmod(x, y):
    _check_divisor(y)
    return jnp.fmod(x, y)


@lowering("aten::pow.Tensor_Tensor", "aten::pow.Scalar", promote=True)
def pow_(x, y):
    if not _is_float(x) and not jnp.issubdtype(jnp.result_type(x), jnp.complexfloating):
        if isinstance(y, int) and y >= 0:
            return lax.integer_pow(x, y)
        return _int_power(x, y)
    return jnp.power(x, y)


def _int_power(x, y):
    """Integer power as PyTorch's: a negative exponent gives 0 but for the bases 1 and -1
    (jax's power is undefined there); other exponents wrap around as repeated products."""
    y = jnp.asarray(y)
    if x.dtype == jnp.bool_:
        return jnp.power(x, y)
    pos = jnp.power(x, jnp.maximum(y, 0).astype(y.dtype))
    one = jnp.ones((), x.dtype)
    neg = jnp.where(x == 1, one, jnp.where(x == -1, jnp.where(y % 2 == 0, one, -one), jnp.zeros((), x.dtype)))
    return jnp.where(y < 0, neg, pos)


# A scalar exponent is part of the program, not a parameter, so the exponents PyTorch's
# CPU kernel special-cases are computed the same way (x**2 as x*x, x**0.5 as sqrt)
# instead of as a general power of a runtime value.
@lowering("aten::pow.Tensor_Scalar", promote=True, static=("exponent",))
def pow_tensor_scalar(x, exponent):
    if isinstance(exponent, bool):
        exponent = int(exponent)
    if not _is_float(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.complexfloating):
            return jnp.power(x, jnp.asarray(exponent, x.dtype))
        return jnp.power(x, exponent)
    # The exponents PyTorch's CPU kernel computes by other functions (same edge cases:
    # (-0) ** 0.5 is -0 and (-inf) ** 0.5 is nan, as sqrt gives).
    e = float(exponent)
    if e == 0.5:
        return jnp.sqrt(x)
    if e == -0.5:
        return lax.rsqrt(x)
    if e in (2.0, 3.0):
        return lax.integer_pow(x, int(e))
    if e in (-1.0, -2.0):
        return 1 / lax.integer_pow(x, -int(e))
    return jnp.power(x, jnp.asarray(e, x.dtype))


@lowering("aten::neg", promote=True)
def neg(x):
    return -x


@lowering("aten::abs", promote=True)
def abs_(x):
    return jnp.abs(x)


def _real_sign(x):
    # (0 < x) - (x < 0), as PyTorch computes it: NaN has sign 0 (jnp.sign keeps NaN)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)
    return jnp.sign(x)


@lowering("aten::sign", promote=True)
def sign(x):
    return x if x.dtype == jnp.bool_ else _real_sign(x)


@lowering("aten::sgn")
def sgn(x):
    if x.dtype == jnp.bool_:
        return x
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        a = jnp.abs(x)
        return jnp.where(a == 0, jnp.zeros((), x.dtype), x / jnp.where(a == 0, 1, a).astype(x.dtype))
    return _real_sign(x)


# PyTorch's generic kernels for these write into an output through views, which needs
# shared storage; they get direct lowerings.

@lowering("aten::complex")
def complex_(real, imag):
    return lax.complex(*jnp.broadcast_arrays(real, imag))


@lowering("aten::polar")
def polar(absv, angle):
    return lax.complex(absv * jnp.cos(angle), absv * jnp.sin(angle))


@lowering("aten::mvlgamma")
def mvlgamma(x, p):
    c = (p * (p - 1) / 4) * math.log(math.pi)
    return c + sum(lax.lgamma(x - j / 2) for j in range(p))


@lowering("aten::reciprocal", promote=True)
def reciprocal(x):
    return 1 / x


@lowering("aten::maximum", promote=True)
def maximum(x, y):
    return jnp.maximum(x, y)


@lowering("aten::minimum", promote=True)
def minimum(x, y):
    return jnp.minimum(x, y)


@lowering("aten::fmax", promote=True)
def fmax(x, y):
    return jnp.fmax(x, y)


@lowering("aten::fmin", promote=True)
def fmin(x, y):
    return jnp.fmin(x, y)


@lowering("aten::clamp", "aten::clamp.Tensor", promote=True)
def clamp(x, lo=None, hi=None):
    if lo is not None:
        x = jnp.maximum(x, lo)
    if hi is not None:
        x = jnp.minimum(x, hi)
    return x


@lowering("aten::clamp_min", "aten::clamp_min.Tensor", promote=True)
def clamp_min(x, lo):
    return jnp.maximum(x, lo)


@lowering("aten::clamp_max", "aten::clamp_max.Tensor", promote=True)
def clamp_max(x, hi):
    return jnp.minimum(x, hi)


@lowering("aten::lerp.Scalar", "aten::lerp.Tensor", promote=True)
def lerp(x, end, weight):
    return x + weight * (end - x)


@lowering("aten::addcmul", promote=True)
def addcmul(x, t1, t2, value=1):
    return x + value * t1 * t2


@lowering("aten::addcdiv", promote=True)
def addcdiv(x, t1, t2, value=1):
    return x + value * (t1 / t2)


@lowering("aten::where.self", "aten::where.ScalarSelf", "aten::where.ScalarOther", "aten::where.Scalar")
def where(c, x, y):
    dt = out_dtype()
    return jnp.where(c, jnp.asarray(x).astype(dt), jnp.asarray(y).astype(dt))


# ---- unary math ------------------------------------------------------------------------

def _unary(name, f, promote=True):
    lowering(name, promote=promote)(f)


for _n, _f in {
    "exp": jnp.exp, "exp2": jnp.exp2, "expm1": jnp.expm1, "log": jnp.log, "log2": jnp.log2,
    "log10": jnp.log10, "log1p": jnp.log1p, "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt,
    "sin": jnp.sin, "cos": jnp.cos, "tan": jnp.tan, "asin": jnp.arcsin, "acos": jnp.arccos,
    "atan": jnp.arctan, "sinh": jnp.sinh, "cosh": jnp.cosh, "tanh": jnp.tanh,
    "asinh": jnp.arcsinh, "acosh": jnp.arccosh, "atanh": jnp.arctanh,
    "erf": lax.erf, "erfc": lax.erfc, "erfinv": lax.erf_inv, "lgamma": lax.lgamma,
    "sigmoid": jax.nn.sigmoid, "floor": jnp.floor, "ceil": jnp.ceil,
    "trunc": jnp.trunc, "frac": lambda x: x - jnp.trunc(x), "square": jnp.square,
    "i0": jax.scipy.special.i0, "sinc": jnp.sinc, "deg2rad": jnp.deg2rad, "rad2deg": jnp.rad2deg,
}.items():
    _unary("aten::" + _n, (lambda f: lambda x: f(x))(_f))


@lowering("aten::round", promote=True)
def round_(x):
    return jnp.round(x) if _is_float(x) else x


@lowering("aten::round.decimals", promote=True)
def round_decimals(x, decimals=0):
    s = 10.0 ** decimals
    return jnp.round(x * s) / s


@lowering("aten::atan2", promote=True)
def atan2(x, y):
    return jnp.arctan2(x, y)


@lowering("aten::hypot", promote=True)
def hypot(x, y):
    return jnp.hypot(x, y)


@lowering("aten::logit", promote=True)
def logit(x, eps=None):
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


@lowering("aten::xlogy.Tensor", "aten::xlogy.Scalar_Self", "aten::xlogy.Scalar_Other", promote=True)
def xlogy(x, y):
    return jax.scipy.special.xlogy(x, y)


@lowering("aten::copysign.Tensor", "aten::copysign.Scalar", promote=True)
def copysign(x, y):
    return jnp.copysign(x, y)


@lowering("aten::nan_to_num")
def nan_to_num(x, nan=None, posinf=None, neginf=None):
    if not _is_float(x):
        return x
    fi = jnp.finfo(x.dtype)
    return jnp.nan_to_num(x, nan=0.0 if nan is None else nan,
                          posinf=fi.max if posinf is None else posinf,
                          neginf=fi.min if neginf is None else neginf)


# ---- comparisons and logic ---------------------------------------------------------------

for _n, _f in {"eq": jnp.equal, "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal,
               "gt": jnp.greater, "ge": jnp.greater_equal}.items():
    lowering(f"aten::{_n}.Tensor", f"aten::{_n}.Scalar", promote=True)((lambda f: lambda x, y: f(x, y))(_f))

for _n, _f in {"logical_and": jnp.logical_and, "logical_or": jnp.logical_or,
               "logical_xor": jnp.logical_xor}.items():
    lowering(f"aten::{_n}")((lambda f: lambda x, y: f(x, y))(_f))


@lowering("aten::logical_not")
def logical_not(x):
    return jnp.logical_not(x)


for _n, _f in {"bitwise_and": jnp.bitwise_and, "bitwise_or": jnp.bitwise_or,
               "bitwise_xor": jnp.bitwise_xor}.items():
    lowering(f"aten::{_n}.Tensor", f"aten::{_n}.Scalar", promote=True)((lambda f: lambda x, y: f(x, y))(_f))


@lowering("aten::bitwise_left_shift.Tensor", "aten::bitwise_left_shift.Tensor_Scalar",
          "aten::bitwise_left_shift.Scalar_Tensor", "aten::__lshift__.Tensor", "aten::__lshift__.Scalar",
          promote=True)
def bitwise_left_shift(x, y):
    # XLA gives 0 for shift amounts outside [0, bits), as PyTorch's CPU kernel does.
    return lax.shift_left(*jnp.broadcast_arrays(x, y))


@lowering("aten::bitwise_right_shift.Tensor", "aten::bitwise_right_shift.Tensor_Scalar",
          "aten::bitwise_right_shift.Scalar_Tensor", "aten::__rshift__.Tensor", "aten::__rshift__.Scalar",
          promote=True)
def bitwise_right_shift(x, y):
    x, y = jnp.broadcast_arrays(x, y)
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        return lax.shift_right_arithmetic(x, y)
    return lax.shift_right_logical(x, y)


@lowering("aten::bitwise_not")
def bitwise_not(x):
    return jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.invert(x)


@lowering("aten::isnan")
def isnan(x):
    return jnp.isnan(x) if _is_float(x) else jnp.zeros(x.shape, bool)


@lowering("aten::isinf")
def isinf(x):
    return jnp.isinf(x) if _is_float(x) else jnp.zeros(x.shape, bool)


@lowering("aten::isfinite")
def isfinite(x):
    return jnp.isfinite(x) if _is_float(x) else jnp.ones(x.shape, bool)


@lowering("aten::signbit")
def signbit(x):
    return jnp.signbit(x)


# ---- activations and their backward -------------------------------------------------------

@lowering("aten::relu", promote=True)
def relu(x):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


@lowering("aten::threshold_backward", promote=True)
def threshold_backward(grad, x, threshold):
    return jnp.where(x <= threshold, jnp.zeros((), grad.dtype), grad)


@lowering("aten::threshold", promote=True)
def threshold(x, threshold, value):
    return jnp.where(x <= threshold, value, x)


@lowering("aten::sigmoid_backward", promote=True)
def sigmoid_backward(grad, out):
    return grad * out * (1 - out)


@lowering("aten::tanh_backward", promote=True)
def tanh_backward(grad, out):
    return grad * (1 - out * out)


@lowering("aten::silu", promote=True)
def silu(x):
    return x * jax.nn.sigmoid(x)


@lowering("aten::silu_backward", promote=True)
def silu_backward(grad, x):
    s = jax.nn.sigmoid(x)
    return grad * s * (1 + x * (1 - s))


@lowering("aten::gelu", promote=True)
def gelu(x, approximate="none"):
    return jax.nn.gelu(x, approximate=(approximate == "tanh"))


@lowering("aten::gelu_backward", promote=True)
def gelu_backward(grad, x, approximate="none"):
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        inner = k * (x + 0.044715 * x ** 3)
        t = jnp.tanh(inner)
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)
        return grad * d
    cdf = 0.5 * (1 + lax.erf(x / math.sqrt(2)))
    pdf = jnp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return grad * (cdf + x * pdf)


@lowering("aten::leaky_relu", promote=True)
def leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@lowering("aten::leaky_relu_backward", promote=True)
def leaky_relu_backward(grad, x, negative_slope, self_is_result):
    return jnp.where(x > 0, grad, grad * negative_slope)


@lowering("aten::hardtanh", promote=True)
def hardtanh(x, lo=-1, hi=1):
    return jnp.clip(x, lo, hi)


@lowering("aten::hardtanh_backward", promote=True)
def hardtanh_backward(grad, x, lo, hi):
    return jnp.where((x <= lo) | (x >= hi), jnp.zeros((), grad.dtype), grad)


@lowering("aten::elu", promote=True)
def elu(x, alpha=1, scale=1, input_scale=1):
    return jnp.where(x > 0, x * scale, alpha * scale * jnp.expm1(x * input_scale))


@lowering("aten::elu_backward", promote=True)
def elu_backward(grad, alpha, scale, input_scale, is_result, x):
    if is_result:
        neg = grad * input_scale * (x + alpha * scale)
    else:
        neg = grad * input_scale * alpha * scale * jnp.exp(x * input_scale)
    return jnp.where(x > 0, grad * scale, neg)


@lowering("aten::softplus", promote=True)
def softplus(x, beta=1, threshold=20):
    bx = x * beta
    return jnp.where(bx > threshold, x, jnp.log1p(jnp.exp(bx)) / beta)


@lowering("aten::softplus_backward", promote=True)
def softplus_backward(grad, x, beta, threshold):
    bx = x * beta
    return jnp.where(bx > threshold, grad, grad * jax.nn.sigmoid(bx))


@lowering("aten::hardsigmoid", promote=True)
def hardsigmoid(x):
    return jnp.clip(x / 6 + 0.5, 0, 1)


@lowering("aten::hardswish", promote=True)
def hardswish(x):
    return x * jnp.clip(x / 6 + 0.5, 0, 1)


@lowering("aten::mish", promote=True)
def mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


@lowering("aten::log_sigmoid_forward", promote=True)
def log_sigmoid_forward(x):
    # The buffer is what the CPU kernel stores for its backward: exp(-|x|), shaped as x.
    buf = jnp.exp(-jnp.abs(x))
    return jax.nn.log_sigmoid(x), buf if buf.shape == tuple(out_shape(1)) else jnp.zeros(out_shape(1), x.dtype)


@lowering("aten::log_sigmoid_backward", promote=True)
def log_sigmoid_backward(grad, x, buffer):
    return grad * jax.nn.sigmoid(-x)


# ---- fills ---------------------------------------------------------------------------------

@lowering("aten::fill.Scalar", "aten::fill.Tensor")
def fill(x, value):
    return jnp.broadcast_to(jnp.asarray(value).astype(out_dtype()), x.shape)


@lowering("aten::masked_fill.Scalar", "aten::masked_fill.Tensor")
def masked_fill(x, mask, value):
    return jnp.where(mask, jnp.asarray(value).astype(x.dtype), x)


@lowering("aten::zeros_like")
def zeros_like(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(x.shape, out_dtype())


@lowering("aten::ones_like")
def ones_like(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(x.shape, out_dtype())


@lowering("aten::full_like")
def full_like(x, value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.full(x.shape, value, out_dtype())


# ---- conversions ----------------------------------------------------------------------------

@lowering("aten::_to_copy")
def to_copy(x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    return x.astype(out_dtype())


@lowering("aten::copy")
def copy(x, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(out_dtype()), x.shape)


@lowering("aten::clone", alias=True)
def clone(x, memory_format=None):
    return x


@lowering("aten::alias", "aten::lift_fresh", "aten::detach", "aten::lift", "aten::alias_copy",
          "aten::lift_fresh_copy", "aten::detach_copy", alias=True)
def identity(x):
    return x


@lowering("aten::zero")
def zero(x):
    return jnp.zeros(x.shape, x.dtype)


@lowering("aten::gcd", promote=True)
def gcd(x, y):
    return jnp.gcd(x, y)


@lowering("aten::lcm", promote=True)
def lcm(x, y):
    # PyTorch's: |x / gcd * y| (0 when either is 0), wrapping as int64 products do.
    g = jnp.gcd(x, y)
    return jnp.abs(jnp.where(g == 0, jnp.zeros((), x.dtype), x // jnp.where(g == 0, 1, g).astype(x.dtype)) * y)
