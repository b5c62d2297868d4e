"""Helpers for StableHLO export tests."""
from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable, Tuple

import numpy as np
import torch
from torch.utils import _pytree as pytree


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


def load_save_model_and_inference(path: str, args: Tuple[Any, ...]) -> Any:
    """Runs the TensorFlow SavedModel at `path` (its function `f`) on `args` (needs TensorFlow)."""
    if not has_tf_package():
        raise ImportError("load_save_model_and_inference needs the tensorflow package")
    import tensorflow as tf
    loaded = tf.saved_model.load(path)
    tf_args = pytree.tree_map_only(torch.Tensor, lambda t: tf.constant(t.numpy()), args)
    return loaded.f(*tf_args)


def compare_exported_program_and_saved_model_result(ep: torch.export.ExportedProgram, saved_model_path: str,
                                                    args: Tuple[Any, ...], atol: float = 1e-7) -> tuple:
    """Checks that `ep` run by PyTorch and the SavedModel at `saved_model_path` agree on `args`
    (same number of outputs, dtypes, values within `atol`); returns both as numpy arrays."""
    tf_out = load_save_model_and_inference(saved_model_path, args)
    with torch.no_grad():
        torch_out = ep.module()(*args)
    if not isinstance(torch_out, tuple):
        torch_out = (torch_out,)
    if len(torch_out) != len(tf_out):
        raise AssertionError(f"{len(torch_out)} outputs from PyTorch, {len(tf_out)} from the SavedModel")
    ours = tuple(t.numpy() for t in torch_out)
    theirs = tuple(t.numpy() for t in tf_out)
    for a, b in zip(ours, theirs):
        if a.dtype != b.dtype:
            raise AssertionError(f"dtype {a.dtype} from PyTorch, {b.dtype} from the SavedModel")
        if not np.allclose(a, b, atol=atol):
            raise AssertionError(f"values differ beyond atol={atol}")
    return ours, theirs
