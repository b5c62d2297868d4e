"""Registers the `xla` device with PyTorch.

PrivateUse1 is renamed to `xla` and given a Python device guard, hooks and device
module, as torch.utils.backend_registration does for Python backends (its method
generation step is skipped: the names it would add already exist for `xla`).
"""
from __future__ import annotations

import torch

from . import executor, rng, pjrt

_done = False


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


class Stream:
    """The device's one stream: work is ordered by the graphs themselves, so waiting on
    it means waiting for every launched program."""

    def synchronize(self) -> None:
        # Launched programs only, as a CUDA stream's synchronize waits for queued kernels:
        # a barrier here would run the pending operations other threads are still
        # recording (torch.distributed.checkpoint's writer calls this from its own thread
        # while training goes on) and donate buffers those threads have just read.
        pjrt.wait_all_buffers()

    def wait_stream(self, other: "Stream") -> None:
        return None

    def query(self) -> bool:
        return True


_STREAM = Stream()


class DeviceModule:
    """`torch.xla`: what PyTorch asks a device module for."""

    @staticmethod
    def current_stream(device=None) -> Stream:
        return _STREAM

    @staticmethod
    def default_stream(device=None) -> Stream:
        return _STREAM

    @staticmethod
    def stream(s):
        import contextlib
        return contextlib.nullcontext(s)

    Stream = Stream

    # The generator exists from the start: torch.utils.checkpoint saves and restores the
    # device's random state around a recomputation only when the module says so.
    _initialized = True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device(device):
        """Context selecting a device: one generator serves every xla device."""
        import contextlib
        return contextlib.nullcontext(device)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        """The index of this process's device (`xla:<index>`, runtime.device_index), so
        that `torch.device("xla", torch.xla.current_device())` is the device it computes on."""
        return pjrt.device_index()

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return pjrt.device_count()

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        rng.set_seed(seed)

    @staticmethod
    def manual_seed(seed: int) -> None:
        rng.set_seed(seed)

    @staticmethod
    def get_rng_state(device="xla"):
        return torch.tensor([rng.state()], dtype=torch.int64)

    @staticmethod
    def set_rng_state(state, device="xla"):
        rng.set_seed(int(state.reshape(-1)[0]))

    @staticmethod
    def get_amp_supported_dtype():
        """The dtypes `torch.autocast("xla", dtype=...)` accepts."""
        return [torch.bfloat16, torch.float16, torch.float32]

    @staticmethod
    def synchronize(device=None) -> None:
        executor.sync(wait=True)


def set_autocast_dtype() -> None:
    """Patch `xla_autocast_dtype`: PyTorch/XLA's default autocast dtype (PrivateUse1's is
    float16); thread-local state of the importing thread."""
    torch.set_autocast_dtype("xla", torch.bfloat16)


def register() -> None:
    """Patch `xla_device`: PrivateUse1 named `xla`, its device module, hooks and guard."""
    global _done
    if _done:
        return
    _done = True
    torch.utils.rename_privateuse1_backend("xla")
    torch._register_device_module("xla", DeviceModule())
    torch._C._acc.register_python_privateuseone_hook(_Hooks())
    torch._C._acc.register_python_privateuseone_device_guard(_Guard())
