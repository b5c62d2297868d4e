"""Training through Hugging Face accelerate (tests/test_accelerate.py), in one process or
in each replica of a launched job."""
from __future__ import annotations

import torch

STEPS = 3
BATCH = 4


def data(n_batches: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_batches * BATCH, 6, generator=g)
    y = torch.randint(0, 3, (n_batches * BATCH,), generator=g)
    return x, y


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def train(rank: int = 0, world: int = 1):
    """The accelerate loop; returns (losses of this replica, final parameters on the CPU)."""
    from accelerate import Accelerator
    acc = Accelerator()
    assert acc.num_processes == world and acc.process_index == rank, (acc.num_processes, acc.process_index)
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    x, y = data(STEPS * world)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    m, opt, dl = acc.prepare(m, opt, dl)
    losses = []
    for xb, yb in dl:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(xb), yb)
        acc.backward(loss)
        opt.step()
        losses.append(loss.item())
    params = [p.detach().cpu() for p in acc.unwrap_model(m).parameters()]
    return str(acc.device), str(acc.distributed_type), losses, params


def replica(rank: int):
    """`train`, then accelerate's generator-state sync (`xm.collective_broadcast` from 0)."""
    import torch_xla.runtime as xr
    from accelerate.utils import synchronize_rng_states
    out = train(rank, xr.world_size())
    g = torch.Generator().manual_seed(100 + rank)
    synchronize_rng_states(["generator"], generator=g)
    return out + (torch.randn(3, generator=g),)
