"""The TorchDynamo bridge: `torch.compile(model, backend='openxla')` (and `openxla_eval`).

PyTorch's backend (`torch/_dynamo/backends/torchxla.py`) calls
`extract_compiled_graph(graph_module, args)` with the FX graph and its first real inputs.
The graph is run once on those inputs under the capture seam (`_engine/capture.py`): that
one lazy trace gives a program with an explicit input order, the inputs it writes in
place and its outputs, compiled once. Later calls with inputs of the same shapes run the
compiled program on the inputs' device buffers (pending inputs are computed first): no
per-op tracing, no graph hashing. Inputs of new shapes (or new Python values) trace and
compile again; a graph that is not one XLA program (a CPU fallback or a host read inside
it, CPU tensors among its inputs or outputs) is run through the lazy tracer at each call.
In SPMD mode a program is compiled for its inputs' shardings: a call whose inputs are laid
out otherwise (jax checks every argument's layout) runs the program traced for those
layouts, tracing it at the first such call. Sharding annotations inside the graph
(`torch.ops.xla.dynamo_mark_sharding`, `xs.mark_sharding`) are constraints of the program.
The forward and backward graphs of a training step are applied as pending IR nodes
(`OneProgramGraph`): the step's forward, backward and optimizer become one program at its
barrier (`XLA_DYNAMO_ONE_PROGRAM=0`: each graph's program runs at once, as a graph outside
a training step does when its inputs are computed).

Dynamic shapes (`torch.compile(..., dynamic=True)`, `torch._dynamo.mark_dynamic`): Dynamo
traces one graph whose sizes are symbols, passed to the graph as int arguments. XLA
compiles static shapes, so the graph gets one program per distinct set of concrete sizes
(the call's tensor shapes and int arguments), traced and compiled at the first call with
those sizes and reused afterwards; the graph itself is extracted once
(`DynamoExtractCompiledGraph`), each new set of sizes counts `DynamoCompileNewSizes`, and
XLA_DYNAMO_DEBUG names the sizes.

The helpers of `torch_xla._XLAC` the original's bridge is built on (`_get_graph_hash`,
`_xla_warm_up_cache`, `_run_cached_graph`, `_get_tensors_xla_device_data_node`,
`_clear_pending_irs`) are implemented here on the same captured programs.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Sequence

import torch
from torch.utils import _pytree as pytree

from .._dynamo import config
from .._engine import capture as _capture, env_vars as _config, executor as _executor, ir, rng, telemetry, mode
from .._engine.executor import analysis as _analysis, donation as _donation, dumps as _dumps
from .._engine.tensor import pending as _pending, state_of

_LAZY = "lazy"   # a graph that must be traced at every call


class NoneRemover:
    """Removes the None entries of an output list or tuple and puts them back."""

    def __init__(self):
        self.none_poslist: List[int] = []

    def remove_nones(self, value: Sequence):
        """Records where the Nones are; a list is edited in place, a tuple returned anew."""
        self.none_poslist = [i for i, v in enumerate(value) if v is None]
        kept = [v for v in value if v is not None]
        if isinstance(value, list):
            value[:] = kept
            return value
        return tuple(kept)

    def add_nones(self, value: Sequence):
        """Puts the recorded Nones back: a list in place, a tuple as a new tuple."""
        out = list(value)
        for pos in self.none_poslist:
            out.insert(pos, None)
        if isinstance(value, list):
            value[:] = out
            return value
        return tuple(out)


class GraphInputMatcher:
    """Maps a graph's inputs to a call's arguments: `graph_input_xla_values[i]` is the
    value captured for input i, or None where the input is one of the call's arguments
    (then `__call__` takes it from the arguments)."""

    def __init__(self, tensor_id_to_arg_idx: Dict[int, int], graph_input_tensor_ids: Sequence[int],
                 graph_input_xla_values: Sequence[Any], xla_args_tensor_ids: Any):
        self.tensor_id_to_arg_idx = dict(tensor_id_to_arg_idx)
        self.graph_input_tensor_ids = list(graph_input_tensor_ids)
        self.graph_input_xla_values = [None if tid in xla_args_tensor_ids else v
                                       for tid, v in zip(graph_input_tensor_ids, graph_input_xla_values)]
        self.arg_index = [self.tensor_id_to_arg_idx.get(tid) for tid in self.graph_input_tensor_ids]

    def __call__(self, args: Sequence[Any]) -> List[Any]:
        return [args[i] if v is None else v for i, v in zip(self.arg_index, self.graph_input_xla_values)]


class UnsupportedNodesCollector(torch.fx.Interpreter):
    """Runs an FX graph on the xla device and collects the nodes XLA cannot run as part of
    one program: a CPU fallback inside, or CPU tensors among the results. The metrics are
    left as they were."""

    def __init__(self, module: torch.fx.GraphModule):
        super().__init__(module)
        self._unsupported: List[torch.fx.Node] = []

    def run(self, *args: Any, **kwargs: Any) -> Any:
        saved = telemetry.snapshot_counters()
        try:
            return super().run(*args, **kwargs)
        finally:
            telemetry.restore_counters(saved)

    def run_node(self, n: torch.fx.Node) -> Any:
        before = _fallbacks()
        result = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module"):
            cpu = any(isinstance(v, torch.Tensor) and v.device.type != "xla" for v in pytree.tree_leaves(result))
            if cpu or _fallbacks() != before:
                self._unsupported.append(n)
        return result

    def get_unsupported_nodes(self) -> List[torch.fx.Node]:
        return self._unsupported


def _fallbacks() -> int:
    return sum(v for k, v in telemetry.counters.items() if k.startswith("aten::"))


# The executor's donor setting (`_XLAC._xla_set_enable_alias_with_buffer_donor_config`):
# one setting for the process, not per thread; set and restored by
# `alias_with_buffer_donor_config` in the thread that enters it, without a lock.
_donor_config = _donation.config


@contextlib.contextmanager
def alias_with_buffer_donor_config(should_alias: bool = True) -> Iterator[bool]:
    """Inside the block, graph hashes (`_XLAC._get_graph_hash`) count which inputs are
    buffer donors (`_XLAC._set_buffer_donation`), and every execution (partial syncs and
    host reads too) donates them: the setting of
    `_XLAC._xla_set_enable_alias_with_buffer_donor_config`. Yields the previous setting."""
    saved = _donor_config.alias
    _donor_config.alias = should_alias
    try:
        yield saved
    finally:
        _donor_config.alias = saved


def donor_config() -> bool:
    return _donor_config.alias


def _signature(args: Sequence[Any]) -> tuple:
    # A tensor's device is not part of it: the first call of a signature sends graphs with
    # inputs off the device to the lazy path, and Dynamo guards on devices.
    return tuple((a.shape, a.dtype) if isinstance(a, torch.Tensor) else (type(a), a) for a in args)


class CompiledGraph:
    """A dynamo FX graph bound to XLA programs, one per input signature."""

    def __init__(self, graph_module: Callable, name: str = "dynamo"):
        self.graph_module = graph_module
        self.name = name
        self.programs: Dict[tuple, Any] = {}
        # SPMD: every program traced for a signature, by its inputs' layouts (`programs`
        # holds the one used last); a run whose inputs are laid out anew picks or traces one.
        self.laid_out: Dict[tuple, Any] = {}
        self.host_scalars = None   # positions of 0-d CPU tensor inputs, found at the first call

    def _on_device(self, args: tuple) -> tuple:
        """`args` with their 0-d CPU tensors on the xla device. Dynamo passes the Python
        floats of a dynamic graph (`specialize_float=False`) as such tensors: sent with
        the call, one program serves every value (as a CPU scalar operand of an xla op)."""
        found = self.host_scalars
        if found is None:
            found = self.host_scalars = _host_scalars(args)
        if not found:
            return args
        device, pos = found
        args = list(args)
        for i in pos:
            args[i] = args[i].to(device)
        return tuple(args)

    def __call__(self, *args: Any) -> Any:
        args = self._on_device(args)
        key = _signature(args)
        entry = self.programs.get(key)
        if entry is None:
            return self._first_call(key, args)
        if entry is _LAZY:
            with mode.lazy_scope():
                return self.graph_module(*args)
        flat = [a for a in args if isinstance(a, torch.Tensor)]   # a graph's inputs are flat
        return self._run_cached(entry, key, args, flat, [state_of(t) for t in flat])

    def _run_cached(self, program, key: tuple, args: Sequence[Any], flat: list, states: list) -> Any:
        _check_inputs(states)
        try:
            return _run(program, flat, states)
        except _capture.LayoutChanged:
            return self._new_layout(key, args, states)

    def _new_layout(self, key: tuple, args: Sequence[Any], states) -> Any:
        """SPMD: the inputs' shardings changed since the program was compiled (their
        values are computed by now): the program traced for these layouts, or a new one."""
        layouts = _capture.layouts(states)
        program = self.laid_out.get((key, layouts))
        if program is None:
            _debug(f"graph {self.name}: an input's sharding changed: traced again")
            return self._first_call(key, args)
        self.programs[key] = program
        return _run(program, [a for a in args if isinstance(a, torch.Tensor)], states)

    def _first_call(self, key: tuple, args: Sequence[Any]) -> Any:
        if self.programs and key not in self.programs:
            _new_sizes(self, key)
        tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        if any(args[i].device.type != "xla" for i in tensor_pos):
            _debug(f"graph {self.name}: an input is not on the xla device: it runs lazily at every call")
            for i in tensor_pos:   # each one named: the graph loses its cached program
                if args[i].device.type != "xla":
                    warnings.warn(f"Found tensor with shape {args[i].shape} on {args[i].device} (input {i} of a "
                                  f"graph given to backend openxla): a graph with inputs off the xla device is "
                                  f"traced at every call instead of running one cached XLA program; move the "
                                  f"input to the xla device", stacklevel=2)
            self.programs[key] = _LAZY
            with mode.lazy_scope():
                return self.graph_module(*args)
        with _analysis.cause("torch_xla.sync when dynamo processing input graphs"):
            _executor.sync()
        program, out = _capture.trace(self.graph_module, *args, run=False)
        if program is None:
            _debug(f"graph {self.name}: not one closed graph (a host read or CPU fallback inside): "
                   f"it runs lazily at every call")
            self.programs[key] = _LAZY
            return out
        program.compile_cause = "dynamo is compiling a FX graph to HLO"
        program.execute_cause = "dynamo is executing a compiled program"
        _debug(f"graph {self.name}: traced for inputs {[a for a in key]}: {len(program.graph.order)} nodes, "
               f"{len(program.graph.params)} parameters, {len(program.graph.roots)} outputs")
        self.programs[key] = program
        flat = _capture.input_tensors(args)
        if program.strategy.name.startswith("spmd"):
            self.laid_out[(key, _capture.layouts([state_of(t) for t in flat]))] = program
        return self._run_first(program, flat)

    def _run_first(self, program, flat: list) -> Any:
        return _run(program, flat)


class OneProgramGraph(CompiledGraph):
    """A dynamo FX graph applied as one pending IR node at each call, so that a training
    step's graphs (AOTAutograd's forward and backward, and the optimizer's graph when the
    step is compiled whole) and its lazy ops join one lazy graph, which the step's barrier
    compiles as one program (keyed by structure: later steps reuse it).

    A graph that is not part of a training step (`kind` "") runs at once, computing its
    pending inputs first, unless it reads results of a pending compiled graph (an
    optimizer step compiled after the backward); so does any call in eager mode and any
    program that needs its own strategy (SPMD, collectives). A graph called on pending
    inputs while its previous application has not run yet (a loop of steps without `torch_xla.sync()`) first runs
    everything pending as one program, so the lazy graph holds one step, not a chain of
    them; the backward is exempt (gradient accumulation applies it again within a step)."""

    def __init__(self, graph_module: Callable, name: str = "dynamo", kind: str = ""):
        super().__init__(graph_module, name)
        self.kind = kind
        self._applied = None   # weak reference to the node of the latest application

    def _runs_at_once(self, program, states: list) -> bool:
        # Outside a training step only a graph reading results of a pending compiled graph
        # (an optimizer step compiled after the backward) joins the lazy graph.
        return (mode.modes.eager or not program.appliable()
                or (not self.kind and not any(not s.is_data and s.node.op == "xla::call_subgraph"
                                              for s in states)))

    def _apply(self, program, flat: list, states: list) -> Any:
        if self.kind != "backward" and self._applied is not None and self._applied() is not None \
                and any(not s.is_data for s in states):
            _debug(f"graph {self.name}: called again before the previous step ran: the pending step "
                   f"runs first as one program")
            telemetry.inc("DynamoImplicitStep")
            _executor.flush("dynamo graph called again before the step's barrier")
            states = [state_of(t) for t in flat]
            if not self.kind:
                return _run(program, flat, states)
        if config.skip_input_data_check and any(not s.is_data for s in states):
            _check_inputs(states)   # raises: the inputs were promised to be computed
        out = program.outputs(program.apply(flat, states))
        self._applied = program.last_applied
        return out

    def _run_cached(self, program, key: tuple, args: Sequence[Any], flat: list, states: list) -> Any:
        if self._runs_at_once(program, states):
            return super()._run_cached(program, key, args, flat, states)
        return self._apply(program, flat, states)

    def _run_first(self, program, flat: list) -> Any:
        states = [state_of(t) for t in flat]
        if self._runs_at_once(program, states):
            return _run(program, flat)
        return self._apply(program, flat, states)


def _graph_kind(graph_module: Any) -> str:
    """`forward` or `backward` for the two halves of an AOTAutograd training graph,
    otherwise "" (an inference graph, or one not made by AOTAutograd): the bridge gets
    the graph at its first call, after AOTAutograd's compile, so the kind is read from
    the names AOTAutograd gives a training graph's inputs (`primals_N`, and `tangents_N`
    for the backward's incoming gradients)."""
    graph = getattr(graph_module, "graph", None)
    if graph is None:
        return ""
    names = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    if any(n.startswith("tangents_") for n in names):
        return "backward"
    if any(n.startswith("primals_") for n in names):
        return "forward"
    return ""


def _host_scalars(args: Sequence[Any]):
    """(xla device, positions of the 0-d CPU tensors among `args`), or () when there are
    none or no tensor of the call is on the xla device (a graph of CPU tensors is left as
    it is)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "xla"), None)
    pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() == 0]
    return (device, pos) if device is not None and pos else ()


def _new_sizes(graph: CompiledGraph, key: tuple) -> None:
    """A graph called with sizes it has no program for (a dynamic dimension took a new
    value, or Dynamo's guards let other shapes through): counted, and explained under
    XLA_DYNAMO_DEBUG before the trace and compile."""
    telemetry.inc("DynamoCompileNewSizes")
    if _config.get("XLA_DYNAMO_DEBUG"):
        sizes = [tuple(k[0]) if isinstance(k[0], torch.Size) else k[1] for k in key]
        _debug(f"graph {graph.name}: no program for the input sizes {sizes}: traced and compiled for them "
               f"(XLA compiles static shapes; {len(graph.programs) + 1} programs for this graph)")


def _run(program, flat: list, states=None) -> Any:
    """Runs a traced graph's program on its input buffers; each run records how many
    buffers went in and came out (`RunCachedGraphInputData` / `...OutputData`)."""
    if _dumps.settings.on:
        _dump_run(program)
    results = program.run_flat(flat, states)
    telemetry.add_sample("RunCachedGraphInputData", len(flat))
    telemetry.add_sample("RunCachedGraphOutputData", len(results))
    return program.outputs(results)


def _debug(text: str) -> None:
    if _config.get("XLA_DYNAMO_DEBUG"):
        print(f"[torch_xla dynamo] {text}", flush=True)


def _check_inputs(states) -> None:
    if any(not s.is_data for s in states):
        if config.skip_input_data_check:
            raise RuntimeError("input data to dynamo graph can not be a pending ir: call torch_xla.sync() "
                               "first, or leave torch_xla._dynamo.config.skip_input_data_check False")
        telemetry.inc("DynamoSyncInputExecuteTime")   # the run computes them first (the original's name)


def extract_compiled_graph(graph_module: torch.fx.GraphModule,
                           args: Sequence[Any]) -> Callable:  # noqa: ARG001 (traced at the first call)
    """Binds a dynamo FX graph to XLA: returns a callable taking the graph's inputs.

    The graph is traced and compiled at the callable's first call, for the shapes of the
    inputs it gets (one program per input signature), so the example `args` (the
    original traces them at once) are not needed. The graphs of a training step are
    applied as pending IR nodes (`OneProgramGraph`), so the step's forward, backward and
    optimizer compile into one program at its barrier; `XLA_DYNAMO_ONE_PROGRAM=0` runs
    each graph's program at once, as a graph outside a training step does when its
    inputs are computed."""
    telemetry.inc("DynamoExtractCompiledGraph")
    if _config.get("XLA_DYNAMO_ONE_PROGRAM"):
        return OneProgramGraph(graph_module, kind=_graph_kind(graph_module))
    return CompiledGraph(graph_module)


def extract_compiled_graph_and_run(graph_module: torch.fx.GraphModule, args: Sequence[Any]) -> Any:
    """`extract_compiled_graph(graph_module, args)(*args)`."""
    return extract_compiled_graph(graph_module, args)(*args)


# ---- the graph helpers of `torch_xla._XLAC` -------------------------------------------------

def _dump_run(program) -> None:
    """XLA_SAVE_TENSORS_FILE: each run of a Dynamo program appends its graph under
    `[dynamo]` (the text is made at the program's first run)."""
    path = _dumps.saved_tensors_path()
    if not path:
        return
    text = getattr(program, "dump_text", None)
    if text is None:
        text = program.dump_text = _graph_dump(program.graph, program.strategy)
    with open(path, "a") as fh:
        fh.write(f"[dynamo]\n{text}\n")


def _graph_dump(graph, strategy) -> str:
    body = _dumps.graph_text(graph, strategy, _config.get("XLA_SAVE_TENSORS_FMT"))
    if not body.endswith("\n"):
        body += "\n"
    roots = ", ".join(_analysis.graph_hash(n.hash) for n, _ in graph.roots)
    return ("TensorsGraphInfo:\n" + "".join(f"  {f}\n" for f in _analysis.frames())
            + f"\nRoot Hashes: ({roots})\n\n## BEGIN_GRAPH\n{body}"
            + f"Graph Hash: {_analysis.graph_hash(graph.key)}\n\n## END_GRAPH\n\n")


def graph_inputs(roots: Sequence[tuple]) -> List[Any]:
    """The device data leaves the graph of `roots` reads, one per buffer, in the order of
    the parameter sequence of the original's graphs: depth first from each root in turn,
    a node's operands visited last to first. `run_cached_graph` takes its inputs in this
    order, so a caller can match them to the leaves it knows."""
    expanded, emitted, buffers, out = set(), set(), set(), []
    for root, _ in roots:
        stack = [root]
        while stack:
            node = stack[-1]
            nid = id(node)
            if nid not in expanded:
                expanded.add(nid)
                stack.extend(o for o, _ in node.operands if id(o) not in expanded)
                continue
            stack.pop()
            if nid in emitted:
                continue
            emitted.add(nid)
            if type(node) is ir.DeviceData and id(node.array) not in buffers:
                buffers.add(id(node.array))
                out.append(node)
    return out


class _CachedGraph:
    """A program warmed up for `_run_cached_graph`: its inputs are the graph's device
    data leaves in `graph_inputs` order; `program` is None when every root was data
    already (nothing to compute)."""
    __slots__ = ("program", "n_inputs", "positions")

    def __init__(self, program, n_inputs: int, positions: List[int]):
        self.program = program
        self.n_inputs = n_inputs
        self.positions = positions   # input position of each of the program's flat inputs


# hash bytes -> _CachedGraph, least recently used first. Each entry keeps its graph's
# captured buffers alive, hence the bound.
_cached_graphs: "OrderedDict[bytes, _CachedGraph]" = OrderedDict()
_CACHED_GRAPHS_MAX = 256


def warm_up_cache(key: bytes, roots: Sequence[tuple]) -> None:
    """Compiles the program computing `roots` (nothing runs) and keeps it under `key`,
    the graph's hash, for `run_cached_graph`. Its outputs are the roots that are not
    device data already, each value once: what the original's graph returns."""
    if key in _cached_graphs:
        _cached_graphs.move_to_end(key)
        return
    leaves = graph_inputs(roots)
    outs, seen = [], set()
    for node, idx in roots:
        if type(node) is ir.DeviceData or (id(node), idx) in seen:
            continue
        seen.add((id(node), idx))
        outs.append((node, idx))
    program, positions = None, []
    if outs:
        graph, strategy = _executor.walk(outs)
        at = {id(leaf.array): k for k, leaf in enumerate(leaves)}
        slots = []
        for slot, p in enumerate(graph.params):
            if type(p) is ir.DeviceData:
                positions.append(at[id(p.array)])
                slots.append(slot)
        seed = rng.current_seed_node()
        seed_slot = graph.slot.get(id(seed), -1) if seed is not None else -1
        out_tree = pytree.tree_flatten(list(range(len(outs))))[1]
        program = _capture.Program(graph, strategy, slots, [], out_tree, list(range(len(outs))), seed_slot)
        program.compile_cause = "dynamo is compiling a FX graph to HLO"
        program.execute_cause = "dynamo is executing a compiled program"
        program.executable()
        if _dumps.settings.on and _dumps.saved_tensors_path():
            program.dump_text = _graph_dump(graph, strategy)
    _cached_graphs[key] = _CachedGraph(program, len(leaves), positions)
    while len(_cached_graphs) > _CACHED_GRAPHS_MAX:
        _cached_graphs.popitem(last=False)


def run_cached_graph(key: bytes, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Runs the program `warm_up_cache` kept under `key` on `inputs` (xla or CPU tensors,
    in `graph_inputs` order); returns its outputs."""
    entry = _cached_graphs.get(key)
    if entry is None:
        raise RuntimeError(f"_run_cached_graph: no graph was warmed up with hash {key.hex()} "
                           f"(call _xla_warm_up_cache on its tensors first)")
    if len(inputs) != entry.n_inputs:
        raise RuntimeError(f"_run_cached_graph: the graph takes {entry.n_inputs} inputs, got {len(inputs)}")
    _cached_graphs.move_to_end(key)
    if entry.program is None:
        return []
    device = None
    flat = []
    for pos in entry.positions:
        t = inputs[pos]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"_run_cached_graph: input {pos} is a {type(t).__name__}, not a tensor")
        if t.device.type != "xla":
            if device is None:
                from .._engine import pjrt
                device = torch.device("xla", pjrt.device_index())
            t = t.to(device)
        flat.append(t)
    return _run(entry.program, flat)


def clear_pending_irs() -> None:
    """Drops the pending IR of every live tensor: each one holds a placeholder instead
    (no value: reading or computing with it raises), and the next barrier runs nothing
    for them."""
    from ._xla_ops import _PT_XLA_TYPE_MAP
    from .xla_builder import _placeholder
    for s in _pending.take_live():
        holder = _placeholder({"type": _PT_XLA_TYPE_MAP[s.dtype], "sizes": tuple(s.shape)})
        s.set_data(state_of(holder).node)


__all__ = ["extract_compiled_graph", "NoneRemover", "CompiledGraph", "OneProgramGraph", "GraphInputMatcher",
           "UnsupportedNodesCollector", "alias_with_buffer_donor_config"]

