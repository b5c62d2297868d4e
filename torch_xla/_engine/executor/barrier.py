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
from . import donation
from .donation import donatable, honours
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


class PlaceholderRead(RuntimeError):
    """A program would read a placeholder tensor (device data without a buffer)."""
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
    donate = donatable(graph, barrier) if strategy.donates else ()
    # Leaves the program also outputs (donated, their aliases moved to the copies).
    copied = donation.copied(graph) if getattr(graph, "copied", None) else None
    args = strategy.to_args(args, graph)
    telemetry.add_sample("UnwrapXlaData", _now() - t0)
    exe = compiling.lookup(graph.key, donate)
    if exe is not None and not honours(exe.donated, graph, donate):
        exe = None
    eager = metric != "ExecuteTime"
    if exe is None:
        _refuse_placeholders(graph, states, barrier, metric, why)   # before a compile it would waste
        # Sampled per compiled program, as PyTorch/XLA does (a cached run adds nothing).
        telemetry.add_sample("InputOutputAliasCount", len(donate))
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
            _refuse_placeholders(graph, states, barrier, metric, why)
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
    if copied:
        donation.rebind(copied, outs[len(roots):len(roots) + len(copied)])
    telemetry.add_sample("WrapXlaData", _now() - t0)
    if _waiting:
        _notify_ready()


def _refuse_placeholders(graph: Graph, states: List[XlaState], barrier: bool, metric: str, why: str) -> None:
    """Raises PlaceholderRead when `graph` reads placeholder tensors, naming them. The
    states that read one are left out of later barriers (they can never be computed:
    reading them raises again); at a full barrier the others are computed first."""
    device_data = ir.DeviceData
    bad = {id(p): s for s, p in enumerate(graph.params)
           if type(p) is device_data and getattr(p.array, "placeholder", False) is True}
    if not bad:
        return
    names = ", ".join(f"{graph.params[s].array!r} (parameter {s})" for s in bad.values())
    error = PlaceholderRead(
        f"the program computing these tensors reads a placeholder tensor: {names}. A placeholder "
        "(`create_placeholder_tensor`) has no device buffer: the graphs that read it can be printed "
        "(`_get_xla_tensors_hlo`, `_get_xla_tensors_text`), not run")
    reads = _reaching(states, bad)
    if barrier:   # the barrier took them off the pending list: the others only go back
        rest = [s for s in states if id(s) not in reads]
        if rest:
            execute(rest, barrier=True, metric=metric, why=why)
    else:
        _forget(reads)
    raise error


def _forget(state_ids: set) -> None:
    """Takes the states `state_ids` off the pending list (the barrier's roots)."""
    refs = pending.refs
    with pending.lock:
        # Appends (other threads tracing, without the lock) only land after `n`.
        n = len(refs)
        for i in range(n - 1, -1, -1):
            s = refs[i]()
            if s is not None and id(s) in state_ids:
                del refs[i]


def _reaching(states: List[XlaState], leaves: dict) -> set:
    """ids of the states whose pending IR reads one of `leaves` (ids of nodes)."""
    memo = {}

    def reads(root) -> bool:
        stack = [(root, False)]
        while stack:
            n, expanded = stack.pop()
            if id(n) in memo:
                continue
            if expanded:
                memo[id(n)] = id(n) in leaves or any(memo[id(o)] for o, _ in n.operands)
                continue
            stack.append((n, True))
            stack.extend((o, False) for o, _ in n.operands if id(o) not in memo)
        return memo[id(root)]
    return {id(s) for s in states if reads(s.node)}


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
            except BaseException as e:
                # The states that read a placeholder are left out (they can never run).
                if states is None and not isinstance(e, PlaceholderRead):
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


def flush(why: str) -> None:
    """Runs all pending IR as one program, donating the buffers it overwrites, without
    ending the step (no step closures, no new random step, no `MarkStep`): the implicit
    barrier of a step the user did not close (`why` names it in the debugging analysis)."""
    with _lock:
        live = pending.take_live()
        if not live:
            return
        try:
            execute(live, barrier=True, why=why)
        except BaseException as e:
            if not isinstance(e, PlaceholderRead):
                pending.restore(live)
            raise


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


def printed_param_order(graph: Graph) -> List[int]:
    """The graph's parameter slots in the order PyTorch/XLA numbers the parameters of the
    programs it prints: the order a post-order walk meets them that, at each node, walks
    the last operand first (roots in turn)."""
    state = {}   # id(node) -> False while its operands are walked, True once emitted
    order = []
    slot = graph.slot
    for root, _ in graph.roots:
        stack = [root]
        while stack:
            n = stack[-1]
            done = state.get(id(n))
            if done is None:
                state[id(n)] = False
                stack.extend(o for o, _ in n.operands if id(o) not in state)
            else:
                stack.pop()
                if done is False:
                    state[id(n)] = True
                    if id(n) in slot:
                        order.append(slot[id(n)])
    return order


def _printed_lowering(graph: Graph, strategy, manual_text: bool):
    """`compiling.lowered` with the parameters in `printed_param_order` (the text only:
    executed programs keep the graph's slot order)."""
    from . import unbounded
    perm = printed_param_order(graph)
    if unbounded.marked(graph) or perm == list(range(len(graph.params))):
        return compiling.lowered(graph, strategy, manual_text=manual_text)
    from .lower import build_fn
    jax = pjrt.jax_module()
    args = strategy.to_args(graph.param_values(), graph)
    fn = strategy.wrap(build_fn(graph, False, manual_text=manual_text), graph)
    n = len(perm)

    def printed(*given):
        ordered = [None] * n
        for k, s in enumerate(perm):
            ordered[s] = given[k]
        return fn(*ordered)
    printed.__name__ = getattr(fn, "__name__", "fn")   # the module's name (`jit_fn`)
    return jax.jit(printed, keep_unused=True, **strategy.jit_options(graph, args)).lower(*[args[s] for s in perm])


def lower_text(roots, dialect: str = "stablehlo") -> str:
    """The text of the program computing `roots` (no execution): StableHLO, or XLA's HLO
    (`dialect="hlo"`, with the sharding annotations before partitioning); with
    XLA_HLO_DEBUG, with locations (each op's Python source line).

    The HLO is printed as PyTorch/XLA prints it: parameters numbered in its order
    (`printed_param_order`), the results in one tuple."""
    from .. import env_vars
    debug = bool(env_vars.get("XLA_HLO_DEBUG"))
    graph, strategy = walk(roots)
    # A region left unfinished (per-device results) can be printed, not run: as the
    # original prints it, with XLA's SPMD custom calls at its edges.
    manual_text = bool(manual.per_device_roots(graph))
    if dialect != "hlo":
        low = compiling.lowered(graph, strategy, manual_text=manual_text)
        from ..lowering import qdq
        # Quantize / dequantize print as StableHLO's uniform ops (lowering/qdq.py).
        return qdq.rewrite_text(low.as_text(dialect=dialect, debug_info=debug))
    low = _printed_lowering(graph, strategy, manual_text)
    # XLA's full text form: operand shapes inline (`convert(bf16[16,10]{1,0} %p0)`), as
    # HLO dumps print them, so one line tells an op's input and output types; without
    # XLA_HLO_DEBUG the instructions are named by opcode (`%exponential.3`), not by the
    # jax primitive that emitted them.
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jaxlib import xla_client
    module = low.compiler_ir("stablehlo")
    text = mlir.module_to_bytecode(module) if debug else mlir.module_to_string(module, enable_debug_info=False)
    comp = _jax.mlir.mlir_module_to_xla_computation(text, use_tuple_args=False, return_tuple=True)
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
