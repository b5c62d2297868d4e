"""The graph executor: turns pending IR into compiled XLA programs and runs them.

A barrier collects the live tensors with pending IR, walks their graph once
(post order), binds device data and scalars to parameter slots, and looks the
graph up by key (root hashes + parameter signature + operand binding). A miss
lowers the graph to jax (`jax.jit(...).lower(...).compile()`); a hit replays the
executable on the new buffers. Execution is asynchronous: only host reads wait.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from . import exec_cache, host_memory, ir, metrics, process_group, runtime
from .lowering import LOWERINGS, ctx as lowering_ctx
from .tensor import XlaState, pending

COLLECTIVE_OPS = frozenset({"xla::all_reduce", "xla::all_gather", "xla::reduce_scatter",
                            "xla::all_to_all", "xla::collective_permute"})
_lock = threading.RLock()
_cache: Dict[int, List["Executable"]] = {}
_step_closures: List = []
_listeners = {"after_sync": []}


class Executable:
    __slots__ = ("compiled", "donated", "temp")

    def __init__(self, compiled, donated):
        self.compiled = compiled
        self.donated = donated
        # Its temporary buffer's bytes when dispatches of large programs are paced
        # (host_memory), else 0.
        self.temp = host_memory.temp_bytes(compiled) if host_memory.active() else 0


class GraphCompileError(RuntimeError):
    pass


def _subst(a, vals):
    t = type(a)
    if t is ir.Ref:
        return vals[a[1]]
    if t is tuple or t is list:
        return t(_subst(x, vals) for x in a)
    return a


def _cast_arrays(a, dtype, jnp):
    t = type(a)
    if t is tuple or t is list:
        return t(_cast_arrays(x, dtype, jnp) for x in a)
    if hasattr(a, "dtype") and hasattr(a, "shape"):
        return a if a.dtype == dtype else a.astype(dtype)
    return a


def _flat_outputs(out):
    if isinstance(out, (tuple, list)):
        return tuple(out)
    return (out,)


def lower_node(node: ir.Node, operand_vals: list):
    """Applies a node's lowering to jax values; returns its outputs as a tuple."""
    import jax.numpy as jnp
    low = node.lowering
    args = _subst(node.args, operand_vals)
    if low.random:
        from .lowering import rng_key
        args = args[:-2] + (rng_key(args[-2], args[-1]),)
    if low.promote and node.info is not None:
        cdt = runtime.device_dtype(node.info)
        args = _cast_arrays(args, cdt, jnp)
    lowering_ctx.out = tuple(None if a is None else (a[0], runtime.device_dtype(a[1])) for a in node.avals)
    lowering_ctx.node = node
    out = _flat_outputs(low.fn(*args))
    res = []
    for o, aval in zip(out, node.avals):
        if o is None or aval is None:
            res.append(None)
            continue
        shape, dtype = aval
        want = runtime.device_dtype(dtype)
        o = jnp.asarray(o)
        if o.dtype != want:
            o = o.astype(want)
        if tuple(o.shape) != tuple(shape):
            if o.size == 1 or o.ndim <= len(shape):
                o = jnp.broadcast_to(o.reshape(o.shape) if o.ndim else o, shape)
            else:
                raise GraphCompileError(
                    f"lowering of {node.op} produced shape {tuple(o.shape)}, expected {tuple(shape)}")
        res.append(o)
    return tuple(res)


class Graph:
    """A walked graph: program structure plus the parameters bound for this run."""

    def __init__(self, roots: Sequence[tuple]):
        # roots: list of (node, idx) output values
        self.roots = list(roots)
        # One walk (operands before users) collects everything the barrier needs: the
        # order, parameter slots, how operands bind to positions, and how many operand
        # slots read each DeviceData (for donation).
        order = []
        index = {}       # id(node) -> position in order
        params = []      # leaf nodes bound to parameters, in slot order
        slot = {}        # id(leaf) -> slot
        binding = []
        uses = {}        # id(DeviceData) -> operand slots of this graph reading it
        collective = False
        seen = set()
        device_data, scalar_param = ir.DeviceData, ir.ScalarParam
        stack = [(n, False) for n, _ in reversed(self.roots)]
        while stack:
            node, expanded = stack.pop()
            nid = id(node)
            if expanded:
                index[nid] = len(order)
                order.append(node)
                t = type(node)
                if t is device_data or t is scalar_param:
                    slot[nid] = len(params)
                    params.append(node)
                    continue
                ops = node.operands
                if ops:
                    pos = []
                    for o, _ in ops:
                        oid = id(o)
                        pos.append(index[oid])
                        if type(o) is device_data:
                            uses[oid] = uses.get(oid, 0) + 1
                    binding.append(tuple(pos))
                if node.op in COLLECTIVE_OPS:
                    collective = True
                continue
            if nid in seen:
                continue
            seen.add(nid)
            stack.append((node, True))
            for o, _ in reversed(node.operands):
                if id(o) not in seen:
                    stack.append((o, False))
        self.order = order
        # A graph with a collective runs on every replica as one SPMD program.
        self.replicated = collective and process_group.is_multiprocess()
        self.params = params
        self.slot = slot
        self.index = index
        self.data_uses = uses
        # The key: structure hashes of the roots, plus how operands bind to positions
        # (two graphs with equal node hashes may share a leaf differently: x+x vs x+y).
        self.key = hash((tuple((n.hash, i) for n, i in self.roots), tuple(binding), len(order),
                         self.replicated))

    def param_values(self):
        out = []
        for p in self.params:
            if type(p) is ir.DeviceData:
                out.append(p.array)
            else:
                out.append(np.asarray(p.value, dtype=runtime.device_dtype(p.avals[0][1])))
        return out

    def build_fn(self):
        """A pure function params -> root values, evaluating the nodes with their lowerings."""
        import jax.numpy as jnp
        order = self.order
        slot = self.slot
        index = self.index
        root_pos = [(index[id(n)], i) for n, i in self.roots]
        plan = []
        for n in order:
            t = type(n)
            if t is ir.DeviceData or t is ir.ScalarParam:
                plan.append(("p", slot[id(n)], None))
            elif t is ir.Constant:
                shape, dt = n.avals[0]
                plan.append(("c", np.asarray(n.value, dtype=runtime.device_dtype(dt)), None))
            else:
                plan.append(("n", n, tuple((index[id(o)], i) for o, i in n.operands)))

        def fn(*params):
            vals = [None] * len(plan)
            for pos, (kind, a, ops) in enumerate(plan):
                if kind == "p":
                    vals[pos] = (params[a],)
                elif kind == "c":
                    vals[pos] = (jnp.asarray(a),)
                else:
                    try:
                        vals[pos] = lower_node(a, [vals[p][i] for p, i in ops])
                    except GraphCompileError:
                        raise
                    except Exception as e:
                        raise GraphCompileError(f"lowering {a.op} failed: {type(e).__name__}: {e}") from e
            return tuple(vals[p][i] for p, i in root_pos)
        return fn


def _donatable(graph: Graph, roots_states) -> tuple:
    """Parameter slots whose buffers no live tensor will read after this run."""
    if os.environ.get("XLA_NO_DONATION", "0") not in ("", "0"):
        return ()
    donate = []
    # References we know of: the graph's params list, the post-order list, the operand
    # tuples of users inside this graph, and getrefcount's own argument.
    uses = graph.data_uses
    root_ids = {id(n) for n, _ in graph.roots}
    params = graph.params
    for s in range(len(params)):
        p = params[s]
        if type(p) is not ir.DeviceData or id(p) in root_ids:
            continue
        # Known holders: graph.params, graph.order, the loop variable, getrefcount's
        # argument, and the operand tuples of this graph's users. Any other holder (a
        # tensor state, a node outside this graph) keeps the buffer alive.
        if sys.getrefcount(p) <= 4 + uses.get(id(p), 0):
            donate.append(s)
    if not donate:
        return ()
    # XLA reuses a donated buffer only for an output of the same shape and dtype.
    free = {}
    for n, i in graph.roots:
        a = n.avals[i]
        free[a] = free.get(a, 0) + 1
    usable = []
    for s in donate:
        a = params[s].avals[0]
        if free.get(a, 0) > 0:
            free[a] -= 1
            usable.append(s)
    return tuple(usable)


def _compile(graph: Graph, args, donate):
    jax = runtime.jax_module()
    pkey = None
    if exec_cache.enabled() and not graph.replicated:
        pkey = exec_cache.key(graph, tuple(donate))
        if pkey is not None:
            exe = exec_cache.load(pkey)
            if exe is not None:
                return Executable(exe, donate)
    fn = graph.build_fn()
    if graph.replicated:
        fn = _replicated(fn, graph)
        donate = ()
    host_memory.settle(release=True)
    t0 = time.perf_counter()
    with metrics.timed("CompileTime"):
        lowered = jax.jit(fn, donate_argnums=donate, keep_unused=True).lower(*args)
        opts = compiler_options(graph)
        compiled = lowered.compile(compiler_options=opts) if opts else lowered.compile()
    metrics.inc("UncachedCompile")
    if pkey is not None:
        exec_cache.store(pkey, compiled)
    if time.perf_counter() - t0 >= _RELEASE_AFTER_S:
        host_memory.release()
    return Executable(compiled, donate)


_BIG_BMM_BYTES = 16 << 20
_YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"


def compiler_options(graph: Graph) -> dict:
    """XLA options for this program beyond the process-wide XLA_FLAGS.

    On a CPU without AVX-512, XLA's YNNPACK fusions make attention-shaped programs slower
    (batched matrix products with large outputs: the decoder benchmark's step 7%, its
    forward 21%, `bench/bench_xla_options.py`) while they speed up convolution networks
    (ResNet-18 step 33%); there, programs with such a product compile without them. With
    AVX-512 they make the decoder faster too (step 1147 -> 1014 ms, forward 392 -> 338)
    and every program keeps them. XLA_FLAGS naming the option decides alone."""
    if runtime.platform() != "CPU" or _YNN_OPTION in os.environ.get("XLA_FLAGS", ""):
        return {}
    if "avx512f" in runtime.host_cpu_flags():
        return {}
    for n in graph.order:
        if n.op == "aten::bmm" or n.op == "aten::baddbmm":
            shape, dtype = n.avals[0]
            if int(np.prod(shape)) * dtype.itemsize >= _BIG_BMM_BYTES:
                return {_YNN_OPTION: ""}
    return {}


# Only compilations this long leave enough garbage to be worth a trim (a trim walks the
# whole heap; the test suite compiles thousands of small programs).
_RELEASE_AFTER_S = 0.5


def _replicated(fn, graph):
    """Wraps a local program as an SPMD program over the replica mesh (axis 'r').

    Each global parameter is every replica's local buffer concatenated on dim 0 (0-d
    values as shape (1,)), so inside the program each replica sees its own values.
    """
    jax = runtime.jax_module()
    from jax.sharding import PartitionSpec as P
    from .lowering import ctx
    mesh = process_group.replica_mesh()
    world = mesh.devices.size
    in_shapes = [p.avals[0][0] for p in graph.params]
    out_shapes = [n.avals[i][0] for n, i in graph.roots]

    def body(*gparams):
        local = [g.reshape(()) if len(s) == 0 else g for g, s in zip(gparams, in_shapes)]
        ctx.axis, ctx.world = "r", world
        try:
            outs = fn(*local)
        finally:
            ctx.axis, ctx.world = None, 1
        return tuple(o.reshape((1,)) if len(s) == 0 else o for o, s in zip(outs, out_shapes))

    spec = P("r")
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(spec for _ in in_shapes),
                         out_specs=tuple(spec for _ in out_shapes), check_vma=False)


def _to_global(args, graph):
    """Local buffers -> global arrays sharded over the replica mesh."""
    jax = runtime.jax_module()
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = process_group.replica_mesh()
    world = mesh.devices.size
    sharding = NamedSharding(mesh, P("r"))
    dev = runtime.default_device()
    out = []
    for a, p in zip(args, graph.params):
        shape = p.avals[0][0]
        if len(shape) == 0:
            a = np.reshape(np.asarray(a), (1,)) if not hasattr(a, "addressable_shards") else a.reshape((1,))
        if not hasattr(a, "addressable_shards"):
            a = jax.device_put(a, dev)
        gshape = (a.shape[0] * world,) + tuple(a.shape[1:])
        out.append(jax.make_array_from_single_device_arrays(gshape, sharding, [a]))
    return out


def _from_global(outs, graph):
    res = []
    for o, (n, i) in zip(outs, graph.roots):
        local = o.addressable_shards[0].data
        if len(n.avals[i][0]) == 0:
            local = local.reshape(())
        res.append(local)
    return res


def lower_text(roots) -> str:
    """The StableHLO text of the program computing `roots` (no execution)."""
    return lowered(roots).as_text()


def lowered(roots):
    """The jax `Lowered` program computing `roots` (no compilation, no execution)."""
    jax = runtime.jax_module()
    graph = Graph(roots)
    args = graph.param_values()
    return jax.jit(graph.build_fn(), keep_unused=True).lower(*args)


def _lookup(key, donatable: tuple):
    """A compiled program for `key` that donates only buffers that may be donated now.

    Which buffers are free to donate can change between steps with the same graph (an
    optimizer's state appears at step 2): an executable donating a subset is reused
    rather than compiling again.
    """
    exes = _cache.get(key)
    if not exes:
        return None
    best = None
    free = set(donatable)
    for exe in exes:
        if exe.donated == donatable:
            return exe
        if free.issuperset(exe.donated) and (best is None or len(exe.donated) > len(best.donated)):
            best = exe
    return best


def execute(states: List[XlaState], barrier: bool = False) -> None:
    """Computes the pending values of `states` in one program and stores the results.

    `barrier`: `states` are all the live pending tensors (a full barrier). Only then can
    the executor know that no IR outside this graph still reads a buffer, so only then
    are the buffers of overwritten tensors donated.
    """
    states = [s for s in states if type(s.node) is not ir.DeviceData]
    if not states:
        return
    # Several states may share one value (aliases): compute each value once.
    roots = []
    root_of = {}
    for s in states:
        k = (id(s.node), s.idx)
        if k not in root_of:
            root_of[k] = len(roots)
            roots.append((s.node, s.idx))
    graph = Graph(roots)
    args = graph.param_values()
    replicated = graph.replicated
    donate = _donatable(graph, states) if barrier and not replicated else ()
    if replicated:
        args = _to_global(args, graph)
    exe = _lookup(graph.key, donate)
    if exe is None:
        exe = _compile(graph, args, donate)
        _cache.setdefault(graph.key, []).append(exe)
    else:
        metrics.inc("CachedCompile")
    large = exe.temp >= host_memory.LARGE_TEMP_BYTES
    if large:
        used_before = host_memory.before_dispatch()
    with metrics.timed("ExecuteTime"):
        outs = exe.compiled(*args)
    if large:
        host_memory.after_dispatch(exe.temp, used_before, outs)
    if replicated:
        outs = _from_global(outs, graph)
    del graph
    metrics.inc("ExecuteCount")
    del args
    for s in states:
        r = root_of[(id(s.node), s.idx)]
        aval = (s.shape, s.dtype)
        s.node = ir.DeviceData(outs[r], aval)
        s.idx = 0
    _dedupe_data(states, root_of)


def _dedupe_data(states, root_of):
    """States that computed the same root share one DeviceData leaf (and one buffer)."""
    by_array = {}
    for s in states:
        a = id(s.node.array)
        first = by_array.get(a)
        if first is None:
            by_array[a] = s.node
        else:
            s.node = first


def sync(wait: bool = False, states: Optional[List[XlaState]] = None) -> None:
    """The barrier: runs all pending IR (or that of `states`) and the step closures."""
    with _lock:
        if states is None:
            live = pending.take_live()
        else:
            live = states
        if live:
            metrics.add_sample("TensorsGraphSize", len(live))
            try:
                execute(live, barrier=states is None)
            except BaseException:
                if states is None:
                    pending.restore(live)
                raise
        if states is None:
            from . import rng
            rng.advance_step()
        for cb in _listeners["after_sync"]:
            cb()
        if wait:
            wait_all(live)
    if states is None:
        run_step_closures()


def materialize(state: XlaState):
    """The device buffer of `state`, running its pending graph if needed."""
    if type(state.node) is not ir.DeviceData:
        with _lock:
            if type(state.node) is not ir.DeviceData:
                execute([state])
    return state.node.array


def wait_all(states=None) -> None:
    if states is None:
        return
    for s in states:
        if type(s.node) is ir.DeviceData:
            try:
                s.node.array.block_until_ready()
            except Exception:
                pass


def add_step_closure(closure, args=(), run_async=False) -> None:
    _step_closures.append((closure, args, run_async))


_async_pool = {"thread": None, "queue": None}


def _async_worker(q):
    while True:
        item = q.get()
        if item is None:
            return
        fn, args = item
        try:
            fn(*args)
        except Exception:
            traceback.print_exc()


def run_step_closures() -> None:
    global _step_closures
    closures, _step_closures = _step_closures, []
    for fn, args, run_async in closures:
        if run_async:
            import queue
            if _async_pool["thread"] is None:
                q = queue.Queue()
                th = threading.Thread(target=_async_worker, args=(q,), daemon=True)
                th.start()
                _async_pool["thread"], _async_pool["queue"] = th, q
            _async_pool["queue"].put((fn, args))
        else:
            fn(*args)


def cache_size() -> int:
    return sum(len(v) for v in _cache.values())


def clear_cache() -> None:
    _cache.clear()
