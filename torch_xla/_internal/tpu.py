"""TPU facts (through the PJRT runtime's device kinds)."""
from __future__ import annotations

import re

from torch_xla._engine import pjrt as _rt


def version() -> int:
    """The TPU generation of this host's devices (4 for 'TPU v4'); raises off TPU."""
    if _rt.platform() != "TPU":
        raise EnvironmentError(f"no TPU: the devices are {_rt.platform()}")
    kind = _rt.local_devices()[0].device_kind
    m = re.search(r"v(\d+)", kind)
    if m is None:
        raise EnvironmentError(f"unknown TPU kind {kind!r}")
    return int(m.group(1))


def num_available_chips() -> int:
    return len(_rt.local_devices()) if _rt.platform() == "TPU" else 0
