"""The lowering table: aten overload name -> function of jax values.

One table serves every path: the lazy graph executor, eager mode, the dynamo
bridge and StableHLO export. A lowering receives the op's arguments in schema
order, with tensors replaced by `jax.Array`s (or tracers) and everything else as
the Python value, and returns a jax value (or a tuple/list of them for ops with
several outputs). The executor casts each result to the dtype PyTorch's meta
kernel predicted, so lowerings need not repeat PyTorch's type promotion.

Register with the decorator::

    @lowering("aten::add.Tensor", "aten::add.Scalar", promote=True)
    def add(x, y, alpha=1):
        return x + y * alpha if alpha != 1 else x + y

`promote=True` casts every array argument (tensors and scalar parameters) to the
op's common dtype first (PyTorch's elementwise type promotion).
`static=("end",)` names Scalar arguments whose value is part of the program
(e.g. they decide a shape) instead of a graph parameter.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Iterable, Optional

import numpy as np


class Lowering:
    __slots__ = ("name", "fn", "promote", "static", "meta", "opmath", "random", "alias")

    def __init__(self, name, fn, promote, static, meta, opmath, random, alias=False):
        self.alias = alias
        self.name = name
        self.fn = fn
        self.promote = promote
        self.static = frozenset(static)
        self.meta = meta
        self.opmath = opmath
        self.random = random


LOWERINGS: Dict[str, Lowering] = {}


def lowering(*names: str, promote: bool = False, static: Iterable[str] = (), meta: Optional[Callable] = None,
             opmath: bool = False, random: bool = False, alias: bool = False):
    """Registers the decorated function as the lowering of the named aten overloads.

    names: "aten::op.overload" (".default" may be omitted).
    promote: cast array arguments to PyTorch's common dtype before calling.
    opmath: with promote, compute bf16/f16 in f32 and round once (as CPU kernels do).
    static: Scalar arguments that are compile-time constants.
    meta: optional shape function (args as meta tensors -> meta outputs) for ops whose
      PyTorch meta kernel is missing.
    alias: the op returns its first argument's value unchanged (detach, clone, alias...):
      the kernel shares the value instead of adding a node (jax arrays are immutable).
    random: the op draws random numbers; the lowering receives a jax PRNG key as an
      extra last argument (derived from the step's seed parameter and the op's number).
    """
    def deco(fn):
        for n in names:
            key = _normalize(n)
            LOWERINGS[key] = Lowering(key, fn, promote, static, meta, opmath, random, alias)
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
    """What the executor knows about the node being lowered (its output avals)."""
    out = None  # tuple of (shape, np dtype)
    node = None
    axis = None  # the replica axis name inside a multi-process program, else None
    world = 1    # number of replicas on that axis


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


def load_all() -> None:
    """Imports every lowering family (each registers itself)."""
    from . import (elementwise, reductions, shape_ops, nn_ops, indexing, factories,  # noqa: F401
                   linalg, random_ops, collectives, foreach, fft, special)
