"""The default platform policy (what GPU and TPU get)."""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

# What a program's float32 matrix products may give the platform's library handler
# (lowering/blas_cpu.py): none, only products whose reduction is long and narrow (a
# convolution's weight gradient over many images and positions), or every large one.
NO_PRODUCTS = ""
LONG_REDUCTIONS = "long-reductions"
ALL_PRODUCTS = "all"


class Policy:
    """The defaults: no options, nothing around compiles and dispatches."""
    name = "default"
    patch_convolutions = False
    widen_int4_dots = False
    # How a process of a multi-process (replication) job numbers its device: PyTorch/XLA
    # names a device by its index among the devices its process drives. On GPU and TPU a
    # process drives its own device(s) there as here, so a replica's device is `xla:0`.
    ordinal_device_index = False

    def device_index(self, global_ordinal: int) -> int:
        """The index of the device of replica `global_ordinal` (its `xla:<index>`)."""
        return global_ordinal if self.ordinal_device_index else 0

    def library_products(self) -> str:
        """Which float32 matrix products may call a library handler (lowering/blas_cpu.py):
        NO_PRODUCTS, LONG_REDUCTIONS or ALL_PRODUCTS."""
        return NO_PRODUCTS

    def compiler_options(self, ops: Iterable[Tuple[str, tuple]], library_products: str = NO_PRODUCTS) -> dict:
        """XLA options for one program; `ops` yields (op name, first output aval);
        `library_products`: which of its float32 products call the library handler."""
        return {}

    def lowered_options(self, lowered) -> dict:
        """Options that depend on the lowered program (a jax `Lowered`), on top of
        `compiler_options`."""
        return {}

    def quick_compiler_options(self, nodes: int) -> Optional[dict]:
        """Options for a quick first compile of a program of `nodes` IR nodes, whose
        optimized compile then runs in the background (executor/tiers.py); None: compile
        once."""
        return None

    def before_compile(self) -> None:
        pass

    def after_compile(self, seconds: float) -> None:
        pass

    def paced_bytes(self, compiled) -> int:
        """How much of a program's memory its dispatches must wait for (0: none)."""
        return 0

    def before_dispatch(self, paced: int):
        return None

    def after_dispatch(self, paced: int, token, outs) -> None:
        pass
