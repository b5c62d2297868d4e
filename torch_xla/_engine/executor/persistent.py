"""Persistent executables (`xr.initialize_cache`).

jax's compilation cache saves XLA's work but not ours: a new process still traces every
lowering to build the program before jax can look it up. Here a compiled program is also
stored under a key computed from the graph itself (ops, arguments, shapes, operand
structure, parameters, donation) and from everything else that decides the program (the
engine's source, jax/jaxlib versions, platform, XLA flags, dtype options), so a later
process that builds the same graph loads the executable without lowering it at all.
Entries are written atomically (temporary file + rename); anything unreadable is a miss.

An entry is data only, never a pickle: a header line, the program's metadata as JSON
(its device, argument and result avals, the host side of its index checks) and XLA's
serialized executable, which PJRT loads (`Client.deserialize_executable`) and the
engine calls directly (`_Stored`).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from typing import Optional

import numpy as np

from .. import env_vars, ir, telemetry, pjrt
from ..lowering.table import matmul_precision


class _Cache:
    """`dir` (None: no cache), `readonly` and `listening` (jax's cache events reach
    `_on_jax_event`): written by `initialize`, in the thread that started jax
    (XLA_PERSISTENT_CACHE_PATH) or that calls `xr.initialize_cache`, without a lock, before
    the programs it serves compile. `env`: the hash of everything outside a graph that
    decides its program, computed by the first compile that asks (a race computes it
    twice). `jax_hits`: counted by jax's listener on the thread that compiles. Read by the
    compiling threads (the barrier's, under `barrier._lock`, or a captured program's)."""
    __slots__ = ("dir", "readonly", "listening", "env", "jax_hits")

    def __init__(self):
        self.dir: Optional[str] = None
        self.readonly = False
        self.listening = False
        self.env: Optional[str] = None
        self.jax_hits = 0


_cache = _Cache()


def configure(path: Optional[str], readonly: bool = False) -> None:
    """Entries are read from (and, unless `readonly`, written to) `path`; None: no cache."""
    _cache.dir = path
    _cache.readonly = readonly


def initialize(jax, path: str, readonly: bool = False) -> None:
    """Puts jax's compilation cache and this one's executables under `path`."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if not _cache.listening:
        from jax._src import monitoring
        monitoring.register_event_listener(_on_jax_event)
        _cache.listening = True
    configure(path, readonly)


def _on_jax_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _cache.jax_hits += 1


def jax_cache_hits() -> int:
    """Programs jax's own cache has served so far. An executable it loaded cannot be
    stored again (XLA:CPU serializes it without its code), so `compile_graph` compiles
    one afresh to store when this moves during its compile."""
    return _cache.jax_hits


# A compiler option set to its default value: it only makes jax's cache key differ, so
# that jax compiles instead of loading (jax leaves the dump options out of its key).
FRESH_OPTION = {"xla_backend_optimization_level": 3}


def enabled() -> bool:
    return _cache.dir is not None


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
    if _cache.env is None:
        jax = pjrt.jax_module()
        import jaxlib
        h = hashlib.sha256()
        engine = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for root, _, files in sorted(os.walk(engine)):
            for f in sorted(files):
                if f.endswith(".py"):
                    with open(os.path.join(root, f), "rb") as fh:
                        h.update(f.encode() + fh.read())
        for v in ("XLA_FLAGS", "XLA_USE_BF16", "XLA_DOWNCAST_BF16", "XLA_NO_SPECIAL_SCALARS", "XLA_CHECK_INDICES"):
            h.update(f"{v}={env_vars.raw(v) or ''}".encode())
        h.update(f"{jax.__version__}/{jaxlib.__version__}/{pjrt.platform()}".encode())
        _cache.env = h.hexdigest()
    return _cache.env


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
    return os.path.join(_cache.dir, f"txj-{k}.exe")


_MAGIC = b"torch-xla-jax executable 2\n"
_EXCEPTIONS = {"IndexError": IndexError, "RuntimeError": RuntimeError}


class _Stored:
    """A program loaded from the cache: XLA's executable on one device, called on flat
    arguments like the jax `Compiled` it was stored from."""

    def __init__(self, exe, device, in_avals):
        self.exe = exe
        self.device = device
        self.in_avals = in_avals

    def __call__(self, *args):
        jax = pjrt.jax_module()
        put = []
        for a, (shape, dtype) in zip(args, self.in_avals):
            if not isinstance(a, jax.Array) or a.devices() != {self.device}:
                a = jax.device_put(np.asarray(a, dtype=dtype), self.device)
            put.append(a)
        return tuple(o[0] for o in self.exe.execute_sharded(put).disassemble_into_single_device_arrays())

    def memory_analysis(self):
        return self.exe.get_compiled_memory_stats()


def load(k: str):
    """(program, host side of its index checks) stored for key `k`, or None."""
    p = _path(k)
    if not os.path.exists(p):
        telemetry.inc("PersistentCacheMiss")
        return None
    try:
        with open(p, "rb") as f:
            blob = f.read()
        if not blob.startswith(_MAGIC):
            telemetry.inc("PersistentCacheMiss")
            return None
        at = len(_MAGIC)
        (n,) = struct.unpack_from("<Q", blob, at)
        meta = json.loads(blob[at + 8:at + 8 + n].decode())
        payload = blob[at + 8 + n:]
        if hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
            # Truncated or corrupt: never hand it to XLA; the compile that follows replaces it.
            telemetry.inc("PersistentCacheMiss")
            return None
        jax = pjrt.jax_module()
        from jax._src.lib import xla_client as xc
        device = {d.id: d for d in jax.local_devices()}[meta["device"]]
        exe = device.client.deserialize_executable(payload, executable_devices=xc.DeviceList((device,)))
        in_avals = [(tuple(s), pjrt.jax_module().numpy.dtype(d)) for s, d in meta["in"]]
        checks = None if meta["checks"] is None else [(_EXCEPTIONS[e], m, op, src) for e, m, op, src in meta["checks"]]
    except Exception:  # noqa: BLE001  (unreadable: a miss)
        telemetry.inc("PersistentCacheMiss")
        return None
    telemetry.inc("PersistentExecutableHit")
    telemetry.inc("PersistentCacheHit")
    return _Stored(exe, device, in_avals), checks


def store(k: str, compiled, args, checks) -> None:
    if _cache.readonly:
        return
    tmp = None
    try:
        jax = pjrt.jax_module()
        if compiled.in_tree != jax.tree_util.tree_structure((tuple(args), {})):
            return
        exe = compiled.runtime_executable()
        devices = exe.local_devices()
        if len(devices) != 1 or any(e not in _EXCEPTIONS.values() for e, *_ in checks or ()):
            return
        meta = {"device": devices[0].id,
                "in": [[list(np.shape(a)), str(np.asarray(a).dtype if not hasattr(a, "dtype") else a.dtype)]
                       for a in args],
                "checks": None if checks is None else [[e.__name__, m, op, src] for e, m, op, src in checks]}
        payload = exe.serialize()
        meta["sha256"] = hashlib.sha256(payload).hexdigest()
        head = json.dumps(meta).encode()
        data = _MAGIC + struct.pack("<Q", len(head)) + head + payload
        fd, tmp = tempfile.mkstemp(dir=_cache.dir, prefix=".txj-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, _path(k))
    except Exception:  # noqa: BLE001
        # A cache that cannot be written is only slower.
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
