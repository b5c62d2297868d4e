"""Computations the user built by hand (`torch_xla.core.xla_builder`), applied to tensors.

The static argument is the computation object itself: it hashes and compares by the
text of its program, so two computations built alike share one compiled graph.
"""
from __future__ import annotations

from .table import lowering, matmul_precision


@lowering("xla::user_computation")
def user_computation(*args):
    """args: the inputs' jax values, the op's name, the computation. Returns the
    computation's result as its leaves."""
    comp = args[-1]
    return tuple(comp.flat_call(*args[:-2]))


@lowering("xla::dot_general")
def dot_general(lhs, rhs, dimension_numbers, preferred):
    """XLA's DotGeneral: ((lhs contracting, rhs contracting), (lhs batch, rhs batch))."""
    from jax import lax
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=matmul_precision(),
                           preferred_element_type=preferred)
