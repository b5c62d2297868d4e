"""Compiling a graph, and the caches of compiled programs (in memory, and on disk)."""
from __future__ import annotations

import functools
import time
from typing import Dict, List, Optional

import torch

from .. import env_vars, telemetry, pjrt
from ..platform import policy
from ..platform.base import NO_PRODUCTS
from . import persistent, tiers
from .graph import Graph
from .lower import build_fn

_cache: Dict[int, List["Executable"]] = {}


class Executable:
    __slots__ = ("compiled", "donated", "paced", "checks", "upgrade", "runs")

    def __init__(self, compiled, donated: tuple, paced: int, checks: Optional[list] = None, upgrade=None):
        self.compiled = compiled
        self.donated = donated
        # The host side of the program's index checks (its last output is their error
        # vector, `checks.py`), or None when it has none.
        self.checks = checks
        # The bytes its dispatches wait for (the platform's host-memory pacing), or 0.
        self.paced = paced
        # While `compiled` is the quick tier: the optimized compile (a function to queue,
        # then its tiers.Pending).
        self.upgrade = upgrade
        self.runs = 0

    def settle(self) -> None:
        """Before each run while `upgrade` is set (tiers.py): the second run queues the
        optimized compile, the third switches to it (waiting if it is not ready)."""
        self.runs += 1
        if self.runs == 2:
            self.upgrade = tiers.submit(self.upgrade)
            return
        if self.runs < 3:
            return
        pending, self.upgrade = self.upgrade, None
        try:
            full = pending.wait()
        except Exception as e:  # noqa: BLE001  (any compile error: the quick executable computes the same program)
            import warnings
            telemetry.inc("TieredCompileFailed")
            first_line = (str(e).strip().splitlines() or [""])[0]
            warnings.warn(f"torch_xla: the optimized compile of a tiered program failed, the quick one stays "
                          f"in use: {type(e).__name__}: {first_line}")
            return
        self.compiled = full
        self.paced = platform_policy().paced_bytes(full)
        telemetry.inc("TieredCompileSwitch")


def platform_policy():
    return policy(pjrt.platform())


def compile_graph(graph: Graph, strategy, args, donate: tuple, metric: str = "CompileTime") -> Executable:
    """Lowers and compiles `graph` (or loads it from the persistent cache); `metric` times
    the compilation (`EagerOpCompileTime` for an op run by eager mode)."""
    jax = pjrt.jax_module()
    if graph.has_collective:
        _check_replica_groups(graph)
    pol = platform_policy()
    # before a cached program that calls the platform's handler is loaded
    library_products = (pol.library_products() if strategy.library_products and not graph.has_collective
                        else NO_PRODUCTS)
    pkey = None
    if persistent.enabled() and strategy.persistable:
        # the products' lowering is part of the program: a cached one calls the handler or not
        pkey = persistent.key(graph, (tuple(donate), library_products))
        if pkey is not None:
            hit = persistent.load(pkey)
            if hit is not None:
                return Executable(hit[0], donate, pol.paced_bytes(hit[0]), hit[1])
    fn = strategy.wrap(build_fn(graph, pol.patch_convolutions, checks=True, widen_int4_dots=pol.widen_int4_dots,
                                library_products=library_products), graph)
    if not strategy.donates:
        donate = ()
    pol.before_compile()
    t0 = time.perf_counter()
    # With a persistent cache the optimized program is the one to store: compile it now.
    quick = (pol.quick_compiler_options(len(graph.order))
             if env_vars.get("XLA_TIERED_COMPILE") and pkey is None else None)
    hits = persistent.jax_cache_hits()
    with telemetry.timed(metric):
        opts = {**pol.compiler_options(graph.op_avals(), library_products), **rounding_options(graph)}
        first = {**opts, **quick} if quick else opts

        def build(jit_options: dict):
            with pjrt.phase("torch_xla::lower"):
                lowered = jax.jit(fn, donate_argnums=donate, keep_unused=True, **jit_options).lower(*args)
                extra = pol.lowered_options(lowered)
            with pjrt.phase("torch_xla::compile"):
                return lowered, extra, _compile(lowered, {**first, **extra})
        try:
            lowered, extra, compiled = build(strategy.jit_options(graph, args))
        except Exception as e:  # noqa: BLE001  (the strategy judges any compile error; re-raised unless it retries)
            again = strategy.retry_options(graph, args, e)
            if again is None:
                raise
            lowered, extra, compiled = build(again)
        opts = {**opts, **extra}
    strategy.compiled()
    telemetry.inc("UncachedCompile")
    telemetry.inc("CreateCompileHandles")
    telemetry.inc("StableHloCompile")   # every program is compiled from its StableHLO module
    pol.after_compile(time.perf_counter() - t0)
    if quick:
        telemetry.inc("TieredCompile")
        return Executable(compiled, donate, pol.paced_bytes(compiled), graph.checks, functools.partial(_compile, lowered, opts))
    if pkey is not None:
        if persistent.jax_cache_hits() != hits:
            # Loaded from jax's cache: compile afresh, so that the stored entry holds code.
            compiled = _compile(lowered, {**opts, **persistent.FRESH_OPTION})
        persistent.store(pkey, compiled, args, graph.checks)
    return Executable(compiled, donate, pol.paced_bytes(compiled), graph.checks)


_HALF = (torch.bfloat16, torch.float16)
_EXCESS_PRECISION = "xla_allow_excess_precision"


def rounding_options(graph: Graph) -> dict:
    """Half-precision results rounded where eager PyTorch rounds them. XLA takes a round trip
    through bfloat16 or float16 (an op's half result converted back to float32) as excess
    precision it may drop, on every platform; eager rounds every op's result, and so does a
    program with this option off (a half-precision product's gradient cast to a float32
    master weight keeps eager's rounding). XLA_FLAGS naming the option decides alone."""
    if _EXCESS_PRECISION in (env_vars.get("XLA_FLAGS") or ""):
        return {}
    for _, (_, dtype) in graph.op_avals():
        if dtype in _HALF:
            return {_EXCESS_PRECISION: False}
    return {}


# Where each collective keeps its replica groups among its static arguments.
_GROUPS_AT = {"xla::all_reduce": 2, "xla::all_gather": 1, "xla::all_gather_coalesced": 1,
              "xla::reduce_scatter": 4, "xla::all_to_all": 3}


def _check_replica_groups(graph: Graph) -> None:
    """Refuses to run collectives whose replica groups name replicas this job lacks (a
    graph traced for a larger world can be printed, not run: XLA would not exchange
    anything with replicas that do not exist)."""
    from .. import job
    from ..ir import Ref
    world = job.world_size()
    for node in graph.order:
        at = _GROUPS_AT.get(node.op)
        if at is None:
            continue
        statics = [a for a in node.args if type(a) is not Ref]
        groups = statics[at] if at < len(statics) else None
        if groups and len(groups[0]) > 1 and any(r >= world for g in groups for r in g):
            raise RuntimeError(f"{node.op.split('::')[1]}: replica groups {[list(g) for g in groups]} name "
                               f"replicas beyond this job's {world}; such a program can be lowered to "
                               "text but not run here")


def _compile(lowered, options: dict):
    """XLA's executable of a jax `Lowered` program, with `options` (XLA debug options)."""
    return lowered.compile(compiler_options=options) if options else lowered.compile()


def lookup(key: int, donatable: tuple) -> Optional[Executable]:
    """A compiled program for `key` that donates only buffers that may be donated now.

    Which buffers are free to donate can change between steps with the same graph (an
    optimizer's state appears at step 2): an executable donating a subset is reused
    rather than compiling again.
    """
    exes = _cache.get(key)
    if not exes:
        return None
    best = None
    free = set(donatable)
    for exe in exes:
        if exe.donated == donatable:
            return exe
        if free.issuperset(exe.donated) and (best is None or len(exe.donated) > len(best.donated)):
            best = exe
    return best


def remember(key: int, exe: Executable) -> None:
    _cache.setdefault(key, []).append(exe)


def lowered(graph: Graph, strategy, manual_text: bool = False):
    """The jax `Lowered` program of a graph (no compilation, no execution), with the
    portable lowering of every op (convolutions as convolutions on every platform);
    `manual_text`: see `build_fn`."""
    jax = pjrt.jax_module()
    from . import unbounded
    if unbounded.marked(graph):
        return unbounded.lowered(graph)
    args = strategy.to_args(graph.param_values(), graph)
    fn = strategy.wrap(build_fn(graph, False, manual_text=manual_text), graph)
    return jax.jit(fn, keep_unused=True, **strategy.jit_options(graph, args)).lower(*args)


def cache_size() -> int:
    return sum(len(v) for v in _cache.values())


def clear_cache() -> None:
    _cache.clear()
