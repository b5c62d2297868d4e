"""Hugging Face accelerate drives torch_xla: `Accelerator().prepare(...)` and
`accelerator.backward` train a small model on the xla device as eager PyTorch does on
the CPU, in one process and in a launched job of two (accelerate's XLA path: its
dataloader gives each replica its own batches, its optimizer all-reduces gradients)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import torch_xla
import torch_xla.core.xla_model as xm
from torch_xla._engine import launcher

import accelerate  # noqa: E402,F401

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mp_scripts import accelerate_workers as w  # noqa: E402


def _reference(world: int):
    """Eager CPU: each step's batch is the replicas' batches together (mean of their losses)."""
    m = w.model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    x, y = w.data(w.STEPS * world)
    losses = [[] for _ in range(world)]
    for s in range(w.STEPS):
        opt.zero_grad()
        total = 0
        for r in range(world):
            b = slice((s * world + r) * w.BATCH, (s * world + r + 1) * w.BATCH)
            loss = torch.nn.functional.cross_entropy(m(x[b]), y[b])
            losses[r].append(loss.item())
            total = total + loss / world
        total.backward()
        opt.step()
    return losses, [p.detach() for p in m.parameters()]


def test_one_process_matches_cpu():
    dev, kind, losses, params = w.train()
    assert dev == str(torch_xla.device()) and kind == "DistributedType.XLA"
    ref_losses, ref_params = _reference(1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[0]), rtol=1e-5, atol=1e-6)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_two_processes_match_cpu():
    res = launcher.spawn(w.replica, nprocs=2, return_results=True)
    ref_losses, ref_params = _reference(2)
    for r in range(2):
        dev, kind, losses, params, drawn = res[r]
        assert kind == "DistributedType.XLA"
        # every replica's generator now has replica 0's state
        torch.testing.assert_close(drawn, torch.randn(3, generator=torch.Generator().manual_seed(100)))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[r]), rtol=1e-5, atol=1e-6)
        for a, b in zip(params, ref_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_version_is_the_api_level():
    import importlib.metadata
    assert torch_xla.__version__ == "2.9.0"
    assert torch_xla.__project_version__ == importlib.metadata.version("torch-xla-jax")
    from accelerate.utils import is_torch_xla_available
    assert is_torch_xla_available()


def test_set_replication_checks_its_arguments():
    xm.set_replication(torch_xla.device(), xm.get_xla_supported_devices())
    xm.set_replication("xla:0", [])
    with pytest.raises(RuntimeError, match="is not an xla device"):
        xm.set_replication("cpu", [])
    with pytest.raises(RuntimeError, match="Cannot replicate if number of devices"):
        xm.set_replication("xla:0", ["xla:0", "xla:1", "xla:2"])
