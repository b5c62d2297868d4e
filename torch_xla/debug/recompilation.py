"""`torch_xla.debug.recompilation`: why graphs compiled again, and what to do about it.

Each compile after the first at a barrier is compared with the closest graph compiled
before at the same line of user code and classified: `shape` (input shape drift), `dtype`,
`data_dependent` (nonzero, masked_select, boolean-mask indexing, unique... read their
input on the host, cutting the graph, and size what follows by its values), `host_read`
(`.item()`, `.cpu()`, print, `if t:` cut the graph), `python_value` (a Python value that
changes is compiled in as a constant), `rng` (the random ops used changed), `code_path`
(the traced code took another branch). Each comes with a one-line suggestion.

With PT_XLA_DEBUG_LEVEL>=1 this is on from the start, printed in each compilation
analysis and summarised at exit; otherwise `enable()` turns it on silently. The work is
done at compiles only (cached runs cost nothing more).
"""
from __future__ import annotations

from typing import Dict, List

from .._engine.executor import analysis
from .._engine.executor import recompilation as _rc

CAUSES: Dict[str, tuple] = _rc.CAUSES


def enable() -> None:
    """Explains the compiles from now on (no output unless PT_XLA_DEBUG_LEVEL is set)."""
    analysis.collect(True)


def disable() -> None:
    """Stops what `enable()` started (PT_XLA_DEBUG_LEVEL's analysis stays on)."""
    analysis.collect(False)


def enabled() -> bool:
    return analysis.settings.on


def explanations() -> List[dict]:
    """One dict per explained compile, oldest first: `cause` (a key of `CAUSES`), `label`,
    `suggestion`, `detail` (what changed), `graph` and `closest` (graph hashes) and `site`
    (the user's `file:line` that ran the barrier)."""
    return _rc.explanations()


def counts() -> Dict[str, int]:
    """Explained compiles per cause."""
    return _rc.counts()


def report() -> str:
    """The causes, most frequent first, each with its last occurrence and a suggestion."""
    return _rc.report()


def reset() -> None:
    """Forgets the explanations so far (graphs compiled before still count as earlier graphs)."""
    _rc.reset()
