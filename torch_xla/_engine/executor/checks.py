"""Device-side index checks: the error code a program computes, read after it ran.

A graph holding ops that index with data (gather, scatter, index, index_put,
index_select, embedding, take, nll_loss targets, ...) is compiled with one more output
when `XLA_CHECK_INDICES` is on: an int64 vector (code, value, position), where code is 0
when every index was in range and otherwise 1 + the number of the first failing check,
with the offending value and its flat position (`lowering.check_range`). The host
learns about it without stalling the device pipeline:

- a host read (`.cpu()`, `.item()`, printing) waits for its program anyway: every
  execution not yet inspected is inspected then (waiting for it);
- `xm.wait_device_ops()` and a barrier with `wait=True` inspect everything too;
- every barrier inspects, without waiting, the executions that have already finished,
  so an error surfaces at most one step after the op that caused it.

The exception is the CPU's (type and message); a note names the op and the user's
source line that created it.
"""
from __future__ import annotations

from collections import deque
from typing import List, Optional

import numpy as np

from .. import env_vars, ir

# (error array, check infos) of executions not inspected yet, oldest first.
_pending: deque = deque()
# More in flight than this: the oldest is waited for (bounded memory without reads).
_MAX_PENDING = 64


def enabled() -> bool:
    return bool(env_vars.get("XLA_CHECK_INDICES"))


def error_output(checks: list):
    """The program's error vector from the checks `check_range` recorded while tracing."""
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
    """What the host needs to raise each check's error: (exception type, message, op, source)."""
    out = []
    for *_, (exc, message, node) in checks:
        src = ir.CHECK_SOURCES.get(node, "<unknown>") if node is not None else "<unknown>"
        out.append((exc, message, node.op if node is not None else "?", src))
    return out


def watch(err, check_infos: list) -> None:
    """Remembers an execution's error vector until it is inspected."""
    _pending.append((err, check_infos))
    if len(_pending) > _MAX_PENDING:
        _inspect(_pending.popleft())


def poll(block: bool) -> None:
    """Inspects the executions not inspected yet (`block`: waiting for them; otherwise
    only those already finished, oldest first); raises the first failure found."""
    while _pending:
        err, check_infos = _pending[0]
        if not block and not _ready(err):
            return
        _pending.popleft()
        _inspect((err, check_infos))


def _ready(err) -> bool:
    try:
        return err.is_ready()
    except RuntimeError:  # jax's JaxRuntimeError: a failed buffer is finished, reading it raises
        return True


def _inspect(entry) -> None:
    err, check_infos = entry
    try:
        v = np.asarray(err.addressable_shards[0].data)
    except RuntimeError:  # jax's JaxRuntimeError: the execution failed, its outputs raise that
        return
    code = int(v[0])
    if code:
        raise error(check_infos[code - 1], int(v[1]), int(v[2]))


def error(info: tuple, value: int, pos: int) -> BaseException:
    exc, message, op, source = info
    e = exc(message.replace("{value}", str(value)).replace("{pos}", str(pos)))
    e.add_note(f"raised by {op} (created at {source}), checked on the device after the program ran; "
               f"XLA_CHECK_INDICES=0 turns the checks off")
    return e


def clear() -> None:
    _pending.clear()


def split(outs, check_infos: Optional[list]):
    """A program's outputs without its error vector (watched)."""
    if check_infos is None:
        return outs
    watch(outs[-1], check_infos)
    return outs[:-1]
