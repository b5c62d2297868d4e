"""Graph dumps for debugging: the IR as text or Graphviz, and the files the debugging
variables ask for (XLA_SAVE_TENSORS_FILE, XLA_SAVE_HLO_FILE, XLA_METRICS_FILE,
XLA_DUMP_HLO_GRAPH). Nothing here runs unless one of them is set (`settings.on`)."""
from __future__ import annotations

from typing import Dict, List

import torch

from .. import env_vars, ir, pjrt
from . import ir_debug


class _Settings:
    """`on`: XLA_SAVE_TENSORS_FILE or XLA_METRICS_FILE is set, so the executor calls the
    dumps here. Written once, by `activate` at the import of torch_xla (under Python's
    import lock); read by any thread at barriers and executions."""
    __slots__ = ("on",)

    def __init__(self):
        self.on = False


settings = _Settings()

_hlo_cache: Dict[int, str] = {}
_DT = {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16", "int64": "s64",
       "int32": "s32", "int16": "s16", "int8": "s8", "uint8": "u8", "uint16": "u16", "uint32": "u32",
       "uint64": "u64", "bool": "pred", "complex64": "c64", "complex128": "c128"}


def activate() -> None:
    settings.on = bool(env_vars.get("XLA_SAVE_TENSORS_FILE") or env_vars.get("XLA_METRICS_FILE"))
    if env_vars.get("XLA_IR_DEBUG"):
        ir.record_sources()
    fmt = env_vars.get("XLA_SAVE_TENSORS_FMT")
    if fmt not in ("text", "hlo", "dot"):
        raise ValueError(f"XLA_SAVE_TENSORS_FMT={fmt!r}: use text, hlo or dot")


def dtype_text(d) -> str:
    s = str(d).replace("torch.", "")
    return _DT.get(s, s)


def _aval(a, bounded: tuple = ()) -> str:
    # the type the device holds (bf16 under XLA_USE_BF16, s32 under XLA_USE_32BIT_LONG)
    try:
        dt = pjrt.device_dtype(a[1]).name
    except (TypeError, KeyError):
        dt = a[1]
    dims = [f"<={n}" if d in bounded else str(n) for d, n in enumerate(a[0])]
    return f"{dtype_text(dt)}[{','.join(dims)}]"


def _aval_layout(a, bounded: tuple = ()) -> str:
    """`_aval` with the default (row-major) layout, as XLA prints a shape: `f32[2,3]{1,0}`
    (a bounded dimension as `<=N`)."""
    rank = len(a[0])
    layout = "{" + ",".join(map(str, range(rank - 1, -1, -1))) + "}" if rank else ""
    return _aval(a, bounded) + layout


def _node_desc(n, names, consts=None) -> str:
    t = type(n)
    if t is ir.DeviceData:
        return "xla::device_data()"
    if t is ir.ScalarParam:
        return f"xla::device_data(), scalar={n.value}"
    if t is ir.Constant:
        return f"prim::Constant(), value={n.value}"
    ops = [names[id(o)] + (f".{i}" if len(o.avals) > 1 else "") for o, i in n.operands]
    mine = consts.get(id(n), {}) if consts else {}
    if mine:  # operands and constants in the argument order
        ordered = []
        for k, a in enumerate(n.args):
            if k in mine:
                ordered.append(mine[k][0])
            elif isinstance(a, ir.Ref):
                ordered.append(ops[a[1]])
            elif isinstance(a, tuple):
                ordered.extend(ops[r[1]] for r in a if isinstance(r, ir.Ref))
        ops = ordered if len(ordered) == len(ops) + len(mine) else ops + [mine[k][0] for k in sorted(mine)]
    statics = [a for k, a in enumerate(n.args) if k not in mine and not isinstance(a, ir.Ref)
               and not (isinstance(a, tuple) and a and isinstance(a[0], ir.Ref))]
    return f"{n.op}({', '.join(ops)})" + (f", args={statics}" if statics else "")


_scalar_slots: Dict[str, tuple] = {}
# schema types whose argument may be a Python number (a Tensor slot: a wrapped number)
_NUMBER_SLOTS = ("number", "Optional[number]", "Scalar", "Scalar?", "Tensor", "Tensor?")


def _scalar_positions(op: str) -> tuple:
    """Positions of an aten overload's Scalar (or wrapped number) arguments: a number
    there is compiled into the program (the special scalars 0 and 1, pow's exponent);
    other numbers are graph parameters, operands of their own."""
    got = _scalar_slots.get(op)
    if got is None:
        got = ()
        if op.startswith("aten::"):
            base, _, overload = op[len("aten::"):].partition(".")
            try:
                schema = getattr(getattr(torch.ops.aten, base), overload or "default")._schema
                got = tuple(k for k, a in enumerate(schema.arguments) if str(a.type) in _NUMBER_SLOTS)
            except (AttributeError, RuntimeError):
                pass
        _scalar_slots[op] = got
    return got


def _constants(order: List) -> Dict[int, Dict[int, tuple]]:
    """The compiled-in Scalar arguments of each node: {id(node): {arg position: (name,
    line)}}, listed first in the text as `prim::Constant` nodes."""
    out: Dict[int, Dict[int, tuple]] = {}
    count = 0
    for n in order:
        if isinstance(n, (ir.DeviceData, ir.ScalarParam, ir.Constant)):
            continue
        for k in _scalar_positions(n.op):
            v = n.args[k] if k < len(n.args) else None
            if type(v) not in (int, float, bool):
                continue
            dt = n.operands[0][0].avals[n.operands[0][1]][1] if n.operands else n.avals[0][1]
            name = f"%{count}"
            count += 1
            out.setdefault(id(n), {})[k] = (name, f"  {name} = {_aval(((), dt))} prim::Constant(), value={v}")
    return out


def ir_text(order: List, roots: List[tuple]) -> str:
    """The IR graph, one node per line (with XLA_IR_DEBUG or `_set_ir_debug`, each op's source line)."""
    consts = _constants(order)
    lines = ["IR {"] + [line for c in consts.values() for _, line in c.values()]
    names = {}
    first = len(lines) - 1
    sources = ir.SOURCES
    root_ids = {}
    for i, (n, _) in enumerate(roots):
        root_ids.setdefault(id(n), i)
    for n in order:
        names[id(n)] = f"%{len(names) + first}"
        marks = ir.BOUNDED.get(n, {})
        shapes = ", ".join(_aval_layout(a, marks.get(i, ())) for i, a in enumerate(n.avals) if a is not None)
        src = sources.get(n) if sources else None
        loc = f", location={src}" if src else ""
        scope = ir_debug.scope_of(n)
        scope = f", scope={scope}" if scope else ""
        root = f", ROOT={root_ids[id(n)]}" if id(n) in root_ids else ""
        lines.append(f"  {names[id(n)]} = {shapes} {_node_desc(n, names, consts)}{scope}{loc}{root}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def ir_dot(order: List, roots: List[tuple]) -> str:
    """The IR graph in Graphviz's dot format."""
    names = {id(n): f"n{i}" for i, n in enumerate(order)}
    sources = ir.SOURCES
    lines = ["digraph G {"]
    for n in order:
        label = f"{_node_desc(n, {id(o): names[id(o)] for o, _ in n.operands}).split('(')[0]}\\n" + \
            "\\n".join(_aval(a) for a in n.avals if a is not None)
        src = sources.get(n) if sources else None
        if src:
            label += f"\\n{src}"
        lines.append(f'  {names[id(n)]} [label="{label}"]')
    for n in order:
        for o, i in n.operands:
            lines.append(f"  {names[id(o)]} -> {names[id(n)]}" + (f' [label="{i}"]' if len(o.avals) > 1 else ""))
    for k, (n, i) in enumerate(roots):
        lines.append(f'  r{k} [label="ROOT {k}", shape=box]')
        lines.append(f"  {names[id(n)]} -> r{k}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def graph_text(graph, strategy, fmt: str) -> str:
    if fmt == "dot":
        return ir_dot(graph.order, graph.roots)
    if fmt == "hlo":
        if env_vars.get("XLA_DUMP_POST_OPTIMIZATIONS"):
            from .hlo_text import optimized_graph
            return optimized_graph(graph, strategy)
        text = _hlo_cache.get(graph.key)
        if text is None:
            from .compile import lowered
            text = _hlo_cache[graph.key] = lowered(graph, strategy).as_text(
                dialect="hlo", debug_info=bool(env_vars.get("XLA_HLO_DEBUG")))
        return text
    return ir_text(graph.order, graph.roots)


def saved_tensors_path() -> str:
    """The file of XLA_SAVE_TENSORS_FILE for this process: the name with this process's
    device ordinal appended (`graphs.txt.0`), so that the processes of a job each write
    their own; '' when unset."""
    path = env_vars.get("XLA_SAVE_TENSORS_FILE")
    return f"{path}.{pjrt.device_index()}" if path else ""


def executed(graph, strategy, cause: str, frames: List[str]) -> None:
    """XLA_SAVE_TENSORS_FILE: appends the graph that is about to run (compiled already),
    and, for an SPMD program in the `hlo` format, the sharding of each of its outputs."""
    path = saved_tensors_path()
    if not path:
        return
    from .analysis import graph_hash
    fmt = env_vars.get("XLA_SAVE_TENSORS_FMT")
    roots = ", ".join(graph_hash(n.hash) for n, _ in graph.roots)
    text = (f"[ScheduleSyncTensorsGraph] cause: {cause}\nTensorsGraphInfo:\n" + "".join(f"  {f}\n" for f in frames)
            + f"\nRoot Hashes: ({roots})\n\n## BEGIN_GRAPH\n" + graph_text(graph, strategy, fmt)
            + f"\nGraph Hash: {graph_hash(graph.key)}\n\n## END_GRAPH\n\n")
    if fmt == "hlo":
        text += _output_shardings(graph, strategy)
    with open(path, "a") as fh:
        fh.write(text)


def _output_shardings(graph, strategy) -> str:
    """The layout XLA chose for each output of an SPMD program (`f32[8,32] {devices=...}`)."""
    from . import compile as compiling, strategies
    if not isinstance(strategy, strategies.Spmd):
        return ""
    from .. import partitioning
    exe = compiling.lookup(graph.key, tuple(range(len(graph.params))))
    shardings = getattr(getattr(exe, "compiled", None), "output_shardings", None) or ()
    lines = []
    for k, (n, i) in enumerate(graph.roots):
        aval = n.avals[i]
        sh = shardings[k] if k < len(shardings) else None
        lines.append(f"{_aval(aval)} {partitioning.spec_text(sh, len(aval[0])) if sh is not None else '{unknown}'}\n")
    return "\n#OUTPUT_SHARDING_BEGIN\n\n" + "".join(lines) + "\n#OUTPUT_SHARDING_END\n\n"


def step() -> None:
    """XLA_METRICS_FILE: appends the metrics report at each step (full barrier)."""
    path = env_vars.get("XLA_METRICS_FILE")
    if not path:
        return
    from .. import telemetry
    from ..metrics_report import format_report
    telemetry.settle()   # the step's run included (a debugging file: waiting is acceptable)
    with open(path, "a") as fh:
        fh.write(format_report(sorted(telemetry.metrics), sorted(telemetry.counters)))


def failed(graph, strategy, exc: BaseException, stage: str) -> None:
    """A compile or execution failed: XLA_SAVE_HLO_FILE receives the program (its HLO, or
    the IR when it could not be lowered); XLA_DUMP_HLO_GRAPH adds it to the error."""
    path = env_vars.get("XLA_SAVE_HLO_FILE")
    dump = env_vars.get("XLA_DUMP_HLO_GRAPH")
    if not path and not dump:
        return
    try:
        text = graph_text(graph, strategy, "hlo")
    except Exception:  # noqa: BLE001  (the lowering itself failed: the IR is what there is)
        text = ir_text(graph.order, graph.roots)
    if path:
        with open(path, "w") as fh:
            fh.write(text)
        exc.add_note(f"XLA_SAVE_HLO_FILE: the program whose {stage} failed is in {path}")
    if dump:
        exc.add_note(f"the program whose {stage} failed:\n{text}")
