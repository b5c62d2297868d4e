import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest  # noqa: E402
import torch  # noqa: E402,F401

import torch_xla  # noqa: E402,F401
import torch_xla.core.xla_model as xm  # noqa: E402,F401


@pytest.fixture
def dev():
    return torch_xla.device()


# tests/spmd/ runs in its own process with several devices and SPMD mode on (`make test`
# runs `XLA_TEST_SPMD=1 CPU_NUM_DEVICES=4 pytest tests/spmd`): SPMD mode is process-wide.
collect_ignore = [] if os.environ.get("XLA_TEST_SPMD") == "1" else ["spmd"]
