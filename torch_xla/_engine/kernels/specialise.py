"""Specialised kernels: straight-line Python generated per overload from its argument plan.

The generic kernel (`op_kernel.OpKernel.__call__`) runs the plan's steps one by one on every
call. On an op's first call, `specialise` generates straight-line code for that overload
from the same steps (`plan.Step.general`, `plan.Step.common`), building the same cache
key and node, and registers it in place of the stub. It has two layers, each handing
what it does not handle to the next:
- `fast`, the common case (`_common_case`): the overload's commonest call (XLA tensors,
  the last one possibly a Python number; Scalars at a 0/1/None default; no optional
  tensor), with fixed-length tuples and the node and output tensor made inline;
- `general`: any inner XLA tensors and Python numbers, a cached shape entry;
- then the generic kernel: the first call of a shape, CPU scalars, fallbacks, eager mode.
This is where the per-op tracing cost is decided; a test checks that both kernels build
equal nodes and that the fast path is taken. `PT_XLA_PRINT_KERNELS` prints the source of
each kernel generated.
"""
from __future__ import annotations

import keyword
import math
import sys
import threading
import weakref
from typing import List, Optional, Tuple

import torch

from .. import env_vars, ir, tensor
from ..mode import modes
from ..tensor import make_tensor
from . import library
from .op_kernel import OpKernel
from .plan import (NO_SPECIAL_SCALARS, OPT_TENSOR, REFS, TENSOR, ArgPlan, Source, freeze)


class LazyFast:
    """Registered in place of a specialisable kernel: on the op's first call it generates
    the specialised kernel and registers it in its own place (generating all of them at
    import would cost about 0.3 s)."""
    __slots__ = ("kernel", "short")

    def __init__(self, kernel: OpKernel, short: str):
        self.kernel, self.short = kernel, short

    def __call__(self, *args, **kwargs):
        return _specialised(self.kernel, self.short)(*args, **kwargs)


_lock = threading.Lock()


def _specialised(k: OpKernel, short: Optional[str] = None):
    """`k`'s specialised kernel, generated once (and registered for overload `short`)."""
    if k.fast is None:
        with _lock:
            if k.fast is None:
                k.fast = specialise(k)
                if short is not None:
                    library.replace(short, k.fast, "PrivateUse1")
    return k.fast


def entry_point(k: OpKernel, short: str):
    """The callable to register for overload `short` of kernel `k`."""
    return LazyFast(k, short) if specialisable(k) else k


def fast_kernel(k: OpKernel):
    """Kernel `k`'s specialised form (generated now if needed, not registered: for a
    hand-written kernel that calls it), or `k` itself when it has none."""
    return _specialised(k) if specialisable(k) else k


def specialisable(k: OpKernel) -> bool:
    low = k.low
    if low.alias or low.random or k.is_factory or not all(s.specialisable for s in k.plan.steps):
        return False
    if any(keyword.iskeyword(n) or n.startswith("_") for n in k.plan.names):
        return False
    tensor_kinds = [x for x in k.kinds if x in (TENSOR, OPT_TENSOR)]
    # The tensors read first must be the first operands, as in the generic kernel.
    return not (OPT_TENSOR in tensor_kinds and TENSOR in tensor_kinds[tensor_kinds.index(OPT_TENSOR):])


def specialise(k: OpKernel):
    """The specialised kernel of overload `k` (see the module's doc), with its source as
    its `source` attribute."""
    ns = _namespace(k)
    params, call = _signature(k.plan, ns)
    general, common = _general(k), _common_case(k, ns)
    # Without a common case, the general layer is the entry point.
    layers = [("general", general), ("fast", common)] if common is not None else [("fast", general)]
    src = "\n".join(f"def {name}({params}):\n" + "\n".join("    " + line.replace("CALL", call) for line in body)
                    + "\n" for name, body in layers)
    if _printed(k.name):
        print(f"# <kernel {k.name}>: {k.plan.describe()}\n{src}", file=sys.stderr, flush=True)
    exec(compile(src, f"<kernel {k.name}>", "exec"), ns)
    fast = ns["fast"]
    fast.source = src
    return fast


def _printed(name: str) -> bool:
    """Whether PT_XLA_PRINT_KERNELS asks for the source of kernel `name` (`aten::add.Tensor`,
    `aten::mm` for a default overload): `1` or `all` for every kernel, else names with or
    without `aten::` and the overload (`mm`, `aten::mm.default`)."""
    want = env_vars.get("PT_XLA_PRINT_KERNELS").strip()
    if want in ("", "0"):
        return False
    if want.lower() in ("1", "all"):
        return True
    full = name if "." in name else name + ".default"
    op = full.partition(".")[0]
    forms = {full, op, full.rpartition("::")[2], op.rpartition("::")[2]}
    return any(w.strip() in forms for w in want.split(","))


def _namespace(k: OpKernel) -> dict:
    """The names the generated source uses: the kernel's tables and the engine's
    functions, looked up as globals."""
    low = k.low
    create = tensor.creation_function()
    return {"generic": k.__call__, "outputs": k._outputs, "cache": k.cache, "one": k.one,
            "make_tensor": make_tensor, "Tensor": torch.Tensor, "REFS": REFS, "MODES": modes, "freeze": freeze,
            "NOSPECIAL": NO_SPECIAL_SCALARS, "NAME": k.name, "LOW": low, "PROMOTE": low.promote,
            "COUNT": k.op_count, "copysign": math.copysign, "make_node": ir.make_node,
            "scalar_param": ir.scalar_param, "NEW": object.__new__, "Node": ir.Node, "RECORDING": ir.recording,
            "record_source": ir.record_source, "CHECK_SOURCES": ir.CHECK_SOURCES, "user_line": ir.user_line,
            "CREATED": tensor.CREATED, "EMPTY": create, "TensorState": tensor.TensorState,
            "RECORD": getattr(create, "record", None), "IMPORT": tensor._from_dlpack,
            "CAPSULE": tensor._capsule_new, "DLTENSOR": tensor._DLTENSOR,
            "PENDING": tensor.pending.refs, "WEAK": weakref.ref}


def _signature(plan: ArgPlan, ns: dict) -> Tuple[str, str]:
    """The kernels' parameter list (the schema's, defaults as `_d<i>`) and the call that
    hands the arguments on (`CALL` in the lines)."""
    params, call = [], []
    for i, name in enumerate(plan.names):
        if plan.kwarg_only[i] and "*" not in params:
            params.append("*")
        if plan.has_default[i]:
            ns[f"_d{i}"] = plan.defaults[i]
            params.append(f"{name}=_d{i}")
        else:
            params.append(name)
        call.append(f"{name}={name}" if plan.kwarg_only[i] else name)
    return ", ".join(params), ", ".join(call)


def _fetch(src: Source) -> List[str]:
    """The tensors read first: any other value raises AttributeError and leaves."""
    if not src.fetched:
        return []
    return ["try:"] + ["    " + f for f in src.fetched] + ["except AttributeError:", "    " + src.leave]


def _general(k: OpKernel) -> List[str]:
    """The general layer: any XLA tensors and Python numbers, a cached entry without
    fallback. Operands and hash parts are lists here (`_ops`, `_hx`), as arguments add to
    them; the hash is `ir.node_hash`'s tuple."""
    src = Source("return generic(CALL)")
    for step in k.plan.steps:
        step.general(src)
    return (_fetch(src) + [f"_ops = [{', '.join(src.ops)}]", f"_hx = [{', '.join(src.hx)}]"] + src.lines
            + [f"_entry = cache.get(({', '.join(src.key)},))",
               "if _entry is None or _entry.fallback or MODES.eager:", "    " + src.leave,
               f"_argv = [{', '.join(src.argv)}]"] + src.late
            + ["COUNT[0] += 1", "_argv = tuple(_argv)",
               "_node = make_node(NAME, tuple(_ops), _argv, _entry.avals, LOW, _entry.common if PROMOTE else None,"
               " hash((_entry.base, _argv, *_hx)))",
               "if _entry.structure != 'one':", "    return outputs(_node, _entry)",
               "_shape, _dtype = _entry.avals[0]", "return make_tensor(_node, 0, _shape, _dtype)"])


_NEW_NODE = """_node = NEW(Node)
_node.op = NAME
_node.operands = ({ops})
_node.args = _argv
_node.avals = _entry.avals
_node.lowering = LOW
_node.info = {promote}
_node.hash = hash((_entry.base, _argv, {hx}))
if RECORDING.on:
    record_source(_node)"""
_NEW_TENSOR = """CREATED[0] += 1
_shape, _dtype = _entry.avals[0]
_t = EMPTY(_shape, _dtype)
_t._xla = _st = NEW(TensorState)
_st.node = _node
_st.idx = 0
_st.shape = _shape
_st.dtype = _dtype
PENDING.append(WEAK(_st))
return _t"""


# A process whose device is not xla:0 (tensor.creation_function): the output's DLPack
# record rides on the shape entry, which saves the creation function's call and look-up.
_ON_INDEX = """_p = _entry.proto
if _p is None:
    _p = _entry.proto = RECORD(_shape, _dtype)
_t = IMPORT(CAPSULE(_p, DLTENSOR, None))"""


def _common_case(k: OpKernel, ns: dict) -> Optional[List[str]]:
    """The common case's lines, or None when some step has none: every Tensor argument an
    inner XLA tensor (the last one may also be a Python number), every Scalar left at a
    default that is None, 0 or 1, every optional tensor None. Its tuples (key, operands,
    arguments, hash) have fixed lengths, built in one step each; any other call goes to
    `general`."""
    if NO_SPECIAL_SCALARS:
        return None
    src = Source("return general(CALL)")
    for step in k.plan.steps:
        if not step.common(src):
            return None
    ns.update(src.ns)
    promote = "_entry.common" if k.low.promote else "None"
    new_tensor = _NEW_TENSOR if ns["RECORD"] is None else _NEW_TENSOR.replace("_t = EMPTY(_shape, _dtype)", _ON_INDEX)
    branch = src.branch

    def tail(key: List[str], arg: Optional[str], op: Optional[str] = None, hx: Optional[str] = None,
             after_lookup: List[str] = ()) -> List[str]:
        """The lines from the look-up to the result, given the branching argument's key
        parts, argument and operand (None: no operand). `one` holds the entries of one
        output without fallback: a miss goes to `general`."""
        keys = [x for part in src.key for x in (key if part is branch else [part])]
        argv = [arg if a is branch else a for a in src.argv]
        ops, hxs = src.ops + [op] * (op is not None), src.hx + [hx] * (hx is not None)
        out = [f"_entry = one.get(({', '.join(keys)},))", "if _entry is None or MODES.eager:", "    " + src.leave]
        out += after_lookup
        out += ["COUNT[0] += 1", f"_argv = ({''.join(a + ', ' for a in argv)})"]
        # ir.make_node and tensor.make_tensor, inline: this is the path of most traced ops
        out += _NEW_NODE.format(ops="".join(o + ", " for o in ops), promote=promote,
                                hx="".join(h + ", " for h in hxs)).splitlines()
        if k.low.checked:
            out.append("CHECK_SOURCES[_node] = user_line()")
        return out + new_tensor.splitlines()

    lines = _fetch(src) + src.lines
    return lines + (tail([], None) if branch is None else branch.tails(src, tail))
