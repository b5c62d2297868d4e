"""Helpers for StableHLO export tests."""
from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch


@functools.lru_cache
def has_tf_package() -> bool:
    """Whether TensorFlow is importable (the tf.saved_model conversions need it)."""
    return importlib.util.find_spec("tensorflow") is not None


def wrap_func_as_nn_module(f: Callable) -> torch.nn.Module:
    """`f` as the forward of a module in eval mode (what `torch.export.export` takes)."""

    class M(torch.nn.Module):
        def forward(self, *args):
            return f(*args)

    return M().eval()
