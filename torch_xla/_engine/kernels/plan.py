"""The argument plan of one aten overload: one step per argument, the one description of
the per-op path from which every kernel of the overload is derived.

A step says what its argument is to the engine, and how each kernel handles it:
- `run`: the generic kernel (`op_kernel.OpKernel.__call__`) calls it for the argument's
  value: its parts of the cache key, its node argument, its operands;
- `general`: the lines the specialised kernel (`specialise.py`) has for it in its general
  layer (any XLA tensor or Python number);
- `common`: its lines in the specialised kernel's common case (the overload's commonest
  call), or none (the overload then has no common case).
The lines build the same key and node as `run`, and hand any value they do not handle to
the layer below (`Source.leave`: common case -> general layer -> generic kernel). So a
change to how an argument kind is handled is made here, once for all three;
`tests/test_architecture.py` checks that they build equal nodes.

Argument kinds (`ArgPlan.kinds`; the other modules read the schema only through the plan):
- TENSOR / OPT_TENSOR: an operand of the node (a 0-d CPU tensor or a Python number in a
  TENSOR slot is a wrapped scalar: a graph parameter);
- TENSOR_LIST / OPT_TENSOR_LIST: a tuple of operand references;
- SCALAR / OPT_SCALAR: a graph parameter (0 and 1 are compiled in, see below);
- STATIC: everything else, and Scalars the lowering declares `static`: part of the program.
"""
from __future__ import annotations

from math import copysign
from typing import Any, Dict, List, Tuple

import torch

from .. import env_vars, ir, job
from ..tensor import XlaState, state_of
from . import cpu_operand, values

TENSOR, OPT_TENSOR, TENSOR_LIST, OPT_TENSOR_LIST, SCALAR, OPT_SCALAR, STATIC = range(7)
KIND_NAMES = ("TENSOR", "OPT_TENSOR", "TENSOR_LIST", "OPT_TENSOR_LIST", "SCALAR", "OPT_SCALAR", "STATIC")
_KIND_OF_TYPE = {
    "Tensor": TENSOR, "Optional[Tensor]": OPT_TENSOR, "List[Tensor]": TENSOR_LIST,
    "List[Optional[Tensor]]": OPT_TENSOR_LIST, "number": SCALAR, "Optional[number]": OPT_SCALAR,
}
TENSOR_KINDS = (TENSOR, OPT_TENSOR, TENSOR_LIST, OPT_TENSOR_LIST)
REFS = ir.REFS


def special_scalars() -> bool:
    """Whether 0 and 1 are compiled into programs (other Python scalars are parameters).

    In a multi-process job every replica must compile the same program for its
    collectives to match, and a value like `rank * 10` would differ between them: there
    all scalars are parameters, as with XLA_NO_SPECIAL_SCALARS."""
    return not env_vars.get("XLA_NO_SPECIAL_SCALARS") and job.world_size() <= 1


# Read once: every kernel tests it on every Scalar.
NO_SPECIAL_SCALARS = not special_scalars()


def is_constant(v) -> bool:
    """Whether Python number `v` is compiled in (0 or 1). -0.0 equals 0 and hashes alike:
    it is a parameter, or a program cached for 0.0 would serve it."""
    return v == 1 or v == 0 and copysign(1.0, v) > 0


def constant_src(v: str) -> str:
    """`is_constant` as the specialised kernels' source, for the variable named `v`."""
    return f"{v} == 1 or {v} == 0 and copysign(1.0, {v}) > 0"


def freeze(v):
    """A static argument as a key part: lists become tuples, SymInts ints."""
    if isinstance(v, list):
        return tuple(freeze(x) for x in v)
    if isinstance(v, torch.SymInt):
        return int(v)
    return v


def _scalar_state(t: torch.Tensor) -> XlaState:
    """A 0-d CPU tensor mixed with XLA tensors: it becomes a graph parameter."""
    return XlaState(ir.ScalarParam(t.item(), t.dtype), 0, (), t.dtype)


def _tensor_state(t, op_name) -> XlaState:
    """The state of an operand; a 0-d CPU tensor becomes a graph parameter, another CPU
    tensor a device copy or PyTorch's same-device error (`cpu_operand.py`)."""
    if t.device.type == "xla":
        try:
            return t._xla
        except AttributeError:
            return state_of(t)
    if t.dim() == 0 and t.device.type == "cpu":
        return _scalar_state(t)
    return cpu_operand.to_device(t, op_name)


def add_params(scalars, dtype, argv: list, ops: list) -> None:
    """The generic kernel's Scalars that are graph parameters, once the shape entry gives
    their dtype: each becomes the next operand (`late_param` is the same as source)."""
    for pos, v in scalars:
        argv[pos] = ir.ref(len(ops))
        ops.append((ir.scalar_param(v, dtype), 0))


def late_param(src: "Source", i: int, v: str) -> None:
    """`add_params` for argument `i` (variable `v`) of the general layer, where `_p<i>`
    says whether it is a parameter (the layer's argument list has one entry per argument)."""
    src.late += [f"if _p{i}:", f"    _argv[{i}] = REFS[len(_ops)]; _n = scalar_param({v}, _entry.common)",
                 "    _ops.append((_n, 0)); _hx.append(_n.hash); _hx.append(0)"]


class Source:
    """What the steps of one overload emit for one layer of its specialised kernel, which
    `specialise.py` puts around the cache look-up and the node (expressions as text)."""

    def __init__(self, leave: str):
        self.leave = leave    # the statement handing the call to the layer below
        self.fetched = []     # `_s<i> = <arg>._xla` of the tensors read first, in one try block
        self.lines = []       # then each argument's lines, in argument order
        self.key = ["NAME"]   # the cache key's parts
        self.argv = []        # the node's arguments
        self.ops = []         # the operands known at generation (the fetched tensors)
        self.hx = []          # their parts of the node's hash (`ir.node_hash`)
        self.late = []        # lines run once the shape entry is known
        self.branch = None    # common case: the step whose value picks the tail (`LastTensor.tails`)
        self.ns: Dict[str, Any] = {}  # values the lines name, for the kernel's namespace


class Step:
    """One argument of an overload (index `i`, variable `name`) as its kernels handle it."""
    __slots__ = ("i", "name", "op", "has_default", "default")
    specialisable = True  # whether the specialised kernels have lines for this kind

    def __init__(self, i: int, arg, op: str):
        self.i, self.name, self.op = i, arg.name, op
        self.has_default = arg.has_default_value()
        self.default = arg.default_value if self.has_default else None

    def run(self, v, key: list, argv: list, ops: list, scalars: list) -> None:
        """Appends the value's parts of the cache key, its node argument (a `Ref` where an
        operand goes) and its operands; a graph parameter waits in `scalars` as (argument
        position, value) until the shape entry gives its dtype (`add_params`)."""
        raise NotImplementedError

    def general(self, src: Source) -> None:
        """Adds the argument's lines and expressions for the general layer to `src`: any
        XLA tensor or Python number, `run`'s key and node for them."""
        raise NotImplementedError

    def common(self, src: Source) -> bool:
        """Adds them for the common case; False when the argument has none there."""
        raise NotImplementedError


class Tensor(Step):
    """TENSOR: an operand. PyTorch passes a wrapped number (`x * 0.5`) as a Python number:
    handled as a Scalar."""
    __slots__ = ()

    def run(self, v, key, argv, ops, scalars):
        try:
            s = v._xla
        except AttributeError:
            if not isinstance(v, torch.Tensor):
                return Scalar.run(v, key, argv, ops, scalars)
            s = _tensor_state(v, self.op)
        key.append(s.shape)
        key.append(s.dtype)
        argv.append(REFS[len(ops)])
        ops.append((s.node, s.idx))

    def general(self, src):
        # Read first, in one try block: an operand fixed at generation. Other values
        # (a number, a CPU tensor) raise AttributeError there and leave.
        i = self.i
        src.fetched.append(f"_s{i} = {self.name}._xla")
        src.key += [f"_s{i}.shape", f"_s{i}.dtype"]
        src.argv.append(f"REFS[{len(src.ops)}]")
        src.ops.append(f"(_s{i}.node, _s{i}.idx)")
        src.hx.append(f"_s{i}.node.hash, _s{i}.idx")

    def common(self, src):
        self.general(src)
        return True


class LastTensor(Tensor):
    """The last tensor argument, when no optional tensor follows it: the one the
    specialised kernels also take as a wrapped Python number (`x * 0.5`, `x + 1`), as a
    Scalar. It is the node's last operand, or its last before graph parameters."""
    __slots__ = ()

    def general(self, src):
        i, v = self.i, self.name
        src.lines += [
            f"_s{i} = getattr({v}, '_xla', None)", f"if _s{i} is not None:",
            f"    _k{i} = (_s{i}.shape, _s{i}.dtype); _p{i} = False; _w{i} = REFS[len(_ops)]",
            f"    _n = _s{i}.node; _ops.append((_n, _s{i}.idx)); _hx.append(_n.hash); _hx.append(_s{i}.idx)",
            "else:", f"    _t{i} = type({v})",
            f"    if _t{i} is not float and _t{i} is not int:", "        " + src.leave,
            f"    if not NOSPECIAL and ({constant_src(v)}):",
            f"        _k{i} = ((_t{i}, {v}),); _p{i} = False; _w{i} = {v}",
            "    else:", f"        _k{i} = (_t{i},); _p{i} = True; _w{i} = None"]
        src.key.append(f"*_k{i}")
        src.argv.append(f"_w{i}")
        late_param(src, i, v)

    def common(self, src):
        src.branch = self
        src.key.append(self)   # placeholders: each tail puts its own parts here
        src.argv.append(self)
        return True

    def tails(self, src: Source, tail) -> List[str]:
        """The common case's lines from the look-up on: one tail per form of the value
        (a tensor, a constant, a graph parameter). `tail(key parts, argument, operand,
        hash part, lines after the look-up)` gives a tail's lines."""
        i, v = self.i, self.name
        ref = f"REFS[{len(src.ops)}]"
        # a type test first: cheaper than getattr with a default, and no exception for numbers
        lines = [f"_ty = type({v})", "if _ty is not float and _ty is not int:", "    try:",
                 f"        _s{i} = {v}._xla", "    except AttributeError:", "        " + src.leave]
        lines += ["    " + x for x in tail([f"_s{i}.shape", f"_s{i}.dtype"], ref, f"(_s{i}.node, _s{i}.idx)",
                                         f"_s{i}.node.hash, _s{i}.idx")]
        lines.append(f"if {constant_src(v)}:")
        lines += ["    " + x for x in tail([f"(_ty, {v})"], v)]
        return lines + tail(["_ty"], ref, "(_n, 0)", "_n.hash, 0", [f"_n = scalar_param({v}, _entry.common)"])


class OptTensor(Step):
    """OPT_TENSOR: None, or an operand."""
    __slots__ = ()

    def run(self, v, key, argv, ops, scalars):
        if v is None:
            argv.append(None)
            key.append(None)
            return
        s = _tensor_state(v, self.op)
        argv.append(REFS[len(ops)])
        ops.append((s.node, s.idx))
        key.append(s.shape)
        key.append(s.dtype)

    def general(self, src):
        i, v = self.i, self.name
        src.lines += [
            f"if {v} is None:", f"    _k{i} = (None,); _r{i} = None", "else:",
            f"    _s{i} = getattr({v}, '_xla', None)", f"    if _s{i} is None:", "        " + src.leave,
            f"    _k{i} = (_s{i}.shape, _s{i}.dtype)",
            f"    _r{i} = REFS[len(_ops)]; _n = _s{i}.node; _ops.append((_n, _s{i}.idx))",
            f"    _hx.append(_n.hash); _hx.append(_s{i}.idx)"]
        src.key.append(f"*_k{i}")
        src.argv.append(f"_r{i}")

    def common(self, src):
        src.lines += [f"if {self.name} is not None:", "    " + src.leave]
        src.key.append("None")
        src.argv.append("None")
        return True


class TensorList(Step):
    """TENSOR_LIST / OPT_TENSOR_LIST (`optional`): a tuple of operand references, None
    where an optional one is None. Generic kernel only."""
    __slots__ = ("optional",)
    specialisable = False

    def __init__(self, i, arg, op, optional: bool):
        super().__init__(i, arg, op)
        self.optional = optional

    def run(self, v, key, argv, ops, scalars):
        refs = []
        for t in v:
            if t is None:
                refs.append(None)
                key.append(None)
                continue
            if self.optional and t.device.type != "xla":
                s = values.from_cpu(t)._xla  # CPU indices are allowed, as on other devices
            else:
                s = _tensor_state(t, self.op)
            refs.append(ir.ref(len(ops)))
            ops.append((s.node, s.idx))
            key.append(s.shape)
            key.append(s.dtype)
        argv.append(tuple(refs))
        key.append(len(refs))


class Scalar(Step):
    """SCALAR / OPT_SCALAR: None, a constant (0 and 1, unless NO_SPECIAL_SCALARS) or a
    graph parameter of the shape entry's dtype. The key holds a parameter's type only."""
    __slots__ = ()

    @staticmethod
    def run(v, key, argv, ops, scalars):
        if v is None:
            argv.append(None)
            key.append(None)
            return
        tv = type(v)
        if tv is not int and tv is not float and tv is not bool:
            if isinstance(v, torch.Tensor):
                v = v.item()
                tv = type(v)
        elif not NO_SPECIAL_SCALARS and is_constant(v):
            argv.append(v)
            key.append((tv, v))
            return
        scalars.append((len(argv), v))
        argv.append(None)
        key.append(tv)

    def general(self, src):
        i, v = self.i, self.name
        src.lines += [
            f"_t{i} = type({v})", f"if {v} is None:", f"    _k{i} = None; _p{i} = False",
            f"elif _t{i} is not int and _t{i} is not float:", "    " + src.leave,
            f"elif not NOSPECIAL and ({constant_src(v)}):", f"    _k{i} = (_t{i}, {v}); _p{i} = False",
            "else:", f"    _k{i} = _t{i}; _p{i} = True"]
        src.key.append(f"_k{i}")
        src.argv.append(f"(None if _p{i} else {v})")
        late_param(src, i, v)

    def common(self, src):
        # Its default only, when that is None or a constant: the key part is known.
        d = self.default
        if not self.has_default or not (d is None or type(d) in (int, float) and is_constant(d)):
            return False
        if d is None:
            src.key.append("None")
        else:
            src.ns[f"_kd{self.i}"] = (type(d), d)
            src.key.append(f"_kd{self.i}")
        src.lines += [f"if {self.name} is not _d{self.i}:", "    " + src.leave]
        src.argv.append(f"_d{self.i}")
        return True


class Static(Step):
    """STATIC: part of the program; the key holds its type too (2 == 2.0 == True, but
    they may give other dtypes)."""
    __slots__ = ()

    @staticmethod
    def run(v, key, argv, ops, scalars):
        if type(v) is list:
            v = freeze(v)
        argv.append(v)
        key.append(type(v))
        key.append(v)

    def general(self, src):
        i, v = self.i, self.name
        src.lines.append(f"_x{i} = freeze({v}) if type({v}) is list else {v}")
        src.key += [f"type(_x{i})", f"_x{i}"]
        src.argv.append(f"_x{i}")

    def common(self, src):
        self.general(src)
        return True


class ArgPlan:
    """Names, kinds, defaults and steps of an overload's arguments, in schema order."""
    __slots__ = ("names", "kinds", "defaults", "has_default", "kwarg_only", "index_of",
                 "signature", "nargs", "is_factory", "steps")

    def __init__(self, op: torch._ops.OpOverload, static: frozenset):
        args = op._schema.arguments
        self.names: List[str] = [a.name for a in args]
        self.signature: List[Tuple[str, str]] = [(a.name, str(a.type)) for a in args]
        self.kinds: Tuple[int, ...] = tuple(
            STATIC if a.name in static else _KIND_OF_TYPE.get(str(a.type), STATIC) for a in args)
        self.has_default: List[bool] = [a.has_default_value() for a in args]
        self.defaults: List[Any] = [a.default_value if a.has_default_value() else None for a in args]
        self.kwarg_only: List[bool] = [a.kwarg_only for a in args]
        self.index_of: Dict[str, int] = {n: i for i, n in enumerate(self.names)}
        self.nargs = len(args)
        # Factories (no tensor inputs) are called outside functionalization: their
        # results are wrapped for the user.
        self.is_factory = not any(k in TENSOR_KINDS for k in self.kinds)
        self.steps: Tuple[Step, ...] = tuple(self._step(i, a, op.name()) for i, a in enumerate(args))

    def _step(self, i, arg, op: str) -> Step:
        kind = self.kinds[i]
        if kind == TENSOR:
            later = [k for k in self.kinds[i + 1:] if k in (TENSOR, OPT_TENSOR)]
            return Tensor(i, arg, op) if later else LastTensor(i, arg, op)
        if kind == OPT_TENSOR:
            return OptTensor(i, arg, op)
        if kind in (TENSOR_LIST, OPT_TENSOR_LIST):
            return TensorList(i, arg, op, kind == OPT_TENSOR_LIST)
        if kind in (SCALAR, OPT_SCALAR):
            return Scalar(i, arg, op)
        return Static(i, arg, op)

    def describe(self) -> str:
        return ", ".join(f"{n}:{KIND_NAMES[k]}" for n, k in zip(self.names, self.kinds))
