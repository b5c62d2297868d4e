"""The lowering table itself: `Lowering`, the `lowering` decorator, the lowering context
and `apply`, the one entry through which a lowering runs (see the package docstring)."""
from __future__ import annotations

import threading
from typing import Callable, Dict, Iterable, Optional, Sequence

from ..pjrt import is_complex32


class Lowering:
    __slots__ = ("name", "fn", "promote", "static", "meta", "random", "alias", "checked")

    def __init__(self, name, fn, promote, static, meta, random, alias=False, checked=False):
        self.alias = alias
        self.checked = checked
        self.name = name
        self.fn = fn
        self.promote = promote
        self.static = frozenset(static)
        self.meta = meta
        self.random = random


LOWERINGS: Dict[str, Lowering] = {}

# The precision of matrix products and convolutions (`torch_xla.backends.
# set_mat_mul_precision`): "default", "high" or "highest"; it decides how graphs are
# lowered, so changing it empties the compile cache (executor.set_mat_mul_precision).
_MATMUL_PRECISION = ["highest"]


def matmul_precision() -> str:
    """The precision lowerings pass to jax's dot and convolution ops."""
    return _MATMUL_PRECISION[0]


def set_matmul_precision(precision: str) -> None:
    _MATMUL_PRECISION[0] = precision


def lowering(*names: str, promote: bool = False, static: Iterable[str] = (), meta: Optional[Callable] = None,
             random: bool = False, alias: bool = False, checked: bool = False):
    """Registers the decorated function as the lowering of the named aten overloads.

    names: "aten::op.overload" (".default" may be omitted).
    promote: cast array arguments to PyTorch's common dtype before calling (the kernel
      computes bf16/f16 in f32 and rounds once, as CPU kernels do).
    static: Scalar arguments that are compile-time constants.
    meta: optional shape function (args as meta tensors -> meta outputs) for ops whose
      PyTorch meta kernel is missing.
    alias: the op returns its first argument's value unchanged (detach, clone, alias...):
      the kernel shares the value instead of adding a node (jax arrays are immutable).
    random: the op draws random numbers; the lowering receives a jax PRNG key as an
      extra last argument (derived from the step's seed parameter and the op's number).
    checked: the lowering records device-side checks of its values (`check_range`,
      `check_nonzero`); its nodes remember the user's source line that created them, for
      the error.
    """
    def deco(fn):
        for n in names:
            key = _normalize(n)
            LOWERINGS[key] = Lowering(key, fn, promote, static, meta, random, alias, checked)
        return fn
    return deco


def _normalize(name: str) -> str:
    if name.startswith("aten::"):
        name = name[len("aten::"):]
    elif "::" in name:
        return name  # an engine op (xla::...)
    if "." not in name:
        name += ".default"
    return name


class _Ctx(threading.local):
    """What a lowering may know beyond its arguments: its outputs' avals, the program's
    replica axis, and the platform's choices. Set by `apply` and by the program strategy."""
    out = None  # tuple of (shape, np dtype) of the node being lowered
    axis = None  # the replica axis name inside a multi-process program, else None
    world = 1    # number of replicas on that axis
    patch_convolutions = False  # lower convolutions as patch products (conv_cpu)
    widen_int4_dots = False  # int4 dot operands widened to s8 (a backend without s4 dots)
    library_products = ""  # which float32 products call the platform's BLAS handler (blas_cpu)
    source = None  # (node, output index) -> its value already lowered in this program, or None
    checks = None  # while a program is traced with index checks: where `check_range` records them
    node = None    # the IR node being lowered (set by the executor when checks are recorded)
    manual_text = False  # manual region edges as XLA's SPMD custom calls (HLO text of an unfinished region)


ctx = _Ctx()


def out_dtype(i: int = 0):
    """The device dtype of output `i` of the node being lowered."""
    return ctx.out[i][1]


def out_shape(i: int = 0):
    return ctx.out[i][0]


def rng_key(seed, counter: int):
    """The PRNG key of one random op: the step's seed folded with the op's number
    (SplitMix64, `prng.py`)."""
    import jax
    from . import prng
    return jax.random.fold_in(jax.random.key(seed.astype("uint32") if hasattr(seed, "astype") else seed,
                                             impl=prng.impl()), counter)


def check_range(index, size: int, exc: type, message: str, nonneg: bool = False, ignore=None) -> None:
    """Records a device-side check that every element of `index` lies in [-size, size)
    (`nonneg`: [0, size)), elements equal to `ignore` excepted. The program reports the
    first failing element; the executor raises `exc(message)` with `{value}` and `{pos}`
    (its flat position) filled in. A no-op unless the executor asked for checks."""
    checks = ctx.checks
    if checks is None or index.size == 0:
        return
    import jax.numpy as jnp
    idx = jnp.reshape(index, (-1,))
    bad = (idx < (0 if nonneg else -size)) | (idx >= size)
    if ignore is not None:
        bad = bad & (idx != ignore)
    _record_first(checks, bad, idx, exc, message)


def check_whole(values, exc: type, message: str, ignore=None) -> None:
    """Records a device-side check that every element of floating `values` is a whole
    number (elements equal to `ignore` excepted); `{pos}` in `message` is the first
    failing element's flat position. A no-op unless the executor asked for checks."""
    checks = ctx.checks
    if checks is None or values.size == 0:
        return
    import jax.numpy as jnp
    v = jnp.reshape(values, (-1,))
    bad = v != jnp.floor(v)
    if ignore is not None:
        bad = bad & (v != ignore)
    _record_first(checks, bad, None, exc, message)


def check_nonzero(values, exc: type, message: str) -> None:
    """Records a device-side check that no element of `values` (an array or a Python
    number) is zero. A no-op unless the executor asked for checks, and for a Python
    number that is not zero."""
    checks = ctx.checks
    if checks is None:
        return
    import jax.numpy as jnp
    if not hasattr(values, "shape"):
        if values != 0:
            return
        values = jnp.zeros((1,), jnp.int32)
    if values.size == 0:
        return
    # No value or position to report: one or-reduction, cheaper than `_record_first`'s.
    zero = jnp.zeros((), jnp.int64)
    checks.append((jnp.any(values == 0), zero, zero, (exc, message, ctx.node)))


def _record_first(checks: list, bad, flat, exc: type, message: str) -> None:
    """Appends the check (failed?, value, position) of the first True of the flat `bad`;
    the value is `flat`'s element there (0 without `flat`)."""
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    n = bad.shape[0]
    it = np.int32 if n < 2 ** 31 - 1 else np.int64
    # The first failing position as one min-reduction (n when none fails): cheaper to
    # compile than argmax's (value, index) reduction plus a separate any().
    pos = jnp.min(jnp.where(bad, lax.iota(it, n), it(n)))
    first = jnp.minimum(pos, it(n - 1))
    value = jnp.zeros((), jnp.int64) if flat is None else lax.dynamic_index_in_dim(flat, first, keepdims=False)
    checks.append((pos < n, value, first, (exc, message, ctx.node)))


class LoweringError(RuntimeError):
    """A lowering failed or returned a value that is not what its op promises."""


def apply(low: Lowering, args: tuple, out_avals: Sequence[Optional[tuple]], compute_dtype=None) -> tuple:
    """Applies one lowering: the single entry every path uses (the lazy executor, eager
    mode, and traced programs).

    args: the op's arguments in schema order, arrays as jax values (for a random op, the
    last two are the seed and the op's number); out_avals: (shape, numpy dtype) per output
    (None for an output the op does not produce); compute_dtype: with `promote`, the dtype
    every array argument is cast to first. Returns one jax value per output, cast to its
    dtype; an output of another shape is a LoweringError.
    """
    import jax.numpy as jnp
    if low.random:
        args = args[:-2] + (rng_key(args[-2], args[-1]),)
    if low.promote and compute_dtype is not None:
        args = _cast_arrays(args, compute_dtype)
    ctx.out = tuple(out_avals)
    if "::" not in low.name and out_avals and all(a is None or 0 in a[0] for a in out_avals):
        # Only empty results: nothing to compute (as on the CPU), and reductions over an
        # empty axis would have no identity to trace with.
        return tuple(None if a is None else jnp.zeros(a[0], a[1]) for a in out_avals)
    out = low.fn(*args)
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(out) != len(out_avals):
        raise LoweringError(f"lowering of {low.name} returned {len(out)} values, expected {len(out_avals)}")
    res = []
    for o, aval in zip(out, out_avals):
        if o is None or aval is None:
            res.append(None)
            continue
        shape, dtype = aval
        o = jnp.asarray(o)
        if o.dtype != dtype:
            o = o.astype(dtype)
        if is_complex32(dtype):
            o = round_complex32(o)
        if tuple(o.shape) != tuple(shape):
            raise LoweringError(
                f"lowering of {low.name} produced shape {tuple(o.shape)}, expected {tuple(shape)}")
        res.append(o)
    return tuple(res)


def round_complex32(o):
    """A complex64 value rounded to complex32 (float16 parts), as PyTorch stores each
    complex32 result."""
    import jax
    import jax.numpy as jnp
    re = jnp.real(o).astype(jnp.float16).astype(jnp.float32)
    im = jnp.imag(o).astype(jnp.float16).astype(jnp.float32)
    return jax.lax.complex(re, im)


def _map_arrays(a, fn):
    t = type(a)
    if t is tuple or t is list:
        return t(_map_arrays(x, fn) for x in a)
    return fn(a) if hasattr(a, "dtype") and hasattr(a, "shape") else a


def _cast_arrays(a, dtype):
    """The arrays of `a` (nested tuples / lists) cast to the computation dtype; complex32
    operands, scalars too, rounded to complex32 values, as in PyTorch's kernels."""
    c32 = is_complex32(dtype)

    def cast(x):
        x = x if x.dtype == dtype else x.astype(dtype)
        return round_complex32(x) if c32 else x
    return _map_arrays(a, cast)
