"""`torch_xla.compile(fn, max_different_graphs=n)`: the graphs a function traced, as a trie
of their op sequences, and the error of a call that would trace one graph too many.

Each op is keyed by its node's hash (op, static arguments, output shapes and, through its
operands, the shapes of its inputs); leaves (device data, scalars, constants) are left out.
A path that ends where an earlier call ended is a graph already traced and is not counted
again. The sequence is read from the pending graph when the function returns (ops run
earlier by a host read inside the function are not part of it).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .. import ir
from . import dumps

_LEAVES = (ir.DeviceData, ir.ScalarParam, ir.Constant, ir.Placeholder)

Value = Tuple[int, str]   # (node hash, the node as the error message writes it)


def node_text(n: ir.Node) -> str:
    """`[] aten::add, xla_shape=f32[10]{0}, dynamic_dims: ()`: the op without its overload
    and the output shape with its layout (a tuple of them for several outputs)."""
    op = n.op.split(".", 1)[0]
    shapes = [_shape(a) for a in n.avals if a is not None]
    shape = shapes[0] if len(shapes) == 1 else "(" + ", ".join(shapes) + ")"
    extra = f", num_outputs={len(n.avals)}" if len(n.avals) > 1 else ""
    return f"[] {op}{extra}, xla_shape={shape}, dynamic_dims: ()"


def _shape(aval) -> str:
    dims = aval[0]
    layout = "{" + ",".join(str(i) for i in range(len(dims) - 1, -1, -1)) + "}" if dims else ""
    return f"{dumps.dtype_text(aval[1])}[{','.join(map(str, dims))}]{layout}"


class _Node:
    __slots__ = ("seq", "children", "boundary")

    def __init__(self, seq: List[Value], boundary: bool = False):
        self.seq = seq
        self.children: Dict[int, "_Node"] = {}
        self.boundary = boundary

    def split_at(self, matched: int) -> bool:
        """Keeps `seq[:matched]` here and moves the rest, with the children, into a child."""
        suffix = self.seq[matched:]
        if not suffix:
            return False
        tail = _Node(suffix, self.boundary)
        tail.children, self.children = self.children, {suffix[0][0]: tail}
        del self.seq[matched:]
        return True


class Session:
    """The graphs one compiled function traced."""
    __slots__ = ("root", "graphs")

    def __init__(self):
        self.root = _Node([])
        self.graphs = 0

    def add(self, values: List[Value], limit: int) -> bool:
        """Walks `values` into the trie; a new graph beyond `limit` raises RuntimeError
        (and leaves the trie as it was). Returns whether a new graph was recorded."""
        node, matched, allow = self.root, 0, self.graphs < limit
        if values and not allow and not self.root.boundary and not self.root.children:
            # Nothing traced yet and no graph allowed (limit 0): the first op is too many.
            raise RuntimeError(_message(limit, self.root, 0, values[0]))
        for v in values:
            if not node.children and not node.boundary:
                node.seq.append(v)         # the leaf this call is building
                matched += 1
            elif matched < len(node.seq) and node.seq[matched][0] == v[0]:
                matched += 1
            elif matched == len(node.seq) and v[0] in node.children:
                node, matched = node.children[v[0]], 1
            else:
                if not allow:
                    raise RuntimeError(_message(limit, node, matched, v))
                if node.split_at(matched):
                    node.boundary = False
                node.children[v[0]] = node = _Node([v])
                matched = 1
        if matched == 0 or (matched == len(node.seq) and node.boundary):
            return False
        if not allow:
            raise RuntimeError(_message(limit, node, matched, None))
        if matched != len(node.seq):
            node.split_at(matched)
        node.boundary = True
        self.graphs += 1
        return True


def _message(limit: int, node: _Node, matched: int, got: Optional[Value]) -> str:
    lines = [f"Maximum number of different graphs allowed per function exceeded: {limit}"]
    if got is not None:
        lines.append(f"Got: {got[1]}")
    else:
        lines.append(f"Reached the end of the function at: {node.seq[matched - 1][1]}")
    if matched < len(node.seq):
        lines.append(f"Expected: {node.seq[matched][1]}")
    else:
        lines.append("Expected either of:")
        lines += [f"  - {child.seq[0][1]}" for child in node.children.values()]
    return "\n".join(lines) + "\n"


def values_of(order: List[ir.Node]) -> List[Value]:
    """The op values of a walked graph's nodes (operands before users), leaves left out."""
    return [(n.hash, node_text(n)) for n in order if not isinstance(n, _LEAVES)]
