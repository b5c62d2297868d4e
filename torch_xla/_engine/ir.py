"""The lazy IR: nodes, their hashes, and the leaves that become graph parameters.

A node is one aten op (or an engine op such as a collective) applied to operand
values. An operand is a pair (node, output index). The node's hash is computed
once, at creation, from the op, its static arguments, its operands' hashes and its
output shapes, so hashing a whole graph never walks it twice.

Leaves:
- `DeviceData` holds a `jax.Array` and hashes by shape and dtype only: a step that
  runs on new data replays the same executable.
- `ScalarParam` holds a Python number that becomes a 0-d graph parameter, so a
  learning rate that changes every step does not recompile.
- `Constant` is baked into the program (the special scalars 0 and 1, small index
  tables); its value is part of the hash.
- `Placeholder` stands for an input of a traced body (`subgraph.py`): no value.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import weakref
from typing import Any, Optional, Tuple

import numpy as np

# An aval: (shape tuple, torch dtype). Kept as plain tuples: they are hashed a lot.
Aval = Tuple[Tuple[int, ...], Any]


class Ref(tuple):
    """Placeholder for the i-th operand inside a node's argument tuple.

    A tuple subclass so that hashing and comparing argument tuples stays in C.
    """
    __slots__ = ()

    def __new__(cls, i: int):
        return tuple.__new__(cls, ("%", i))

    @property
    def i(self) -> int:
        return self[1]

    def __repr__(self):
        return f"%{self[1]}"


REFS = [Ref(i) for i in range(512)]


def ref(i: int) -> Ref:
    return REFS[i] if i < 512 else Ref(i)


_entry_ids = itertools.count()


def node_base(op: str, avals: tuple, info=None) -> int:
    """The part of a node's hash that depends on neither its operands nor its args.

    Kernels call this once per shape entry (op, input avals, static args, compared by
    equality), and each call is unique: two entries never share a base, so static
    arguments whose Python hashes collide (hash(-1) == hash(-2), 2 == 2.0) still give
    different nodes and graph keys."""
    return hash((op, avals, info, next(_entry_ids)))


def node_hash(base: int, args: tuple, operands: tuple) -> int:
    """A node's hash: its base, its argument tuple, then each operand's hash and output
    index in order, in one flat tuple (the specialised kernels build the same tuple
    inline, `kernels/specialise.py`)."""
    h = [base, args]
    for n, i in operands:
        h.append(n.hash)
        h.append(i)
    return hash(tuple(h))


class Node:
    """An IR node. `args` is the op's full argument tuple with `Ref`s where operands go."""
    __slots__ = ("op", "operands", "args", "avals", "hash", "lowering", "info", "__weakref__")

    def __init__(self, op: str, operands: tuple, args: tuple, avals: tuple, lowering, info=None,
                 base: Optional[int] = None):
        self.op = op
        self.operands = operands  # tuple of (Node, int)
        self.args = args
        self.avals = avals  # tuple of Aval, one per output
        self.lowering = lowering
        self.info = info  # per-node extra data (e.g. the compute dtype), part of the hash
        # `base` is node_base(op, avals, info), which kernels cache per shape entry.
        # Without a kernel's base the args are hashed by their text too: Python's hash
        # maps -1 and -2 (and equal ints and floats) to one value.
        self.hash = node_hash(hash((op, avals, info, repr(args))) if base is None else base, args, operands)
        if lowering is not None and lowering.checked:
            CHECK_SOURCES[self] = user_line()
        if recording.on:
            record_source(self)

    @property
    def is_leaf(self) -> bool:
        return False

    def __repr__(self):
        return f"Node({self.op}, {len(self.operands)} operands)"


_new = object.__new__


def make_node(op: str, operands: tuple, args: tuple, avals: tuple, lowering, info, h: int) -> Node:
    """A `Node` whose hash `h` the caller computed (`node_hash`'s tuple, built inline by
    the specialised kernels): a plain function and slot stores, which cost less than the
    class call, once per traced op."""
    node = _new(Node)
    node.op = op
    node.operands = operands
    node.args = args
    node.avals = avals
    node.lowering = lowering
    node.info = info
    node.hash = h
    if lowering.checked:
        CHECK_SOURCES[node] = user_line()
    if recording.on:
        record_source(node)
    return node


class DeviceData(Node):
    """A leaf holding a device buffer (`jax.Array`).

    In SPMD mode (`shard_aware`) the hash includes the buffer's sharding: a program
    compiled for one layout of its inputs must not be replayed on another. SPMD data
    still on the host (`runtime.HostArray`) is sent to the devices, replicated, when a
    node first uses it (reads its hash: `upload_host_data_on_use`), as the original's
    virtual device uploads it."""
    __slots__ = ("array", "computed", "_host")
    shard_aware = False

    def __init__(self, array, aval: Aval):
        self.op = "xla::device_data"
        self.operands = ()
        self.args = ()
        self.avals = (aval,)
        self.lowering = None
        self.info = None
        self.array = array
        self.computed = False  # a program's result (SPMD: its layout is XLA's choice, shown)
        self._host = hasattr(array, "place")
        if recording.frames:
            record_debug_info(self)
        # Through Node's slot: in SPMD mode `DeviceData.hash` is a property without a setter.
        if DeviceData.shard_aware:
            _NODE_HASH.__set__(self, hash(("data", aval, array.sharding)))
        else:
            _NODE_HASH.__set__(self, hash(("data", aval)))

    @property
    def is_leaf(self) -> bool:
        return True


_NODE_HASH = Node.hash   # the slot every node keeps its hash in


def _hash_uploading_host_data(self: DeviceData) -> int:
    if self._host:
        self._host = False
        if hasattr(self.array, "place"):
            self.array = self.array.place()
    return _NODE_HASH.__get__(self)


def upload_host_data_on_use() -> None:
    """SPMD mode (the only one with host data, `runtime.HostArray`): a DeviceData's first
    hash read, its first use by a node, sends its host data to the devices. Outside SPMD
    the hash stays a plain slot read, on the path of every traced op."""
    DeviceData.hash = property(_hash_uploading_host_data)


_SCALAR_LEAF = {}   # dtype -> (avals, hash) of its ScalarParams


class ScalarParam(Node):
    """A leaf holding a Python scalar that is passed to the program as a 0-d parameter."""
    __slots__ = ("value",)

    def __init__(self, value, dtype):
        self.op = "xla::scalar"
        self.operands = ()
        self.args = ()
        self.lowering = None
        self.info = None
        self.value = value
        self.avals, self.hash = _scalar_leaf(dtype)

    @property
    def is_leaf(self) -> bool:
        return True


def _scalar_leaf(dtype):
    c = _SCALAR_LEAF.get(dtype)
    if c is None:
        c = _SCALAR_LEAF[dtype] = ((((), dtype),), hash(("scalar", dtype)))
    return c


def scalar_param(value, dtype) -> ScalarParam:
    """`ScalarParam(value, dtype)` without the class call (the specialised kernels' path)."""
    p = _new(ScalarParam)
    p.op = "xla::scalar"
    p.operands = ()
    p.args = ()
    p.lowering = None
    p.info = None
    p.value = value
    c = _SCALAR_LEAF.get(dtype) or _scalar_leaf(dtype)
    p.avals = c[0]
    p.hash = c[1]
    return p


class Constant(Node):
    """A leaf whose value is part of the program (and of the hash)."""
    __slots__ = ("value",)

    def __init__(self, value, aval: Aval):
        self.op = "xla::constant"
        self.operands = ()
        self.args = ()
        self.avals = (aval,)
        self.lowering = None
        self.info = None
        self.value = value
        if isinstance(value, np.ndarray):
            key = (value.shape, str(value.dtype), value.tobytes())
        else:
            key = (type(value), repr(value))
        self.hash = hash(("const", key, aval))

    @property
    def is_leaf(self) -> bool:
        return True


class Placeholder(Node):
    """A leaf standing for an input of a traced body (a scan step, a loop body, a pure
    function): it has an aval and no value. A graph holding one is lowered as a function
    of it (`subgraph.py`) and never run on its own."""
    __slots__ = ("position",)

    def __init__(self, aval: Aval, position: int):
        self.op = "xla::placeholder"
        self.operands = ()
        self.args = ()
        self.avals = (aval,)
        self.lowering = None
        self.info = None
        self.position = position
        self.hash = hash(("placeholder", aval, position))

    @property
    def is_leaf(self) -> bool:
        return True


# DeviceData leaves whose buffer a compiled graph may donate (`_XLAC._set_buffer_donation`).
DONORS: "weakref.WeakSet" = weakref.WeakSet()

# DeviceData leaves a captured program reads at every application (its captured values):
# no tensor holds them, yet a barrier must never donate them.
KEPT: "weakref.WeakSet" = weakref.WeakSet()

# DeviceData leaf -> the dimensions `_XLAC._xla_mark_dynamic` declared unbounded: the
# StableHLO text of a graph reading it has those sizes as `?` (executing uses the data's
# own sizes).
DYNAMIC_DIMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


# The dimensions of node outputs that hold a bounded (padded) value whose real size is a
# device value (kernels/bounded.py): {node: {output index: dims}}; dumps print them `<=N`.
BOUNDED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def mark_bounded(node: Node, idx: int, dims: tuple) -> None:
    BOUNDED.setdefault(node, {})[idx] = dims


# ---- source lines (XLA_HLO_DEBUG) -------------------------------------------------------

# Nodes of ops whose programs check their values on the device (indices, integer
# divisors) -> the user's line that created them: the error raised after a program ran
# names the line of that run's node, whichever trace compiled the program.
CHECK_SOURCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_SKIPPED = []


def _user_frame():
    """The innermost frame outside torch_xla, torch, the generated kernels and FX graphs, or None."""
    if not _SKIPPED:
        import torch
        _SKIPPED.extend([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         os.path.dirname(os.path.abspath(torch.__file__)), "<kernel ",
                         "<eval_with_key>"])   # FX graphs' generated code (a scan body's AOT graphs)
    skipped = tuple(_SKIPPED)
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(skipped):
        f = f.f_back
    return f


def user_site() -> Tuple[str, int, str]:
    """(file, line, module name) of the innermost frame outside torch_xla, torch and
    generated kernels: where a warning about the user's code points."""
    f = _user_frame()
    if f is None:
        return "<unknown>", 0, "torch_xla"
    return f.f_code.co_filename, f.f_lineno, f.f_globals.get("__name__", "__main__")


def user_line() -> str:
    """`file:line` of the innermost frame outside torch_xla, torch and generated kernels."""
    f = _user_frame()
    return "<unknown>" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


SOURCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # node -> "file.py:line"


class _Recording:
    """Whether new nodes record their source line in `SOURCES` (XLA_IR_DEBUG, the debug
    analysis, `_XLAC._set_ir_debug`). Written by `record_sources` in the thread that asks,
    without a lock (a node made meanwhile in another thread may or may not record); read
    at every node's creation by any tracing thread (the specialised kernels hold it as
    `RECORDING`)."""
    __slots__ = ("on", "frames")

    def __init__(self):
        self.on = False
        # XLA_IR_DEBUG / XLA_HLO_DEBUG: nodes (device data too) also keep their creation's
        # profiler scope and Python frames in `DEBUG_INFO` (`_xla_tensors_report`).
        self.frames = False


recording = _Recording()
DEBUG_INFO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # node -> (scope, frames)


def record_sources(on: bool = True) -> None:
    """From now on every new node remembers the first Python frame outside torch_xla and
    torch that created it (only when asked: node constructors test `recording.on`);
    `on=False` stops."""
    recording.on = on


def record_source(node: Node) -> None:
    """Remembers the user's line that created `node` (while `recording.on`)."""
    f = _user_frame()
    if f is not None:
        SOURCES[node] = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"
    if recording.frames:
        record_debug_info(node, f)


def record_debug_info(node: Node, f=None) -> None:
    """The open profiler scope and the user's frames (innermost first) creating `node`."""
    if f is None:
        f = _user_frame()
    frames = []
    while f is not None and len(frames) < 32:
        frames.append((f.f_code.co_name, f.f_code.co_filename, f.f_lineno))
        f = f.f_back
    DEBUG_INFO[node] = (current_scope(), tuple(frames))


# ---- IR scopes: the names of the open profiler `Trace` regions -------------------------
# Named as PyTorch/XLA names them: "name.N", N counting the siblings at that depth, nested
# scopes joined by "/". A barrier that resets the scopes refuses to run inside one: the
# graph it cuts would belong to a region that has not ended.
_scopes = threading.local()


def _scope_state():
    st = _scopes.__dict__
    if "stack" not in st:
        st["stack"], st["next"] = [], 1
    return st


def push_scope(name: str) -> None:
    st = _scope_state()
    st["stack"].append((f"{name}.{st['next']}", st["next"] + 1))
    st["next"] = 1


def pop_scope() -> None:
    st = _scope_state()
    if st["stack"]:
        st["next"] = st["stack"].pop()[1]


def current_scope() -> str:
    return "/".join(s for s, _ in _scope_state()["stack"])


def reset_scopes() -> None:
    """At a barrier: no scope may be open."""
    st = _scope_state()
    if st["stack"]:
        raise RuntimeError(f"Expecting scope to be empty but it is {current_scope()}")
    st["next"] = 1
