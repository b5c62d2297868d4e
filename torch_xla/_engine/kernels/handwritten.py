"""Hand-written kernels: factories, transfers, copies, host reads, and the few ops whose
semantics a pure lowering cannot express (batch norm's in-place statistics, Scalar[]
foreach overloads, the derivative of `_fft_r2c`, transpositions that report eager's
strides, `as_strided` reading a transposition in its storage order)."""
from __future__ import annotations

import torch

from .. import telemetry, pjrt
from ..tensor import XlaState, is_functional, make_tensor, point_at, replace_state, state_of, unwrap, with_strides, wrap_user
from .fallback import check_devices
from .op_kernel import KERNELS, copy, to_copy
from .specialise import fast_kernel
from .values import check_device, const_tensor, from_cpu, to_cpu


def _check_dtype(dtype):
    if not pjrt.is_supported_dtype(dtype):
        raise TypeError(f"dtype {dtype} is not supported on the xla device")


def k_empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    check_device(device)
    dtype = dtype or torch.get_default_dtype()
    _check_dtype(dtype)
    return wrap_user(const_tensor(size, dtype, 0))


def k_zeros_like(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """`zeros_like` reads only `x`'s metadata: a tensor of the xla device that holds no
    data (a Dynamo fake tensor made real by its fallback for ops without a meta kernel)
    gets zeros too."""
    if getattr(x, "_xla", None) is None and not is_functional(x) and x.device.type == "xla":
        check_device(device)
        dtype = dtype or x.dtype
        _check_dtype(dtype)
        return const_tensor(x.shape, dtype, 0)
    return KERNELS["zeros_like.default"](x, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory,
                                       memory_format=memory_format)


def k_ones_like(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """`ones_like` is a constant of `x`'s shape, not an op on `x`: the seed of a backward
    (`ones_like(loss)`) then needs no program of its own before a compiled backward graph
    reads it (capture.py fills small constants from a cache)."""
    if x.device.type != "xla" or (device is not None and torch.device(device).type != "xla"):
        return KERNELS["ones_like.default"](x, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory,
                                           memory_format=memory_format)
    check_device(device)
    dtype = dtype or x.dtype
    _check_dtype(dtype)
    return const_tensor(x.shape, dtype, 1)


def k_empty_quantized(size, qtensor, dtype=None, layout=None, device=None, pin_memory=None,
                      memory_format=None):
    raise TypeError(f"dtype {qtensor.dtype} is not supported on the xla device")


def k_empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    check_device(device)
    return k_empty(size, dtype)


def k_to_copy(x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    check_device(device, unindexed_as_0=True)
    src_xla = x.device.type == "xla"
    dst_xla = (device.type == "xla") if device is not None else src_xla
    if not src_xla and dst_xla:
        return wrap_user(from_cpu(x, dtype))
    if src_xla and not dst_xla:
        c = to_cpu(x)
        return c.to(device=device, dtype=dtype or c.dtype)
    # xla -> xla: a (possibly converting) lazy copy; same dtype shares the value.
    inner = unwrap(x) if is_functional(x) else x
    if dtype is None or dtype == inner.dtype:
        s = state_of(inner)
        return wrap_user(make_tensor(s.node, s.idx, s.shape, s.dtype))
    return wrap_user(to_copy(inner, dtype))


def k_copy_from(src, dst, non_blocking=False):
    """`dst.copy_(src)` across devices."""
    if src.device.type == "xla" and dst.device.type != "xla":
        dst.copy_(to_cpu(src))
        return dst
    if src.device.type != "xla" and dst.device.type == "xla":
        replace_state(dst, from_cpu(src.to(dst.dtype).expand(dst.shape).contiguous())._xla)
        return dst
    raise RuntimeError("_copy_from: unsupported device pair")


def k_copy_(dst, src, non_blocking=False):
    """In-place copy on a non-functional inner tensor."""
    if src.device.type != "xla":
        return k_copy_from(src, dst, non_blocking)
    replace_state(dst, copy(dst, src)._xla)
    return dst


def k_copy(self, src, non_blocking=False):
    if src.device.type != "xla":
        return from_cpu(src.to(self.dtype).expand(self.shape).contiguous())
    return copy(self, src)


def _permutation(op: str, args: tuple, ndim: int):
    """The dims permutation of a transposition (`op` with its arguments after the input),
    or None for another op."""
    if op == "aten::t_copy":
        return (1, 0) if ndim == 2 else tuple(range(ndim))
    if op == "aten::transpose_copy.int":
        p = list(range(ndim))
        if ndim:
            d0, d1 = args[0] % ndim, args[1] % ndim
            p[d0], p[d1] = p[d1], p[d0]
        return tuple(p)
    if op == "aten::permute_copy":
        return tuple(d % ndim for d in args[0]) if ndim else ()
    return None


def transposition(name: str):
    """The kernel of a transposition: the generic one (errors, node), with the strides
    eager PyTorch reports for the view (`tensor.with_strides`); one undoing the
    transposition that made its input holds that transposition's input (x.t().t() is x:
    the graph computes one value, not both)."""
    op = "aten::" + name.removesuffix(".default")
    base = []   # the op's own kernel (specialised: its common case is the traced path), at first use

    def kernel(x, *args):
        if not base:
            base.append(fast_kernel(KERNELS[name]))
        out = base[0](x, *args)
        ndim = x.dim()
        perm = _permutation(op, args, ndim)
        s = state_of(x)
        node = s.node
        if node.operands:
            first = _permutation(node.op, node.args[1:], ndim)
            if first is not None and all(first[perm[i]] == i for i in range(ndim)):
                inner = node.operands[0][0]
                point_at(out._xla, XlaState(inner, node.operands[0][1], s.shape, s.dtype))
        stride = x.stride()
        return with_strides(out, tuple(stride[p] for p in perm))
    return kernel


def _storage_order(x):
    """The dims permutation that puts `x`'s value in its storage order, when `x` reports the
    strides of a transposition of a contiguous tensor (None when its strides are contiguous)."""
    stride, shape = x.stride(), x.shape
    if x.is_contiguous():
        return None
    perm = sorted(range(x.dim()), key=lambda d: (-stride[d], d))
    expect = 1
    for d in reversed(perm):
        if shape[d] != 1 and stride[d] != expect:
            return None
        expect *= shape[d]
    return tuple(perm)


def k_as_strided_copy(x, size, stride, storage_offset=None):
    """`as_strided` reads `x`'s storage: a transposition's value is put in its storage order first."""
    perm = _storage_order(x)
    if perm is not None:
        x = KERNELS["permute_copy.default"](x, perm)
    return KERNELS["as_strided_copy.default"](x, size, stride, storage_offset)


def k_as_strided_scatter(x, src, size, stride, storage_offset=None):
    """`as_strided_scatter` writes `x`'s storage (see `k_as_strided_copy`)."""
    perm = _storage_order(x)
    if perm is None:
        return KERNELS["as_strided_scatter.default"](x, src, size, stride, storage_offset)
    flat = KERNELS["as_strided_scatter.default"](KERNELS["permute_copy.default"](x, perm), src, size, stride,
                                                 storage_offset)
    back = [0] * len(perm)
    for i, d in enumerate(perm):
        back[d] = i
    return with_strides(KERNELS["permute_copy.default"](flat, tuple(back)), x.stride())


def k_local_scalar_dense(x):
    telemetry.inc("aten::_local_scalar_dense")
    return to_cpu(x).item()


def k_equal(self, other):
    """`torch.equal`: a Python bool, so the comparison is read from the device once."""
    check_devices("equal", (self, other), {})
    if tuple(self.shape) != tuple(other.shape):
        return False
    return bool(torch.ops.aten.all.default(torch.ops.aten.eq.Tensor(self, other)).item())


def _host_lengths(t):
    return [int(v) for v in to_cpu(t).tolist()] if isinstance(t, torch.Tensor) else list(t)


def k_ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """CTC with lengths given as tensors: the lengths decide the output's shape, so they are
    read to the host (once) and the list overload runs on the device."""
    return torch.ops.aten._ctc_loss.default(log_probs, targets, _host_lengths(input_lengths),
                                            _host_lengths(target_lengths), blank, zero_infinity)


def k_ctc_loss_backward_tensor(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha,
                               blank, zero_infinity=False):
    return torch.ops.aten._ctc_loss_backward.default(grad, log_probs, targets, _host_lengths(input_lengths),
                                                     _host_lengths(target_lengths), nll, log_alpha, blank,
                                                     zero_infinity)


def k_is_pinned(x, device=None):
    return False


def k_set_source(self, source):
    s = self._xla if hasattr(self, "_xla") else state_of(self)
    src = state_of(source)
    s.shape, s.dtype = src.shape, src.dtype
    point_at(s, src)
    return self


# ---- batch norm ------------------------------------------------------------

# `native_batch_norm` updates running_mean/running_var in place although its schema does
# not say so, so functionalization hands it to the backend as is and a pure lowering would
# lose the update. Its kernel is therefore a Python one: it runs the functional variant
# (which returns the new statistics) and writes them into the (inner) stats tensors, the
# way `copy_` does. It is registered with the other hand-written kernels, and counts as
# `xla::native_batch_norm` (the op the user's batch norm reaches, whichever entry).
_BN_COUNT = telemetry.cell("xla::native_batch_norm")


def k_native_batch_norm(x, w, b, rm, rv, training, momentum, eps):
    _BN_COUNT[0] += 1
    aten = torch.ops.aten
    # The saved statistics have the running statistics' dtype (the input's without them)
    # and are empty in evaluation mode, as on the CPU.
    stat_dtype = rm.dtype if rm is not None else x.dtype
    if not training:
        y = aten._native_batch_norm_legit_no_training.default(x, w, b, rm, rv, momentum, eps)[0]
        empty = torch.empty((0,), dtype=stat_dtype, device=x.device)
        return y, empty, empty.clone()
    if rm is not None or rv is not None:
        if rm is None or rv is None:
            raise RuntimeError("native_batch_norm: running_mean and running_var must be both given or both None")
        # The overload itself, not the packet: the packet resolves its overload per call.
        y, mean, invstd, nrm, nrv = aten._native_batch_norm_legit_functional.default(
            x, w, b, rm, rv, True, momentum, eps)
        k_copy_(rm, nrm)
        k_copy_(rv, nrv)
    else:
        y, mean, invstd = aten._native_batch_norm_legit.no_stats(x, w, b, True, momentum, eps)
    if mean.dtype != stat_dtype:
        mean, invstd = mean.to(stat_dtype), invstd.to(stat_dtype)
    return y, mean, invstd


def k_native_batch_norm_legit(x, w, b, rm, rv, training, momentum, eps):
    """`_native_batch_norm_legit` (declared mutating; reaches the backend only outside
    functionalization, which otherwise turns it into the _functional variant)."""
    return k_native_batch_norm(x, w, b, rm, rv, training, momentum, eps)


# ---- Scalar[] overloads (workaround, see the module docstring) -----------------------------

def _cpu_scalars(scalars, xs=()):
    """0-d CPU tensors (graph parameters). Floats are f64 when every tensor is floating
    (a 0-d tensor does not change their result dtype and keeps the double value, which the
    lowering rounds to the compute dtype as CPU opmath does); with integer tensors they
    take the default dtype, as a Python float would."""
    fdt = torch.float64 if all(t.is_floating_point() for t in xs) else torch.get_default_dtype()
    out = []
    for s in scalars:
        if isinstance(s, torch.Tensor):
            s = s.item()
        if isinstance(s, bool):
            out.append(torch.tensor(s))
        elif isinstance(s, int):
            out.append(torch.tensor(s, dtype=torch.int64))
        elif isinstance(s, complex):
            out.append(torch.tensor(s, dtype=torch.complex128))
        else:
            out.append(torch.tensor(float(s), dtype=fdt))
    return out


def _device_vector(scalars):
    """The scalars as one 1-d f64 tensor on the device (new data each call, same graph)."""
    vals = [s.item() if isinstance(s, torch.Tensor) else s for s in scalars]
    return from_cpu(torch.tensor(vals, dtype=torch.float64))


def foreach_scalarlist_kernels() -> dict:
    """Kernels of the `_foreach_*.ScalarList` overloads: their Scalar[] argument reaches the
    device as 0-d tensors (graph parameters) through the `.List` / `.Tensor` overloads."""
    aten = torch.ops.aten
    out = {}

    def binary(list_op):
        def k(xs, scalars):
            return list_op(xs, _cpu_scalars(scalars, xs))
        return k

    for n in ("add", "sub", "mul", "div", "maximum", "minimum", "clamp_min", "clamp_max", "pow"):
        lst = getattr(aten, f"_foreach_{n}").List
        out[f"_foreach_{n}.ScalarList"] = binary(lst)

    def ternary(tensor_op):
        def k(xs, t1, t2, scalars):
            return tensor_op(xs, t1, t2, _device_vector(scalars))
        return k

    out["_foreach_addcmul.ScalarList"] = ternary(aten._foreach_addcmul.Tensor)
    out["_foreach_addcdiv.ScalarList"] = ternary(aten._foreach_addcdiv.Tensor)

    def lerp(xs, ends, weights):
        return aten._foreach_lerp.List(xs, ends, _cpu_scalars(weights, xs))

    out["_foreach_lerp.ScalarList"] = lerp

    return out


# ---- the derivative of _fft_r2c on the device ----------------------------------------------
# PyTorch's `fft_r2c_backward` keeps `grad.sym_sizes()` (a non-owning reference) across
# `grad.new_zeros(...)`. Under functionalization the wrapper's sizes are those of its inner
# tensor, and new_zeros syncs `grad`: when grad is a view of a tensor with a pending write
# (irfft's backward doubles half of its result in place, so `irfft(rfft(x).mT.mT)` and
# istft(stft(x)) do this), the sync replaces the inner tensor and frees the sizes that
# reference points to. The slice that follows then reads garbage. This kernel, at the
# device's autograd key, computes the same derivative from sizes copied up front.

def _r2c_below_autograd(x, dim, normalization, onesided):
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.aten._fft_r2c.default(x, dim, normalization, onesided)


def _make_r2c_function():

    class FftR2C(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, normalization, onesided):
            ctx.args = (list(dim), normalization, onesided, int(x.shape[dim[-1]]))
            return _r2c_below_autograd(x, dim, normalization, onesided)

        @staticmethod
        def backward(ctx, grad):
            dim, normalization, onesided, n_last = ctx.args
            if onesided and grad.shape[dim[-1]] < n_last:
                # the discarded half of the spectrum had zero gradient
                pad = list(grad.shape)
                pad[dim[-1]] = n_last - grad.shape[dim[-1]]
                grad = torch.cat([grad, grad.new_zeros(pad)], dim[-1])
            return torch.real(torch.ops.aten._fft_c2c(grad, dim, normalization, False)), None, None, None

        @staticmethod
        def jvp(ctx, t, *_):
            dim, normalization, onesided, _n = ctx.args
            return _r2c_below_autograd(t, dim, normalization, onesided)

    return FftR2C


_R2C_FN = None


def k_fft_r2c_autograd(x, dim, normalization, onesided):
    global _R2C_FN
    if _R2C_FN is None:
        _R2C_FN = _make_r2c_function()
    return _R2C_FN.apply(x, dim, normalization, onesided)
