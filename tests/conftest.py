import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest  # noqa: E402
import torch  # noqa: E402,F401

import torch_xla  # noqa: E402,F401
import torch_xla.core.xla_model as xm  # noqa: E402,F401

# As strict as CI (where PyTorch turns it on from the `CI` variable): a custom op whose
# output aliases an input is an error, not a warning.
import torch._functorch.config  # noqa: E402
torch._functorch.config.error_on_custom_op_aliasing = True


@pytest.fixture
def dev():
    return torch_xla.device()


# tests/spmd/ runs in its own process with several devices and SPMD mode on (`make test`
# runs `XLA_TEST_SPMD=1 CPU_NUM_DEVICES=4 pytest tests/spmd`): SPMD mode is process-wide.
collect_ignore = [] if os.environ.get("XLA_TEST_SPMD") == "1" else ["spmd"]
