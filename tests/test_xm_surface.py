"""The rest of the documented `xm` surface: unlazy, fork_rng, xla_device_kind, send / recv,
all_reduce_bucketized_gradients, do_on_ordinals, and the arguments that change nothing
here (pin_layout, defval, devkind), which warn once.

Values are compared with eager PyTorch on the CPU; the 2-process test (send / recv,
bucketed all-reduce, do_on_ordinals) with values the CPU computes from every replica's
inputs (tests/mp_scripts/xm_surface_workers.py)."""
import os
import sys
import warnings

import pytest
import torch

import torch_xla
import torch_xla.core.xla_model as xm
from torch_xla._engine import launcher

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mp_scripts import xm_surface_workers as xw  # noqa: E402


def _ir(tensors):
    return torch_xla._XLAC._get_xla_tensors_text(list(tensors))


def _pending(t):
    return "device_data" not in _ir([t]).split("ROOT")[0].splitlines()[-1]


@pytest.fixture
def fresh_warnings():
    xm._WARNED.clear()
    yield
    xm._WARNED.clear()


# ---- unlazy --------------------------------------------------------------------------------

def test_unlazy_materialises_only_the_given_tensors():
    a = torch.arange(6.0).reshape(2, 3)
    x = a.to("xla") * 2 + 1
    y = a.to("xla") - 4
    assert _pending(x) and _pending(y)
    xm.unlazy([x])
    assert not _pending(x) and _pending(y)
    torch.testing.assert_close(x.cpu(), a * 2 + 1)
    torch.testing.assert_close(y.cpu(), a - 4)
    with pytest.raises(RuntimeError, match="expected xla tensors"):
        xm.unlazy([a])


# ---- fork_rng ------------------------------------------------------------------------------

def _draws(rand, seed, fork, enabled=True, sync=False):
    """(before, inside, after) draws, around a fork of the generator (like CPU's)."""
    seed()
    before = rand()
    with fork(enabled):
        inside = rand()
        if sync:
            torch_xla.sync()
    return before, inside, rand()


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("sync", [False, True])
def test_fork_rng_restores_the_generator_as_torch_random_fork_rng_does(enabled, sync):
    cpu = _draws(lambda: torch.rand(4), lambda: torch.manual_seed(3),
                 lambda e: torch.random.fork_rng(enabled=e), enabled)
    dev = _draws(lambda: torch.rand(4, device="xla"), lambda: xm.set_rng_state(3),
                 lambda e: xm.fork_rng(enabled=e), enabled, sync)
    dev = [t.cpu() for t in dev]
    # The pattern of equal draws is the CPU's: after a fork, the next draw repeats the
    # block's first one; without it, it is new.
    for i, j in ((0, 1), (1, 2), (0, 2)):
        assert torch.equal(cpu[i], cpu[j]) == torch.equal(dev[i], dev[j])
    assert torch.equal(dev[1], dev[2]) == enabled


def test_fork_rng_restores_on_an_exception():
    xm.set_rng_state(11)
    with pytest.raises(ValueError):
        with xm.fork_rng():
            first = torch.rand(3, device="xla").cpu()
            raise ValueError("inside")
    torch.testing.assert_close(torch.rand(3, device="xla").cpu(), first)


# ---- xla_device_kind -----------------------------------------------------------------------

def test_xla_device_kind_is_the_pjrt_device_kind():
    import jax
    want = jax.local_devices()[0].device_kind
    assert xm.xla_device_kind() == want == "cpu"
    assert xm.xla_device_kind(torch_xla.device()) == want
    assert xm.xla_device_kind(str(torch_xla.device())) == want
    with pytest.raises(RuntimeError, match="Invalid device format"):
        xm.xla_device_kind("cpu")


# ---- send / recv in one process ------------------------------------------------------------

def test_send_recv_loopback_in_one_process():
    a = torch.arange(6.0).reshape(2, 3)
    x = a.to("xla") * 3  # pending: send computes it
    ret = xm.send(x, 41)
    xm.send(x + 1, 41)
    torch.testing.assert_close(ret.cpu(), a * 3)
    first = xm.recv(torch.zeros(2, 3, device="xla"), 41)
    second = xm.recv(torch.zeros(2, 3, device="xla"), 41)
    assert first.device.type == "xla"
    torch.testing.assert_close(first.cpu(), a * 3)
    torch.testing.assert_close(second.cpu(), a * 3 + 1)
    with pytest.raises(RuntimeError, match="nothing was sent"):
        xm.recv(torch.zeros(2, 3, device="xla"), 41)
    xm.send(torch.ones(4, device="xla"), 42)
    with pytest.raises(RuntimeError, match=r"shape \(4,\), expected torch.float32 of shape \(2, 3\)"):
        xm.recv(torch.zeros(2, 3, device="xla"), 42)
    with pytest.raises(TypeError):
        xm.send([1, 2], 43)


# ---- all_reduce_bucketized_gradients -------------------------------------------------------

@pytest.mark.parametrize("cap,collectives", [(0, 5), (5e-5, 4), (1, 3)])
def test_all_reduce_bucketized_gradients_one_all_reduce_per_bucket(cap, collectives):
    """Buckets: consecutive gradients of one dtype, up to `cap` MiB (0: one each). In one
    process the sum over replicas is the gradient itself: the result is scale * g."""
    cpu = xw.grads_of(0)
    gs = [g.to("xla") for g in cpu]
    xm.all_reduce_bucketized_gradients(gs, scale=0.5, groups=None, pin_layout=True, bucket_cap_mb=cap)
    assert _ir(gs).count("xla::all_reduce") == collectives
    for g, c in zip(gs, cpu):
        assert g.dtype == c.dtype and g.shape == c.shape
        torch.testing.assert_close(g.cpu(), c * 0.5)


# ---- do_on_ordinals ------------------------------------------------------------------------

def test_do_on_ordinals_one_process():
    x = torch.arange(4.0).to("xla") + 1
    seen = []

    def target(t, k):
        seen.append((t.device.type, k))
        return t * 2

    torch.testing.assert_close(xm.do_on_ordinals(target, (x, 7)), torch.arange(4.0) * 2 + 2)
    assert seen == [("cpu", 7)]
    assert xm.do_on_ordinals(target, (x, 8), ordinals=(1, 2)) is None
    assert xm.do_on_ordinals(lambda: "ran", ordinals=0) == "ran"
    assert seen == [("cpu", 7)]


# ---- arguments that change nothing ---------------------------------------------------------

def _ours(record):
    return [str(w.message) for w in record if str(w.message).startswith("xm.")]


def test_pin_layout_warns_once_when_not_the_default(fresh_warnings):
    x = torch.arange(4.0).to("xla")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        xm.all_reduce("sum", x)
        xm.all_gather_bucketized([x], pin_layout=False)  # the default of the bucketed forms
        assert _ours(rec) == []
        torch.testing.assert_close(xm.all_reduce("sum", x, pin_layout=False).cpu(), torch.arange(4.0))
        xm.all_gather(x, pin_layout=False)
        xm.reduce_scatter("sum", x, 1.0, 0, 1, pin_layout=False)
    msgs = _ours(rec)
    assert len(msgs) == 1 and "pin_layout=False has no effect here" in msgs[0]


def test_defval_warns_once_when_not_the_default(fresh_warnings):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert xm.get_ordinal() == 0 and xm.get_local_ordinal() == 0
        assert _ours(rec) == []
        assert xm.get_ordinal(defval=5) == 0
        assert xm.get_local_ordinal(defval=5) == 0
    msgs = _ours(rec)
    assert len(msgs) == 1 and "defval=5 has no effect here" in msgs[0]


def test_devkind(fresh_warnings):
    devices = [str(torch_xla.device())]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert xm.xla_device(devkind="CPU") == torch_xla.device()
        assert xm.get_xla_supported_devices("CPU") == devices
        assert xm.get_xla_supported_devices("cpu") == devices
        assert xm.get_xla_supported_devices("TPU") == []
        assert xm.get_xla_supported_devices(1) == devices  # max_devices, PyTorch/XLA >= 2.4
        assert xm.get_xla_supported_devices(max_devices=1) == devices
        assert _ours(rec) == []
        assert xm.xla_device(devkind="TPU") == torch_xla.device()
        assert xm.xla_device(devkind="GPU") == torch_xla.device()
    msgs = _ours(rec)
    assert len(msgs) == 1 and "devkind='TPU' has no effect here" in msgs[0]


# ---- two processes -------------------------------------------------------------------------

def test_send_recv_bucketized_all_reduce_do_on_ordinals_2_processes(tmp_path):
    res = launcher.spawn(xw.xm_surface_job, args=(str(tmp_path),), nprocs=2, return_results=True)
    res = sorted(res.values() if isinstance(res, dict) else res, key=lambda o: o["rank"])
    n = 2
    sent = [torch.arange(6.0).reshape(2, 3) * (r + 1) + 1 for r in range(n)]
    r0, r1 = res
    torch.testing.assert_close(r0["send_ret"], sent[0])
    torch.testing.assert_close(r1["recv"], [sent[0], sent[0] * 10])
    torch.testing.assert_close(r0["recv"], [torch.tensor([1, 7, 8, 9])])
    for cap in (0, 1e-4, 1):
        want = [sum(g.float() for g in gs) / n for gs in zip(*[xw.grads_of(r) for r in range(n)])]
        for o in res:
            got = o[f"bucketized_{cap}"]
            assert [g.dtype for g in got] == [g.dtype for g in xw.grads_of(0)]
            torch.testing.assert_close([g.float() for g in got], want,
                                       atol=2e-2, rtol=2e-2)  # bfloat16's sum
    assert not r0["ran"] and r0["do_on_ordinals"] is None
    kind, total, rank = r1["do_on_ordinals"]
    assert r1["ran"] and kind == "cpu" and rank == 1
    torch.testing.assert_close(total, sent[0] + sent[1])
    assert r0["marker_after"] and r1["marker_after"]
    assert os.listdir(tmp_path) == ["ran_on_1"]
    assert r0["int_ordinal"] == 0 and r1["int_ordinal"] is None


def test_no_effect_warnings_name_the_callers_line(fresh_warnings):
    x = torch.arange(4.0).to("xla")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        xm.all_reduce("sum", x, pin_layout=False)
        xm.get_ordinal(defval=3)
    assert [os.path.basename(w.filename) for w in rec if str(w.message).startswith("xm.")] == \
        ["test_xm_surface.py"] * 2
