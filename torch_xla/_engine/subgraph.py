"""A PyTorch callable traced once on placeholder inputs into a jax function: the bodies of
`scan`, `while_loop` and `fori_loop`, and the functions of `assume_pure`.

`trace(fn, avals)` runs `fn` lazily on tensors whose IR leaves are `ir.Placeholder`s (no
value, no device memory), walks the graph of its results and keeps it as a `Subgraph`:
`sub(inputs, outer, seed)` evaluates the graph on jax values with the lowering table,
so a lowering can call it inside `lax.scan` / `lax.while_loop` / `jax.vjp`. Values the
function reads from outside (weights, tensors it creates, Python scalars that became
graph parameters) are the graph's other leaves, `outer`: the node applying the body takes
them as operands. Random ops inside the body draw from a seed placeholder, which the
caller feeds (per iteration for a loop).

A subgraph's `key` is its structure's hash (node hashes do not depend on source lines),
so equal bodies traced from different functions share compiled programs.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from . import ir, mode, rng
from .executor.graph import Graph
from .executor.lower import build_fn
from .lowering import ctx as lowering_ctx
from .tensor import make_tensor, pending, state_of, wrap_user

Aval = Tuple[tuple, torch.dtype]
SEED_AVAL: Aval = ((), torch.int64)


class Subgraph:
    """A traced body: a jax function of (inputs, outer values, seed) -> flat outputs."""

    def __init__(self, graph: Graph, n_in: int, out_kinds: list, out_tree, out_avals: List[Aval]):
        self.key = graph.keyed("subgraph").key
        self.n_in = n_in
        self.out_kinds = out_kinds     # per output leaf: root index, or ("const", value)
        self.out_tree = out_tree
        self.out_avals = out_avals     # of the tensor outputs (the roots), in order
        # parameter slot -> ("in", position) | ("seed", None) | ("outer", k)
        self.binding = []
        self.outer: List[ir.Node] = []
        self.seeded = False
        for p in graph.params:
            if type(p) is ir.Placeholder:
                if p.position == n_in:
                    self.seeded = True
                    self.binding.append(("seed", None))
                else:
                    self.binding.append(("in", p.position))
            else:
                self.binding.append(("outer", len(self.outer)))
                self.outer.append(p)
        self.outer_avals = [p.avals[0] for p in self.outer]
        self._graph = graph
        self._fns = {}

    def __call__(self, inputs: Sequence, outer: Sequence, seed=None) -> list:
        """The body's tensor outputs as jax values (inside any jax trace)."""
        forms = (lowering_ctx.patch_convolutions, lowering_ctx.widen_int4_dots)
        fn = self._fns.get(forms)
        if fn is None:
            fn = self._fns[forms] = build_fn(self._graph, forms[0], widen_int4_dots=forms[1])
        params = []
        for kind, k in self.binding:
            params.append(inputs[k] if kind == "in" else outer[k] if kind == "outer" else seed)
        # The body is lowered inside another node's lowering: keep the enclosing graph's
        # lowering state. Index checks cannot leave a loop body; inside one they are off.
        saved = (lowering_ctx.checks, lowering_ctx.node, lowering_ctx.out, lowering_ctx.manual_text)
        try:
            return list(fn(*params))
        finally:
            (lowering_ctx.checks, lowering_ctx.node, lowering_ctx.out, lowering_ctx.manual_text) = saved

    def root_shardings(self) -> list:
        """Per tensor output: the sharding the body constrained it to last (mark_sharding
        inside the body), or None."""
        return [n.args[1] if n.op == "xla::sharding_constraint" else None for n, _ in self._graph.roots]

    def outputs(self, tensors: Sequence) -> Any:
        """`tensors` (one per root) placed in the traced output tree, constants restored."""
        leaves = [tensors[k] if type(k) is int else k[1] for k in self.out_kinds]
        return pytree.tree_unflatten(leaves, self.out_tree)

    def __repr__(self):
        return f"Subgraph<{self.key & 0xFFFFFFFFFFFF:x}>"


@contextlib.contextmanager
def _forget_pending():
    """The body's tensors are not pending IR of the program around it: drop their entries."""
    with pending.lock:
        mark = len(pending.refs)
    try:
        yield
    finally:
        with pending.lock:
            del pending.refs[mark:]


def placeholder_tensor(aval: Aval, position: int, wrap: bool = True) -> torch.Tensor:
    shape, dtype = aval
    t = make_tensor(ir.Placeholder((tuple(shape), dtype), position), 0, tuple(shape), dtype)
    return wrap_user(t) if wrap else t


def trace(fn: Callable, avals: Sequence[Aval], seeded: bool = True,
          build_args: Optional[Callable[[list], tuple]] = None, wrap: bool = True) -> Subgraph:
    """Traces `fn` on placeholders of `avals` into a `Subgraph`.

    `build_args(flat placeholders)` makes `fn`'s positional arguments (default: the flat
    list itself). The function's result may be any pytree; its tensor leaves must be xla
    tensors computed without a host read or an execution. `wrap=False`: the placeholders
    are plain xla tensors (for a kernel below functionalization)."""
    n = len(avals)
    seed = ir.Placeholder(SEED_AVAL, n) if seeded else None
    with _forget_pending(), mode.lazy_scope(), torch.no_grad(), rng.local_seed(seed):
        ins = [placeholder_tensor(a, k, wrap) for k, a in enumerate(avals)]
        args = tuple(ins) if build_args is None else build_args(ins)
        out = fn(*args)
    leaves, tree = pytree.tree_flatten(out)
    roots, kinds, avals_out = [], [], []
    for v in leaves:
        if isinstance(v, torch.Tensor):
            v = getattr(v, "global_tensor", v)   # a sharded tensor (mark_sharding's result): its value
            if v.device.type != "xla":
                raise RuntimeError(f"a traced body returned a tensor on {v.device}; its results must be xla tensors")
            s = state_of(v)
            kinds.append(len(roots))
            roots.append((s.node, s.idx))
            avals_out.append((tuple(s.shape), s.dtype))
        else:
            kinds.append(("const", v))
    graph = Graph(roots)
    return Subgraph(graph, n, kinds, tree, avals_out)


def outer_operands(sub: Subgraph) -> list:
    """The (node, index) operands of the values the body reads from outside."""
    return [(p, 0) for p in sub.outer]


class Spec:
    """The static argument of a node applying subgraphs (`xla::scan`, `xla::while_loop`,
    `xla::call_subgraph`): the bodies and the counts the lowering needs. Equal when the
    bodies' structures and the counts are equal; its repr (part of the node's hash) holds
    no address."""
    __slots__ = ("bodies", "fields", "_hash")

    def __init__(self, bodies: Sequence[Subgraph], **fields):
        self.bodies = tuple(bodies)
        self.fields = fields
        self._hash = hash((tuple(b.key for b in bodies), tuple(sorted(fields.items()))))

    def __getattr__(self, name):
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(name) from None

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (type(other) is Spec and other._hash == self._hash
                and tuple(b.key for b in other.bodies) == tuple(b.key for b in self.bodies)
                and other.fields == self.fields)

    def __repr__(self):
        inner = ", ".join(f"{k}={v!r}" for k, v in sorted(self.fields.items()))
        return f"Spec({', '.join(map(repr, self.bodies))}; {inner})"


def apply(op: str, tensors: Sequence[torch.Tensor], extra: Sequence[tuple], spec: Spec,
          out_avals: Sequence[Aval], wrap: bool = True) -> List[torch.Tensor]:
    """One node of engine op `op` on `tensors` then the `extra` (node, index) operands
    (outer values of bodies, a seed), with static `spec`; returns its outputs as tensors
    (`wrap=False`: plain xla tensors, for a kernel below functionalization)."""
    from . import executor
    from .lowering import LOWERINGS
    operands = [(state_of(t).node, state_of(t).idx) for t in tensors] + list(extra)
    args = tuple(ir.ref(i) for i in range(len(operands))) + (spec,)
    avals = tuple((tuple(sh), dt) for sh, dt in out_avals)
    node = ir.Node(op, tuple(operands), args, avals, LOWERINGS[op], None)
    outs = [make_tensor(node, i, sh, dt) for i, (sh, dt) in enumerate(avals)]
    if mode.modes.eager and outs:
        executor.execute([o._xla for o in outs], metric="EagerOpExecuteTime")
    return [wrap_user(o) for o in outs] if wrap else outs


def seed_operand() -> tuple:
    """The (node, index) operand of this step's seed, for a body that draws random numbers."""
    return (rng.seed_node(), 0)
