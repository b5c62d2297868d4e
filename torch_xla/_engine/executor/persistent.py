"""Persistent executables (`xr.initialize_cache`).

jax's compilation cache saves XLA's work but not ours: a new process still traces every
lowering to build the program before jax can look it up. Here a compiled program is also
stored under a key computed from the graph itself (ops, arguments, shapes, operand
structure, parameters, donation) and from everything else that decides the program (the
engine's source, jax/jaxlib versions, platform, XLA flags, dtype options), so a later
process that builds the same graph loads the executable without lowering it at all.

An entry is data only, never a pickle: a header line, a SHA-256 digest, the lengths of
the two parts it covers, the program's metadata as JSON (its key, device, argument avals
and the host side of its index checks) and XLA's serialized executable, which PJRT loads
(`Client.deserialize_executable`) and the engine calls directly (`_Stored`). An entry of
another format version is a plain miss; one that is truncated, altered (either part), foreign
or owned by another user is a miss that warns (once per process; every one counts in
`PersistentCacheCorrupt`) and is replaced by the compile that follows.

Trust: the directory holds native code this process runs, so it must be owned by this
process's user and writable by no one else (`private_dir`, at the call that names it);
the digest detects damage, not forgery (whoever can write the directory can recompute it).
Writes go to a temporary file in the directory, fsynced, then `os.replace`d, so ranks
sharing a directory see a whole entry or none; a valid entry already present is kept.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import tempfile
import warnings
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
    compiling threads (the barrier's, under `barrier._lock`, or a captured program's).
    `warned`: a corrupt entry was warned about (set by a compiling thread; a race warns
    twice)."""
    __slots__ = ("dir", "readonly", "listening", "env", "jax_hits", "warned")

    def __init__(self):
        self.dir: Optional[str] = None
        self.readonly = False
        self.listening = False
        self.env: Optional[str] = None
        self.jax_hits = 0
        self.warned = False


_cache = _Cache()


def private_dir(path: str) -> None:
    """Creates `path` (mode 0700) if missing; raises RuntimeError unless it is a directory
    owned by this process's user that no other user can write."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    uid = os.geteuid()
    wrong = []
    if st.st_uid != uid:
        wrong.append(f"it is owned by uid {st.st_uid}, not by this process's uid {uid}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        wrong.append(f"its mode {stat.S_IMODE(st.st_mode):#o} lets other users write to it")
    if wrong:
        raise RuntimeError(
            f"refusing the persistent compilation cache directory {path!r}: {'; '.join(wrong)}. "
            "The programs it holds are native code this process would run. Name a directory only you "
            "own and can write, with xr.initialize_cache(path) or XLA_PERSISTENT_CACHE_PATH=path (a missing "
            "one is created with mode 0700), or make this one private (chown to your user, chmod go-w).")


def configure(path: Optional[str], readonly: bool = False) -> None:
    """Entries are read from (and, unless `readonly`, written to) `path`; None: no cache."""
    if path is not None:
        private_dir(path)
    _cache.dir = path
    _cache.readonly = readonly


def initialize(jax, path: str, readonly: bool = False) -> None:
    """Puts jax's compilation cache and this one's executables under `path` (refused
    before anything is set if `path` is not private: `private_dir`)."""
    private_dir(path)
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


_FAMILY = b"torch-xla-jax executable "
_MAGIC = _FAMILY + b"3\n"
_HEAD = struct.Struct("<32sQQ")   # digest of the rest, metadata length, executable length
_EXCEPTIONS = {"IndexError": IndexError, "RuntimeError": RuntimeError}


class _Corrupt(Exception):
    pass


def _encode(k: str, meta: dict, payload: bytes) -> bytes:
    head = json.dumps({**meta, "key": k}).encode()
    lengths = struct.pack("<QQ", len(head), len(payload))
    digest = hashlib.sha256(lengths + head + payload).digest()
    return _MAGIC + _HEAD.pack(digest, len(head), len(payload)) + head + payload


def _decode(k: str, blob: bytes):
    """(metadata, executable) of an entry, None for another format version; raises
    `_Corrupt` saying what is wrong with it."""
    if not blob.startswith(_MAGIC):
        if blob.startswith(_FAMILY):
            return None
        raise _Corrupt("it is not a torch-xla-jax cache entry")
    at = len(_MAGIC) + _HEAD.size
    if len(blob) < at:
        raise _Corrupt(f"it is truncated ({len(blob)} bytes, shorter than its header)")
    digest, n, m = _HEAD.unpack_from(blob, len(_MAGIC))
    if len(blob) != at + n + m:
        raise _Corrupt(f"it is {'truncated' if len(blob) < at + n + m else 'extended'} "
                       f"({len(blob)} bytes, its header says {at + n + m})")
    if hashlib.sha256(blob[len(_MAGIC) + 32:]).digest() != digest:
        raise _Corrupt("its checksum does not match: its metadata or its executable was altered")
    try:
        meta = json.loads(blob[at:at + n].decode())
    except ValueError as e:
        raise _Corrupt(f"its metadata is unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("key") != k:
        raise _Corrupt("it was stored under another key (a renamed or copied entry)")
    return meta, blob[at + n:]


def _read(p: str, k: str):
    """`_decode` of the file at `p`, which must be owned by this process's user."""
    with open(p, "rb") as f:
        owner = os.fstat(f.fileno()).st_uid
        if owner != os.geteuid():
            raise _Corrupt(f"it is owned by uid {owner}, not by this process's uid {os.geteuid()}")
        return _decode(k, f.read())


def _corrupt(p: str, why: str) -> None:
    telemetry.inc("PersistentCacheCorrupt")
    if not _cache.warned:
        _cache.warned = True
        then = "compiled again" if _cache.readonly else "compiled again and replaced"
        warnings.warn(f"persistent compilation cache: ignoring {p}: {why}; the program is {then}. "
                      "Further corrupt entries are only counted (metric PersistentCacheCorrupt).", UserWarning,
                      stacklevel=3)


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
    try:
        entry = _read(p, k)
    except OSError:  # missing, or unreadable (permissions, I/O): only slower
        entry = None
    except _Corrupt as e:
        # Never handed to XLA; the compile that follows replaces it.
        _corrupt(p, str(e))
        entry = None
    if entry is None:
        telemetry.inc("PersistentCacheMiss")
        return None
    meta, payload = entry
    try:
        jax = pjrt.jax_module()
        from jax._src.lib import xla_client as xc
        device = {d.id: d for d in jax.local_devices()}[meta["device"]]
        in_avals = [(tuple(s), jax.numpy.dtype(d)) for s, d in meta["in"]]
        checks = None if meta["checks"] is None else [(_EXCEPTIONS[e], m, op, src) for e, m, op, src in meta["checks"]]
        exe = device.client.deserialize_executable(payload, executable_devices=xc.DeviceList((device,)))
    except Exception as e:  # noqa: BLE001  (its digest holds, so this build cannot use it: a miss)
        _corrupt(p, f"it cannot be loaded ({type(e).__name__}: {e})")
        telemetry.inc("PersistentCacheMiss")
        return None
    telemetry.inc("PersistentExecutableHit")
    telemetry.inc("PersistentCacheHit")
    return _Stored(exe, device, in_avals), checks


def _valid(p: str, k: str) -> bool:
    try:
        return _read(p, k) is not None
    except (OSError, _Corrupt):
        return False


def store(k: str, compiled, args, checks) -> None:
    """Writes the entry for key `k`, unless the cache is read-only or a valid entry is
    already there (another rank's): atomically, so a reader sees all of it or none."""
    if _cache.readonly:
        return
    p = _path(k)
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
        if _valid(p, k):
            return
        data = _encode(k, meta, exe.serialize())
        fd, tmp = tempfile.mkstemp(dir=_cache.dir, prefix=".txj-", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        tmp = None
        _sync_dir(_cache.dir)
    except Exception:  # noqa: BLE001
        # A cache that cannot be written is only slower.
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _sync_dir(path: str) -> None:
    """Makes a rename in `path` durable (best effort: not every file system can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
