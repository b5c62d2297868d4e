"""The graph executor: pending IR -> keyed graph -> compiled program -> device buffers.

Its modules, and the order a barrier passes through them, are in docs/ARCHITECTURE.md
("Layout and layers", "Life of a training step").
"""
from __future__ import annotations

from .barrier import (execute, flush, hlo_module, inspect_checks, lower_text, lowered, materialize, on_ready, pending_graph_key, sync,
                      wait_all, walk)
from .closures import add as add_step_closure, run as run_step_closures
from .compile import cache_size, clear_cache
from .graph import Graph
from .lower import GraphCompileError, lower_node



def activate_debugging() -> None:
    """Reads the debugging variables (at import; each does nothing unless set):
    PT_XLA_DEBUG_LEVEL, the dump files, XLA_USE_EAGER_DEBUG_MODE, XLA_PERSISTENT_CACHE_PATH,
    and warns about the variables that cannot apply here."""
    import warnings
    from .. import boot, env_vars, mode
    from . import analysis, dumps, persistent
    analysis.activate()
    dumps.activate()
    if env_vars.get("XLA_USE_EAGER_DEBUG_MODE"):
        mode.set_eager(True)
    path = env_vars.get("XLA_PERSISTENT_CACHE_PATH")
    if path:
        boot.after_start.append(lambda: persistent.enabled() or persistent.initialize(boot.start_jax(), path))
    for name, why in env_vars.refused_set().items():
        warnings.warn(f"{name} is set but has no effect in torch_xla: {why}", stacklevel=3)


__all__ = ["activate_debugging", "execute", "flush", "inspect_checks", "on_ready", "sync", "materialize", "wait_all", "walk", "lowered", "lower_text", "hlo_module",
           "add_step_closure", "run_step_closures", "pending_graph_key", "cache_size", "clear_cache", "Graph",
           "GraphCompileError", "lower_node"]
