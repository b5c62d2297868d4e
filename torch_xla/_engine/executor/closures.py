"""Step closures (`xm.add_step_closure`): run after the barrier, in order, some on a thread."""
from __future__ import annotations

import queue
import threading
import traceback
from typing import Callable, List

_step_closures: List = []
_async_pool = {"thread": None, "queue": None}


def add(closure: Callable, args=(), run_async: bool = False) -> None:
    _step_closures.append((closure, args, run_async))


def _async_worker(q):
    while True:
        item = q.get()
        if item is None:
            return
        fn, args = item
        try:
            fn(*args)
        except Exception:
            traceback.print_exc()


def run() -> None:
    global _step_closures
    closures, _step_closures = _step_closures, []
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
