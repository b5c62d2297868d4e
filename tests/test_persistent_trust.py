"""What the persistent compilation cache trusts: one digest over an entry's metadata and
executable (a damaged entry warns, compiles again and is replaced), a private directory
(refused when another user owns it or can write to it), atomic writes that keep a valid
entry another rank wrote."""
import json
import os
import stat
import threading
import warnings

import numpy as np
import pytest
import torch

import torch_xla.debug.metrics as met
import torch_xla.runtime as xr
from torch_xla._engine import executor, pjrt
from torch_xla._engine.executor import persistent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache directory configured for this test, its warning not yet given."""
    d = tmp_path / "cache"
    monkeypatch.setattr(persistent._cache, "warned", False)
    persistent.configure(str(d))
    executor.clear_cache()
    try:
        yield d
    finally:
        persistent.configure(None)
        executor.clear_cache()


def _gather(x, idx):
    return x[idx] * 3


def _run(idx=(1, 5)):
    """One program with an index check, on the device (through the cache) and on the CPU."""
    x = torch.arange(6.0)
    i = torch.tensor(idx)
    return _gather(x.to("xla"), i.to("xla")).cpu(), _gather(x, i)


def _entries(d):
    return sorted(d.glob("txj-*.exe"))


def _split(blob):
    at = len(persistent._MAGIC) + persistent._HEAD.size
    _, n, m = persistent._HEAD.unpack_from(blob, len(persistent._MAGIC))
    return blob[:at], json.loads(blob[at:at + n]), blob[at + n:]


def _checked_entry(d):
    """The entry whose metadata records index checks."""
    found = [p for p in _entries(d) if _split(p.read_bytes())[1]["checks"]]
    assert len(found) == 1, found
    return found[0]


def _recorded(caught):
    return [w for w in caught if issubclass(w.category, UserWarning) and "persistent compilation cache" in str(w.message)]


def _counter(name):
    return met.counter_value(name) or 0


def _checks_removed(blob):
    # what an edit by hand would do: drop the checks, fix the lengths, keep the old digest
    head, meta, payload = _split(blob)
    digest, _, _ = persistent._HEAD.unpack_from(blob, len(persistent._MAGIC))
    meta["checks"] = None
    text = json.dumps(meta).encode()
    return persistent._MAGIC + persistent._HEAD.pack(digest, len(text), len(payload)) + text + payload


def _metadata_byte_flipped(blob):
    head, _, _ = _split(blob)
    b = bytearray(blob)
    at = bytes(b).index(b'"checks"', len(head))
    b[at + 2] ^= 0x01                    # "checks" -> "cbecks": still JSON, another record
    return bytes(b)


def _executable_truncated(blob):
    return blob[:-200]


@pytest.mark.parametrize("damage, why", [(_checks_removed, "checksum does not match"),
                                         (_metadata_byte_flipped, "checksum does not match"),
                                         (_executable_truncated, "truncated")])
def test_damaged_entry_warns_once_recompiles_and_is_replaced(cache, damage, why):
    got, want = _run()
    torch.testing.assert_close(got, want)
    entry = _checked_entry(cache)
    good = entry.read_bytes()
    bad = damage(good)
    entry.write_bytes(bad)
    executor.clear_cache()
    compiles, hits = _counter("UncachedCompile"), _counter("PersistentExecutableHit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, want = _run()
        _run()                                   # the same entry again: no second warning
    torch.testing.assert_close(got, want)
    (w,) = _recorded(caught)
    assert str(entry) in str(w.message) and why in str(w.message), str(w.message)
    assert _counter("UncachedCompile") == compiles + 1 and _counter("PersistentExecutableHit") == hits
    # replaced by a valid entry, with its checks, that the next compile loads
    replaced = entry.read_bytes()
    assert replaced != bad and _split(replaced)[1]["checks"]
    assert not list(cache.glob(".txj-*"))
    executor.clear_cache()
    got, want = _run()
    torch.testing.assert_close(got, want)
    assert _counter("PersistentExecutableHit") == hits + 1
    # and the recorded index check still raises what the CPU raises
    executor.clear_cache()
    with pytest.raises(IndexError) as cpu:
        _gather(torch.arange(6.0), torch.tensor([1, 9]))
    with pytest.raises(IndexError, match=str(cpu.value)):
        _gather(torch.arange(6.0).to("xla"), torch.tensor([1, 9]).to("xla")).cpu()
    assert _counter("PersistentExecutableHit") == hits + 2


def test_two_corrupt_entries_warn_once_per_process(cache):
    x = torch.arange(6.0)
    progs = [lambda t: t * 3, lambda t: t + 1]
    for f in progs:
        torch.testing.assert_close(f(x.to("xla")).cpu(), f(x))
    entries = _entries(cache)
    assert len(entries) == 2
    for p in entries:
        p.write_bytes(p.read_bytes()[:-100])
    executor.clear_cache()
    corrupt = _counter("PersistentCacheCorrupt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for f in progs:
            torch.testing.assert_close(f(x.to("xla")).cpu(), f(x))
    (w,) = _recorded(caught)
    assert "Further corrupt entries are only counted" in str(w.message)
    assert _counter("PersistentCacheCorrupt") == corrupt + 2
    assert all(persistent._valid(str(p), p.name[4:-4]) for p in entries)


def test_foreign_owner_of_entry_is_refused(cache):
    got, want = _run()
    entry = _checked_entry(cache)
    os.chown(entry, 12345, -1)
    executor.clear_cache()
    hits = _counter("PersistentExecutableHit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, want = _run()
    torch.testing.assert_close(got, want)
    (w,) = _recorded(caught)
    assert "owned by uid 12345" in str(w.message)
    assert _counter("PersistentExecutableHit") == hits
    assert entry.stat().st_uid == os.geteuid()          # replaced by ours


def test_readonly_cache_warns_and_keeps_the_entry(cache):
    _run()
    entry = _checked_entry(cache)
    bad = entry.read_bytes()[:-50]
    entry.write_bytes(bad)
    persistent.configure(str(cache), readonly=True)
    executor.clear_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, want = _run()
    torch.testing.assert_close(got, want)
    (w,) = _recorded(caught)
    assert "the program is compiled again. " in str(w.message)
    assert entry.read_bytes() == bad


def test_older_format_is_a_silent_miss(cache):
    _run()
    entry = _checked_entry(cache)
    entry.write_bytes(b"torch-xla-jax executable 2\n" + entry.read_bytes()[len(persistent._MAGIC):])
    executor.clear_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, want = _run()
    torch.testing.assert_close(got, want)
    assert not _recorded(caught)
    assert entry.read_bytes().startswith(persistent._MAGIC)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o720])
def test_directory_writable_by_others_is_refused(tmp_path, mode):
    jax = pjrt.jax_module()
    before = jax.config.jax_compilation_cache_dir
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(RuntimeError) as e:
        xr.initialize_cache(str(d))
    msg = str(e.value)
    assert str(d) in msg and f"mode {mode:#o}" in msg
    assert "xr.initialize_cache(path)" in msg and "XLA_PERSISTENT_CACHE_PATH" in msg
    assert not persistent.enabled() and jax.config.jax_compilation_cache_dir == before
    with pytest.raises(RuntimeError, match="lets other users write"):
        persistent.configure(str(d))
    assert not persistent.enabled()


def test_directory_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(d, 12345, -1)
        owner, me = 12345, 0
    else:                                  # the directory stays ours; this process pretends to be another user
        owner, me = os.geteuid(), os.geteuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: me)
    with pytest.raises(RuntimeError) as e:
        xr.initialize_cache(str(d))
    msg = str(e.value)
    assert str(d) in msg and f"owned by uid {owner}, not by this process's uid {me}" in msg
    assert "XLA_PERSISTENT_CACHE_PATH" in msg
    assert not persistent.enabled()


def test_created_directory_is_private(tmp_path):
    d = tmp_path / "a" / "cache"
    persistent.private_dir(str(d))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    persistent.private_dir(str(d))            # an existing private one is accepted as it is
    assert not persistent.enabled()


def test_concurrent_stores_leave_one_valid_entry(cache):
    jax = pjrt.jax_module()
    a = np.arange(6.0, dtype=np.float32)
    compiled = jax.jit(lambda v: v * 2).lower(a).compile()
    k = "concurrent"
    start = threading.Barrier(2)

    def write():
        start.wait()
        persistent.store(k, compiled, [a], None)
    threads = [threading.Thread(target=write) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.name for p in cache.iterdir()] == [f"txj-{k}.exe"]      # no temporary file left
    assert persistent._valid(persistent._path(k), k)
    inode = os.stat(persistent._path(k)).st_ino
    persistent.store(k, compiled, [a], None)                             # a valid entry is kept
    assert os.stat(persistent._path(k)).st_ino == inode
    prog, checks = persistent.load(k)
    assert checks is None
    torch.testing.assert_close(torch.from_numpy(np.array(prog(a)[0])), torch.from_numpy(a) * 2)
