"""SPMD misuse outside SPMD mode (this process never turns it on)."""
import numpy as np
import pytest
import torch

import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla._engine import launcher

from mp_scripts import workers


def test_mark_sharding_before_use_spmd_is_refused(dev):
    assert not xr.is_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,))
    with pytest.raises(RuntimeError, match="use_spmd"):
        xs.mark_sharding(torch.zeros(4, device=dev), mesh, (0,))


def test_use_spmd_in_a_replica_is_refused():
    res = launcher.spawn(workers.use_spmd_job, nprocs=2, return_results=True)
    assert set(res) == {0, 1}
    for r in res.values():
        assert r.startswith("refused: ") and "multi-process replication" in r
