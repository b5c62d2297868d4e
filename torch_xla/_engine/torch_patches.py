"""The places where PyTorch's own Python needs help with xla tensors.

- `Module._apply` gives each module its own new Parameter when the old one cannot
  take the new data in place, which is the case from CPU to xla (different tensor
  types). Two modules that shared one Parameter (an embedding tied to an LM head)
  would then train two copies: the wrapper restores the sharing afterwards.
- `cpu_tensor.copy_(xla_tensor)` (what `cpu_model.load_state_dict(xla_state_dict)`
  does) reaches functionalization with a plain destination and a functional source,
  which it refuses: the source is read to the CPU first.
- Shape inference runs PyTorch's Python meta kernels, which import `torch._dynamo` on
  their first call (1-2 s) only to mark themselves as not traceable by it
  (`lazy_dynamo_disable`). In-place elementwise ops get lean meta checks
  (`install_inplace_meta`).
"""
from __future__ import annotations

import sys
import threading
import types

import torch

_orig_apply = torch.nn.Module._apply
_tls = threading.local()


def _apply(self, fn, recurse=True):
    if getattr(_tls, "active", False) or not recurse:
        return _orig_apply(self, fn, recurse)
    holders = {}
    for mod in self.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((mod, name))
    _tls.active = True
    try:
        out = _orig_apply(self, fn, recurse)
    finally:
        _tls.active = False
    for refs in holders.values():
        if len(refs) < 2:
            continue
        mod0, name0 = refs[0]
        first = mod0._parameters[name0]
        if first is None or first.device.type != "xla":
            continue
        for mod, name in refs[1:]:
            if mod._parameters[name] is not first:
                mod._parameters[name] = first
    return out


_orig_copy_ = torch.Tensor.copy_


def _copy_(self, src, non_blocking=False):
    if (isinstance(src, torch.Tensor) and src.device.type == "xla" and self.device.type != "xla"
            and not torch._is_functional_tensor(self)):
        src = src.to(self.device)
    return _orig_copy_(self, src, non_blocking)


_copy_.__doc__ = _orig_copy_.__doc__


def install() -> None:
    if torch.nn.Module._apply is not _apply:
        torch.nn.Module._apply = _apply
    if torch.Tensor.copy_ is not _copy_:
        torch.Tensor.copy_ = _copy_
    install_inplace_meta()


# ---- lean shape checks for in-place elementwise ops ---------------------------------------
# Functionalization checks an in-place op by running it on meta tensors before turning it
# into its functional form. For many elementwise ops PyTorch's meta kernel is Python code
# that costs tens of microseconds per call, more than tracing the op. These kernels run the
# full check once per (op, shapes, dtypes, scalar types) and remember that it passed.

_INPLACE_ELEMENTWISE = (
    "add_.Tensor", "add_.Scalar", "sub_.Tensor", "sub_.Scalar", "mul_.Tensor", "mul_.Scalar",
    "div_.Tensor", "div_.Scalar", "div_.Tensor_mode", "div_.Scalar_mode", "addcmul_", "addcdiv_",
    "lerp_.Scalar", "lerp_.Tensor", "clamp_", "clamp_.Tensor", "clamp_min_", "clamp_max_",
    "sqrt_", "rsqrt_", "exp_", "log_", "neg_", "abs_", "sigmoid_", "tanh_", "relu_",
    "pow_.Scalar", "pow_.Tensor", "reciprocal_", "sign_", "floor_", "ceil_", "round_", "trunc_",
    "masked_fill_.Scalar", "masked_fill_.Tensor", "maximum_", "minimum_",
)
_meta_ok = set()
_meta_lib = None


def _meta_key(name, args, kwargs):
    key = [name]
    for a in args:
        key.append((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a))
    for k, v in kwargs.items():
        key.append((k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v)))
    return tuple(key)


def _make_inplace_meta(name, functional):
    def meta(self, *args, **kwargs):
        key = _meta_key(name, (self,) + args, kwargs)
        if key in _meta_ok:
            return self
        out = functional(self, *args, **kwargs)
        if tuple(out.shape) != tuple(self.shape):
            raise RuntimeError(f"output with shape {list(self.shape)} doesn't match the broadcast "
                               f"shape {list(out.shape)}")
        if not torch.can_cast(out.dtype, self.dtype):
            raise RuntimeError(f"result type {_dtype_name(out.dtype)} can't be cast to the desired "
                               f"output type {_dtype_name(self.dtype)}")
        _meta_ok.add(key)
        return self
    return meta


def _dtype_name(d):
    return {torch.float32: "Float", torch.float64: "Double", torch.int64: "Long", torch.int32: "Int",
            torch.bool: "Bool", torch.bfloat16: "BFloat16", torch.float16: "Half",
            torch.complex64: "ComplexFloat"}.get(d, str(d))


def install_inplace_meta() -> None:
    global _meta_lib
    if _meta_lib is not None:
        return
    _meta_lib = torch.library.Library("aten", "IMPL")
    for name in _INPLACE_ELEMENTWISE:
        packet, _, ov = name.partition(".")
        ip = getattr(torch.ops.aten, packet, None)
        fpk = getattr(torch.ops.aten, packet[:-1], None)
        if ip is None or fpk is None:
            continue
        ov = ov or "default"
        if not hasattr(ip, ov) or not hasattr(fpk, ov):
            continue
        functional = getattr(fpk, ov)
        # Only where the functional overload takes exactly the in-place one's arguments.
        if ([str(a.type) for a in getattr(ip, ov)._schema.arguments]
                != [str(a.type) for a in functional._schema.arguments]):
            continue
        _meta_lib.impl(name, _make_inplace_meta(name, functional), "Meta")


# ---- meta kernels without importing torch._dynamo -------------------------------------------
# Many of PyTorch's meta kernels are Python references wrapped by `torch._disable_dynamo`,
# whose wrapper imports torch._dynamo on the first call (1-2 s here) to build a
# "don't trace this" version of the function, cached as `fn.__dynamo_disable`. While
# torch._dynamo is not imported nothing can be tracing, so calling `fn` directly is the
# same. Each wrapped function gets a stand-in that does that, and hands over to the real
# wrapper once torch._dynamo has been imported (by the user, torch.compile or torch.optim).

class _UntilDynamo:
    __slots__ = ("fn", "recursive")

    def __init__(self, fn, recursive):
        self.fn, self.recursive = fn, recursive

    def __call__(self, *args, **kwargs):
        dyn = sys.modules.get("torch._dynamo")
        if dyn is None or not hasattr(dyn, "disable"):
            return self.fn(*args, **kwargs)
        real = dyn.disable(self.fn, self.recursive, wrapping=False)
        setattr(self.fn, "__dynamo_disable", real)  # (a plain assignment here would be name-mangled)
        return real(*args, **kwargs)


_dynamo_patched = [False]


def lazy_dynamo_disable() -> None:
    """Gives every `torch._disable_dynamo` wrapper the stand-in above (once; nothing to do
    when torch._dynamo is already imported). It finds them among the collector's objects:
    the runtime calls it before `gc.freeze()`, which would hide them (~70 ms)."""
    if _dynamo_patched[0]:
        return
    _dynamo_patched[0] = True
    if "torch._dynamo" in sys.modules:
        return
    try:
        code = torch._compile._disable_dynamo(lambda: None).__code__
        i_fn, i_rec = code.co_freevars.index("fn"), code.co_freevars.index("recursive")
    except (AttributeError, ValueError):  # another torch: leave it alone
        return
    import gc
    for f in gc.get_objects():
        if type(f) is types.FunctionType and f.__code__ is code:
            fn = f.__closure__[i_fn].cell_contents
            if getattr(fn, "__dynamo_disable", None) is None:
                try:
                    fn.__dynamo_disable = _UntilDynamo(fn, f.__closure__[i_rec].cell_contents)
                except (AttributeError, TypeError):
                    pass
