import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest  # noqa: E402
import torch  # noqa: E402,F401

import torch_xla  # noqa: E402,F401
import torch_xla.core.xla_model as xm  # noqa: E402,F401


@pytest.fixture
def dev():
    return torch_xla.device()
