"""On-device random numbers.

The seed is a graph parameter and every random op of a step takes its key from
(seed, op number within the step), so each step's graph has the same hash while
its numbers differ: the seed advances at every barrier.
"""
from __future__ import annotations

import collections
import itertools
import threading

_MASK = (1 << 63) - 1
_lock = threading.Lock()


class _Generator:
    """The step's seed, `counter` (the op numbers still to hand out: an `itertools.count`,
    whose `next` is atomic under the GIL) and `node` (the seed's graph leaf, made at the
    step's first random op). Replaced under `_lock` (seeding, snapshots, the barrier's
    advance); the tracing threads read them and make `node` without it, per random op."""
    __slots__ = ("seed", "counter", "node")

    def __init__(self):
        self.seed = 101
        self.counter = itertools.count()
        self.node = None


_gen = _Generator()


# Positions handed out by `state()` (token -> (seed, op number)), newest last: a token
# given back to `set_seed` returns to its position; any other integer is a new seed.
_positions: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()
_MAX_POSITIONS = 256


def set_seed(seed: int) -> None:
    with _lock:
        pos = _positions.get(int(seed))
        s, n = pos if pos is not None else (int(seed) & _MASK, 0)
        _gen.seed = s
        _gen.counter = itertools.count(n)
        _gen.node = None


def state() -> int:
    """The generator's position as one integer, for `set_seed` to return to; reading it
    changes nothing. At the start of a step that is the seed itself; after random ops drew
    from it, a token standing for (seed, op number) that `set_seed` recognises."""
    with _lock:
        n = next(_gen.counter)
        _gen.counter = itertools.count(n)
        seed = _gen.seed
        if n == 0:
            return seed
        token = ((seed * 0x9E3779B97F4A7C15) ^ (n * 0xBF58476D1CE4E5B9)) & _MASK
        _positions[token] = (seed, n)
        _positions.move_to_end(token)
        while len(_positions) > _MAX_POSITIONS:
            _positions.popitem(last=False)
        return token


def next_op() -> tuple:
    """(seed, op number) for the next random op of this step."""
    return _gen.seed, next(_gen.counter)


def snapshot() -> tuple:
    """The generator's position: the next random op draws what it would draw now."""
    with _lock:
        n = next(_gen.counter)
        _gen.counter = itertools.count(n)
        return _gen.seed, n, _gen.node


def restore(snap: tuple) -> None:
    """Returns the generator to a `snapshot()` (e.g. to replay a checkpointed forward)."""
    with _lock:
        _gen.seed, n, _gen.node = snap
        _gen.counter = itertools.count(n)


def advance_step() -> None:
    """Called at each barrier: a new seed for the next step, op numbers from zero."""
    with _lock:
        _advance()


def _advance() -> None:
    _gen.seed = (_gen.seed * 6364136223846793005 + 1442695040888963407) & _MASK
    _gen.counter = itertools.count()
    _gen.node = None


def seed_node():
    """The step's seed as a graph parameter (one leaf shared by the step's random ops)."""
    n = _gen.node
    if n is None:
        import torch
        from . import ir
        n = ir.ScalarParam(_gen.seed & 0xFFFFFFFF, torch.int64)
        _gen.node = n
    return n


def current_seed_node():
    """The seed leaf random ops of this step read (None before the step's first one)."""
    return _gen.node


def fresh_seed() -> int:
    """A seed no traced op of this step or the next uses (for a captured program's run)."""
    advance_step()
    s = _gen.seed & 0xFFFFFFFF
    advance_step()
    return s


class local_seed:
    """Inside the block random ops draw from `node` (a traced body's seed placeholder),
    op numbers from zero; the step's generator is untouched afterwards. `None`: no change."""
    __slots__ = ("node", "saved")

    def __init__(self, node):
        self.node = node

    def __enter__(self):
        if self.node is not None:
            with _lock:
                self.saved = (_gen.seed, _gen.counter, _gen.node)
                _gen.counter = itertools.count()
                _gen.node = self.node
        return self

    def __exit__(self, *exc):
        if self.node is not None:
            with _lock:
                _gen.seed, _gen.counter, _gen.node = self.saved
        return False
