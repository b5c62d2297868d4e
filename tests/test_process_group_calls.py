"""Call forms of the `xla` process group, checked in a one-process world against the CPU.

- a bare tensor where c10d passes a list raises TypeError, as gloo's group does, and is
  also a NotImplementedError (torch_xla's own group raised that for these ops);
- `reduce_scatter_coalesced` (torch_xla's name) gives the values reduce_scatter gives.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import torch_xla
from torch_xla.distributed import _xla_process_group as pgm


def _pg():
    return pgm.ProcessGroupXla(dist.HashStore(), 0, 1)


@pytest.mark.parametrize("op", ["allreduce_coalesced", "recv_anysource"])
def test_bare_tensor_is_refused_as_gloo_refuses_it(op):
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    with pytest.raises(TypeError):
        getattr(gloo, op)(torch.ones(2))
    t = torch.ones(2, device=torch_xla.device())
    with pytest.raises(TypeError) as info:
        getattr(_pg(), op)(t)
    assert isinstance(info.value, NotImplementedError)
    torch.testing.assert_close(t.cpu(), torch.ones(2))  # untouched


def test_reduce_scatter_coalesced_matches_the_cpu():
    dev = torch_xla.device()
    a, b = torch.arange(2.) + 1, torch.arange(5.) * 2
    out_a, out_b = torch.zeros(2, device=dev), torch.zeros(5, device=dev)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    work = _pg().reduce_scatter_coalesced([out_a, out_b], [[a.to(dev)], [b.to(dev)]], opts)
    work.wait()
    # One member: each output is the sum over the one member's single shard.
    torch.testing.assert_close(out_a.cpu(), a)
    torch.testing.assert_close(out_b.cpu(), b)
