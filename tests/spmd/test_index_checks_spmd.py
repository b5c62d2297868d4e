"""Index checks in SPMD mode: the check of a sharded gather is one value for the whole
program, and the host read raises the CPU's exception."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr


def _mesh():
    n = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), (n,), ("x",))


def test_sharded_embedding_and_target_checks():
    mesh = _mesh()
    n = mesh.size()
    w = torch.randn(16, 4)
    tokens = torch.arange(2 * n) % 16
    tokens_bad = tokens.clone()
    tokens_bad[-1] = 16   # on the last device's shard only
    xw = w.to("xla")
    xs.mark_sharding(xw, mesh, ("x", None))
    good = tokens.to("xla")
    xs.mark_sharding(good, mesh, ("x",))
    torch.testing.assert_close(F.embedding(good, xw).cpu(), F.embedding(tokens, w))
    bad = tokens_bad.to("xla")
    xs.mark_sharding(bad, mesh, ("x",))
    cerr = pytest.raises(IndexError, F.embedding, tokens_bad, w).value
    with pytest.raises(IndexError) as ei:
        F.embedding(bad, xw).cpu()
    assert str(ei.value) == str(cerr)
    logits = torch.randn(2 * n, 5)
    target = torch.arange(2 * n) % 5
    target[0] = 5
    xl = logits.to("xla")
    xs.mark_sharding(xl, mesh, ("x", None))
    cerr = pytest.raises(IndexError, F.cross_entropy, logits, target).value
    with pytest.raises(IndexError) as ei:
        F.cross_entropy(xl, target.to("xla")).item()
    assert str(ei.value) == str(cerr) == "Target 5 is out of bounds."
