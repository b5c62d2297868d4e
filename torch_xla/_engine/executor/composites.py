"""Composite patterns: the part of a graph between `xla::mark_tensor` marks, as one op.

A pattern instance (name, id) starts at its input marks and ends at its output marks
(`torch_xla.experimental.mark_pattern_utils.StableHLOCompositeBuilder`). Its inside is
every node that an output mark reaches without crossing an input mark and that depends
on an input mark; values from outside it (weights, scalars, other results) are extra
operands of the composite, constants are inlined into its decomposition. The global
program evaluates the marks' dependencies, then the composite at its first output mark;
inside nodes that nothing else reads are not lowered globally. Nested patterns are not
grouped: an inner mark is the identity.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from .. import ir
from ..lowering import composite as lowering_composite, ctx as lowering_ctx
from .graph import Graph

MARK = "xla::mark_tensor"


class Pattern:
    """One pattern instance: its marks, inside nodes and outside operands."""

    def __init__(self, name: str):
        self.name = name
        self.attrs: tuple = ()
        self.in_marks: Dict[int, ir.Node] = {}
        self.out_marks: Dict[int, ir.Node] = {}
        self.inside: List[ir.Node] = []
        self.outside: List[tuple] = []   # (node, idx) read by the inside, computed outside

    def close(self, index: Dict[int, int]) -> bool:
        """Finds the inside; False when the pattern cannot be one op (a missing side, or
        an output mark that feeds another output or an input of the same pattern)."""
        if not self.in_marks or not self.out_marks:
            return False
        inputs = {id(m) for m in self.in_marks.values()}
        outputs = {id(m) for m in self.out_marks.values()}
        seen, stack, found = set(), [m.operands[0][0] for m in self.out_marks.values()], []
        while stack:
            n = stack.pop()
            if id(n) in seen or id(n) in inputs or type(n) is not ir.Node:
                continue
            seen.add(id(n))
            if id(n) in outputs:
                return False
            found.append(n)
            stack.extend(o for o, _ in n.operands)
        if _reaches(outputs, [m.operands[0][0] for m in self.in_marks.values()]):
            return False   # an input computed from the pattern's own output: no single op
        found.sort(key=lambda n: index[id(n)])
        depends = set(inputs)
        for n in found:
            if any(id(o) in depends for o, _ in n.operands):
                depends.add(id(n))
        self.inside = [n for n in found if id(n) in depends]
        inside = {id(n) for n in self.inside} | inputs
        reads = [r for n in self.inside for r in n.operands] + [m.operands[0] for m in self.out_marks.values()]
        outside, listed = [], set()
        for o, i in reads:
            if id(o) not in inside and (id(o), i) not in listed:
                listed.add((id(o), i))
                outside.append((o, i))
        self.outside = outside
        return True

    def deps(self) -> list:
        """The values (node, idx) the global program computes before the composite: the
        input marks, then the outside operands."""
        return [(m, 0) for _, m in sorted(self.in_marks.items())] + self.outside

    def lower(self, in_vals: list, out_vals: list, lower_node) -> tuple:
        """The pattern's outputs (in mark position order) from the values of its input
        marks and outside operands (host arrays for constants)."""
        marks = [m for _, m in sorted(self.in_marks.items())]
        operands, where, closed = list(in_vals), {}, {}
        for (o, i), v in zip(self.outside, out_vals):
            if isinstance(v, np.ndarray):   # a constant: inlined in the decomposition
                closed[(id(o), i)] = v
            else:                           # a program value: an operand of the op
                where[(id(o), i)] = len(operands)
                operands.append(v)
        inside, outs = self.inside, [m.operands[0] for _, m in sorted(self.out_marks.items())]

        def body(*xs):
            local = {id(m): (xs[k],) for k, m in enumerate(marks)}

            def get(o, i):
                if id(o) in local:
                    return local[id(o)][i]
                k = where.get((id(o), i))
                return xs[k] if k is not None else closed[(id(o), i)]
            for n in inside:
                local[id(n)] = lower_node(n, [get(o, i) for o, i in n.operands])
            return tuple(get(o, i) for o, i in outs)

        saved, lowering_ctx.checks = lowering_ctx.checks, None   # checks cannot leave the op
        try:
            return lowering_composite.composite(body, self.name, self.attrs, operands)
        finally:
            lowering_ctx.checks = saved


def _reaches(targets: set, start: list) -> bool:
    """Whether walking operands back from `start` meets a node of `targets` (ids)."""
    seen, stack = set(), list(start)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        if id(n) in targets:
            return True
        seen.add(id(n))
        stack.extend(o for o, _ in n.operands)
    return False


class Composites:
    """The graph's patterns and the order in which the global program evaluates it."""

    def __init__(self, graph: Graph, patterns: List[Pattern]):
        self.exits = {}   # id(output mark) -> (pattern, output position)
        for p in patterns:
            for k, (_, m) in enumerate(sorted(p.out_marks.items())):
                self.exits[id(m)] = (p, k)
        order, seen = [], set()
        stack = [(n, False) for n, _ in reversed(graph.roots)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            exit = self.exits.get(id(node))
            deps = exit[0].deps() if exit else getattr(node, "operands", ())
            stack.extend((o, False) for o, _ in reversed(deps) if id(o) not in seen)
        self.order = order


def plan(graph: Graph) -> Optional[Composites]:
    """The graph's composite patterns, or None when it has no marks (the common case)."""
    patterns: Dict[tuple, Pattern] = {}
    for n in graph.order:
        if type(n) is ir.Node and n.op == MARK:
            _, name, pos, pattern_id, is_input, attr = n.args
            p = patterns.setdefault((name, pattern_id), Pattern(name))
            (p.in_marks if is_input else p.out_marks)[pos] = n
            if attr and not is_input:
                p.attrs = attr
    if not patterns:
        return None
    closed = [p for p in patterns.values() if p.close(graph.index)]
    return Composites(graph, closed) if closed else None
