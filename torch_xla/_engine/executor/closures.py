"""Step closures (`xm.add_step_closure`): run after the barrier, in order, some on a thread.

An asynchronous closure that raises makes the next barrier raise (RuntimeError, with the
closure's exception as its cause) before it runs its own closures, which are dropped."""
from __future__ import annotations

import queue
import threading
import traceback
from typing import Callable, List

_step_closures: List = []
_async_pool = {"thread": None, "queue": None, "error": None}


def add(closure: Callable, args=(), run_async: bool = False) -> None:
    _step_closures.append((closure, args, run_async))


def _async_worker(q):
    while True:
        item = q.get()
        if item is None:
            return
        fn, args = item
        try:
            if _async_pool["error"] is None:
                fn(*args)
        except Exception as e:
            traceback.print_exc()
            _async_pool["error"] = e
        finally:
            q.task_done()


def run() -> None:
    global _step_closures
    closures, _step_closures = _step_closures, []
    if _async_pool["queue"] is not None and threading.current_thread() is not _async_pool["thread"]:
        # The previous barrier's asynchronous closures have had this step to run.
        _async_pool["queue"].join()
        error, _async_pool["error"] = _async_pool["error"], None
        if error is not None:
            raise RuntimeError(f"an asynchronous step closure failed: {error!r}") from error
    for fn, args, run_async in closures:
        if run_async:
            if _async_pool["thread"] is None:
                q = queue.Queue()
                th = threading.Thread(target=_async_worker, args=(q,), daemon=True)
                th.start()
                _async_pool["thread"], _async_pool["queue"] = th, q
            _async_pool["queue"].put((fn, args))
        else:
            fn(*args)
