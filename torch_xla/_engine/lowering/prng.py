"""The device's random bit generator: SplitMix64 as a jax PRNG implementation.

Every random op's lowering draws from `jax.random` with a key made here. jax's default
generator (threefry2x32, 20 rounds per 64 bits) is a large expression that XLA:CPU
compiles slowly: about 0.3-0.4 s more per program with one random op, several tenths
more with a few dropout sites, and it runs 3-6x slower than this one
(`bench/bench_rng.py`). SplitMix64 is a counter-based generator: element i of a
stream with key k is mix64(k + (i + 1) * golden), where mix64 is the SplitMix64 output
function (two multiply-xorshift rounds); the sequence of outputs is SplitMix64's, which
passes BigCrush. Keys of different ops (seed folded with the op's number) and split
keys go through mix64 with distinct constants, so streams start at unrelated points of
the 2^64 cycle.

The key is two uint32 words (high, low) of one 64-bit state; the arithmetic is in
uint64 (the engine runs jax with x64 on).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

_GOLDEN = 0x9E3779B97F4A7C15
_FOLD = 0x632BE59BD9B4E019
_SPLIT = 0xD1B54A32D192ED03
_IMPL = None


def _mix64(z):
    u = jnp.uint64
    z = (z ^ (z >> u(30))) * u(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> u(27))) * u(0x94D049BB133111EB)
    return z ^ (z >> u(31))


def _to64(k):
    return (k[..., 0].astype(jnp.uint64) << jnp.uint64(32)) | k[..., 1].astype(jnp.uint64)


def _from64(z):
    return jnp.stack([(z >> jnp.uint64(32)).astype(jnp.uint32), z.astype(jnp.uint32)], axis=-1)


def _counters(n: int):
    return lax.iota(jnp.uint64, n) + jnp.uint64(1)


def _seed(s):
    return _from64(_mix64(jnp.asarray(s).astype(jnp.uint64) + jnp.uint64(_GOLDEN)))


def _fold_in(k, data):
    d = jnp.asarray(data).astype(jnp.uint64) * jnp.uint64(_GOLDEN) + jnp.uint64(_FOLD)
    return _from64(_mix64(_to64(k) ^ _mix64(d)))


def _split(k, shape):
    shape = tuple(int(d) for d in shape)
    start = _mix64(_to64(k) ^ jnp.uint64(_SPLIT))
    keys = _mix64(start + _counters(int(np.prod(shape, dtype=np.int64))) * jnp.uint64(_GOLDEN))
    return _from64(keys).reshape(shape + (2,))


def _random_bits(k, bit_width: int, shape):
    shape = tuple(int(d) for d in shape)
    z = _mix64(_to64(k) + _counters(int(np.prod(shape, dtype=np.int64))) * jnp.uint64(_GOLDEN))
    if bit_width != 64:
        # The high bits: the output function mixes them best.
        z = (z >> jnp.uint64(64 - bit_width)).astype(jnp.dtype(f"uint{bit_width}"))
    return z.reshape(shape)


def impl():
    """The jax PRNG implementation (defined once, on first use)."""
    global _IMPL
    if _IMPL is None:
        import jax.extend.random as jxr
        _IMPL = jxr.define_prng_impl(key_shape=(2,), seed=_seed, split=_split,
                                     random_bits=_random_bits, fold_in=_fold_in,
                                     name="splitmix64", tag="sm64")
    return _IMPL
