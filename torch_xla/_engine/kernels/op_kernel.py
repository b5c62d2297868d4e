"""The generic kernel of a lowered aten overload: the call becomes an IR node.

It runs the overload's argument plan (`plan.py`) step by step: tensor arguments become
operands, Scalars graph parameters (or constants for 0 and 1), everything else a static
argument. Output shapes and dtypes come from a cache filled once per (op, input avals,
static args) by PyTorch's meta kernel (`shapes.py`), so shape errors surface here, at the
op's line, with PyTorch's own exception; an entry the meta kernel cannot compute sends
the op to the CPU fallback. The specialised kernels (`specialise.py`) are generated from
the same plan and call this one for anything unusual.
"""
from __future__ import annotations

import time
from typing import Any, Dict

import torch

from .. import executor, ir, telemetry, rng
from ..lowering import Lowering
from ..mode import modes
from ..tensor import is_functional, make_alias, make_tensor, state_of, with_strides, wrap_user
from . import fallback, shapes, values
from .shapes import ShapeEntry
from .plan import ArgPlan, add_params, freeze  # noqa: F401 (freeze: imported from here by other modules)

_now = time.perf_counter_ns
KERNELS: Dict[str, "OpKernel"] = {}
_LIFTS = ("aten::lift_fresh", "aten::lift")


def _meta_alias(op, args, kwargs):
    """The alias of a meta tensor carrying the xla keys: the data of a Dynamo fake tensor,
    which `FakeTensor.__new__` detaches. The result must not be a plain Python tensor (the
    fake tensor adopts it), so it is made as an (uninitialised) FakeTensor object, below
    the xla key."""
    from torch._subclasses.fake_tensor import FakeTensor
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)):
        return torch.Tensor._make_subclass(FakeTensor, args[0])


def _add_seed(argv: list, ops: list) -> None:
    """A random op's last arguments: the step's seed (an operand) and the op's number."""
    _, counter = rng.next_op()
    argv.append(ir.ref(len(ops)))
    ops.append((rng.seed_node(), 0))
    argv.append(counter)


class OpKernel:
    """The kernel of one lowered aten overload."""

    def __init__(self, op: torch._ops.OpOverload, low: Lowering):
        self.op = op
        self.low = low
        self.name = op.name()  # aten::add.Tensor
        self.plan = plan = ArgPlan(op, low.static)
        self.kinds = plan.kinds
        self.defaults = plan.defaults
        self.index_of = plan.index_of
        self.signature = plan.signature
        self.nargs = plan.nargs
        self.is_factory = plan.is_factory
        # Keyword-only arguments come last in a schema: the CPU fallback passes them by name.
        self.kwarg_only = tuple(a.name for a in op._schema.arguments if a.kwarg_only)
        # The steps' `run`s, bound once: the generic kernel calls one per argument.
        self.runs = tuple(step.run for step in plan.steps)
        self.cache: Dict[Any, ShapeEntry] = {}
        # The entries of one output that build a node here (no CPU fallback): the
        # specialised kernels' common case looks its key up in this one only.
        self.one: Dict[Any, ShapeEntry] = {}
        self.fast = None  # the specialised kernel, once generated (specialise.py)
        # `xla::<op>`: IR nodes this op made (shared by its overloads).
        self.op_count = telemetry.cell("xla::" + op._schema.name.rpartition("::")[2])

    def __call__(self, *args, **kwargs):
        """The generic kernel, timed as `LazyTracing` (the specialised kernels are counted
        by `xla::<op>` only): each argument's step (`plan.Step.run`), the shape entry, then
        the node. One function with the usual calls' branches inline: this path is taken
        by every op the specialised kernels leave or do not have."""
        t0 = _now()
        try:
            low = self.low
            if low.alias:
                return self._alias(args, kwargs)
            if kwargs or len(args) < self.nargs:
                args = self._in_schema_order(args, kwargs)
            key, argv, ops, scalars = [self.name], [], [], []
            for run, v in zip(self.runs, args):
                run(v, key, argv, ops, scalars)
            key = tuple(key)
            entry = self.cache.get(key)
            if entry is None:
                entry = self._infer(key, args)
            if entry.fallback:
                return self._fallback(args)
            if scalars:
                add_params(scalars, entry.common, argv, ops)
            if low.random:
                _add_seed(argv, ops)
            self.op_count[0] += 1
            ops, argv = tuple(ops), tuple(argv)
            # ir.Node without the class call, as the specialised kernels make it
            node = ir.make_node(self.name, ops, argv, entry.avals, low, entry.common if low.promote else None,
                                ir.node_hash(entry.base, argv, ops))
            if entry.structure == "one" and not modes.eager:
                shape, dtype = entry.avals[0]
                out = make_tensor(node, 0, shape, dtype)
                return wrap_user(out) if self.is_factory else out
            return self._outputs(node, entry)
        finally:
            telemetry.add_sample("LazyTracing", _now() - t0)

    def _in_schema_order(self, args: tuple, kwargs: dict) -> list:
        """Every argument, positionally (defaults for those not given)."""
        if self.is_factory and "device" in kwargs:
            values.check_device(kwargs["device"])
        n = len(args)
        args = list(args) + self.defaults[n:]
        for k, v in kwargs.items():
            args[self.index_of[k]] = v
        return args

    def _fallback(self, args):
        """The CPU fallback of the op with `args` (every argument, in schema order): the
        keyword-only ones by name, as the op takes them."""
        n = len(args) - len(self.kwarg_only)
        return fallback.cpu_fallback(self.op, list(args[:n]), dict(zip(self.kwarg_only, args[n:])))

    def _infer(self, key: tuple, args) -> ShapeEntry:
        """The shape entry of `key`, on its first call (`shapes.infer`)."""
        entry = shapes.infer(self, args)
        entry.base = ir.node_base(self.name, entry.avals, entry.common if self.low.promote else None)
        self.cache[key] = entry
        if not entry.fallback and entry.structure == "one":
            self.one[key] = entry
        return entry

    def _alias(self, args, kwargs):
        """A view op's result: a new tensor holding its input's value."""
        x = args[0]
        if is_functional(x):
            # Reached without functionalization (torch.tensor(..., device=) lifts its
            # result this way): keep the result a functional tensor.
            if self.name in _LIFTS:
                return x
            return wrap_user(self._strided(make_alias(state_of(x)), x))
        try:
            s = state_of(x)
        except RuntimeError:
            if x.device.type != "meta":
                raise
            return _meta_alias(self.op, args, kwargs)
        out = self._strided(make_alias(s), x)
        if self.name in _LIFTS:
            # torch.tensor(data, device=xla) moves its data with functionalization
            # excluded, then lifts the result: this is where it becomes a user tensor.
            return wrap_user(out)
        return out

    def _strided(self, out, x):
        """An alias (`detach`, `alias`, ...) reports its input's strides (a transposition's
        are eager's); a clone is contiguous (`contiguous()` is a clone)."""
        return out if self.name == "aten::clone" else with_strides(out, x.stride())

    def _outputs(self, node, entry):
        """The result tensors of a node with several outputs, or in eager mode."""
        outs = [None if a is None else make_tensor(node, i, a[0], a[1]) for i, a in enumerate(entry.avals)]
        if modes.eager:
            executor.execute([o._xla for o in outs if o is not None], metric="EagerOpExecuteTime")
        if self.is_factory:
            outs = [wrap_user(o) if o is not None else None for o in outs]
        st = entry.structure
        if st == "one":
            return outs[0]
        return tuple(outs) if st == "tuple" else outs


def to_copy(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` converted to `dtype` on the device (inner tensors, no dispatch)."""
    return KERNELS["_to_copy.default"](x, dtype=dtype)


def copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`aten::copy(dst, src)` on inner tensors: src's value in dst's dtype and shape."""
    return KERNELS["copy.default"](dst, src)
