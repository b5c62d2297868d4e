"""Random ops. Each is registered with `random=True`: the lowering gets a jax PRNG key
as its last argument (the step's seed folded with the op's number in the step), so a
step's graph is the same every step while its numbers differ.

Under functionalization the in-place samplers (`uniform_`, `normal_`, `bernoulli_`,
`random_`, `exponential_`, ...) reach us as their functional forms; the `*_like`
factories and `randint` are lowered directly because their composite kernels would
otherwise run `empty(...).random_()` below functionalization (a CPU fallback).
`generator=` arguments are ignored (the device has one generator: the step seed).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .table import lowering, out_dtype, out_shape


def _shape_dtype():
    return out_shape(), jnp.dtype(out_dtype())


def _fdt(dt):
    """The dtype in which to draw floats for an output of dtype dt."""
    dt = jnp.dtype(dt)
    if dt == jnp.float64:
        return dt
    return jnp.dtype(jnp.float32)


def _uniform01(key, shape, dt):
    return jax.random.uniform(key, shape, _fdt(dt))


# ---- uniform / normal ------------------------------------------------------------------------

@lowering("aten::uniform", random=True)
def uniform(x, lo=0.0, hi=1.0, generator=None, key=None):
    shape, dt = _shape_dtype()
    fdt = _fdt(dt)
    u = jax.random.uniform(key, shape, fdt)
    return (lo + u * (hi - lo)).astype(dt)


def _normal(key, shape, dt, mean, std):
    fdt = _fdt(dt)
    z = jax.random.normal(key, shape, fdt)
    return mean + std * z


@lowering("aten::normal_functional", random=True)
def normal_functional(x, mean=0.0, std=1.0, generator=None, key=None):
    shape, dt = _shape_dtype()
    return _normal(key, shape, dt, mean, std)


@lowering("aten::normal.Tensor_float", random=True)
def normal_tensor_float(mean, std=1.0, generator=None, key=None):
    shape, dt = _shape_dtype()
    return _normal(key, shape, dt, mean.astype(_fdt(dt)), std)


@lowering("aten::normal.float_Tensor", random=True)
def normal_float_tensor(mean, std, generator=None, key=None):
    shape, dt = _shape_dtype()
    return _normal(key, shape, dt, mean, std.astype(_fdt(dt)))


@lowering("aten::normal.Tensor_Tensor", random=True)
def normal_tensor_tensor(mean, std, generator=None, key=None):
    shape, dt = _shape_dtype()
    return _normal(key, shape, dt, mean.astype(_fdt(dt)), std.astype(_fdt(dt)))


@lowering("aten::normal.float_float", random=True)
def normal_float_float(mean, std, size, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
                       key=None):
    shape, dt = _shape_dtype()
    return _normal(key, shape, dt, mean, std)


# ---- factories -------------------------------------------------------------------------------

@lowering("aten::rand", random=True)
def rand(size, dtype=None, layout=None, device=None, pin_memory=None, key=None):
    shape, dt = _shape_dtype()
    return _uniform01(key, shape, dt)


@lowering("aten::randn", random=True)
def randn(size, dtype=None, layout=None, device=None, pin_memory=None, key=None):
    shape, dt = _shape_dtype()
    return jax.random.normal(key, shape, _fdt(dt))


@lowering("aten::rand_like", random=True)
def rand_like(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key=None):
    shape, dt = _shape_dtype()
    return _uniform01(key, shape, dt)


@lowering("aten::randn_like", random=True)
def randn_like(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key=None):
    shape, dt = _shape_dtype()
    return jax.random.normal(key, shape, _fdt(dt))


def _max_int(dt):
    """The exclusive upper bound of random_() without bounds (PyTorch's choice per dtype)."""
    dt = jnp.dtype(dt)
    if dt == jnp.bool_:
        return 2
    if jnp.issubdtype(dt, jnp.integer):
        return int(jnp.iinfo(dt).max) + 1
    # floats: integers exactly representable, [0, 2^digits]
    digits = {jnp.dtype(jnp.float64): 53, jnp.dtype(jnp.float32): 24,
              jnp.dtype(jnp.float16): 11, jnp.dtype(jnp.bfloat16): 8}.get(dt, 24)
    return (1 << digits) + 1


def _randint(key, shape, lo, hi, dt):
    """Uniform integers in [lo, hi), returned in dtype dt."""
    lo, hi = int(lo), int(hi)
    if hi > np.iinfo(np.int64).max:
        if lo == 0:  # [0, 2^63): 63 random bits
            return (jax.random.bits(key, shape, jnp.uint64) >> np.uint64(1)).astype(jnp.int64).astype(dt)
        # a span beyond int64: reduced in uint64, shifted by lo modulo 2^64
        bits = jax.random.bits(key, shape, jnp.uint64) % np.uint64(hi - lo) + np.uint64(lo % (1 << 64))
        return jax.lax.bitcast_convert_type(bits, jnp.int64).astype(dt)
    v = jax.random.randint(key, shape, lo, hi, jnp.int64)
    return v.astype(dt)


@lowering("aten::random", random=True)
def random_default(x, generator=None, key=None):
    shape, dt = _shape_dtype()
    return _randint(key, shape, 0, _max_int(dt), dt)


def _check_from_to(x, lo, hi):
    """PyTorch's checks of random_'s bounds (its meta kernel has none): `lo` < `hi`, and
    both ends of the interval representable in x's dtype."""
    dt = x.dtype
    if hi is not None:
        if lo >= hi:
            raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={lo} >= to={hi}")
        top = hi - 1
    elif dt.is_floating_point:
        top = 1 << _DIGITS[dt]
        if lo >= top:
            raise RuntimeError(f"random_ expects 'from' casted to dtype to be less than or equal to "
                               f"'to_inc' casted to dtype, but got from={lo} > to_inc={top}")
    else:
        top = 1 if dt == torch.bool else torch.iinfo(dt).max
    info = torch.finfo(dt) if dt.is_floating_point else (torch.iinfo(dt) if dt != torch.bool else None)
    mn, mx = (0, 1) if info is None else (info.min, info.max)
    for what, v in (("from", lo), ("to - 1", top)):
        if not mn <= v <= mx:
            raise RuntimeError(f"{what} is out of bounds for {_C_TYPE.get(dt, dt)}")


_DIGITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
_C_TYPE = {torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16", torch.float32: "float",
           torch.float64: "double", torch.int64: "long int", torch.int32: "int", torch.int16: "short int",
           torch.int8: "signed char", torch.uint8: "unsigned char", torch.bool: "bool"}


def _meta_random_from(x, lo, hi=None, generator=None):
    _check_from_to(x, lo, hi)
    return torch.empty_like(x)


def _meta_random_to(x, hi, generator=None):
    _check_from_to(x, 0, hi)
    return torch.empty_like(x)


@lowering("aten::random.from", random=True, meta=_meta_random_from)
def random_from(x, lo, hi=None, generator=None, key=None):
    shape, dt = _shape_dtype()
    if hi is None:
        hi = _max_int(dt)
    return _randint(key, shape, lo, hi, dt)


@lowering("aten::random.to", random=True, meta=_meta_random_to)
def random_to(x, hi, generator=None, key=None):
    shape, dt = _shape_dtype()
    return _randint(key, shape, 0, hi, dt)


@lowering("aten::randint", random=True)
def randint(high, size, dtype=None, layout=None, device=None, pin_memory=None, key=None):
    shape, dt = _shape_dtype()
    return _randint(key, shape, 0, high, dt)


@lowering("aten::randint.low", random=True)
def randint_low(low, high, size, dtype=None, layout=None, device=None, pin_memory=None, key=None):
    shape, dt = _shape_dtype()
    return _randint(key, shape, low, high, dt)


@lowering("aten::randint_like", random=True)
def randint_like(x, high, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key=None):
    shape, dt = _shape_dtype()
    return _randint(key, shape, 0, high, dt)


@lowering("aten::randint_like.low_dtype", random=True)
def randint_like_low(x, low, high, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None,
                     key=None):
    shape, dt = _shape_dtype()
    return _randint(key, shape, low, high, dt)


@lowering("aten::randperm", random=True)
def randperm(n, dtype=None, layout=None, device=None, pin_memory=None, key=None):
    shape, dt = _shape_dtype()
    return jax.random.permutation(key, jnp.arange(n, dtype=jnp.int64)).astype(dt)


# ---- bernoulli -------------------------------------------------------------------------------

@lowering("aten::bernoulli", random=True)
def bernoulli(p, generator=None, key=None):
    shape, dt = _shape_dtype()
    u = jax.random.uniform(key, shape, _fdt(p.dtype))
    return (u < p).astype(dt)


@lowering("aten::bernoulli.p", random=True)
def bernoulli_p(x, p=0.5, generator=None, key=None):
    shape, dt = _shape_dtype()
    u = jax.random.uniform(key, shape, jnp.float64 if jnp.dtype(dt) == jnp.float64 else jnp.float32)
    return (u < p).astype(dt)


@lowering("aten::bernoulli.Tensor", random=True)
def bernoulli_tensor(x, p, generator=None, key=None):
    shape, dt = _shape_dtype()
    fdt = jnp.float64 if p.dtype == jnp.float64 else jnp.float32
    u = jax.random.uniform(key, shape, fdt)
    return (u < jnp.broadcast_to(p.astype(fdt), shape)).astype(dt)


# ---- other distributions ----------------------------------------------------------------------

@lowering("aten::exponential", random=True)
def exponential(x, lambd=1.0, generator=None, key=None):
    shape, dt = _shape_dtype()
    return jax.random.exponential(key, shape, _fdt(dt)) / lambd


@lowering("aten::geometric", random=True)
def geometric(x, p, generator=None, key=None):
    # number of Bernoulli(p) trials up to the first success: support {1, 2, ...}
    shape, dt = _shape_dtype()
    fdt = _fdt(dt) if jnp.issubdtype(dt, jnp.floating) else jnp.dtype(jnp.float64)
    # u in (0, 1]: a draw of 0 from [0, 1) would stand for the whole lowest bucket of
    # width 2^-23 (float32), not for the smallest float (a trial count of ~300 at p=0.25)
    u = 1.0 - jax.random.uniform(key, shape, fdt)
    k = jnp.floor(jnp.log(u) / math.log1p(-p)) + 1 if p < 1 else jnp.ones(shape, fdt)
    return k.astype(dt)


@lowering("aten::log_normal", random=True)
def log_normal(x, mean=1.0, std=2.0, generator=None, key=None):
    shape, dt = _shape_dtype()
    return jnp.exp(_normal(key, shape, dt, mean, std))


@lowering("aten::cauchy", random=True)
def cauchy(x, median=0.0, sigma=1.0, generator=None, key=None):
    shape, dt = _shape_dtype()
    return median + sigma * jax.random.cauchy(key, shape, _fdt(dt))


@lowering("aten::multinomial", random=True, static=("num_samples",))
def multinomial(probs, num_samples, replacement=False, generator=None, key=None):
    # Rows of non-negative weights (not necessarily normalised). With replacement: a
    # categorical draw per sample; without: Gumbel top-k (sampling without replacement
    # in proportion to the weights).
    fdt = jnp.float64 if probs.dtype == jnp.float64 else jnp.float32
    p = probs.astype(fdt)
    two_d = p.ndim == 2
    if not two_d:
        p = p[None]
    logits = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1)), -jnp.inf)
    if replacement:
        out = jax.random.categorical(key, logits, axis=-1, shape=(num_samples, p.shape[0])).T
    else:
        g = jax.random.gumbel(key, p.shape, fdt)
        _, out = jax.lax.top_k(logits + g, num_samples)
    out = out.astype(jnp.int64)
    return out if two_d else out[0]
