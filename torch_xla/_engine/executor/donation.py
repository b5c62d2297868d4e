"""Donation: which parameter buffers a program may overwrite with its outputs.

At a full barrier every live tensor with pending IR is a root of the graph, so after the
run a device buffer is read again only if a live tensor state holds its DeviceData leaf
(`tensor.data_states`: every state that has pointed at device data) or the leaf is itself
a result. Any other parameter buffer is dead once the program has read it: it is donated
to an output of the same shape and dtype, so a step does not hold two copies of the
model. Partial syncs (host reads) never donate these: IR outside their graph may still
read the buffers.

A buffer that only aliases of a tensor still hold (clones, detached copies: states that
share the leaf of a tensor since overwritten in place) is donated too: the program also
outputs it once, XLA writes that output to a fresh buffer, and the aliases move to it
(`copy_out`, `rebind`). The leaves made so are not copied again at later barriers (their
aliases own them), so a value read at every step is copied at most once.

Buffers the user marked as donors (`set_donor`, `_XLAC._set_buffer_donation`) are donated
at a full barrier even when a live tensor still holds them (the user's promise that it
will not be read again: a later read raises, the buffer is deleted), and by any execution
once `config.alias` is on (`_XLAC._xla_set_enable_alias_with_buffer_donor_config`).
"""
from __future__ import annotations

import weakref

from .. import env_vars, ir, telemetry
from ..tensor import XlaState, data_states, state_of
from .graph import Graph

# DeviceData leaves `rebind` gave to aliases: owned by them, never copied out again.
_REBOUND: "weakref.WeakSet" = weakref.WeakSet()


class _Config:
    """`alias`: executions other than a full barrier (partial syncs, host reads) donate
    the buffers marked as donors too. One setting for the process."""
    __slots__ = ("alias",)

    def __init__(self):
        self.alias = False


config = _Config()


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


def held_data() -> tuple:
    """ids of the DeviceData leaves that live tensor states point at now: (those some
    tensor's own state holds, those only aliases' states hold)."""
    device_data, alias = ir.DeviceData, XlaState
    # A copy of the weak references in one C call: another thread (a data loader's, a
    # ready-waiter's) may add states while we look, which iterating the WeakSet refuses.
    owned = set()
    aliased = set()
    for ref in data_states.data.copy():
        s = ref()
        if s is not None and type(s.node) is device_data:
            if type(s) is alias:
                aliased.add(id(s.node))
            else:
                owned.add(id(s.node))
    return owned, aliased - owned


def donatable(graph: Graph, barrier: bool = True) -> tuple:
    """Parameter slots whose buffers may be donated by this run, matched to outputs of
    the same aval (XLA reuses a donated buffer only for such an output): at a full
    `barrier`, those no live tensor will read after the run; and the marked donors.

    At a full barrier, buffers only aliases hold are donated after the others when
    outputs are left to take them: they are then also outputs of the program (appended
    to `graph.roots`, the key changed with them; `copied` returns their slots)."""
    graph.copied = ()
    users = len(ir.DONORS) > 0 and (barrier or config.alias)
    if not (barrier or users) or env_vars.get("XLA_NO_DONATION"):
        return ()
    root_ids = {id(n) for n, _ in graph.roots}
    params = graph.params
    chosen = set()
    shared = ()
    if barrier:
        owned, aliased = held_data()
        device_data = ir.DeviceData
        kept = ir.KEPT
        chosen.update(s for s, p in enumerate(params)
                      if type(p) is device_data and id(p) not in owned and id(p) not in aliased
                      and id(p) not in root_ids and p not in kept)
        if aliased:
            shared = [s for s, p in enumerate(params)
                      if type(p) is device_data and id(p) in aliased and id(p) not in root_ids]
    if users:
        chosen.update(_marked(params, root_ids))
    if not chosen and not shared:
        return ()
    free = {}
    for n, i in graph.roots:
        a = n.avals[i]
        free[a] = free.get(a, 0) + 1
    usable = []
    for s in sorted(chosen):
        a = params[s].avals[0]
        if free.get(a, 0) > 0:
            free[a] -= 1
            usable.append(s)
    copied = []
    for s in shared:
        p = params[s]
        a = p.avals[0]
        if s not in chosen and free.get(a, 0) > 0 and p not in _REBOUND and _has_buffer(p.array):
            free[a] -= 1
            copied.append(s)
    if copied:
        _copy_out(graph, tuple(copied))
        usable = sorted(usable + copied)
    return tuple(usable)


def _copy_out(graph: Graph, slots: tuple) -> None:
    """Makes the parameters at `slots` outputs of the program too, after the others (jax
    gives donated buffers to the first outputs of their aval, so these get new ones)."""
    graph.copied = slots
    graph.roots.extend((graph.params[s], 0) for s in slots)
    graph.key = hash((graph.key, "copied", slots))


def copied(graph: Graph) -> list:
    """The leaves `donatable` made outputs, in output order (after the graph's own)."""
    return [graph.params[s] for s in graph.copied]


def rebind(leaves: list, arrays) -> None:
    """Moves every state holding one of `leaves` to a new leaf of the matching array (a
    fresh buffer holding the same value: the old one was donated)."""
    device_data = ir.DeviceData
    new = {}
    for leaf, arr in zip(leaves, arrays):
        d = device_data(arr, leaf.avals[0])
        d.computed = True
        _REBOUND.add(d)
        new[id(leaf)] = d
    for ref in data_states.data.copy():
        s = ref()
        if s is not None:
            d = new.get(id(s.node))
            if d is not None:
                s.set_data(d)


def _marked(params, root_ids) -> list:
    """Slots of the marked donors that can be donated: a buffer still there, and not
    passed in another slot too (one array given twice cannot be donated once)."""
    device_data = ir.DeviceData
    arrays = {}
    for p in params:
        if type(p) is device_data:
            arrays[id(p.array)] = arrays.get(id(p.array), 0) + 1
    out = []
    for s, p in enumerate(params):
        if type(p) is device_data and p in ir.DONORS and id(p) not in root_ids \
                and arrays[id(p.array)] == 1 and _has_buffer(p.array):
            out.append(s)
    return out


def _has_buffer(array) -> bool:
    is_deleted = getattr(array, "is_deleted", None)
    return is_deleted is not None and not is_deleted()


def honours(donated: tuple, graph: Graph, donate: tuple) -> bool:
    """Whether a program donating `donated` serves a run that may donate `donate`: it
    must donate every marked donor among them (a compiled program donating a subset
    serves the other buffers, which the executor donates on its own account)."""
    if not ir.DONORS or donated == donate:
        return True
    params = graph.params
    return all(s in donated for s in donate if params[s] in ir.DONORS)
