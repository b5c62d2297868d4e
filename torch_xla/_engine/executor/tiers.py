"""Tiered compilation: a program's first runs use a quickly compiled executable while the
optimized one compiles on a background thread.

XLA's CPU compiler spends most of a training step's first-compile time in code generation
that a program run once or twice does not pay back. Where the platform policy names quick
options for a program (`Policy.quick_compiler_options`), `compile_graph` compiles with them
and returns that executable. The switch is at a fixed point, so a run is reproducible:
the program's first two executions use the quick executable; the second queues the
optimized compile of the same lowered program here (a program run once, such as a training
loop's first step before the optimizer has state, is never compiled twice); the third and
later use the optimized executable, waiting for it if it is not ready. XLA releases the GIL
while compiling, so tracing goes on meanwhile.

Opt-in (`XLA_TIERED_COMPILE=1`): the quick executable can round differently from the
optimized one (a few ulps in some programs), so those first two runs may differ from an
untiered run in the last bits; the options that keep every bit save too little compile
time to pay for compiling twice (bench/bench_first_step.py, BENCHMARKS.md).
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
from typing import Callable, Optional

from .. import patches, telemetry


class Pending:
    """The optimized executable of one program, being compiled in the background."""
    __slots__ = ("build", "claimed", "done", "result", "error")

    def __init__(self, build: Callable):
        self.build = build
        self.claimed = False
        self.done = threading.Event()
        self.result = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.result = self.build()
        except BaseException as e:  # noqa: BLE001  (reported to the thread that waits)
            self.error = e
        finally:
            self.build = None
            telemetry.add_sample("BackgroundCompileTime", int((time.perf_counter() - t0) * 1e9))
            self.done.set()

    def wait(self):
        """The optimized executable (compiled on this thread if the worker has not started it)."""
        if not self.done.is_set() and _claim(self):
            self.run()
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


_queue: "queue.Queue[Optional[Pending]]" = queue.Queue()
_lock = threading.Lock()


class _Background:
    """The background compiler: `thread`, started once (patch `tiered_compile_thread`) at
    the first `submit`, which tests it without the lock; `closing`, set at exit. Written
    under `_lock`; the worker reads `closing` under it."""
    __slots__ = ("thread", "closing")

    def __init__(self):
        self.thread: Optional[threading.Thread] = None
        self.closing = False


_background = _Background()


def _claim(p: Pending) -> bool:
    """True for the one caller that gets to run `p` (the worker or a waiting thread)."""
    with _lock:
        if p.claimed:
            return False
        p.claimed = True
        return True


def _worker() -> None:
    while True:
        p = _queue.get()
        if p is None:
            return
        with _lock:
            closing = _background.closing
        if not _claim(p):
            continue
        if closing:
            # At exit nobody will run the program again: leave it.
            p.error = RuntimeError("process exiting")
            p.done.set()
            continue
        p.run()


def submit(build: Callable) -> Pending:
    """Queues `build()` (the optimized compile) on the background compiler thread."""
    p = Pending(build)
    if _background.thread is None:
        patches.install("tiered_compile_thread")
    _queue.put(p)
    return p


def start_worker() -> None:
    """Patch `tiered_compile_thread`: the background compiler and its exit hook."""
    with _lock:
        t = threading.Thread(target=_worker, name="torch_xla-tiered-compile", daemon=True)
        _background.thread = t
        t.start()
        atexit.register(_shutdown)


def _shutdown() -> None:
    # Queued compiles are dropped; one in flight is waited for, so XLA is not torn down
    # under it.
    with _lock:
        _background.closing = True
        t = _background.thread
    if t is not None:
        _queue.put(None)
        t.join()
