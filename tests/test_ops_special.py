"""Special functions, incomplete gamma, shrink/PReLU activations against eager PyTorch on the CPU."""

import torch
import torch.nn.functional as F

from helpers import check_flat

S = torch.special
NAN, INF = float("nan"), float("inf")

# Transcendental functions: float32 results within 1e-4 of the CPU kernels.
TOL = dict(rtol=1e-4, atol=1e-4)
# Ops that autograd formulas of these ops reach and other families lower.
OTHERS = {"aten::_local_scalar_dense"}


def check(fn, *args, grad=False, **tol):
    return check_flat(fn, *args, grad=grad, others=OTHERS, **{**TOL, **tol})


def grid(lo, hi, n, extra=()):
    return torch.cat([torch.linspace(lo, hi, n), torch.tensor(extra, dtype=torch.float32)])


def rnd(*shape, lo=-9.0, hi=9.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) * (hi - lo) + lo


# Large |x| included: oscillating functions there depend on the phase being rounded in
# float32 as on the CPU.
EDGES = [0.0, -0.0, 1e-8, -1e-8, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 30.0, -30.0, 100.0, -100.0, 300.25, -300.25,
         2345.5, -2345.5, 1e4, -1e4, 12345.0, -12345.0, INF, -INF, NAN]


def test_bessel_airy_family():
    x = grid(-25, 25, 301, EDGES)
    check(lambda x: (S.airy_ai(x), S.bessel_j0(x), S.bessel_j1(x), S.bessel_y0(x), S.bessel_y1(x),
                     S.modified_bessel_i0(x), S.modified_bessel_i1(x), S.modified_bessel_k0(x),
                     S.modified_bessel_k1(x), S.scaled_modified_bessel_k0(x), S.scaled_modified_bessel_k1(x),
                     S.spherical_bessel_j0(x), S.i0e(x), S.i1(x), S.i1e(x), S.erfcx(x), S.log_ndtr(x),
                     S.entr(x), S.ndtri(torch.sigmoid(x) * 1.25 - 0.125)), x)


def test_bessel_integer_and_bool_inputs():
    i = torch.arange(-12, 13)
    b = torch.tensor([True, False])
    check(lambda i, b: (S.airy_ai(i), S.bessel_y1(i), S.modified_bessel_k0(i), S.i1(b), S.entr(b)), i, b)


def test_bessel_bfloat16():
    x = grid(-8, 8, 41).to(torch.bfloat16)
    check(lambda x: (S.i0e(x), S.i1(x), S.i1e(x), S.entr(x), torch.digamma(x), torch.polygamma(2, x),
                     S.xlog1py(x, x.abs())), x, rtol=1.6e-2, atol=1e-2)


def test_unary_gradients():
    x = rnd(40, lo=0.2, hi=6)
    check(lambda x: (S.i0e(x), S.i1(x), S.i1e(x), S.erfcx(x), S.log_ndtr(x), S.entr(x), S.ndtri(x / 7),
                     torch.digamma(x), torch.polygamma(1, x), torch.polygamma(3, x), torch.lgamma(x)), x, grad=True)


def test_digamma_polygamma():
    x = grid(-12.3, 12.3, 247, [0.0, -0.0, -1.0, -2.0, -7.0, 1.0, 2.0, 1e-6, 50.0, 1e5, INF, -INF, NAN])
    i = torch.arange(-4, 5)
    check(lambda x, i: [torch.digamma(x), S.digamma(x), S.psi(x), torch.digamma(i),
                        torch.digamma(torch.tensor([True, False]))]
          + [torch.polygamma(n, x) for n in range(6)] + [S.polygamma(n, i) for n in range(4)], x, i,
          rtol=2e-4)


def test_zeta():
    x = grid(1, 12, 23, [0.5, 1.0, 0.0, -2.0, 2.0, 3.0, 4.0, 50.0, INF, NAN])
    q = rnd(x.numel(), lo=-12, hi=12, seed=1)
    q[:6] = torch.tensor([0.0, -1.0, -3.0, INF, -INF, NAN])
    qq = grid(0.1, 30, 33)
    ei, eq = torch.meshgrid(torch.tensor([-2.0, -1.5, 0.0, 1.0, 2.5, INF, NAN]),
                            torch.tensor([-INF, -2.0, -1.5, 0.0, 0.5, 1.0, INF, NAN]), indexing="ij")
    x = torch.cat([x, x.clamp(1.5, 9), ei.flatten()])
    q = torch.cat([q, q.abs() + 0.5, eq.flatten()])
    check(lambda x, q, qq: (S.zeta(x, q), S.zeta(x, 2.5), S.zeta(3.0, qq)), x, q, qq)


def test_zeta_integer_inputs():
    a = torch.arange(-3, 6).repeat(9)
    b = torch.arange(-3, 6).repeat_interleave(9)
    check(lambda a, b: (S.zeta(a, b), S.zeta(a, 2), S.zeta(3, b)), a, b)


def test_incomplete_gamma_and_xlog1py():
    e = torch.tensor([-INF, -1.0, 0.0, -0.0, 0.5, 1.0, 2.5, 30.0, INF, NAN])
    a, x = (t.contiguous() for t in torch.meshgrid(e, e, indexing="ij"))
    a = torch.cat([a.flatten(), rnd(60, lo=0.01, hi=20)])
    x = torch.cat([x.flatten(), rnd(60, lo=0, hi=25, seed=1)])
    check(lambda a, x: (torch.igamma(a, x), S.gammaincc(a, x), S.xlog1py(a, x), S.xlog1py(a, 0.5), S.xlog1py(2, x)),
          a, x)


def test_incomplete_gamma_xlog1py_gradients():
    a, x = rnd(30, lo=0.5, hi=8), rnd(30, lo=0.1, hi=10, seed=1)
    # igamma/igammac are differentiable in their second argument only.
    check(lambda a, x: (torch.igamma(a.detach(), x), torch.igammac(a.detach(), x), S.xlog1py(a, x),
                        S.zeta(a.detach() + 1.5, x)), a, x, grad=True)


def test_integer_promotion_of_binary_special():
    i, j = torch.arange(0, 12), torch.arange(1, 13).flip(0)
    check(lambda i, j: (S.xlog1py(i, j), torch.logaddexp(i.float(), j),
                        S.xlog1py(i, 0.5), S.zeta(j, 1.5)), i, j)


POLYS = ["chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
         "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
         "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he",
         "laguerre_polynomial_l", "legendre_polynomial_p"]


def _poly_grid():
    # (NaN x with n >= 2 is left out: the CPU kernels return an uninitialised value there.)
    xs = torch.cat([torch.linspace(-2.5, 2.5, 41), torch.tensor([-1.0, 1.0, 0.0, 0.5, -0.5, 0.999, -0.999])])
    ns = torch.tensor([-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.9, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 13.0,
                       25.0, 60.0, 129.0, NAN, INF, -INF])
    x, n = torch.meshgrid(xs, ns, indexing="ij")
    return x.contiguous(), n.contiguous()


def test_orthogonal_polynomials():
    x, n = _poly_grid()
    fs = [getattr(S, nm) for nm in POLYS]
    check(lambda x, n: [f(x, n) for f in fs], x, n, rtol=2e-4, atol=1e-4)


def test_orthogonal_polynomials_overloads_and_integers():
    x, n = _poly_grid()
    fs = [getattr(S, nm) for nm in POLYS]
    # Scalar x / scalar n overloads and integer inputs (promoted to float32), alternating kinds.
    check(lambda x, n: [f(x, 3) for f in fs[0::3]] + [f(0.25, n) for f in fs[1::3]]
          + [f(x.round().long(), n.nan_to_num(0, 0, 0).long()) for f in fs[2::3]], x, n, rtol=2e-4, atol=1e-4)


def test_small_pointwise_ops():
    x = torch.tensor([-INF, -3.5, -1.0, -0.0, 0.0, 1e-30, 0.75, 1.0, 2.0, 1e30, INF, NAN])
    y = torch.tensor([INF, -3.5, 2.0, 0.0, -1.0, 0.0, 0.75, NAN, -INF, 1e30, 1.0, 0.0])
    i = torch.tensor([-3, 0, 2, 7])
    b = torch.tensor([True, False, True, False])
    check(lambda x, y, i, b: (torch.nextafter(x, y), torch.nextafter(x.double(), y.double()),
                              *torch.frexp(x), *torch.frexp(x.double()), *torch.frexp(x.bfloat16()),
                              torch.logaddexp(x, y), torch.logaddexp2(x, y), torch.logaddexp(x.double(), y.double()),
                              torch.heaviside(x, y), torch.heaviside(i, i.flip(0)), torch.heaviside(x, torch.tensor(7.0)),
                              torch.isposinf(x), torch.isneginf(x), torch.isposinf(i), torch.isneginf(b),
                              torch.nextafter(x.bfloat16(), y.bfloat16())), x, y, i, b, rtol=1.3e-6, atol=1e-5)


def test_logaddexp_gradients():
    x, y = rnd(30), rnd(30, seed=1)
    check(lambda x, y: (torch.logaddexp(x, y), torch.logaddexp2(x, y), torch.logaddexp(x, 2.0 * y)), x, y, grad=True)


def test_shrink_prelu():
    x = torch.cat([rnd(3, 4, 5).flatten(), torch.tensor([0.5, -0.5, 0.25, -0.25, 0.0])])
    w = torch.tensor([0.25, -0.1, 2.0, 0.5])
    check(lambda x, w: (F.softshrink(x), F.softshrink(x, 0.25), F.hardshrink(x), F.hardshrink(x, 1.5),
                        F.prelu(x.reshape(-1)[:60].reshape(3, 4, 5), w), F.prelu(x, w[:1]),
                        torch.nn.functional.softshrink(torch.tensor([NAN]).to(x.device)),
                        torch.nn.functional.hardshrink(torch.tensor([NAN]).to(x.device))), x, w,
          grad=True, rtol=1.3e-6, atol=1e-5)


def test_shrink_prelu_bfloat16():
    x = rnd(40).to(torch.bfloat16)
    w = torch.tensor([0.25]).to(torch.bfloat16)
    check(lambda x, w: (F.softshrink(x, 0.3), F.hardshrink(x, 0.3), F.prelu(x, w)), x, w, rtol=1.6e-2, atol=1e-2)
