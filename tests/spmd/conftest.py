"""SPMD tests: one process, CPU_NUM_DEVICES virtual devices (default 4), SPMD mode on."""
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()
