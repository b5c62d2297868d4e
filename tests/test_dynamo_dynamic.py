"""torch.compile(backend='openxla') with dynamic shapes (`dynamic=True`, `mark_dynamic`):
one Dynamo trace for every size, one XLA program per distinct size (compiled at its first
call, reused afterwards), values and gradients equal to eager PyTorch on CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend

import torch_xla.debug.metrics as met
from torch_xla._engine import env_vars
from helpers import XLA, assert_same


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


class MLP(torch.nn.Module):
    def __init__(self, d: int = 12, h: int = 24):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, h)
        self.fc2 = torch.nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(torch.nn.Module):
    """Pre-norm causal self-attention, written with the sizes read from `x`."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


def _pair(cls):
    torch.manual_seed(0)
    cpu = cls()
    return cpu, copy.deepcopy(cpu).to(XLA)


class _Backend:
    """A backend counting the FX graphs Dynamo hands it (one per trace; a trace that
    Dynamo restarts, e.g. to make a tensor of a float, reaches it twice)."""

    def __init__(self, name: str = "openxla"):
        self.graphs = 0
        self._backend = lookup_backend(name)

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self._backend(gm, example_inputs)


def _cpu_graphs(make_fn, calls, dynamic=True, mark=None, grad=True) -> int:
    """How many graphs Dynamo hands a backend for `make_fn()` on CPU tensors of the shapes
    of `calls` (argument tuples), compiled as the xla version is: the trace count to match."""
    torch._dynamo.reset()
    backend = _Backend("aot_eager")
    compiled = torch.compile(make_fn(), backend=backend, dynamic=dynamic)
    for args in calls:
        args = [a.clone().requires_grad_(a.requires_grad) for a in args]
        if mark is not None:
            torch._dynamo.mark_dynamic(args[0], mark)
        with torch.set_grad_enabled(grad):
            out = compiled(*args)
        if grad and isinstance(out, torch.Tensor) and out.requires_grad:
            out.backward()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return backend.graphs


def _compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def _loss(model):
    def step(x):
        return model(x).square().mean()
    return step


def _train_check(cpu, dev, compiled, x):
    """One forward and backward of the compiled loss on `x`'s device copy, compared with
    the CPU model's (loss, input and parameter gradients)."""
    xc = x.clone().requires_grad_()
    xd = x.to(XLA).requires_grad_()
    loss_d = compiled(xd)
    loss_d.backward()
    loss_c = cpu(xc).square().mean()
    loss_c.backward()
    assert_same(loss_d, loss_c, atol=1e-5, rtol=1e-4)
    assert_same(xd.grad, xc.grad, atol=1e-5, rtol=1e-4)
    for (name, pd), pc in zip(dev.named_parameters(), cpu.parameters()):
        assert_same(pd.grad, pc.grad, atol=1e-5, rtol=1e-4, msg=name)
        pd.grad = None
        pc.grad = None


def test_mlp_inference_dynamic_one_trace_one_program_per_size():
    cpu, dev = _pair(MLP)
    backend = _Backend()
    compiled = torch.compile(dev, backend=backend, dynamic=True)
    met.clear_all()
    seen = {}
    with torch.no_grad():
        for batch in (3, 5, 8, 5, 3):
            x = torch.randn(batch, 12)
            before = _compiles()
            assert_same(compiled(x.to(XLA)), cpu(x), atol=1e-5, rtol=1e-4)
            new = _compiles() - before
            # A new size compiles one program; a size seen before compiles nothing.
            assert new == (0 if batch in seen else 1), (batch, new)
            seen[batch] = True
    assert backend.graphs == 1
    assert met.counter_value("DynamoExtractCompiledGraph") == 1
    assert met.counter_value("DynamoCompileNewSizes") == 2   # 5 and 8 after the first size
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("cls,shapes", [
    (MLP, [(4, 12), (7, 12), (2, 12), (7, 12), (7, 12)]),
    pytest.param(Attention, [(2, 5, 16), (3, 7, 16), (4, 3, 16), (3, 7, 16)], marks=pytest.mark.slow),
], ids=["mlp", "attention"])
def test_training_dynamic_values_grads_and_caching(cls, shapes):
    cpu, dev = _pair(cls)
    cpu_graphs = _cpu_graphs(lambda: _loss(copy.deepcopy(cpu)),
                             [(torch.randn(*shape, requires_grad=True),) for shape in shapes])
    backend = _Backend()
    compiled = torch.compile(_loss(dev), backend=backend, dynamic=True)
    seen = {}
    for i, shape in enumerate(shapes):
        torch.manual_seed(i)
        x = torch.randn(*shape)
        before = _compiles()
        _train_check(cpu, dev, compiled, x)
        # A new size traces its programs and runs the step's pieces; the step as one
        # program (its forward and backward nodes) compiles at the size's second step.
        if seen.get(shape, 0) >= 2:
            assert _compiles() == before, f"{shape} was seen twice before: nothing may compile"
        elif shape not in seen:
            assert _compiles() > before
        seen[shape] = seen.get(shape, 0) + 1
    # Dynamo traced the function as often as on CPU tensors: once for the MLP; the
    # attention block's first trace restarts once (to make a tensor of a float).
    assert backend.graphs == cpu_graphs
    if cls is MLP:
        assert backend.graphs == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_mark_dynamic_one_trace():
    """`mark_dynamic` on the sequence dimension (no `dynamic=`): one trace serves every
    sequence length, one program per length."""
    cpu, dev = _pair(Attention)
    sizes = ((2, 6), (2, 3), (2, 8), (2, 3))
    calls = [(torch.randn(b, t, 16),) for b, t in sizes]
    cpu_graphs = _cpu_graphs(lambda: copy.deepcopy(cpu), calls, dynamic=None, mark=1, grad=False)
    backend = _Backend()
    compiled = torch.compile(dev, backend=backend)
    met.clear_all()
    seen = set()
    with torch.no_grad():
        for (x,) in calls:
            xd = x.to(XLA)
            torch._dynamo.mark_dynamic(xd, 1)
            before = _compiles()
            assert_same(compiled(xd), cpu(x), atol=1e-5, rtol=1e-4)
            assert _compiles() - before == (0 if x.shape[1] in seen else 1), x.shape
            seen.add(x.shape[1])
    assert backend.graphs == cpu_graphs == 1
    assert met.counter_value("DynamoExtractCompiledGraph") == 1
    assert met.counter_value("DynamoCompileNewSizes") == 2


def test_symbolic_sizes_in_the_graph():
    """Graphs whose ops take the symbolic sizes (views, factories, int results) get them
    bound from each call's shapes."""
    def fn(x, y):
        n = x.shape[0]
        flat = x.reshape(n * 2, -1)
        idx = torch.arange(n, device=x.device)
        z = flat[: n] + y[idx % y.shape[0]]
        return z, n * 2, x.new_zeros(n, 3).sum(1)

    calls = [(torch.randn(n, 10), torch.randn(3, 5)) for n in (4, 6, 10, 6)]
    cpu_graphs = _cpu_graphs(lambda: fn, calls)
    backend = _Backend()
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for x, y in calls:
        got = compiled(x.to(XLA), y.to(XLA))
        want = fn(x, y)
        assert got[1] == want[1]
        assert_same(got[0], want[0])
        assert_same(got[2], want[2])
    assert backend.graphs == cpu_graphs == 1


def test_float_argument_one_program():
    """A Python float of a dynamic graph reaches the graph as a 0-d CPU tensor: it is sent
    with each call, and one program serves every value."""
    def fn(x, alpha):
        return torch.tanh(x) * alpha + x.sum(0)

    backend = _Backend()
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    met.clear_all()
    for alpha in (0.5, 1.25, -3.0):
        x = torch.randn(5, 3)
        assert_same(compiled(x.to(XLA), alpha), fn(x, alpha))
    assert _compiles() == 1


def test_static_compile_retraces_then_goes_dynamic():
    """dynamic=None: Dynamo's second trace (automatic dynamic shapes) serves the sizes
    after it; the bridge's count of extracted graphs follows Dynamo's traces."""
    cpu, dev = _pair(MLP)
    backend = _Backend()
    compiled = torch.compile(dev, backend=backend)
    met.clear_all()
    with torch.no_grad():
        for batch in (2, 3, 4, 6):
            x = torch.randn(batch, 12)
            assert_same(compiled(x.to(XLA)), cpu(x), atol=1e-5, rtol=1e-4)
    assert backend.graphs == 2
    assert met.counter_value("DynamoExtractCompiledGraph") == 2


def test_new_sizes_debug_message(capsys):
    cpu, dev = _pair(MLP)
    compiled = torch.compile(dev, backend="openxla", dynamic=True)
    with env_vars.overlay({"XLA_DYNAMO_DEBUG": "1"}), torch.no_grad():
        for batch in (2, 5):
            x = torch.randn(batch, 12)
            assert_same(compiled(x.to(XLA)), cpu(x), atol=1e-5, rtol=1e-4)
    out = capsys.readouterr().out
    assert "no program for the input sizes" in out
    assert "(5, 12)" in out
