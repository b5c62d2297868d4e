"""The barrier: pending IR becomes compiled programs, run asynchronously.

A barrier collects the live tensors with pending IR, walks their graph once, picks a
program strategy, and looks the graph up by key. A miss compiles it (`compile.py`); a
hit replays the executable on the new buffers. Only host reads wait for results.
"""
from __future__ import annotations

import threading
import time
from typing import List, Optional

from .. import env_vars, ir, telemetry, mode, rng, pjrt, partitioning
from ..tensor import XlaState, pending
from . import analysis, checks, closures, compile as compiling, dumps, hlo_text, manual, strategies
from .donation import donatable
from .graph import Graph

_lock = threading.RLock()
_now = time.perf_counter_ns


class _Execution:
    """`allowed` False (`_XLAC._set_allow_execution(False)`): any execution is an error (a
    compiled function that must not run programs of its own). Written by the thread that
    calls `_set_allow_execution`, read by every executing thread without a lock."""
    __slots__ = ("allowed",)

    def __init__(self):
        self.allowed = True


execution = _Execution()
# (state, fn): on_ready callbacks whose value was still pending when they were registered.
_waiting: list = []


def walk(roots) -> Graph:
    """The keyed graph of `roots` ((node, idx) values) and its strategy."""
    with pjrt.phase("torch_xla::build_graph"):
        graph = Graph(roots)
    strategy = strategies.for_graph(graph)
    return graph.keyed(strategy.name), strategy


def execute(states: List[XlaState], barrier: bool = False, metric: str = "ExecuteTime",
            why: str = analysis.PARTIAL) -> None:
    """Computes the pending values of `states` in one program and stores the results.

    `barrier`: `states` are all the live pending tensors (a full barrier). Only then can
    the executor know that no IR outside this graph still reads a buffer, so only then
    are the buffers of overwritten tensors donated. `metric`: the time metric of the run
    (`EagerOpExecuteTime` for an op run by eager mode). `why`: the cause the debugging
    analysis reports when no public entry point named one (`analysis.cause`).
    """
    states = [s for s in states if type(s.node) is not ir.DeviceData]
    if not states:
        return
    if not execution.allowed:
        raise RuntimeError("Unexpected execution happens inside the compiled function, exiting "
                           "(graph execution is disallowed: torch_xla._XLAC._set_allow_execution(False))")
    # Several states may share one value (aliases): compute each value once.
    roots = []
    root_of = {}
    for s in states:
        k = (id(s.node), s.idx)
        if k not in root_of:
            root_of[k] = len(roots)
            roots.append((s.node, s.idx))
    graph, strategy = walk(roots)
    if barrier and partitioning.manual_regions.used:
        # Per-device values of an unfinished manual region cannot be computed alone: they
        # stay pending (the region's exit will compute them).
        stuck = manual.per_device_roots(graph)
        if stuck:
            pending.restore([s for s in states if (id(s.node), s.idx) in stuck])
            return execute([s for s in states if (id(s.node), s.idx) not in stuck], barrier=True,
                           metric=metric, why=why)
    t0 = _now()
    args = graph.param_values(on_device=strategy is strategies.LOCAL)
    donate = donatable(graph) if barrier and strategy.donates else ()
    telemetry.add_sample("InputOutputAliasCount", len(donate))
    args = strategy.to_args(args, graph)
    telemetry.add_sample("UnwrapXlaData", _now() - t0)
    exe = compiling.lookup(graph.key, donate)
    eager = metric != "ExecuteTime"
    if exe is None:
        try:
            exe = compiling.compile_graph(graph, strategy, args, donate,
                                          "EagerOpCompileTime" if metric == "EagerOpExecuteTime" else "CompileTime")
        except Exception as e:
            dumps.failed(graph, strategy, e, "compilation")
            raise
        compiling.remember(graph.key, exe)
        if analysis.settings.on:
            analysis.compiled(graph, exe.compiled, why, eager)
    else:
        telemetry.inc("CachedCompile")
    if exe.upgrade is not None:
        exe.settle()
    if analysis.settings.on:
        analysis.executed(graph, why, eager)
    if dumps.settings.on and not eager:
        dumps.executed(graph, strategy, analysis.resolve(why), analysis.frames())
    if exe.paced:
        pol = compiling.platform_policy()
        token = pol.before_dispatch(exe.paced)
    t_run = _now()
    with pjrt.phase("torch_xla::execute"):
        try:
            outs = exe.compiled(*args)
        except Exception as e:
            dumps.failed(graph, strategy, e, "execution")
            raise
    # Eager mode names its own metric; a program's run is its strategy's. The sample ends
    # when the run does, not when the asynchronous dispatch returns (the outputs of one
    # program are ready together: the first stands for all).
    if outs:
        telemetry.add_sample_when_ready(strategy.execute_metric if metric == "ExecuteTime" else metric,
                                      t_run, outs[0])
    else:
        telemetry.add_sample(strategy.execute_metric if metric == "ExecuteTime" else metric, _now() - t_run)
    if exe.paced:
        pol.after_dispatch(exe.paced, token, outs)
    outs = strategy.from_outputs(checks.split(outs, exe.checks, graph), graph)
    del graph
    telemetry.inc("ExecuteCount")
    if strategy is strategies.SPMD:
        telemetry.inc("ExecuteReplicated")
    del args
    t0 = _now()
    telemetry.inc("CreateDataHandles", len(outs))
    by_array = {}
    for s in states:
        r = root_of[(id(s.node), s.idx)]
        # States that computed the same root share one DeviceData leaf (and one buffer).
        node = by_array.get(r)
        if node is None:
            node = by_array[r] = ir.DeviceData(outs[r], (s.shape, s.dtype))
            node.computed = True
        s.set_data(node)
    telemetry.add_sample("WrapXlaData", _now() - t0)
    if _waiting:
        _notify_ready()


def on_ready(state: XlaState, fn) -> None:
    """Calls `fn()` on a helper thread once `state`'s device buffer holds its value (a
    pending value waits for the execution that computes it)."""
    with _lock:
        if type(state.node) is ir.DeviceData:
            _when_ready(state.node.array, fn)
        else:
            _waiting.append((state, fn))


def _when_ready(array, fn) -> None:
    def wait_then_call():
        try:
            array.block_until_ready()
        finally:
            fn()
    threading.Thread(target=wait_then_call, name="xla-on-ready", daemon=True).start()


def _notify_ready() -> None:
    still = []
    for state, fn in _waiting:
        if type(state.node) is ir.DeviceData:
            _when_ready(state.node.array, fn)
        else:
            still.append((state, fn))
    _waiting[:] = still


def sync(wait: bool = False, states: Optional[List[XlaState]] = None) -> None:
    """The barrier: runs all pending IR (or that of `states`) and the step closures."""
    wait = wait or env_vars.get("XLA_SYNC_WAIT")
    t0 = _now()
    with _lock, pjrt.phase("torch_xla::sync"):
        telemetry.add_sample("DeviceLockWait", _now() - t0)
        if checks._pending:
            checks.poll(block=False)  # earlier programs' index checks, if they have finished
        if states is None:
            telemetry.inc("MarkStep")
        if mode.modes.spmd:
            partitioning.constrain_annotated()
        live = pending.take_live() if states is None else states
        if live:
            telemetry.add_sample("TensorsGraphSize", len(live))
            try:
                execute(live, barrier=states is None, why=analysis.SYNC if states is None else analysis.PARTIAL)
            except BaseException:
                if states is None:
                    pending.restore(live)
                raise
        if states is None:
            rng.advance_step()
            if analysis.settings.on:
                analysis.step()
            if dumps.settings.on:
                dumps.step()
        if wait:
            wait_all(live)
            checks.poll(block=True)
    if states is None:
        closures.run()


def materialize(state: XlaState):
    """The device buffer of `state`, running its pending graph if needed."""
    if type(state.node) is not ir.DeviceData:
        with _lock:
            if type(state.node) is not ir.DeviceData:
                execute([state], why=analysis.HOST_READ)
    return state.node.array


def inspect_checks(block: bool = True) -> None:
    """Raises the index error of a finished program, if any (`checks.py`); `block`: wait
    for every program not inspected yet."""
    if checks._pending:
        checks.poll(block)


def wait_all(states=None) -> None:
    if states is None:
        return
    for s in states:
        if type(s.node) is ir.DeviceData:
            array = s.node.array
            try:
                array.block_until_ready()
            except pjrt.jax_module().errors.JaxRuntimeError:
                # A buffer donated (another thread's step) since has nothing left to wait
                # for; a failed execution is this step's failure and is raised.
                if not array.is_deleted():
                    raise


def lowered(roots):
    """The jax `Lowered` program computing `roots` (no compilation, no execution)."""
    graph, strategy = walk(roots)
    return compiling.lowered(graph, strategy)


def hlo_module(roots):
    """The program computing `roots` as XLA's serialized `HloModuleProto` (no compilation,
    no execution), and the graph's parameter nodes in parameter order."""
    graph, strategy = walk(roots)
    comp = compiling.lowered(graph, strategy).compiler_ir("hlo")
    return comp.as_serialized_hlo_module_proto(), list(graph.params)


def lower_text(roots, dialect: str = "stablehlo") -> str:
    """The text of the program computing `roots` (no execution): StableHLO, or XLA's HLO
    (`dialect="hlo"`, with the sharding annotations before partitioning); with
    XLA_HLO_DEBUG, with locations (each op's Python source line)."""
    from .. import env_vars
    debug = bool(env_vars.get("XLA_HLO_DEBUG"))
    graph, strategy = walk(roots)
    # A region left unfinished (per-device results) can be printed, not run: as the
    # original prints it, with XLA's SPMD custom calls at its edges.
    low = compiling.lowered(graph, strategy, manual_text=bool(manual.per_device_roots(graph)))
    if dialect != "hlo":
        return low.as_text(dialect=dialect, debug_info=debug)
    # XLA's full text form: operand shapes inline (`convert(bf16[16,10]{1,0} %p0)`), as
    # HLO dumps print them, so one line tells an op's input and output types; without
    # XLA_HLO_DEBUG the instructions are named by opcode (`%exponential.3`), not by the
    # jax primitive that emitted them.
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jaxlib import xla_client
    if debug:
        comp = low.compiler_ir("hlo")
    else:
        text = mlir.module_to_string(low.compiler_ir("stablehlo"), enable_debug_info=False)
        comp = _jax.mlir.mlir_module_to_xla_computation(text, use_tuple_args=False)
    opts = xla_client.hlo.HloPrintOptions()
    opts.print_large_constants = True
    opts.print_operand_shape = True
    opts.print_metadata = debug
    return hlo_text.original_form(comp.as_hlo_module().to_string(opts))


def pending_graph_key():
    """The key of the graph a full barrier would run now (None when nothing is pending)."""
    live = pending.take_live()
    pending.restore(live)
    roots = []
    seen = set()
    for s in live:
        k = (id(s.node), s.idx)
        if k not in seen:
            seen.add(k)
            roots.append((s.node, s.idx))
    if not roots:
        return None
    graph, _ = walk(roots)
    return graph.key
