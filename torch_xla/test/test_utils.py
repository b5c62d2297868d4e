"""`torch_xla.test.test_utils`: progress lines and TensorBoard helpers of the training scripts.

The progress lines look like::

    | Training Device=xla:0/0 Epoch=1 Step=20 Loss=6.79297 Rate=117.16 GlobalRate=45.84 Time=06:13:36
    | Test Device=xla:0/0 Epoch=1 Accuracy=98.12 Time=06:14:10

(`Device=<device>/<global ordinal>`). The TensorBoard helpers work when the
`tensorboard` package is installed; without it `get_summary_writer` returns None
(with a warning when a log directory was asked for) and the others do nothing.
"""
from __future__ import annotations

import warnings
from datetime import datetime
from typing import Optional

import torch_xla.debug.metrics as met
from torch_xla import runtime as xr
from torch_xla._engine import env_vars as _config


def mp_test(func):
    """Decorates a `unittest.TestCase` method to run in a child process of its own; the
    test fails unless that process exits with status 0."""
    import functools
    import multiprocessing
    import unittest

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        proc = multiprocessing.Process(target=func, args=args, kwargs=kwargs)
        proc.start()
        proc.join()
        if args and isinstance(args[0], unittest.TestCase):
            args[0].assertEqual(proc.exitcode, 0)
        return proc.exitcode
    return wrapper


def _get_device_spec(device) -> str:
    ordinal = xr.global_ordinal()
    return str(device) if ordinal < 0 else f"{device}/{ordinal}"


def now(format: str = "%H:%M:%S") -> str:
    """The current local time formatted with `format`."""
    return datetime.now().strftime(format)


def get_summary_writer(logdir: Optional[str]):
    """A `torch.utils.tensorboard.SummaryWriter` for `logdir`, or None.

    None when `logdir` is empty or TensorBoard is not installed. The writer starts
    with the environment variables written as text.
    """
    if not logdir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        warnings.warn(f"TensorBoard logging to {logdir!r} is disabled: {e}", RuntimeWarning, stacklevel=2)
        return None
    writer = SummaryWriter(log_dir=logdir)
    writer.add_text("environment_variables",
                    "\n".join(f"{k}: {v}" for k, v in _config.environ_items().items()), 0)
    return writer


def _xla_metrics_scalars() -> dict:
    """Counters (by name) and metrics (`<name>__TotalSamples`, `<name>__Accumulator`) as numbers."""
    out = {}
    for name in met.counter_names():
        out[name] = met.counter_value(name)
    for name in met.metric_names():
        data = met.metric_data(name)
        if data is None:
            continue
        total, accumulator, _ = data
        out[f"{name}__TotalSamples"] = total
        out[f"{name}__Accumulator"] = accumulator
    return out


def write_to_summary(summary_writer, global_step: Optional[int] = None, dict_to_write: dict = {},
                     write_xla_metrics: bool = False) -> None:
    """Writes the scalars of `dict_to_write` (and optionally the XLA metrics) at `global_step`.

    The XLA metrics are every counter, each metric's sample count and accumulated value,
    and `aten_ops_sum`, the total of the `aten::*` (CPU fallback) counters.
    Does nothing when `summary_writer` is None.
    """
    if summary_writer is None:
        return
    for k, v in dict_to_write.items():
        summary_writer.add_scalar(k, v, global_step)
    if write_xla_metrics:
        aten_ops_sum = 0
        for name, value in _xla_metrics_scalars().items():
            if name.startswith("aten::"):
                aten_ops_sum += value
            summary_writer.add_scalar(name, value, global_step)
        summary_writer.add_scalar("aten_ops_sum", aten_ops_sum, global_step)


def close_summary_writer(summary_writer) -> None:
    """Flushes and closes `summary_writer` (None is ignored)."""
    if summary_writer:
        summary_writer.flush()
        summary_writer.close()


def print_training_update(device, step, loss, rate, global_rate, epoch=None, summary_writer=None) -> None:
    """Prints one training progress line (and writes the rates to `summary_writer`).

    Args:
      device: the device the step ran on.
      step (int): the step number within the epoch.
      loss (float or 0-dim tensor): the loss (printed with 5 decimals).
      rate (float): the current rate, samples per second.
      global_rate (float): the average rate since the start.
      epoch (int, optional): the epoch, printed when given.
      summary_writer (optional): a SummaryWriter receiving `examples/sec` and
        `average_examples/sec`.
    """
    update_data = [
        "Training",
        f"Device={_get_device_spec(device)}",
        f"Epoch={epoch}" if epoch is not None else None,
        f"Step={step}",
        "Loss={:.5f}".format(float(loss)),
        "Rate={:.2f}".format(rate),
        "GlobalRate={:.2f}".format(global_rate),
        f"Time={now()}",
    ]
    print("|", " ".join(item for item in update_data if item), flush=True)
    if summary_writer:
        write_to_summary(summary_writer, dict_to_write={
            "examples/sec": rate,
            "average_examples/sec": global_rate,
        })


def print_test_update(device, accuracy, epoch=None, step=None) -> None:
    """Prints one test progress line: device, step and epoch when given, accuracy (2 decimals)."""
    update_data = [
        "Test",
        f"Device={_get_device_spec(device)}",
        f"Step={step}" if step is not None else None,
        f"Epoch={epoch}" if epoch is not None else None,
        "Accuracy={:.2f}".format(accuracy) if accuracy is not None else None,
        f"Time={now()}",
    ]
    print("|", " ".join(item for item in update_data if item), flush=True)
