"""PyTorch on XLA devices, on the XLA compiler and PJRT runtime of jaxlib.

Importing the package registers the `xla` device and its kernels and applies the
import-time entries of the patch registry (`_engine/patches.py`, listed in
docs/ARCHITECTURE.md); jax itself starts at the first use of a device (`_engine/boot.py`).
"""
from __future__ import annotations

from ._engine import collector as _collector
from ._engine import env_vars as _env_vars
from ._engine import patches as _patches

# Patch `quiet_gc_imports`: the collector's full passes over torch's import-time objects
# were a third of this import (docs/ARCHITECTURE.md).
# `import jax` (by the lowering modules) sets TPU_SKIP_MDS_QUERY=1 on a host without TPU
# chips: undone, so that this import leaves the environment as it found it.
with _collector.paused(_patches.enabled("quiet_gc_imports")), _env_vars.kept(["TPU_SKIP_MDS_QUERY"]):
    from . import _XLAC  # noqa: E402,F401  (documented as torch_xla._XLAC)
    from ._api import (device, devices, device_count, sync, step, compile, manual_seed,  # noqa: E402
                       launch, real_devices, is_xla_tensor)
    from ._engine import executor as _executor

    # Every import-time change to PyTorch (docs/ARCHITECTURE.md's table), the last of them
    # before the collector's freeze, which would hide what `lazy_dynamo_disable` looks for.
    _patches.install_phase(_patches.IMPORT)
    _executor.activate_debugging()

# The API level: the version of PyTorch/XLA whose public API this package implements, so
# that clients gating on `torch_xla.__version__` (accelerate, Lightning) take the path
# written for it. The package's own release is `__project_version__` (its metadata).
__version__ = "2.9.0"
__project_version__ = "0.1.0"
__all__ = ["device", "devices", "device_count", "sync", "step", "compile", "manual_seed", "launch",
           "real_devices", "is_xla_tensor"]


_MODULE_ALIASES = {"xm": ".core.xla_model", "xr": ".runtime", "xmp": ".distributed.xla_multiprocessing",
                   "xu": ".utils.utils", "xenv": ".core.xla_env_vars"}


def __getattr__(name: str):
    # Subpackages on first use (`torch_xla.experimental.eager_mode(...)` after `import
    # torch_xla`), and the StableHLO export helpers (`torch_xla.save_as_stablehlo`).
    import importlib
    if name in ("save_as_stablehlo", "save_torch_model_as_stablehlo"):
        return getattr(importlib.import_module(".stablehlo", __name__), name)
    if name in ("experimental", "stablehlo", "core", "runtime", "debug", "distributed", "utils", "_dynamo",
                "backends"):
        return importlib.import_module("." + name, __name__)
    if name in _MODULE_ALIASES:   # the short names PyTorch/XLA's top-level module exposes
        return importlib.import_module(_MODULE_ALIASES[name], __name__)
    raise AttributeError(f"module 'torch_xla' has no attribute {name!r}")
