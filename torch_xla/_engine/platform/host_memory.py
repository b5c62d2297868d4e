"""Host memory on the CPU device: a step's large buffers stay resident for the next step.

On the CPU device XLA's buffers are C-heap memory. glibc serves a request over its mmap
threshold (at most 32 MiB), and every large request of a thread other than the main one,
with a fresh `mmap` and returns it with `munmap` on free, so each execution of a program
with a large temporary buffer touches all of it anew: one page fault per 4 KiB, a large
part of the decoder benchmark's step (BENCHMARKS.md, "What moved the figures", *Host
memory kept resident on CPU*).

`configure()` keeps the memory instead: one malloc arena for all threads (a non-main
arena cannot hold more than 64 MiB), no mmap, no trimming of the heap's top. Freed
buffers go back to the heap and the next execution reuses the same pages. The arena
limit is taken at `import torch_xla` already when PJRT_DEVICE=CPU is set then
(`limit_arenas`): threads that allocate before it (PyTorch's OpenMP workers while a model
is built) would get arenas of their own, which XLA's threads, started later, are then
given in turn.

A heap that keeps what it is given holds the peak of what was live at once, so the
executor must not let two large temporary buffers coexist: XLA allocates a program's
temporary buffer when it is dispatched and frees it a few milliseconds after its outputs
are ready. `before_dispatch()` therefore waits, before a program is dispatched, until the
previous large program's temporary buffer is free. Only programs whose temporary buffer
is at least `LARGE_TEMP_BYTES` are held back this way (their execution dwarfs the short
gap); smaller programs are dispatched at once and run ahead as before.

One arena serializes every thread's allocations on one lock, and its free lists hold
every thread's freed blocks: programs of a few milliseconds (MNIST's step) run ~15%
slower than with glibc's arena per thread. `PT_XLA_RETAIN_HOST_MEMORY=threads` keeps an
arena per thread instead and makes each fit what it keeps: programs are compiled with
their temporary buffer cut into pieces of at most `TEMP_PIECE_BYTES` (XLA's
`xla_multiheap_size_constraint_per_heap`), each of which fits a non-main arena's 64 MiB
heap, and a top pad keeps an emptied heap mapped for the next step. A single buffer over
64 MiB is still mapped afresh at every step there (a decoder at batch 16 x 512 took 1.45x
as long a step; the first program with an array over 64 MiB warns of it once), which is
why one arena stays the default (BENCHMARKS.md, issue 35, twelfth session).
`PT_XLA_RETAIN_HOST_MEMORY=0` leaves the C allocator as it is.
"""
from __future__ import annotations

import ctypes

import sys
import time
from typing import Optional

from .. import env_vars

LARGE_TEMP_BYTES = 64 << 20
# Per-thread arenas: the largest piece of a temporary buffer (a non-main arena's heap
# holds at most 64 MiB, its header included), and the top pad that keeps an emptied heap.
TEMP_PIECE_BYTES = 32 << 20
THREAD_HEAP_BYTES = 64 << 20   # glibc's HEAP_MAX_SIZE on 64-bit: larger requests are mmapped
_TOP_PAD_BYTES = THREAD_HEAP_BYTES
ONE_ARENA, PER_THREAD, OFF = "one arena", "per thread", "off"
# XLA frees the temporary buffer a few ms after the outputs are ready (BENCHMARKS.md, as
# above); past this the dispatch goes ahead rather than stall.
_FREE_WAIT_S = 0.05
# ... and it has mostly done so within this much after the outputs became ready. A reading
# of the heap walks its free lists (~5 ms on a heap that keeps a step's buffers) holding the
# heap's lock, which also holds up that free: a reading taken at once mostly had to be taken
# twice (BENCHMARKS.md, issue 35, seventh session).
_FREE_GRACE_S = 0.0005

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


class _Allocator:
    """`libc`: glibc's handle (None: not looked up yet; False: not glibc 2.33+), looked up
    by the first thread that asks, without a lock (a race loads the same library twice).
    `active`: `configure` changed the allocator; `per_thread`: with an arena per thread.
    Both written once at jax's start (under `boot._lock`), read by any thread that
    dispatches or compiles a program."""
    __slots__ = ("libc", "active", "per_thread")

    def __init__(self):
        self.libc = None
        self.active = False
        self.per_thread = False


_allocator = _Allocator()
# The last large program dispatched: (an output array, heap bytes in use just before its
# dispatch, its temporary buffer's bytes).
_last: Optional[tuple] = None


def _glibc():
    if _allocator.libc is None:
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
            libc.mallinfo2.restype = _MallInfo2
            _allocator.libc = libc
        except (OSError, AttributeError):  # not glibc, or older than 2.33
            _allocator.libc = False
    return _allocator.libc


def mode() -> str:
    """The heap policy `PT_XLA_RETAIN_HOST_MEMORY` names: ONE_ARENA (`1`, the default),
    PER_THREAD (`threads`) or OFF (`0`)."""
    raw = (env_vars.get("PT_XLA_RETAIN_HOST_MEMORY") or "").strip().lower() or "1"
    if raw in ("1", "true", "yes", "on"):
        return ONE_ARENA
    if raw == "threads":
        return PER_THREAD
    if raw in env_vars.FALSE_WORDS:
        return OFF
    raise ValueError(f"environment variable PT_XLA_RETAIN_HOST_MEMORY={raw!r} is not one of "
                     "1, threads, 0")


def configure() -> bool:
    """Makes freed C-heap memory stay resident (see the module docstring). Called once,
    before the CPU client starts its threads; returns whether the allocator was changed."""
    if _allocator.active:
        return True
    policy = mode()
    if policy == OFF:
        return False
    libc = _glibc()
    if not libc:
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "_backends", None):
        # jax's CPU client already runs (jax was used before torch_xla): its threads
        # have their own arenas, from which large blocks are always mmapped.
        return False
    ok = (limit_arenas() and libc.mallopt(_M_MMAP_MAX, 0) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1) == 1)
    if ok and policy == PER_THREAD:
        # glibc unmaps a non-main heap whose every block is free unless the top pad
        # covers it: the next step would fault all of it in again
        ok = libc.mallopt(_M_TOP_PAD, _TOP_PAD_BYTES) == 1
    _allocator.active = ok
    _allocator.per_thread = ok and policy == PER_THREAD
    return ok


def limit_arenas() -> bool:
    """One malloc arena for every thread from now on (the first part of `configure`, taken
    as early as `import torch_xla`): a thread that allocates before the limit gets an arena
    of its own, and glibc then hands the threads started later (XLA's) the existing arenas
    in turn, whatever the limit; a large block from an arena other than the main one is
    mmapped at every allocation. Returns whether the limit was set (with
    `PT_XLA_RETAIN_HOST_MEMORY=threads` there is no limit to set: whether glibc is there)."""
    policy = mode()
    if policy == OFF:
        return False
    libc = _glibc()
    if policy == PER_THREAD:
        return bool(libc)
    return bool(libc) and libc.mallopt(_M_ARENA_MAX, 1) == 1


def active() -> bool:
    return _allocator.active


def temp_piece_bytes() -> int:
    """The largest piece a program's temporary buffer may be cut into (0: one piece)."""
    return TEMP_PIECE_BYTES if _allocator.per_thread else 0


def release() -> None:
    """Returns the C heap's free pages to the OS (glibc keeps them otherwise; with
    `configure()` it keeps them on purpose, so only a compile, which leaves hundreds of MB
    of garbage, asks for this)."""
    libc = _glibc()
    if libc:
        libc.malloc_trim(0)


def temp_bytes(compiled) -> int:
    """The temporary buffer of a compiled program, in bytes (0 when XLA does not say)."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001  (deserialised or foreign executables)
        return 0


def before_dispatch() -> int:
    """Before dispatching a program with a large temporary buffer: waits until the
    previous large program's temporary buffer is free. Returns the heap's bytes in use
    just before the dispatch, for `after_dispatch`."""
    used = settle()
    # The wait's last reading is still true (nothing was allocated since): a reading walks
    # the arena's free lists, milliseconds on a heap that keeps a step's buffers.
    return used if used is not None else _allocator.libc.mallinfo2().uordblks


def settle(release: bool = False) -> Optional[int]:
    """Waits until the last large program dispatched has run and freed its temporary
    buffer; with `release`, then returns the heap's free pages to the OS. The compiler
    calls it with `release`: its own allocations would otherwise pile on top of a step's
    resident buffers (the decoder's peak RSS came from compiling step 2's program right
    after step 1). Returns the heap's bytes in use at the last reading (None when there
    was nothing to wait for)."""
    global _last
    if _last is None:
        return None
    out, used_before, temp = _last
    _last = None
    try:
        waited = not out.is_ready()
        out.block_until_ready()
    except Exception:  # noqa: BLE001  (its error surfaces where its value is read)
        return None
    libc = _allocator.libc
    if waited:   # the outputs have only just become ready: the free follows shortly
        time.sleep(_FREE_GRACE_S)
    # XLA allocates the temporary buffer on a worker thread, at or after the dispatch,
    # and frees it after the outputs are ready: it is free once the heap is back near
    # its size before the dispatch (outputs mostly replace donated inputs).
    limit = used_before + temp // 2
    deadline = time.perf_counter() + _FREE_WAIT_S
    used = libc.mallinfo2().uordblks
    while used > limit and time.perf_counter() < deadline:
        time.sleep(0.0002)
        used = libc.mallinfo2().uordblks
    if release:
        libc.malloc_trim(0)
        return None
    return used


def after_dispatch(temp: int, used_before: int, outs) -> None:
    """Records a just-dispatched large program."""
    global _last
    if outs:
        _last = (outs[0], used_before, temp)
