"""PT_XLA_DEBUG_LEVEL: why each graph compiles and runs, and what changed when one compiles again.

Level 1 prints a compilation analysis at every compile (its cause, the graph's name, hash,
input and output counts, the Python frames that triggered it) and, for a graph compiled
again, what differs from the closest graph compiled before (which op, shape, dtype or
constant, and the source line that created it). Level 2 adds an execution analysis at every
run. At exit a summary counts compiles and executions and those a host read caused.

Causes: a public entry point that runs a barrier names itself with `cause(text)` (the
outermost one wins: the parallel loader's `mark_step` is the loader's); without one, a full
barrier is the user's `torch_xla.sync` and a single tensor's run is a host read. Nothing
here runs unless the level is set (`settings.on`), and never per traced op: the executor calls it
at compiles and executions only.
"""
from __future__ import annotations

import atexit
import contextlib
import difflib
import linecache
import os
import sys
from typing import Iterator, List, Optional

from .. import env_vars, ir, job, patches, telemetry
from . import recompilation


class _Settings:
    """`on`: any analysis is wanted (level >= 1, or the silent recompilation report of
    `collect`), so the executor calls this module; `level`: the analysis level (0: print
    nothing). Written by `activate` at the import of torch_xla (under Python's import
    lock) and by `collect`; read by any thread at barriers, compiles and executions."""
    __slots__ = ("on", "level")

    def __init__(self):
        self.on = False
        self.level = 0


settings = _Settings()

_causes: List[tuple] = []     # (text, graph name)
_history: List[tuple] = []    # (key, cause, descriptions, sources) of compiled graphs
_MAX_HISTORY = 64
_stats = {"compiles": 0, "executions": 0, "host_read_compiles": 0, "host_read_executions": 0,
          "first_host_read": None, "steps": 0, "warned": set()}
_ENGINE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP = (_ENGINE_DIR, os.path.dirname(contextlib.__file__) + os.sep + "contextlib.py")

SYNC = "user torch_xla.sync"
PARTIAL = "user sync of selected tensors"
HOST_READ = "user code trying to access tensor value before torch_xla.sync"


def level() -> int:
    lv = env_vars.get("PT_XLA_DEBUG_LEVEL")
    if lv < 0:
        lv = 100 if env_vars.get("PT_XLA_DEBUG") else 0
    return lv


def activate() -> None:
    """Turns the analysis on when PT_XLA_DEBUG_LEVEL / PT_XLA_DEBUG ask for it (at import),
    and the recording of each node's profiler scope and frames when XLA_IR_DEBUG /
    XLA_HLO_DEBUG do."""
    if env_vars.get("XLA_IR_DEBUG") or env_vars.get("XLA_HLO_DEBUG"):
        ir.recording.frames = True
        ir.record_sources()
    lv = level()
    if lv <= 0:
        return
    settings.level = lv
    settings.on = True
    # The recompilation analysis names the source line that created a changed op.
    ir.record_sources()
    patches.install("debug_exit_summary")


_collecting = {"changed_sources": False}


def collect(on: bool = True) -> None:
    """Explains recompilations without printing anything (`torch_xla.debug.recompilation
    .enable()`); with PT_XLA_DEBUG_LEVEL set this is already on and stays on."""
    if settings.level >= 1:
        return
    settings.on = on
    if on and not ir.recording.on:
        ir.record_sources()
        _collecting["changed_sources"] = True
    elif not on and _collecting["changed_sources"]:
        ir.record_sources(False)
        _collecting["changed_sources"] = False


def register_summary() -> None:
    """Patch `debug_exit_summary`."""
    atexit.register(_summary)


@contextlib.contextmanager
def cause(text: str, name: Optional[str] = None) -> Iterator[None]:
    """The cause (and graph name) reported for the barriers run inside the block."""
    if not settings.on or _causes:
        yield
        return
    _causes.append((text, name))
    try:
        yield
    finally:
        _causes.pop()


def _resolve(default: str) -> tuple:
    return _causes[-1] if _causes else (default, None)


def resolve(default: str) -> str:
    """The cause of the barrier running now (`default` when no entry point named one)."""
    return _resolve(default)[0]


def frames() -> List[str]:
    """The Python frames outside the engine, innermost first."""
    return _frames()


def _frames() -> List[str]:
    out = []
    f = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_SKIP):
            out.append(f"{f.f_code.co_name} ({fn}:{f.f_lineno})")
        f = f.f_back
    return out


def _user_frame():
    """The first frame outside torch_xla and torch (None if there is none)."""
    import torch
    skip = (os.path.dirname(_ENGINE_DIR), os.path.dirname(torch.__file__), _SKIP[1])
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(skip):
        f = f.f_back
    return f


def _site() -> str:
    """`file:line` of the user code that ran this barrier."""
    f = _user_frame()
    return "?" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def _user_line() -> str:
    """`file:line: source` of the user code that ran this barrier."""
    f = _user_frame()
    if f is None:
        return "?"
    src = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" + (f": {src}" if src else "")


def _emit(text: str) -> None:
    if job.local_ordinal() != 0:
        return
    path = env_vars.get("PT_XLA_DEBUG_FILE")
    if path:
        with open(path, "a") as fh:
            fh.write(text)
    else:
        sys.stderr.write(text)
        sys.stderr.flush()


def _block(prefix: str, body: List[str]) -> str:
    lines = ["", prefix + "=" * 80] + [prefix + b for b in body] + [prefix + "-" * 80, prefix + "=" * 80]
    return "\n".join(lines) + "\n"


def graph_hash(key: int) -> str:
    return f"{key & (2 ** 64 - 1):016x}"


def _graph_info(key: int, n_in: int, n_out: int, name: Optional[str]) -> List[str]:
    info = ["Graph Info: "]
    if name:
        info.append(f"  Graph Name: {name}")
    info += [f"  Graph Hash: {graph_hash(key)}", f"  Number of Graph Inputs: {n_in}",
             f"  Number of Graph Outputs: {n_out}"]
    return info


def _frame_lines() -> List[str]:
    limit = env_vars.get("PT_XLA_DEBUG_MAX_FRAME")
    frames = _frames()
    body = ["Python Frame Triggered Execution: "]
    for i, fr in enumerate(frames):
        if i >= limit:
            body.append("  ..........")
            break
        body.append("  " + fr)
    return body


def _cause_lines(text: str) -> List[str]:
    lines = text.split("\n")
    return ["  " + line for line in lines]


def compiled(graph, compiled_exe, default: str, eager: bool = False) -> None:
    """Reports one compile of `graph` (called by the executor, with `settings.on`)."""
    if eager:
        return
    text, name = _resolve(default)
    _stats["compiles"] += 1
    if text.startswith(HOST_READ):
        _stats["host_read_compiles"] += 1
        text = f"{text}\n  ({_user_line()})"
    descs, srcs = describe(graph)
    site = _site()
    explained = _explain(graph, text, descs, site)
    if settings.level >= 1:
        body = ["Compilation Cause"] + _cause_lines(text)
        body += _graph_info(graph.key, len(graph.params), len(graph.roots), name)
        body += _recompile_lines(descs, srcs)
        if explained is not None:
            body += recompilation.lines(explained)
        body += _frame_lines()
        out = _block("Compilation Analysis: ", body)
        out += _block("Post Compilation Analysis: ", _memory_lines(compiled_exe))
        _emit(out)
    _history.append((graph.key, text.split("\n")[0], descs, srcs, site))
    del _history[:-_MAX_HISTORY]


def _explain(graph, text: str, descs: list, site: str) -> Optional[dict]:
    """Classifies this compile against the closest graph compiled before at the same
    barrier line (or as a graph cut by a host read); None for a first graph."""
    cut = None
    if text.startswith(HOST_READ):
        kind, op = recompilation.cut_kind()
        cut = (kind, op, site)
    same = [h for h in _history if h[4] == site and h[0] != graph.key]
    if cut is None and not same:
        return None
    closest = None
    changes: list = []
    if same:
        closest = max(same, key=lambda h: difflib.SequenceMatcher(None, h[2], descs, autojunk=False).quick_ratio())
        changes = [(k, o, n) for k, o, n, _ in _diff(closest[2], descs, [None] * len(descs), closest[3])[0]]
    cause, detail = recompilation.classify(changes, cut)
    return recompilation.record(cause, detail, graph_hash(graph.key), closest and graph_hash(closest[0]), site)


def executed(graph, default: str, eager: bool = False, dynamo: bool = False) -> None:
    """Reports one execution of `graph` (level 2), and counts it."""
    if eager and not dynamo:
        return
    text, name = _resolve(default)
    _stats["executions"] += 1
    if text.startswith(HOST_READ):
        _stats["host_read_executions"] += 1
        line = _user_line()
        if _stats["first_host_read"] is None:
            _stats["first_host_read"] = line
        recompilation.host_read(line.split(": ", 1)[0])
        text = f"{text}\n  ({line})"
    if settings.level < 2:
        return
    body = ["Execution Cause"] + _cause_lines(text)
    body += _graph_info(graph.key, len(graph.params), len(graph.roots), name)
    body += _frame_lines()
    _emit(_block("Execution Analysis: ", body))


def _memory_lines(exe) -> List[str]:
    gb = 1024 ** 3
    try:
        m = exe.memory_analysis()
        sizes = (m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                 m.temp_size_in_bytes, m.generated_code_size_in_bytes)
    except Exception:  # noqa: BLE001  (a platform without memory analysis)
        sizes = None
    names = ("Graph input size", "Graph output size", "Aliased Input size", "Intermediate tensor size",
             "Compiled program size")
    if sizes is None:
        return [f"{n}: unknown GB" for n in names]
    return [f"{n}: {s / gb:.6f} GB" for n, s in zip(names, sizes)]


# ---- what changed since the closest graph compiled before ------------------------------------

def _aval_text(aval) -> str:
    if aval is None:
        return "?"
    shape, dt = aval
    return f"{str(dt).replace('torch.', '')}[{','.join(map(str, shape))}]"


def _statics(node) -> list:
    return [a for a in node.args if not isinstance(a, ir.Ref)
            and not (isinstance(a, (tuple, list)) and a and isinstance(a[0], ir.Ref))]


def describe(graph) -> tuple:
    """Per node of `graph`: (op, operand avals, output avals, static arguments or constant
    value) as texts, and the source line that created it (when recorded)."""
    descs, srcs = [], []
    sources = ir.SOURCES
    pos = {}
    for n in graph.order:
        pos[id(n)] = len(srcs)
        t = type(n)
        outs = ",".join(_aval_text(a) for a in n.avals)
        if t is ir.DeviceData:
            d = ("input", "", outs, "")
        elif t is ir.ScalarParam:
            d = ("scalar input", "", outs, "")
        elif t is ir.Constant:
            d = ("constant", "", outs, _short(n.value))
        else:
            st = _statics(n)
            d = (n.op, ", ".join(_aval_text(o.avals[i]) for o, i in n.operands), outs, _short(st) if st else "")
        descs.append(d)
        src = sources.get(n) if sources else None
        srcs.append(f"created at {src}" if src else None)
        if src:
            # An input has no line of its own: the first op that reads it stands for it.
            for o, _ in n.operands:
                k = pos[id(o)]
                if srcs[k] is None and not o.operands:
                    srcs[k] = f"used at {src}"
    return descs, srcs


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _text(d) -> str:
    op, ins, outs, st = d
    if op in ("input", "scalar input"):
        return f"{op} {outs}"
    if op == "constant":
        return f"constant {outs} = {st}"
    return f"{op}({ins}) -> {outs}" + (f" with {st}" if st else "")


def _recompile_lines(descs: list, srcs: list) -> List[str]:
    if not _history:
        return []
    best, best_ratio = None, -1.0
    for entry in _history:
        r = difflib.SequenceMatcher(None, entry[2], descs, autojunk=False).quick_ratio()
        if r > best_ratio:
            best, best_ratio = entry, r
    key, why, old, old_srcs = best[:4]
    ratio = difflib.SequenceMatcher(None, old, descs, autojunk=False).ratio()
    lines = [f"Compiled Again: the closest graph compiled before is {graph_hash(key)} ({why}); "
             f"{ratio:.0%} of their nodes are alike. What differs:"]
    diffs, follow = _diff(old, descs, srcs, old_srcs)
    changes = [_change_text(k, o, n, src) for k, o, n, src in diffs]
    limit = 8
    lines += ["  " + c for c in changes[:limit]]
    if len(changes) > limit:
        lines.append(f"  ... and {len(changes) - limit} more")
    if follow:
        lines.append(f"  and {follow} op(s) whose operands changed because of the above")
    return lines


def _diff(old: list, descs: list, srcs: list, old_srcs: list) -> tuple:
    """The differences of two graphs' node descriptions: [(kind, old, new, source)] with
    kind op / argument / constant / dtype / shape / added / removed, and the number of ops
    that differ only by their operands (consequences, not causes)."""
    sm = difflib.SequenceMatcher(None, old, descs, autojunk=False)
    changes, follow = [], 0
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        pairs = list(zip(range(i1, i2), range(j1, j2))) if tag == "replace" else []
        for a, b in pairs:
            o, n = old[a], descs[b]
            if o[0] == n[0] and o[1] != n[1] and o[3] == n[3]:
                follow += 1    # same op on operands that changed: a consequence, not a cause
                continue
            changes.append((_kind(o, n), o, n, srcs[b] or old_srcs[a]))
        for b in range(j1 + len(pairs), j2):
            changes.append(("added", None, descs[b], srcs[b]))
        for a in range(i1 + len(pairs), i2):
            changes.append(("removed", old[a], None, old_srcs[a]))
    return changes, follow


def _at(src) -> str:
    return f" ({src})" if src else ""


def _kind(o: tuple, n: tuple) -> str:
    if o[0] != n[0]:
        return "op"
    if o[3] != n[3]:
        return "constant" if n[0] == "constant" else "argument"
    o_dt = [x.split("[")[0] for x in (o[1] + "," + o[2]).split(",") if "[" in x]
    n_dt = [x.split("[")[0] for x in (n[1] + "," + n[2]).split(",") if "[" in x]
    return "dtype" if o_dt != n_dt else "shape"


def _change_text(kind: str, o: Optional[tuple], n: Optional[tuple], src) -> str:
    if kind == "added":
        return f"added: {_text(n)}{_at(src)}"
    if kind == "removed":
        return f"removed: {_text(o)}{_at(src)}"
    if kind == "op":
        return f"op changed{_at(src)}: {_text(o)}  =>  {_text(n)}"
    if kind in ("constant", "argument"):
        return f"{kind} changed{_at(src)}: {n[0]} {o[3]}  =>  {n[3]}"
    return f"{kind} changed{_at(src)}: {_text(o)}  =>  {_text(n)}"


# ---- per step metrics analysis and the exit summary -------------------------------------------

def step() -> None:
    """A full barrier: warns once when compiles or host transfers happen at most steps."""
    _stats["steps"] += 1
    recompilation.step()
    steps = _stats["steps"]
    if steps < 5 or settings.level < 1:
        return
    for name, threshold in (("CompileTime", 0.5), ("TransferFromDeviceTime", 0.9)):
        m = telemetry.metrics.get(name)
        if m is not None and m.total_samples / steps > threshold and name not in _stats["warned"]:
            _stats["warned"].add(name)
            _emit(f"pt-xla-profiler: {name} too frequent: {m.total_samples} counts during {steps} steps\n")
    ops = [c for c in sorted(telemetry.counters) if c.startswith("aten::") and c != "aten::_local_scalar_dense"]
    if ops and "ops" not in _stats["warned"]:
        _stats["warned"].add("ops")
        _emit(f"pt-xla-profiler: Op(s) not lowered: {', '.join(ops)},  (they ran on the CPU)\n")


def _summary() -> None:
    s = _stats
    lines = [f"pt-xla-profiler: summary: {s['compiles']} compilation(s), {s['executions']} execution(s) "
             f"in {s['steps']} step(s)"]
    if s["host_read_executions"]:
        lines.append(f"pt-xla-profiler: {s['host_read_executions']} execution(s) and {s['host_read_compiles']} "
                     f"compilation(s) were caused by reading a tensor's value (print, .item(), .cpu()) "
                     f"before torch_xla.sync; the first at {s['first_host_read']}")
    for name in ("CompileTime", "TransferFromDeviceTime"):
        m = telemetry.metrics.get(name)
        if m is not None and s["steps"] and m.total_samples > s["steps"]:
            lines.append(f"pt-xla-profiler: {name} too frequent: {m.total_samples} counts during {s['steps']} steps")
    if recompilation.counts():
        lines += ["pt-xla-profiler: " + line for line in recompilation.report().rstrip("\n").split("\n")]
    try:
        _emit("\n".join(lines) + "\n")
    except ValueError:
        # stderr closed before the exit handlers ran: nothing can show the summary. (An
        # unwritable PT_XLA_DEBUG_FILE raises OSError, which atexit reports.)
        pass
