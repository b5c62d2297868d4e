"""Host cost of tracing in-place elementwise ops (microseconds per op, 200 calls each).

    PJRT_DEVICE=CPU python bench/bench_inplace.py
"""
import time

import torch

import torch_xla
import torch_xla.core.xla_model as xm


def main():
    dev = torch_xla.device()
    a, b, c = (torch.rand(64, 64, device=dev) + 1 for _ in range(3))
    ops = {
        "add_": lambda: a.add_(b), "addcmul_": lambda: a.addcmul_(b, c, value=0.1),
        "addcdiv_": lambda: a.addcdiv_(b, c, value=0.1), "lerp_": lambda: a.lerp_(b, 0.1),
        "mul_": lambda: a.mul_(0.9), "div_": lambda: a.div_(b), "sqrt_": lambda: a.sqrt_(),
        "clamp_": lambda: a.clamp_(0, 5), "z + y (reference)": lambda: b + c,
    }
    print("| op | us per traced op |\n|---|---|")
    for name, f in ops.items():
        for _ in range(50):
            f()
        xm.mark_step()
        t0 = time.perf_counter()
        for _ in range(200):
            f()
        dt = (time.perf_counter() - t0) / 200 * 1e6
        xm.mark_step()
        print(f"| {name} | {dt:.1f} |")


if __name__ == "__main__":
    main()
