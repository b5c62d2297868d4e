"""The generic kernel of a lowered aten overload: the call becomes an IR node.

Tensor arguments become operands, Scalars graph parameters (or constants for 0 and 1),
everything else a static argument (`plan.py`). Output shapes and dtypes come from a
cache filled once per (op, input avals, static args) by PyTorch's meta kernel
(`shapes.py`), so shape errors surface here, at the op's line, with PyTorch's own
exception; an entry the meta kernel cannot compute sends the op to the CPU fallback.
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict

import torch

from .. import executor, ir, metrics, rng, runtime
from ..lowering import Lowering
from ..mode import EAGER
from ..tensor import XlaState, is_functional, make_alias, make_tensor, state_of, wrap_user
from . import fallback, shapes, values
from .shapes import ShapeEntry
from .plan import (OPT_SCALAR, OPT_TENSOR, OPT_TENSOR_LIST, SCALAR, STATIC, TENSOR, ArgPlan,
                   special_scalars)

REFS = ir.REFS
_now = time.perf_counter_ns
# Read once: the hot path tests it on every Scalar (see plan.special_scalars).
NO_SPECIAL_SCALARS = not special_scalars()
KERNELS: Dict[str, "OpKernel"] = {}


def freeze(v):
    if isinstance(v, list):
        return tuple(freeze(x) for x in v)
    if isinstance(v, torch.SymInt):
        return int(v)
    return v


def _scalar_state(t: torch.Tensor) -> XlaState:
    """A 0-d CPU tensor mixed with XLA tensors: it becomes a graph parameter."""
    v = t.item()
    node = ir.ScalarParam(v, t.dtype)
    return XlaState(node, 0, (), t.dtype)


def _tensor_state(t, op_name):
    if t.device.type == "xla":
        try:
            return t._xla
        except AttributeError:
            return state_of(t)
    if t.dim() == 0 and t.device.type == "cpu":
        return None  # handled by the caller as a wrapped scalar
    raise RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"xla:{runtime.device_index()} and {t.device}! (when checking argument for {op_name})")


def _meta_alias(op, args, kwargs):
    """The alias of a meta tensor carrying the xla keys: the data of a Dynamo fake tensor,
    which `FakeTensor.__new__` detaches. The result must not be a plain Python tensor (the
    fake tensor adopts it), so it is made as an (uninitialised) FakeTensor object, below
    the xla key."""
    from torch._subclasses.fake_tensor import FakeTensor
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)):
        return torch.Tensor._make_subclass(FakeTensor, args[0])


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
        self.cache: Dict[Any, ShapeEntry] = {}
        # The entries of one output that build a node here (no CPU fallback): the
        # specialised kernels' common case looks its key up in this one only.
        self.one: Dict[Any, ShapeEntry] = {}
        self.fast = None  # the specialised kernel, once generated (specialise.py)
        # `xla::<op>`: IR nodes this op made (shared by its overloads).
        self.op_count = metrics.cell("xla::" + op._schema.name.rpartition("::")[2])

    def __call__(self, *args, **kwargs):
        """The generic kernel, timed as `LazyTracing` (the specialised fast path is not
        timed: it is counted by `xla::<op>` only)."""
        t0 = _now()
        try:
            return self.trace(*args, **kwargs)
        finally:
            metrics.add_sample("LazyTracing", _now() - t0)

    # -- the generic path ------------------------------------------------------------
    def trace(self, *args, **kwargs):
        if self.low.alias:
            x = args[0]
            if is_functional(x):
                # Reached without functionalization (torch.tensor(..., device=) lifts its
                # result this way): keep the result a functional tensor.
                if self.name in ("aten::lift_fresh", "aten::lift"):
                    return x
                return wrap_user(make_alias(state_of(x)))
            try:
                s = state_of(x)
            except RuntimeError:
                if x.device.type != "meta":
                    raise
                return _meta_alias(self.op, args, kwargs)
            out = make_alias(s)
            if self.name in ("aten::lift_fresh", "aten::lift"):
                # torch.tensor(data, device=xla) moves its data with functionalization
                # excluded, then lifts the result: this is where it becomes a user tensor.
                return wrap_user(out)
            return out
        n = len(args)
        if self.is_factory and "device" in kwargs:
            values.check_device(kwargs["device"])
        if n < self.nargs or kwargs:
            args = list(args) + self.defaults[n:]
            for k, v in kwargs.items():
                args[self.index_of[k]] = v
        operands = []
        argv = []
        key = [self.name]
        scalars = None
        i = 0
        for kind in self.kinds:
            v = args[i]
            i += 1
            if kind == TENSOR:
                try:
                    s = v._xla
                except AttributeError:
                    if not isinstance(v, torch.Tensor):
                        kind = SCALAR  # a wrapped Python number: handled with the scalars below
                        s = None
                    else:
                        s = _tensor_state(v, self.name)
                        if s is None:
                            s = _scalar_state(v)
                if s is not None:
                    key.append(s.shape)
                    key.append(s.dtype)
                    argv.append(REFS[len(operands)])
                    operands.append((s.node, s.idx))
                    continue
            if kind == STATIC:
                if type(v) is list:
                    v = freeze(v)
                argv.append(v)
                key.append(type(v))  # 2 == 2.0 == True, but they may give other dtypes
                key.append(v)
            elif kind == SCALAR or kind == OPT_SCALAR:
                tv = type(v)
                if v is None:
                    argv.append(None)
                    key.append(None)
                    continue
                if tv is not int and tv is not float and tv is not bool:
                    if isinstance(v, torch.Tensor):
                        v = v.item()
                        tv = type(v)
                # -0.0 == 0 and hashes alike: it is a parameter, or a cached 0.0 would serve it
                elif (v == 1 or v == 0 and math.copysign(1.0, v) > 0) and not NO_SPECIAL_SCALARS:
                    argv.append(v)
                    key.append((tv, v))
                    continue
                if scalars is None:
                    scalars = []
                scalars.append((len(argv), v))
                argv.append(None)  # filled below, once the parameter dtype is known
                key.append(tv)
            elif kind == OPT_TENSOR:
                if v is None:
                    argv.append(None)
                    key.append(None)
                else:
                    s = _tensor_state(v, self.name)
                    if s is None:
                        s = _scalar_state(v)
                    argv.append(REFS[len(operands)])
                    operands.append((s.node, s.idx))
                    key.append(s.shape)
                    key.append(s.dtype)
            else:  # TENSOR_LIST / OPT_TENSOR_LIST
                refs = []
                for t in v:
                    if t is None:
                        refs.append(None)
                        key.append(None)
                        continue
                    if kind == OPT_TENSOR_LIST and t.device.type != "xla":
                        s = values.from_cpu(t)._xla  # CPU indices are allowed, as on other devices
                    else:
                        s = _tensor_state(t, self.name)
                        if s is None:
                            s = _scalar_state(t)
                    refs.append(ir.ref(len(operands)))
                    operands.append((s.node, s.idx))
                    key.append(s.shape)
                    key.append(s.dtype)
                argv.append(tuple(refs))
                key.append(len(refs))
        key = tuple(key)
        entry = self.cache.get(key)
        if entry is None:
            entry = shapes.infer(self, args)
            entry.base = ir.node_base(self.name, entry.avals, entry.common if self.low.promote else None)
            self.cache[key] = entry
            if not entry.fallback and entry.structure == "one":
                self.one[key] = entry
        if entry.fallback:
            return fallback.cpu_fallback(self.op, args, {})
        if scalars is not None:
            dt = entry.common
            for pos, v in scalars:
                argv[pos] = ir.ref(len(operands))
                operands.append((ir.ScalarParam(v, dt), 0))
        low = self.low
        if low.random:
            seed, counter = rng.next_op()
            argv.append(ir.ref(len(operands)))
            operands.append((rng.seed_node(), 0))
            argv.append(counter)
        self.op_count[0] += 1
        node = ir.Node(self.name, tuple(operands), tuple(argv), entry.avals, low,
                       entry.common if low.promote else None, entry.base)
        if entry.structure == "one" and not EAGER[0]:
            shape, dtype = entry.avals[0]
            out = make_tensor(node, 0, shape, dtype)
            return wrap_user(out) if self.is_factory else out
        return self._outputs(node, entry)

    def _outputs(self, node, entry):
        outs = [None if a is None else make_tensor(node, i, a[0], a[1]) for i, a in enumerate(entry.avals)]
        if EAGER[0]:
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
