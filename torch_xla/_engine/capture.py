"""Capture: trace a callable on given XLA inputs into one program with an explicit
input order and output tree.

`capture(fn, *args)` runs `fn` once, lazily, on the inputs' device data and keeps the
graph of its outputs as a `Program`: `input_slots` maps each flat tensor argument to its
parameter slot, every other parameter (weights read from a module, Python scalars) is
captured by value, and `run(*new_args)` executes the compiled program on new inputs of
the same avals without tracing again. An input that `fn` overwrites in place is written
back by `run` as well (`mutated`). Random ops draw from a fresh seed at every run.
`apply` is `run` as one pending node (`xla::call_subgraph` on the program's graph), for a
caller that wants the program inside the next barrier's graph. This
is the seam a dynamo backend, export and `torch_xla.compile` share: what the program
reads, in which order, and what it returns.

`trace(fn, *args)` is the same call returning the traced call's own results too, and no
program when the call was not one closed graph (an execution or a CPU fallback happened
inside it, or it returned CPU tensors): such a function must be traced at every call.
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils import _pytree as pytree

from . import executor, ir, telemetry, mode, rng, pjrt
from .executor import analysis, checks, compile as compiling, strategies
from .executor.lower import build_fn
from .executor.graph import Graph
from .lowering import LOWERINGS, Lowering, ctx as lowering_ctx
from .tensor import is_functional, make_tensor, pending, replace_state, state_of, unwrap, wrap_user

_DEVICE_DATA = ir.DeviceData


class Program:
    """A captured program: `run(*args)` -> outputs in the traced tree."""
    # What the debugging analysis (PT_XLA_DEBUG_LEVEL) reports for its compile and runs.
    compile_cause = "a captured program (torch.compile, export) is compiled"
    execute_cause = "a captured program (torch.compile, export) runs"
    name = None

    def __init__(self, graph, strategy, input_slots: List[int], mutated: List[int], out_tree,
                 out_kinds: list, seed_slot: int):
        self.graph = graph
        self.strategy = strategy
        self.input_slots = input_slots   # parameter slot of each flat tensor input (-1: unused)
        self.mutated = mutated           # flat input positions written in place, in output order
        self.out_tree = out_tree
        self.out_kinds = out_kinds       # per output leaf: root index (int) or ("const", value)
        self.n_out = sum(1 for k in out_kinds if type(k) is int)
        self.seed_slot = seed_slot       # slot of the random ops' seed, or -1
        self.captured = graph.param_values()   # values of every slot at capture time
        self.avals = [graph.params[s].avals[0] if s >= 0 else None for s in input_slots]
        # Computed once for every run: (flat input position, slot) of the inputs the program
        # reads, and the output leaves when they are the program's results in order.
        self.reads = [(pos, slot) for pos, slot in enumerate(input_slots) if slot >= 0]
        self.plain_out = out_kinds == list(range(len(out_kinds))) and len(out_kinds) == len(graph.roots) - len(mutated)
        self.out_flat_type = _flat_container(out_tree)   # tuple/list of leaves: no unflatten
        self._exe = None
        self._call = None    # what `apply` builds its nodes from, made at its first call
        self.last_applied = None   # weak reference to the node of the latest `apply`

    def executable(self, states=None):
        """The compiled program (compiled at the first call, counted as a compile). The
        input slots whose buffers are marked as donors (`ir.DONORS`) in `states` then are
        donated by every run."""
        if self._exe is None:
            donate = ()
            if states is not None and self.strategy.donates:
                donate = tuple(sorted({slot for s, slot in zip(states, self.input_slots)
                                       if slot >= 0 and type(s.node) is _DEVICE_DATA and s.node in ir.DONORS}))
            args = self.strategy.to_args(self.captured, self.graph)
            self._exe = compiling.compile_graph(self.graph, self.strategy, args, donate)
            if analysis.settings.on:
                with analysis.cause(self.compile_cause, self.name):
                    analysis.compiled(self.graph, self._exe.compiled, self.compile_cause)
        return self._exe

    def lowered(self):
        """The jax `Lowered` program (StableHLO) with parameters in slot order."""
        return compiling.lowered(self.graph, self.strategy)

    def check(self, flat: Sequence[torch.Tensor]) -> List:
        """The input states of `flat`; raises ValueError when an aval differs from the trace."""
        states = [state_of(t) for t in flat]
        for s, aval in zip(states, self.avals):
            if aval is not None and (s.shape, s.dtype) != aval:
                raise ValueError(f"captured program: input of aval {(s.shape, s.dtype)} where {aval} was traced")
        return states

    def run_flat(self, flat: Sequence[torch.Tensor], states=None) -> list:
        """Runs the program on flat tensor inputs; returns the flat output leaves."""
        if states is None:
            states = self.check(flat)
        waiting = [s for s in states if type(s.node) is not _DEVICE_DATA]
        if waiting and self.strategy is strategies.LOCAL:
            waiting = [s for s in waiting if not _fill(s)]
        if waiting:
            executor.sync(states=waiting)    # pending inputs: one program first
        params = list(self.captured)
        for pos, slot in self.reads:
            params[slot] = states[pos].node.array
        if self.seed_slot >= 0:
            params[self.seed_slot] = np.asarray(rng.fresh_seed(), dtype=pjrt.device_dtype(torch.int64))
        exe = self.executable(states)
        graph, strategy = self.graph, self.strategy
        args = strategy.to_args(params, graph)
        if exe.upgrade is not None:
            exe.settle()
        if analysis.settings.on:
            with analysis.cause(self.execute_cause, self.name):
                analysis.executed(graph, self.execute_cause, dynamo=True)
        if exe.paced:
            pol = compiling.platform_policy()
            token = pol.before_dispatch(exe.paced)
        with pjrt.phase("torch_xla::execute"), telemetry.timed("ExecuteTime"):
            try:
                outs = exe.compiled(*args)
            except ValueError:
                # jax checks every argument's layout against the compiled one at no cost
                # to us: a layout change is found here, not by comparing at every run.
                if strategy is strategies.SPMD and _layouts_differ(exe.compiled, args):
                    raise LayoutChanged("an input's sharding differs from the one the program was "
                                        "compiled for") from None
                raise
        if exe.paced:
            pol.after_dispatch(exe.paced, token, outs)
        outs = strategy.from_outputs(checks.split(outs, exe.checks, graph), graph)
        telemetry.inc("ExecuteCount")
        results = []
        for (n, i), arr in zip(graph.roots, outs):
            aval = n.avals[i]
            results.append(make_tensor(_DEVICE_DATA(arr, aval), 0, aval[0], aval[1]))
        for pos, r in zip(self.mutated, results[self.n_out:]):
            write_back(flat[pos], r)
        if self.plain_out:
            return [wrap_user(r) for r in results[:self.n_out]]
        return [wrap_user(results[k]) if type(k) is int else k[1] for k in self.out_kinds]

    def outputs(self, leaves: list) -> Any:
        """The flat output leaves in the traced output tree."""
        t = self.out_flat_type
        if t is list:
            return leaves
        if t is tuple:
            return tuple(leaves)
        return pytree.tree_unflatten(leaves, self.out_tree)

    def run(self, *args: Any):
        flat = input_tensors(args)
        return self.outputs(self.run_flat(flat))

    def appliable(self) -> bool:
        """Whether `apply` may stand for `run_flat`: a one-device program without
        collectives (their lowering needs the strategy of the graph around the node)."""
        return self.strategy is strategies.LOCAL and not self.graph.has_collective

    def apply(self, flat: Sequence[torch.Tensor], states: Sequence) -> list:
        """`run_flat` as one pending IR node (`xla::call_subgraph` on the program's
        graph): nothing runs, the outputs and in-place writes of the inputs are pending
        values, and the program is lowered inside whatever graph the next barrier
        compiles. `states` are `flat`'s states, pending or not."""
        call = self._call
        if call is None:
            call = self._call = _Call(self)
        operands = list(call.leaves)
        for pos, slot in self.reads:
            s = states[pos]
            if s.shape != self.avals[pos][0] or s.dtype != self.avals[pos][1]:
                raise ValueError(f"captured program: input of aval {(s.shape, s.dtype)} where "
                                 f"{self.avals[pos]} was traced")
            operands[slot] = (s.node, s.idx)
        if self.seed_slot >= 0:
            operands[self.seed_slot] = (ir.ScalarParam(rng.fresh_seed(), torch.int64), 0)
        node = ir.Node("xla::call_subgraph", tuple(operands), call.args, call.avals, call.lowering,
                       None, call.base)
        self.last_applied = weakref.ref(node)
        results = [make_tensor(node, i, aval[0], aval[1]) for i, aval in enumerate(call.avals)]
        for pos, r in zip(self.mutated, results[self.n_out:]):
            write_back(flat[pos], r)
        if self.plain_out:
            return [wrap_user(r) for r in results[:self.n_out]]
        return [wrap_user(results[k]) if type(k) is int else k[1] for k in self.out_kinds]


class _Body:
    """A program's graph as the body of an `xla::call_subgraph` node: a jax function of
    its parameters in slot order, every one of them an operand of the node."""
    __slots__ = ("key", "n_in", "outer", "seeded", "_roots", "_graphs", "_fns")

    def __init__(self, graph):
        self.key = graph.key
        self.n_in = len(graph.params)
        self.outer = ()
        self.seeded = False    # the seed is a parameter like any other
        self._roots = graph.roots
        # One walk per form: `build_fn` keeps the host side of a form's checks on its graph.
        self._graphs = {}
        self._fns = {}

    @property
    def _graph(self):
        """The body's graph (what platform policies read: `Graph.op_avals`)."""
        g = self._graphs.get(None)
        if g is None:
            g = self._graphs[None] = Graph(self._roots)
        return g

    def __call__(self, inputs: Sequence, outer: Sequence, seed=None) -> list:
        recording = lowering_ctx.checks
        forms = (lowering_ctx.patch_convolutions, lowering_ctx.widen_int4_dots, recording is not None)
        fn = self._fns.get(forms)
        if fn is None:
            graph = self._graphs[forms] = Graph(self._roots)
            fn = self._fns[forms] = build_fn(graph, forms[0], checks=forms[2], widen_int4_dots=forms[1])
        # Lowered inside the enclosing graph's lowering: its state is kept.
        saved = (recording, lowering_ctx.node, lowering_ctx.out, lowering_ctx.manual_text)
        try:
            outs = list(fn(*inputs))
        finally:
            (lowering_ctx.checks, lowering_ctx.node, lowering_ctx.out, lowering_ctx.manual_text) = saved
        infos = self._graphs[forms].checks
        if infos:
            # The body's error vector (code = 1 + its first failing check) becomes one
            # check of the enclosing program per check of the body.
            err = outs.pop()
            for k, info in enumerate(infos):
                node = info.node() if info.node is not None else None
                recording.append((err[0] == k + 1, err[1], err[2], (info[0], info[1], node)))
        return outs


class _CallSpec:
    """The static argument of a program's node: equal and hashed by the program graph's
    key (its structure), so the same program applied at every step keys the same graph;
    its repr holds no address."""
    __slots__ = ("bodies", "_hash")

    def __init__(self, body: _Body):
        self.bodies = (body,)
        self._hash = hash(("program", body.key))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return type(other) is _CallSpec and other.bodies[0].key == self.bodies[0].key

    def __repr__(self):
        return f"Program<{self.bodies[0].key & 0xFFFFFFFFFFFF:x}>"


class _Call:
    """What every `Program.apply` node shares: the static arguments, the output avals,
    the hash base, and the captured leaves that fill the slots no input takes."""
    __slots__ = ("args", "avals", "lowering", "base", "leaves")

    def __init__(self, program: Program):
        graph = program.graph
        spec = _CallSpec(_Body(graph))
        # The input slots are filled at each application: only the captured values stay.
        inputs = {slot for _, slot in program.reads} | {program.seed_slot}
        self.leaves = [(None if s in inputs else p, 0) for s, p in enumerate(graph.params)]
        ir.KEPT.update(p for s, p in enumerate(graph.params) if s not in inputs and type(p) is ir.DeviceData)
        self.args = tuple(ir.ref(i) for i in range(len(graph.params))) + (spec,)
        self.avals = tuple(n.avals[i] for n, i in graph.roots)
        low = LOWERINGS["xla::call_subgraph"]
        if any(n.lowering is not None and n.lowering.checked for n in graph.order):
            # The node records the user's line like the ops whose device-side checks it carries.
            low = Lowering(low.name, low.fn, low.promote, low.static, low.meta, low.random, low.alias, True)
        self.lowering = low
        self.base = hash(("xla::call_subgraph", self.avals, None, repr(self.args)))


class LayoutChanged(ValueError):
    """An SPMD program run on inputs laid out otherwise than those it was compiled for
    (raised before anything runs: trace and compile again for the new layouts)."""


def _layouts_differ(compiled, args) -> bool:
    want = getattr(compiled, "input_shardings", None)
    if want is None:
        return False
    want = want[0] if isinstance(want, tuple) and len(want) == 2 and isinstance(want[1], dict) else want
    for a, w in zip(args, want):
        sh = getattr(a, "sharding", None)
        if sh is not None and hasattr(a, "ndim") and not sh.is_equivalent_to(w, a.ndim):
            return True
    return False


def layouts(states) -> tuple:
    """The layouts of input states holding device data (None for any other)."""
    return tuple(getattr(s.node.array, "sharding", None) if type(s.node) is _DEVICE_DATA else None
                 for s in states)


def _flat_container(spec):
    """tuple or list when `spec` is one of leaves only, else None."""
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    if spec.type in (tuple, list) and all(c.is_leaf() for c in children):
        return spec.type
    return None


# Small constant arrays (shape, dtype, value) -> jax.Array, for pending inputs that are
# constant fills: the seed of a backward (`ones_like(loss)`) is one at every step.
_FILLS: dict = {}
_FILL_MAX_ELEMENTS = 4096


def _fill(s) -> bool:
    """Gives pending state `s` its device buffer from `_FILLS` when it is a broadcast of
    a scalar constant (no program run); False when it is anything else."""
    n = s.node
    if n.op != "xla::broadcast" or s.idx:
        return False
    c = n.operands[0][0]
    if type(c) is not ir.Constant or isinstance(c.value, np.ndarray) or math.prod(s.shape) > _FILL_MAX_ELEMENTS:
        return False
    key = (s.shape, s.dtype, type(c.value), c.value)
    arr = _FILLS.get(key)
    if arr is None or arr.is_deleted():   # a donated fill is made again
        if len(_FILLS) >= 64:
            _FILLS.clear()
        arr = _FILLS[key] = pjrt.put(np.full(s.shape, c.value, dtype=pjrt.device_dtype(s.dtype)),
                                        pjrt.default_device())
    s.set_data(_DEVICE_DATA(arr, (s.shape, s.dtype)))
    return True


def input_tensors(args: Sequence[Any]) -> List[torch.Tensor]:
    """The tensor leaves of `args`, in order."""
    if all(isinstance(a, (torch.Tensor, int, float, bool, type(None))) for a in args):
        return [a for a in args if isinstance(a, torch.Tensor)]   # flat (a Dynamo graph's inputs)
    return [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]


def write_back(t: torch.Tensor, inner: torch.Tensor) -> None:
    """Gives input `t` the value of inner tensor `inner`, as an in-place op would (through
    functionalization, so the views of `t`'s base see it)."""
    if is_functional(t):
        torch._functionalize_replace(t, inner)
        torch._functionalize_commit_update(t)
    else:
        replace_state(t, inner._xla)


def _marks() -> tuple:
    """What moves when a traced call is not one closed graph: executions and CPU fallbacks."""
    c = telemetry.counters
    return c.get("ExecuteCount", 0), sum(v for k, v in c.items() if k.startswith("aten::"))


# Per thread: how many `trace` calls are running (sharding annotations made meanwhile on
# an input are constraints inside the program, not a new layout of the caller's data).
_tracing = threading.local()


def tracing() -> bool:
    """Whether this thread is inside `trace` (a Dynamo graph or export being captured)."""
    return getattr(_tracing, "depth", 0) > 0


def _constrains(s, node) -> bool:
    """Whether state `s` is `node`'s value under sharding constraints only: an input the
    traced call annotated, which the program lays out inside (no write-back)."""
    n, i = s.node, s.idx
    while type(n) is not _DEVICE_DATA and n.op == "xla::sharding_constraint" and i == 0:
        n, i = n.operands[0]
    return n is node and i == 0


def trace(fn: Callable, *args: Any, run: bool = True) -> Tuple[Optional[Program], Any]:
    """Runs `fn(*args)` once, lazily, and returns (its Program or None, its results).

    `args` hold XLA tensors (and other values, which the program keeps as traced). The
    results and in-place writes of the call are computed before returning; with
    `run=False` and a program, nothing is computed and the results are None (the caller
    runs the program instead: one compilation, not two)."""
    executor.sync()
    flat = input_tensors(args)
    # The call runs on fresh tensors holding the inputs' values: a view among the inputs
    # would otherwise be read through its base, which the program does not take.
    before, proxies = [], {}
    for t in flat:
        if t.device.type != "xla":
            raise TypeError(f"capture: inputs must be xla tensors, got one on {t.device}")
        s = state_of(t)
        executor.materialize(s)
        before.append(s.node)
        if id(t) not in proxies:
            proxies[id(t)] = wrap_user(make_tensor(s.node, 0, s.shape, s.dtype))
    proxy_args = pytree.tree_map_only(torch.Tensor, lambda t: proxies[id(t)], args)
    marks = _marks()
    _tracing.depth = getattr(_tracing, "depth", 0) + 1
    try:
        with mode.lazy_scope():
            out = fn(*proxy_args)
    finally:
        _tracing.depth -= 1
    closed = _marks() == marks
    leaves, out_tree = pytree.tree_flatten(out)
    roots, kinds = [], []
    for v in leaves:
        if isinstance(v, torch.Tensor):
            if v.device.type != "xla":
                closed = False
                continue
            s = state_of(v)
            kinds.append(len(roots))
            roots.append((s.node, s.idx))
        else:
            kinds.append(("const", v))
    mutated, written = [], []
    for pos, t in enumerate(flat):
        inner = unwrap(proxies[id(t)])
        s = inner._xla
        if s.node is not before[pos] and id(t) not in written and not _constrains(s, before[pos]):
            written.append(id(t))
            mutated.append(pos)
            roots.append((s.node, s.idx))
    program = None
    if closed and roots:
        graph, strategy = executor.walk(roots)
        slots = [graph.slot.get(id(node), -1) for node in before]
        seed = rng.current_seed_node()
        seed_slot = graph.slot.get(id(seed), -1) if seed is not None else -1
        program = Program(graph, strategy, slots, mutated, out_tree, kinds, seed_slot)
    if program is not None and not run:
        return program, None
    # The traced call itself ran nothing: give the caller its results and write-backs, in
    # a partial sync (which never donates: the program keeps reading its captured values).
    executor.sync(states=pending.take_live())
    for pos in mutated:
        write_back(flat[pos], unwrap(proxies[id(flat[pos])]))
    return program, out


def capture(fn: Callable, *args: Any) -> Program:
    """Traces `fn(*args)` once (lazily) into a Program; `args` hold XLA tensors."""
    program, out = trace(fn, *args)
    if program is None:
        raise RuntimeError("capture: the function is not one graph (a host read, a CPU fallback or an "
                           "execution happened inside it, or it returned no xla tensor)")
    return program
