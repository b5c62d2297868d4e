"""`torch_xla.stablehlo`: a `torch.export` program as StableHLO that runs anywhere.

`exported_program_to_stablehlo(exported)` traces the exported graph once on the xla device
(the capture seam, `_engine/capture.py`) and keeps one jax program per method whose
arguments are the weights, then the flat user inputs. The result, a
`StableHLOGraphModule`, runs on xla (or CPU) tensors, prints its StableHLO, and saves to a
directory that plain jax can load and run without torch (the format: docs/stablehlo.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Set

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ._engine import capture as _capture, ir, telemetry, pjrt
from ._engine.executor.lower import build_fn
from ._engine.tensor import make_tensor, state_of, wrap_user
from .experimental import quantized as _quantized  # noqa: F401  (quantize / dequantize ops on the device)

FORMAT_VERSION = 1


@dataclasses.dataclass
class StableHLOExportOptions:
    """How a program is exported.

    include_human_readable_text: also save the StableHLO text beside the program;
    inline_all_constant: Python scalars of the graph become constants of the program
      (False: program arguments, saved with the weights; 0 and 1 are always constants);
    override_tracing_arguments / override_tracing_kwargs: trace on these inputs instead of
      the exported program's example inputs;
    save_weights: write the weights beside the program when saving;
    export_weights: keep the weights in the module (False: the caller supplies them);
    custom_ops_allowed_in_graph: namespaces of custom ops (`torch.ops.<ns>.*`) exported as
      `stablehlo.custom_call @<ns>.<op>.<overload>` of the op's output shapes, not run;
    export_node_metadata: each FX node's metadata (stack trace, module stack, source
      function) as the MLIR location of the operations it produced.
    """
    include_human_readable_text: bool = True
    inline_all_constant: bool = True
    override_tracing_arguments: Optional[tuple] = None
    override_tracing_kwargs: Optional[dict] = None
    save_weights: bool = True
    export_weights: bool = True
    custom_ops_allowed_in_graph: Set[str] = dataclasses.field(default_factory=set)
    export_node_metadata: bool = False


@dataclasses.dataclass
class StableHLOFunc:
    """One method: its serialized jax program and signature."""
    serialized: bytes                    # jax.export serialization (loadable by jax alone)
    weight_names: List[str]              # the program's first arguments, by state-dict name
    input_avals: List[tuple]             # (shape, dtype name) of each flat user input
    output_avals: List[tuple]
    in_spec: str                         # pytree specs (torch.utils._pytree.treespec_dumps)
    out_spec: str
    text: str = ""

    def exported(self):
        jax = pjrt.jax_module()
        return jax.export.deserialize(bytearray(self.serialized))


@dataclasses.dataclass
class StableHLOModelBundle:
    """What a saved export holds: the weights and the methods."""
    state_dict: Dict[str, torch.Tensor]
    methods: Dict[str, StableHLOFunc]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return pjrt.to_numpy(t.detach().cpu())


class StableHLOGraphModule:
    """An exported program as StableHLO: call it like the model (xla or CPU tensors in,
    xla tensors out), read its StableHLO, or `save` it."""

    def __init__(self, bundle: StableHLOModelBundle):
        self._bundle = bundle
        self._calls: Dict[str, Any] = {}
        self._device_weights: Optional[Dict[str, Any]] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call("forward", *args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Runs `method` on `args` (its flat inputs must match the traced shapes)."""
        func = self._bundle.methods[method]
        flat = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        got = [(tuple(a.shape), _dtype_name(a.dtype)) for a in flat]
        want = [(tuple(s), d) for s, d in func.input_avals]
        if len(got) != len(want) or any(
                gd != wd or len(gs) != len(ws) or any(isinstance(w, int) and g != w for g, w in zip(gs, ws))
                for (gs, gd), (ws, wd) in zip(got, want)):
            raise ValueError(f"StableHLOGraphModule.{method}: inputs {got}, the program was exported for {want}")
        jax = pjrt.jax_module()
        fn = self._calls.get(method)
        if fn is None:
            fn = self._calls[method] = jax.jit(func.exported().call)
        weights = self._weights(func)
        arrays = [_array_of(t) for t in flat]
        outs = fn(*weights, *arrays)
        telemetry.inc("ExecuteCount")
        res = []
        for o, (_, dname) in zip(outs, func.output_avals):
            shape, dtype = tuple(o.shape), getattr(torch, dname)
            res.append(wrap_user(make_tensor(ir.DeviceData(o, (shape, dtype)), 0, shape, dtype)))
        return pytree.tree_unflatten(res, pytree.treespec_loads(func.out_spec))

    def _weights(self, func: StableHLOFunc) -> list:
        if self._device_weights is None:
            self._device_weights = {}
        out = []
        for name in func.weight_names:
            a = self._device_weights.get(name)
            if a is None:
                t = self._bundle.state_dict.get(name)
                if t is None:
                    raise ValueError(f"StableHLOGraphModule: weight {name!r} is missing (the export was saved "
                                     "without weights; put them in ._bundle.state_dict)")
                a = self._device_weights[name] = pjrt.put(_to_numpy(t))
            out.append(a)
        return out

    def get_stablehlo_text(self, method: str = "forward") -> str:
        """The StableHLO of `method`, as text: quantize / dequantize as StableHLO's uniform
        ops on quantized types (`_engine/lowering/qdq.py`), and, where the export recorded
        debug information (`experimental/xla_mlir_debuginfo.py`), the operations' locations.
        The serialized program and its bytecode keep the exact arithmetic they run."""
        func = self._bundle.methods[method]
        if not func.text:
            func.text = _readable_text(func.exported())
        return func.text

    def get_stablehlo_bytecode(self, method: str = "forward") -> bytes:
        """The StableHLO of `method` as portable MLIR bytecode."""
        return bytes(self._bundle.methods[method].exported().mlir_module_serialized)

    def save(self, path: os.PathLike, options: Optional[StableHLOExportOptions] = None) -> None:
        """Writes the export to directory `path` (docs/stablehlo.md)."""
        options = options or StableHLOExportOptions()
        path = os.fspath(path)
        os.makedirs(os.path.join(path, "functions"), exist_ok=True)
        meta = {"format": "torch_xla.stablehlo", "version": FORMAT_VERSION, "methods": {}, "weights": {}}
        for name, func in self._bundle.methods.items():
            with open(os.path.join(path, "functions", f"{name}.jaxexport"), "wb") as f:
                f.write(func.serialized)
            with open(os.path.join(path, "functions", f"{name}.mlirbc"), "wb") as f:
                f.write(self.get_stablehlo_bytecode(name))
            if options.include_human_readable_text:
                with open(os.path.join(path, "functions", f"{name}.mlir"), "w") as f:
                    f.write(self.get_stablehlo_text(name))
            meta["methods"][name] = {"weights": func.weight_names, "inputs": func.input_avals,
                                     "outputs": func.output_avals, "in_spec": func.in_spec,
                                     "out_spec": func.out_spec}
        if options.save_weights and self._bundle.state_dict:
            os.makedirs(os.path.join(path, "data"), exist_ok=True)
            arrays = {}
            for k, t in self._bundle.state_dict.items():
                meta["weights"][k] = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
                a = _to_numpy(t)
                arrays[k] = a.view(np.uint16) if t.dtype == torch.bfloat16 else a
            np.savez(os.path.join(path, "data", "weights.npz"), **arrays)
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)

    @classmethod
    def load(cls, path: os.PathLike) -> "StableHLOGraphModule":
        """Reads an export written by `save`."""
        path = os.fspath(path)
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("format") != "torch_xla.stablehlo" or meta.get("version", 0) > FORMAT_VERSION:
            raise ValueError(f"{path} is not a torch_xla.stablehlo export this version can read")
        methods = {}
        for name, m in meta["methods"].items():
            with open(os.path.join(path, "functions", f"{name}.jaxexport"), "rb") as f:
                blob = f.read()
            methods[name] = StableHLOFunc(blob, m["weights"], [tuple(a) for a in m["inputs"]],
                                          [tuple(a) for a in m["outputs"]], m["in_spec"], m["out_spec"])
        state = {}
        wfile = os.path.join(path, "data", "weights.npz")
        if os.path.exists(wfile):
            with np.load(wfile) as z:
                for k, info in meta["weights"].items():
                    dtype = getattr(torch, info["dtype"])
                    a = z[k]
                    state[k] = (torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
                                if dtype == torch.bfloat16 else torch.from_numpy(a.copy()))
        return cls(StableHLOModelBundle(state, methods))


def _readable_text(exp) -> str:
    from ._engine.lowering import qdq
    from .experimental import xla_mlir_debuginfo as debuginfo
    return qdq.rewrite_text(debuginfo.locations_text(exp.mlir_module()))


def _array_of(t: torch.Tensor):
    if t.device.type != "xla":
        return pjrt.put(_to_numpy(t))
    from ._engine import executor
    return executor.materialize(state_of(t))


class _OnDevice(torch.fx.Interpreter):
    """Runs an exported graph on the xla device: the graph recorded the device of its
    example inputs (`device=cpu` of factories and `_assert_tensor_metadata`); those
    name the xla device instead. Custom ops of the namespaces in `custom_ops` become
    custom calls; a custom op with a kernel for PyTorch/XLA's `XLA` dispatch key (and
    none for the xla device's key) runs that kernel; `metadata`: each node's metadata
    is recorded as debug information on the operations computing its results."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, custom_ops: Set[str] = frozenset(),
                 metadata: bool = False):
        super().__init__(gm)
        self.device = device
        self.custom_ops = custom_ops
        self.metadata = metadata
        self._node = None

    def run_node(self, n):
        self._node = n
        res = super().run_node(n)
        if self.metadata and n.op == "call_function":
            from .experimental.xla_mlir_debuginfo import annotate
            data = _node_metadata(n)
            for t in pytree.tree_leaves(res):
                if isinstance(t, torch.Tensor) and t.device.type == "xla":
                    annotate(t, data)
        return res

    def call_function(self, target, args, kwargs):
        dev = kwargs.get("device")
        if isinstance(dev, torch.device) and dev.type == "cpu":
            kwargs = dict(kwargs, device=self.device)
        if isinstance(target, torch._ops.OpOverload):
            if target.namespace in self.custom_ops:
                from .experimental.stablehlo_custom_call import (extract_custom_call_outputs_shape_dtype,
                                                                 stablehlo_custom_call)
                shapes, dtypes = extract_custom_call_outputs_shape_dtype(self._node)
                operands = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
                res = stablehlo_custom_call(operands, str(target), shapes, dtypes)
                return tuple(res) if isinstance(res, list) else res
            if target.namespace not in ("aten", "prim", "prims") and _xla_key_only(target):
                return target.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.XLA), *args, **kwargs)
        return super().call_function(target, args, kwargs)


def _xla_key_only(op) -> bool:
    """Whether `op` has a kernel for the `XLA` dispatch key and none for the xla device's."""
    name = op.name()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "XLA") and not has(name, "PrivateUse1")


def _node_metadata(n: torch.fx.Node) -> str:
    """An FX node's metadata as JSON: its stack trace, module stack and source functions
    (every key present, empty when the node has none) and the torch function it came from."""
    stack = n.meta.get("nn_module_stack") or {}
    meta = {
        "stack_trace": n.meta.get("stack_trace") or "",
        "nn_module_stack": {k: [str(v) for v in (vals if isinstance(vals, (tuple, list)) else (vals,))]
                            for k, vals in stack.items()},
        "source_fn_stack": [[str(a), getattr(b, "__name__", str(b))] for a, b in n.meta.get("source_fn_stack") or ()],
    }
    if n.meta.get("torch_fn"):
        meta["torch_fn"] = [str(v) for v in n.meta["torch_fn"]]
    return json.dumps(meta)


def _affine(expr):
    """(symbol, a, c) when sympy `expr` is a * symbol + c with integers a > 0 and c."""
    syms = list(expr.free_symbols)
    if len(syms) != 1:
        return None
    sym = syms[0]
    try:
        poly = expr.as_poly(sym)
    except Exception:   # not a polynomial (floor division, max...)
        return None
    if poly is None or poly.degree() != 1:
        return None
    a, c = poly.all_coeffs()
    if not (a.is_Integer and c.is_Integer and int(a) > 0):
        return None
    return sym, int(a), int(c)


def _bound(v, default: int) -> int:
    """A range bound of a size as an int (`default` when absent or infinite)."""
    try:
        return int(v) if v is not None else default
    except (TypeError, ValueError, OverflowError, AttributeError):
        return default


def _dynamic_dims(exported: torch.export.ExportedProgram, leaves: list) -> Dict[str, dict]:
    """The exported program's symbolic input sizes: symbol -> {"range": (lo, hi),
    "example": its value in `leaves` (the inputs traced first), "at": [(flat user input,
    dim, a, c)]}: that dimension's size is a * symbol + c (a derived `Dim`, as `2 * b`)."""
    placeholders = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    users = [sp for sp in exported.graph_signature.input_specs if sp.kind.name == "USER_INPUT"]
    out: Dict[str, dict] = {}
    for k, spec in enumerate(users):
        val = placeholders[spec.arg.name].meta.get("val") if hasattr(spec.arg, "name") else None
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if isinstance(size, int):
                continue
            expr = size.node.expr
            affine = _affine(expr)
            if affine is None:
                raise ValueError(f"exported_program_to_stablehlo: input {spec.arg.name} has size {expr} in "
                                 f"dimension {d}; only sizes a * Dim + c can be exported as dynamic")
            sym, a, c = affine
            name = str(sym)
            vr = exported.range_constraints.get(sym)
            lo = _bound(vr.lower if vr is not None else None, 0)
            hi = _bound(vr.upper if vr is not None else None, 2 ** 62)
            leaf = leaves[k] if k < len(leaves) else None
            actual = leaf.shape[d] if isinstance(leaf, torch.Tensor) and leaf.dim() > d else size.node.hint
            if (int(actual) - c) % a:
                raise ValueError(f"exported_program_to_stablehlo: input {spec.arg.name} has {actual} in dimension "
                                 f"{d}, which is not {expr} for any {name}")
            entry = out.setdefault(name, {"range": (max(lo, 1), hi), "example": (int(actual) - c) // a, "at": []})
            entry["at"].append((k, d, a, c))
    if out and len(users) != len(leaves):
        raise ValueError("exported_program_to_stablehlo: dynamic dimensions with inputs that are not tensors")
    return out


def exported_program_to_stablehlo(exported: torch.export.ExportedProgram,
                                  options: Optional[StableHLOExportOptions] = None) -> StableHLOGraphModule:
    """Lowers a `torch.export` program to StableHLO (traced once on the xla device; with
    `torch.export.Dim` sizes, traced at a few sizes and exported with symbolic sizes)."""
    options = options or StableHLOExportOptions()
    sig = exported.graph_signature
    weights: Dict[str, torch.Tensor] = {}
    weight_names: List[str] = []
    for spec in sig.input_specs:
        if spec.kind.name == "USER_INPUT":
            continue
        if spec.kind.name not in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            raise ValueError(f"exported_program_to_stablehlo: inputs of kind {spec.kind.name} are not supported")
        t = exported.state_dict.get(spec.target)
        if t is None:
            t = exported.constants[spec.target]
        weights[spec.target] = t.detach()
        weight_names.append(spec.target)
    if options.override_tracing_arguments is not None:
        args, kwargs = tuple(options.override_tracing_arguments), dict(options.override_tracing_kwargs or {})
    else:
        args, kwargs = exported.example_inputs
    user_leaves, in_spec = pytree.tree_flatten((args, kwargs))
    dynamic = _dynamic_dims(exported, user_leaves)
    dev = torch.device("xla", pjrt.device_index())
    xla_weights = [weights[n].to(dev) for n in weight_names]
    user_out_pos = [i for i, s in enumerate(sig.output_specs) if s.kind.name == "USER_OUTPUT"]
    gm = exported.graph_module

    def run(*flat):
        outs = _OnDevice(gm, dev, options.custom_ops_allowed_in_graph, options.export_node_metadata).run(*flat)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return [outs[i] for i in user_out_pos]

    def trace(leaves):
        xla_user = [a.detach().to(dev) if isinstance(a, torch.Tensor) else a for a in leaves]
        with torch.no_grad():
            # not run: exporting needs the program only (a custom call's target may exist
            # only where the StableHLO goes)
            program, _ = _capture.trace(run, *xla_weights, *xla_user, run=False)
        if program is None:
            raise RuntimeError("exported_program_to_stablehlo: the program is not one graph (a host read, a CPU "
                               "fallback or an execution happened while tracing it, or it returned no xla tensor)")
        return program, xla_user

    program, xla_user = trace(user_leaves)
    jax = pjrt.jax_module()
    inputs = xla_weights + [a for a in xla_user if isinstance(a, torch.Tensor)]
    user_shapes = [list(t.shape) for t in inputs[len(xla_weights):]]
    symbolic = None
    if dynamic:
        symbolic, user_shapes = _symbolic_program(program, dynamic, user_leaves, trace)
    fn, extra = _program_function(program, len(xla_weights), options.inline_all_constant, symbolic)
    avals = [jax.ShapeDtypeStruct(tuple(t.shape), pjrt.device_dtype(t.dtype))
             for t in inputs[:len(xla_weights)] + extra]
    avals += [jax.ShapeDtypeStruct(tuple(shape), pjrt.device_dtype(t.dtype))
              for shape, t in zip(user_shapes, inputs[len(xla_weights):])]
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _custom_call_targets(program.graph)]
    exp = jax.export.export(jax.jit(fn), disabled_checks=checks)(*avals)
    names = list(weight_names) + [f"__constant_{i}" for i in range(len(extra))]
    state = dict(weights) if options.export_weights else {}
    if options.export_weights:
        state.update(zip(names[len(weight_names):], extra))
    roots = program.graph.roots
    out_spec = exported.call_spec.out_spec or pytree.tree_flatten([None] * len(roots))[1]
    out_shapes = [list(a.shape) for a in exp.out_avals]
    func = StableHLOFunc(
        serialized=bytes(exp.serialize()), weight_names=names,
        input_avals=[(_shape_json(shape), _dtype_name(t.dtype))
                     for shape, t in zip(user_shapes, inputs[len(xla_weights):])],
        output_avals=[(_shape_json(shape), _dtype_name(n.avals[i][1]))
                      for shape, (n, i) in zip(out_shapes, roots[:program.n_out])],
        in_spec=pytree.treespec_dumps(in_spec), out_spec=pytree.treespec_dumps(out_spec))
    return StableHLOGraphModule(StableHLOModelBundle(state, {"forward": func}))


def _custom_call_targets(graph) -> List[str]:
    """The targets of the graph's custom calls (`stablehlo_custom_call`): jax exports only
    the targets it knows to be stable unless told."""
    return sorted({n.args[-5] for n in graph.order if getattr(n, "op", None) == "xla::custom_call"})


def _shape_json(shape) -> list:
    """A shape for meta.json: sizes as ints, symbolic sizes as their expression ("b", "2*b")."""
    return [d if isinstance(d, int) else str(d) for d in shape]


def _symbolic_program(program, dynamic: Dict[str, dict], leaves: list, trace):
    """The program's graph with sizes as jax symbols (traced at the sizes `plan_sizes`
    picks) and the user inputs' symbolic shapes."""
    from ._engine.executor import symbolic as sym
    jax = pjrt.jax_module()
    names = list(dynamic)
    constraints = []
    for n in names:
        lo, hi = dynamic[n]["range"]
        if lo > 1:
            constraints.append(f"{n} >= {lo}")
        if hi < 2 ** 62:
            constraints.append(f"{n} <= {hi}")
    dims = jax.export.symbolic_shape(", ".join(names), constraints=constraints)
    symbols = dict(zip(names, dims))
    sizes = sym.plan_sizes({n: d["range"] for n, d in dynamic.items()}, {n: d["example"] for n, d in dynamic.items()})
    tensor_pos = {k: j for j, k in enumerate(i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor))}
    graphs = [program.graph]
    for size in sizes[1:]:
        shapes = {k: list(a.shape) for k, a in enumerate(leaves) if isinstance(a, torch.Tensor)}
        for n, d in dynamic.items():
            for k, dim, a, c in d["at"]:
                shapes[k][dim] = a * size[n] + c
        variant = [torch.zeros(shapes[k], dtype=a.dtype) if isinstance(a, torch.Tensor) else a
                   for k, a in enumerate(leaves)]
        graphs.append(trace(variant)[0].graph)
    try:
        graph = sym.SymbolicGraph(graphs, sizes, symbols)
    except sym.DynamicShapeError as e:
        raise ValueError(f"exported_program_to_stablehlo: {e}") from None
    user_shapes = [list(a.shape) for a in leaves if isinstance(a, torch.Tensor)]
    for n, d in dynamic.items():
        for k, dim, a, c in d["at"]:
            user_shapes[tensor_pos[k]][dim] = a * symbols[n] + c
    return graph, user_shapes


def _program_function(program, n_weights: int, inline_all: bool, symbolic=None):
    """The captured program as a jax function of (weights, extra constants, flat user
    tensors), and the extra constants' values. Every slot that is not an input is inlined
    as a constant, except Python scalars when not `inline_all`: those become the extra
    arguments (a scalar that follows a dynamic size is computed from it instead). An
    input the program does not read is accepted and ignored. `symbolic`: the graph with
    symbolic sizes (`executor/symbolic.py`)."""
    graph = program.graph
    slots = program.input_slots
    used = {s for s in slots if s >= 0}
    extra_slots, extra_values, consts = [], [], {}
    for s, (p, v) in enumerate(zip(graph.params, program.captured)):
        if s in used:
            continue
        if symbolic is not None and s in symbolic.scalars:
            continue
        if type(p) is ir.ScalarParam and not inline_all:
            extra_slots.append(s)
            extra_values.append(torch.tensor(p.value, dtype=p.avals[0][1]))
        else:
            consts[s] = np.asarray(v)
    base = build_fn(graph, False, constants=consts) if symbolic is None else symbolic.fn(program.n_out, consts)
    order = slots[:n_weights] + extra_slots + slots[n_weights:]
    n = len(graph.params)

    def fn(*args):
        params = [None] * n   # the constants' slots are compiled in and stay empty
        for s, a in zip(order, args):
            if s >= 0:
                params[s] = a
        return tuple(base(*params)[:program.n_out])
    return fn, extra_values



def save_as_stablehlo(exported_model: torch.export.ExportedProgram, stablehlo_dir: os.PathLike,
                      options: Optional[StableHLOExportOptions] = None) -> None:
    """Exports `exported_model` to StableHLO and saves it in `stablehlo_dir`."""
    options = options or StableHLOExportOptions()
    exported_program_to_stablehlo(exported_model, options).save(stablehlo_dir, options)


def save_torch_model_as_stablehlo(torchmodel: torch.nn.Module, args: Sequence[Any], path: os.PathLike,
                                  options: Optional[StableHLOExportOptions] = None) -> None:
    """`torch.export.export(torchmodel, args)`, then `save_as_stablehlo`."""
    exported = torch.export.export(torchmodel, tuple(args))
    save_as_stablehlo(exported, path, options)
