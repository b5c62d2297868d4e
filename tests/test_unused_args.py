"""Arguments of the public API that used to be accepted and ignored: each now works as
PyTorch/XLA documents it (checked against eager PyTorch on the CPU), raises the error
PyTorch/XLA raises, or warns once per process that it changes nothing here."""
import inspect
import io
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_xla
import torch_xla._api as api
import torch_xla.core.xla_builder as xb
import torch_xla.core.xla_model as xm
import torch_xla.core.xla_op_registry as xor
from torch_xla._engine import pjrt
from torch_xla.distributed.data_parallel import DataParallel
from torch_xla.experimental.gradient_accumulation import gradient_accumulation

from helpers import XLA, assert_same, to_xla


@pytest.fixture
def fresh_warnings():
    for warned in (api._WARNED, xb._WARNED):
        warned.clear()
    yield
    for warned in (api._WARNED, xb._WARNED):
        warned.clear()


def _user_warnings(rec):
    return [str(w.message) for w in rec if issubclass(w.category, UserWarning)]


@pytest.fixture
def two_devices(monkeypatch):
    """This process shows a second xla device (as one with several devices outside SPMD mode)."""
    base = pjrt.device_index()
    monkeypatch.setattr(pjrt, "device_indices", lambda: [base, base + 1])
    return torch.device("xla", base + 1)


# ---- xm.master_print: PyTorch/XLA's (fd, local, flush) -------------------------------------

class _Flushes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.flushes = 0

    def flush(self):
        self.flushes += 1
        super().flush()


def test_master_print_is_print_on_the_master_ordinal():
    want = io.StringIO()
    print("epoch", 3, {"a": 1}, file=want)
    for local in (False, True):
        got = _Flushes()
        xm.master_print("epoch", 3, {"a": 1}, fd=got, local=local)
        assert got.getvalue() == want.getvalue() and got.flushes == 0
    got = _Flushes()
    xm.master_print("x", fd=got, flush=True)
    assert got.getvalue() == "x\n" and got.flushes == 1


def test_master_print_refuses_unknown_keywords():
    # Not parameters of PyTorch/XLA's master_print: a TypeError, as there.
    for kw in ({"finalize": True}, {"sep": "-"}):
        with pytest.raises(TypeError):
            xm.master_print("x", fd=io.StringIO(), **kw)


# ---- xm.wait_device_ops(devices) ---------------------------------------------------------------

def test_wait_device_ops_checks_the_device_names():
    a = torch.arange(6.0)
    x = a.to(XLA) * 3
    xm.mark_step()
    xm.wait_device_ops([str(XLA), f"{pjrt.platform()}:0"])
    assert_same(x, a * 3)
    for bad in ("cpu", "", ":0", "xla:one"):
        with pytest.raises(RuntimeError, match="Invalid device specification"):
            xm.wait_device_ops([bad])


# ---- the device of the random number generator calls ---------------------------------------

def test_rng_calls_take_this_process_s_device(fresh_warnings):
    dev = torch_xla.device()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        xm.set_rng_state(1234, device=dev)
        assert xm.get_rng_state(device=str(dev)) == 1234  # the state set is the state read
        torch_xla.manual_seed(77, device=dev)
        assert xm.get_rng_state(dev) == 77
        with xm.fork_rng(device=dev):
            torch.rand(3, device=dev)
        assert xm.get_rng_state(dev) == 77
    assert _user_warnings(rec) == []
    # Not an xla device, or another process's: a RuntimeError, as PyTorch/XLA's device check.
    for call in (lambda d: xm.set_rng_state(1, device=d), lambda d: xm.get_rng_state(d),
                 lambda d: torch_xla.manual_seed(1, device=d)):
        with pytest.raises(RuntimeError, match="not an xla device"):
            call("cpu")
        with pytest.raises(RuntimeError):
            call(torch.device("xla", pjrt.device_index() + 7))


def test_rng_of_another_device_of_this_process_warns_once(fresh_warnings, two_devices):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        xm.set_rng_state(5, device=two_devices)
        torch_xla.manual_seed(5, device=two_devices)
        assert xm.get_rng_state(two_devices) == 5
    msgs = _user_warnings(rec)
    assert msgs == [f"set_rng_state: device='{two_devices}': this process's devices share one random "
                    f"number generator, so this also changes what the other devices draw"]
    assert rec[0].filename == __file__


# ---- xm.get_memory_info(device) ------------------------------------------------------------

def test_memory_info_device(fresh_warnings, two_devices):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        info = xm.get_memory_info(torch_xla.device())
        assert _user_warnings(rec) == []
        other = xm.get_memory_info(two_devices)
        xm.get_memory_info(str(two_devices))
    assert set(other) == set(info) and info["bytes_limit"] >= info["bytes_used"] >= 0
    msgs = _user_warnings(rec)
    assert msgs == [f"xm.get_memory_info: device='{two_devices}': the statistics are those of this "
                    f"process's first device, {torch_xla.device()}"]
    assert rec[0].filename == __file__
    with pytest.raises(RuntimeError, match="not an xla device"):
        xm.get_memory_info(torch.device("cpu"))


# ---- xla_builder: max_pool's layout, reshape's inferred_dimension, ignored **kwargs -----------

def _run(name, fn, *tensors, **kwargs):
    return xor.register(name, fn)(*[t.to(XLA) for t in tensors], **kwargs)


def test_max_pool_windows_of_every_dimension_or_of_the_spatial_ones():
    a = torch.randn(2, 3, 6, 8)
    want = F.max_pool2d(a, kernel_size=(2, 3), stride=(2, 2))
    # As XLA's builder takes them: one window size and stride per dimension.
    full = _run("mp_full", lambda x: x.max_pool([1, 1, 2, 3], [1, 1, 2, 2], 0, 1, [2, 3]), a)
    assert_same(full, want)
    spatial = _run("mp_spatial", lambda x: x.max_pool([2, 3], [2, 2], 0, 1, [2, 3]), a)
    assert_same(spatial, want)
    # Channels last: the batch and feature dimensions place the spatial windows.
    nhwc = _run("mp_nhwc", lambda x: x.max_pool([2, 3], [2, 2], 0, 3, [1, 2]), a.permute(0, 2, 3, 1))
    assert_same(nhwc, want.permute(0, 2, 3, 1))
    with pytest.raises(ValueError, match="must name each of the operand's 4 dimensions once"):
        _run("mp_bad_layout", lambda x: x.max_pool([2, 3], [2, 2], 0, 2, [2, 3]), a)
    with pytest.raises(ValueError, match="one entry per dimension"):
        _run("mp_bad_window", lambda x: x.max_pool([2, 3, 1], [2, 2], 0, 1, [2, 3]), a)


def test_reshape_with_inferred_dimension_is_the_static_reshape():
    a = torch.randn(2, 3, 4)
    got = _run("reshape_inferred", lambda x: x.reshape([6, 4], inferred_dimension=0), a)
    assert_same(got, a.reshape(6, 4))


def test_mkwhile_and_mkconditional_keywords_warn_once(fresh_warnings):
    a, b = torch.randn(2, 2), torch.randn(2, 2)

    def loop(x, y):
        def cond(i, x, y):
            return i < xb.Op.scalar(i.builder(), 3, dtype=xb.Type.S32)

        def body(i, x, y):
            return xb.Op.tuple((i + xb.Op.scalar(i.builder(), 1, dtype=xb.Type.S32), x + y, y))
        zero = xb.Op.scalar(x.builder(), 0, dtype=xb.Type.S32)
        return xb.Op.mkwhile((zero, x, y), cond, body, name="loop").get_tuple_element(1)

    def pick(x, y):
        pred = xb.Op.scalar(x.builder(), 1, dtype=xb.Type.PRED)
        return pred.mkconditional((x, y), lambda x, y: x * y, lambda x, y: x - y, name="pick")

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert_same(_run("kw_while", loop, a, b), a + 3 * b)
        assert_same(_run("kw_while2", loop, a, b), a + 3 * b)
        assert_same(_run("kw_cond", pick, a, b), a * b)
        assert_same(_run("kw_cond2", pick, a, b), a * b)
    assert _user_warnings(rec) == [
        "Op.mkwhile: keyword arguments ['name'] have no effect (PyTorch/XLA's mkwhile accepts and ignores them)",
        "Op.mkconditional: keyword arguments ['name'] have no effect (PyTorch/XLA's mkconditional accepts and "
        "ignores them)"]


# ---- DataParallel: PyTorch/XLA's __call__(loop_fn, loader, batchdim=0, **kwargs) -------------

def test_data_parallel_call_passes_extra_keywords_to_the_loop():
    assert list(inspect.signature(DataParallel.__call__).parameters) == [
        "self", "loop_fn", "loader", "batchdim", "kwargs"]
    model = torch.nn.Linear(4, 2)
    dp = DataParallel(model, device_ids=[torch_xla.device()])
    data = [(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(2)]

    def loop_fn(m, loader, device, context, **kw):
        outs = [m(x).cpu() for x, _ in loader]
        return outs, kw

    # fixed_batch_size left DataParallel in 2021: like any other keyword it goes to loop_fn.
    [(outs, kw)] = dp(loop_fn, data, fixed_batch_size=True)
    assert kw == {"fixed_batch_size": True}
    assert_same(outs, [model(x) for x, _ in data])


# ---- gradient_accumulation(model=...) ----------------------------------------------------------

def test_gradient_accumulation_accumulates_into_the_model_only():
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 3)
    m = torch.nn.Linear(6, 3).to(XLA)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    w = torch.randn(3, generator=torch.Generator().manual_seed(2), requires_grad=True)
    ww = to_xla(w)
    params = list(ref.parameters())
    total = torch.zeros(())
    for i in range(4):  # what PyTorch/XLA's loop computes: the model's gradients only
        loss = (ref(x[i]) * w).sum() / 4
        loss.backward(inputs=params)
        total = total + loss.detach()
    assert w.grad is None
    got = gradient_accumulation(lambda xi: (m(xi) * ww).sum(), (to_xla(x),), m)
    assert_same(got, total)
    assert_same([p.grad for p in m.parameters()], [p.grad for p in params])
    assert ww.grad is None

    frozen = torch.nn.Linear(6, 3).to(XLA).requires_grad_(False)
    with pytest.raises(RuntimeError) as cpu_error:
        torch.zeros(()).backward()
    with pytest.raises(RuntimeError, match=str(cpu_error.value)):
        gradient_accumulation(lambda xi: frozen(xi).sum(), (to_xla(x),), frozen)
