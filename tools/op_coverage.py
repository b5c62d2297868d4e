#!/usr/bin/env python3
"""Op conformance harness: PyTorch's OpInfo database, CPU versus the `xla` device.

For every OpInfo in `torch.testing._internal.common_methods_invocations.op_db` and each of
float32, bfloat16, int64 and bool that the OpInfo supports on the CPU, the first N sample
inputs are run on the CPU and on copies moved to xla:0, and the results compared with
`torch.testing.assert_close`.  Float32 samples of differentiable ops also compare the
gradients; OpInfos with error inputs check that the device raises the same exception type
inside the op call.

Each (op, dtype) is classified as
  native    equal to the CPU, no aten:: CPU-fallback counter incremented (other than the
            allowed aten::_local_scalar_dense and aten::nonzero, which fall back by design)
  fallback  equal to the CPU, but some aten:: fallback counter was incremented (recorded)
  fail      mismatch or exception (one-line reason recorded)
  skip      not applicable (reason recorded)
  random    random or uninitialised results: only shape/dtype/device checked, not compared
            (a metadata mismatch or exception is a `fail`)

Tolerances (documented in docs/op_coverage.md):
  float32   rtol 1.3e-6, atol 1e-5 (torch.testing defaults); rtol 1e-4, atol 1e-4 for ops that
            accumulate (reductions, matmul/conv, norms, softmax, losses, scans, linalg, fft,
            pooling, interpolation) and for all gradients
  bfloat16  rtol 1.6e-2, atol 1e-2
  int64/bool exact (a floating result of integer/bool inputs: float32 relaxed; any bfloat16
            result at least the bfloat16 tolerance)
  Where the OpInfo carries a `toleranceOverride` / `precisionOverride` for the dtype (in any
  DecorateInfo active on the CPU), the larger of it and the above is used.

The sweep runs in chunks of ops in worker subprocesses; a worker that dies or stalls has its
in-progress op re-run alone in a fresh subprocess to confirm, which is then recorded as
`fail: crashed (signal N)` or `fail: timeout`; the remaining ops of the chunk go on in a new
worker.

  python tools/op_coverage.py --samples 2 --out docs/op_coverage.md     # fast, all ops
  python tools/op_coverage.py --full                                    # all samples
  python tools/op_coverage.py --ops add,mul,nn.functional.conv2d        # a subset
  python tools/op_coverage.py --jobs 2                                  # parallel workers
"""
from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

XLA = torch.device("xla", 0)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}
# CPU fallbacks that are expected by design (data-dependent shapes / host reads).
ALLOWED_FALLBACKS = {"aten::_local_scalar_dense", "aten::nonzero"}

# Ops whose results are random or uninitialised: only shape/dtype/device are checked.
RANDOM_NAMES = {
    "bernoulli", "multinomial", "normal", "uniform", "rand_like", "randn_like", "randint_like",
    "randint", "randn", "rand", "randperm", "empty", "empty_like", "empty_strided", "empty_permuted",
    "new_empty", "new_empty_strided", "nn.functional.dropout", "nn.functional.dropout2d",
    "nn.functional.dropout3d", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "nn.functional.rrelu", "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "exponential", "geometric", "cauchy", "log_normal", "random", "torch.empty", "resize_", "resize_as_",
    "nn.functional.gumbel_softmax", "cuda.rng_state",
    # random Gaussian sketches (torch.randn inside): the device's stream differs from the CPU's
    "svd_lowrank", "pca_lowrank",
}

ACCUM_SUBSTR = (
    "sum", "mean", "prod", "var", "std", "norm", "matmul", "mm", "mv", "dot", "inner", "einsum",
    "tensordot", "conv", "linear", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
    "softmax", "logsumexp", "loss", "entropy", "pool", "interpolate", "upsample", "linalg", "cdist",
    "pdist", "trapz", "trapezoid", "kron", "fft", "grid_sample", "embedding_bag", "cov", "corrcoef",
    "distance", "similarity", "addr", "addcdiv", "addcmul", "lerp", "polar", "pow", "float_power",
    "cholesky", "lu", "qr", "svd", "eig", "inverse", "det", "solve", "pinv", "lstsq", "triangular",
    "baddbmm", "chain_matmul", "multi_dot", "sinc", "erfinv", "digamma", "polygamma", "lgamma",
    "mvlgamma", "igamma", "special", "attention", "histc", "renorm", "xlogy", "logit", "gelu",
    "silu", "mish", "softplus", "tan", "atan2", "hypot", "expm1", "log1p", "pixel", "affine_grid",
    "cross", "fmod", "remainder", "div", "reciprocal", "rsqrt", "sqrt", "exp", "log", "sigmoid",
    "elu", "selu", "celu", "hardswish", "tanh", "sin", "cos", "frexp", "ldexp", "glu", "rms",
    "vander", "diff", "gradient", "cosh", "sinh", "acos", "asin", "atan", "erf",
)

DEFAULT_TOL = {
    "float32": (1.3e-6, 1e-5),
    "float32_accum": (1e-4, 1e-4),
    "bfloat16": (1.6e-2, 1e-2),
    "int64": (0.0, 0.0),
    "bool": (0.0, 0.0),
}

# ---------------------------------------------------------------------------------------
# op database


_OP_DB = None


def op_db():
    global _OP_DB
    if _OP_DB is None:
        from torch.testing._internal.common_methods_invocations import op_db as db
        _OP_DB = list(db)
    return _OP_DB


def op_key(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def select_ops(spec):
    """Indices into op_db for a comma-separated list of names (all variants of a name), full
    keys (name.variant), or names without their `nn.functional.` / `_refs.` prefix."""
    db = op_db()
    if not spec:
        return list(range(len(db)))
    want = [s.strip() for s in spec.split(",") if s.strip()]
    out = []
    for w in want:
        hits = [i for i, op in enumerate(db) if op_key(op) == w]
        if not hits:
            hits = [i for i, op in enumerate(db) if op.name == w]
        if not hits:
            hits = [i for i, op in enumerate(db) if op.name in ("nn.functional." + w, "special." + w, "linalg." + w)]
        if not hits:
            print(f"warning: no OpInfo named {w!r}", file=sys.stderr)
        out += [i for i in hits if i not in out]
    return out


def is_random(op) -> bool:
    name = op.name
    if name in RANDOM_NAMES or op_key(op) in RANDOM_NAMES:
        return True
    base = name.split(".")[-1]
    return (base.startswith(("rand", "empty", "new_empty")) or "dropout" in base
            or base in ("normal", "bernoulli", "multinomial", "uniform"))


def _eigvecs_up_to_sign(res, sample=None):
    """Eigenvectors are defined up to sign (PyTorch's documentation says so): give each
    column the sign that makes its largest-magnitude entry positive."""
    vals, vecs = res
    v = vecs.detach()
    if v.numel() == 0:
        return vals, v
    idx = v.abs().argmax(dim=-2, keepdim=True)
    return vals, v * torch.sgn(torch.gather(v, -2, idx))


def _arg(sample, i, name, default):
    """Argument `name` of a sample (positional `i` after the input)."""
    if name in sample.kwargs:
        return sample.kwargs[name]
    return sample.args[i] if len(sample.args) > i else default


def _ties_in_index_order(res, sample):
    """sort / argsort without `stable=True`: PyTorch leaves the order of equal elements
    unspecified (the CPU's large-input sort is not stable), so the indices of each run of
    equal values are compared sorted. The values gathered through the indices are
    checked too, by comparing the indices' canonical form with the CPU's."""
    if _arg(sample, 2, "stable", False):
        return res
    dim = _arg(sample, 0, "dim", -1)
    x = sample.input.detach().cpu()
    idx = (res[1] if isinstance(res, (tuple, list)) else res).detach().cpu()
    if x.ndim == 0 or idx.numel() == 0:
        return res
    v = torch.gather(x, dim, idx)
    n = v.shape[dim]
    a, b = v.narrow(dim, 1, n - 1), v.narrow(dim, 0, n - 1)
    new_run = (a != b) & ~(a.isnan() & b.isnan()) if v.is_floating_point() else a != b
    group = torch.cat([torch.zeros_like(v.narrow(dim, 0, 1), dtype=torch.int64), new_run.long().cumsum(dim)], dim)
    canon = (group * n + idx).sort(dim).values % n
    dev = res[0].device if isinstance(res, (tuple, list)) else res.device
    v, canon = v.to(dev), canon.to(dev)
    return (res[0], v, canon) if isinstance(res, (tuple, list)) else canon


def _any_index_of_the_value(res, sample):
    """topk / kthvalue: any index of an element equal to the selected value is right (the
    CPU's selection picks an unspecified one among ties); the index is compared as the
    input's element it points to."""
    dim = _arg(sample, 1, "dim", -1)
    vals, idx = res
    x = sample.input.detach().cpu()
    idx = idx.detach().cpu()
    if x.ndim == 0:
        picked = x.reshape(idx.shape)
    elif idx.ndim == x.ndim:
        picked = torch.gather(x, dim, idx)
    else:
        picked = torch.gather(x, dim, idx.unsqueeze(dim)).squeeze(dim)
    return vals, picked.to(vals.device)


def _upcast(tree):
    return tree_map(lambda t: t.detach().double() if t.is_floating_point() else t.detach(), tree)


def _closer_than_cpu(op, sample, xres, cres, rtol, atol) -> bool:
    """A bfloat16 result that differs from the CPU's passes where no element is further
    from the float64 result (the op on the inputs upcast) than the CPU's own bfloat16
    element or the bfloat16 tolerance: CPU kernels that accumulate in bfloat16 (grid
    sampling, transposed convolutions, adaptive pooling) are less accurate than a device
    that accumulates in float32."""
    if not isinstance(cres, torch.Tensor) or not isinstance(xres, torch.Tensor) or not cres.is_floating_point():
        return False
    try:
        ref = op(_upcast(sample.input), *_upcast(tuple(sample.args)),
                 **{k: _upcast(v) for k, v in sample.kwargs.items()})
    except Exception:
        return False
    if not isinstance(ref, torch.Tensor) or ref.shape != cres.shape:
        return False
    ref = ref.detach()
    x, c = xres.detach().cpu().double(), cres.detach().double()
    bound = torch.maximum((c - ref).abs().nan_to_num(0.0, 0.0, 0.0),
                          max(atol, 1e-2) + max(rtol, 1.6e-2) * ref.abs())
    err = (x - ref).abs()
    same_nan = x.isnan() == ref.isnan()
    return bool(same_nan.all()) and bool((err.nan_to_num(0.0) <= bound).all())


# Matrix functions whose elements are compared to within rtol of the result's largest
# element (their error is relative to the matrix norm, on the CPU as here).
NORM_SCALED = {"matrix_exp"}

# Tensor arguments PyTorch requires on the CPU whatever the input's device (positions after
# the input): the OpInfo makes them there, and CUDA refuses them on the device as we do.
HOST_ARGS = {"tensor_split": (0,)}


# Outputs compared in a canonical form, where the op's result is not unique.
CANONICAL_FORM = {"linalg.eigh": _eigvecs_up_to_sign, "sort": _ties_in_index_order,
                  "argsort": _ties_in_index_order, "topk": _any_index_of_the_value,
                  "kthvalue": _any_index_of_the_value}


def sample_is_random(op, sample) -> bool:
    """Samples of otherwise deterministic ops that draw random numbers (dropout inside)."""
    if op.name == "nn.functional.multi_head_attention_forward":
        p = sample.args[9] if len(sample.args) > 9 else sample.kwargs.get("dropout_p", 0.0)
        return bool(sample.kwargs.get("training", True)) and p > 0
    return False


def is_accum(op) -> bool:
    name = op.name.lower()
    return any(s in name for s in ACCUM_SUBSTR)


def tolerance(op, dname, grad=False):
    """(rtol, atol) for op at dtype name `dname`."""
    if dname == "float32":
        rtol, atol = DEFAULT_TOL["float32_accum" if (grad or is_accum(op)) else "float32"]
    else:
        rtol, atol = DEFAULT_TOL[dname]
    if dname in ("int64", "bool"):
        return 0.0, 0.0
    dtype = DTYPES[dname]
    try:
        from torch.testing._internal.common_device_type import precisionOverride, toleranceOverride
        from torch.testing._internal.opinfo.core import DecorateInfo
    except Exception:  # pragma: no cover
        return rtol, atol
    for di in getattr(op, "decorators", None) or ():
        if not isinstance(di, DecorateInfo):
            continue
        if di.device_type not in (None, "cpu") or (di.dtypes is not None and dtype not in di.dtypes):
            continue
        try:
            if not di.active_if:
                continue
        except Exception:
            pass
        for dec in di.decorators:
            if isinstance(dec, toleranceOverride) and dtype in dec.d:
                t = dec.d[dtype]
                rtol, atol = max(rtol, t.rtol), max(atol, t.atol)
            elif isinstance(dec, precisionOverride) and dtype in dec.d:
                atol = max(atol, dec.d[dtype])
    return rtol, atol


# ---------------------------------------------------------------------------------------
# fake ops (used by the tests to exercise the runner)


class _FakeSample:
    def __init__(self, x):
        self.input, self.args, self.kwargs = x, (), {}
        self.output_process_fn_grad = lambda o: o


class FakeOp:
    """A minimal OpInfo stand-in. kind: ok | raise | crash | hang."""

    def __init__(self, kind):
        self.kind = kind
        self.name = "_fake_" + kind
        self.variant_test_name = ""
        self.supports_autograd = False
        self.error_inputs_func = None
        self.decorators = ()

    def supported_dtypes(self, device_type):
        return {torch.float32}

    def sample_inputs(self, device, dtype, requires_grad=False, **kw):
        yield _FakeSample(torch.arange(6, dtype=dtype))

    def __call__(self, x, *args, **kwargs):
        if x.device.type == "xla":
            if self.kind == "raise":
                raise ValueError("fake op raised on the device")
            if self.kind == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.kind == "abort":
                os._exit(3)
            if self.kind == "hang":
                time.sleep(3600)
        return x * 2


def resolve(ref):
    """An op reference (an int index into op_db, or 'fake:<kind>') -> op object."""
    if isinstance(ref, str) and ref.startswith("fake:"):
        return FakeOp(ref[5:])
    return op_db()[int(ref)]


# ---------------------------------------------------------------------------------------
# trees


def tree_map(fn, t):
    if isinstance(t, torch.Tensor):
        return fn(t)
    if isinstance(t, tuple) and hasattr(t, "_fields"):
        return type(t)(*(tree_map(fn, x) for x in t))
    if isinstance(t, (list, tuple)):
        return type(t)(tree_map(fn, x) for x in t)
    if isinstance(t, dict):
        return {k: tree_map(fn, v) for k, v in t.items()}
    return t


def tree_leaves(t, out=None):
    out = [] if out is None else out
    if isinstance(t, torch.Tensor):
        out.append(t)
    elif isinstance(t, (list, tuple)):
        for x in t:
            tree_leaves(x, out)
    elif isinstance(t, dict):
        for v in t.values():
            tree_leaves(v, out)
    return out


def _dev_fix(v, key=None):
    """Device arguments (factory kwargs): cpu -> xla:0."""
    if isinstance(v, torch.device) and v.type == "cpu":
        return XLA
    if (key == "device" or key == "arg") and isinstance(v, str) and (v == "cpu" or v.startswith("cpu:")):
        return "xla:0"
    return v


def to_device(tree, grad):
    def mv(t):
        x = t.detach().to(XLA)
        if grad and t.requires_grad and (t.is_floating_point() or t.is_complex()):
            x.requires_grad_(True)
        return x
    return tree_map(mv, tree)


def fresh_cpu(tree, grad):
    def cp(t):
        x = t.detach().clone()
        if grad and t.requires_grad and (t.is_floating_point() or t.is_complex()):
            x.requires_grad_(True)
        return x
    return tree_map(cp, tree)


def move_kwargs(kwargs, fn):
    out = {}
    for k, v in kwargs.items():
        v = fn(v)
        if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
            v = type(v)(_dev_fix(x) for x in v) if not hasattr(v, "_fields") else v
        out[k] = _dev_fix(v, k)
    return out


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    s = f"{type(e).__name__}: {first}"
    return s[:240]


# ---------------------------------------------------------------------------------------
# comparison


class Mismatch(Exception):
    pass


def compare(xr, cr, rtol, atol, path="out"):
    """xr: device result, cr: CPU result. Raises Mismatch with a one-line reason."""
    if isinstance(cr, torch.Tensor):
        if not isinstance(xr, torch.Tensor):
            raise Mismatch(f"{path}: expected a tensor, got {type(xr).__name__}")
        if xr.device.type != "xla" and cr.device.type == "cpu" and cr.numel() > 0:
            raise Mismatch(f"{path}: result on {xr.device}, not on xla")
        x = xr.detach().cpu()
        c = cr.detach()
        if x.shape != c.shape:
            raise Mismatch(f"{path}: shape {tuple(x.shape)} != {tuple(c.shape)}")
        if x.dtype != c.dtype:
            raise Mismatch(f"{path}: dtype {x.dtype} != {c.dtype}")
        if c.is_sparse or c.layout != torch.strided:
            c = c.to_dense()
            x = x.to_dense() if x.layout != torch.strided else x
        if c.is_floating_point():
            # The tolerance follows the result dtype: a bfloat16 result gets at least the bfloat16
            # tolerance; a floating result of integer/bool inputs the relaxed float32 one.
            if c.dtype in (torch.bfloat16, torch.float16):
                rtol, atol = max(rtol, 1.6e-2), max(atol, 1e-2)
            elif rtol == 0 and atol == 0:
                rtol, atol = DEFAULT_TOL["float32_accum"]
        elif c.is_complex() and rtol == 0 and atol == 0:
            rtol, atol = DEFAULT_TOL["float32_accum"]
        try:
            torch.testing.assert_close(x, c, rtol=rtol, atol=atol, equal_nan=True,
                                       check_device=False, check_stride=False, check_layout=False)
        except AssertionError:
            if c.dtype == torch.bool:
                n = int((x != c).sum())
                raise Mismatch(f"{path}: {n}/{c.numel()} bool elements differ")
            if c.is_complex():
                xf, cf = x.to(torch.complex128), c.to(torch.complex128)
                d = (xf - cf).abs()
                nan = torch.isnan(d) & ~(torch.isnan(xf) & torch.isnan(cf))
                d = torch.where(nan, torch.full_like(d, float("inf")), torch.nan_to_num(d, nan=0.0))
                bad = d > (atol + rtol * cf.abs())
                raise Mismatch(f"{path}: max abs diff {float(d.max()):.3g} (complex; "
                               f"{int(bad.sum())}/{c.numel()} elements beyond rtol={rtol:g} atol={atol:g})")
            xf, cf = x.double(), c.double()
            both_nan = torch.isnan(xf) & torch.isnan(cf)
            d = (xf - cf).abs()
            d = torch.where(both_nan, torch.zeros_like(d), d)
            d = torch.where(torch.isnan(d) | (torch.isinf(xf) | torch.isinf(cf)) & (xf != cf),
                            torch.full_like(d, float("inf")), d)
            d = torch.where((xf == cf), torch.zeros_like(d), d)
            bad = (d > (atol + rtol * cf.abs())) | (d == float("inf"))
            raise Mismatch(f"{path}: max abs diff {float(d.max()):.3g} "
                           f"({int(bad.sum())}/{c.numel()} elements beyond rtol={rtol:g} atol={atol:g})")
        return
    if isinstance(cr, (list, tuple)):
        if not isinstance(xr, (list, tuple)) or len(xr) != len(cr):
            raise Mismatch(f"{path}: expected a sequence of {len(cr)}, got {type(xr).__name__}"
                           + (f" of {len(xr)}" if isinstance(xr, (list, tuple)) else ""))
        for i, (a, b) in enumerate(zip(xr, cr)):
            compare(a, b, rtol, atol, f"{path}[{i}]")
        return
    if isinstance(cr, dict):
        for k in cr:
            compare(xr.get(k) if isinstance(xr, dict) else None, cr[k], rtol, atol, f"{path}[{k!r}]")
        return
    if isinstance(cr, (bool, int, float, complex)) and not isinstance(cr, torch.Tensor):
        if isinstance(xr, torch.Tensor):
            xr = xr.item()
        try:
            torch.testing.assert_close(xr, cr, rtol=rtol, atol=atol, equal_nan=True,
                                       check_dtype=False)
        except Exception:
            raise Mismatch(f"{path}: {xr!r} != {cr!r}")
        return
    if cr is None or isinstance(cr, (str, torch.Size, torch.dtype)):
        if xr != cr:
            raise Mismatch(f"{path}: {xr!r} != {cr!r}")
        return
    if isinstance(cr, torch.device):
        return
    # other objects: not compared


def check_meta(xr, cr, path="out"):
    """Random/uninitialised results: shape, dtype and device only."""
    if isinstance(cr, torch.Tensor):
        if not isinstance(xr, torch.Tensor):
            raise Mismatch(f"{path}: expected a tensor, got {type(xr).__name__}")
        if tuple(xr.shape) != tuple(cr.shape):
            raise Mismatch(f"{path}: shape {tuple(xr.shape)} != {tuple(cr.shape)}")
        if xr.dtype != cr.dtype:
            raise Mismatch(f"{path}: dtype {xr.dtype} != {cr.dtype}")
        if xr.device.type != "xla":
            raise Mismatch(f"{path}: result on {xr.device}, not on xla")
        xr.cpu()  # materialise
        return
    if isinstance(cr, (list, tuple)):
        if not isinstance(xr, (list, tuple)) or len(xr) != len(cr):
            raise Mismatch(f"{path}: expected a sequence of {len(cr)}")
        for i, (a, b) in enumerate(zip(xr, cr)):
            check_meta(a, b, f"{path}[{i}]")


# ---------------------------------------------------------------------------------------
# running one op


def _sync_quiet():
    try:
        torch_xla.sync()
    except Exception:
        pass


def _fallbacks():
    """CPU fallbacks (`aten::` counters) and ops served by a torch decomposition (`decomposed::`)."""
    return sorted(c for c in met.counter_names()
                  if (c.startswith("aten::") and c not in ALLOWED_FALLBACKS) or c.startswith("decomposed::"))


def _classify(results):
    """results: list of ('ok', fallbacks) | ('fail', reason) | ('skip', reason) | ('random', fb)."""
    fails = [r for r in results if r[0] == "fail"]
    if fails:
        return {"cls": "fail", "reason": fails[0][1]}
    oks = [r for r in results if r[0] in ("ok", "random")]
    if not oks:
        reasons = [r[1] for r in results if r[0] == "skip"]
        return {"cls": "skip", "reason": reasons[0] if reasons else "no samples"}
    seen = sorted(set(itertools.chain.from_iterable(r[1] for r in oks)))
    fb = [c for c in seen if c.startswith("aten::")]
    dec = {"decomposed": [c.split("::", 1)[1] for c in seen if c.startswith("decomposed::")]} \
        if any(c.startswith("decomposed::") for c in seen) else {}
    if all(r[0] == "random" for r in oks):
        return {"cls": "random", "reason": "random/uninitialised, not compared", "fallbacks": fb, **dec}
    if fb:
        return {"cls": "fallback", "fallbacks": fb, **dec}
    return {"cls": "native", **dec}


def _run_sample(op, sample, dname, grad, rnd):
    """Returns (fwd_result, bwd_result) entries as in _classify."""
    rtol, atol = tolerance(op, dname)
    # Device copies first: the CPU call may mutate the sample.
    try:
        x_in = to_device(sample.input, grad)
        x_args = tuple(_dev_fix(a, "arg") for a in to_device(tuple(sample.args), grad))
        if op.name in HOST_ARGS:
            x_args = tuple(fresh_cpu(sample.args[i], False) if i in HOST_ARGS[op.name] else a
                           for i, a in enumerate(x_args))
        x_kwargs = move_kwargs(sample.kwargs, lambda v: to_device(v, grad))
        torch_xla.sync()
    except Exception as e:
        _sync_quiet()
        return ("fail", "moving inputs to xla: " + one_line(e)), None
    c_in = fresh_cpu(sample.input, grad)
    c_args = fresh_cpu(tuple(sample.args), grad)
    c_kwargs = {k: fresh_cpu(v, grad) for k, v in sample.kwargs.items()}
    try:
        cres = op(c_in, *c_args, **c_kwargs)
    except Exception as e:
        return ("skip", "CPU raised " + one_line(e)), None
    met.clear_all()
    try:
        xres = op(x_in, *x_args, **x_kwargs)
    except Exception as e:
        _sync_quiet()
        return ("fail", one_line(e)), None
    try:
        torch_xla.sync()
    except Exception as e:
        _sync_quiet()
        return ("fail", "at sync: " + one_line(e)), None
    try:
        if rnd:
            check_meta(xres, cres)
        else:
            canon = CANONICAL_FORM.get(op.name)
            if op.name in NORM_SCALED and isinstance(cres, torch.Tensor) and cres.numel():
                # Elements much smaller than the matrix carry the rounding error of its
                # largest ones (the CPU's own error there exceeds the elementwise bound).
                atol = max(atol, rtol * float(cres.detach().abs().float().nan_to_num(0, 0, 0).max()))
            if canon is None:
                try:
                    compare(xres, cres, rtol, atol)
                except Mismatch:
                    if dname != "bfloat16" or not _closer_than_cpu(op, sample, xres, cres, rtol, atol):
                        raise
            else:
                compare(canon(xres, sample), canon(cres, sample), rtol, atol)
    except Mismatch as e:
        return ("fail", str(e)[:240]), None
    except Exception as e:
        _sync_quiet()
        return ("fail", "reading result: " + one_line(e)), None
    fwd = ("random" if rnd else "ok", _fallbacks())
    if not grad or rnd:
        return fwd, None
    return fwd, _run_backward(op, sample, cres, xres, (c_in, c_args, c_kwargs), (x_in, x_args, x_kwargs))


def _grad_outputs(sample, res):
    fn = getattr(sample, "output_process_fn_grad", None)
    if fn is not None:
        res = fn(res)
    return [t for t in tree_leaves(res) if t.requires_grad and t.is_floating_point()]


def _run_backward(op, sample, cres, xres, cins, xins):
    rtol, atol = tolerance(op, "float32", grad=True)
    cinputs = [t for t in tree_leaves(list(cins)) if t.requires_grad and t.is_floating_point()]
    xinputs = [t for t in tree_leaves(list(xins)) if t.requires_grad and t.is_floating_point()]
    if not cinputs:
        return ("skip", "no floating inputs require grad")
    try:
        couts = _grad_outputs(sample, cres)
    except Exception as e:
        return ("skip", "CPU output_process_fn_grad raised " + one_line(e))
    if not couts:
        return ("skip", "no differentiable outputs")
    g = torch.Generator().manual_seed(1234)
    cots = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in couts]
    try:
        cgrads = torch.autograd.grad(couts, cinputs, cots, allow_unused=True)
    except Exception as e:
        return ("skip", "CPU backward raised " + one_line(e))
    met.clear_all()
    try:
        xouts = _grad_outputs(sample, xres)
        if len(xouts) != len(couts):
            return ("fail", f"{len(xouts)} differentiable outputs on the device, {len(couts)} on the CPU")
        if len(xinputs) != len(cinputs):
            return ("fail", "input structure differs")
        xgrads = torch.autograd.grad(xouts, xinputs, [c.to(XLA) for c in cots], allow_unused=True)
        torch_xla.sync()
    except Exception as e:
        _sync_quiet()
        return ("fail", one_line(e))
    try:
        for i, (xg, cg) in enumerate(zip(xgrads, cgrads)):
            if cg is None or xg is None:
                if (cg is None) != (xg is None):
                    if cg is None and xg is not None and float(xg.detach().cpu().abs().max()) == 0:
                        continue
                    if xg is None and float(cg.abs().max()) == 0:
                        continue
                    raise Mismatch(f"grad[{i}]: {'None' if xg is None else 'tensor'} on the device, "
                                   f"{'None' if cg is None else 'tensor'} on the CPU")
                continue
            compare(xg, cg, rtol, atol, f"grad[{i}]")
    except Mismatch as e:
        return ("fail", str(e)[:240])
    except Exception as e:
        _sync_quiet()
        return ("fail", "reading grad: " + one_line(e))
    return ("ok", _fallbacks())


def _run_error_inputs(op, n_max):
    if getattr(op, "error_inputs_func", None) is None:
        return {"cls": "skip", "reason": "no error inputs"}
    try:
        eis = list(itertools.islice(op.error_inputs("cpu"), n_max))
    except Exception as e:
        return {"cls": "skip", "reason": "error_inputs raised " + one_line(e)}
    n = 0
    for ei in eis:
        s = ei.sample_input
        try:
            op(s.input, *s.args, **s.kwargs)
            continue  # the CPU does not raise: not applicable
        except Exception as e:
            cexc = e
        try:
            x_in = to_device(s.input, False)
            x_args = tuple(_dev_fix(a, "arg") for a in to_device(tuple(s.args), False))
            x_kwargs = move_kwargs(s.kwargs, lambda v: to_device(v, False))
            torch_xla.sync()
        except Exception:
            _sync_quiet()
            continue  # cannot build the device inputs (e.g. unsupported dtype): not applicable
        n += 1
        try:
            op(x_in, *x_args, **x_kwargs)
        except Exception as e:
            _sync_quiet()
            if not isinstance(e, type(cexc)):
                return {"cls": "fail", "reason": f"raised {type(e).__name__}, CPU raised {one_line(cexc)}"[:240]}
            continue
        try:
            torch_xla.sync()
        except Exception as e:
            _sync_quiet()
            return {"cls": "fail", "reason": f"deferred to the barrier ({one_line(e)}); CPU raised "
                                              f"{type(cexc).__name__}"[:240]}
        return {"cls": "fail", "reason": f"no raise; CPU raised {one_line(cexc)}"[:240]}
    if n == 0:
        return {"cls": "skip", "reason": "no error input raised on the CPU"}
    return {"cls": "pass", "n": n}


def run_op(op, n_samples=2, dtypes=tuple(DTYPES), backward=True, errors=True):
    """All results of one OpInfo (never raises)."""
    res = {"op": op.name, "variant": op.variant_test_name, "key": op_key(op), "fwd": {}, "bwd": None, "err": None}
    t0 = time.time()
    rnd = is_random(op)
    try:
        supported = op.supported_dtypes("cpu")
    except Exception as e:
        supported = set()
        res["note"] = "supported_dtypes raised " + one_line(e)
    for dname in dtypes:
        dtype = DTYPES[dname]
        if dtype not in supported:
            res["fwd"][dname] = {"cls": "skip", "reason": "dtype not supported by the OpInfo", "na": True}
            continue
        grad = (dname == "float32" and backward and bool(getattr(op, "supports_autograd", False)) and not rnd)
        fwd_r, bwd_r = [], []
        try:
            samples = list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=grad), n_samples))
        except Exception as e:
            res["fwd"][dname] = {"cls": "skip", "reason": "sample_inputs raised " + one_line(e)}
            continue
        for sample in samples:
            try:
                srnd = rnd or sample_is_random(op, sample)
                f, b = _run_sample(op, sample, dname, grad and not srnd, srnd)
            except Exception as e:  # harness bug or anything unexpected
                _sync_quiet()
                f, b = ("fail", "harness: " + one_line(e)), None
            fwd_r.append(f)
            if b is not None:
                bwd_r.append(b)
        res["fwd"][dname] = _classify(fwd_r)
        if dname == "float32" and backward:
            if rnd:
                res["bwd"] = {"cls": "skip", "reason": "random"}
            elif not grad:
                res["bwd"] = {"cls": "skip", "reason": "no autograd support"}
            else:
                res["bwd"] = _classify(bwd_r) if bwd_r else {"cls": "skip", "reason": "forward failed or no samples"}
    if backward and res["bwd"] is None:
        res["bwd"] = {"cls": "skip", "reason": "float32 not supported"}
    if errors:
        try:
            res["err"] = _run_error_inputs(op, n_max=max(4, 2 * n_samples) if n_samples < 10 ** 6 else 10 ** 6)
        except Exception as e:
            _sync_quiet()
            res["err"] = {"cls": "fail", "reason": "harness: " + one_line(e)}
    res["secs"] = round(time.time() - t0, 2)
    _sync_quiet()
    met.clear_all()
    return res


# ---------------------------------------------------------------------------------------
# worker subprocess and chunked runner


def worker_main(refs, n_samples, out_path, dtypes):
    with open(out_path, "a", buffering=1) as f:
        for ref in refs:
            f.write(json.dumps({"start": ref}) + "\n")
            f.flush()
            try:
                op = resolve(ref)
                r = run_op(op, n_samples, dtypes=dtypes)
            except Exception as e:
                r = {"op": str(ref), "variant": "", "key": str(ref), "fwd": {},
                     "bwd": None, "err": None, "crash": "harness: " + one_line(e)}
            r["ref"] = ref
            f.write(json.dumps({"result": r}) + "\n")
            f.flush()
            os.fsync(f.fileno())
    return 0


def _spawn(refs, n_samples, out_path, dtypes):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--refs", ",".join(str(r) for r in refs),
           "--samples", str(n_samples), "--worker-out", out_path, "--dtypes", ",".join(dtypes)]
    env = dict(os.environ)
    env.setdefault("PJRT_DEVICE", "CPU")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)


def _read_progress(path):
    started, done = [], {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                if "start" in d:
                    started.append(d["start"])
                elif "result" in d:
                    done[d["result"]["ref"]] = d["result"]
    except FileNotFoundError:
        pass
    return started, done


def _kill(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(10)
    except Exception:
        pass


def _run_once(refs, n_samples, dtypes, op_timeout, startup_timeout=300):
    """Runs refs in one worker. Returns (results dict, culprit ref or None, failure str or None)."""
    fd, path = tempfile.mkstemp(prefix="opcov_", suffix=".jsonl")
    os.close(fd)
    p = _spawn(refs, n_samples, path, dtypes)
    stderr_chunks = []
    t_err = threading.Thread(target=lambda: stderr_chunks.append(p.stderr.read()), daemon=True)
    t_err.start()
    last_change, last_n = time.time(), -1
    failure = None
    try:
        while True:
            rc = p.poll()
            started, done = _read_progress(path)
            n = len(started) + len(done)
            if n != last_n:
                last_n, last_change = n, time.time()
            if rc is not None:
                if rc != 0 or len(done) < len(refs):
                    failure = f"crashed (signal {-rc})" if rc < 0 else f"crashed (exit code {rc})"
                break
            limit = op_timeout if started else startup_timeout + op_timeout
            if time.time() - last_change > limit:
                _kill(p)
                failure = "timeout"
                break
            time.sleep(0.5)
    finally:
        if p.poll() is None:
            _kill(p)
        t_err.join(5)
    started, done = _read_progress(path)
    os.unlink(path)
    culprit = None
    if failure:
        pending = [r for r in started if r not in done]
        culprit = pending[0] if pending else None
        if culprit is None and not started:
            err = (stderr_chunks[0] if stderr_chunks else b"").decode(errors="replace").strip().splitlines()
            failure += " before the first op" + (": " + err[-1][:200] if err else "")
    return done, culprit, failure


def _failed_result(ref, failure):
    try:
        op = resolve(ref)
        name, variant = op.name, op.variant_test_name
    except Exception:
        name, variant = str(ref), ""
    key = name + ("." + variant if variant else "")
    return {"op": name, "variant": variant, "key": key, "ref": ref, "crash": failure,
            "fwd": {}, "bwd": None, "err": None}


def run_chunk(refs, n_samples, dtypes, op_timeout, log=None):
    """Runs a chunk of ops in worker subprocesses, isolating crashing / hanging ops."""
    results = {}
    todo = list(refs)
    while todo:
        done, culprit, failure = _run_once(todo, n_samples, dtypes, op_timeout)
        results.update(done)
        if failure is None:
            break
        if culprit is None:
            for r in todo:
                if r not in results:
                    results[r] = _failed_result(r, failure)
            break
        if log:
            log(f"  worker {failure} in {culprit}; re-running it alone")
        if len(todo) > 1 and failure != "timeout":
            d2, c2, f2 = _run_once([culprit], n_samples, dtypes, op_timeout)
            if f2 is None and culprit in d2:
                r = d2[culprit]
                r["note"] = f"crashed the worker when run after other ops ({failure}); passes alone"
                results[culprit] = r
            else:
                results[culprit] = _failed_result(culprit, f2 or failure)
        else:
            results[culprit] = _failed_result(culprit, failure)
        todo = [r for r in todo if r not in results]
    return [results[r] for r in refs if r in results]


def run_sweep(refs, n_samples, dtypes, jobs=1, chunk=40, op_timeout=240, log=print):
    chunks = [refs[i:i + chunk] for i in range(0, len(refs), chunk)]
    out = []
    lock = threading.Lock()
    t0 = time.time()

    def one(ci):
        r = run_chunk(chunks[ci], n_samples, dtypes, op_timeout, log=log)
        with lock:
            out.extend(r)
            log(f"chunk {ci + 1}/{len(chunks)} done ({len(out)}/{len(refs)} ops, {time.time() - t0:.0f}s)")
        return r

    if jobs <= 1:
        for ci in range(len(chunks)):
            one(ci)
    else:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(jobs) as ex:
            list(ex.map(one, range(len(chunks))))
    order = {r: i for i, r in enumerate(refs)}
    out.sort(key=lambda r: order.get(r.get("ref"), 0))
    return out


# ---------------------------------------------------------------------------------------
# report


def entry(r, kind):
    """The class dict of r for kind in float32|bfloat16|int64|bool|bwd|err."""
    if r.get("crash"):
        return {"cls": "fail", "reason": r["crash"]}
    if kind == "bwd":
        return r.get("bwd") or {"cls": "skip", "reason": "not run"}
    if kind == "err":
        return r.get("err") or {"cls": "skip", "reason": "not run"}
    return r["fwd"].get(kind) or {"cls": "skip", "reason": "not run", "na": True}


def totals(results):
    t = {}
    for kind in ("float32", "bwd", "bfloat16", "int64", "bool", "err"):
        c = collections.Counter(entry(r, kind)["cls"] for r in results)
        t[kind] = dict(c)
    return t


def _pct(a, b):
    return f"{100.0 * a / b:.1f}%" if b else "n/a"


def totals_text(results):
    t = totals(results)
    lines = []

    def line(label, c, good):
        app = sum(v for k, v in c.items() if k in ("native", "fallback", "fail", "pass"))
        g = sum(c.get(k, 0) for k in good)
        parts = ", ".join(f"{k} {c.get(k, 0)}" for k in ("native", "fallback", "pass", "fail", "random", "skip")
                          if c.get(k, 0) or k in ("fail", "skip"))
        return f"{label:<22} {parts}; {'/'.join(good)} {g}/{app} = {_pct(g, app)} of applicable"

    lines.append(f"ops (OpInfo entries): {len(results)}")
    f = t["float32"]
    app = f.get("native", 0) + f.get("fallback", 0) + f.get("fail", 0)
    lines.append(line("forward float32:", f, ("native", "fallback")))
    lines.append(f"{'':<22} native {f.get('native', 0)}/{app} = {_pct(f.get('native', 0), app)} of applicable")
    lines.append(line("backward float32:", t["bwd"], ("native", "fallback")))
    lines.append(line("forward bfloat16:", t["bfloat16"], ("native", "fallback")))
    lines.append(line("forward int64:", t["int64"], ("native", "fallback")))
    lines.append(line("forward bool:", t["bool"], ("native", "fallback")))
    lines.append(line("error inputs:", t["err"], ("pass",)))
    return "\n".join(lines)


def _cell(e):
    c = e["cls"]
    if c == "skip" and e.get("na"):
        return "—"
    if c in ("fallback", "random") and e.get("fallbacks"):
        return c + " (" + ", ".join(x.replace("aten::", "") for x in e["fallbacks"]) + ")"
    if c == "native" and e.get("decomposed"):
        return "native (decomposed: " + ", ".join(e["decomposed"]) + ")"
    return c


def _esc(s):
    return str(s).replace("|", "\\|").replace("\n", " ").replace("`", "'")


def failure_reasons(results):
    """(kind, op key, reason) for every failing entry."""
    out = []
    for r in results:
        for kind in ("float32", "bwd", "bfloat16", "int64", "bool", "err"):
            e = entry(r, kind)
            if e["cls"] == "fail":
                out.append((kind, r["key"], e.get("reason", "")))
    return out


def normalize_reason(s):
    """Groups similar reasons: drops numbers, shapes and quoted names."""
    import re
    s = re.sub(r"\[\d+\]", "[i]", s)
    s = re.sub(r"\(\d+/\d+ elements[^)]*\)", "", s)
    s = re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", s)
    s = re.sub(r"'[^']*'", "'…'", s)
    return s.strip()[:160]


def render_md(results, command, totals_str, seconds):
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    L = []
    L.append("# Op coverage: PyTorch OpInfo conformance on the xla device\n")
    L.append(f"Generated by `{command}` on {now} (torch {torch.__version__}, {seconds / 60:.0f} min). "
             "Do not edit by hand.\n")
    L.append("Every OpInfo of `torch.testing._internal.common_methods_invocations.op_db` is run on the CPU "
             "and on xla:0 with the same sample inputs (the first N of `op.sample_inputs('cpu', dtype)`), "
             "for float32, bfloat16, int64 and bool where the OpInfo supports the dtype on the CPU, and "
             "the results are compared with `torch.testing.assert_close`. Float32 samples of "
             "differentiable ops also compare `torch.autograd.grad` (outputs times a fixed random "
             "cotangent) with respect to every floating input. Error inputs check that the device raises "
             "the same exception type as the CPU, inside the op call (an error deferred to the barrier "
             "counts as a failure).\n")
    L.append("Classes: **native** equal to the CPU and no CPU fallback (the by-design fallbacks "
             "`aten::_local_scalar_dense` and `aten::nonzero` are allowed); **native (decomposed: op)** "
             "native, with `op` served on the device by its `torch._decomp` decomposition "
             "(torch_xla/_engine/decompositions.py); **fallback** equal to the "
             "CPU but some `aten::` fallback counter was incremented (listed); **fail** mismatch or "
             "exception; **skip** not applicable (the CPU raised on every sample, no grad, ...); "
             "**random** random or uninitialised results (`empty*`, `rand*`, `normal`, `bernoulli`, "
             "dropouts, `multinomial`, ...): only shape/dtype/device are checked, values are not "
             "compared; **—** the OpInfo does not support the dtype on the CPU.\n")
    L.append("Tolerances: float32 rtol 1.3e-6 / atol 1e-5 (the `torch.testing` defaults), relaxed to "
             "1e-4 / 1e-4 for ops that accumulate or use transcendental approximations (reductions, "
             "matmul/conv, norms, softmax, losses, scans, linalg, fft, pooling, interpolation, exp/log/"
             "trig...) and for all gradients; bfloat16 rtol 1.6e-2 / atol 1e-2; int64 and bool exact (the tolerance follows the result "
             "dtype: a floating result of integer/bool inputs, e.g. `cos` of int64, gets the relaxed "
             "float32 one, and a bfloat16 result at least the bfloat16 one). "
             "Where the OpInfo has a `toleranceOverride` / `precisionOverride` for the dtype in a "
             "`DecorateInfo` active on the CPU, the larger of it and the above is used.\n")
    L.append("Results that are not unique are compared in a canonical form: eigenvectors up to sign "
             "(`linalg.eigh`); the indices of `sort` / `argsort` without `stable=True` with each run of "
             "equal values in index order (PyTorch leaves their order unspecified and the CPU's large-input "
             "sort is not stable); the indices of `topk` / `kthvalue` as the input elements they point to "
             "(any of equal elements is right). `matrix_exp` is compared to within rtol of its largest "
             "element (its rounding error is relative to the matrix norm, on the CPU as here). A bfloat16 "
             "result that differs from the CPU's passes when no element is further from the op's float64 "
             "result than the CPU's own bfloat16 element or the bfloat16 tolerance (CPU kernels that "
             "accumulate in bfloat16: grid sampling, transposed convolutions, adaptive pooling, "
             "`matrix_exp`'s NaNs). Arguments PyTorch requires on the CPU (`tensor_split`'s tensor of "
             "indices) stay there.\n")
    L.append("## Totals\n")
    L.append("```\n" + totals_str + "\n```\n")
    reasons = failure_reasons(results)
    if reasons:
        L.append("## Most common failure reasons\n")
        grp = collections.defaultdict(list)
        for kind, key, reason in reasons:
            grp[normalize_reason(reason)].append(f"{key}" + ("" if kind == "float32" else f" ({kind})"))
        L.append("| count | reason (normalised) | examples |")
        L.append("|---:|---|---|")
        for reason, keys in sorted(grp.items(), key=lambda kv: -len(kv[1]))[:30]:
            ex = ", ".join(keys[:6]) + (", ..." if len(keys) > 6 else "")
            L.append(f"| {len(keys)} | {_esc(reason)} | {_esc(ex)} |")
        L.append("")
    L.append("## Per op\n")
    L.append("| op | variant | f32 fwd | f32 bwd | bf16 | int64 | bool | error inputs | failure reasons |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        cells = [_cell(entry(r, k)) for k in ("float32", "bwd", "bfloat16", "int64", "bool", "err")]
        why = []
        for k, lab in (("float32", "f32"), ("bwd", "bwd"), ("bfloat16", "bf16"), ("int64", "i64"),
                       ("bool", "bool"), ("err", "err")):
            e = entry(r, k)
            if e["cls"] == "fail":
                why.append(f"{lab}: {e.get('reason', '')[:150]}")
        if r.get("note"):
            why.append(r["note"])
        L.append("| " + " | ".join(_esc(x) for x in [r["op"], r["variant"] or ""] + cells + ["; ".join(why)]) + " |")
    L.append("")
    return "\n".join(L)


# ---------------------------------------------------------------------------------------
# CLI


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2, help="samples per (op, dtype) (default 2)")
    ap.add_argument("--full", action="store_true", help="all samples")
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="parallel worker subprocesses (default 1)")
    ap.add_argument("--chunk", type=int, default=40, help="ops per worker subprocess")
    ap.add_argument("--op-timeout", type=float, default=240, help="seconds without progress before a worker is killed")
    ap.add_argument("--out", default=None, help="markdown report (default docs/op_coverage.md for a full-db run)")
    ap.add_argument("--json", default=os.path.join(ROOT, "build", "op_coverage.json"), help="JSON of all results")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--in-process", action="store_true", help="no subprocesses (debugging)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--refs", default="", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    n = 10 ** 9 if a.full else a.samples
    dtypes = tuple(d for d in a.dtypes.split(",") if d)
    if a.worker:
        refs = [r if r.startswith("fake:") else int(r) for r in a.refs.split(",") if r]
        return worker_main(refs, n, a.worker_out, dtypes)

    t0 = time.time()
    refs = select_ops(a.ops)
    command = "python tools/op_coverage.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{len(refs)} OpInfos, {'all' if a.full else n} samples, dtypes {','.join(dtypes)}", flush=True)
    if a.in_process:
        results = []
        for i, ref in enumerate(refs):
            r = run_op(op_db()[ref], n, dtypes=dtypes)
            r["ref"] = ref
            results.append(r)
            print(f"[{i + 1}/{len(refs)}] {r['key']}: {_cell(entry(r, 'float32'))} ({r['secs']}s)", flush=True)
    else:
        results = run_sweep(refs, n, dtypes, jobs=a.jobs, chunk=a.chunk, op_timeout=a.op_timeout,
                            log=lambda s: print(s, flush=True))
    secs = time.time() - t0
    text = totals_text(results)
    print(text, flush=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "torch": torch.__version__, "seconds": secs, "totals": totals(results),
                       "results": results}, f, indent=1)
        print(f"wrote {a.json}")
    out = a.out
    if out is None and not a.ops:
        out = os.path.join(ROOT, "docs", "op_coverage.md")
    if out:
        with open(out, "w") as f:
            f.write(render_md(results, command, text, secs))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
