"""Specialised kernels: straight-line Python generated per overload from its argument plan.

The generic kernel (`op_kernel.OpKernel.__call__`) loops over the plan's argument kinds
on every call. On an op's first call, `specialise` generates code for the common case
of that overload (every tensor argument an inner XLA tensor, the last one possibly a
wrapped number; every Scalar a Python int or float; a cached shape entry), building the
same cache key and the same node as the generic kernel, and registers it in place of
the stub. Anything else (first call of a shape, CPU scalars, fallbacks, eager mode)
goes to the generic kernel. Its first layer (`_common_case`) is the overload's commonest
call, with fixed-length tuples and the node and output tensor made inline. This is where
the per-op tracing cost is decided; a test checks that both kernels build equal nodes and
that the fast path is taken.
"""
from __future__ import annotations

import keyword
import math
import threading
import weakref

import torch

from .. import ir, tensor
from ..mode import EAGER
from ..tensor import make_tensor
from . import library
from .op_kernel import NO_SPECIAL_SCALARS, REFS, OpKernel, freeze
from .plan import OPT_TENSOR, OPT_TENSOR_LIST, STATIC, TENSOR, TENSOR_LIST


class LazyFast:
    """Registered in place of a specialisable kernel: on the op's first call it generates
    the specialised kernel and registers it in its own place (generating all of them at
    import would cost about 0.3 s)."""
    __slots__ = ("kernel", "short")

    def __init__(self, kernel: OpKernel, short: str):
        self.kernel, self.short = kernel, short

    def __call__(self, *args, **kwargs):
        k = self.kernel
        if k.fast is None:
            with _lock:
                if k.fast is None:
                    k.fast = specialise(k)
                    library.replace(self.short, k.fast, "PrivateUse1")
        return k.fast(*args, **kwargs)


_lock = threading.Lock()


def entry_point(k: OpKernel, short: str):
    """The callable to register for overload `short` of kernel `k`."""
    return LazyFast(k, short) if specialisable(k) else k


def specialisable(k: OpKernel) -> bool:
    low = k.low
    if low.alias or low.random or k.is_factory or any(x in (TENSOR_LIST, OPT_TENSOR_LIST) for x in k.kinds):
        return False
    if any(keyword.iskeyword(n) or n.startswith("_") for n in k.plan.names):
        return False
    tensor_kinds = [x for x in k.kinds if x in (TENSOR, OPT_TENSOR)]
    # operands must keep the generic kernel's (argument) order
    return not (OPT_TENSOR in tensor_kinds and TENSOR in tensor_kinds[tensor_kinds.index(OPT_TENSOR):])


def specialise(k: OpKernel):
    """Generates a straight-line kernel for the common case of one overload: every tensor
    argument an inner XLA tensor (the last one may be a wrapped number), every Scalar a Python int/float, a cached shape entry
    with one output. It builds the same cache key and node as the generic
    `OpKernel.__call__`, which it calls for anything else (first call of a shape, other
    CPU scalars, fallbacks, eager mode), without the per-argument kind dispatch."""
    low = k.low
    create = tensor.creation_function()
    ns = {"generic": k.__call__, "outputs": k._outputs, "cache": k.cache, "one": k.one,
          "make_tensor": make_tensor, "Tensor": torch.Tensor, "REFS": REFS, "EAGER": EAGER, "freeze": freeze,
          "NOSPECIAL": NO_SPECIAL_SCALARS, "NAME": k.name, "LOW": low, "PROMOTE": low.promote,
          "COUNT": k.op_count, "copysign": math.copysign, "make_node": ir.make_node,
          "scalar_param": ir.scalar_param, "NEW": object.__new__, "Node": ir.Node, "RECORDING": ir.RECORDING,
          "record_source": ir.record_source, "CHECK_SOURCES": ir.CHECK_SOURCES, "user_line": ir.user_line,
          "CREATED": tensor.CREATED, "EMPTY": create, "TensorState": tensor.TensorState,
          "RECORD": getattr(create, "record", None), "IMPORT": tensor._from_dlpack,
          "CAPSULE": tensor._capsule_new, "DLTENSOR": tensor._DLTENSOR,
          "PENDING": tensor.pending.refs, "WEAK": weakref.ref}
    params, call, tensors, lines, key, argv, scalars = [], [], [], [], ["NAME"], [], []
    kw_only = False
    tpos = [i for i, x in enumerate(k.kinds) if x in (TENSOR, OPT_TENSOR)]
    last_t = tpos[-1] if tpos and k.kinds[tpos[-1]] == TENSOR else -1
    plan = k.plan
    names = plan.names
    for i, kind in enumerate(plan.kinds):
        v = names[i]
        if plan.kwarg_only[i] and not kw_only:
            params.append("*")
            kw_only = True
        if plan.has_default[i]:
            ns[f"_d{i}"] = plan.defaults[i]
            params.append(f"{v}=_d{i}")
        else:
            params.append(v)
        call.append(f"{v}={v}" if plan.kwarg_only[i] else v)
        if kind == TENSOR and i == last_t:
            # The last tensor argument may be a wrapped number (`x * 0.5` reaches the
            # backend as a Python float): a Scalar, as in the generic kernel.
            lines += [f"_s{i} = getattr({v}, '_xla', None)", f"if _s{i} is not None:",
                      f"    _k{i} = (_s{i}.shape, _s{i}.dtype); _p{i} = False; _w{i} = REFS[len(_ops)]",
                      f"    _n = _s{i}.node; _ops.append((_n, _s{i}.idx)); _hx.append(_n.hash); _hx.append(_s{i}.idx)",
                      "else:", f"    _t{i} = type({v})",
                      f"    if _t{i} is not float and _t{i} is not int:", "        return generic(CALL)",
                      f"    if not NOSPECIAL and ({v} == 1 or {v} == 0 and copysign(1.0, {v}) > 0):",
                      f"        _k{i} = ((_t{i}, {v}),); _p{i} = False; _w{i} = {v}",
                      "    else:", f"        _k{i} = (_t{i},); _p{i} = True; _w{i} = None"]
            key.append(f"*_k{i}")
            argv.append(f"_w{i}")
            scalars.append((i, v))
        elif kind == TENSOR:
            tensors.append(i)
            key += [f"_s{i}.shape", f"_s{i}.dtype"]
            argv.append(f"REFS[{len(tensors) - 1}]")
        elif kind == OPT_TENSOR:
            lines += [f"if {v} is None:", f"    _k{i} = (None,); _r{i} = None", "else:",
                      f"    _s{i} = getattr({v}, '_xla', None)", f"    if _s{i} is None:", "        return generic(CALL)",
                      f"    _k{i} = (_s{i}.shape, _s{i}.dtype)",
                      f"    _r{i} = REFS[len(_ops)]; _n = _s{i}.node; _ops.append((_n, _s{i}.idx))",
                      f"    _hx.append(_n.hash); _hx.append(_s{i}.idx)"]
            key.append(f"*_k{i}")
            argv.append(f"_r{i}")
        elif kind == STATIC:
            lines.append(f"_x{i} = freeze({v}) if type({v}) is list else {v}")
            key += [f"type(_x{i})", f"_x{i}"]
            argv.append(f"_x{i}")
        else:  # S / OPT_SCALAR: 0 and 1 are constants (unless NOSPECIAL), other numbers parameters
            scalars.append((i, v))
            lines += [f"_t{i} = type({v})", f"if {v} is None:", f"    _k{i} = None; _p{i} = False",
                      f"elif _t{i} is not int and _t{i} is not float:", "    return generic(CALL)",
                      f"elif not NOSPECIAL and ({v} == 1 or {v} == 0 and copysign(1.0, {v}) > 0):", f"    _k{i} = (_t{i}, {v}); _p{i} = False",
                      "else:", f"    _k{i} = _t{i}; _p{i} = True"]
            key.append(f"_k{i}")
            argv.append(f"(None if _p{i} else {v})")
    body = []
    if tensors:
        body = (["try:"] + [f"    _s{i} = {names[i]}._xla" for i in tensors]
                + ["except AttributeError:", "    return generic(CALL)"])
    body.append(f"_ops = [{', '.join(f'(_s{i}.node, _s{i}.idx)' for i in tensors)}]")
    # The node's hash parts (ir.node_hash's tuple after base and args), kept beside _ops.
    body.append(f"_hx = [{', '.join(f'_s{i}.node.hash, _s{i}.idx' for i in tensors)}]")
    body += lines
    body.append(f"_entry = cache.get(({', '.join(key)},))")
    body += ["if _entry is None or _entry.fallback or EAGER[0]:", "    return generic(CALL)"]
    body.append(f"_argv = [{', '.join(argv)}]")
    for i, v in scalars:
        body += [f"if _p{i}:", f"    _argv[{i}] = REFS[len(_ops)]; _n = scalar_param({v}, _entry.common)",
                 "    _ops.append((_n, 0)); _hx.append(_n.hash); _hx.append(0)"]
    body += ["COUNT[0] += 1", "_argv = tuple(_argv)",
             "_node = make_node(NAME, tuple(_ops), _argv, _entry.avals, LOW, _entry.common if PROMOTE else None,"
             " hash((_entry.base, _argv, *_hx)))",
             "if _entry.structure != 'one':", "    return outputs(_node, _entry)",
             "_shape, _dtype = _entry.avals[0]", "return make_tensor(_node, 0, _shape, _dtype)"]
    src = f"def general({', '.join(params)}):\n" + "\n".join("    " + l.replace("CALL", ", ".join(call))
                                                             for l in body) + "\n"
    common = _common_case(k, ns)
    if common is None:
        src = src.replace("def general(", "def fast(", 1)
    else:
        src += "\n" + f"def fast({', '.join(params)}):\n" + "\n".join(
            "    " + l.replace("CALL", ", ".join(call)) for l in common) + "\n"
    exec(compile(src, f"<kernel {k.name}>", "exec"), ns)
    fast = ns["fast"]
    fast.source = src
    return fast


_NEW_NODE = """_node = NEW(Node)
_node.op = NAME
_node.operands = ({ops})
_node.args = _argv
_node.avals = _entry.avals
_node.lowering = LOW
_node.info = {promote}
_node.hash = hash((_entry.base, _argv, {hx}))
if RECORDING[0]:
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


def _common_case(k: OpKernel, ns: dict):
    """The lines of the commonest call of an overload, or None: every Tensor argument an
    inner XLA tensor (the last one may also be a Python number), every Scalar left at a
    default that is None, 0 or 1, every optional tensor None. Its tuples (key, operands,
    arguments, hash) have fixed lengths, built in one step each; any other call goes to
    `general` (the lines above), which goes to the generic kernel."""
    plan = k.plan
    names = plan.names
    if NO_SPECIAL_SCALARS:
        return None
    tpos = [i for i, x in enumerate(k.kinds) if x in (TENSOR, OPT_TENSOR)]
    last_t = tpos[-1] if tpos and k.kinds[tpos[-1]] == TENSOR else -1
    head, key, argv, fixed = [], ["NAME"], [], []
    for i, kind in enumerate(plan.kinds):
        v = names[i]
        if kind == TENSOR:
            fixed.append(i)
            key += [f"_s{i}.shape", f"_s{i}.dtype"]
            argv.append(f"REFS[{len(fixed) - 1}]" if i != last_t else "LAST")
            if i == last_t:
                key[-2:] = ["*LASTKEY"]
        elif kind == OPT_TENSOR:
            head += [f"if {v} is not None:", "    return general(CALL)"]
            key.append("None")
            argv.append("None")
        elif kind == STATIC:
            head.append(f"_x{i} = freeze({v}) if type({v}) is list else {v}")
            key += [f"type(_x{i})", f"_x{i}"]
            argv.append(f"_x{i}")
        else:  # a Scalar: its default only, if that is None or a constant (0, 1)
            d = plan.defaults[i] if plan.has_default[i] else ...
            if d is None:
                key.append("None")
            elif type(d) in (int, float) and (d == 1 or d == 0 and math.copysign(1.0, d) > 0):
                ns[f"_kd{i}"] = (type(d), d)
                key.append(f"_kd{i}")
            else:
                return None
            head += [f"if {v} is not _d{i}:", "    return general(CALL)"]
            argv.append(f"_d{i}")
    promote = "_entry.common" if k.low.promote else "None"

    def tail(last_key, last_arg, last_op):
        """The lines from the key to the result, given the last tensor argument's key
        parts, argument and operand (None: no operand)."""
        ops = [f"(_s{i}.node, _s{i}.idx)" for i in fixed if i != last_t]
        hx = [f"_s{i}.node.hash, _s{i}.idx" for i in fixed if i != last_t]
        # `one` holds the entries of one output without fallback: a miss goes to `general`
        out = [f"_entry = one.get(({', '.join(x for kp in key for x in (last_key if kp == '*LASTKEY' else [kp]))},))",
               "if _entry is None or EAGER[0]:", "    return general(CALL)"]
        if last_op == "param":
            out.append(f"_n = scalar_param({names[last_t]}, _entry.common)")
            last_arg = f"REFS[{len(ops)}]"
            ops.append("(_n, 0)")
            hx.append("_n.hash, 0")
        elif last_op is not None:
            ops.append(last_op)
            hx.append(f"_s{last_t}.node.hash, _s{last_t}.idx")
        out += ["COUNT[0] += 1", f"_argv = ({''.join(a + ', ' for a in (last_arg if a == 'LAST' else a for a in argv))})"]
        # ir.make_node and tensor.make_tensor, inline: this is the path of most traced ops
        out += _NEW_NODE.format(ops="".join(o + ", " for o in ops), promote=promote,
                                hx="".join(h + ", " for h in hx)).splitlines()
        if k.low.checked:
            out.append("CHECK_SOURCES[_node] = user_line()")
        new_tensor = _NEW_TENSOR if ns["RECORD"] is None else _NEW_TENSOR.replace(
            "_t = EMPTY(_shape, _dtype)", _ON_INDEX)
        out += new_tensor.splitlines()
        return out

    lines = []
    inner = [i for i in fixed if i != last_t]
    if inner:
        lines += ["try:"] + [f"    _s{i} = {names[i]}._xla" for i in inner] + ["except AttributeError:",
                                                                              "    return general(CALL)"]
    lines += head
    if last_t < 0:
        return lines + tail([], None, None)
    v = names[last_t]
    # a type test first: cheaper than getattr with a default, and no exception for numbers
    lines += [f"_ty = type({v})", "if _ty is not float and _ty is not int:", "    try:", f"        _s{last_t} = {v}._xla",
              "    except AttributeError:", "        return general(CALL)"]
    lines += ["    " + x for x in tail([f"_s{last_t}.shape", f"_s{last_t}.dtype"], f"REFS[{len(inner)}]",
                                     f"(_s{last_t}.node, _s{last_t}.idx)")]
    # a wrapped Python number: a constant if 0 or 1, else a graph parameter (as `general`)
    lines += [f"if {v} == 1 or {v} == 0 and copysign(1.0, {v}) > 0:"]
    lines += ["    " + x for x in tail([f"(_ty, {v})"], v, None)]
    lines += tail(["_ty"], None, "param")
    return lines


