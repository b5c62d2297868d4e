"""One program per training step under torch.compile(backend='openxla') (the default;
XLA_DYNAMO_ONE_PROGRAM=0 switches back): the forward and backward graphs are pending IR
nodes, so a training step (forward graph, backward graph, optimizer) runs as one XLA
program. Other graphs run at once when their inputs are computed. Every result is compared with eager PyTorch on the
CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch_xla._engine import env_vars
from torch_xla.core import dynamo_bridge
from helpers import XLA, assert_same
from models import MNIST, Decoder, lm_data, lm_loss, mlp, mlp_batches, mnist_data


@pytest.fixture(autouse=True)
def _one_program(monkeypatch):
    monkeypatch.setenv("XLA_DYNAMO_ONE_PROGRAM", "1")
    env_vars.reload()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    monkeypatch.delenv("XLA_DYNAMO_ONE_PROGRAM")
    env_vars.reload()


def _runs() -> int:
    """Programs executed so far (each barrier's or captured program's run is one sample)."""
    data = met.metric_data("ExecuteTime")
    return data[0] if data else 0


def _pair(model_cls, *a, **k):
    torch.manual_seed(0)
    cpu = model_cls(*a, **k)
    return cpu, copy.deepcopy(cpu).to(XLA)


def _graph(*names):
    g = torch.fx.Graph()
    out = None
    for n in names:
        p = g.placeholder(n)
        out = p if out is None else g.call_function(torch.add, (out, p))
    g.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_bridge_picks_the_mode_from_the_graph_and_the_variable(monkeypatch):
    fwd, bwd, inference = _graph("primals_1", "primals_2"), _graph("primals_1", "tangents_1"), _graph("arg0_1")
    assert type(dynamo_bridge.extract_compiled_graph(fwd, [])) is dynamo_bridge.OneProgramGraph
    assert dynamo_bridge.extract_compiled_graph(bwd, []).kind == "backward"
    assert dynamo_bridge.extract_compiled_graph(inference, []).kind == ""
    monkeypatch.delenv("XLA_DYNAMO_ONE_PROGRAM")
    env_vars.reload()
    assert type(dynamo_bridge.extract_compiled_graph(fwd, [])) is dynamo_bridge.OneProgramGraph   # the default
    monkeypatch.setenv("XLA_DYNAMO_ONE_PROGRAM", "0")
    env_vars.reload()
    assert type(dynamo_bridge.extract_compiled_graph(fwd, [])) is dynamo_bridge.CompiledGraph


def test_inference_graph_runs_at_once():
    torch.manual_seed(0)
    cpu = torch.nn.Linear(8, 4)
    dev = copy.deepcopy(cpu).to(XLA)
    cdev = torch.compile(dev, backend="openxla")
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(2):
            runs = _runs()
            out = cdev(x.to(XLA))
            assert _runs() - runs >= 1        # ran before any barrier or host read
            assert_same(out, cpu(x), rtol=1e-5, atol=1e-6)


def test_steps_without_barrier_run_one_step_at_a_time():
    """A loop of compiled training steps with no torch_xla.sync(): each forward called on
    the previous step's pending parameters first runs that step as one program, so the
    lazy graph never chains steps and nothing recompiles once warm."""
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    dev = copy.deepcopy(cpu).to(XLA)
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(dev.parameters(), lr=0.1)
    cdev = torch.compile(dev, backend="openxla")
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    xd, yd = x.to(XLA), y.to(XLA)
    implicit0 = met.counter_value("DynamoImplicitStep") or 0
    for i in range(6):
        if i == 4:
            compiles = met.counter_value("UncachedCompile") or 0
        opt_c.zero_grad()
        lc = F.cross_entropy(cpu(x), y)
        lc.backward()
        opt_c.step()
        opt_d.zero_grad()
        ld = F.cross_entropy(cdev(xd), yd)
        ld.backward()
        opt_d.step()
    assert (met.counter_value("UncachedCompile") or 0) == compiles
    assert (met.counter_value("DynamoImplicitStep") or 0) - implicit0 >= 4
    assert_same(ld, lc, rtol=1e-4, atol=1e-5)
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        assert_same(pd, pc, rtol=1e-4, atol=1e-5)


def test_mnist_sgd_step_is_one_program_and_matches_cpu():
    cpu, dev = _pair(MNIST)
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    opt_d = torch.optim.SGD(dev.parameters(), lr=0.05, momentum=0.9)
    cdev = torch.compile(dev, backend="openxla")
    for i, (x, y) in enumerate(mnist_data(4)):
        runs, compiles = _runs(), met.counter_value("UncachedCompile") or 0
        opt_c.zero_grad()
        lc = F.nll_loss(cpu(x), y)
        lc.backward()
        opt_c.step()
        opt_d.zero_grad()
        ld = F.nll_loss(cdev(x.to(XLA)), y.to(XLA))
        ld.backward()
        opt_d.step()
        xm.mark_step()
        if i >= 2:
            assert _runs() - runs == 1                      # forward, backward and SGD together
            assert (met.counter_value("UncachedCompile") or 0) == compiles
        assert_same(ld, lc, rtol=1e-4, atol=1e-5)
    for (n, pc), pd in zip(cpu.state_dict().items(), dev.state_dict().values()):
        assert_same(pd, pc, rtol=1e-3, atol=1e-4, msg=n)    # weights and BN running stats (in place)


@pytest.mark.slow   # ~10 s; the MNIST test covers the mode in the default run
def test_decoder_adam_step_is_one_program_and_matches_cpu():
    cpu, dev = _pair(Decoder, n_layers=1)
    opt_c = torch.optim.Adam(cpu.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(dev.parameters(), lr=1e-2)
    cdev = torch.compile(dev, backend="openxla")
    for i, (x, y) in enumerate(lm_data(4, batch=2, seq=16)):
        runs = _runs()
        opt_c.zero_grad()
        lc = lm_loss(cpu(x), y)
        lc.backward()
        opt_c.step()
        opt_d.zero_grad()
        ld = lm_loss(cdev(x.to(XLA)), y.to(XLA))
        ld.backward()
        opt_d.step()
        xm.mark_step()
        if i >= 2:
            assert _runs() - runs == 1
        assert_same(ld, lc, rtol=1e-4, atol=1e-4)
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        assert_same(pd, pc, rtol=1e-3, atol=1e-3)   # Adam: near-zero gradients amplified


def test_whole_step_compiled_writes_parameters_in_place():
    """zero_grad, forward, backward and the optimizer in one compiled function: the
    optimizer's graph writes parameters and momentum buffers (its inputs) in place."""
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
    for i in range(5):
        runs = _runs()
        lc = step(cpu, opts[0], x, y)
        ld = cstep(dev, opts[1], xd, yd)
        xm.mark_step()
        if i >= 3:
            assert _runs() - runs == 1
        assert_same(ld, lc, rtol=1e-4, atol=1e-5)
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        assert_same(pd, pc, rtol=1e-4, atol=1e-5)
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        assert_same(opts[1].state[pd]["momentum_buffer"], opts[0].state[pc]["momentum_buffer"],
                    rtol=1e-4, atol=1e-5)


def test_inplace_input_and_chained_pending_calls():
    def f(acc, x):
        acc.add_(x.sum(0))
        return x * 2, acc.clone()

    cf = torch.compile(f, backend="openxla_eval")
    acc_c, acc_d = torch.zeros(3), torch.zeros(3, device=XLA)
    outs_c, outs_d = [], []
    for _ in range(3):
        x = torch.randn(4, 3)
        outs_c.append(f(acc_c, x))
        outs_d.append(cf(acc_d, x.to(XLA) * 1.0))   # pending input, no barrier between calls
    xm.mark_step()
    assert_same(outs_d, outs_c)
    assert_same(acc_d, acc_c)


def test_host_read_inside_the_step_gives_the_same_values():
    cpu, dev = _pair(mlp, 32)
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.05)
    opt_d = torch.optim.SGD(dev.parameters(), lr=0.05)
    cdev = torch.compile(dev, backend="openxla")
    for x, y in mlp_batches(3):
        opt_c.zero_grad()
        lc = F.cross_entropy(cpu(x), y)
        opt_d.zero_grad()
        ld = F.cross_entropy(cdev(x.to(XLA)), y.to(XLA))
        assert ld.item() == pytest.approx(lc.item(), rel=1e-5)   # before the backward
        lc.backward()
        ld.backward()
        opt_c.step()
        opt_d.step()
        xm.mark_step()
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        assert_same(pd, pc, rtol=1e-3, atol=1e-4)


def test_dropout_draws_new_numbers_each_call_in_one_step():
    cf = torch.compile(lambda x: F.dropout(x, 0.5, training=True), backend="openxla")
    x = torch.ones(64, 64)
    cf(x.to(XLA))                                # the first call traces
    a, b = cf(x.to(XLA)), cf(x.to(XLA))          # two nodes of one program
    xm.mark_step()
    a, b = a.cpu(), b.cpu()
    ref = F.dropout(x, 0.5, training=True)
    assert set(a.unique().tolist()) == set(ref.unique().tolist()) == {0.0, 2.0}
    assert not torch.equal(a, b)


def test_index_check_inside_the_graph_raises_the_cpu_error():
    torch.manual_seed(0)
    cpu = torch.nn.Embedding(10, 4)
    dev = copy.deepcopy(cpu).to(XLA)
    ce = torch.compile(dev, backend="openxla")
    good, bad = torch.tensor([1, 2, 3]), torch.tensor([1, 12, 3])
    for _ in range(2):                           # the second call is the graph's node
        out = ce(good.to(XLA))
        xm.mark_step()
        assert_same(out, cpu(good))
    with pytest.raises(IndexError) as want:
        cpu(bad)
    with pytest.raises(IndexError, match=str(want.value)):
        out = ce(bad.to(XLA))
        xm.mark_step()
        out.cpu()


def test_gradient_accumulation_is_one_program_per_step():
    """Two forward/backward pairs, then the optimizer: one program per step once warm."""
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    dev = copy.deepcopy(cpu).to(XLA)
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    opt_d = torch.optim.SGD(dev.parameters(), lr=0.1, momentum=0.9)
    cdev = torch.compile(dev, backend="openxla")
    batches = [(torch.randn(16, 8), torch.randint(0, 4, (16,))) for _ in range(2)]
    for i in range(5):
        runs = _runs()
        opt_c.zero_grad()
        opt_d.zero_grad()
        for x, y in batches:
            F.cross_entropy(cpu(x), y).backward()
            F.cross_entropy(cdev(x.to(XLA)), y.to(XLA)).backward()
        opt_c.step()
        opt_d.step()
        xm.mark_step()
        if i >= 3:
            assert _runs() - runs == 1
    for pc, pd in zip(cpu.parameters(), dev.parameters()):
        assert_same(pd, pc, rtol=1e-4, atol=1e-5)
