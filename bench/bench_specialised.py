"""Generic versus specialised kernels: microseconds per traced op of the two tracing
chains, in one process, alternating which kernel is registered for add/mul/mm/relu.

    PJRT_DEVICE=CPU python bench/bench_specialised.py [--runs 30]

Prints the minimum over runs of the Python loop's CPU time per op (the minimum is the
least disturbed by other work on a shared machine).
"""
from __future__ import annotations

import argparse
import time
import warnings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch_xla._engine.kernels import KERNELS
    from torch_xla._engine.kernels.specialise import specialise
    warnings.filterwarnings("ignore", category=UserWarning)  # re-registering kernels warns
    dev = torch_xla.device()
    y = (torch.rand(64, 64) / 64).to(dev)
    names = ["add.Tensor", "mul.Tensor", "mm.default", "relu.default"]
    libs = []

    def use(specialised: bool) -> None:
        lib = torch.library.Library("aten", "IMPL")
        for n in names:
            k = KERNELS[n]
            lib.impl(n.replace(".default", ""), specialise(k) if specialised else k, "PrivateUse1")
        libs.append(lib)

    def run(mixed: bool) -> float:
        z = torch.rand(64, 64).to(dev)
        xm.mark_step()
        xm.wait_device_ops()
        t = time.process_time()
        if mixed:
            for _ in range(250):
                z = torch.relu(z @ y * 0.5 + 1.0)
        else:
            for _ in range(1000):
                z = z + y
        dt = time.process_time() - t
        xm.mark_step()
        xm.wait_device_ops()
        return dt / 1000 * 1e6

    for mixed in (False, True):
        res = {False: [], True: []}
        for _ in range(args.runs):
            for spec in (False, True):
                use(spec)
                res[spec].append(run(mixed))
        chain = "250 x relu(z @ y * 0.5 + 1.0)" if mixed else "1000 x z = z + y"
        print(f"{chain}: generic {min(res[False]):.2f} us/op, specialised {min(res[True]):.2f} us/op")


if __name__ == "__main__":
    main()
