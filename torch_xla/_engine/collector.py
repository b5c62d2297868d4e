"""Python's garbage collector paused around an import (patch `quiet_gc_imports`).

Kept free of torch and jax imports: `import torch_xla` enters it before anything else.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused(active: bool = True) -> Iterator[None]:
    """Runs the block with the collector paused (when `active` and the collector is on).
    When the block succeeds, its cyclic garbage, all in the youngest generation since
    nothing was collected meanwhile, is collected, then every tracked object joins the
    permanent generation (`gc.freeze()`, as `patches.tune_gc` does at jax start), so that
    no full pass rescans them. The collector's state is restored either way."""
    pause = active and gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
        if pause:
            gc.collect(0)
            gc.freeze()
    finally:
        if pause:
            gc.enable()
