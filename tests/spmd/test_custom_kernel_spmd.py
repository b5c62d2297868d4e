"""`custom_kernel.flash_attention` under SPMD with a partition spec: values, gradients and
the result's sharding against `scaled_dot_product_attention` on the CPU."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.experimental.custom_kernel as ck
import torch_xla.runtime as xr

N = xr.global_runtime_device_count()


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(ck, "BLOCK_Q", 8)
    monkeypatch.setattr(ck, "BLOCK_K", 8)


def test_flash_attention_partition_spec_matches_cpu():
    mesh = xs.Mesh(np.arange(N), (2, 2), ("data", "model"))
    spec = ("data", "model", None, None)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 4, 20, 8, generator=g) for _ in range(3))
    seg = torch.randint(0, 2, (4, 20), generator=g)
    keep = torch.ones(20, 20, dtype=torch.bool).tril()[None, None] & (seg[:, None, :, None] == seg[:, None, None, :])

    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*cpu, attn_mask=keep, scale=0.4)
    dev = [t.to("xla").requires_grad_() for t in (q, k, v)]
    s = seg.to("xla")
    out = ck.flash_attention(*dev, True, s, s, 0.4, partition_spec=spec, mesh=mesh)
    assert torch_xla._XLAC._get_xla_sharding_spec(out) == "{devices=[2,2,1,1]0,1,2,3}"
    assert torch_xla._XLAC._get_xla_sharding_spec(dev[0]) == "{devices=[2,2,1,1]0,1,2,3}"
    torch.testing.assert_close(out.cpu(), ref.detach(), atol=2e-5, rtol=1e-5)

    cot = torch.randn(ref.shape, generator=g)
    ref.backward(cot)
    out.backward(cot.to("xla"))
    for c, d in zip(cpu, dev):
        torch.testing.assert_close(d.grad.cpu(), c.grad, atol=1e-4, rtol=1e-4)


def test_flash_attention_partition_spec_with_bias_and_global_mesh():
    mesh = xs.Mesh(np.arange(N), (4, 1), ("data", "model"))
    xs.set_global_mesh(mesh)
    try:
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(4, 2, 12, 8, generator=g) for _ in range(3))
        ab = torch.randn(4, 2, 12, 12, generator=g)
        cpu = [t.clone().requires_grad_() for t in (q, k, v, ab)]
        ref = F.scaled_dot_product_attention(*cpu[:3], attn_mask=cpu[3], scale=1.0)
        dev = [t.to("xla").requires_grad_() for t in (q, k, v, ab)]
        out = ck.flash_attention(*dev[:3], ab=dev[3], partition_spec=("data", None, None, None))
        torch.testing.assert_close(out.cpu(), ref.detach(), atol=2e-5, rtol=1e-5)
        ref.sum().backward()
        out.sum().backward()
        for c, d in zip(cpu, dev):
            torch.testing.assert_close(d.grad.cpu(), c.grad, atol=1e-4, rtol=1e-4)
    finally:
        xs.set_global_mesh(None)


def test_flash_attention_partition_spec_errors():
    mesh = xs.Mesh(np.arange(N), (2, 2), ("data", "model"))
    q = torch.randn(4, 4, 8, 8).to("xla")
    with pytest.raises(ValueError, match="batch and head dimensions only"):
        ck.flash_attention(q, q, q, partition_spec=("data", None, "model", None), mesh=mesh)
    with pytest.raises(ValueError, match="4 entries"):
        ck.flash_attention(q, q, q, partition_spec=("data", None), mesh=mesh)
