"""A barrier's graph: one walk over the pending IR, its parameters and its key."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from .. import ir, telemetry, pjrt

# Python scalars already on the device, by dtype and exact bytes (so -0.0 and 0.0, or 1
# and True of another dtype, stay apart): a learning rate or a constant factor is sent
# once, not at every run. Least recently used first; the size is the lazy tensor core's.
_SCALARS: "OrderedDict[tuple, object]" = OrderedDict()
SCALAR_CACHE_SIZE = 128


def _device_scalar(host: np.ndarray):
    key = (host.dtype, host.tobytes())
    a = _SCALARS.get(key)
    if a is None:
        telemetry.inc("DeviceDataCacheMiss")
        a = _SCALARS[key] = pjrt.put(host)
        if len(_SCALARS) > SCALAR_CACHE_SIZE:
            _SCALARS.popitem(last=False)
    else:
        _SCALARS.move_to_end(key)
    return a

COLLECTIVE_OPS = frozenset({"xla::all_reduce", "xla::all_gather", "xla::all_gather_coalesced",
                            "xla::reduce_scatter", "xla::all_to_all", "xla::collective_permute"})


class Graph:
    """A walked graph: program structure plus the parameters bound for this run.

    One walk (operands before users) collects everything the barrier needs: the order,
    parameter slots, and how operands bind to positions. The key is the structure hashes
    of the roots plus that binding (two graphs with equal node hashes may share a leaf
    differently: x+x vs x+y) plus the program strategy's name.
    """
    checks = None  # set by lower.build_fn: the host side of the program's index checks

    def __init__(self, roots: Sequence[tuple]):
        self.roots = list(roots)  # (node, output index) values
        order = []
        index = {}       # id(node) -> position in order
        params = []      # leaf nodes bound to parameters, in slot order
        slot = {}        # id(leaf) -> slot
        binding = []
        collective = False
        seen = set()
        device_data, scalar_param, placeholder = ir.DeviceData, ir.ScalarParam, ir.Placeholder
        stack = [(n, False) for n, _ in reversed(self.roots)]
        while stack:
            node, expanded = stack.pop()
            nid = id(node)
            if expanded:
                index[nid] = len(order)
                order.append(node)
                t = type(node)
                if t is device_data or t is scalar_param or t is placeholder:
                    slot[nid] = len(params)
                    params.append(node)
                    continue
                ops = node.operands
                if ops:
                    binding.append(tuple(index[id(o)] for o, _ in ops))
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
        self.params = params
        self.slot = slot
        self.index = index
        self.has_collective = collective
        self.binding = tuple(binding)
        self.key = None  # set by keyed()

    def keyed(self, strategy_name: str) -> "Graph":
        self.key = hash((tuple((n.hash, i) for n, i in self.roots), self.binding, len(self.order),
                         strategy_name))
        return self

    def param_values(self, on_device: bool = False) -> list:
        """The arrays bound to the parameter slots; scalar parameters as host values, or
        with `on_device` (a program of one device) as device arrays from the scalar cache."""
        out = []
        for p in self.params:
            t = type(p)
            if t is ir.DeviceData:
                out.append(p.array)
            elif t is ir.Placeholder:
                raise RuntimeError("a value computed inside a traced body (scan, while_loop, assume_pure) was "
                                   "used outside it, or read on the host while the body was traced: such values "
                                   "exist only inside the compiled loop or function")
            else:
                v = np.asarray(p.value, dtype=pjrt.device_dtype(p.avals[0][1]))
                out.append(_device_scalar(v) if on_device else v)
        return out

    def op_avals(self):
        """(op name, first output aval) of every op node, those of traced bodies (scan,
        while_loop, call_subgraph) included (for platform policies)."""
        for n in self.order:
            if n.lowering is not None and n.avals and n.avals[0] is not None:
                yield n.op, n.avals[0]
            for body in getattr(n.args[-1] if n.args else None, "bodies", ()):
                inner = getattr(body, "_graph", None)   # a traced body's graph (not jax callables)
                if inner is not None:
                    yield from inner.op_avals()
