"""Jax functions as IR nodes (`torch_xla.core.xla_builder.call_jax`).

A `JaxFunction` is a jax function of flat arrays traced once, at the call, for fixed input
avals under the jax configuration then in force: its closed jaxpr is what the node's
lowering evaluates when the graph is compiled, however much later and under whatever
configuration, so a setting such as `jax_default_matmul_precision` applies to the calls
made while it was set. It is the node's one static argument: equal functions (same key)
hash and compare equal and print alike, so a traced step that calls the same function
again keeps its graph key and its compiled program.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from .table import lowering

Aval = Tuple[Tuple[int, ...], np.dtype]


def trace_context() -> tuple:
    """The jax configuration that decides how a function traces (jax's own jit key)."""
    from jax._src import config
    return config.trace_context()


def _config_scope(captured: tuple):
    """Re-enters the jax options of `captured` (a `trace_context()`) that differ from the
    ones in force now; the context managers (meshes, axis environments) are left as they
    are: they belong to whoever is tracing now."""
    from jax._src import config
    now = config.trace_context()
    if now == captured:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for name, then, cur in zip(config.trace_context_names(), captured, now):
        state = config.config_states.get(name)
        if state is None or then is cur or then == cur:
            continue
        try:
            stack.enter_context(state(then))
        except (TypeError, ValueError):
            pass   # a value the option's parser cannot take back (already parsed): it stays
    return stack


def _is_complex(dtype) -> bool:
    return np.issubdtype(np.dtype(dtype), np.complexfloating)


def differentiable(dtype) -> bool:
    """Whether values of `dtype` carry gradients (floating and complex dtypes)."""
    d = np.dtype(dtype)
    return np.issubdtype(d, np.inexact)


class JaxFunction:
    """`fn(*arrays)` (a jax function of flat arrays returning a pytree of arrays), traced
    for `in_avals`.

    key: what identifies it (equality and hash; the cache key of its caller); name: the
    `jax.named_scope` its operations carry in the program (HLO `op_name` metadata).
    Attributes: `out_avals` ((shape, numpy dtype) per output leaf), `out_torch` (the same
    with torch dtypes), `out_tree` (the result's jax treedef), `used` (per input: whether
    the outputs depend on it at all).
    """
    __slots__ = ("key", "name", "in_avals", "out_avals", "out_torch", "out_tree", "used", "config", "jaxpr", "_fn",
                 "_hash", "_text", "_vjps")

    def __init__(self, fn: Callable, in_avals: Sequence[Aval], key: Hashable, name: str,
                 config: Optional[tuple] = None):
        import jax
        from jax.extend.core import jaxpr_as_fun
        self.key = key
        self.name = name
        self.in_avals = tuple((tuple(s), np.dtype(d)) for s, d in in_avals)
        self.config = trace_context() if config is None else config
        specs = [jax.ShapeDtypeStruct(s, d) for s, d in self.in_avals]
        self.jaxpr, shapes = jax.make_jaxpr(fn, return_shape=True)(*specs)
        leaves, self.out_tree = jax.tree.flatten(shapes)
        self.out_torch = tuple((tuple(x.shape), _torch_dtype(x.dtype, name, i)) for i, x in enumerate(leaves))
        self.out_avals = tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves)
        self.used = _used_inputs(self.jaxpr)
        self._fn = jaxpr_as_fun(self.jaxpr)
        self._hash = hash(key)
        self._text = f"JaxFunction({name}, {_digest(self)})"
        self._vjps: Dict[tuple, JaxFunction] = {}

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is JaxFunction and self._hash == other._hash and self.key == other.key)

    def __repr__(self) -> str:
        # Part of the node's hash within a process, and of the persistent cache's program
        # key across processes: see `_digest`.
        return self._text

    def scope(self):
        """The jax options this function was traced under (for tracing what derives from it)."""
        return _config_scope(self.config)

    def lower(self, *args) -> List:
        """The function's flat outputs on jax values (or tracers) `args`."""
        import jax
        with self.scope(), jax.named_scope(self.name):
            return self._fn(*args)

    def vjp(self, diff_in: Tuple[bool, ...], diff_out: Tuple[bool, ...]) -> "JaxFunction":
        """The function of (inputs..., cotangents of the outputs marked in `diff_out`) that
        returns the gradients of the inputs marked in `diff_in`, in PyTorch's convention
        for complex values (the conjugate of jax's). Traced once per pair of masks, under
        this function's jax options."""
        masks = (tuple(diff_in), tuple(diff_out))
        fn = self._vjps.get(masks)
        if fn is None:
            ct_avals = [a for a, m in zip(self.out_avals, diff_out) if m]
            with self.scope():
                fn = JaxFunction(_vjp_of(self, *masks), self.in_avals + tuple(ct_avals), ("vjp", self.key, masks),
                                 f"{self.name}_vjp", self.config)
            self._vjps[masks] = fn
        return fn


def _torch_dtype(dtype, name: str, i: int):
    from .. import pjrt
    try:
        return pjrt.torch_dtype(np.dtype(dtype))
    except (KeyError, TypeError):
        raise TypeError(f"{name}: output {i} has dtype {dtype}, which no torch tensor holds") from None


def _vjp_of(f: JaxFunction, diff_in: tuple, diff_out: tuple) -> Callable:
    import jax
    import jax.numpy as jnp
    n = len(f.in_avals)
    conj_in = [_is_complex(d) for (_, d), m in zip(f.in_avals, diff_in) if m]
    conj_out = [_is_complex(d) for (_, d), m in zip(f.out_avals, diff_out) if m]

    def bwd(*xs):
        primals, cts = xs[:n], xs[n:]

        def part(*d):
            it = iter(d)
            outs = f._fn(*[next(it) if m else p for p, m in zip(primals, diff_in)])
            return [o for o, m in zip(outs, diff_out) if m]

        _, pull = jax.vjp(part, *[p for p, m in zip(primals, diff_in) if m])
        grads = pull([jnp.conj(c) if cj else c for c, cj in zip(cts, conj_out)])
        return tuple(jnp.conj(g) if cj else g for g, cj in zip(grads, conj_in))
    return bwd


def _digest(f: JaxFunction) -> str:
    """A digest of what decides the function's program: its jaxpr's text, the values of
    its constants, its name and the jax options it was traced under. Equal for equal
    functions in any process, so a persistent compile cache can find their programs. A
    function whose text names process-specific objects (host callbacks, objects printed
    by address) gets an address-like text instead, which no other process shares and the
    persistent cache refuses (its executable would call into this process)."""
    from jax._src import config
    try:
        text = str(f.jaxpr)
        if "callback" in text or " at 0x" in text:
            raise ValueError(text)
        h = hashlib.sha256(f"{f.name}\n{text}\n".encode())
        for c in f.jaxpr.consts:
            a = np.asarray(c)
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(np.ascontiguousarray(a).tobytes())
        for name, value in zip(config.trace_context_names(), f.config):
            if name.startswith("jax_"):
                h.update(f"{name}={value!r};".encode())
        return h.hexdigest()[:20]
    except Exception:
        return f"process-specific at 0x{f._hash & 0xFFFFFFFFFFFFFFFF:x}"


def _used_inputs(closed) -> Tuple[bool, ...]:
    """Per input of a closed jaxpr: whether any output (or effect) depends on it."""
    jaxpr = closed.jaxpr
    try:
        from jax._src.interpreters import partial_eval as pe
        _, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
        return tuple(bool(u) for u in used)
    except Exception:   # a private helper: without it, every input counts as used
        return (True,) * len(jaxpr.invars)


@lowering("xla::call_jax")
def call_jax(*args):
    """args: the inputs' jax values, then the `JaxFunction`. Returns its flat outputs."""
    return tuple(args[-1].lower(*args[:-1]))
