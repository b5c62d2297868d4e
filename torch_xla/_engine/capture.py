"""Capture: trace a callable on given XLA inputs into one program with an explicit
input order and output tree.

`capture(fn, *args)` runs `fn` once, lazily, on the inputs' device data and keeps the
graph of its outputs as a `Program`: `inputs` maps each flat tensor argument to its
parameter slot, every other parameter (weights read from a module, Python scalars) is
captured by value, and `run(*new_args)` executes the compiled program on new inputs of
the same avals without tracing again. An input that `fn` overwrites in place is written
back by `run` as well (`mutated`). This is the seam a dynamo backend, export and
`torch_xla.compile` share: what the program reads, in which order, and what it returns.
"""
from __future__ import annotations

from typing import Any, Callable, List

import torch
from torch.utils import _pytree as pytree

from . import executor, ir, mode, runtime
from .executor import compile as compiling
from .executor.lower import build_fn
from .tensor import make_tensor, pending, replace_state, state_of, unwrap, wrap_user


class Program:
    """A captured program: `run(*args)` -> outputs in the traced tree."""

    def __init__(self, graph, input_slots: List[int], mutated: List[int], out_tree, n_out: int):
        self.graph = graph
        self.input_slots = input_slots   # parameter slot of each flat tensor input (-1: unused)
        self.mutated = mutated           # flat input positions written in place, in output order
        self.out_tree = out_tree
        self.n_out = n_out
        self.captured = graph.param_values()   # values of every slot at capture time
        jax = runtime.jax_module()
        fn = build_fn(graph, compiling.platform_policy().patch_convolutions)
        self._jit = jax.jit(fn, keep_unused=True)

    def _params(self, flat_inputs):
        params = list(self.captured)
        for t, slot in zip(flat_inputs, self.input_slots):
            if slot >= 0:
                s = state_of(t)
                p = self.graph.params[slot]
                if (s.shape, s.dtype) != p.avals[0]:
                    raise ValueError(f"captured program: input of aval {(s.shape, s.dtype)} where "
                                     f"{p.avals[0]} was traced")
                params[slot] = executor.materialize(s)
        return params

    def lowered(self):
        """The jax `Lowered` program (StableHLO) with parameters in slot order."""
        return self._jit.lower(*self.captured)

    def run(self, *args: Any):
        flat = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        outs = self._jit(*self._params(flat))
        results = []
        for (n, i), arr in zip(self.graph.roots, outs):
            shape, dtype = n.avals[i]
            results.append(make_tensor(ir.DeviceData(arr, (shape, dtype)), 0, shape, dtype))
        for pos, r in zip(self.mutated, results[self.n_out:]):
            replace_state(flat[pos], r._xla)
        return pytree.tree_unflatten([wrap_user(r) for r in results[:self.n_out]], self.out_tree)


def capture(fn: Callable, *args: Any) -> Program:
    """Traces `fn(*args)` once (lazily) into a Program; `args` hold XLA tensors."""
    executor.sync()
    flat = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    before = []
    for t in flat:
        if t.device.type != "xla":
            raise TypeError(f"capture: inputs must be xla tensors, got one on {t.device}")
        s = state_of(t)
        executor.materialize(s)
        before.append(s.node)
    with mode.lazy_scope():
        out = fn(*args)
    leaves, out_tree = pytree.tree_flatten(out)
    if not all(isinstance(v, torch.Tensor) and v.device.type == "xla" for v in leaves):
        raise TypeError("capture: the function must return xla tensors (in any nesting)")
    roots = [(state_of(v).node, state_of(v).idx) for v in leaves]
    mutated = []
    for pos, t in enumerate(flat):
        s = unwrap(t)._xla
        if s.node is not before[pos]:
            mutated.append(pos)
            roots.append((s.node, s.idx))
    graph, _ = executor.walk(roots)
    slots = [graph.slot.get(id(node), -1) for node in before]
    program = Program(graph, slots, mutated, out_tree, len(leaves))
    # The traced call itself ran nothing: give the caller its results and write-backs, in
    # a partial sync (which never donates: the program keeps reading its captured values).
    executor.sync(states=pending.take_live())
    return program
