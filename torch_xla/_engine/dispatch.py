"""Aten kernels for the `xla` (PrivateUse1) dispatch key.

Every overload in the lowering table gets a generic kernel that turns the call into
an IR node: tensor arguments become operands, Scalars become graph parameters (or
constants for 0 and 1), everything else is a static argument. Output shapes and
dtypes come from a cache filled once per (op, input avals, static args) by running
PyTorch's meta kernel, so shape errors surface here, at the op's line, with
PyTorch's own exception. Ops without a lowering run on the CPU (the fallback) and
count as `aten::<op>`. Factories and transfers have their own kernels below.
"""
from __future__ import annotations

import keyword
import os
import threading
import warnings
from typing import Any, Dict, Optional

import numpy as np
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from . import decompositions, ir, metrics, process_group, runtime, rng, torch_patches
from .lowering import LOWERINGS, Lowering, load_all
from .tensor import (XlaState, make_tensor, replace_state, state_of, unwrap, wrap_user,
                     _is_functional)

T, OT, LT, LOT, S, OS, X = range(7)
_KIND_OF_TYPE = {
    "Tensor": T, "Optional[Tensor]": OT, "List[Tensor]": LT, "List[Optional[Tensor]]": LOT,
    "number": S, "Optional[number]": OS,
}
_DEFAULT_KIND = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
# 0 and 1 are baked into programs, other Python scalars are parameters. In a multi-process
# job every replica must compile the same program for its collectives to match, and a
# value like `rank * 10` would differ between them: there all scalars are parameters.
_NO_SPECIAL_SCALARS = (os.environ.get("XLA_NO_SPECIAL_SCALARS", "0") not in ("", "0")
                       or process_group.world_size() > 1)
_META = torch.device("meta")
_XLA0 = None
_REFS = ir.REFS
# Eager mode (torch_xla.experimental.eager_mode): run each op as it is traced.
EAGER = [False]
EAGER_DEFAULT = [False]


class ShapeEntry:
    """What the meta kernel told us about one (op, avals, statics) combination."""
    __slots__ = ("avals", "structure", "common", "fallback", "base")

    def __init__(self, avals, structure, common, fallback=False):
        self.base = None  # ir.node_base of the nodes built from this entry (set by the kernel)
        self.avals = avals
        self.structure = structure  # "one" | "tuple" | "list"
        self.common = common
        self.fallback = fallback


def _freeze(v):
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, torch.SymInt):
        return int(v)
    return v


def _xla_device():
    global _XLA0
    if _XLA0 is None:
        _XLA0 = torch.device("xla", 0)
    return _XLA0


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
        f"xla:0 and {t.device}! (when checking argument for {op_name})")


class OpKernel:
    """The kernel of one lowered aten overload."""

    def __init__(self, op: torch._ops.OpOverload, low: Lowering):
        self.op = op
        self.low = low
        self.name = op.name()  # aten::add.Tensor
        schema = op._schema
        self.arg_names = [a.name for a in schema.arguments]
        self.signature = [(a.name, str(a.type)) for a in schema.arguments]
        self.kinds = tuple(_KIND_OF_TYPE.get(str(a.type), X) for a in schema.arguments)
        self.defaults = [a.default_value if a.has_default_value() else None for a in schema.arguments]
        self.index_of = {n: i for i, n in enumerate(self.arg_names)}
        self.static_idx = frozenset(self.index_of[n] for n in low.static if n in self.index_of)
        self.kinds = tuple(X if i in self.static_idx else k for i, k in enumerate(self.kinds))
        self.nargs = len(self.arg_names)
        self.cache: Dict[Any, ShapeEntry] = {}
        self.counter_name = "aten::" + op._schema.name.split("::")[-1]
        # Factories (no tensor inputs) are called outside functionalization: wrap results.
        self.is_factory = not any(k in (T, OT, LT, LOT) for k in self.kinds)

    def entry_point(self, short: str):
        """The callable to register for overload `short`. Where a specialised fast path can
        be generated, a stub that generates it on the op's first call and registers it in
        its own place (generating all of them at import would cost about 0.3 s)."""
        return _LazyFast(self, short) if _specialisable(self) else self

    # -- the hot path (generic) ----------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.low.alias:
            x = args[0]
            if _is_functional(x):
                # Reached without functionalization (torch.tensor(..., device=) lifts its
                # result this way): keep the result a functional tensor.
                if self.name in ("aten::lift_fresh", "aten::lift"):
                    return x
                s = state_of(x)
                return wrap_user(make_tensor(s.node, s.idx, s.shape, s.dtype))
            s = state_of(x)
            out = make_tensor(s.node, s.idx, s.shape, s.dtype)
            if self.name in ("aten::lift_fresh", "aten::lift"):
                # torch.tensor(data, device=xla) moves its data with functionalization
                # excluded, then lifts the result: this is where it becomes a user tensor.
                return wrap_user(out)
            return out
        n = len(args)
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
            if kind == T:
                try:
                    s = v._xla
                except AttributeError:
                    if not isinstance(v, torch.Tensor):
                        kind = S  # a wrapped Python number: handled with the scalars below
                        s = None
                    else:
                        s = _tensor_state(v, self.name)
                        if s is None:
                            s = _scalar_state(v)
                if s is not None:
                    key.append(s.shape)
                    key.append(s.dtype)
                    argv.append(_REFS[len(operands)])
                    operands.append((s.node, s.idx))
                    continue
            if kind == X:
                if type(v) is list:
                    v = _freeze(v)
                argv.append(v)
                key.append(type(v))  # 2 == 2.0 == True, but they may give other dtypes
                key.append(v)
            elif kind == S or kind == OS:
                tv = type(v)
                if v is None:
                    argv.append(None)
                    key.append(None)
                    continue
                if tv is not int and tv is not float and tv is not bool:
                    if isinstance(v, torch.Tensor):
                        v = v.item()
                        tv = type(v)
                elif (v == 0 or v == 1) and not _NO_SPECIAL_SCALARS:
                    argv.append(v)
                    key.append((tv, v))
                    continue
                if scalars is None:
                    scalars = []
                scalars.append((len(argv), v))
                argv.append(None)  # filled below, once the parameter dtype is known
                key.append(tv)
            elif kind == OT:
                if v is None:
                    argv.append(None)
                    key.append(None)
                else:
                    s = _tensor_state(v, self.name)
                    if s is None:
                        s = _scalar_state(v)
                    argv.append(_REFS[len(operands)])
                    operands.append((s.node, s.idx))
                    key.append(s.shape)
                    key.append(s.dtype)
            else:  # LT / LOT
                refs = []
                for t in v:
                    if t is None:
                        refs.append(None)
                        key.append(None)
                        continue
                    if kind == LOT and t.device.type != "xla":
                        s = from_cpu(t)._xla  # CPU indices are allowed, as on other devices
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
            entry = self._infer(args)
            entry.base = ir.node_base(self.name, entry.avals, entry.common if self.low.promote else None)
            self.cache[key] = entry
        if entry.fallback:
            return cpu_fallback(self.op, args, {})
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
            from . import graph_executor
            graph_executor.execute([o._xla for o in outs if o is not None])
        if self.is_factory:
            outs = [wrap_user(o) if o is not None else None for o in outs]
        st = entry.structure
        if st == "one":
            return outs[0]
        return tuple(outs) if st == "tuple" else outs

    # -- the cold path: shape inference -------------------------------------------
    def _infer(self, args) -> ShapeEntry:
        torch_patches.lazy_dynamo_disable()
        margs = []
        promo = []
        for i, kind in enumerate(self.kinds):
            v = args[i]
            if kind == T and not isinstance(v, torch.Tensor):
                kind = S
            if kind in (T, OT):
                if v is None:
                    margs.append(None)
                else:
                    m = _to_meta(v)
                    margs.append(m)
                    promo.append(m)
            elif kind in (LT, LOT):
                ms = [None if t is None else _to_meta(t) for t in v]
                margs.append(ms)
                promo.extend(m for m in ms if m is not None)
            elif kind in (S, OS):
                if isinstance(v, torch.Tensor):
                    v = v.item()
                margs.append(v)
                if v is not None:
                    promo.append(v)
            else:
                if isinstance(v, torch.device) and v.type == "xla":
                    v = _META
                margs.append(v)
        kwargs = {}
        schema_args = self.op._schema.arguments
        pos = []
        for a, m in zip(schema_args, margs):
            if a.kwarg_only:
                kwargs[a.name] = m
            else:
                pos.append(m)
        try:
            if self.low.meta is not None:
                out = self.low.meta(*pos, **kwargs)
            else:
                out = self.op(*pos, **kwargs)
        except NotImplementedError:
            return ShapeEntry((), "one", None, fallback=True)
        except RuntimeError as e:
            msg = str(e)
            if ("data-dependent" in msg or "Meta" in msg or "meta" in msg and "not" in msg
                    or "Cannot" in msg and "meta" in msg):
                return ShapeEntry((), "one", None, fallback=True)
            raise
        if isinstance(out, torch.Tensor):
            structure, outs = "one", (out,)
        elif isinstance(out, tuple):
            structure, outs = "tuple", out
        else:
            structure, outs = "list", tuple(out)
        avals = []
        for o in outs:
            if o is None:
                avals.append(None)
            else:
                if not runtime.is_supported_dtype(o.dtype):
                    raise TypeError(f"dtype {o.dtype} is not supported on the xla device")
                avals.append((tuple(o.shape), o.dtype))
        common = None
        first = avals[0] if avals and avals[0] is not None else None
        if promo:
            try:
                common = elementwise_dtypes(*promo, type_promotion_kind=_DEFAULT_KIND)[1]
            except Exception:
                common = first[1] if first else None
            if first is not None and common is not None:
                od = first[1]
                if (od.is_floating_point or od.is_complex) and not (common.is_floating_point or common.is_complex):
                    common = od
        elif first is not None:
            common = first[1]
        if self.low.promote and common in (torch.bfloat16, torch.float16):
            # Like PyTorch's CPU kernels, compute half-precision elementwise math in float32
            # and round once at the end.
            common = torch.float32
        return ShapeEntry(tuple(avals), structure, common)


class _LazyFast:
    __slots__ = ("kernel", "short", "fast")

    def __init__(self, kernel: OpKernel, short: str):
        self.kernel, self.short, self.fast = kernel, short, None

    def __call__(self, *args, **kwargs):
        fast = self.fast
        if fast is None:
            global _lib_fast
            with _lock:
                if self.fast is None:
                    self.fast = _specialise(self.kernel)
                    if _lib_fast is None:
                        _lib_fast = torch.library.Library("aten", "IMPL")
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
                        _lib_fast.impl(self.short, self.fast, "PrivateUse1")
            fast = self.fast
        return fast(*args, **kwargs)


_lock = threading.Lock()
_lib_fast = None


def _specialisable(k: OpKernel) -> bool:
    low = k.low
    if low.alias or low.random or k.is_factory or any(x in (LT, LOT) for x in k.kinds):
        return False
    if any(keyword.iskeyword(a.name) or a.name.startswith("_") for a in k.op._schema.arguments):
        return False
    tensor_kinds = [x for x in k.kinds if x in (T, OT)]
    # operands must keep the generic kernel's (argument) order
    return not (OT in tensor_kinds and T in tensor_kinds[tensor_kinds.index(OT):])


def _specialise(k: OpKernel):
    """Generates a straight-line kernel for the common case of one overload: every tensor
    argument an inner XLA tensor (the last one may be a wrapped number), every Scalar a Python int/float, a cached shape entry
    with one output. It builds the same cache key and node as the generic
    `OpKernel.__call__`, which it calls for anything else (first call of a shape, other
    CPU scalars, fallbacks, eager mode), without the per-argument kind dispatch."""
    low = k.low
    ns = {"generic": k.__call__, "outputs": k._outputs, "cache": k.cache, "Node": ir.Node, "ScalarParam": ir.ScalarParam,
          "make_tensor": make_tensor, "Tensor": torch.Tensor, "REFS": _REFS, "EAGER": EAGER, "freeze": _freeze,
          "NOSPECIAL": _NO_SPECIAL_SCALARS, "NAME": k.name, "LOW": low, "PROMOTE": low.promote}
    params, call, tensors, lines, key, argv, scalars = [], [], [], [], ["NAME"], [], []
    kw_only = False
    tpos = [i for i, x in enumerate(k.kinds) if x in (T, OT)]
    last_t = tpos[-1] if tpos and k.kinds[tpos[-1]] == T else -1
    names = [a.name for a in k.op._schema.arguments]
    for i, (a, kind) in enumerate(zip(k.op._schema.arguments, k.kinds)):
        v = a.name
        if a.kwarg_only and not kw_only:
            params.append("*")
            kw_only = True
        if a.has_default_value():
            ns[f"_d{i}"] = a.default_value
            params.append(f"{v}=_d{i}")
        else:
            params.append(v)
        call.append(f"{v}={v}" if a.kwarg_only else v)
        if kind == T and i == last_t:
            # The last tensor argument may be a wrapped number (`x * 0.5` reaches the
            # backend as a Python float): a Scalar, as in the generic kernel.
            lines += [f"_s{i} = getattr({v}, '_xla', None)", f"if _s{i} is not None:",
                      f"    _k{i} = (_s{i}.shape, _s{i}.dtype); _p{i} = False; _w{i} = REFS[len(_ops)]",
                      f"    _ops.append((_s{i}.node, _s{i}.idx))",
                      "else:", f"    _t{i} = type({v})",
                      f"    if _t{i} is not float and _t{i} is not int:", "        return generic(CALL)",
                      f"    if not NOSPECIAL and ({v} == 0 or {v} == 1):",
                      f"        _k{i} = ((_t{i}, {v}),); _p{i} = False; _w{i} = {v}",
                      "    else:", f"        _k{i} = (_t{i},); _p{i} = True; _w{i} = None"]
            key.append(f"*_k{i}")
            argv.append(f"_w{i}")
            scalars.append((i, v))
        elif kind == T:
            tensors.append(i)
            key += [f"_s{i}.shape", f"_s{i}.dtype"]
            argv.append(f"REFS[{len(tensors) - 1}]")
        elif kind == OT:
            lines += [f"if {v} is None:", f"    _k{i} = (None,); _r{i} = None", "else:",
                      f"    _s{i} = getattr({v}, '_xla', None)", f"    if _s{i} is None:", "        return generic(CALL)",
                      f"    _k{i} = (_s{i}.shape, _s{i}.dtype)",
                      f"    _r{i} = REFS[len(_ops)]; _ops.append((_s{i}.node, _s{i}.idx))"]
            key.append(f"*_k{i}")
            argv.append(f"_r{i}")
        elif kind == X:
            lines.append(f"_x{i} = freeze({v}) if type({v}) is list else {v}")
            key += [f"type(_x{i})", f"_x{i}"]
            argv.append(f"_x{i}")
        else:  # S / OS: 0 and 1 are constants (unless NOSPECIAL), other numbers parameters
            scalars.append((i, v))
            lines += [f"_t{i} = type({v})", f"if {v} is None:", f"    _k{i} = None; _p{i} = False",
                      f"elif _t{i} is not int and _t{i} is not float:", "    return generic(CALL)",
                      f"elif not NOSPECIAL and ({v} == 0 or {v} == 1):", f"    _k{i} = (_t{i}, {v}); _p{i} = False",
                      "else:", f"    _k{i} = _t{i}; _p{i} = True"]
            key.append(f"_k{i}")
            argv.append(f"(None if _p{i} else {v})")
    body = []
    if tensors:
        body = (["try:"] + [f"    _s{i} = {names[i]}._xla" for i in tensors]
                + ["except AttributeError:", "    return generic(CALL)"])
    body.append(f"_ops = [{', '.join(f'(_s{i}.node, _s{i}.idx)' for i in tensors)}]")
    body += lines
    body.append(f"_entry = cache.get(({', '.join(key)},))")
    body += ["if _entry is None or _entry.fallback or EAGER[0]:", "    return generic(CALL)"]
    body.append(f"_argv = [{', '.join(argv)}]")
    for i, v in scalars:
        body += [f"if _p{i}:", f"    _argv[{i}] = REFS[len(_ops)]; _ops.append((ScalarParam({v}, _entry.common), 0))"]
    body += ["_node = Node(NAME, tuple(_ops), tuple(_argv), _entry.avals, LOW, _entry.common if PROMOTE else None, _entry.base)",
             "if _entry.structure != 'one':", "    return outputs(_node, _entry)",
             "_shape, _dtype = _entry.avals[0]", "return make_tensor(_node, 0, _shape, _dtype)"]
    src = f"def fast({', '.join(params)}):\n" + "\n".join("    " + l.replace("CALL", ", ".join(call))
                                                          for l in body) + "\n"
    exec(compile(src, f"<kernel {k.name}>", "exec"), ns)
    fast = ns["fast"]
    fast.source = src
    return fast


def _to_meta(t: torch.Tensor):
    if t.device.type == "xla":
        s = t._xla if hasattr(t, "_xla") else state_of(t)
        return torch.empty(s.shape, dtype=s.dtype, device=_META)
    if t.dim() == 0:
        return t  # a CPU scalar tensor takes part as a wrapped number
    return torch.empty(t.shape, dtype=t.dtype, device=_META)


# ---------------------------------------------------------------------------------------
# CPU fallback

def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """Materialises an XLA tensor on the CPU (a host read)."""
    from . import graph_executor
    s = state_of(t)
    with metrics.timed("TransferFromDeviceTime"):
        arr = graph_executor.materialize(s)
        host = runtime.fetch(arr)
    return runtime.from_numpy(host, s.dtype)


def from_cpu(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A new inner XLA tensor holding a copy of CPU tensor `t`."""
    if dtype is not None and dtype != t.dtype:
        t = t.to(dtype)
    if not runtime.is_supported_dtype(t.dtype):
        raise TypeError(f"dtype {t.dtype} is not supported on the xla device")
    with metrics.timed("TransferToDeviceTime"):
        host = runtime.to_numpy(t)
        dd = runtime.device_dtype(t.dtype)
        if host.dtype != dd:
            host = host.astype(dd)
        arr = runtime.put(host)
    aval = (tuple(t.shape), t.dtype)
    return make_tensor(ir.DeviceData(arr, aval), 0, aval[0], aval[1])


def set_data(t: torch.Tensor, cpu: torch.Tensor) -> None:
    """Replaces the value of inner XLA tensor `t` with CPU data (fallback write-back)."""
    if tuple(t.shape) != tuple(cpu.shape):
        k_resize_(t, cpu.shape)
    replace_state(t, from_cpu(cpu.to(t.dtype))._xla)


_CPU_OPERANDS_OK = frozenset({"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index",
                              "_unsafe_index_put", "copy_", "_copy_from", "_copy_from_and_resize"})


def _check_devices(name, args, kwargs):
    """PyTorch's same-device rule: XLA tensors mixed with non-scalar CPU tensors is an error."""
    devs = set()

    def visit(a):
        if isinstance(a, torch.Tensor):
            if a.device.type == "xla":
                devs.add("xla:0")
            elif a.dim() > 0:
                devs.add(str(a.device))
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)

    for a in args:
        visit(a)
    for a in kwargs.values():
        visit(a)
    if len(devs) > 1 and "xla:0" in devs:
        other = sorted(d for d in devs if d != "xla:0")[0]
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                           f"devices, xla:0 and {other}! (when checking argument for aten::{name})")


def cpu_fallback(op, args, kwargs):
    """Runs `op` in eager PyTorch on the CPU and moves the results back to the device."""
    name = op._schema.name.split("::")[-1]
    if name not in _CPU_OPERANDS_OK:
        _check_devices(name, args, kwargs)
    metrics.inc("aten::" + name)
    xla_args = []

    def conv(a):
        if isinstance(a, torch.Tensor) and a.device.type == "xla":
            c = to_cpu(a)
            xla_args.append((a, c))
            return c
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        if isinstance(a, torch.device) and a.type == "xla":
            return torch.device("cpu")
        return a

    cargs = [conv(a) for a in args]
    ckwargs = {k: conv(v) for k, v in kwargs.items()}
    out = op(*cargs, **ckwargs)
    # Mutated arguments: write the CPU result back into the XLA tensor.
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor) and v.device.type == "xla":
                c = cargs[i] if i < len(cargs) else ckwargs.get(a.name)
                set_data(unwrap(v), c)
    mutated = {id(c) for i, a in enumerate(op._schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write
               for c in [cargs[i] if i < len(cargs) else ckwargs.get(a.name)]}
    cpu_to_xla = {id(c): a for a, c in xla_args}

    def back(o):
        if isinstance(o, torch.Tensor):
            if id(o) in mutated and id(o) in cpu_to_xla:
                return cpu_to_xla[id(o)]
            return from_cpu(o)
        if isinstance(o, (list, tuple)):
            return type(o)(back(x) for x in o)
        return o

    return back(out)


def _fallback_kernel(op, *args, **kwargs):
    return cpu_fallback(op, args, kwargs)


# ---------------------------------------------------------------------------------------
# factories and transfers

def _const_tensor(shape, dtype, value):
    """A tensor of `shape` filled with a constant (no device memory until used)."""
    shape = tuple(int(s) for s in shape)
    node = ir.Constant(value, ((), dtype))
    full = ir.Node("xla::broadcast", ((node, 0),), (ir.ref(0), shape), ((shape, dtype),),
                   LOWERINGS["xla::broadcast"], None)
    return make_tensor(full, 0, shape, dtype)


def _check_dtype(dtype):
    if not runtime.is_supported_dtype(dtype):
        raise TypeError(f"dtype {dtype} is not supported on the xla device")


def k_empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    dtype = dtype or torch.get_default_dtype()
    _check_dtype(dtype)
    return wrap_user(_const_tensor(size, dtype, 0))


def k_empty_quantized(size, qtensor, dtype=None, layout=None, device=None, pin_memory=None,
                      memory_format=None):
    raise TypeError(f"dtype {qtensor.dtype} is not supported on the xla device")


def k_empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return k_empty(size, dtype)


def k_to_copy(x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    src_xla = x.device.type == "xla"
    dst_xla = (device.type == "xla") if device is not None else src_xla
    if not src_xla and dst_xla:
        return wrap_user(from_cpu(x, dtype))
    if src_xla and not dst_xla:
        c = to_cpu(x)
        return c.to(device=device, dtype=dtype or c.dtype)
    # xla -> xla: a (possibly converting) lazy copy; same dtype shares the value.
    inner = unwrap(x) if _is_functional(x) else x
    if dtype is None or dtype == inner.dtype:
        s = state_of(inner)
        return wrap_user(make_tensor(s.node, s.idx, s.shape, s.dtype))
    return wrap_user(_TO_COPY(inner, dtype=dtype))


def k_copy_from(src, dst, non_blocking=False):
    """`dst.copy_(src)` across devices."""
    if src.device.type == "xla" and dst.device.type != "xla":
        dst.copy_(to_cpu(src))
        return dst
    if src.device.type != "xla" and dst.device.type == "xla":
        replace_state(dst, from_cpu(src.to(dst.dtype).expand(dst.shape).contiguous())._xla)
        return dst
    raise RuntimeError("_copy_from: unsupported device pair")


def k_copy_(dst, src, non_blocking=False):
    """In-place copy on a non-functional inner tensor."""
    if src.device.type != "xla":
        return k_copy_from(src, dst, non_blocking)
    replace_state(dst, _COPY(dst, src)._xla)
    return dst


def k_copy(self, src, non_blocking=False):
    if src.device.type != "xla":
        return from_cpu(src.to(self.dtype).expand(self.shape).contiguous())
    return _COPY(self, src)


def k_local_scalar_dense(x):
    metrics.inc("aten::_local_scalar_dense")
    return to_cpu(x).item()


def k_equal(self, other):
    """`torch.equal`: a Python bool, so the comparison is read from the device once."""
    _check_devices("equal", (self, other), {})
    if tuple(self.shape) != tuple(other.shape):
        return False
    return bool(torch.ops.aten.all.default(torch.ops.aten.eq.Tensor(self, other)).item())


def _host_lengths(t):
    return [int(v) for v in to_cpu(t).tolist()] if isinstance(t, torch.Tensor) else list(t)


def k_ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """CTC with lengths given as tensors: the lengths decide the output's shape, so they are
    read to the host (once) and the list overload runs on the device."""
    return torch.ops.aten._ctc_loss.default(log_probs, targets, _host_lengths(input_lengths),
                                            _host_lengths(target_lengths), blank, zero_infinity)


def k_ctc_loss_backward_tensor(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha,
                               blank, zero_infinity=False):
    return torch.ops.aten._ctc_loss_backward.default(grad, log_probs, targets, _host_lengths(input_lengths),
                                                     _host_lengths(target_lengths), nll, log_alpha, blank,
                                                     zero_infinity)


def k_is_pinned(x, device=None):
    return False


def k_resize_(self, size, memory_format=None):
    """Resizing an inner tensor: new sizes, contents undefined (zeros), as for `out=` tensors."""
    size = tuple(int(v) for v in size)
    if tuple(self.shape) == size:
        return self
    new = _const_tensor(size, self.dtype, 0)
    self.data = new  # takes the new sizes; the Python object (and its attributes) stays
    self._xla = new._xla
    return self


def k_set_source(self, source):
    s = self._xla if hasattr(self, "_xla") else state_of(self)
    src = state_of(source)
    s.node, s.idx, s.shape, s.dtype = src.node, src.idx, src.shape, src.dtype
    return self


_TO_COPY = None
_COPY = None
_lib = None
_lib_fallback = None
_registered = False
KERNELS: Dict[str, OpKernel] = {}


def _overload(name: str):
    if "::" in name:
        return None
    packet, ov = name.split(".", 1)
    pk = getattr(torch.ops.aten, packet, None)
    if pk is None:
        return None
    return getattr(pk, ov, None)


class _InplaceKernel:
    """`foo_(self, ...)` on an inner tensor: the functional `foo`, then self takes the value.

    Functionalization turns user-level in-place ops into functional ones before they
    reach the backend; these kernels serve PyTorch's own composite kernels, which run
    below functionalization on inner tensors.
    """

    def __init__(self, functional: OpKernel):
        self.functional = functional

    def __call__(self, *args, **kwargs):
        out = self.functional(*args, **kwargs)
        target = args[0]
        if isinstance(out, (list, tuple)):  # _foreach_*_: self is a list
            for t, o in zip(target, out):
                replace_state(t, o._xla)
            return None
        if target.dtype != out.dtype:
            out = _TO_COPY(out, dtype=target.dtype)
        replace_state(target, out._xla)
        return target


class _OutKernel:
    """`foo.out(..., out=)`: the functional `foo`, then `out` takes the value (and shape)."""

    def __init__(self, functional: OpKernel, out_names):
        self.functional = functional
        self.out_names = out_names

    def __call__(self, *args, **kwargs):
        outs = [kwargs.pop(n) for n in self.out_names]
        res = self.functional(*args, **kwargs)
        res = list(res) if isinstance(res, (list, tuple)) else [res]
        for o, r in zip(outs, res):
            if o.dtype != r.dtype:
                r = _TO_COPY(r, dtype=o.dtype)
            if tuple(o.shape) != r._xla.shape:
                o.resize_(r.shape)
            replace_state(o, r._xla)
        return outs[0] if len(outs) == 1 else tuple(outs)


def _register_mutating_variants(special) -> None:
    """Registers `foo_` and `foo.out` for every lowered functional `foo` that has them."""
    for name, k in list(KERNELS.items()):
        if name.startswith("_to_copy") or name.startswith("copy"):
            continue
        packet, ov = name.split(".", 1)
        # in-place: foo_.ov
        ip = _overload(f"{packet}_.{ov}")
        if ip is not None and not _is_composite_implicit(ip):
            short = f"{packet}_" if ov == "default" else f"{packet}_.{ov}"
            if short not in special:
                _lib.impl(short, _InplaceKernel(k), "PrivateUse1")
        # out variant: the overload of the same packet taking the same inputs plus out=.
        for oo in _out_overloads(packet):
            ins = [(a.name, str(a.type)) for a in oo._schema.arguments if not a.is_out]
            if ins == k.signature and not _is_composite_implicit(oo):
                out_args = [a.name for a in oo._schema.arguments if a.is_out]
                _lib.impl(oo.name().split("::")[1], _OutKernel(k, out_args), "PrivateUse1")
                break


def _out_overloads(packet: str):
    pk = getattr(torch.ops.aten, packet, None)
    if pk is None:
        return []
    res = []
    for ov in pk.overloads():
        op = getattr(pk, ov)
        if any(a.is_out for a in op._schema.arguments):
            res.append(op)
    return res


def _is_composite_implicit(op) -> bool:
    name = op.name()
    if name.endswith(".default"):
        name = name[:-len(".default")]
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
    except RuntimeError:
        return False


def register() -> None:
    """Installs every kernel for the xla dispatch key (idempotent)."""
    global _registered, _lib, _lib_fallback, _TO_COPY, _COPY
    if _registered:
        return
    _registered = True
    load_all()
    _lib = torch.library.Library("aten", "IMPL")
    special = {
        "empty.memory_format": k_empty,
        "empty_strided": k_empty_strided,
        "_to_copy": k_to_copy,
        "_copy_from": k_copy_from,
        "copy_": k_copy_,
        "copy": k_copy,
        "_local_scalar_dense": k_local_scalar_dense,
        "is_pinned": k_is_pinned,
        "equal": k_equal,
        "_ctc_loss.Tensor": k_ctc_loss_tensor,
        "_ctc_loss_backward.Tensor": k_ctc_loss_backward_tensor,
        "set_.source_Tensor": k_set_source,
        "resize_": k_resize_,
    }
    for name, low in LOWERINGS.items():
        op = _overload(name)
        if op is None:
            continue
        k = OpKernel(op, low)
        KERNELS[name] = k
        short = name[:-len(".default")] if name.endswith(".default") else name
        if short in special or name in special:
            continue
        if _is_composite_implicit(op):
            # PyTorch decomposes these above autograd; a backend kernel would hide their
            # derivative. Their lowering still serves dynamo/export graphs.
            continue
        _lib.impl(short, k.entry_point(short), "PrivateUse1")
    _register_mutating_variants(special)
    for short, k in decompositions.kernels(LOWERINGS).items():
        _lib.impl(short, k, "PrivateUse1")
    _TO_COPY = KERNELS["_to_copy.default"]
    _COPY = KERNELS["copy.default"]
    for name, fn in special.items():
        _lib.impl(name, fn, "PrivateUse1")
    # Quantized CPU tensors reach the device through empty_quantized: refuse by dtype.
    _lib.impl("empty_quantized", k_empty_quantized, "QuantizedPrivateUse1")
    _lib_fallback = torch.library.Library("_", "IMPL")
    _lib_fallback.fallback(_fallback_kernel, "PrivateUse1")


def engine_op(name: str, inputs, statics: tuple, avals) -> list:
    """Applies engine op `name` (a lowering registered as "xla::...") to XLA tensors.

    The lowering receives the inputs' jax values followed by `statics`; `avals` are the
    (shape, dtype) of its outputs. Returns new user-level XLA tensors.
    """
    operands = []
    for t in inputs:
        s = state_of(t)
        operands.append((s.node, s.idx))
    args = tuple(ir.ref(i) for i in range(len(operands))) + tuple(_freeze(v) for v in statics)
    node = ir.Node(name, tuple(operands), args, tuple((tuple(sh), dt) for sh, dt in avals),
                   LOWERINGS[name], None)
    return [wrap_user(make_tensor(node, i, tuple(sh), dt)) for i, (sh, dt) in enumerate(avals)]
