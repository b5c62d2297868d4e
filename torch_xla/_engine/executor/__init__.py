"""The graph executor: pending IR -> keyed graph -> compiled program -> device buffers.

- `graph.py`: one walk over a barrier's IR (order, parameters, key);
- `lower.py`: the graph as a jax function, one `lowering.apply` per node;
- `strategies.py`: how a graph becomes a program (`Local`, `Replicated`);
- `donation.py`: which parameter buffers a program may overwrite;
- `compile.py`, `persistent.py`: compiling, the in-memory and on-disk caches;
- `barrier.py`: execute / sync / materialize; `closures.py`: step closures;
- `checks.py`: the device-side index checks, inspected after the programs ran.
"""
from __future__ import annotations

from .barrier import (execute, hlo_module, inspect_checks, lower_text, lowered, materialize, on_ready, pending_graph_key, sync,
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
    from .. import boot, config, mode
    from . import analysis, dumps, persistent
    analysis.activate()
    dumps.activate()
    if config.get("XLA_USE_EAGER_DEBUG_MODE"):
        mode.set_eager(True)
    path = config.get("XLA_PERSISTENT_CACHE_PATH")
    if path:
        boot.after_start.append(lambda: persistent.enabled() or persistent.initialize(boot.start_jax(), path))
    for name, why in config.refused_set().items():
        warnings.warn(f"{name} is set but has no effect in torch_xla: {why}", stacklevel=3)


__all__ = ["activate_debugging", "execute", "inspect_checks", "on_ready", "sync", "materialize", "wait_all", "walk", "lowered", "lower_text", "hlo_module",
           "add_step_closure", "run_step_closures", "pending_graph_key", "cache_size", "clear_cache", "Graph",
           "GraphCompileError", "lower_node"]
