"""Donation: which parameter buffers a program may overwrite with its outputs.

At a full barrier every live tensor with pending IR is a root of the graph, so after the
run a device buffer is read again only if a live tensor state holds its DeviceData leaf
(`tensor.data_states`: every state that has pointed at device data) or the leaf is itself
a result. Any other parameter buffer is dead once the program has read it: it is donated
to an output of the same shape and dtype, so a step does not hold two copies of the
model. Partial syncs (host reads) never donate: IR outside their graph may still read
the buffers.
"""
from __future__ import annotations

from .. import env_vars, ir, telemetry
from ..tensor import data_states, state_of
from .graph import Graph


def set_donor(tensor, should_donate: bool) -> bool:
    """Marks (or unmarks) the device buffer of `tensor` as one a compiled graph may donate.
    False, and nothing done, when `tensor` holds no device data (pending IR)."""
    s = state_of(tensor)
    if type(s.node) is not ir.DeviceData:
        return False
    if should_donate:
        ir.DONORS.add(s.node)
    else:
        ir.DONORS.discard(s.node)
    telemetry.inc("XlaSetBufferDonation")
    return True


def held_data() -> set:
    """ids of the DeviceData leaves that live tensor states point at now."""
    device_data = ir.DeviceData
    # A copy of the weak references in one C call: another thread (a data loader's, a
    # ready-waiter's) may add states while we look, which iterating the WeakSet refuses.
    held = set()
    for ref in data_states.data.copy():
        s = ref()
        if s is not None and type(s.node) is device_data:
            held.add(id(s.node))
    return held


def donatable(graph: Graph) -> tuple:
    """Parameter slots whose buffers no live tensor will read after this run, matched to
    outputs of the same aval (XLA reuses a donated buffer only for such an output)."""
    if env_vars.get("XLA_NO_DONATION"):
        return ()
    held = held_data()
    root_ids = {id(n) for n, _ in graph.roots}
    candidates = [s for s, p in enumerate(graph.params)
                  if type(p) is ir.DeviceData and id(p) not in held and id(p) not in root_ids]
    if not candidates:
        return ()
    free = {}
    for n, i in graph.roots:
        a = n.avals[i]
        free[a] = free.get(a, 0) + 1
    usable = []
    for s in candidates:
        a = graph.params[s].avals[0]
        if free.get(a, 0) > 0:
            free[a] -= 1
            usable.append(s)
    return tuple(usable)
