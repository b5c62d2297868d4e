"""Device-side checks: the error code a program computes, read after it ran.

A graph holding ops that index with data (gather, scatter, index, index_put,
index_select, embedding, take, nll_loss targets, ...) or divide integers (div with a
rounding mode, floor_divide, remainder, fmod) is compiled with one more output when
`XLA_CHECK_INDICES` is on: an int64 vector (code, value, position), where code is 0
when every check passed and otherwise 1 + the number of the first failing check, with
the offending value and its flat position (`lowering.check_range`,
`lowering.check_nonzero`). The host learns about it without stalling the device
pipeline:

- a host read (`.cpu()`, `.item()`, printing) waits for its program anyway: every
  execution not yet inspected is inspected then (waiting for it);
- `xm.wait_device_ops()` and a barrier with `wait=True` inspect everything too;
- every barrier inspects, without waiting, the executions that have already finished,
  so an error surfaces at most one step after the op that caused it;
- at exit (patch `device_checks_at_exit`) the executions never inspected are: an error
  of the last step is printed to stderr and the process exits with status 1.

The exception is the CPU's (type and message); a note names the op and the user's
source line that created it in the run that failed (`ir.CHECK_SOURCES` of that run's
node: a cached program is traced once, but each step's nodes are its own).
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
import weakref
from collections import deque
from typing import List, Optional

import numpy as np

from .. import env_vars, ir, patches

# (error array, check infos, sources) of executions not inspected yet, oldest first;
# sources: the creating line of each check's node in that run.
_pending: deque = deque()
# More in flight than this: the oldest is waited for (bounded memory without reads).
_MAX_PENDING = 64


def enabled() -> bool:
    return bool(env_vars.get("XLA_CHECK_INDICES"))


class CheckInfo(tuple):
    """What the host needs to raise one check's error: (exception type, message, op,
    source line of the traced node). `node` weakly refers to the traced node until `at`,
    the node's position in the graph walk (-1: not found), is known: graphs of one key
    are walked in the same order, so `at` names the matching node of any later run."""

    def __new__(cls, exc: type, message: str, op: str, source: str, node=None):
        self = super().__new__(cls, (exc, message, op, source))
        self.node = None if node is None else weakref.ref(node)
        self.at = None
        return self


def error_output(checks: list):
    """The program's error vector from the checks `check_range` / `check_nonzero`
    recorded while tracing."""
    import jax.numpy as jnp
    if not checks:
        return jnp.zeros((3,), jnp.int64)
    if len(checks) == 1:
        flag, value, pos, _ = checks[0]
        return jnp.stack([flag.astype(jnp.int64), value.astype(jnp.int64), pos.astype(jnp.int64)])
    flags = jnp.stack([c[0] for c in checks])
    first = jnp.argmax(flags)
    values = jnp.stack([c[1].astype(jnp.int64) for c in checks])
    positions = jnp.stack([c[2].astype(jnp.int64) for c in checks])
    code = jnp.where(jnp.any(flags), first + 1, 0).astype(jnp.int64)
    return jnp.stack([code, values[first], positions[first]])


def infos(checks: list) -> List[tuple]:
    """The host side (`CheckInfo`) of each check recorded while tracing."""
    out = []
    for *_, (exc, message, node) in checks:
        if node is None:
            out.append(CheckInfo(exc, message, "?", "<unknown>"))
        else:
            out.append(CheckInfo(exc, message, node.op, ir.CHECK_SOURCES.get(node, "<unknown>"), node))
    return out


def _resolve(info, graph) -> int:
    """The position in `graph`'s walk of the node that recorded `info`'s check, or -1.
    Without the traced node (an executable from the persistent cache) an op that occurs
    once in the graph is its own answer."""
    ref = getattr(info, "node", None)
    node = None if ref is None else ref()
    if node is not None:
        at = graph.index.get(id(node))
        if at is not None and graph.order[at] is node:
            return at
    found = -1
    for k, n in enumerate(graph.order):
        if n.op == info[2] and n.lowering is not None and n.lowering.checked:
            if found >= 0:
                return -1
            found = k
    return found


def _sources(check_infos: list, graph) -> list:
    """The creating line of each check's node in this run of the program."""
    order = graph.order
    get = ir.CHECK_SOURCES.get
    out = []
    for k, info in enumerate(check_infos):
        at = getattr(info, "at", None)
        if at is None:
            at = _resolve(info, graph)
            if type(info) is not CheckInfo:   # a stored executable's plain tuple
                info = check_infos[k] = CheckInfo(*info[:4])
            info.at, info.node = at, None
        src = None
        if 0 <= at < len(order):
            n = order[at]
            if n.op == info[2]:
                src = get(n)
        out.append(src or info[3])
    return out


def watch(err, check_infos: list, sources: Optional[list] = None) -> None:
    """Remembers an execution's error vector until it is inspected."""
    if not _exit_hook.registered:
        patches.install("device_checks_at_exit")
    elif _exit_hook.count != _callbacks():
        _exit_hook.keep_last()
    _pending.append((err, check_infos, sources))
    if len(_pending) > _MAX_PENDING:
        _inspect(_pending.popleft())


def poll(block: bool) -> None:
    """Inspects the executions not inspected yet (`block`: waiting for them; otherwise
    only those already finished, oldest first); raises the first failure found."""
    while _pending:
        entry = _pending[0]
        if not block and not _ready(entry[0]):
            return
        _pending.popleft()
        _inspect(entry)


def _ready(err) -> bool:
    try:
        return err.is_ready()
    except RuntimeError:  # jax's JaxRuntimeError: a failed buffer is finished, reading it raises
        return True


def _inspect(entry) -> None:
    e = _failure(entry)
    if e is not None:
        raise e


def _failure(entry) -> Optional[BaseException]:
    """The error of a finished execution's failed check, or None."""
    err, check_infos, sources = entry
    try:
        v = np.asarray(err.addressable_shards[0].data)
    except RuntimeError:  # jax's JaxRuntimeError: the execution failed, its outputs raise that
        return None
    code = int(v[0])
    if not code:
        return None
    info = check_infos[code - 1]
    if sources is not None:
        info = (*info[:3], sources[code - 1])
    return error(info, int(v[1]), int(v[2]))


def error(info: tuple, value: int, pos: int) -> BaseException:
    exc, message, op, source = info[:4]
    e = exc(message.replace("{value}", str(value)).replace("{pos}", str(pos)))
    e.add_note(f"raised by {op} (created at {source}), checked on the device after the program ran; "
               f"XLA_CHECK_INDICES=0 turns the checks off")
    return e


def clear() -> None:
    _pending.clear()


def split(outs, check_infos: Optional[list], graph=None):
    """A program's outputs without its error vector (watched, with the creating lines of
    `graph`'s checked nodes: the run's own)."""
    if check_infos is None:
        return outs
    if check_infos:   # a graph whose checked ops checked nothing (float division) has none
        watch(outs[-1], check_infos, None if graph is None else _sources(check_infos, graph))
    return outs[:-1]


# ---- at exit ------------------------------------------------------------------------------

def _callbacks() -> int:
    n = getattr(atexit, "_ncallbacks", None)
    return -1 if n is None else n()


class _ExitHook:
    """The exit hook's registration. It must run before jax's own exit handlers (which
    tear the runtime down) and, after an error, run the others once itself before
    leaving with status 1: it is kept the most recently registered handler (CPython runs
    them last registered first), registered again at a watch when one came after it."""
    __slots__ = ("registered", "count")

    def __init__(self):
        self.registered = False
        self.count = -1

    def register(self) -> None:
        atexit.register(_at_exit)
        self.registered = True
        self.count = _callbacks()

    def keep_last(self) -> None:
        atexit.unregister(_at_exit)
        self.register()


_exit_hook = _ExitHook()


def install_exit_hook() -> bool:
    """Patch `device_checks_at_exit`."""
    if not enabled():
        return False
    _exit_hook.register()
    return True


def _at_exit() -> None:
    if not _pending:
        return
    # A program that never finishes (its peers gone) must not hang the exit.
    deadline = time.monotonic() + env_vars.get("XLA_COLLECTIVE_TIMEOUT_S")
    while _pending:
        entry = _pending[0]
        while not _ready(entry[0]):
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)
        _pending.popleft()
        e = _failure(entry)
        if e is not None:
            _fail(e)


def _fail(e: BaseException) -> None:
    """Reports the error of an execution inspected at exit; the process then exits with
    status 1 once the other exit handlers have run. An exit handler cannot change the
    status the interpreter returns: the process ends here, its open files flushed first
    (the interpreter's own teardown, which would close them, is skipped)."""
    try:
        sys.stderr.write("torch_xla: a device-side check of the last program failed (found at exit):\n")
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        sys.stderr.flush()
    except (OSError, ValueError):   # stderr closed
        pass
    _pending.clear()
    atexit.unregister(_at_exit)
    run_others = getattr(atexit, "_run_exitfuncs", None)
    if run_others is not None:
        run_others()
    _flush_open_files()
    os._exit(1)


def _flush_open_files() -> None:
    import gc
    import io
    gc.unfreeze()   # files opened before `gc.freeze()` are not listed otherwise
    kinds = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    # type(), not isinstance(): some objects' `__class__` is a property that warns
    files = [o for o in gc.get_objects() if issubclass(type(o), kinds)]
    for f in files + [sys.stdout, sys.stderr]:
        try:
            if not f.closed:
                f.flush()
        except Exception:  # noqa: BLE001  (a file that cannot be flushed is left as it is)
            pass
