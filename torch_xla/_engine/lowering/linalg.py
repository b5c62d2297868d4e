"""Matrix products and linear algebra (forward and the backward ops autograd uses).

Products run at HIGHEST precision (full float32 on every backend) and bf16/f16 products
accumulate in float32 (the executor rounds the result once, as the CPU kernels do).
Factorizations follow LAPACK's conventions where PyTorch exposes them: `pivots` are
1-based int32 row swaps (getrf), `info` is int32 (0 = success, k > 0 = the failing
leading minor / zero pivot, 1-based).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from . import blas_cpu
from .table import matmul_precision, lowering, out_dtype, out_shape

_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _pet(*xs):
    """preferred_element_type: a float32 result for half types (where more math follows)."""
    dt = jnp.result_type(*xs)
    return jnp.float32 if np.dtype(dt) in _HALF else None


def _matmul(a, b, wide: bool = False):
    if blas_cpu.applies(a, b):
        return blas_cpu.matmul(a, b)
    # A half-precision product is a half-precision dot: XLA accumulates it in float32 and
    # rounds once, as PyTorch's CPU kernels do; `wide` keeps the float32 result for a sum
    # that follows (addmm's bias), so that it is rounded once too.
    return jnp.matmul(a, b, precision=matmul_precision(), preferred_element_type=_pet(a, b) if wide else None)


def _is_num(v, k):
    return isinstance(v, (int, float, bool)) and v == k


def _scaled_add(self, prod, beta, alpha):
    """beta * self + alpha * prod; with beta == 0 `self` is ignored (NaN/inf included)."""
    if not _is_num(alpha, 1):
        prod = prod * (jnp.asarray(alpha).astype(prod.dtype) if hasattr(alpha, "dtype") else alpha)
    if _is_num(beta, 0):
        return prod
    s = self.astype(prod.dtype)
    if not _is_num(beta, 1):
        s = s * (jnp.asarray(beta).astype(prod.dtype) if hasattr(beta, "dtype") else beta)
    return s + prod


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x)) if jnp.issubdtype(x.dtype, jnp.complexfloating) else _mT(x)


# ---- products -------------------------------------------------------------------------------------

_CNAME = {"float32": "float", "float64": "double", "float16": "c10::Half", "bfloat16": "c10::BFloat16",
          "int64": "long int", "int32": "int", "int16": "short int", "int8": "signed char", "uint8": "unsigned char",
          "complex64": "c10::complex<float>", "complex128": "c10::complex<double>", "bool": "bool"}


def _cname(dt) -> str:
    s = str(dt).replace("torch.", "")
    return _CNAME.get(s, s)


def _sname(dt) -> str:
    return torch.empty(0, dtype=dt).type().replace("torch.", "").replace("Tensor", "")


# PyTorch's meta kernels of mm, mv, addmm and addmv do not check that the operands share a
# dtype (its CPU kernels do): the checks below raise the CPU's error at the op's line.
def _meta_mm(x, y):
    if x.dtype != y.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {_cname(x.dtype)} != {_cname(y.dtype)}")
    return torch.ops.aten.mm.default(x, y)


def _meta_mv(x, y):
    if x.dtype != y.dtype:
        raise RuntimeError(f"addmv input tensors must have the same dtype, but got {_sname(x.dtype)} and "
                           f"{_sname(y.dtype)}")
    return torch.ops.aten.mv.default(x, y)


def _meta_addmm(self, m1, m2, beta=1, alpha=1):
    if self.dtype != m2.dtype:
        raise RuntimeError(f"self and mat2 must have the same dtype, but got {_sname(self.dtype)} and "
                           f"{_sname(m2.dtype)}")
    if m1.dtype != m2.dtype:
        raise RuntimeError(f"mat1 and mat2 must have the same dtype, but got {_sname(m1.dtype)} and "
                           f"{_sname(m2.dtype)}")
    return torch.ops.aten.addmm.default(self, m1, m2, beta=beta, alpha=alpha)


def _meta_addmv(self, m, v, beta=1, alpha=1):
    if not self.dtype == m.dtype == v.dtype:
        raise RuntimeError(f"addmv input tensors must have the same dtype, but got {_sname(self.dtype)}, "
                           f"{_sname(m.dtype)} and {_sname(v.dtype)}")
    return torch.ops.aten.addmv.default(self, m, v, beta=beta, alpha=alpha)


@lowering("aten::mm", meta=_meta_mm)
@lowering("aten::mv", meta=_meta_mv)
@lowering("aten::bmm")
def mm(x, y):
    return _matmul(x, y)


@lowering("aten::dot")
def dot(x, y):
    return jnp.dot(x, y, precision=matmul_precision())


@lowering("aten::vdot")
def vdot(x, y):
    return jnp.dot(jnp.conj(x), y, precision=matmul_precision())


@lowering("aten::addmm", meta=_meta_addmm)
@lowering("aten::addmv", meta=_meta_addmv)
@lowering("aten::baddbmm")
def addmm(self, m1, m2, beta=1, alpha=1):
    return _scaled_add(self, _matmul(m1, m2, wide=True), beta, alpha)


@lowering("aten::addbmm")
def addbmm(self, b1, b2, beta=1, alpha=1):
    p = jnp.einsum("bij,bjk->ik", b1, b2, precision=matmul_precision(), preferred_element_type=_pet(b1, b2))
    return _scaled_add(self, p, beta, alpha)


@lowering("aten::addr")
def addr(self, v1, v2, beta=1, alpha=1):
    p = v1[:, None] * v2[None, :]
    return _scaled_add(self, p, beta, alpha)


@lowering("aten::linalg_cross")
def linalg_cross(x, y, dim=-1):
    shape = out_shape()
    dt = out_dtype()
    x = jnp.broadcast_to(x.astype(dt), shape)
    y = jnp.broadcast_to(y.astype(dt), shape)
    d = dim % len(shape)
    x = jnp.moveaxis(x, d, -1)
    y = jnp.moveaxis(y, d, -1)
    x0, x1, x2 = x[..., 0], x[..., 1], x[..., 2]
    y0, y1, y2 = y[..., 0], y[..., 1], y[..., 2]
    r = jnp.stack([x1 * y2 - x2 * y1, x2 * y0 - x0 * y2, x0 * y1 - x1 * y0], axis=-1)
    return jnp.moveaxis(r, -1, d)


@lowering("aten::diag_embed")
def diag_embed(x, offset=0, dim1=-2, dim2=-1):
    shape = out_shape()
    nd = len(shape)
    d1, d2 = dim1 % nd, dim2 % nd
    k = x.shape[-1]
    n = k + abs(offset)
    i = np.arange(k)
    r, c = i + max(0, -offset), i + max(0, offset)
    m = jnp.zeros(x.shape[:-1] + (n, n), x.dtype).at[..., r, c].set(x)
    if d1 > d2:  # the diagonal plane's first axis is dim1 wherever it sits
        m = jnp.swapaxes(m, -1, -2)
        d1, d2 = d2, d1
    return jnp.moveaxis(m, (-2, -1), (d1, d2))


@lowering("aten::trace")
def trace(x):
    dt = out_dtype()
    return jnp.trace(x.astype(jnp.float32 if np.dtype(dt) in _HALF else dt))


# ---- distances ---------------------------------------------------------------------------------

def _cdist_uses_mm(p, r1, r2, mode):
    return p == 2.0 and (mode == 1 or ((mode is None or mode == 0) and (r1 > 25 or r2 > 25)))


@lowering("aten::_cdist_forward")
def cdist_forward(x1, x2, p, compute_mode=None):
    dt = out_dtype()
    x1, x2 = x1.astype(_calc_dt(dt)), x2.astype(_calc_dt(dt))
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    if x1.shape[-1] == 0:
        return jnp.zeros(out_shape(), dt)
    if _cdist_uses_mm(p, x1.shape[-2], x2.shape[-2], compute_mode):
        return euclidean_dist(x1, x2)  # |a|^2 + |b|^2 - 2 a.b (PyTorch's matrix-product path)
    return _p_norm_last(jnp.abs(x1[..., :, None, :] - x2[..., None, :, :]), p)


def _p_norm_last(diff, p):
    """The p-norm over the last axis of non-negative differences (cdist/pdist's sums)."""
    if p == 0:
        return jnp.sum((diff != 0).astype(diff.dtype), axis=-1)
    if p == float("inf"):
        return jnp.max(diff, axis=-1)
    if p == 1:
        return jnp.sum(diff, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    return jnp.sum(diff ** p, axis=-1) ** (1.0 / p)


@lowering("aten::_euclidean_dist")
def euclidean_dist(x1, x2):
    dt = out_dtype()
    x1, x2 = x1.astype(_calc_dt(dt)), x2.astype(_calc_dt(dt))
    n1 = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    n2 = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    d2 = n1 - 2 * _matmul(x1, _mT(x2), wide=True) + _mT(n2)
    return jnp.sqrt(jnp.maximum(d2, 0))


@lowering("aten::_cdist_backward")
def cdist_backward(grad, x1, x2, p, dist):
    """The gradient of cdist with respect to x1 (x2's comes from swapped arguments)."""
    dt = _calc_dt(out_dtype())
    grad, x1, x2, dist = (t.astype(dt) for t in (grad, x1, x2, dist))
    batch = out_shape()[:-2]
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    if p == 0 or x1.shape[-1] == 0:
        return jnp.zeros(out_shape(), dt)
    diff = x1[..., :, None, :] - x2[..., None, :, :]          # (..., P, R, M)
    g = grad[..., None]
    d = dist[..., None]
    zero = jnp.zeros((), dt)
    if p == 1:
        t = jnp.sign(diff)
    elif p == float("inf"):
        t = jnp.sign(diff) * (jnp.abs(diff) == d)
    elif p == 2:
        t = jnp.where(d == 0, zero, diff / jnp.where(d == 0, jnp.ones((), dt), d))
    else:
        ad = jnp.abs(diff)
        dn = jnp.where(d == 0, jnp.ones((), dt), d)
        t = jnp.sign(diff) * ad ** (p - 1) / dn ** (p - 1)
        t = jnp.where((d == 0) | ((p < 1) & (ad == 0)), zero, t)
    return jnp.sum(g * t, axis=-2)


def _calc_dt(dt):
    return jnp.float32 if np.dtype(dt) in _HALF else dt


# ---- triangular solves --------------------------------------------------------------------------

def _bcast_batch(a, b):
    """Broadcasts the batch dims of matrices a (..., m, m) and b (..., m, k)."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _tri_solve(a, b, lower, left=True, trans=False, conj=False, unit=False):
    a, b = _bcast_batch(a, b)
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=lower, transpose_a=trans,
                                       conjugate_a=conj, unit_diagonal=unit)


@lowering("aten::linalg_solve_triangular")
def linalg_solve_triangular(a, b, upper, left=True, unitriangular=False):
    return _tri_solve(a, b, lower=not upper, left=left, unit=unitriangular)


@lowering("aten::triangular_solve")
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    x = _tri_solve(a, b, lower=not upper, trans=transpose, unit=unitriangular)
    return x, jnp.broadcast_to(a, out_shape(1))


# ---- Cholesky ----------------------------------------------------------------------------------

def _chol_info(a, lfac):
    """LAPACK potrf's info: 0, or the order of the first leading minor that is not
    positive-definite (jax returns NaNs on failure, so the failing order is found by
    factoring the leading minors, only when the factorization failed)."""
    n = a.shape[-1]
    batch = a.shape[:-2]
    failed = jnp.any(jnp.isnan(lfac), axis=(-2, -1))
    if n == 0:
        return jnp.zeros(batch, jnp.int32)

    def find(_):
        # Minor k (1-based) embedded in an identity: rows/cols >= k replaced by I.
        idx = np.arange(n)
        keep = (idx[None, :, None] < idx[:, None, None] + 1) & (idx[None, None, :] < idx[:, None, None] + 1)
        eye = np.eye(n, dtype=bool)[None]
        m = jnp.where(keep, a[..., None, :, :], jnp.where(eye, jnp.ones((), a.dtype), jnp.zeros((), a.dtype)))
        lm = lax.linalg.cholesky(m, symmetrize_input=False)
        bad = jnp.any(jnp.isnan(lm), axis=(-2, -1))  # (..., n)
        k = jnp.argmax(bad, axis=-1).astype(jnp.int32) + 1
        return jnp.where(failed, k, 0).astype(jnp.int32)

    return lax.cond(jnp.any(failed), find, lambda _: jnp.zeros(batch, jnp.int32), None)


def _cholesky(a, upper):
    if upper:
        a = _mH(a)  # the upper triangle of A as a lower one
    lfac = lax.linalg.cholesky(a, symmetrize_input=False)
    info = _chol_info(a, lfac)
    lfac = jnp.tril(lfac)
    return (_mH(lfac) if upper else lfac), info


@lowering("aten::linalg_cholesky_ex")
def linalg_cholesky_ex(a, upper=False, check_errors=False):
    return _cholesky(a, upper)


@lowering("aten::cholesky")
def cholesky(a, upper=False):
    return _cholesky(a, upper)[0]


@lowering("aten::_cholesky_solve_helper")
def cholesky_solve_helper(b, f, upper):
    # A = L L^H (or U^H U): solve L Y = B, then L^H X = Y.
    if upper:
        y = _tri_solve(f, b, lower=False, trans=True, conj=True)
        return _tri_solve(f, y, lower=False)
    y = _tri_solve(f, b, lower=True)
    return _tri_solve(f, y, lower=True, trans=True, conj=True)


@lowering("aten::cholesky_inverse")
def cholesky_inverse(f, upper=False):
    n = f.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=f.dtype), f.shape)
    return cholesky_solve_helper(eye, f, upper)


# ---- LU ----------------------------------------------------------------------------------------

def _lu(a):
    """(LU, 1-based int32 pivots, 0-based permutation, info) of a batch of matrices."""
    k = min(a.shape[-2], a.shape[-1])
    batch = a.shape[:-2]
    if a.size == 0:  # an empty batch or 0-sized matrices: nothing to factor (argmax needs k > 0)
        return (a, jnp.ones(batch + (k,), jnp.int32), jnp.zeros(batch + (a.shape[-2],), jnp.int32),
                jnp.zeros(batch, jnp.int32))
    lu, piv, perm = lax.linalg.lu(a)
    d = jnp.diagonal(lu, axis1=-2, axis2=-1)[..., :k]
    zero = d == 0
    info = jnp.where(jnp.any(zero, axis=-1), jnp.argmax(zero, axis=-1) + 1, 0).astype(jnp.int32)
    return lu, (piv + 1).astype(jnp.int32), perm, info


def _perm_from_pivots(pivots, m):
    """The row permutation p (A[p] = L U) of 1-based LAPACK pivots."""
    return lax.linalg.lu_pivots_to_permutation((pivots - 1).astype(jnp.int32), m)


def _take_rows(x, perm):
    return jnp.take_along_axis(x, jnp.broadcast_to(perm[..., :, None], perm.shape + (x.shape[-1],)).astype(jnp.int32),
                               axis=-2)


def _lu_solve_left(lu, perm, b, adjoint):
    """Solves A X = B (adjoint: A^H X = B) for A[perm] = L U (L unit lower)."""
    lu, b = _bcast_batch(lu, b)
    perm = jnp.broadcast_to(perm, lu.shape[:-1])
    if not adjoint:
        y = _tri_solve(lu, _take_rows(b, perm), lower=True, unit=True)
        return _tri_solve(lu, y, lower=False)
    # A^H = U^H L^H P^T: solve U^H Z = B, L^H Y = Z, then X = P Y (X[perm] = Y).
    z = _tri_solve(lu, b, lower=False, trans=True, conj=True)
    y = _tri_solve(lu, z, lower=True, trans=True, conj=True, unit=True)
    inv = jnp.argsort(perm, axis=-1)
    return _take_rows(y, inv)


def _lu_solve(lu, perm, b, left, adjoint):
    if left:
        return _lu_solve_left(lu, perm, b, adjoint)
    # X A = B  <=>  A^H X^H = B^H  (and X A^H = B  <=>  A X^H = B^H)
    return _mH(_lu_solve_left(lu, perm, _mH(b), not adjoint))


@lowering("aten::linalg_lu_factor_ex")
def linalg_lu_factor_ex(a, pivot=True, check_errors=False):
    if not pivot:
        raise NotImplementedError("linalg.lu_factor: LU without pivoting is not implemented on the XLA device")
    lu, piv, _, info = _lu(a)
    return lu, piv, info


@lowering("aten::linalg_lu_solve")
def linalg_lu_solve(lu, pivots, b, left=True, adjoint=False):
    perm = _perm_from_pivots(pivots, lu.shape[-1])
    return _lu_solve(lu, perm, b, left, adjoint)


@lowering("aten::lu_unpack")
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2], lu.shape[-1]
    k = min(m, n)
    if unpack_pivots:
        perm = _perm_from_pivots(pivots, m)
        # A = P L U with P[perm[i], i] = 1
        p = (perm[..., None, :] == jnp.arange(m, dtype=perm.dtype)[:, None]).astype(lu.dtype)
    else:
        p = jnp.zeros(out_shape(0), lu.dtype)
    if unpack_data:
        low = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
        up = jnp.triu(lu[..., :k, :])
    else:
        low = jnp.zeros(out_shape(1), lu.dtype)
        up = jnp.zeros(out_shape(2), lu.dtype)
    return p, low, up


@lowering("aten::linalg_lu")
def linalg_lu(a, pivot=True):
    if not pivot:
        raise NotImplementedError("linalg.lu: LU without pivoting is not implemented on the XLA device")
    lu, piv, _, _ = _lu(a)
    return lu_unpack(lu, piv)


def _vector_rhs(a, b):
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])


@lowering("aten::_linalg_solve_ex")
def linalg_solve_ex_(a, b, left=True, check_errors=False):
    lu, piv, perm, info = _lu(a)
    vec = _vector_rhs(a, b)
    bm = b[..., None] if vec else b
    x = _lu_solve(lu, perm, bm, left, False)
    if vec:
        x = x[..., 0]
    return x, lu, piv, info


@lowering("aten::linalg_inv_ex")
def linalg_inv_ex(a, check_errors=False):
    lu, _, perm, info = _lu(a)
    n = a.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=a.dtype), a.shape)
    return _lu_solve_left(lu, perm, eye, False), info


def _det_parts(lu, piv):
    n = lu.shape[-1]
    d = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(piv != jnp.arange(1, n + 1, dtype=piv.dtype), axis=-1)
    sign = jnp.where(swaps % 2 == 1, -1, 1).astype(lu.dtype)
    return d, sign


def _lu_for_det(a):
    # PyTorch factors A^T for real (contiguous) input: its det backward reads LU that way.
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        return _lu(a)
    return _lu(_mT(a))


@lowering("aten::_linalg_det")
def linalg_det_(a):
    lu, piv, _, _ = _lu_for_det(a)
    d, sign = _det_parts(lu, piv)
    return sign * jnp.prod(d, axis=-1), lu, piv


@lowering("aten::_linalg_slogdet")
def linalg_slogdet_(a):
    lu, piv, _, _ = _lu_for_det(a)
    d, sign = _det_parts(lu, piv)
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        ad = jnp.abs(d)
        s = sign * jnp.prod(d / ad, axis=-1)
        logabs = jnp.sum(jnp.log(ad), axis=-1)
    else:
        s = sign * jnp.prod(jnp.sign(d), axis=-1)
        logabs = jnp.sum(jnp.log(jnp.abs(d)), axis=-1)
    return s, logabs, lu, piv


# ---- QR, SVD, eigh -----------------------------------------------------------------------------

@lowering("aten::linalg_qr")
def linalg_qr(a, mode="reduced"):
    if mode == "r":
        r = jnp.linalg.qr(a, mode="r")
        return jnp.zeros(out_shape(0), a.dtype), r
    q, r = jnp.linalg.qr(a, mode="complete" if mode == "complete" else "reduced")
    return q, r


@lowering("aten::_linalg_svd")
def linalg_svd_(a, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        s = jnp.linalg.svd(a, compute_uv=False)
        return jnp.zeros(out_shape(0), a.dtype), s, jnp.zeros(out_shape(2), a.dtype)
    u, s, vh = jnp.linalg.svd(a, full_matrices=full_matrices)
    return u, s, vh


@lowering("aten::_linalg_eigh")
def linalg_eigh_(a, UPLO="L", compute_v=True):
    w, v = jnp.linalg.eigh(a, UPLO=UPLO, symmetrize_input=False)
    if not compute_v:
        return w, jnp.zeros(out_shape(1), a.dtype)
    return w, v


@lowering("aten::linalg_eig")
def linalg_eig(a):
    # LAPACK geev on the CPU backend (as PyTorch): unit-norm eigenvectors, same order.
    w, v = jnp.linalg.eig(a)
    return w, v


@lowering("aten::linalg_matrix_exp")
def linalg_matrix_exp(a):
    dt = a.dtype
    return jax.scipy.linalg.expm(a.astype(_calc_dt(dt)))


@lowering("aten::linalg_householder_product")
def linalg_householder_product(a, tau):
    return lax.linalg.householder_product(a, tau)


# ---- least squares -------------------------------------------------------------------------------

def _lstsq_driver(driver):
    # The CPU's default; PyTorch picks "gels" for other devices, but results must match the CPU.
    return "gelsy" if driver is None else driver


def _lstsq_meta(a, b, rcond=None, driver=None):
    """Output shapes of linalg_lstsq (the CPU computes them with data-dependent resizes).
    Residuals assume full rank (gelsd/gelss return none on the CPU for a rank-deficient A)."""
    import torch
    driver = _lstsq_driver(driver)
    if a.dim() < 2:
        raise RuntimeError("torch.linalg.lstsq: input must have at least 2 dimensions.")
    if b.dim() < 1:
        raise RuntimeError("torch.linalg.lstsq: other must have at least 1 dimension.")
    if a.dtype != b.dtype:
        raise RuntimeError(f"torch.linalg.lstsq: Expected input and other to have the same dtype, "
                           f"but got input's dtype {a.dtype} and other's dtype {b.dtype}")
    if driver not in ("gels", "gelsy", "gelsd", "gelss"):
        raise RuntimeError("torch.linalg.lstsq: parameter `driver` should be one of (gels, gelsy, gelsd, gelss)")
    m, n = a.shape[-2], a.shape[-1]
    vec = b.dim() == a.dim() - 1
    bm = b.unsqueeze(-1) if vec else b
    if bm.shape[-2] != m:
        raise RuntimeError("torch.linalg.lstsq: input.size(-2) should match other.size(-2)")
    batch = torch.broadcast_shapes(a.shape[:-2], bm.shape[:-2])
    k = bm.shape[-1]
    sol = batch + ((n,) if vec else (n, k))
    res = (batch + (() if vec else (k,))) if (m > n and driver != "gelsy") else (0,)
    rank = batch if driver != "gels" else (0,)
    sv = batch + (min(m, n),) if driver in ("gelsd", "gelss") else (0,)
    real = a.dtype.to_real() if a.dtype.is_complex else a.dtype
    e = lambda s, dt: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    return e(sol, a.dtype), e(res, real), e(rank, torch.int64), e(sv, real)


@lowering("aten::linalg_lstsq", meta=_lstsq_meta)
def linalg_lstsq(a, b, rcond=None, driver=None):
    """Minimum-norm least squares through the SVD (what gelsd computes; gels/gelsy agree on
    full-rank inputs). Singular values below rcond * max(s) count as zero."""
    driver = _lstsq_driver(driver)
    m, n = a.shape[-2], a.shape[-1]
    vec = b.ndim == a.ndim - 1
    bm = b[..., None] if vec else b
    batch = jnp.broadcast_shapes(a.shape[:-2], bm.shape[:-2])
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    bm = jnp.broadcast_to(bm.astype(a.dtype), batch + bm.shape[-2:])
    real = jnp.finfo(a.dtype).dtype
    if rcond is None:
        rcond = float(jnp.finfo(a.dtype).eps) * max(m, n)
    if min(m, n) == 0:
        x = jnp.zeros(batch + (n, bm.shape[-1]), a.dtype)
        s = jnp.zeros(batch + (0,), real)
        rank = jnp.zeros(batch, jnp.int64)
    else:
        u, s, vh = jnp.linalg.svd(a, full_matrices=False)
        keep = s > rcond * s[..., :1]
        sinv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(a.dtype)
        x = _matmul(_mH(vh), sinv[..., :, None] * _matmul(_mH(u), bm))
        rank = jnp.sum(keep, axis=-1).astype(jnp.int64)
    outs = []
    if m > n and driver != "gelsy":
        r = _matmul(a, x) - bm
        res = jnp.sum(jnp.real(r * jnp.conj(r)), axis=-2)
        outs.append(res[..., 0] if vec else res)
    else:
        outs.append(jnp.zeros(out_shape(1), real))
    outs.append(rank if driver != "gels" else jnp.zeros(out_shape(2), jnp.int64))
    outs.append(s if driver in ("gelsd", "gelss") else jnp.zeros(out_shape(3), real))
    return (x[..., 0] if vec else x, *outs)


# ---- pdist ---------------------------------------------------------------------------------------

@lowering("aten::_pdist_forward")
def pdist_forward(x, p=2.0):
    """Distances between rows i < j in row-major order, summed directly (as the CPU)."""
    n = x.shape[0]
    dt = _calc_dt(out_dtype())
    i, j = np.triu_indices(n, 1)
    if i.size == 0 or x.shape[1] == 0:
        return jnp.zeros(out_shape(), dt)
    x = x.astype(dt)
    return _p_norm_last(jnp.abs(x[i] - x[j]), p)


@lowering("aten::_pdist_backward")
def pdist_backward(grad, x, p, dist):
    """cdist's backward on the symmetric matrices of grad and dist (each pair's term is odd
    in x_i - x_j, so row j receives the negated contribution of row i)."""
    n = x.shape[0]
    i, j = np.triu_indices(n, 1)
    if i.size == 0:
        return jnp.zeros(out_shape(), x.dtype)
    g = jnp.zeros((n, n), grad.dtype).at[i, j].set(grad).at[j, i].set(grad)
    d = jnp.zeros((n, n), dist.dtype).at[i, j].set(dist).at[j, i].set(dist)
    return cdist_backward(g, x, x, p, d)


# ---- Householder QR in LAPACK's compact form ------------------------------------------------------

def _geqrf_meta(a):
    import torch
    if a.dim() < 2:
        raise RuntimeError("torch.geqrf: input must have at least 2 dimensions.")
    m, n = a.shape[-2:]
    return torch.empty_like(a), a.new_empty(a.shape[:-2] + (min(m, n),))


@lowering("aten::geqrf", meta=_geqrf_meta)
def geqrf(a):
    # jax exports only its QR built on it; the primitive is LAPACK's geqrf on the CPU.
    from jax._src.lax.linalg import geqrf as _geqrf
    return _geqrf(a)


@lowering("aten::ormqr")
def ormqr(a, tau, c, left=True, transpose=False):
    """op(Q) @ c (left) or c @ op(Q) of the Q whose reflectors geqrf left in a and tau:
    the square Q built from them (reflectors past tau's are the identity)."""
    m, k = a.shape[-2], tau.shape[-1]
    batch = a.shape[:-2]
    v = a[..., :, :k]
    if k < m:
        v = jnp.concatenate([v, jnp.zeros(batch + (m, m - k), a.dtype)], axis=-1)
        tau = jnp.concatenate([tau, jnp.zeros(batch + (m - k,), tau.dtype)], axis=-1)
    q = lax.linalg.householder_product(v, tau)
    if transpose:
        q = jnp.conj(jnp.swapaxes(q, -1, -2))
    prec = matmul_precision()
    return jnp.matmul(q, c, precision=prec) if left else jnp.matmul(c, q, precision=prec)
