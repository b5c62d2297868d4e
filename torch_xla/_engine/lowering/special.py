"""Special functions (torch.special, polygamma, incomplete gamma, ...) as pointwise lowerings.

Values follow PyTorch's CPU kernels, including their special cases (poles, negative
orders, non-integer polynomial degrees). Where the CPU kernel computes in double for
float32 (zeta, polygamma n >= 2: CPU `acc_type<float>` is double) or where a float32
evaluation would lose too much to cancellation (Bessel series), the math runs in
float64 (`_wide`) and is rounded once; x64 is always enabled by the runtime.
"""
from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
from jax import lax

from .table import lowering, out_dtype, out_shape

_EULER = 0.57721566490153286061
_PI = math.pi


# ---- helpers ------------------------------------------------------------------------------

def _cdtype():
    """Compute dtype for the node's (floating) output: half types are computed in float32."""
    dt = jnp.dtype(out_dtype())
    return jnp.dtype(jnp.float32) if dt.itemsize < 4 else dt


def _fp(*xs):
    """Arguments as arrays of the compute dtype (integer/bool inputs become floating)."""
    dt = _cdtype()
    out = tuple(jnp.asarray(x).astype(dt) for x in xs)
    return out if len(out) > 1 else out[0]


def _wide(x):
    """x in float64 (CPU kernels' double accumulation / headroom against cancellation)."""
    return x.astype(jnp.float64) if jax.config.jax_enable_x64 else x


def _inf(x):
    return jnp.full_like(x, jnp.inf)


def _nan(x):
    return jnp.full_like(x, jnp.nan)


def _series(x, term, first, n_terms):
    """sum_{k>=0} t_k with t_0 = first and t_k = t_{k-1} * term(k, x), a fixed number of terms."""
    def body(k, st):
        t, s = st
        t = t * term(k.astype(x.dtype), x)
        return t, s + t
    _, s = lax.fori_loop(1, n_terms, body, (first, first))
    return s


# ---- gamma family ------------------------------------------------------------------------------

def _digamma(x):
    # lax.digamma gives NaN at 0; the CPU kernel gives -inf at +0 and +inf at -0.
    return jnp.where(x == 0, jnp.copysign(_inf(x), -x), lax.digamma(x))


@lowering("aten::digamma", promote=True)
def digamma(x):
    return _digamma(_fp(x))


def _trigamma(x):
    """psi'(x): reflection below 0.5, six recurrence steps, then the asymptotic series."""
    small = x < 0.5
    s = jnp.sin(jnp.asarray(_PI, x.dtype) * x)
    res = jnp.where(small, -(jnp.asarray(_PI * _PI, x.dtype)) / (s * s), 0)
    y = jnp.where(small, 1 - x, x)
    for _ in range(6):
        res = res + 1 / (y * y)
        y = y + 1
    iyy = 1 / (y * y)
    res = res + (1 + 1 / (2 * y) + iyy * (1 / 6 - iyy * (1 / 30 - iyy * (1 / 42)))) / y
    return jnp.where(small, -res, res)


# (2j)! / B_2j for j = 1..12: the Euler-Maclaurin coefficients of the zeta tail.
_BERNOULLI = [Fraction(1, 6), Fraction(-1, 30), Fraction(1, 42), Fraction(-1, 30), Fraction(5, 66),
              Fraction(-691, 2730), Fraction(7, 6), Fraction(-3617, 510), Fraction(43867, 798),
              Fraction(-174611, 330), Fraction(854513, 138), Fraction(-236364091, 2730)]
_EM = [float(math.factorial(2 * j + 2) / b) for j, b in enumerate(_BERNOULLI)]
_MACHEP = 1.11022302462515654042e-16


def _zeta(x, q):
    """Hurwitz zeta (x, q) in x's dtype: direct sum until q + N > 9 (N >= 9), then the
    Euler-Maclaurin tail; stops adding terms once they are negligible (as the CPU does)."""
    special = (x == 1) | (x < 1) | ((q <= 0) & ((q == jnp.floor(q)) | (x != jnp.floor(x))))
    qs = jnp.where(special | jnp.isnan(q), 1, q)
    # Number of extra direct terms; capped so that absurd q cannot hang the device.
    nterms = jnp.clip(jnp.maximum(9, jnp.floor(9 - qs) + 1), 9, 1 << 20)
    s = jnp.power(qs, -x)

    def cond(st):
        k, s, b, done = st
        return jnp.any((k <= nterms) & ~done)

    def body(st):
        k, s, b, done = st
        act = (k <= nterms) & ~done
        bk = jnp.power(qs + k, -x)
        s = jnp.where(act, s + bk, s)
        b = jnp.where(act, bk, b)
        done = done | (act & (-_MACHEP * s < bk) & (bk < _MACHEP * s))
        return k + 1, s, b, done

    k0 = jnp.asarray(1, x.dtype)
    _, s, b, done = lax.while_loop(cond, body, (k0, s, jnp.zeros_like(s), jnp.zeros(s.shape, bool)))
    w = qs + nterms
    s = jnp.where(done, s, s + b * w / (x - 1) - 0.5 * b)
    a = jnp.ones_like(s)
    k = jnp.zeros_like(s)
    for c in _EM:
        a = a * (x + k)
        b = b / w
        t = a * b / c
        s = jnp.where(done, s, s + t)
        done = done | (jnp.abs(t / s) < _MACHEP)
        k = k + 1
        a = a * (x + k)
        b = b / w
        k = k + 1
    # The CPU kernel's checks, the first that applies wins.
    s = jnp.where(jnp.isnan(q), _nan(s), s)
    s = jnp.where((q <= 0) & (x != jnp.floor(x)), _nan(s), s)
    s = jnp.where((q <= 0) & (q == jnp.floor(q)), _inf(s), s)
    s = jnp.where(x < 1, _nan(s), s)
    return jnp.where(x == 1, _inf(s), s)


@lowering("aten::special_zeta", "aten::special_zeta.other_scalar", "aten::special_zeta.self_scalar",
          promote=True)
def special_zeta(x, q):
    x, q = _fp(x, q)
    return _zeta(_wide(x), _wide(q))


@lowering("aten::polygamma", "aten::special_polygamma", promote=True)
def polygamma(n, x):
    x = _fp(x)
    if n == 0:
        return _digamma(x)
    if n == 1:
        return _trigamma(x)
    xw = _wide(x)
    z = _zeta(jnp.full_like(xw, n + 1), xw).astype(x.dtype)
    return (1.0 if n % 2 else -1.0) * jnp.exp(lax.lgamma(jnp.asarray(n + 1.0, x.dtype))) * z


def _igamma_edges(a, x, v, upper):
    """The CPU kernel's special cases of the regularized incomplete gamma functions."""
    lo, hi = (1.0, 0.0) if upper else (0.0, 1.0)  # values of P/Q as x -> 0 and x -> inf
    nan = _nan(v)
    r = jnp.where(jnp.isinf(x), hi, v)
    r = jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(x), nan, lo), r)
    r = jnp.where(x == 0, lo, r)
    r = jnp.where(a == 0, jnp.where(x > 0, hi, nan), r)
    return jnp.where((x < 0) | (a < 0), nan, r)


@lowering("aten::igamma", promote=True)
def igamma(a, x):
    a, x = _fp(a, x)
    return _igamma_edges(a, x, jss.gammainc(a, x), upper=False)


@lowering("aten::igammac", promote=True)
def igammac(a, x):
    a, x = _fp(a, x)
    return _igamma_edges(a, x, jss.gammaincc(a, x), upper=True)


# ---- error function / normal distribution / entropy -----------------------------------------

@lowering("aten::special_ndtri", promote=True)
def special_ndtri(x):
    return jss.ndtri(_fp(x))


@lowering("aten::special_log_ndtr", promote=True)
def special_log_ndtr(x):
    return jss.log_ndtr(_fp(x))


@lowering("aten::special_erfcx", promote=True)
def special_erfcx(x):
    x = _fp(x)
    # jax's float32 erfcx underflows to 0 for x > ~9.2 (exp(x^2) overflows); use float64.
    return jss.erfcx(_wide(x)).astype(x.dtype)


@lowering("aten::special_entr", promote=True)
def special_entr(x):
    return jss.entr(_fp(x))


@lowering("aten::special_xlog1py", "aten::special_xlog1py.other_scalar", "aten::special_xlog1py.self_scalar",
          promote=True)
def special_xlog1py(x, y):
    return jss.xlog1py(*_fp(x, y))


# ---- modified Bessel functions -------------------------------------------------------------------

@lowering("aten::special_i0e", promote=True)
def special_i0e(x):
    return jss.i0e(_fp(x))


@lowering("aten::special_i1", promote=True)
def special_i1(x):
    return jss.i1(_fp(x))


@lowering("aten::special_i1e", promote=True)
def special_i1e(x):
    return jss.i1e(_fp(x))


@lowering("aten::special_modified_bessel_i0", promote=True)
def special_modified_bessel_i0(x):
    x = _fp(x)
    return jnp.exp(jnp.abs(x)) * jss.i0e(x)  # inf * 0 -> NaN at +-inf, as on the CPU


@lowering("aten::special_modified_bessel_i1", promote=True)
def special_modified_bessel_i1(x):
    x = _fp(x)
    return jnp.exp(jnp.abs(x)) * jss.i1e(x)


def _bessel_asym(x, nu, n_terms=14):
    """Hankel's asymptotic sums P, Q of order nu for large x (error ~ exp(-2x))."""
    mu = 4.0 * nu * nu
    p = jnp.ones_like(x)
    q = jnp.zeros_like(x)
    t = jnp.ones_like(x)
    for k in range(1, 2 * n_terms):
        t = t * (mu - (2 * k - 1) ** 2) / (k * 8.0 * x)
        if k % 2:
            q = q + (t if (k // 2) % 2 == 0 else -t)
        else:
            p = p + (-t if (k // 2) % 2 else t)
    return p, q


def _k_asym(x, nu, n_terms=24):
    """sum_k a_k(nu) / x^k of K_nu(x) ~ sqrt(pi / 2x) e^-x sum (error ~ exp(-2x))."""
    mu = 4.0 * nu * nu
    s = jnp.ones_like(x)
    t = jnp.ones_like(x)
    for k in range(1, n_terms):
        t = t * (mu - (2 * k - 1) ** 2) / (k * 8.0 * x)
        s = s + t
    return s


_KSERIES_MAX = 10.0


def _k_series(x, order):
    """K0 or K1 by their ascending series (float64; cancellation stays below 1e-10 for x <= 10)."""
    h = x * x / 4
    lg = jnp.log(x / 2)

    def body(k, st):
        t, hk, i_sum, k_sum = st  # t = h^k / (k! (k+order)!), hk = H_k
        kf = k.astype(x.dtype)
        t = t * h / (kf * (kf + order))
        hk = hk + 1 / kf
        if order == 0:
            return t, hk, i_sum + t, k_sum + t * hk
        return t, hk, i_sum + t, k_sum + t * (2 * hk + 1 / (kf + 1))

    t0 = jnp.ones_like(x)
    z = jnp.zeros_like(x)
    k_first = z if order == 0 else t0  # H_0 + H_1 = 1 for the k = 0 term of K1
    _, _, i_sum, k_sum = lax.fori_loop(1, 60, body, (t0, z, t0, k_first))
    if order == 0:
        return -(lg + _EULER) * i_sum + k_sum
    i1 = x / 2 * i_sum
    return 1 / x + lg * i1 - x / 4 * (k_sum - 2 * _EULER * i_sum)


def _k(x, order, scaled):
    xw = _wide(x)
    small = xw <= _KSERIES_MAX
    xs = jnp.where(small, jnp.maximum(xw, 1e-300), 1.0)
    xl = jnp.where(small, _KSERIES_MAX * 2, xw)
    ser = _k_series(xs, order)
    if scaled:
        ser = ser * jnp.exp(xs)
    asym = jnp.sqrt(_PI / (2 * xl)) * _k_asym(xl, order)
    if not scaled:
        asym = asym * jnp.exp(-xl)
    r = jnp.where(small, ser, asym)
    r = jnp.where(xw == jnp.inf, 0.0, r)
    r = jnp.where(xw == 0, jnp.inf, jnp.where(xw < 0, jnp.nan, r))
    r = jnp.where(jnp.isnan(xw), jnp.nan, r)
    return r.astype(x.dtype)


def _register_order_family(fn, names):
    """Registers `fn(x, order, flag)` for each (aten name, order, flag)."""
    for name, order, flag in names:
        lowering("aten::" + name, promote=True)(
            (lambda o, f: lambda x: fn(_fp(x), o, f))(order, flag))


_register_order_family(_k, (("special_modified_bessel_k0", 0, False), ("special_modified_bessel_k1", 1, False),
                            ("special_scaled_modified_bessel_k0", 0, True),
                            ("special_scaled_modified_bessel_k1", 1, True)))


# ---- Bessel functions of the first and second kind -----------------------------------------

_JSERIES_MAX = 12.0


def _j_series(x, order):
    """J0/J1 by the ascending series, plus the harmonic sums Y0/Y1 need."""
    h = -x * x / 4

    def body(k, st):
        t, hk, j_sum, y_sum = st
        kf = k.astype(x.dtype)
        t = t * h / (kf * (kf + order))
        hk = hk + 1 / kf
        if order == 0:
            return t, hk, j_sum + t, y_sum + t * hk
        return t, hk, j_sum + t, y_sum + t * (2 * hk + 1 / (kf + 1))

    t0 = jnp.ones_like(x)
    z = jnp.zeros_like(x)
    _, _, j_sum, y_sum = lax.fori_loop(1, 60, body, (t0, z, t0, z if order == 0 else t0))
    return j_sum, y_sum


def _bessel(x, order, second):
    """J/Y of order 0/1. The large-x phase x - (2 order + 1) pi/4 is rounded in x's own
    dtype, as the CPU kernel does, so the two agree for large arguments."""
    xw = _wide(x)
    ax = jnp.abs(xw)
    small = ax < _JSERIES_MAX
    xs = jnp.where(small, xw, 1.0)
    j_sum, y_sum = _j_series(xs, order)
    if not second:
        ser = j_sum if order == 0 else xs / 2 * j_sum
    else:
        xp = jnp.where(xs > 0, xs, 1.0)
        lg = jnp.log(xp / 2) + _EULER
        if order == 0:
            ser = 2 / _PI * (lg * j_sum - y_sum)
        else:
            # Y1 = (2/pi) (J1 ln(x/2) - 1/x) - (x / 2pi) sum (-h)^k/(k!(k+1)!) (psi(k+1) + psi(k+2))
            j1 = xp / 2 * j_sum
            ser = 2 / _PI * (j1 * jnp.log(xp / 2) - 1 / xp) - xp / (2 * _PI) * (y_sum - 2 * _EULER * j_sum)
    axl = jnp.where(small, _JSERIES_MAX * 2, ax)
    p, q = _bessel_asym(axl, order)
    # Odd orders change sign with x; the phase uses |x| (its rounding is symmetric).
    ph = _wide(jnp.where(small, 0, jnp.abs(x) - jnp.asarray((2 * order + 1) * _PI / 4, x.dtype)))
    amp = jnp.sqrt(2 / (_PI * axl))
    if not second:
        asym = amp * (p * jnp.cos(ph) - q * jnp.sin(ph))
        if order == 1:
            asym = jnp.where(xw < 0, -asym, asym)
    else:
        asym = amp * (p * jnp.sin(ph) + q * jnp.cos(ph))
    r = jnp.where(small, ser, asym)
    r = jnp.where(jnp.isinf(xw), jnp.nan, r)
    if second:
        r = jnp.where(xw == 0, -jnp.inf, jnp.where(xw < 0, jnp.nan, r))
    return r.astype(x.dtype)


_register_order_family(_bessel, (("special_bessel_j0", 0, False), ("special_bessel_j1", 1, False),
                                 ("special_bessel_y0", 0, True), ("special_bessel_y1", 1, True)))


@lowering("aten::special_spherical_bessel_j0", promote=True)
def special_spherical_bessel_j0(x):
    x = _fp(x)
    x2 = x * x
    # Taylor polynomial of sin(x)/x near 0 (no 0/0), sin(x)/x elsewhere, 0 at +-inf.
    series = 1 + x2 * (-1 / 6 + x2 * (1 / 120 + x2 * (-1 / 5040 + x2 * (1 / 362880 + x2 * (
        -1 / 39916800 + x2 * (1 / 6227020800))))))
    r = jnp.where(jnp.abs(x) < 0.5, series, jnp.sin(x) / jnp.where(x == 0, 1, x))
    return jnp.where(jnp.isinf(x), 0, r)


# ---- Airy function ---------------------------------------------------------------------------------

_AI0 = 0.355028053887817239260   # Ai(0)
_AIP0 = 0.258819403792806798405  # -Ai'(0)


def _airy_u(n_terms):
    """Coefficients u_k of the Airy asymptotic expansions (DLMF 9.7.2)."""
    u = [1.0]
    for k in range(1, n_terms):
        num = 1.0
        for j in range(2 * k + 1, 6 * k, 2):
            num *= j
        u.append(num / (math.factorial(k) * 216.0 ** k * math.factorial(2 * k - 1)))
    return u


_AIRY_U = _airy_u(16)


@lowering("aten::special_airy_ai", promote=True)
def special_airy_ai(x):
    x = _fp(x)
    xw = _wide(x)
    lo, hi = -7.0, 5.0
    mid = (xw >= lo) & (xw <= hi)
    # Maclaurin series Ai = Ai(0) f - (-Ai'(0)) g, in float64 (cancellation ~ e^zeta * eps).
    xs = jnp.where(mid, xw, 0.0)
    x3 = xs * xs * xs
    f = _series(xs, lambda k, x: x3 / ((3 * k - 1) * (3 * k)), jnp.ones_like(xs), 45)
    g = _series(xs, lambda k, x: x3 / ((3 * k) * (3 * k + 1)), xs, 45)
    ser = _AI0 * f - _AIP0 * g
    # x > 5: Ai ~ e^-zeta / (2 sqrt(pi) x^1/4) sum (-1)^k u_k / zeta^k.
    xp = jnp.where(xw > hi, xw, 2 * hi)
    zp = 2.0 / 3.0 * xp * jnp.sqrt(xp)
    sp = sum(((-1) ** k) * c / zp ** k for k, c in enumerate(_AIRY_U))
    pos = jnp.exp(-zp) / (2 * math.sqrt(_PI) * jnp.sqrt(jnp.sqrt(xp))) * sp
    # x < -7: oscillatory expansion. The phase zeta + pi/4 is rounded in x's dtype as on
    # the CPU, which matters once zeta is large.
    xn = jnp.where(xw < lo, x, jnp.asarray(2 * lo, x.dtype))
    t = jnp.sqrt(-xn)
    # XLA turns `/ 3` into `* (1/3)`, which rounds differently; dividing in float64 and
    # rounding once gives the correctly rounded float32 quotient the CPU computes.
    zeta_n = (_wide((-2 * xn) * t) / 3).astype(x.dtype)
    theta = _wide(zeta_n + jnp.asarray(_PI / 4, x.dtype))
    zn = _wide(zeta_n)
    pe = sum(((-1) ** (k // 2)) * c / zn ** k for k, c in enumerate(_AIRY_U) if k % 2 == 0)
    po = sum(((-1) ** (k // 2)) * c / zn ** k for k, c in enumerate(_AIRY_U) if k % 2 == 1)
    neg = (jnp.sin(theta) * pe - jnp.cos(theta) * po) / (math.sqrt(_PI) * jnp.sqrt(jnp.sqrt(-_wide(xn))))
    r = jnp.where(mid, ser, jnp.where(xw > hi, pos, neg))
    r = jnp.where(jnp.isinf(xw) | jnp.isnan(xw), jnp.nan, r)
    return r.astype(x.dtype)


# ---- orthogonal polynomials (degree n is a tensor) -------------------------------------------

def _degree(n):
    """The CPU kernels' int64 cast of n: truncation; NaN, +-inf and |n| >= 2^63 become
    INT64_MIN (x86), i.e. negative. Kept in the float dtype."""
    ok = jnp.isfinite(n) & (jnp.abs(n) < 2.0 ** 63)
    return jnp.where(ok, jnp.trunc(n), -1)


def _recurrence(p0, p1, n, step, loop, nan_stop=True):
    """q = P_n from P_0 = p0, P_1 = p1 and P_{k+1} = step(k, P_{k-1}, P_k), run per element
    while k < n (and P_k is not NaN, as the CPU loops stop), only where `loop`."""
    lim = jnp.where(loop, n, 0)

    def active(k, q):
        a = k < lim
        return (a & ~jnp.isnan(q)) if nan_stop else a

    def cond(st):
        k, p, q = st
        return jnp.any(active(k, q))

    def body(st):
        k, p, q = st
        a = active(k, q)
        r = step(k, p, q)
        return k + 1, jnp.where(a, q, p), jnp.where(a, r, q)

    _, _, q = lax.while_loop(cond, body, (jnp.asarray(1, p1.dtype), jnp.broadcast_to(p0, p1.shape), p1))
    return q


def _poly_args(x, n):
    x, n = _fp(x, n)
    x, n = jnp.broadcast_arrays(x, n)
    return x, _degree(n)


def _even(n):
    return jnp.fmod(n, 2) == 0


def _chebyshev(x, n, first, cos_from, closed, at_one, at_minus_one, shifted=False):
    """Chebyshev T/U/V/W (shifted: of 2x - 1): recurrence with P_1 = first(y), a closed
    form in acos(y) for |y| < 1 and n > cos_from, and the values at the ends of [-1, 1]."""
    y = x + x - 1 if shifted else x
    two_y = y + y
    # The shifted kernels test x == 1 and x == 0 rather than y = +-1.
    end_hi, end_lo = (x == 1, x == 0) if shifted else (x == 1, x == -1)
    inner = (n > cos_from) & (jnp.abs(y) < 1)
    loop = ~(end_hi | end_lo | inner) & (n >= 2)
    q = _recurrence(jnp.ones_like(y), first(y, two_y), n, lambda k, p, q: two_y * q - p, loop)
    theta = jnp.arccos(jnp.where(inner, y, 0))
    r = jnp.where(n == 0, 1, jnp.where(n == 1, first(y, two_y), q))
    r = jnp.where(inner, closed(theta, n, y), r)
    r = jnp.where(end_hi, at_one(n), jnp.where(end_lo, at_minus_one(n), r))
    return jnp.where(n < 0, 0, r)


def _t_closed(th, n, y):
    return jnp.cos(n * th)


def _u_closed(th, n, y):
    s = jnp.sin(th)
    return jnp.where(s != 0, jnp.sin((n + 1) * th) / jnp.where(s != 0, s, 1),
                     (n + 1) * jnp.cos((n + 1) * th) / y)


def _v_closed(th, n, y):
    alt = jnp.where(_even(n), n + n + 1, -(n + n + 1))
    ok = jnp.sin(th / 2) != 1
    return jnp.where(ok, jnp.cos((n + 0.5) * th) / jnp.where(ok, jnp.cos(th / 2), 1), alt)


def _w_closed(th, n, y):
    alt = jnp.where(y > 0, n + n + 1, jnp.where(_even(n), 1, -1))
    ok = jnp.cos(th / 2) != 1
    return jnp.where(ok, jnp.sin((n + 0.5) * th) / jnp.where(ok, jnp.sin(th / 2), 1), alt)


def _sgn_even(n, v):
    return jnp.where(_even(n), v, -v)


_CHEB = {
    # name: (P_1(y, 2y), closed form, cos_from (plain, shifted), P_n(1), P_n(-1))
    "t": (lambda y, ty: y, _t_closed, (6, 6), lambda n: jnp.ones_like(n), lambda n: _sgn_even(n, jnp.ones_like(n))),
    "u": (lambda y, ty: ty, _u_closed, (8, 6), lambda n: n + 1, lambda n: _sgn_even(n, n + 1)),
    "v": (lambda y, ty: ty - 1, _v_closed, (8, 6), lambda n: jnp.ones_like(n), lambda n: _sgn_even(n, n + n + 1)),
    "w": (lambda y, ty: ty + 1, _w_closed, (8, 4), lambda n: n + n + 1, lambda n: _sgn_even(n, jnp.ones_like(n))),
}


def _register_chebyshev(kind):
    first, closed, (c_plain, c_shift), at_one, at_minus_one = _CHEB[kind]

    @lowering(f"aten::special_chebyshev_polynomial_{kind}", f"aten::special_chebyshev_polynomial_{kind}.x_scalar",
              f"aten::special_chebyshev_polynomial_{kind}.n_scalar", promote=True)
    def plain(x, n):
        x, n = _poly_args(x, n)
        return _chebyshev(x, n, first, c_plain, closed, at_one, at_minus_one)

    @lowering(f"aten::special_shifted_chebyshev_polynomial_{kind}",
              f"aten::special_shifted_chebyshev_polynomial_{kind}.x_scalar",
              f"aten::special_shifted_chebyshev_polynomial_{kind}.n_scalar", promote=True)
    def shifted(x, n):
        x, n = _poly_args(x, n)
        return _chebyshev(x, n, first, c_shift, closed, at_one, at_minus_one, shifted=True)


for _kind in "tuvw":
    _register_chebyshev(_kind)


def _hermite_limit(dt):
    # The CPU kernels return NaN above this degree.
    return 128 if jnp.dtype(dt) == jnp.float32 else 512


@lowering("aten::special_hermite_polynomial_h", "aten::special_hermite_polynomial_h.x_scalar",
          "aten::special_hermite_polynomial_h.n_scalar", promote=True)
def special_hermite_polynomial_h(x, n):
    x, n = _poly_args(x, n)
    q = _recurrence(jnp.ones_like(x), x + x, n, lambda k, p, q: (x + x) * q - (k + k) * p,
                    (n >= 2) & (n <= _hermite_limit(x.dtype)), nan_stop=False)
    r = jnp.where(n > _hermite_limit(x.dtype), jnp.nan, jnp.where(n == 0, 1, jnp.where(n == 1, x + x, q)))
    return jnp.where(n < 0, 0, r)


@lowering("aten::special_hermite_polynomial_he", "aten::special_hermite_polynomial_he.x_scalar",
          "aten::special_hermite_polynomial_he.n_scalar", promote=True)
def special_hermite_polynomial_he(x, n):
    x, n = _poly_args(x, n)
    q = _recurrence(jnp.ones_like(x), x, n, lambda k, p, q: x * q - k * p,
                    (n >= 2) & (n <= _hermite_limit(x.dtype)), nan_stop=False)
    r = jnp.where(n > _hermite_limit(x.dtype), jnp.nan, jnp.where(n == 0, 1, jnp.where(n == 1, x, q)))
    return jnp.where(n < 0, 0, r)


@lowering("aten::special_laguerre_polynomial_l", "aten::special_laguerre_polynomial_l.x_scalar",
          "aten::special_laguerre_polynomial_l.n_scalar", promote=True)
def special_laguerre_polynomial_l(x, n):
    x, n = _poly_args(x, n)
    q = _recurrence(jnp.ones_like(x), 1 - x, n, lambda k, p, q: (((k + k) + (1 - x)) * q - k * p) / (k + 1),
                    (n >= 2) & (x != 0))
    r = jnp.where((x == 0) | (n == 0), 1, jnp.where(n == 1, 1 - x, q))
    return jnp.where(n < 0, 0, r)


@lowering("aten::special_legendre_polynomial_p", "aten::special_legendre_polynomial_p.x_scalar",
          "aten::special_legendre_polynomial_p.n_scalar", promote=True)
def special_legendre_polynomial_p(x, n):
    x, n = _poly_args(x, n)
    end = jnp.abs(x) == 1
    q = _recurrence(jnp.ones_like(x), x, n, lambda k, p, q: ((k + k + 1) * x * q - k * p) / (k + 1),
                    (n >= 2) & ~end)
    r = jnp.where(n == 0, 1, jnp.where(n == 1, x, q))
    r = jnp.where(end, jnp.where((x > 0) | _even(n), 1, -1), r)
    return jnp.where(n < 0, 0, r)


# ---- small pointwise ops ----------------------------------------------------------------------

@lowering("aten::nextafter")
def nextafter(x, y):
    """One ulp of the output dtype (bfloat16 too: no float32 compute) from x towards y."""
    dt = out_dtype()
    x, y = jnp.asarray(x).astype(dt), jnp.asarray(y).astype(dt)
    ut = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(x.dtype).itemsize]
    bits = lax.bitcast_convert_type(x, ut)
    away = (y > x) == (x > 0)  # moving away from zero increases the magnitude bits
    step = jnp.where(away, bits + 1, bits - 1)
    r = lax.bitcast_convert_type(step, x.dtype)
    tiny = lax.bitcast_convert_type(jnp.ones((), ut), x.dtype)
    r = jnp.where(x == 0, jnp.copysign(jnp.broadcast_to(tiny, r.shape), y), r)
    r = jnp.where(x == y, y, r)
    return jnp.where(jnp.isnan(x) | jnp.isnan(y), jnp.nan, r).astype(x.dtype)


@lowering("aten::frexp.Tensor")
def frexp(x):
    m, e = jnp.frexp(x)
    return m, e.astype(out_dtype(1))


@lowering("aten::logaddexp", promote=True)
def logaddexp(x, y):
    return jnp.logaddexp(*_fp(x, y))


@lowering("aten::logaddexp2", promote=True)
def logaddexp2(x, y):
    return jnp.logaddexp2(*_fp(x, y))


@lowering("aten::heaviside", promote=True)
def heaviside(x, values):
    # NaN input: the CPU kernel's `x == 0 ? values : x > 0` gives 0.
    dt = out_dtype()
    return jnp.where(x == 0, values, x > 0).astype(dt)


@lowering("aten::isposinf")
def isposinf(x):
    return x == jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros(x.shape, bool)


@lowering("aten::isneginf")
def isneginf(x):
    return x == -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros(x.shape, bool)


# ---- shrink activations and PReLU (forward and backward) ----------------------------------------

@lowering("aten::softshrink", promote=True)
def softshrink(x, lambd=0.5):
    # x * 0 keeps NaN for NaN inputs, as the CPU kernel does.
    return jnp.where(x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, x * 0))


@lowering("aten::hardshrink", promote=True)
def hardshrink(x, lambd=0.5):
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros((), x.dtype), x)


@lowering("aten::softshrink_backward", "aten::hardshrink_backward", promote=True)
def shrink_backward(grad, x, lambd):
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros((), grad.dtype), grad)


@lowering("aten::_prelu_kernel", promote=True)
def prelu_kernel(x, w):
    return jnp.where(x > 0, x, w * x)


@lowering("aten::_prelu_kernel_backward", promote=True)
def prelu_kernel_backward(grad, x, w):
    gx = jnp.where(x > 0, grad, w * grad)
    gw = jnp.where(x > 0, jnp.zeros((), grad.dtype), x * grad)
    return jnp.broadcast_to(gx, out_shape(0)), jnp.broadcast_to(gw, out_shape(1))
