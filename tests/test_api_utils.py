"""The script-facing utilities: xm.RateTracker, torch_xla.utils.utils (xu), the device
loaders (pl.MpDeviceLoader / pl.ParallelLoader), torch_xla.utils.serialization (xser),
xm.save atomicity, torch_xla.test.test_utils, and the MNIST demo end to end.

Values are always compared with the CPU tensors they came from (or with eager PyTorch).
"""
from __future__ import annotations

import collections
import gc
import os
import re
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.parallel_loader as pl
import torch_xla.test.test_utils as test_utils
import torch_xla.utils.serialization as xser
import torch_xla.utils.utils as xu
from torch_xla.core import _rate

from helpers import assert_same

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "train_mnist_xla.py")


def _wait_threads(baseline: int, timeout: float = 10.0) -> int:
    """Waits until the live thread count drops to `baseline` (returns the last count)."""
    deadline = time.time() + timeout
    while True:
        gc.collect()
        n = threading.active_count()
        if n <= baseline or time.time() > deadline:
            return n
        time.sleep(0.01)


def _batches(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(n)]


# ---- RateTracker --------------------------------------------------------------------------------

class _Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_rate_tracker_rates_and_smoothing(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(_rate.time, "time", clock)
    assert xm.RateTracker is _rate.RateTracker
    tr = xm.RateTracker()                    # smooth_factor 0.4
    tr.add(50)
    tr.add(50)
    clock.t += 2.0
    assert tr.rate() == pytest.approx(50.0)  # first report: 100 samples / 2 s
    assert tr.global_rate() == pytest.approx(50.0)
    tr.add(300)
    clock.t += 1.0
    # 0.6 * 300/s + 0.4 * 50/s
    assert tr.rate() == pytest.approx(0.6 * 300 + 0.4 * 50)
    assert tr.global_rate() == pytest.approx(400 / 3.0)
    tr.add(30)                               # not yet reported: still in the global rate
    clock.t += 1.0
    assert tr.global_rate() == pytest.approx(430 / 4.0)
    assert tr.rate() == tr._partial_rate     # the report becomes the smoothing base


def test_rate_tracker_custom_smoothing_and_zero_time(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(_rate.time, "time", clock)
    tr = _rate.RateTracker(smooth_factor=0.0)
    assert tr.rate() == 0.0 and tr.global_rate() == 0.0   # no time elapsed
    tr.add(10)
    clock.t += 1.0
    assert tr.rate() == pytest.approx(10.0)
    tr.add(40)
    clock.t += 1.0
    assert tr.rate() == pytest.approx(40.0)               # no smoothing
    tr2 = _rate.RateTracker(smooth_factor=1.0)
    tr2.add(10)
    clock.t += 1.0
    tr2.rate()
    tr2.add(1000)
    clock.t += 1.0
    assert tr2.rate() == pytest.approx(10.0)              # fully smoothed: keeps the first rate


def test_rate_tracker_real_clock():
    tr = xm.RateTracker()
    tr.add(100)
    time.sleep(0.05)
    r = tr.rate()
    assert 0 < r <= 100 / 0.05 * 1.01
    assert 0 < tr.global_rate() <= r * 1.01


# ---- torch_xla.utils.utils ----------------------------------------------------------------------

def test_sample_generator():
    data = (torch.randn(2, 3), torch.tensor([1, 2]))
    gen = xu.SampleGenerator(data=data, sample_count=5)
    assert len(gen) == 5
    items = list(gen)
    assert len(items) == 5 and all(it is data for it in items)
    assert len(list(gen)) == 5            # each iter() starts over (one generator, many epochs)
    it = iter(gen)
    assert next(it) is data and it.next() is data
    assert len(list(it)) == 3
    assert list(xu.SampleGenerator(data, 0)) == []


def test_fn_data_generator():
    gen = xu.FnDataGenerator(lambda x: x.sum(dim=1), batch_size=4, gen_tensor=torch.randn, dims=[3], count=3)
    assert len(gen) == 3
    items = list(gen)
    assert len(items) == 3
    for data, target in items:
        assert data.shape == (4, 3)
        torch.testing.assert_close(target, data.sum(dim=1))
    assert not torch.equal(items[0][0], items[1][0])   # fresh data every step


def test_nested_helpers():
    assert xu.shape([[1, 2, 3], [4, 5, 6]]) == [2, 3]
    assert xu.shape((1, 2)) == [2]
    assert xu.shape(7) == []
    with pytest.raises(ValueError):
        xu.shape([[1, 2], [3]])
    assert xu.flatten_nested_tuple((1, [2, (3, 4)], 5)) == (1, 2, 3, 4, 5)
    assert xu.flatten_nested_tuple(7) == (7,)
    assert xu.as_list((1, 2)) == [1, 2] and xu.as_list(3) == [3]
    src = [1]
    assert xu.list_copy_append(src, 2) == [1, 2] and src == [1]


def test_for_each_instance_and_rewrite():
    Point = collections.namedtuple("Point", "x y")
    t = torch.ones(2)
    sd = collections.OrderedDict(a=t, b=[Point(torch.zeros(1), 3), {"c": t}], d="s")
    sd._metadata = {"": {"version": 1}}
    seen = []
    xu.for_each_instance(sd, lambda v: isinstance(v, torch.Tensor), seen.append)
    assert len(seen) == 2 and seen[0] is t   # each object once (`t` is held twice)
    out = xu.for_each_instance_rewrite(sd, lambda v: isinstance(v, torch.Tensor), lambda v: v + 1)
    assert type(out) is collections.OrderedDict and out._metadata == sd._metadata
    assert isinstance(out["b"][0], Point) and out["b"][0].y == 3
    torch.testing.assert_close(out["a"], t + 1)
    torch.testing.assert_close(out["b"][0].x, torch.ones(1))
    assert out["b"][1]["c"] is out["a"]     # one object is converted once
    assert out["d"] == "s"


def test_getenv_as(monkeypatch):
    monkeypatch.setenv("XU_TEST_INT", "42")
    monkeypatch.setenv("XU_TEST_BOOL", "false")
    monkeypatch.delenv("XU_TEST_MISSING", raising=False)
    assert xu.getenv_as("XU_TEST_INT", int) == 42
    assert xu.getenv_as("XU_TEST_BOOL", bool) is False
    assert xu.getenv_as("XU_TEST_MISSING", int, 7) == 7
    monkeypatch.setenv("XU_TEST_BOOL", "1")
    assert xu.getenv_as("XU_TEST_BOOL", bool) is True


def test_print_fns_and_timed(monkeypatch, capsys):
    monkeypatch.setenv("DEBUG", "0")
    assert xu.get_print_fn() is xu.null_print
    monkeypatch.setenv("DEBUG", "1")
    assert xu.get_print_fn() is xu.eprint
    assert xu.get_print_fn(False) is xu.null_print
    xu.eprint("to", "stderr")
    captured = capsys.readouterr()
    assert captured.err == "to stderr\n" and captured.out == ""
    lines = []
    assert xu.timed(lambda: 5, msg="step: ", printfn=lines.append) == 5
    assert len(lines) == 1 and re.fullmatch(r"step: \d+\.\d{3}ms", lines[0])
    assert xu.timed(lambda: 6, msg="t=") == 6   # default printfn: stderr
    assert re.fullmatch(r"t=\d+\.\d{3}ms\n", capsys.readouterr().err)


def test_tmp_folder():
    with xu.TmpFolder() as tmp:
        path = tmp.name
        assert os.path.isdir(path)
    assert not os.path.exists(path)


# ---- device loaders -----------------------------------------------------------------------------

def test_mp_device_loader_values_and_device(dev):
    data = _batches(6)
    loader = pl.MpDeviceLoader(data, dev)
    assert len(loader) == 6
    for epoch in range(2):                     # each iter() is a new ParallelLoader
        out = list(loader)
        assert len(out) == 6
        for (x, y), (cx, cy) in zip(out, data):
            assert x.device == dev and y.device == dev
            assert xm.is_xla_tensor(x) and xm.is_xla_tensor(y)
            assert_same(x, cx)
            assert_same(y, cy)


def test_mp_device_loader_sample_generator_and_len(dev):
    batch = (torch.randn(8, 1, 4, 4), torch.arange(8))
    gen = xu.SampleGenerator(batch, 4)
    it = iter(pl.MpDeviceLoader(gen, dev))
    assert len(it) == 4
    out = list(it)
    assert len(out) == 4
    for x, y in out:
        assert_same(x, batch[0])
        assert_same(y, batch[1])


class _Pair(xu.DataWrapper):
    def __init__(self, a, b, tag):
        super().__init__()
        self.a, self.b, self.tag = a, b, tag

    def get_tensors(self):
        return [self.a, self.b]

    def from_tensors(self, tensors):
        return _Pair(tensors[0], tensors[1], self.tag)


def test_mp_device_loader_nested_structures(dev):
    Batch = collections.namedtuple("Batch", "x y")
    cpu = [
        {"img": torch.randn(2, 3), "meta": [torch.arange(3), "name", 7],
         "nt": Batch(torch.ones(2), torch.zeros(2, dtype=torch.bool)),
         "od": collections.OrderedDict(z=torch.tensor(1.5)), "wrap": _Pair(torch.randn(2), torch.arange(2), "t")}
        for _ in range(3)
    ]
    out = list(pl.MpDeviceLoader(cpu, dev))
    assert len(out) == 3
    for o, c in zip(out, cpu):
        assert set(o) == set(c)
        assert_same(o["img"], c["img"])
        assert o["img"].device == dev
        assert_same(o["meta"][0], c["meta"][0])
        assert o["meta"][1:] == ["name", 7]
        assert isinstance(o["nt"], Batch)
        assert_same(o["nt"].x, c["nt"].x)
        assert o["nt"].y.dtype == torch.bool and o["nt"].y.device == dev
        assert_same(o["nt"].y, c["nt"].y)
        assert type(o["od"]) is collections.OrderedDict
        assert_same(o["od"]["z"], c["od"]["z"])
        assert isinstance(o["wrap"], _Pair) and o["wrap"].tag == "t"
        assert o["wrap"].a.device == dev
        assert_same(o["wrap"].a, c["wrap"].a)
        assert_same(o["wrap"].b, c["wrap"].b)


def test_mp_device_loader_wraps_torch_dataloader(dev):
    ds = torch.utils.data.TensorDataset(torch.randn(30, 3), torch.arange(30))
    dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False, drop_last=True)
    loader = pl.MpDeviceLoader(dl, dev)
    assert len(loader) == len(dl) == 3
    out = list(loader)
    assert len(out) == 3
    for i, (x, y) in enumerate(out):
        assert x.device == dev
        assert_same(x, ds.tensors[0][i * 8:(i + 1) * 8])
        assert_same(y, ds.tensors[1][i * 8:(i + 1) * 8])


def test_parallel_loader_api_and_order_with_many_transfer_threads(dev):
    data = _batches(25, seed=3)
    para = pl.ParallelLoader(data, [dev], host_to_device_transfer_threads=3,
                             loader_prefetch_size=2, device_prefetch_size=1)
    assert para.per_device_samples() == 25
    assert para.batches_per_execution == 1
    it = para.per_device_loader(dev)
    assert len(it) == 25
    out = list(it)
    assert len(out) == 25
    for (x, y), (cx, cy) in zip(out, data):     # loader order is kept
        assert_same(x, cx)
        assert_same(y, cy)
    with pytest.raises(ValueError):
        para.per_device_loader("xla:5")
    with pytest.raises(ValueError):
        pl.ParallelLoader(data, [dev], batches_per_execution=0)


def test_parallel_loader_round_robin_over_devices(monkeypatch):
    # This host has one xla device: the transfer is stubbed to record where each batch goes.
    sent = []

    def fake_send(datas, device, input_sharding=None):
        sent.append((str(device), input_sharding))
        return [t.clone() for t in datas]

    monkeypatch.setattr(xm, "send_cpu_data_to_device", fake_send)
    data = [torch.full((2,), float(i)) for i in range(7)]
    para = pl.ParallelLoader(data, ["xla:0", "xla:1"], input_sharding="spec")
    assert para.per_device_samples() == 3
    got0 = [int(t[0]) for t in para.per_device_loader("xla:0")]
    got1 = [int(t[0]) for t in para.per_device_loader(torch.device("xla", 1))]
    assert got0 == [0, 2, 4] and got1 == [1, 3, 5]      # i-th batch -> devices[i % 2]; the odd one out is dropped
    assert sorted(sent) == sorted([("xla:0", "spec")] * 3 + [("xla:1", "spec")] * 3)
    with pytest.raises(ValueError, match="distinct"):
        pl.ParallelLoader(data, ["xla:0", "xla:0"])


def test_parallel_loader_device_string_and_training_step(dev):
    # The loader's batches feed a real training step; the weights match eager CPU training.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model_x = torch.nn.Linear(3, 2).to(dev)
    model_x.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_x = torch.optim.SGD(model_x.parameters(), lr=0.1)
    data = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(5)]
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for x, y in pl.ParallelLoader(data, ["xla:0"]).per_device_loader("xla:0"):
        opt_x.zero_grad()
        torch.nn.functional.cross_entropy(model_x(x), y).backward()
        xm.optimizer_step(opt_x)
    assert_same(model_x.weight, model.weight)
    assert_same(model_x.bias, model.bias)


@pytest.mark.parametrize("bpe", [1, 3])
def test_barrier_every_batches_per_execution(dev, monkeypatch, bpe):
    n = 7
    data = _batches(n, seed=5)
    marks = []
    real_mark_step = xm.mark_step

    def counting_mark_step(*a, **k):
        marks.append(len(seen))
        return real_mark_step(*a, **k)

    monkeypatch.setattr(xm, "mark_step", counting_mark_step)
    seen = []
    executed_before = []
    acc = torch.zeros((), device=dev)
    torch_xla.sync()
    for x, y in pl.MpDeviceLoader(data, dev, batches_per_execution=bpe):
        executed_before.append(met.counter_value("ExecuteCount") or 0)
        seen.append(x)
        acc = acc + x.sum() * 2 + y.sum()        # pending work of this batch
    executed_after = met.counter_value("ExecuteCount") or 0
    # xm.mark_step() before every bpe-th batch (counting from the first), and at the end.
    assert marks == [i for i in range(n) if i % bpe == 0] + [n], str(marks)
    # The pending work really ran at those barriers: ExecuteCount grew right after them.
    grew = [i for i in range(1, n) if executed_before[i] > executed_before[i - 1]]
    assert grew == [i for i in range(1, n) if i % bpe == 0]
    assert executed_after > executed_before[-1]
    expect = sum(cx.sum() * 2 + cy.sum() for cx, cy in data)
    assert torch_xla._engine.tensor.state_of(acc).is_data      # materialised by the last barrier
    torch.testing.assert_close(acc.cpu(), expect, rtol=1e-5, atol=1e-5)


def test_exhausted_loader_leaves_no_threads(dev):
    baseline = threading.active_count()
    out = list(pl.MpDeviceLoader(_batches(5), dev, host_to_device_transfer_threads=2))
    assert len(out) == 5
    assert _wait_threads(baseline) == baseline


def test_abandoned_iterator_stops_threads(dev):
    baseline = threading.active_count()
    gen = xu.SampleGenerator((torch.randn(16, 8), torch.arange(16)), 10_000)
    it = iter(pl.MpDeviceLoader(gen, dev, loader_prefetch_size=2, device_prefetch_size=1))
    x, y = next(it)
    assert_same(x, gen._data[0])
    assert threading.active_count() >= baseline + 2      # reader + upload threads are running
    del it
    assert _wait_threads(baseline) == baseline


def test_break_out_of_for_loop_stops_threads(dev):
    baseline = threading.active_count()
    gen = xu.SampleGenerator((torch.randn(4, 2), torch.arange(4)), 10_000)
    for i, (x, y) in enumerate(pl.MpDeviceLoader(gen, dev)):
        if i == 2:
            break
    assert_same(x, gen._data[0])
    del x, y
    assert _wait_threads(baseline) == baseline


def test_explicit_close(dev):
    baseline = threading.active_count()
    gen = xu.SampleGenerator((torch.randn(4, 2),), 10_000)
    para = pl.ParallelLoader(gen, [dev], host_to_device_transfer_threads=2)
    it = para.per_device_loader(dev)
    next(it)
    para.close()
    assert _wait_threads(baseline) == baseline
    assert para is not None and it is not None           # the objects are still alive
    with pytest.raises(StopIteration):
        next(it)


def _failing_loader(n_ok, exc):
    data = _batches(n_ok, seed=9)

    class Loader:
        def __len__(self):
            return n_ok + 1

        def __iter__(self):
            for b in data:
                yield b
            raise exc

    return Loader(), data


def test_loader_exception_propagates(dev):
    baseline = threading.active_count()
    loader, data = _failing_loader(3, ValueError("boom in the loader"))
    it = iter(pl.MpDeviceLoader(loader, dev))
    for cx, cy in data:                       # the good batches come first, in order
        x, y = next(it)
        assert_same(x, cx)
        assert_same(y, cy)
    with pytest.raises(ValueError, match="boom in the loader"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    del it
    assert _wait_threads(baseline) == baseline


def test_loader_exception_in_for_loop(dev):
    loader, data = _failing_loader(2, KeyError("missing sample"))
    got = []
    with pytest.raises(KeyError, match="missing sample"):
        for x, y in pl.MpDeviceLoader(loader, dev):
            got.append(x)
    assert len(got) == 2
    assert_same(got[1], data[1][0])


def test_transfer_exception_propagates(dev):
    class Bad(xu.DataWrapper):
        def get_tensors(self):
            return [torch.ones(1)]

        def from_tensors(self, tensors):
            raise RuntimeError("cannot rebuild")

    baseline = threading.active_count()
    it = iter(pl.MpDeviceLoader([(torch.ones(2),), (Bad(),), (torch.ones(2),)], dev))
    assert_same(next(it)[0], torch.ones(2))
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        next(it)
    del it
    assert _wait_threads(baseline) == baseline


def test_no_hang_at_interpreter_exit(tmp_path):
    script = tmp_path / "exit_with_live_loader.py"
    script.write_text(
        "import torch, torch_xla\n"
        "import torch_xla.distributed.parallel_loader as pl\n"
        "import torch_xla.utils.utils as xu\n"
        "gen = xu.SampleGenerator((torch.randn(8, 8),), 100000)\n"
        "LOADER = iter(pl.MpDeviceLoader(gen, torch_xla.device()))\n"
        "x = next(LOADER)[0]\n"
        "print('sum', float(x.sum()), float(gen._data[0].sum()))\n")
    env = dict(os.environ, PJRT_DEVICE="CPU")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    a, b = map(float, res.stdout.split()[1:3])
    assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


# ---- torch_xla.utils.serialization ------------------------------------------------------------

def _state(dev):
    torch.manual_seed(0)
    cpu = {
        "w": torch.randn(4, 3),
        "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(3).to(torch.bfloat16),
        "nested": [torch.randn(2), (torch.randn(1, 2), 5)],
        "cpu_tensor": torch.randn(2),
        "step": 17,
        "name": "ckpt",
    }
    xla = dict(cpu)
    for k in ("w", "i", "mask", "half"):
        xla[k] = cpu[k].to(dev)
    xla["nested"] = [cpu["nested"][0].to(dev), (cpu["nested"][1][0].to(dev), 5)]
    return cpu, xla


def _check_loaded(loaded, cpu):
    for k in ("w", "i", "mask", "half", "cpu_tensor"):
        assert loaded[k].device.type == "cpu"
        assert loaded[k].dtype == cpu[k].dtype
        torch.testing.assert_close(loaded[k], cpu[k], rtol=0, atol=0)
    torch.testing.assert_close(loaded["nested"][0], cpu["nested"][0], rtol=0, atol=0)
    assert isinstance(loaded["nested"][1], tuple) and loaded["nested"][1][1] == 5
    torch.testing.assert_close(loaded["nested"][1][0], cpu["nested"][1][0], rtol=0, atol=0)
    assert loaded["step"] == 17 and loaded["name"] == "ckpt"


def test_xser_round_trip(dev, tmp_path):
    cpu, xla = _state(dev)
    path = tmp_path / "ckpt.pt"
    xser.save(xla, str(path))
    assert path.is_file()
    folders = [p for p in os.listdir(tmp_path) if p.startswith("ckpt.pt.tensors")]
    assert len(folders) == 1
    assert len(os.listdir(tmp_path / folders[0])) == 6        # one file per XLA tensor
    _check_loaded(xser.load(str(path)), cpu)
    _check_loaded(xser.load(path), cpu)                         # PathLike works too


def test_xser_model_state_dict(dev, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    xmodel = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)).to(dev)
    xmodel.load_state_dict(model.state_dict())
    path = str(tmp_path / "model.pt")
    xser.save(xmodel.state_dict(), path)
    sd = xser.load(path)
    assert list(sd) == list(model.state_dict())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0)
    fresh = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)).to(dev)
    fresh.load_state_dict(sd)                                   # metadata kept: strict load works
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert p.device == dev
        assert_same(p, q)


def test_xser_shared_tensor_and_parameter(dev, tmp_path):
    t = torch.randn(3)
    xt = t.to(dev)
    p = torch.nn.Parameter(torch.randn(2).to(dev))
    path = str(tmp_path / "shared.pt")
    xser.save({"a": xt, "b": [xt], "p": p}, path)
    out = xser.load(path)
    assert out["a"] is out["b"][0]
    torch.testing.assert_close(out["a"], t, rtol=0, atol=0)
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad
    torch.testing.assert_close(out["p"].detach(), p.detach().cpu(), rtol=0, atol=0)


def test_xser_overwrite_replaces_old_tensors(dev, tmp_path):
    path = str(tmp_path / "c.pt")
    xser.save({"x": torch.ones(2).to(dev)}, path)
    xser.save({"x": torch.full((3,), 2.0).to(dev), "y": torch.zeros(1).to(dev)}, path)
    folders = [p for p in os.listdir(tmp_path) if p.startswith("c.pt.tensors")]
    assert len(folders) == 1
    out = xser.load(path)
    torch.testing.assert_close(out["x"], torch.full((3,), 2.0))
    torch.testing.assert_close(out["y"], torch.zeros(1))


def test_xser_failed_save_keeps_previous(dev, tmp_path, monkeypatch):
    path = str(tmp_path / "c.pt")
    xser.save({"x": torch.ones(2).to(dev)}, path)
    real_save = torch.save
    calls = []

    def failing_save(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        xser.save({"x": torch.zeros(2).to(dev), "y": torch.zeros(2).to(dev), "z": torch.zeros(1).to(dev)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    torch.testing.assert_close(xser.load(path)["x"], torch.ones(2))
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("c.pt")) == \
        ["c.pt"] + [p for p in os.listdir(tmp_path) if p.startswith("c.pt.tensors")]
    assert len([p for p in os.listdir(tmp_path) if p.startswith("c.pt.tensors")]) == 1


def test_xser_non_master_writes_nothing(dev, tmp_path, monkeypatch):
    monkeypatch.setattr(xm, "is_master_ordinal", lambda local=True: False)
    path = str(tmp_path / "n.pt")
    xser.save({"x": torch.ones(2).to(dev)}, path)
    assert os.listdir(tmp_path) == []
    xser.save({"x": torch.ones(2).to(dev)}, path, master_only=False)
    torch.testing.assert_close(xser.load(path)["x"], torch.ones(2))


def test_xser_loads_upstream_layout(tmp_path):
    path = str(tmp_path / "up.pt")
    os.mkdir(path + ".tensors")
    w = torch.randn(3, 2)
    torch.save(w, os.path.join(path + ".tensors", "tensor_0.pt"))
    torch.save({"w": xser.TensorReference(0), "n": 3}, path)
    out = xser.load(path)
    torch.testing.assert_close(out["w"], w, rtol=0, atol=0)
    assert out["n"] == 3


# ---- xm.save ----------------------------------------------------------------------------------

class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_xm_save_moves_to_cpu(dev, tmp_path):
    cpu, xla = _state(dev)
    path = str(tmp_path / "x.pt")
    xm.save(xla, path)
    _check_loaded(torch.load(path), cpu)


def test_xm_save_is_atomic(dev, tmp_path):
    path = str(tmp_path / "x.pt")
    good = {"w": torch.randn(64, 64).to(dev)}
    xm.save(good, path)
    before = open(path, "rb").read()
    with pytest.raises(RuntimeError, match="cannot pickle"):
        # a large tensor is written first, then pickling fails mid-file
        xm.save({"big": torch.randn(512, 512).to(dev), "bad": _Unpicklable()}, path)
    assert open(path, "rb").read() == before             # the old checkpoint is intact
    assert os.listdir(tmp_path) == ["x.pt"]               # no temporary file left behind
    assert_same(torch.load(path)["w"], good["w"])


# ---- torch_xla.test.test_utils ------------------------------------------------------------------

_TIME = r"Time=\d\d:\d\d:\d\d"


def test_print_training_update(dev, capsys):
    test_utils.print_training_update(dev, 20, 6.792969, 117.1634, 45.8412, epoch=1)
    out = capsys.readouterr().out
    assert re.fullmatch(r"\| Training Device=xla:0/0 Epoch=1 Step=20 Loss=6\.79297 Rate=117\.16 "
                        r"GlobalRate=45\.84 " + _TIME + r"\n", out), out
    loss = torch.tensor(0.123456).to(dev) * 2                # a (pending) device scalar is fine
    test_utils.print_training_update(dev, 3, loss, 1.0, 2.0)
    out = capsys.readouterr().out
    assert re.fullmatch(r"\| Training Device=xla:0/0 Step=3 Loss=0\.24691 Rate=1\.00 GlobalRate=2\.00 "
                        + _TIME + r"\n", out), out


def test_print_test_update(dev, capsys):
    test_utils.print_test_update(dev, 98.1234, epoch=2)
    out = capsys.readouterr().out
    assert re.fullmatch(r"\| Test Device=xla:0/0 Epoch=2 Accuracy=98\.12 " + _TIME + r"\n", out), out
    test_utils.print_test_update(dev, None, epoch=1, step=5)
    out = capsys.readouterr().out
    assert re.fullmatch(r"\| Test Device=xla:0/0 Step=5 Epoch=1 " + _TIME + r"\n", out), out


def test_now():
    assert re.fullmatch(r"\d\d:\d\d:\d\d", test_utils.now())
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", test_utils.now("%Y-%m-%d"))


class _FakeWriter:
    def __init__(self):
        self.scalars = []
        self.flushed = self.closed = False

    def add_scalar(self, tag, value, step=None):
        self.scalars.append((tag, value, step))

    def flush(self):
        self.flushed = True

    def close(self):
        self.closed = True


def test_summary_writer_helpers(dev, tmp_path, capsys):
    assert test_utils.get_summary_writer(None) is None
    assert test_utils.get_summary_writer("") is None
    try:
        import importlib
        importlib.import_module("torch.utils.tensorboard")
        has_tb = True
    except ImportError:
        has_tb = False
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        writer = test_utils.get_summary_writer(str(tmp_path / "tb"))
    if has_tb:
        assert writer is not None
        test_utils.close_summary_writer(writer)
    else:
        assert writer is None                               # degrades without an error
        assert any("TensorBoard" in str(x.message) for x in w)
    # None writers are ignored
    test_utils.write_to_summary(None, 1, {"a": 1.0}, write_xla_metrics=True)
    test_utils.close_summary_writer(None)

    fw = _FakeWriter()
    test_utils.write_to_summary(fw, 3, dict_to_write={"Accuracy/test": 91.5})
    assert fw.scalars == [("Accuracy/test", 91.5, 3)]
    fw = _FakeWriter()
    (torch.ones(2, device=dev) * 3).sum().item()             # at least one execution happened
    test_utils.write_to_summary(fw, 4, write_xla_metrics=True)
    tags = {t: v for t, v, s in fw.scalars}
    assert all(s == 4 for _, _, s in fw.scalars)
    assert tags["ExecuteCount"] == met.counter_value("ExecuteCount")
    assert tags["aten_ops_sum"] == sum(met.counter_value(c) for c in met.counter_names() if c.startswith("aten::"))
    fw = _FakeWriter()
    test_utils.print_training_update(dev, 1, 0.5, 10.0, 5.0, summary_writer=fw)
    assert capsys.readouterr().out.startswith("| Training")
    assert [(t, v) for t, v, _ in fw.scalars] == [("examples/sec", 10.0), ("average_examples/sec", 5.0)]
    test_utils.close_summary_writer(fw)
    assert fw.flushed and fw.closed


# ---- the demo ---------------------------------------------------------------------------------

def _demo_module():
    sys.path.insert(0, os.path.dirname(DEMO))
    try:
        import train_mnist_xla as demo
    finally:
        sys.path.pop(0)
    return demo


def _write_idx(path, array, compress):
    import gzip
    import struct
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    opener = gzip.open if compress else open
    with opener(path, "wb") as f:
        f.write(header + array.astype("uint8").tobytes())


def test_demo_reads_mnist_idx_files(tmp_path):
    demo = _demo_module()
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (12, 28, 28), generator=g, dtype=torch.uint8).numpy()
    labels = torch.randint(0, 10, (12,), generator=g, dtype=torch.uint8).numpy()
    _write_idx(str(tmp_path / "train-images-idx3-ubyte.gz"), images, compress=True)
    _write_idx(str(tmp_path / "train-labels-idx1-ubyte"), labels, compress=False)
    ds = demo._mnist_dataset(str(tmp_path), "train")
    assert len(ds) == 12
    x, y = ds[3]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    expect = (torch.from_numpy(images[3]).float() / 255.0 - 0.1307) / 0.3081
    torch.testing.assert_close(x[0], expect)
    assert int(y) == int(labels[3])
    with pytest.raises(FileNotFoundError, match="--fake_data"):
        demo._mnist_dataset(str(tmp_path), "t10k")


def test_demo_fake_data_labels_readable_from_images():
    demo = _demo_module()
    images, labels = demo._fake_batch(64, seed=7)
    assert images.shape == (64, 1, 28, 28) and labels.dtype == torch.int64
    bands = images[:, 0, 4:24, :].reshape(64, 10, 56).mean(dim=2)
    assert (bands.argmax(dim=1) == labels).float().mean() > 0.9     # the class is the bright band
    assert images.std() > 0.5                                        # random, not constant


def _demo_cpu_reference(steps):
    """The demo's first `steps` training losses and its test accuracy after them, in eager PyTorch."""
    demo = _demo_module()
    torch.manual_seed(1)
    flags = demo.parse_args(["--fake_data"])
    train_loader, test_loader = demo._make_loaders(flags)
    model = demo.MNIST()
    opt = torch.optim.SGD(model.parameters(), lr=flags.lr, momentum=flags.momentum)
    losses = []
    for step, (data, target) in enumerate(train_loader):
        if step >= steps:
            break
        opt.zero_grad()
        loss = torch.nn.functional.nll_loss(model(data), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        data, target = next(iter(test_loader))          # the fake test set repeats one batch
        accuracy = 100.0 * (model(data).argmax(dim=1) == target).float().mean().item()
    return losses, accuracy


@pytest.mark.timeout(300)
def test_demo_script_runs(tmp_path):
    env = dict(os.environ, PJRT_DEVICE="CPU")
    cmd = [sys.executable, DEMO, "--fake_data", "--num_epochs", "1", "--num_steps", "8", "--log_steps", "4",
           "--logdir", str(tmp_path / "tb")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    losses = {int(m.group(1)): float(m.group(2)) for m in
              re.finditer(r"^\| Training Device=xla:0/0 Epoch=1 Step=(\d+) Loss=([0-9.]+) Rate=[0-9.]+ "
                          r"GlobalRate=[0-9.]+ Time=\d\d:\d\d:\d\d$", out, re.M)}
    assert sorted(losses) == [0, 4], out
    cpu_losses, cpu_accuracy = _demo_cpu_reference(8)
    assert losses[0] == pytest.approx(cpu_losses[0], abs=2e-4)
    assert losses[4] == pytest.approx(cpu_losses[4], abs=2e-3)
    assert losses[4] < losses[0]
    m = re.search(r"^Epoch 1 test end \d\d:\d\d:\d\d, Accuracy=(\d+\.\d\d)$", out, re.M)
    assert m, out
    # The same model state as eager training (batchnorm running stats included): at most one
    # of the 128 test samples may flip on float rounding.
    assert abs(float(m.group(1)) - cpu_accuracy) <= 100.0 / 128 + 0.01, (m.group(1), cpu_accuracy)
    assert "Max Accuracy:" in out
    assert "Metric: CompileTime" in out and "Counter: UncachedCompile" in out   # short_metrics_report
    assert re.search(r"^Training rate: \d+\.\d\d samples/sec", out.strip().splitlines()[-1]), out


_CACHE_SCRIPT = r'''
import sys, torch, torch_xla, torch_xla.runtime as xr, torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
xr.initialize_cache(sys.argv[1])
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to("xla")
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
x, y = torch.randn(4, 8).to("xla"), torch.randint(0, 2, (4,)).to("xla")
losses = []
for _ in range(3):
    opt.zero_grad(); loss = torch.nn.functional.cross_entropy(m(x), y); loss.backward(); opt.step()
    xm.mark_step(); losses.append(loss.item())
print(repr((losses, met.counter_value("PersistentExecutableHit") or 0, met.counter_value("UncachedCompile") or 0)))
'''


@pytest.mark.slow
def test_persistent_cache_second_process_loads_executables(tmp_path):
    """A second process with the same cache directory compiles nothing and trains the same."""
    import ast
    script = tmp_path / "train.py"
    script.write_text(_CACHE_SCRIPT)
    env = dict(os.environ, PJRT_DEVICE="CPU")
    runs = [ast.literal_eval(subprocess.run([sys.executable, str(script), str(tmp_path / "cache")], env=env,
                                            capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            for _ in range(2)]
    (l1, hits1, comp1), (l2, hits2, comp2) = runs
    assert comp1 == 2 and hits1 == 0
    assert comp2 == 0 and hits2 == 2
    assert l1 == l2
    torch.manual_seed(0)  # and both equal eager CPU training from the same weights
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    ref = []
    for _ in range(3):
        opt.zero_grad(); loss = torch.nn.functional.cross_entropy(m(x), y); loss.backward(); opt.step()
        ref.append(loss.item())
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(ref), rtol=1e-5, atol=1e-6)


# about 16 s (two processes); tests/test_persistent_trust.py covers damaged entries in the main suite
@pytest.mark.slow
def test_persistent_cache_corrupt_entries_are_recompiled_and_replaced(tmp_path):
    """A truncated or corrupted entry is a miss: the program compiles again, the entry is
    rewritten, and the next process loads it."""
    import ast
    script = tmp_path / "train.py"
    script.write_text(_CACHE_SCRIPT)
    cache = tmp_path / "cache"
    env = dict(os.environ, PJRT_DEVICE="CPU")

    def run():
        p = subprocess.run([sys.executable, str(script), str(cache)], env=env, capture_output=True, text=True,
                           check=True)
        return ast.literal_eval(p.stdout.strip().splitlines()[-1])
    l1, _, _ = run()
    entries = sorted(cache.glob("txj-*.exe"))
    assert len(entries) == 2
    good = entries[0].read_bytes()
    entries[0].write_bytes(good[:len(good) // 2])                               # truncated
    bad = bytearray(entries[1].read_bytes())
    bad[-100] ^= 0xFF                                                            # one byte flipped
    entries[1].write_bytes(bytes(bad))
    l2, hits2, comp2 = run()
    assert (hits2, comp2) == (0, 2) and l2 == l1
    l3, hits3, comp3 = run()
    assert (hits3, comp3) == (2, 0) and l3 == l1


def test_repeat_with_fixed_output_size_matches_repeat_interleave():
    import torch_xla.debug.metrics as met
    from torch_xla.experimental.custom_kernel import repeat_with_fixed_output_size
    x = torch.randn(10)
    for repeats, total in [([0, 1, 2, 0, 4, 0, 6, 7, 8, 9], 20), ([0, 5, 2, 0, 4, 9, 6, 7, 8, 0], 50),
                           ([3, 6, 2, 14, 27, 47, 8, 28, 0, 0], 135)]:
        r = torch.tensor(repeats)
        met.clear_all()
        got = repeat_with_fixed_output_size(x.to("xla"), r.to("xla"), total)
        assert not [c for c in met.counter_names() if c.startswith("aten::")]
        want = torch.repeat_interleave(x, r)[:total]
        want = torch.cat([want, x[-1].repeat(total - want.numel())])
        assert torch.equal(got.cpu(), want)
    with pytest.raises(ValueError):
        repeat_with_fixed_output_size(x.view(2, 5).to("xla"), torch.tensor([1, 1]).to("xla"), 3)
