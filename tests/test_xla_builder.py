"""Hand-built computations (`xla_builder`, `xla_op_registry`), DLPack, the scan GRU and the
model comparator, against eager PyTorch on the CPU."""
import torch
import torch.nn as nn
import pytest

import torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla.core.xla_op_registry as xor
import torch_xla.debug.metrics as met
import torch_xla.debug.model_comparator as mc
import torch_xla.utils.dlpack as xdlpack


def _run(name, fn, *tensors, **kwargs):
    op = xor.register(name, fn)
    return op(*[t.to(torch_xla.device()) for t in tensors], **kwargs)


def test_arithmetic_and_unary_ops(dev):
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    got = _run('arith', lambda x, y: ((x + y) * y - x / (y.exp())).tanh().max(x.sin()), a, b)
    torch.testing.assert_close(got.cpu(), torch.maximum(((a + b) * b - a / b.exp()).tanh(), a.sin()))


def test_tuple_result_and_cast(dev):
    a = torch.randn(2, 3)
    r, c = _run('tuple_cast', lambda x: xb.Op.tuple((x, x.cast(xb.Type.BF16))), a)
    assert r.dtype == torch.float32 and c.dtype == torch.bfloat16
    torch.testing.assert_close(c.cpu(), a.to(torch.bfloat16))


def test_shape_ops(dev):
    a = torch.randn(2, 3, 4)

    def fn(x):
        y = x.transpose([2, 0, 1]).reshape([4, 6])
        z = y.slice([0, 1], [4, 6], [2, 2])
        return xb.Op.concat_in_dim([z, z.rev([1])], 1).broadcast([2])
    y = a.permute(2, 0, 1).reshape(4, 6)[0:4:2, 1:6:2]
    want = torch.cat([y, y.flip(1)], 1).expand(2, 2, 6)
    torch.testing.assert_close(_run('shapes', fn, a).cpu(), want)


def test_reduce_with_computation(dev):
    a = torch.randn(5, 6)

    def fn(x):
        zero = xb.Op.scalar(x.builder(), 0, dtype=x.shape().dtype)
        return x.reduce(zero, lambda p, q: p + q, [1])
    torch.testing.assert_close(_run('reduce', fn, a).cpu(), a.sum(1))


def test_while_and_conditional(dev):
    a, b = torch.randn(2, 2), torch.randn(2, 2)

    def loop(x, y, limit=None):
        def cond(i, x, y):
            return i < xb.Op.scalar(i.builder(), limit, dtype=xb.Type.S32)

        def body(i, x, y):
            return xb.Op.tuple((i + xb.Op.scalar(i.builder(), 1, dtype=xb.Type.S32), x + y, y))
        zero = xb.Op.scalar(x.builder(), 0, dtype=xb.Type.S32)
        return xb.Op.mkwhile((zero, x, y), cond, body).get_tuple_element(1)
    torch.testing.assert_close(_run('while', loop, a, b, limit=7).cpu(), a + 7 * b)

    def pick(k, x, y, k0=None):
        pred = k > xb.Op.scalar(k.builder(), k0, dtype=k.shape().dtype)
        return pred.mkconditional((x, y), lambda x, y: x + y, lambda x, y: x - y)
    k = torch.tensor(0.5)
    torch.testing.assert_close(_run('cond', pick, k, a, b, k0=0.1).cpu(), a + b)
    torch.testing.assert_close(_run('cond', pick, k, a, b, k0=0.9).cpu(), a - b)


def test_triangular_solve(dev):
    A, B = torch.randn(3, 3).triu() + 3 * torch.eye(3), torch.randn(3, 2)
    got = _run('trsm', lambda b, a: a.triangualr_solve(b, True, False, False, False), B, A)
    torch.testing.assert_close(got.cpu(), torch.linalg.solve_triangular(A, B, upper=True), rtol=1e-4, atol=1e-5)


def test_dtype_error_at_build_line():
    b = xb.create_builder('bad')
    x = xb.mkparam(b, 0, xb.mkshape(xb.Type.F32, [2]))
    y = xb.mkparam(b, 1, xb.mkshape(xb.Type.S32, [2]))
    with pytest.raises(TypeError, match="different element types"):
        x + y


def test_type_maps_round_trip():
    for xla_type in xb._XLA_PT_TYPE_MAP:
        assert xb.Op.from_torch_type(xb.Op.to_torch_type(xla_type)) == xla_type


def test_same_computation_compiles_once(dev):
    def fn(a, b):
        return xb.Op.tuple([xb.Op.max(a, b) - xb.Op.min(a, b)])
    x = torch.tensor(10.0).to(dev)
    torch_xla.sync()
    met.clear_all()
    for _ in range(2):
        inputs = [torch.sin(x), torch.cos(x)]
        comp = xb.create_computation("c", fn, [xb.tensor_shape(p) for p in inputs])
        (out,) = torch_xla._XLAC._xla_user_computation("xla::c", inputs, comp)
        torch_xla.sync()
    assert met.counter_value("UncachedCompile") == 1
    torch.testing.assert_close(out.cpu(), (torch.sin(torch.tensor(10.0)) - torch.cos(torch.tensor(10.0))).abs())
    assert "HloModule" in xb.get_computation_hlo(comp)


def test_dlpack_round_trip(dev):
    a = torch.randn(3, 4)
    x = a.to(dev) * 2
    back = torch.utils.dlpack.from_dlpack(xdlpack.to_dlpack(x))
    torch.testing.assert_close(back, a * 2)
    y = xdlpack.from_dlpack(a)
    assert y.device.type == 'xla'
    torch.testing.assert_close(y.cpu(), a)


@pytest.mark.parametrize("bias,batch_first", [pytest.param(True, True, marks=pytest.mark.slow),
                                             pytest.param(False, False, marks=pytest.mark.slow)])
def test_gru_matches_cpu(dev, bias, batch_first):
    torch.manual_seed(0)
    ref = nn.GRU._orig(5, 7, num_layers=2, bias=bias, batch_first=batch_first)
    gru = nn.GRU(5, 7, num_layers=2, bias=bias, batch_first=batch_first)
    assert type(gru) is not nn.GRU._orig
    gru.load_state_dict(ref.state_dict())
    gru = gru.to(dev)
    x = torch.randn(3, 9, 5) if batch_first else torch.randn(9, 3, 5)
    x.requires_grad_()
    h = torch.randn(2, 3, 7, requires_grad=True)
    xx = x.detach().to(dev).requires_grad_()
    hh = h.detach().to(dev).requires_grad_()
    o1, h1 = ref(x, h)
    o2, h2 = gru(xx, hh)
    torch.testing.assert_close(o2.cpu(), o1)
    torch.testing.assert_close(h2.cpu(), h1)
    (o1.sum() + h1.sum()).backward()
    (o2.sum() + h2.sum()).backward()
    torch.testing.assert_close(xx.grad.cpu(), x.grad)
    torch.testing.assert_close(hh.grad.cpu(), h.grad)
    mine = dict(gru.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(mine[n].grad.cpu(), p.grad, rtol=1e-4, atol=1e-5)


def test_model_comparator_finds_difference(tmp_path, dev):
    d1, d2 = tmp_path / "a", tmp_path / "b"
    d1.mkdir()
    d2.mkdir()
    x = torch.randn(4, 4)
    mc.configure(str(d1))
    mc.save('t', x)
    mc.configure(str(d2))
    mc.save('t', x.to(dev))
    assert mc.compare(str(d1), str(d2)) == ""
    mc.save('t', x.to(dev) + 1)
    report = mc.compare(str(d1), str(d2))
    mc.configure(None)
    assert "Mismatch: t.1" in report


def test_dot_general_matches_einsum(dev):
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    got = torch_xla._XLAC._xla_dot_general(a.to(dev), b.to(dev), (([2], [1]), ([0], [0])))
    torch.testing.assert_close(got.cpu(), torch.einsum("bij,bjk->bik", a, b), rtol=1e-4, atol=1e-5)
    x, w = torch.randn(2, 1), torch.randn(1, 2)
    torch.testing.assert_close(torch_xla._XLAC._xla_dot_general(x.to(dev), w.to(dev), (([1], [0]), ())).cpu(), x @ w)


def test_bitwise_shifts_and_bool_scatter_add(dev):
    t1, t2 = torch.randint(-20, 20, (3, 4)), torch.randint(0, 10, (4,))
    torch.testing.assert_close(torch.bitwise_left_shift(t1.to(dev), t2.to(dev)).cpu(), torch.bitwise_left_shift(t1, t2))
    torch.testing.assert_close(torch.bitwise_right_shift(t1.to(dev), t2.to(dev)).cpu(), torch.bitwise_right_shift(t1, t2))
    torch.testing.assert_close((t1.to(dev) >> 2).cpu(), t1 >> 2)
    x = torch.zeros(5, dtype=torch.bool)
    idx, src = torch.tensor([0, 2, 2]), torch.tensor([True, False, True])
    torch.testing.assert_close(x.to(dev).scatter_add(0, idx.to(dev), src.to(dev)).cpu(), x.scatter_add(0, idx, src))
