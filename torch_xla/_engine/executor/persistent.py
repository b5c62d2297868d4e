"""Persistent executables (`xr.initialize_cache`).

jax's compilation cache saves XLA's work but not ours: a new process still traces every
lowering to build the program before jax can look it up. Here a compiled program is also
stored under a key computed from the graph itself (ops, arguments, shapes, operand
structure, parameters, donation) and from everything else that decides the program (the
engine's source, jax/jaxlib versions, platform, XLA flags, dtype options), so a later
process that builds the same graph loads the executable without lowering it at all.
Entries are written atomically (temporary file + rename); anything unreadable is a miss.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from typing import Optional

import numpy as np

from .. import config, ir, metrics, runtime
from ..lowering.table import matmul_precision

_state = {"dir": None, "readonly": False, "env": None}


def configure(path: str, readonly: bool = False) -> None:
    _state["dir"] = path
    _state["readonly"] = readonly


def initialize(jax, path: str, readonly: bool = False) -> None:
    """Puts jax's compilation cache and this one's executables under `path`."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    configure(path, readonly)


def enabled() -> bool:
    return _state["dir"] is not None


class _Uncacheable(Exception):
    pass


def _enc(x, out: list) -> None:
    t = type(x)
    if t is tuple or t is list or t is ir.Ref:
        out.append("(" if t is not list else "[")
        for v in x:
            _enc(v, out)
            out.append(",")
        out.append(")")
    elif t is np.ndarray or isinstance(x, np.generic):
        a = np.asarray(x)
        out.append(f"nd{a.dtype}{a.shape}{hashlib.sha256(a.tobytes()).hexdigest()}")
    else:
        r = repr(x)
        if " at 0x" in r:  # an object without a stable text form
            raise _Uncacheable
        out.append(t.__name__ + ":" + r)


def _env() -> str:
    if _state["env"] is None:
        jax = runtime.jax_module()
        import jaxlib
        h = hashlib.sha256()
        engine = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for root, _, files in sorted(os.walk(engine)):
            for f in sorted(files):
                if f.endswith(".py"):
                    with open(os.path.join(root, f), "rb") as fh:
                        h.update(f.encode() + fh.read())
        for v in ("XLA_FLAGS", "XLA_USE_BF16", "XLA_DOWNCAST_BF16", "XLA_NO_SPECIAL_SCALARS"):
            h.update(f"{v}={config.raw(v) or ''}".encode())
        h.update(f"{jax.__version__}/{jaxlib.__version__}/{runtime.platform()}".encode())
        _state["env"] = h.hexdigest()
    return _state["env"]


def key(graph, donate: tuple) -> Optional[str]:
    """A key that is equal across processes for the same program, or None."""
    out = [_env(), matmul_precision()]
    index = graph.index
    try:
        for n in graph.order:
            t = type(n)
            if t is ir.DeviceData or t is ir.ScalarParam:
                _enc(("p", n.avals), out)
            elif t is ir.Constant:
                _enc(("c", n.value, n.avals), out)
            else:
                _enc((n.op, n.args, n.avals, n.info, tuple((index[id(o)], i) for o, i in n.operands)), out)
        _enc((tuple((index[id(n)], i) for n, i in graph.roots), donate), out)
    except _Uncacheable:
        return None
    return hashlib.sha256("".join(out).encode()).hexdigest()


def _path(k: str) -> str:
    return os.path.join(_state["dir"], f"txj-{k}.exe")


def load(k: str):
    """The stored executable for key `k`, loaded on this process's device, or None."""
    p = _path(k)
    if not os.path.exists(p):
        metrics.inc("PersistentCacheMiss")
        return None
    try:
        from jax.experimental.serialize_executable import deserialize_and_load
        with open(p, "rb") as f:
            payload, in_tree, out_tree = pickle.load(f)
        exe = deserialize_and_load(payload, in_tree, out_tree)
    except Exception:
        metrics.inc("PersistentCacheMiss")
        return None
    metrics.inc("PersistentExecutableHit")
    metrics.inc("PersistentCacheHit")
    return exe


def store(k: str, compiled) -> None:
    if _state["readonly"]:
        return
    tmp = None
    try:
        from jax.experimental.serialize_executable import serialize
        data = pickle.dumps(serialize(compiled))
        fd, tmp = tempfile.mkstemp(dir=_state["dir"], prefix=".txj-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, _path(k))
    except Exception:
        # A cache that cannot be written is only slower.
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
