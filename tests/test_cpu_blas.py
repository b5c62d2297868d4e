"""float32 matrix products of CPU programs computed by PyTorch's BLAS inside the XLA
program (platform/cpu_blas.py, lowering/blas_cpu.py): values against eager PyTorch on
the CPU (the same BLAS, so equal bit for bit where eager's kernel is the plain product),
every transposed form read without a copy, what stays XLA's, and the opt-out."""
import os
import subprocess
import sys

import jax
import pytest
import torch

import torch_xla.core.xla_model as xm
from torch_xla._engine import executor, ir
from torch_xla._engine.executor.compile import platform_policy
from torch_xla._engine.executor.lower import build_fn
from torch_xla._engine.lowering import blas_cpu
from torch_xla._engine.platform import cpu_blas
from torch_xla._engine.platform import cpu
from torch_xla._engine.platform.base import ALL_PRODUCTS, LONG_REDUCTIONS
from torch_xla._engine.tensor import pending

from helpers import XLA, assert_same

_POLICY_PRODUCTS = type(platform_policy()).library_products


@pytest.fixture(autouse=True)
def _handler_takes_every_product(monkeypatch):
    """Executed programs give the handler every large float32 product, whatever this CPU's
    policy (with AVX-512 it keeps only long reductions), so that these tests see its calls;
    programs compiled before are set aside and put back after."""
    from torch_xla._engine.executor import compile as compiling
    assert cpu_blas.available()   # registers the handler, as the policy's own answer does
    monkeypatch.setattr(type(platform_policy()), "library_products", lambda self: ALL_PRODUCTS)
    saved = dict(compiling._cache)
    compiling._cache.clear()
    yield
    compiling._cache.clear()
    compiling._cache.update(saved)


def _program_text(*outs, products=(ALL_PRODUCTS,)):
    """The StableHLO of the pending values' program as the CPU executor lowers it (with
    several `products` settings: a list of texts)."""
    del outs  # kept alive as roots
    roots = [(s.node, s.idx) for s in pending.take_live() if type(s.node) is not ir.DeviceData]
    graph = executor.Graph(roots)
    texts = [jax.jit(build_fn(graph, True, library_products=p), keep_unused=True).lower(*graph.param_values()).as_text()
             for p in products]
    return texts[0] if len(texts) == 1 else texts


def _calls(text: str):
    """(trans_a, trans_b) of each call of the handler in `text`."""
    out = []
    for line in text.splitlines():
        if blas_cpu.TARGET in line:
            out.append(("trans_a = true" in line, "trans_b = true" in line))
    return out


def test_handler_is_built_and_registered():
    # The package builds its native part with setup.py; this machine has a compiler and
    # PyTorch's MKL, so the CPU platform must use it.
    assert cpu_blas.available()
    assert _POLICY_PRODUCTS(platform_policy()) in (LONG_REDUCTIONS, ALL_PRODUCTS)


def test_policy_gives_the_handler_every_product_only_without_avx512(monkeypatch):
    # With AVX-512, XLA's products (YNNPACK) were faster than the handler's on the decoder;
    # without it the handler's were (BENCHMARKS.md, issue 35).
    monkeypatch.setattr(cpu, "_HOST_CPU_FLAGS", frozenset({"avx2", "fma"}))
    assert _POLICY_PRODUCTS(platform_policy()) == ALL_PRODUCTS
    monkeypatch.setattr(cpu, "_HOST_CPU_FLAGS", frozenset({"avx2", "fma", "avx512f"}))
    assert _POLICY_PRODUCTS(platform_policy()) == LONG_REDUCTIONS


@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_mm_transposed_forms_equal_eager(ta, tb):
    torch.manual_seed(0)
    a = torch.randn(256, 320) if not ta else torch.randn(320, 256)
    b = torch.randn(320, 224) if not tb else torch.randn(224, 320)
    op_a = (lambda t: t.t()) if ta else (lambda t: t)
    op_b = (lambda t: t.t()) if tb else (lambda t: t)
    expect = op_a(a) @ op_b(b)
    xa, xb = a.to(XLA), b.to(XLA)
    got = torch.mm(op_a(xa), op_b(xb))
    assert _calls(_program_text(got)) == [(ta, tb)]
    assert torch.equal(got.cpu(), expect)


def test_bmm_transposes_and_permutes():
    torch.manual_seed(0)
    p = torch.randn(16, 128, 160)
    g = torch.randn(16, 128, 96)
    k = torch.randn(16, 160, 96)
    xp, xg, xk = p.to(XLA), g.to(XLA), k.to(XLA)
    r1 = torch.bmm(xp.transpose(1, 2), xg)            # pᵀ·g (attention's dV)
    r2 = torch.bmm(xg, xk.permute(0, 2, 1).transpose(-1, -2).transpose(1, 2))  # three swaps: one
    r3 = torch.matmul(xp, xk)                         # a plain product
    assert sorted(_calls(_program_text(r1, r2, r3))) == sorted([(True, False), (False, True), (False, False)])
    assert torch.equal(r1.cpu(), torch.bmm(p.transpose(1, 2), g))
    assert torch.equal(r2.cpu(), torch.bmm(g, k.transpose(1, 2)))
    assert torch.equal(r3.cpu(), torch.matmul(p, k))


def test_double_transpose_reads_the_source():
    torch.manual_seed(0)
    w = torch.randn(256, 192)
    x = torch.randn(512, 256)
    xw = w.to(XLA)
    got = torch.mm(x.to(XLA), xw.t().t())
    assert _calls(_program_text(got)) == [(False, False)]
    assert torch.equal(got.cpu(), x @ w)


def test_addmm_baddbmm_and_4d_matmul():
    torch.manual_seed(0)
    bias = torch.randn(72)
    x = torch.randn(128, 96)
    w = torch.randn(72, 96)
    q = torch.randn(2, 4, 64, 32)
    kk = torch.randn(2, 4, 64, 32)
    base = torch.randn(8, 64, 64)
    # addmm's bias is added after the product here, inside the BLAS call on the CPU
    assert_same(torch.nn.functional.linear(x.to(XLA), w.to(XLA), bias.to(XLA)), torch.nn.functional.linear(x, w, bias),
                rtol=1e-5, atol=1e-5)
    assert_same(torch.matmul(q.to(XLA), kk.to(XLA).transpose(-1, -2)), torch.matmul(q, kk.transpose(-1, -2)),
                rtol=1e-6, atol=1e-6)
    got = torch.baddbmm(base.to(XLA), q.reshape(8, 64, 32).to(XLA), kk.reshape(8, 64, 32).to(XLA).transpose(1, 2),
                        beta=0.5, alpha=2.0)
    assert_same(got, torch.baddbmm(base, q.reshape(8, 64, 32), kk.reshape(8, 64, 32).transpose(1, 2), beta=0.5,
                                   alpha=2.0), rtol=1e-6, atol=1e-5)


def test_4d_attention_products_read_transposes_behind_reshapes():
    # q·kᵀ of 4-D tensors reaches bmm as a view of an expand of kᵀ; its backward
    # transposes those views again: every operand is read through them with flags.
    torch.manual_seed(0)
    q = torch.randn(2, 8, 256, 32, requires_grad=True)
    k = torch.randn(2, 8, 256, 32, requires_grad=True)
    g = torch.randn(2, 8, 256, 256)
    xq, xk = (t.detach().to(XLA).requires_grad_() for t in (q, k))
    s = torch.matmul(xq, xk.transpose(-1, -2))
    (s * g.to(XLA)).sum().backward()
    calls = _calls(_program_text(s, xq.grad, xk.grad))
    assert len(calls) == 3 and calls[0] == (False, True), calls
    expect = torch.matmul(q, k.transpose(-1, -2))
    (expect * g).sum().backward()
    assert torch.equal(s.detach().cpu(), expect.detach())
    assert_same(xq.grad, q.grad, rtol=1e-6, atol=1e-5)
    assert_same(xk.grad, k.grad, rtol=1e-6, atol=1e-5)


def test_linear_training_gradients_equal_eager():
    torch.manual_seed(0)
    lin = torch.nn.Linear(192, 256, bias=False)
    lx = torch.nn.Linear(192, 256, bias=False).to(XLA)
    lx.load_state_dict(lin.state_dict())
    inp = torch.randn(4, 512, 192, requires_grad=True)
    ix = inp.detach().to(XLA).requires_grad_()
    (lin(inp).tanh() ** 2).sum().backward()
    (lx(ix).tanh() ** 2).sum().backward()
    xm.mark_step()
    assert_same(ix.grad, inp.grad, rtol=1e-5, atol=1e-6)
    assert_same(lx.weight.grad, lin.weight.grad, rtol=1e-5, atol=5e-5)   # sums of 2,048 rows


def test_what_stays_xla():
    torch.manual_seed(0)
    small = torch.mm(torch.randn(8, 8).to(XLA), torch.randn(8, 8).to(XLA))          # below the size
    f64 = torch.mm(torch.randn(128, 128, dtype=torch.float64).to(XLA), torch.randn(128, 128, dtype=torch.float64).to(XLA))
    bf = torch.mm(torch.randn(128, 128).bfloat16().to(XLA), torch.randn(128, 128).bfloat16().to(XLA))
    mv = torch.mv(torch.randn(512, 512).to(XLA), torch.randn(512).to(XLA))                # not a matrix product
    assert _calls(_program_text(small, f64, bf, mv)) == []
    xm.mark_step()


def test_empty_products():
    z = torch.mm(torch.randn(0, 5).to(XLA), torch.randn(5, 7).to(XLA))
    k0 = torch.mm(torch.randn(2048, 0).to(XLA), torch.randn(0, 1024).to(XLA))
    assert z.cpu().shape == (0, 7)
    assert torch.equal(k0.cpu(), torch.zeros(2048, 1024))


def test_opt_out_computes_with_xla():
    code = ("import torch, torch_xla\n"
            "from torch_xla._engine.platform import cpu_blas\n"
            "assert not cpu_blas.available()\n"
            "a, b = torch.randn(256, 384), torch.randn(384, 128)\n"
            "d = (torch.mm(a.to('xla'), b.to('xla')).cpu() - a @ b).abs().max().item()\n"
            "assert d < 1e-3, d\n"
            "print('ok')\n")
    env = dict(os.environ, PT_XLA_CPU_BLAS="0", PJRT_DEVICE="CPU")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_product_gradients_to_second_order():
    # A lowering may take jax.vjp of a forward holding such products (conv_cpu's patch
    # products, backward lowerings): each gradient is again a product, to any order.
    import numpy as np
    cpu_blas.available()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((48, 64)).astype(np.float32)
    b = rng.standard_normal((64, 40)).astype(np.float32)
    for ta, tb in [(False, False), (False, True), (True, False), (True, True)]:
        aa = a.T.copy() if ta else a
        bb = b.T.copy() if tb else b

        def f(x, y, prod):
            return (prod(x, y) ** 2).sum()

        def ours(x, y, ta=ta, tb=tb):
            return blas_cpu.product(x, y, ta, tb)

        def ref(x, y, ta=ta, tb=tb):
            return (x.T if ta else x) @ (y.T if tb else y)

        def g1(prod):
            return jax.grad(lambda x, y: f(x, y, prod), argnums=(0, 1))

        def g2(prod):
            return jax.grad(lambda x, y: sum(t.sum() for t in g1(prod)(x, y)) * 1.0, argnums=(0, 1))
        for got, want in zip(jax.jit(g1(ours))(aa, bb) + jax.jit(g2(ours))(aa, bb),
                             g1(ref)(aa, bb) + g2(ref)(aa, bb)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-3)


def test_capsules_survive_jax_changing_pythonapi_prototypes():
    # jax.ffi.pycapsule sets argtypes on ctypes.pythonapi.PyCapsule_New, which every
    # library of the process shares; the engine's DLPack imports (tensors on xla:N, N > 0)
    # and the handler's registration use prototypes of their own.
    import ctypes
    from torch_xla._engine import tensor as engine_tensor
    jax.ffi.pycapsule(ctypes.cast(ctypes.pythonapi.Py_IncRef, ctypes.c_void_p).value)
    assert ctypes.pythonapi.PyCapsule_New.argtypes[2] is not ctypes.c_void_p
    buf = ctypes.create_string_buffer(8)
    cap = engine_tensor._capsule_new(ctypes.addressof(buf), b"probe", None)
    assert engine_tensor._capsule_pointer(cap, b"probe") == ctypes.addressof(buf)


def test_convolution_weight_gradient_of_a_long_reduction_is_the_handlers():
    """MNIST's first layer: the weight gradient g·patchesᵀ (10 x 73,728 by 73,728 x 25) is
    one call of the handler reading the patches transposed; a convolution whose gradient's
    reduction is short stays XLA's. Values and gradients against eager."""
    torch.manual_seed(0)
    for xs, conv, calls in (((128, 1, 28, 28), torch.nn.Conv2d(1, 10, 5), [(False, True)]),
                            ((128, 10, 12, 12), torch.nn.Conv2d(10, 20, 5), [])):
        x = torch.randn(xs)
        expect = conv(x)
        expect.square().sum().backward()
        dev = torch.nn.Conv2d(conv.in_channels, conv.out_channels, 5).to(XLA)
        dev.load_state_dict(conv.state_dict())
        got = dev(x.to(XLA))
        got.square().sum().backward()
        texts = _program_text(dev.weight.grad, products=(ALL_PRODUCTS, LONG_REDUCTIONS))
        assert [_calls(t) for t in texts] == [calls, calls]
        assert_same(got, expect, rtol=1e-5, atol=1e-4)
        assert_same(dev.weight.grad, conv.weight.grad, rtol=1e-4, atol=1e-2)
        assert_same(dev.bias.grad, conv.bias.grad, rtol=1e-4, atol=1e-2)
        conv.zero_grad()
