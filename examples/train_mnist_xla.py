"""Trains a small CNN on MNIST on the XLA device (the project's main demo).

Shaped like PyTorch/XLA's test/test_train_mp_mnist.py and written only against the
documented torch_xla API:

    PJRT_DEVICE=CPU python examples/train_mnist_xla.py --fake_data --num_epochs 1 --num_steps 60

With --fake_data the data is a fixed random batch whose labels can be read from the
images (a brighter 2-row band marks the class), so the loss goes down. Without it,
the MNIST files (train-images-idx3-ubyte[.gz] etc.) are read from --datadir.
"""
import argparse
import gzip
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
import torch_xla.test.test_utils as test_utils
import torch_xla.utils.utils as xu


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="MNIST training on an XLA device")
    p.add_argument("--datadir", default="/tmp/mnist-data")
    p.add_argument("--logdir", default=None)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--num_epochs", type=int, default=1)
    p.add_argument("--num_steps", type=int, default=None,
                   help="cap on the training (and test) steps per epoch")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--log_steps", type=int, default=20)
    p.add_argument("--num_workers", type=int, default=0)
    p.add_argument("--drop_last", action="store_true")
    p.add_argument("--fake_data", action="store_true")
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--pjrt_distributed", action="store_true")
    p.add_argument("--async_closures", action="store_true")
    p.add_argument("--metrics_debug", action="store_true")
    p.add_argument("--target_accuracy", type=float, default=0.0)
    return p.parse_args(argv)


class MNIST(nn.Module):

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.bn1 = nn.BatchNorm2d(10)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.bn2 = nn.BatchNorm2d(20)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = self.bn1(x)
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = self.bn2(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def _fake_batch(batch_size, seed):
    """A fixed random batch: noise images, each with a brighter 2-row band at rows 4+2k..5+2k for label k.

    The labels can be read from the images, so the loss goes down and the test accuracy
    (on another such batch) is meaningful.
    """
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (batch_size,), generator=g, dtype=torch.int64)
    images = torch.randn(batch_size, 1, 28, 28, generator=g)
    rows = torch.arange(28)
    band = torch.where((rows >= 4) & (rows < 24), (rows - 4) // 2, torch.full_like(rows, -1))
    mask = (band[None, :] == labels[:, None]).to(images.dtype)      # (batch, 28 rows)
    images += 2.0 * mask[:, None, :, None]
    return images, labels


def _read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        magic = struct.unpack(">I", f.read(4))[0]
        ndim = magic & 0xFF
        dims = struct.unpack(">" + "I" * ndim, f.read(4 * ndim))
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(dims)


def _mnist_dataset(datadir, prefix):
    def find(name):
        for cand in (name, name + ".gz"):
            p = os.path.join(datadir, cand)
            if os.path.exists(p):
                return p
        raise FileNotFoundError(
            f"{os.path.join(datadir, name)}[.gz] not found: put the MNIST idx files in --datadir "
            f"or run with --fake_data")
    images = _read_idx(find(f"{prefix}-images-idx3-ubyte"))
    labels = _read_idx(find(f"{prefix}-labels-idx1-ubyte"))
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    x = (x - 0.1307) / 0.3081
    return torch.utils.data.TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


def _make_loaders(flags):
    world = xr.world_size()
    if flags.fake_data:
        # One global batch of batch_size * world samples; each replica takes its slice, so N
        # replicas with --batch_size B see exactly the data of one process with N * B.
        rank = xr.global_ordinal()

        def shard(images, labels):
            lo, hi = rank * flags.batch_size, (rank + 1) * flags.batch_size
            return images[lo:hi].clone(), labels[lo:hi].clone()

        train_loader = xu.SampleGenerator(
            data=shard(*_fake_batch(flags.batch_size * world, seed=1234)),
            sample_count=60000 // flags.batch_size // world)
        test_loader = xu.SampleGenerator(
            data=shard(*_fake_batch(flags.batch_size * world, seed=4321)),
            sample_count=10000 // flags.batch_size // world)
        return train_loader, test_loader
    train_dataset = _mnist_dataset(flags.datadir, "train")
    test_dataset = _mnist_dataset(flags.datadir, "t10k")
    train_sampler = None
    if world > 1:
        train_sampler = torch.utils.data.distributed.DistributedSampler(
            train_dataset, num_replicas=world, rank=xr.global_ordinal(), shuffle=True)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=flags.batch_size, sampler=train_sampler,
        drop_last=flags.drop_last, shuffle=train_sampler is None, num_workers=flags.num_workers)
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=flags.batch_size, drop_last=flags.drop_last, shuffle=False,
        num_workers=flags.num_workers)
    return train_loader, test_loader


def _train_update(device, step, loss, tracker, epoch, writer):
    test_utils.print_training_update(device, step, loss.item(), tracker.rate(), tracker.global_rate(),
                                     epoch, summary_writer=writer)


def train_mnist(flags):
    if flags.ddp or flags.pjrt_distributed:
        import importlib
        import torch.distributed as dist
        try:
            importlib.import_module("torch_xla.distributed.xla_backend")  # registers the 'xla' backend
        except ImportError as e:
            sys.exit(f"--ddp/--pjrt_distributed need the 'xla' torch.distributed backend "
                     f"(torch_xla.distributed.xla_backend): {e}")
        dist.init_process_group("xla", init_method="xla://")

    torch.manual_seed(1)
    train_loader, test_loader = _make_loaders(flags)

    # Scale the learning rate with the number of replicas.
    lr = flags.lr * xr.world_size()

    device = torch_xla.device()
    model = MNIST().to(device)
    # Parameter initialisation may differ between replicas: start them all from the master's.
    xm.broadcast_master_param(model)
    if flags.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, gradient_as_bucket_view=True)
    writer = None
    if xm.is_master_ordinal():
        writer = test_utils.get_summary_writer(flags.logdir)
    optimizer = optim.SGD(model.parameters(), lr=lr, momentum=flags.momentum)
    loss_fn = nn.NLLLoss()
    totals = {"samples": 0, "seconds": 0.0}

    def train_loop_fn(loader, epoch):
        tracker = xm.RateTracker()
        model.train()
        start = time.time()
        steps = 0
        for step, (data, target) in enumerate(loader):
            if flags.num_steps is not None and step >= flags.num_steps:
                break
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()
            if flags.ddp:
                optimizer.step()
            else:
                xm.optimizer_step(optimizer)
            tracker.add(flags.batch_size)
            steps += 1
            if step % flags.log_steps == 0:
                xm.add_step_closure(_train_update, args=(device, step, loss, tracker, epoch, writer),
                                    run_async=flags.async_closures)
        torch_xla.sync()
        xm.wait_device_ops()
        totals["samples"] += steps * flags.batch_size
        totals["seconds"] += time.time() - start

    def test_loop_fn(loader):
        total_samples = 0
        correct = 0
        model.eval()
        with torch.no_grad():
            for step, (data, target) in enumerate(loader):
                if flags.num_steps is not None and step >= flags.num_steps:
                    break
                output = model(data)
                pred = output.max(1, keepdim=True)[1]
                correct += pred.eq(target.view_as(pred)).sum()
                total_samples += data.size()[0]
        accuracy = 100.0 * float(correct.item() if torch.is_tensor(correct) else correct) / max(total_samples, 1)
        accuracy = xm.mesh_reduce("test_accuracy", accuracy, np.mean)
        return accuracy

    train_device_loader = pl.MpDeviceLoader(train_loader, device)
    test_device_loader = pl.MpDeviceLoader(test_loader, device)
    accuracy, max_accuracy = 0.0, 0.0
    for epoch in range(1, flags.num_epochs + 1):
        xm.master_print("Epoch {} train begin {}".format(epoch, test_utils.now()))
        train_loop_fn(train_device_loader, epoch)
        xm.master_print("Epoch {} train end {}".format(epoch, test_utils.now()))
        accuracy = test_loop_fn(test_device_loader)
        xm.master_print("Epoch {} test end {}, Accuracy={:.2f}".format(epoch, test_utils.now(), accuracy))
        max_accuracy = max(accuracy, max_accuracy)
        test_utils.write_to_summary(writer, epoch, dict_to_write={"Accuracy/test": accuracy},
                                    write_xla_metrics=True)
        if flags.metrics_debug:
            xm.master_print(met.metrics_report())

    test_utils.close_summary_writer(writer)
    xm.master_print("Max Accuracy: {:.2f}%".format(max_accuracy))
    xm.master_print(met.short_metrics_report())
    rate = totals["samples"] / totals["seconds"] if totals["seconds"] > 0 else 0.0
    xm.master_print("Training rate: {:.2f} samples/sec ({} samples in {:.2f}s, {} replica(s))".format(
        rate, totals["samples"], totals["seconds"], xr.world_size()))
    return max_accuracy


def _mp_fn(index, flags):
    torch.set_default_dtype(torch.float32)
    accuracy = train_mnist(flags)
    if flags.target_accuracy and accuracy < flags.target_accuracy:
        print("Accuracy {} is below target {}".format(accuracy, flags.target_accuracy), file=sys.stderr)
        sys.exit(21)


if __name__ == "__main__":
    torch_xla.launch(_mp_fn, args=(parse_args(),))
