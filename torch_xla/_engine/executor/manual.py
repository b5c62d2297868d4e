"""Manual sharding regions: the part of a graph written per device, lowered as `shard_map`.

A region starts at `xla::full_to_shard` (each device takes its piece of an annotated
value) or `xla::manual` (a value declared per-device) and ends at `xla::shard_to_full`
(the pieces form a global value). The nodes in between have per-device shapes; they
are not lowered in the global program but inside one `shard_map` per exit, whose inputs
are the entries' global values (split as annotated) and any other value the region
reads (replicated).
"""
from __future__ import annotations

from typing import Dict, Optional

from .. import ir, pjrt, partitioning
from .graph import Graph

ENTRIES = ("xla::full_to_shard", "xla::manual")
EXIT = "xla::shard_to_full"


class ManualRegionError(RuntimeError):
    pass


class Region:
    """The per-device subgraph that ends at exit node `exit`."""

    def __init__(self, exit: ir.Node, index: Dict[int, int], manual: Dict[int, bool]):
        from jax.sharding import PartitionSpec as P
        self.exit = exit
        self.src = exit.operands[0]
        self.inputs = []       # (node, idx) global values entering the region
        self.in_specs = []
        self.entry_arg = {}    # id(entry node) -> input position
        self.outside_arg = {}  # (id(node), idx) -> input position
        meshes = []
        inside = []
        seen = set()
        stack = [self.src[0]]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op in ENTRIES and not (node.op == "xla::manual" and manual.get(id(node.operands[0][0]))):
                o, i = node.operands[0]
                self.entry_arg[id(node)] = len(self.inputs)
                self.inputs.append((o, i))
                if node.op == "xla::full_to_shard":
                    sh = node.args[1]
                    meshes.append(sh.mesh)
                    self.in_specs.append(sh.spec)
                else:
                    self.in_specs.append(P())
                continue
            inside.append(node)
            for o, i in node.operands:
                if manual.get(id(o)):
                    stack.append(o)
                elif (id(o), i) not in self.outside_arg:
                    self.outside_arg[(id(o), i)] = len(self.inputs)
                    self.inputs.append((o, i))
                    self.in_specs.append(P())
        self.inside = sorted(inside, key=lambda n: index[id(n)])
        out_sh = exit.args[1]
        if hasattr(out_sh, "mesh") and not partitioning.is_replicated(out_sh):
            meshes.insert(0, out_sh.mesh)
            self.out_spec = out_sh.spec
        else:
            self.out_spec = P()
        if meshes and any(m != meshes[0] for m in meshes):
            raise ManualRegionError("a manual sharding region mixes meshes; use one mesh from "
                                    "enable_manual_sharding to disable_manual_sharding")
        self.mesh = meshes[0] if meshes else partitioning.jax_mesh(
            range(len(partitioning.global_devices())), (len(partitioning.global_devices()),), ("_devices",))

    def lower(self, values: list, lower_node):
        """The exit's global value from the region's global input values."""
        jax = pjrt.jax_module()
        entry_arg, outside_arg, inside, (src, si) = self.entry_arg, self.outside_arg, self.inside, self.src

        def body(*xs):
            local = {nid: (xs[k],) for nid, k in entry_arg.items()}
            for node in inside:
                ops = [local[id(o)][i] if id(o) in local else xs[outside_arg[(id(o), i)]]
                       for o, i in node.operands]
                # A value marked manual inside its region is already per-device.
                local[id(node)] = (ops[0],) if node.op == "xla::manual" else lower_node(node, ops)
            return local[id(src)][si]
        return jax.shard_map(body, mesh=self.mesh, in_specs=tuple(self.in_specs), out_specs=self.out_spec,
                             check_vma=False)(*values)


class Regions:
    """The manual regions of a graph: which nodes are per-device (not lowered globally)
    and the region of each exit."""

    def __init__(self, graph: Graph, manual: Dict[int, bool]):
        self.skip = {nid for nid, m in manual.items() if m}
        self.exits = {id(n): Region(n, graph.index, manual) for n in graph.order
                      if type(n) is ir.Node and n.op == EXIT}
        for n, _ in graph.roots:
            if id(n) in self.skip:
                raise ManualRegionError(
                    "a per-device value (inside a manual sharding region) is read outside the region: "
                    "leave it through disable_manual_sharding / _spmd_shard_to_full_shape first")


def per_device_roots(graph: Graph) -> set:
    """The roots of `graph` that are per-device values (inside an unfinished region)."""
    manual = _flags(graph)[0]
    return {(id(n), i) for n, i in graph.roots if manual.get(id(n))}


def plan(graph: Graph) -> Optional[Regions]:
    """The graph's manual regions, or None when it has none (the common case)."""
    manual, found = _flags(graph)
    return Regions(graph, manual) if found else None


def _flags(graph: Graph):
    manual: Dict[int, bool] = {}
    found = False
    for n in graph.order:
        if type(n) is not ir.Node:
            continue
        if n.op in ENTRIES:
            manual[id(n)] = found = True
        elif n.op == EXIT:
            manual[id(n)] = False
        elif n.operands:
            manual[id(n)] = any(manual.get(id(o), False) for o, _ in n.operands)
    return manual, found
