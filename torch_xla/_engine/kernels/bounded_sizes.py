"""Symbolic sizes of bounded dynamic tensors (docs/dynamic_shapes.md): `SizeNode`, a SymNode
whose value is a device value, read from the device at most once.

Arithmetic on sizes is recorded, not run: PyTorch computes with sizes at every tensor it
makes (numel, contiguity), and a device op per such step would be dead IR. A derived
size becomes device ops only when a program needs it (`tensor()`: an expand to it, a
masked reduction, `_get_xla_tensor_dimension_size`); its real value is computed on the
host from its leaves, each leaf (a producer's count) read once.
"""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch

from .. import telemetry
from . import values

_READS = telemetry.cell("BoundedSizeRead")


class Value:
    """A symbolic value shared by a node and its clones: a leaf (`t`, a 0-d inner xla
    tensor) or an op (`host` / `device` functions of `args`, Values or Python numbers)."""
    __slots__ = ("t", "host", "device", "args", "real")

    def __init__(self, t=None, host=None, device=None, args=()):
        self.t, self.host, self.device, self.args, self.real = t, host, device, args, None

    def get(self):
        """The real value (leaves read once, counted as `BoundedSizeRead`)."""
        if self.real is None:
            if self.t is not None:
                _READS[0] += 1
                self.real = values.to_cpu(self.t).item()
            else:
                self.real = self.host(*[a.get() if isinstance(a, Value) else a for a in self.args])
        return self.real

    def tensor(self) -> torch.Tensor:
        """The device value (ops made at the first call)."""
        if self.t is None:
            ops = [a.tensor() if isinstance(a, Value) else values.const_tensor((), torch.int64, a) for a in self.args]
            self.t = self.device(*ops)
        return self.t


def same_value(a, b) -> bool:
    """Whether two nodes are one symbolic value (compared without a device read)."""
    va, vb = getattr(a, "v", None), getattr(b, "v", None)
    if va is None or vb is None:
        return False
    if va is vb:
        return True
    if va.t is None or vb.t is None or va.host is not None or vb.host is not None:
        return False
    sa, sb = va.t._xla, vb.t._xla
    return sa.node is sb.node and sa.idx == sb.idx


class _Node:
    """What `SizeNode` and `BoolNode` share: a symbolic `Value` `v` (None for a constant,
    whose value is `const`) and a static `bound` (what `str()` shows)."""
    __slots__ = ("v", "bound", "const")

    def __init__(self, v: Optional[Value], bound, const=None):
        self.v, self.bound, self.const = v, bound, const

    def is_nested_int(self) -> bool:
        return False

    def nested_int(self):
        return None

    def is_symbolic(self) -> bool:
        return self.v is not None

    def is_constant(self) -> bool:
        return self.v is None

    def has_hint(self) -> bool:
        return True

    def value(self):
        return self.const if self.v is None else self._cast(self.v.get())

    def tensor(self) -> torch.Tensor:
        return self.v.tensor()

    def wrap_int(self, v: int) -> "SizeNode":
        return SizeNode(None, v, v)

    def wrap_bool(self, v: bool) -> "BoolNode":
        return BoolNode(None, v, v)

    def str(self) -> str:
        return str(self.bound) if self.v is None else f"<={self.bound}"

    _graph_repr = __str__ = __repr__ = str

    def _apply(self, name: str, other: "_Node", static: Callable, device: Callable, kind: type):
        """The node of `self <name> other`: its bound from the bounds, its value the op on
        the values (recorded), counted as `xla::size_<name>`."""
        telemetry.inc("xla::size_" + name)
        if self.v is None and other.v is None:
            c = static(self.const, other.const)
            return kind(None, c, c)
        args = tuple(n.v if n.v is not None else n.const for n in (self, other))
        return kind(Value(host=static, device=device, args=args), static(self.bound, other.bound))


def _device_op(op) -> Callable:
    return lambda a, b: op(a, b)


def _int_binary(name: str, static: Callable, device: Callable) -> Callable:
    def method(self, other):
        return self._apply(name, other, static, device, SizeNode)
    method.__name__ = name
    return method


def _cmp(name: str, static: Callable, device: Callable) -> Callable:
    def method(self, other):
        if name in ("eq", "ne") and same_value(self, other):
            c = name == "eq"
            telemetry.inc("xla::size_" + name)
            return BoolNode(None, c, c)
        return self._apply(name, other, static, device, BoolNode)
    method.__name__ = name
    return method


def _floordiv(a, b):
    return a // b if b else 0


def _mod(a, b):
    return a % b if b else 0


class SizeNode(_Node):
    """A SymNode (the protocol of torch.fx.experimental.sym_node.SymNode that
    `torch.SymInt(node)` wraps) of a size: `SizeNode.leaf(count, bound)` for a producer's
    count."""
    __slots__ = ()

    @staticmethod
    def leaf(t: torch.Tensor, bound_: int) -> "SizeNode":
        return SizeNode(Value(t=t), bound_)

    @staticmethod
    def _cast(v):
        return int(v)

    def is_int(self) -> bool:
        return True

    def is_bool(self) -> bool:
        return False

    def is_float(self) -> bool:
        return False

    def maybe_as_int(self) -> Optional[int]:
        return self.const

    def constant_int(self) -> Optional[int]:
        return self.const

    def clone(self) -> "SizeNode":
        telemetry.inc("xla::size_clone")
        return SizeNode(self.v, self.bound, self.const)

    def guard_int(self, file=None, line=None) -> int:
        return self.value()

    int_ = guard_size_oblivious = guard_int

    def expect_size(self, file=None, line=None) -> bool:
        return True

    add = _int_binary("add", operator.add, operator.add)
    sub = _int_binary("sub", operator.sub, operator.sub)
    mul = _int_binary("mul", operator.mul, operator.mul)
    mod = _int_binary("mod", _mod, _device_op(torch.remainder))
    floordiv = int_floordiv = _int_binary("floordiv", _floordiv, _device_op(torch.floor_divide))
    sym_max = _int_binary("sym_max", max, _device_op(torch.maximum))
    sym_min = _int_binary("sym_min", min, _device_op(torch.minimum))
    eq = _cmp("eq", operator.eq, _device_op(torch.eq))
    ne = _cmp("ne", operator.ne, _device_op(torch.ne))
    lt = _cmp("lt", operator.lt, _device_op(torch.lt))
    le = _cmp("le", operator.le, _device_op(torch.le))
    gt = _cmp("gt", operator.gt, _device_op(torch.gt))
    ge = _cmp("ge", operator.ge, _device_op(torch.ge))

    def neg(self) -> "SizeNode":
        return self.wrap_int(0).sub(self)

    def sym_float(self):
        return self.value()


class BoolNode(_Node):
    """The SymNode of a comparison of sizes."""
    __slots__ = ()

    @staticmethod
    def _cast(v):
        return bool(v)

    def is_int(self) -> bool:
        return False

    def is_bool(self) -> bool:
        return True

    def is_float(self) -> bool:
        return False

    def maybe_as_bool(self) -> Optional[bool]:
        return self.const

    def constant_bool(self) -> Optional[bool]:
        return self.const

    def clone(self) -> "BoolNode":
        return BoolNode(self.v, self.bound, self.const)

    def guard_bool(self, file=None, line=None) -> bool:
        return self.value()

    bool_ = expect_true = guard_size_oblivious = guard_bool

    def guard_or_false(self, file=None, line=None) -> bool:
        # PyTorch asks this where an unknown answer may be False (layout checks): no read
        return bool(self.const) if self.v is None else False

    def guard_or_true(self, file=None, line=None) -> bool:
        return bool(self.const) if self.v is None else True

    def statically_known_true(self, file=None, line=None) -> bool:
        return self.v is None and bool(self.const)

    def int_(self) -> int:
        return int(self.value())

    def str(self) -> str:
        return str(self.bound)

    _graph_repr = __str__ = __repr__ = str

    def sym_and(self, other: "BoolNode") -> "BoolNode":
        return self._apply("and", other, operator.and_, operator.and_, BoolNode)

    def sym_or(self, other: "BoolNode") -> "BoolNode":
        return self._apply("or", other, operator.or_, operator.or_, BoolNode)

    def sym_not(self) -> "BoolNode":
        return self._apply("not", self.wrap_bool(True), operator.xor, operator.xor, BoolNode)


def size_of(v) -> "int | SizeNode":
    """A size argument as an int or our SizeNode (a SymInt of another kind becomes its int)."""
    if isinstance(v, torch.SymInt):
        node = v.node
        if isinstance(node, SizeNode):
            return node if node.v is not None else node.const
        return int(v)
    return int(v)


def sym(v: "int | SizeNode"):
    return torch.SymInt(v) if isinstance(v, SizeNode) else v


def bound(v: "int | SizeNode") -> int:
    return v.bound if isinstance(v, SizeNode) else v


def real(v: "int | SizeNode") -> int:
    return v.value() if isinstance(v, SizeNode) else v


def _ours(x) -> bool:
    return isinstance(x, torch.SymInt) and isinstance(x.node, SizeNode) and x.node.v is not None


def has_symbolic(args) -> bool:
    """Whether call arguments hold a SymInt of ours (directly or in a list)."""
    for a in args:
        if _ours(a) or (isinstance(a, (list, tuple)) and any(_ours(x) for x in a)):
            return True
    return False
