"""`xla_builder.call_jax` (jax functions inside the lazy graph) and
`torch_xla._internal.jax_workarounds`, against eager PyTorch on the CPU."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla.debug.metrics as met
from torch_xla import _XLAC
from torch_xla._internal import jax_workarounds as jw


@pytest.fixture(autouse=True)
def _fresh_cache():
    xb._JAX_TO_XLA_COMPUTATION_CACHE.clear()


def _f(a, b):
    return a * jnp.sin(b) + 1


def _torch_f(a, b):
    return a * torch.sin(b) + 1


def _grads_cpu(fn, *tensors):
    """(result, grads) of `fn` on CPU copies of `tensors` that require grad."""
    xs = [t.detach().cpu().requires_grad_(t.requires_grad) for t in tensors]
    out = fn(*xs)
    out.backward()
    return out, [x.grad for x in xs]


def test_values_match_cpu(dev):
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out = xb.call_jax(_f, (a.to(dev), b.to(dev)))
    assert out.device.type == "xla" and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), _torch_f(a, b))


def test_pytrees_in_and_out(dev):
    a, b, c = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)

    def fn(inputs, scale, *, bias):
        x, (p, q) = inputs["x"], inputs["pair"]
        return {"sum": x + p * scale, "prod": [x * q + bias, jnp.tanh(p)]}

    out = xb.call_jax(fn, ({"x": a.to(dev), "pair": (b.to(dev), c.to(dev))}, 2.0), {"bias": 0.5})
    assert set(out) == {"sum", "prod"} and isinstance(out["prod"], list) and len(out["prod"]) == 2
    torch.testing.assert_close(out["sum"].cpu(), a + b * 2.0)
    torch.testing.assert_close(out["prod"][0].cpu(), a * c + 0.5)
    torch.testing.assert_close(out["prod"][1].cpu(), torch.tanh(b))


def test_static_leaves(dev):
    a = torch.randn(3, 3)

    def fn(x, num, string, dtype, none, table):
        assert isinstance(string, str) and none is None and isinstance(dtype, np.dtype)
        return (x + jnp.sin(num) + int(string) + table["y"]).astype(dtype)

    out = xb.call_jax(fn, (a.to(dev), 1.0, "10", torch.float64),
                      {"none": None, "table": {"y": torch.tensor(0.25).to(dev)}})
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.cpu(), (a + torch.sin(torch.tensor(1.0)) + 10 + 0.25).double())


def test_static_leaves_of_equal_value_and_other_type_trace_apart(dev):
    a = torch.ones(2).to(dev)

    def fn(x, n):
        return x * 0 + jnp.asarray(n)

    as_int = xb.call_jax(fn, (a, 2))
    as_float = xb.call_jax(fn, (a, 2.0))
    assert xb._jax_to_xla_computation_cache_elements() == 2
    torch.testing.assert_close(as_int.cpu(), torch.ones(2) * 0 + torch.tensor(2))
    torch.testing.assert_close(as_float.cpu(), torch.ones(2) * 0 + torch.tensor(2.0))


def test_integer_inputs_and_outputs(dev):
    x = torch.randn(4, 5)
    idx = torch.tensor([3, 0, 2])

    def fn(x, idx):
        return jnp.argmax(x, axis=1), jnp.take(x, idx, axis=1)

    amax, taken = xb.call_jax(fn, (x.to(dev), idx.to(dev)))
    assert amax.dtype == torch.int64
    torch.testing.assert_close(amax.cpu(), torch.argmax(x, dim=1))
    torch.testing.assert_close(taken.cpu(), torch.index_select(x, 1, idx))


def test_gradients_match_cpu(dev):
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    xa, xb_ = a.to(dev).requires_grad_(), b.to(dev).requires_grad_()
    out = xb.call_jax(_f, (xa, xb_)).sum()
    out.backward()
    ref, (ga, gb) = _grads_cpu(lambda p, q: _torch_f(p, q).sum(), xa, xb_)
    torch.testing.assert_close(out.cpu(), ref.detach())
    torch.testing.assert_close(xa.grad.cpu(), ga)
    torch.testing.assert_close(xb_.grad.cpu(), gb)


def test_gradients_through_pytree_outputs(dev):
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    xa, xb_ = a.to(dev).requires_grad_(), b.to(dev).requires_grad_()

    def fn(p):
        x, y = p
        return {"y": x * y, "z": jnp.exp(x), "i": jnp.argmax(x)}

    out = xb.call_jax(fn, ((xa, xb_),))
    assert not out["i"].requires_grad
    loss = out["y"].sum() + (out["z"] * 2).sum()
    loss.backward()
    _, (ga, gb) = _grads_cpu(lambda p, q: (p * q).sum() + (torch.exp(p) * 2).sum(), xa, xb_)
    torch.testing.assert_close(xa.grad.cpu(), ga)
    torch.testing.assert_close(xb_.grad.cpu(), gb)
    torch.testing.assert_close(out["i"].cpu(), torch.argmax(a))


def test_unused_and_integer_inputs_get_no_gradient(dev):
    x, y, unused = torch.randn(5), torch.randn(5), torch.randn(5)
    idx = torch.tensor([4, 1, 1])
    xs = [t.to(dev).requires_grad_() for t in (x, y, unused)]

    def fn(a, b, c, i):
        return jnp.sum(a[i] * 3.0) + jnp.sum(jnp.cos(b))

    xb.call_jax(fn, (*xs, idx.to(dev))).backward()
    cpu = [t.clone().requires_grad_() for t in (x, y, unused)]
    ((cpu[0][idx] * 3.0).sum() + torch.cos(cpu[1]).sum()).backward()
    torch.testing.assert_close(xs[0].grad.cpu(), cpu[0].grad)
    torch.testing.assert_close(xs[1].grad.cpu(), cpu[1].grad)
    assert xs[2].grad is None and cpu[2].grad is None


def test_gradient_only_for_inputs_that_require_it(dev):
    a, b = torch.randn(4), torch.randn(4)
    xa, xb_ = a.to(dev).requires_grad_(), b.to(dev)
    xb.call_jax(_f, (xa, xb_)).sum().backward()
    _, (ga, gb) = _grads_cpu(lambda p, q: _torch_f(p, q).sum(), xa, xb_)
    torch.testing.assert_close(xa.grad.cpu(), ga)
    assert xb_.grad is None and gb is None


def test_jax_grad_function_called_from_torch(dev):
    a, b = torch.randn(3, 3), torch.randn(3, 3)

    def fn(p, q):
        return jnp.sum(p + jnp.sin(q))

    ga, gb = xb.call_jax(jax.grad(fn, argnums=(0, 1)), (a.to(dev), b.to(dev)))
    _, (ra, rb) = _grads_cpu(lambda p, q: (p + torch.sin(q)).sum(), a.requires_grad_(), b.requires_grad_())
    torch.testing.assert_close(ga.cpu(), ra)
    torch.testing.assert_close(gb.cpu(), rb)


def test_double_backward(dev):
    a = torch.randn(6)
    xa = a.to(dev).requires_grad_()

    def fn(x):
        return jnp.sum(jnp.sin(x) * x)

    (g,) = torch.autograd.grad(xb.call_jax(fn, (xa,)), xa, create_graph=True)
    (g * g).sum().backward()
    ca = a.clone().requires_grad_()
    (cg,) = torch.autograd.grad((torch.sin(ca) * ca).sum(), ca, create_graph=True)
    (cg * cg).sum().backward()
    torch.testing.assert_close(g.detach().cpu(), cg.detach())
    torch.testing.assert_close(xa.grad.cpu(), ca.grad)


def test_complex_gradient_follows_pytorch_convention(dev):
    z = torch.randn(4, dtype=torch.complex64)
    xz = z.to(dev).requires_grad_()

    def fn(v):
        return jnp.sum(jnp.abs(v * v + 2j * v) ** 2)

    xb.call_jax(fn, (xz,)).backward()
    cz = z.clone().requires_grad_()
    (torch.abs(cz * cz + 2j * cz) ** 2).sum().backward()
    torch.testing.assert_close(xz.grad.cpu(), cz.grad)


def test_cache_by_shape_tree_static_name_and_dtype(dev):
    a, b = torch.ones(3, 3).to(dev), torch.ones(2, 2).to(dev)

    def fn(p, *rest):
        return jax.tree.leaves(p)[0] * 2

    start = xb._jax_to_xla_computation_cache_elements()
    xb.call_jax(fn, (a,))
    xb.call_jax(fn, (a,))
    assert xb._jax_to_xla_computation_cache_elements() - start == 1
    xb.call_jax(fn, (b,))                        # shape
    xb.call_jax(fn, ({"k": a},))                 # tree
    xb.call_jax(fn, (a, 1.0))                    # static leaf
    xb.call_jax(fn, (a, 2.0))
    xb.call_jax(fn, (a,), name="other")          # name
    xb.call_jax(fn, (a.double(),))               # dtype
    assert xb._jax_to_xla_computation_cache_elements() - start == 7
    xb.call_jax(fn, (a, 2.0))
    assert xb._jax_to_xla_computation_cache_elements() - start == 7


def test_override_hash_shares_the_trace_of_closures(dev):
    a = torch.ones(3).to(dev)
    outs = []
    for k in range(3):
        def closure(x):
            return x + 1.0
        outs.append(xb.call_jax(closure, (a,), override_hash="closure"))
    assert xb._jax_to_xla_computation_cache_elements() == 1
    for k in range(3):
        def closure(x):
            return x + 1.0
        xb.call_jax(closure, (a,))
    assert xb._jax_to_xla_computation_cache_elements() == 4
    torch.testing.assert_close(outs[-1].cpu(), torch.full((3,), 2.0))


def test_jax_configuration_is_part_of_the_key_and_applies_when_compiled(dev):
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    xa, xb_ = a.to(dev), b.to(dev)

    def fn(p, q):
        return p @ q

    before = jax.config.jax_default_matmul_precision
    try:
        jax.config.update("jax_default_matmul_precision", "highest")
        highest = xb.call_jax(fn, (xa, xb_))
        jax.config.update("jax_default_matmul_precision", "default")
        default = xb.call_jax(fn, (xa, xb_))
        xb.call_jax(fn, (xa, xb_))
        assert xb._jax_to_xla_computation_cache_elements() == 2
    finally:
        jax.config.update("jax_default_matmul_precision", before)
    # Printed (lowered) after the option changed back: each call keeps its own.
    dots = [[ln for ln in _XLAC._get_stablehlo_text([t]).splitlines() if "dot_general" in ln]
            for t in (highest, default)]
    assert len(dots[0]) == 1 and "HIGHEST" in dots[0][0]
    assert len(dots[1]) == 1 and "HIGHEST" not in dots[1][0]
    torch.testing.assert_close(highest.cpu(), a @ b)


def test_equal_calls_reuse_the_compiled_program(dev):
    def step(a, b):
        out = xb.call_jax(_f, (a.to(dev), b.to(dev)))
        torch_xla.sync()
        return out.cpu()

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(step(a, b), _torch_f(a, b))
    compiles = met.counter_value("UncachedCompile") or 0
    c, d = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(step(c, d), _torch_f(c, d))
    assert (met.counter_value("UncachedCompile") or 0) == compiles
    assert xb._jax_to_xla_computation_cache_elements() == 1


def test_name_scopes_the_operations_in_the_program(dev):
    from torch_xla._engine import executor
    a = torch.randn(3).to(dev)
    named = xb.call_jax(_f, (a, a), name="my_jax_op")
    unnamed = xb.call_jax(_f, (a, a))
    assert "my_jax_op/sin" in executor.lowered(_XLAC._roots([named])).as_text(debug_info=True)
    assert "_f/sin" in executor.lowered(_XLAC._roots([unnamed])).as_text(debug_info=True)
    assert "JaxFunction(my_jax_op" in _XLAC._get_xla_tensors_text([named])


def test_text_of_a_call_names_its_program_not_its_process(dev):
    # The text is part of the persistent compile cache's key, shared across processes.
    def make(c):
        def fn(x):
            return x + jnp.asarray(c)
        return fn

    avals = [((3,), np.dtype(np.float32))]
    c1, c2 = np.arange(3, dtype=np.float32), np.arange(3, dtype=np.float32) * 2
    one, again, other = (xb.jax_function(make(c), avals, k, "fn") for k, c in (("a", c1), ("b", c1), ("c", c2)))
    assert one != again and repr(one) == repr(again) and " at 0x" not in repr(one)
    assert repr(other) != repr(one)

    def host(x):
        return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 2

    cb = xb.jax_function(host, avals, "host", "host")
    assert " at 0x" in repr(cb)   # runs here only: the persistent cache refuses its program
    out = xb.apply_jax_function(cb, [torch.arange(3.0).to(dev)])[0]
    torch.testing.assert_close(out.cpu(), torch.sin(torch.arange(3.0)) * 2)


def test_eager_mode(dev):
    a, b = torch.randn(3), torch.randn(3)
    torch_xla.experimental.eager_mode(True)
    try:
        xa = a.to(dev).requires_grad_()
        out = xb.call_jax(_f, (xa, b.to(dev))).sum()
        out.backward()
        grad = xa.grad.cpu()
    finally:
        torch_xla.experimental.eager_mode(False)
    ref, (ga, _) = _grads_cpu(lambda p, q: _torch_f(p, q).sum(), a.requires_grad_(), b)
    torch.testing.assert_close(out.detach().cpu(), ref.detach())
    torch.testing.assert_close(grad, ga)


def test_under_torch_compile(dev):
    # Dynamo does not trace into jax: call_jax runs between compiled graphs.
    def fn(x, y):
        return xb.call_jax(_f, (x + 1, y)) * 2

    a, b = torch.randn(3, 3), torch.randn(3, 3)
    out = torch.compile(fn, backend="openxla")(a.to(dev), b.to(dev))
    torch.testing.assert_close(out.cpu(), _torch_f(a + 1, b) * 2)


def test_call_jax_flat_and_apply_jax_function(dev):
    a, b = torch.randn(2, 3), torch.randn(2, 3)

    def addmul(x, y):
        return x + y, x * y

    s, p = xb.call_jax_flat(addmul, [a.to(dev), b.to(dev)], name="addmul")
    torch.testing.assert_close(s.cpu(), a + b)
    torch.testing.assert_close(p.cpu(), a * b)
    fn = xb.jax_function(addmul, [((2, 3), np.dtype(np.float32))] * 2, addmul, "addmul")
    assert fn.out_avals == (((2, 3), np.dtype(np.float32)),) * 2
    s2, _ = xb.apply_jax_function(fn, [a.to(dev), b.to(dev)])
    torch.testing.assert_close(s2.cpu(), a + b)
    assert xb._jax_to_xla_computation_cache_elements() == 1
    with pytest.raises(ValueError, match="do not match"):
        xb.apply_jax_function(fn, [a.to(dev), torch.randn(3, 2).to(dev)])


def test_bad_arguments(dev):
    with pytest.raises(RuntimeError, match="same device"):
        xb.call_jax(_f, (torch.ones(2).to(dev), torch.ones(2)))
    with pytest.raises(TypeError, match="hashable"):
        xb.call_jax(lambda x, arr: x + arr, (torch.ones(2).to(dev), np.ones(2)))
    with pytest.raises(TypeError, match="no torch tensor holds"):
        xb.call_jax(lambda x: jax.random.key(0), (torch.ones(2).to(dev),))


def test_jax_workarounds():
    assert jw.maybe_get_jax() is jax
    torchax = jw.maybe_get_torchax()
    assert (torchax is None) == (importlib.util.find_spec("torchax") is None)
    jw.jax_import_guard()

    @jw.requires_jax
    def double(x, *, by=2):
        return x * by

    assert double.__name__ == "double" and double(3, by=3) == 9
    with jw.jax_env_context():
        pass
