"""torch.compile(backend='openxla' / 'openxla_eval'): every result against eager PyTorch on CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch_xla._engine import env_vars, ir
from helpers import XLA, assert_same
from models import MNIST, Decoder, ResNet, image_data, lm_data, lm_loss, mnist_data


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pair(model_cls, *a, **k):
    torch.manual_seed(0)
    cpu = model_cls(*a, **k)
    dev = copy.deepcopy(cpu).to(XLA)
    return cpu, dev


def _op_events() -> int:
    """Ops that built a node (`xla::<op>`) or ran on the CPU (`aten::<op>`) so far."""
    return sum(met.counter_value(n) or 0 for n in met.counter_names() if n.startswith(("xla::", "aten::")))


class _NodeCount:
    """Counts IR nodes created (ops traced) while active: nodes built through the class
    and the op events of the kernels (the specialised ones build nodes without it)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        self.events = _op_events()
        orig = ir.Node.__init__

        def init(node, *a, **k):
            self.calls += 1
            orig(node, *a, **k)
        monkeypatch.setattr(ir.Node, "__init__", init)

    @property
    def n(self) -> int:
        return self.calls + _op_events() - self.events


def _backward_step(loss_fn):
    """One step's forward and backward of `model` on (x, y); returns the loss."""
    def step(model, x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss
    return step


def test_spec_add_sample_cpu_inputs():
    def add(a, b):
        return a.to(xm.xla_device()) + b.to(xm.xla_device())
    compiled = torch.compile(add, backend="openxla")
    for _ in range(2):
        a, b = torch.randn(10), torch.randn(10)
        assert_same(compiled(a, b), a + b)


def test_inputs_off_the_device_are_named_in_warnings():
    def f(a, b):
        return a.to(XLA) * b.to(XLA) + 1
    compiled = torch.compile(f, backend="openxla")
    a, b = torch.randn(3), torch.randn(2, 3)
    with pytest.warns(UserWarning) as record:
        out = compiled(a, b)
    assert_same(out, a * b + 1)
    found = [str(w.message) for w in record if "Found tensor with shape" in str(w.message)]
    assert len(found) == 2 and "torch.Size([2, 3]) on cpu" in found[1]


@pytest.mark.slow   # ~16 s; the one-program MNIST test covers the default path
def test_mnist_training_matches_cpu_and_steady_loop_compiles_nothing():
    cpu, dev = _pair(MNIST)
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    opt_d = torch.optim.SGD(dev.parameters(), lr=0.05, momentum=0.9)

    step = _backward_step(F.nll_loss)
    cstep = torch.compile(step, backend="openxla")
    for i, (x, y) in enumerate(mnist_data(5)):
        if i == 3:
            compiles = met.counter_value("UncachedCompile")
        opt_c.zero_grad()
        lc = step(cpu, x, y)
        opt_d.zero_grad()
        ld = cstep(dev, x.to(XLA), y.to(XLA))
        if i == 0:
            for pc, pd in zip(cpu.parameters(), dev.parameters()):
                assert_same(pd.grad, pc.grad, rtol=1e-4, atol=1e-5)
        opt_c.step()
        opt_d.step()
        xm.mark_step()
        assert_same(ld, lc, rtol=1e-4, atol=1e-5)
    assert met.counter_value("UncachedCompile") == compiles    # steps 3 and 4 compile nothing
    for (n, pc), pd in zip(cpu.state_dict().items(), dev.state_dict().values()):
        assert_same(pd, pc, rtol=1e-3, atol=1e-4, msg=n)        # weights and BN running stats


def test_decoder_training_matches_cpu():
    cpu, dev = _pair(Decoder, n_layers=1)
    opt_c = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    opt_d = torch.optim.AdamW(dev.parameters(), lr=1e-2)
    cdev = torch.compile(dev, backend="openxla")
    for x, y in lm_data(3, batch=2, seq=16):
        opt_c.zero_grad()
        lc = lm_loss(cpu(x), y)
        lc.backward()
        opt_c.step()
        opt_d.zero_grad()
        ld = lm_loss(cdev(x.to(XLA)), y.to(XLA))
        ld.backward()
        opt_d.step()
        xm.mark_step()
        assert_same(ld, lc, rtol=1e-4, atol=1e-4)
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        assert_same(pd, pc, rtol=1e-3, atol=1e-3)   # AdamW: near-zero gradients amplified


@pytest.mark.slow   # ~10 s
def test_resnet_training_matches_cpu():
    cpu, dev = _pair(ResNet)
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    opt_d = torch.optim.SGD(dev.parameters(), lr=0.05, momentum=0.9)

    step = _backward_step(F.cross_entropy)
    cstep = torch.compile(step, backend="openxla")
    for x, y in image_data(3, batch=4):
        opt_c.zero_grad()
        lc = step(cpu, x, y)
        opt_d.zero_grad()
        ld = cstep(dev, x.to(XLA), y.to(XLA))
        opt_c.step()
        opt_d.step()
        xm.mark_step()
        assert_same(ld, lc, rtol=1e-4, atol=1e-4)
    for (n, pc), pd in zip(cpu.state_dict().items(), dev.state_dict().values()):
        assert_same(pd, pc, rtol=1e-3, atol=1e-3, msg=n)        # weights and BN running stats


@pytest.mark.parametrize("which", ["mnist", "decoder"])
def test_inference_matches_cpu(which):
    if which == "mnist":
        cpu, dev = _pair(MNIST)
        data = [x for x, _ in mnist_data(3)]
    else:
        cpu, dev = _pair(Decoder, n_layers=1)
        data = [x for x, _ in lm_data(3, batch=2, seq=16)]
    cpu.eval()
    dev.eval()
    cdev = torch.compile(dev, backend="openxla")
    with torch.no_grad():
        for i, x in enumerate(data):
            if i == 1:
                compiles = met.counter_value("UncachedCompile")
            assert_same(cdev(x.to(XLA)), cpu(x), rtol=1e-4, atol=1e-4)
    assert met.counter_value("UncachedCompile") == compiles


def test_resnet_inference_traced_once(monkeypatch):
    cpu, dev = _pair(ResNet)
    cpu.eval()
    dev.eval()
    cdev = torch.compile(dev, backend="openxla")
    data = image_data(4, batch=4)
    with torch.no_grad():
        assert_same(cdev(data[0][0].to(XLA)), cpu(data[0][0]), rtol=1e-4, atol=1e-4)
        compiles = met.counter_value("UncachedCompile")
        assert met.counter_value("StableHloCompile") >= 1   # programs are compiled from StableHLO
        runs = met.metric_data("RunCachedGraphInputData")[0]
        xs = [x.to(XLA) for x, _ in data[1:]]
        xm.mark_step()
        nodes = _NodeCount(monkeypatch)
        outs = [cdev(x) for x in xs]
        assert nodes.n == 0                    # no op traced after the first call
        assert met.counter_value("UncachedCompile") == compiles
        assert met.metric_data("RunCachedGraphInputData")[0] == runs + len(xs)   # one sample per run
        assert met.metric_data("RunCachedGraphOutputData")[0] == runs + len(xs)
        for o, (x, _) in zip(outs, data[1:]):
            assert_same(o, cpu(x), rtol=1e-4, atol=1e-4)


def test_batchnorm_running_stats_written_back():
    cpu, dev = _pair(ResNet)
    cdev = torch.compile(dev, backend="openxla")
    with torch.no_grad():
        for x, _ in image_data(2, batch=4):
            assert_same(cdev(x.to(XLA)), cpu(x), rtol=1e-4, atol=1e-4)
    for (n, bc), bd in zip(cpu.named_buffers(), dev.buffers()):
        assert_same(bd, bc, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("one_program", ["1", "0"])
def test_openxla_eval_inplace_on_input_and_pending_inputs(one_program, monkeypatch):
    """A graph outside a training step computes its pending inputs first in both modes;
    the in-place write of the input lands."""
    monkeypatch.setenv("XLA_DYNAMO_ONE_PROGRAM", one_program)
    env_vars.reload()
    torch._dynamo.reset()

    def f(acc, x):
        acc.add_(x.sum(0))
        return x * 2, acc.clone()

    try:
        cf = torch.compile(f, backend="openxla_eval")
        acc_c, acc_d = torch.zeros(3), torch.zeros(3, device=XLA)
        for i in range(3):
            x = torch.randn(4, 3)
            xd = x.to(XLA) * 1.0                  # pending IR as the input
            met.clear_counters()
            oc, od = f(acc_c, x), cf(acc_d, xd)
            if i:
                synced = met.counter_value("DynamoSyncInputExecuteTime")
                assert synced == 1
            assert_same(od, oc)
            assert_same(acc_d, acc_c)
    finally:
        torch._dynamo.reset()
        monkeypatch.delenv("XLA_DYNAMO_ONE_PROGRAM")
        env_vars.reload()


def test_shape_change_traces_again():
    def f(x, w):
        return torch.relu(x @ w).sum(1)

    cf = torch.compile(f, backend="openxla")
    w = torch.randn(5, 3)
    wd = w.to(XLA)
    for n in (4, 6, 7, 4):
        x = torch.randn(n, 5)
        assert_same(cf(x.to(XLA), wd), f(x, w), rtol=1e-5)


def test_graph_break_and_cpu_fallback_inside_graph():
    def f(x, k):
        a = x @ x.T + k                            # symmetric
        y = torch.linalg.ldl_factor(a)[0]          # served by the CPU fallback (LAPACK's pivots)
        if y.sum() > 0:                            # a graph break (data-dependent branch)
            return y * 2
        return y - 1

    cf = torch.compile(f, backend="openxla")
    for _ in range(2):
        x = torch.randn(4, 4)
        k = torch.eye(4) * 4
        met.clear_counters()
        assert_same(cf(x.to(XLA), k.to(XLA)), f(x, k), rtol=1e-5, atol=1e-5)
        assert met.counter_value("aten::linalg_ldl_factor_ex")


def test_op_without_meta_kernel_inside_compiled_function():
    """`torch._foobar` has no meta kernel: Dynamo's fake-tensor run falls back to running it
    on zeros of the device (made from the fake tensors' metadata); the compiled function
    gives the CPU's results, with the op served by the CPU fallback."""
    def f(t):
        return torch.mul(torch._foobar(torch.mul(t, 2)), 2)

    cf = torch.compile(f, backend="openxla")
    for _ in range(2):
        t = torch.randn(7)
        assert_same(cf(t.to(XLA)), f(t))
    x = torch.randn(2, 3)
    for like in (torch.zeros_like, torch.ones_like):
        assert_same(like(x.to(XLA), dtype=torch.int32), like(x, dtype=torch.int32))
        assert_same(like(x.to(XLA)), like(x))
        assert_same(like(x.to(XLA), device="cpu"), like(x))


def test_none_outputs_and_outputs_aliasing_inputs():
    from torch_xla.core.dynamo_bridge import extract_compiled_graph

    def f(x, y):
        return x, None, (y + 1, x.t())

    gm = torch.fx.symbolic_trace(f)
    x, y = torch.randn(2, 3), torch.randn(3)
    args = (x.to(XLA), y.to(XLA))
    compiled = extract_compiled_graph(gm, args)
    for _ in range(2):
        out = compiled(*args)
        assert out[1] is None
        assert_same([out[0], out[2][0], out[2][1]], [x, y + 1, x.t()])


def test_dropout_draws_new_numbers_each_call():
    cf = torch.compile(lambda x: F.dropout(x, 0.5, training=True), backend="openxla")
    x = torch.ones(64, 64)
    a, b = cf(x.to(XLA)).cpu(), cf(x.to(XLA)).cpu()
    ref = F.dropout(x, 0.5, training=True)
    assert set(a.unique().tolist()) == set(ref.unique().tolist()) == {0.0, 2.0}
    assert not torch.equal(a, b)


def test_skip_input_data_check_refuses_pending_inputs():
    from torch_xla._dynamo import config
    cf = torch.compile(lambda t: t.cos().sin(), backend="openxla")
    x = torch.randn(3, 4)
    assert_same(cf(x.to(XLA)), x.cos().sin())
    config.skip_input_data_check = True
    try:
        with pytest.raises(RuntimeError, match="pending ir"):
            cf(x.to(XLA) + 5)
    finally:
        config.skip_input_data_check = False


def test_dynamo_alias_modules():
    import torch_xla._dynamo.dynamo_bridge as bridge
    import torch_xla.core.dynamo_bridge as core_bridge
    from torch_xla._dynamo.dynamo_bridge import NoneRemover
    assert bridge.extract_compiled_graph is core_bridge.extract_compiled_graph
    r = NoneRemover()
    t = ("a", None, "b")
    assert r.remove_nones(t) == ("a", "b") and r.add_nones(("a", "b")) == t
    import torch_xla._dynamo.config as config
    assert config.skip_input_data_check is False


def test_torch_xla_compile_method_in_eager_mode():
    import torch_xla
    from torch_xla.experimental import eager_mode

    class M:
        @torch_xla.compile
        def f(self, t):
            return torch.cos(torch.sin(t)) * 2

        @torch_xla.compile(full_graph=True, name="breaks")
        def g(self, t):
            return t * 2 if t[0] > 0 else t * 3     # a host read inside

    x = torch.randn(4)
    eager_mode(True)
    try:
        met.clear_all()
        xd = x.to(XLA) * 1.0                           # an op run eagerly
        assert met.metric_data("EagerOpExecuteTime")[0] >= 1
        met.clear_all()
        assert_same(M().f(xd), torch.cos(torch.sin(x)) * 2)
        assert met.metric_data("ExecuteTime")[0] == 1 and "EagerOpExecuteTime" not in met.metric_names()
        with pytest.raises(RuntimeError, match="Unexpected execution"):
            M().g(xd)
    finally:
        eager_mode(False)


def test_buffer_donation_of_marked_inputs():
    from torch_xla import _XLAC
    x = torch.randn(5, 5)
    xd = x.to(XLA)
    assert not _XLAC._set_buffer_donation(xd + 1, True)          # pending IR: no buffer to donate
    assert _XLAC._set_buffer_donation(xd, True) and _XLAC._get_buffer_donation(xd)
    res = torch.compile(lambda t: t * 2 + 1, backend="openxla")(xd)
    assert_same(res, x * 2 + 1)
    assert "Data Handle: Deleted" in _XLAC._get_xla_tensor_debug_info(xd)   # its buffer became the output

    def inplace(t):
        t += 0.5 * torch.sin(t)

    acc_c, acc_d = x.clone(), x.to(XLA)
    compiled = torch.compile(inplace, backend="openxla")
    _XLAC._set_buffer_donation(acc_d, True)
    compiles = met.counter_value("UncachedCompile") or 0
    for _ in range(5):
        inplace(acc_c)
        compiled(acc_d)
    assert_same(acc_d, acc_c, rtol=1e-5)
    assert met.counter_value("UncachedCompile") == compiles + 1   # one program, donating every run


def test_set_buffer_donor_op_inside_compiled_function():
    from torch_xla import _XLAC
    x = torch.randn(5, 5)

    def mul(t):
        torch.ops.xla.dynamo_set_buffer_donor_(t, True)
        return t * 1.1

    xd = x.to(XLA)
    res = torch.compile(mul, backend="openxla")(xd)
    assert_same(res, x * 1.1)
    assert _XLAC._get_buffer_donation(xd)
    assert "Data Handle: Deleted" in _XLAC._get_xla_tensor_debug_info(xd)   # donated to the output
    assert_same(torch.ops.xla.dynamo_set_buffer_donor_(x, True), x)          # other devices: unchanged

    def inplace(t):
        torch.ops.xla.dynamo_set_buffer_donor_(t, True)
        t += 0.5 * torch.sin(t)

    acc_c, acc_d = x.clone(), x.to(XLA)
    compiled = torch.compile(inplace, backend="openxla")
    compiles = met.counter_value("UncachedCompile") or 0
    for _ in range(4):
        inplace(acc_c)
        compiled(acc_d)
    assert_same(acc_d, acc_c, rtol=1e-5)
    assert not _XLAC._get_buffer_donation(acc_d)   # the mark stays with the donated buffer
    assert met.counter_value("UncachedCompile") == compiles + 1


def test_whole_training_step_compiled_dynamo_settles():
    """zero_grad, forward, backward and the optimizer step in one compiled function: Dynamo
    runs the device's kernels (generated code included) without tracing into them, so once
    warm it compiles no more frames, and the losses and weights are the CPU's."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    dev = copy.deepcopy(cpu).to(XLA)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (cpu, dev)]

    def step(model, opt, x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    cstep = torch.compile(step, backend="openxla")
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    xd, yd = x.to(XLA), y.to(XLA)
    for i in range(6):
        if i == 3:
            frames = counters["frames"]["total"]    # frames Dynamo has processed
        runs = met.counter_value("ExecuteCount")
        lc = step(cpu, opts[0], x, y)
        ld = cstep(dev, opts[1], xd, yd)
        xm.mark_step()
        if i >= 3:   # forward, backward and optimizer: one program
            assert met.counter_value("ExecuteCount") - runs == 1
        assert_same(ld, lc, rtol=1e-4, atol=1e-5)
    assert counters["frames"]["total"] == frames
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        assert_same(pd, pc, rtol=1e-4, atol=1e-5)
