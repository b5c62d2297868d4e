"""FFTs, complex views and the conjugate bit against eager PyTorch on the CPU."""

import pytest
import torch

from helpers import XLA, assert_same, check_flat, no_fallback

FFT_TOL = dict(rtol=1e-4, atol=1e-4)


def check(fn, *args, grad=False, allow=None, **tol):
    return check_flat(fn, *args, grad=grad, allow=allow, **({**FFT_TOL, **tol}))


def rnd(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if not dtype.is_floating_point:
        return torch.randint(-5, 6, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def cplx(re, im):
    return torch.complex(re, im)


NORMS = [None, "forward", "ortho"]


# ---- transforms ----------------------------------------------------------------------------------

def test_c2c():
    """fft/ifft family of complex inputs (built from real ones, so they get gradients)."""
    F = torch.fft
    check(lambda a, b: (lambda z: [(
        F.fft(z, norm=norm), F.ifft(z, n=3, norm=norm), F.fft(z, n=7, dim=0, norm=norm),
        F.ifft2(z, s=(3, 6), norm=norm), F.fftn(z, norm=norm), F.ifftn(z, dim=(0, 2), norm=norm))
        for norm in NORMS])(cplx(a, b)),
        rnd(4, 5, 6), rnd(4, 5, 6, seed=1), grad=True)


def test_r2c_c2r():
    F = torch.fft
    check(lambda x, a, b: [(
        F.fft(x, norm=norm), F.ifft(x, norm=norm), F.rfft(x, n=5, dim=0, norm=norm),
        F.rfftn(x, s=(3, 8), dim=(0, 2), norm=norm), F.ihfft2(x, norm=norm),
        F.irfft(cplx(a, b), n=9, dim=1, norm=norm), F.irfftn(cplx(a, b), s=(4, 3, 6), norm=norm),
        F.hfft(cplx(a, b), n=4, dim=0, norm=norm), F.hfft2(cplx(a, b), norm=norm)) for norm in NORMS] + [
        F.rfft(x), F.rfft2(x), F.ihfft(x), F.ihfftn(x), F.fft2(x), F.fftn(x), F.ifft2(x), F.irfft(cplx(a, b)),
        F.irfft2(cplx(a, b)), F.hfft(cplx(a, b)), F.hfftn(cplx(a, b))],
        rnd(4, 5, 6), rnd(4, 5, 4, seed=1), rnd(4, 5, 4, seed=2), grad=True)


def test_r2c_grad_through_stale_view():
    """irfft's backward writes its result in place; a view of it reaching rfft's backward used to
    be regenerated under PyTorch's size reference (see fft.py)."""
    F = torch.fft
    check(lambda x: (F.irfft(F.rfft(x).mT.mT, n=16),
                     F.irfft(torch.view_as_complex(torch.view_as_real(F.rfft(x)).mT.mT), n=16)),
          rnd(3, 16), grad=True)


def test_many_dims_and_dtypes():
    """More than three transformed axes (lax.fft does at most three), float64/complex128,
    integer inputs (promoted to float) and 0/1-sized signals."""
    F = torch.fft
    x, z = rnd(2, 3, 4, 5, 2), rnd(2, 3, 4, 5, dtype=torch.complex128, seed=1)
    check(lambda x, z, i, y: (
        F.fftn(x), F.rfftn(x), F.irfftn(F.rfftn(x), s=x.shape), F.ifftn(z), F.hfftn(z), F.ihfftn(x),
        F.fftn(z, dim=(0, 1, 3)), F.rfftn(z.real), F.irfftn(z), F.fft(i), F.rfft2(i), F.fft(y), F.rfft(y),
        F.fft(x.double()), F.irfft(z, n=1)),
        x, z, rnd(3, 4, dtype=torch.int64), rnd(3, 1))
    check(lambda x: (F.fftn(x), F.irfftn(F.rfftn(x), s=x.shape)), x, grad=True)


def test_fft_helpers_and_bool():
    F = torch.fft
    check(lambda b, x: (F.fft(b), F.rfft(b), F.fftshift(F.fft2(x)), F.ifftshift(F.rfft(x), dim=0)),
          rnd(5, 4) > 0, rnd(5, 4, seed=1))


def test_stft_istft():
    """(istft checks its window envelope on the host with aten::equal, a host read by design.)"""
    x = rnd(2, 64)
    win = torch.hann_window(16)
    check(lambda x, w: (torch.stft(x, 16, hop_length=4, window=w, return_complex=True),
                        torch.stft(x, 16, center=False, onesided=False, return_complex=True),
                        torch.stft(x, 16, hop_length=4, window=w, normalized=True, return_complex=True).abs(),
                        torch.istft(torch.stft(x, 16, hop_length=4, window=w, return_complex=True), 16,
                                    hop_length=4, window=w, length=64)),
          x, win, grad=True, allow={"aten::equal"})


def test_complex128_dtype_kept():
    z = rnd(6, dtype=torch.complex128)
    with no_fallback():
        out = torch.fft.fft(z.to(XLA))
        assert out.dtype == torch.complex128
        assert_same(out, torch.fft.fft(z), rtol=1e-12, atol=1e-12)


# ---- complex views -------------------------------------------------------------------------------

def test_view_as_real_complex():
    check(lambda a, b, p: (lambda z: (torch.view_as_real(z), torch.view_as_complex(p), z.real, z.imag,
                                      torch.view_as_real(z)[..., 1] * 2, torch.view_as_complex(p).abs(),
                                      torch.view_as_real(torch.view_as_complex(p)).sum(-1)))(cplx(a, b)),
          rnd(3, 4), rnd(3, 4, seed=1), rnd(3, 4, 2, seed=2), grad=True)


def _writes_vr(z):
    torch.view_as_real(z).mul_(2)
    r = torch.view_as_real(z)
    r[..., 1].add_(1)
    return z


def _writes_vc(p):
    c = torch.view_as_complex(p)
    c.mul_(1j)
    c[0].add_(2 - 1j)
    return p, c


def _writes_parts(z):
    z.real.add_(3)
    z.imag.mul_(-1)
    return z


@pytest.mark.parametrize("fn,arg", [(_writes_vr, "z"), (_writes_vc, "p"), (_writes_parts, "z")])
def test_writes_through_complex_views(fn, arg):
    """Writing to view_as_real/view_as_complex/real/imag changes the base (functionalization)."""
    a = {"z": rnd(3, 4, dtype=torch.complex64), "p": rnd(3, 4, 2)}[arg]
    check(lambda a: fn(a.clone()), a)


def test_view_as_real_write_grad():
    """An in-place write through view_as_real inside an autograd graph."""
    def fn(a, b):
        z = cplx(a, b) * 1
        torch.view_as_real(z)[..., 0].mul_(3)
        return torch.fft.fft(z)
    check(fn, rnd(5), rnd(5, seed=1), grad=True)


# ---- the conjugate bit ---------------------------------------------------------------------------

def test_conj_values():
    """torch.conj is a lazy bit on the CPU; the device must give the same values everywhere."""
    def fn(z):
        c = torch.conj(z)
        return (c, c * 1, c.real, c.imag, torch.conj(c), c.resolve_conj(), torch.conj_physical(z), c.clone(),
                c.reshape(-1), c.t(), c[1:], torch.view_as_real(c.resolve_conj()), c.imag.resolve_neg(),
                torch._neg_view(z), torch.fft.fft(c), c.abs(), c.angle())
    check(fn, rnd(3, 4, dtype=torch.complex64))


def test_conj_writes_and_regenerated_view():
    def fn(z, w):
        z, w = z.clone(), w.clone()
        torch.conj(z).mul_(1j)  # writes conj(conj(z) * 1j) into z
        c = torch.conj(w)
        w.add_(1j)  # c sees the new w
        return z, c, c.imag
    check(fn, rnd(3, 4, dtype=torch.complex64), rnd(4, dtype=torch.complex64, seed=1))


def test_conj_grad():
    check(lambda a, b: (lambda z: (torch.conj(z) * z, torch.conj(z).imag, torch.conj_physical(z),
                                   torch.fft.ifft(torch.conj(z))))(cplx(a, b)),
          rnd(4, 3), rnd(4, 3, seed=1), grad=True)


def test_conj_cpu_tensor_to_device():
    z = rnd(5, dtype=torch.complex64)
    with no_fallback():
        assert_same(z.conj().to(XLA), z.conj().resolve_conj())


# ---- angle ---------------------------------------------------------------------------------------

def test_angle():
    x = torch.tensor([-2.0, -0.0, 0.0, 3.0, float("nan"), float("-inf"), float("inf")])
    check(lambda x, i, b, z: (torch.angle(x), torch.angle(i), torch.angle(b), torch.angle(z), torch.angle(x.bfloat16())),
          x, rnd(6, dtype=torch.int64), rnd(6) > 0, rnd(6, dtype=torch.complex64, seed=1))
    check(lambda x, a, b: (torch.angle(x), torch.angle(cplx(a, b))), rnd(6), rnd(6, seed=1), rnd(6, seed=2), grad=True)

