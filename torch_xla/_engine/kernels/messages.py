"""The precise wording of argument and shape errors, as PyTorch/XLA words them.

A meta kernel's exception (`shapes.infer`) keeps PyTorch's exception type and the op's
line; for the checks below its message becomes PyTorch/XLA's, which names the shapes in
XLA's notation (`f32[2,2]`), every offending dimension and what would be accepted.
PyTorch's own message stays on the exception as a note, shown in the traceback. Each
rewording recomputes its condition from the arguments, so an error it does not describe
keeps PyTorch's message.
"""
from __future__ import annotations

import traceback
from collections import Counter
from typing import Callable, Dict, List, Optional

import torch

from .. import env_vars
from ..executor.dumps import dtype_text

_BY_OP: Dict[str, Callable[[dict], Optional[str]]] = {}
# Ops whose Python reference raises ValueError where PyTorch's C++ kernel (the CPU) raises
# RuntimeError: the reworded error has the CPU's type.
_VALUE_ERRORS = ("aten::div.Tensor_mode", "aten::div.Scalar_mode")


class XlaIndexError(IndexError, RuntimeError):
    """An index or dimension of an op's arguments out of range. PyTorch raises IndexError
    for these; PyTorch/XLA's shape checks raise RuntimeError for every failed check. This
    is both, so code written for either catches it; the message is PyTorch's."""


def _for(*names: str):
    def deco(fn):
        for n in names:
            _BY_OP[n] = fn
        return fn
    return deco


def _shape(t: torch.Tensor) -> str:
    return f"{dtype_text(t.dtype)}[{','.join(map(str, t.shape))}]"


def _dims(v) -> List[int]:
    return [v] if isinstance(v, int) else list(v)


def reword(name: str, args: dict, e: BaseException) -> BaseException:
    """The exception to raise for `e`, raised by the meta kernel of op `name` called with
    `args` (schema name -> value, tensors as meta tensors)."""
    msg = None
    fn = _BY_OP.get(name)
    if isinstance(e, IndexError):
        return index_error(e)
    if not isinstance(e, RuntimeError) and name not in _VALUE_ERRORS:
        return e  # another check failed: PyTorch's
    try:
        if fn is not None:
            msg = fn(args)
        if msg is None and isinstance(e, RuntimeError) and _from_broadcast_check(e):
            msg = _broadcast(args)
    except Exception:  # a rewording never hides the original error
        msg = None
    if msg is None:
        return e
    old = str(e)
    if isinstance(e, RuntimeError):
        e.args = (msg,)
        out = e
    else:  # PyTorch's Python reference raised another type than its C++ kernel
        out = RuntimeError(msg)
    out.add_note(f"PyTorch's message: {old}")
    return out


def index_error(e: IndexError) -> BaseException:
    """`e` as an XlaIndexError (same message, notes and traceback)."""
    if isinstance(e, RuntimeError):
        return e
    out = XlaIndexError(*e.args)
    for note in getattr(e, "__notes__", ()):
        out.add_note(note)
    return out.with_traceback(e.__traceback__)


def _from_broadcast_check(e: BaseException) -> bool:
    return any(f.f_code.co_name == "_broadcast_shapes" for f, _ in traceback.walk_tb(e.__traceback__))


def _broadcast(args: dict) -> Optional[str]:
    ts = [v for v in args.values() if isinstance(v, torch.Tensor)]
    for i, a in enumerate(ts):
        for b in ts[i + 1:]:
            n = min(a.dim(), b.dim())
            for k in range(n):
                da, db = a.dim() - n + k, b.dim() - n + k
                sa, sb = a.shape[da], b.shape[db]
                if sa != sb and sa != 1 and sb != 1:
                    return (f"Shapes are not compatible for broadcasting: {_shape(a)} vs. {_shape(b)}. "
                            f"Expected dimension {da} of shape {_shape(a)} ({sa}) to match dimension "
                            f"{db} of shape {_shape(b)} ({sb}). Either that or that any of them is either "
                            f"1 or unbounded. Try reshaping one of the tensors to match the other.")
    return None


@_for("aten::cat")
def _cat(args):
    ts = [t for t in args["tensors"] if not (t.dim() == 1 and t.shape[0] == 0)]
    if not ts or any(t.dim() == 0 for t in ts):
        return None  # PyTorch's "zero-dimensional tensor cannot be concatenated" says it
    ref = ts[0]
    d = args.get("dim", 0)
    d = d + ref.dim() if d < 0 else d
    for t in ts[1:]:
        if t.dim() != ref.dim() or any(t.shape[i] != ref.shape[i] for i in range(t.dim()) if i != d):
            return (f"cat(): cannot concatenate tensors of shape {_shape(ref)} with {_shape(t)} at "
                    f"dimension {d}. Expected shapes to be equal (except at dimension {d}) or that "
                    f"either of them was a 1D empty tensor of size (0,).")
    return None


@_for("aten::div.Tensor_mode", "aten::div.Scalar_mode")
def _div(args):
    mode = args.get("rounding_mode")
    if mode in (None, "trunc", "floor"):
        return None
    return (f"div(): invalid rounding mode `{mode}`. Expected it to be either 'trunc', 'floor', "
            f"or be left unspecified.")


@_for("aten::expand_copy", "aten::expand")
def _expand(args):
    # With functionalization, PyTorch's own check of the view (run on meta tensors before
    # the device sees the op) raises first: PyTorch/XLA words these only without it.
    if not env_vars.get("XLA_DISABLE_FUNCTIONALIZATION"):
        return None
    x, sizes = args["self"], [int(v) for v in args["size"]]
    if x.dim() > len(sizes):
        return (f"expand(): expected the `input` tensor {_shape(x)} (rank: {x.dim()}) to have a rank "
                f"smaller or equal to the given `sizes` [{', '.join(map(str, sizes))}] (rank: {len(sizes)}).")
    base = len(sizes) - x.dim()
    for i, have in enumerate(x.shape):
        want = sizes[base + i]
        if want != -1 and have != 1 and want != have:
            return (f"expand(): expected dimension {base + i} of the given `sizes` [{', '.join(map(str, sizes))}] "
                    f"({want}) to be -1, or equal to the size of the `input` tensor {_shape(x)} at dimension "
                    f"{i} ({have}).")
    return None


@_for("aten::flip")
def _flip(args):
    x, dims = args["self"], list(args["dims"])
    n = max(x.dim(), 1)
    if any(not -n <= d < n for d in dims):
        return None  # PyTorch's IndexError comes first
    norm = [d + n if d < 0 else d for d in dims]
    counts = Counter(norm)
    repeated = sorted(d for d, c in counts.items() if c > 1)
    if not repeated:
        return None
    found = ", ".join(f"{d} ({counts[d]} times)" for d in repeated)
    return (f"flip(): expected each dimension to appear at most once. Found dimensions: {found}. "
            f"Consider changing dims from {dims} to {sorted(counts)}.")


@_for("aten::full")
def _full(args):
    size = list(args["size"])
    if all(s >= 0 for s in size):
        return None
    return (f"full(): expected concrete sizes (i.e. non-symbolic) to be positive values. "
            f"However found negative ones: {size}.")


@_for("aten::gather")
def _gather(args):
    x, index, dim = args["self"], args["index"], args["dim"]
    if max(x.dim(), 1) != max(index.dim(), 1):
        return f"gather(): expected rank of input ({x.dim()}) and index ({index.dim()}) tensors to be the same."
    dim = dim + x.dim() if dim < 0 else dim
    bad = [i for i in range(index.dim()) if i != dim and index.shape[i] > x.shape[i]]
    if not bad:
        return None
    return (f"gather(): expected sizes of index {list(index.shape)} to be smaller or equal those of "
            f"input {list(x.shape)} on all dimensions, except on dimension {dim}. However, that's "
            f"not true on dimensions {bad}.")


@_for("aten::mm")
def _mm(args):
    a, b = args["self"], args["mat2"]
    for which, t in (("first", a), ("second", b)):
        if t.dim() != 2:
            return f"mm(): expected the {which} input tensor {_shape(t)} to be a matrix (i.e. a 2D tensor)."
    if a.shape[1] == b.shape[0]:
        return None
    return (f"mm(): cannot matrix-multiply tensors {_shape(a)} and {_shape(b)}. Expected the size of "
            f"dimension 1 of the first input tensor ({a.shape[1]}) to be equal the size of dimension 0 "
            f"of the second input tensor ({b.shape[0]}).")


@_for("aten::roll")
def _roll(args):
    shifts, dims = _dims(args["shifts"]), _dims(args.get("dims") or [])
    if not shifts:
        return "roll(): expected `shifts` to have at least 1 element."
    if not dims and len(shifts) != 1:
        return (f"roll(): expected `shifts` {shifts} (size={len(shifts)}) to have exactly 1 element "
                f"when `dims` is empty.")
    if dims and len(dims) != len(shifts):
        return (f"roll(): expected `dims` {dims} (size={len(dims)}) to match the size of `shifts` "
                f"{shifts} (size={len(shifts)}).")
    return None


@_for("aten::trace")
def _trace(args):
    x = args["self"]
    if x.dim() == 2:
        return None
    return f"trace(): expected the input tensor {_shape(x)} to be a matrix (i.e. a 2D tensor)."


def _bounds(dtype: torch.dtype):
    if dtype == torch.bool:
        return 0, 1
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    lo, hi = info.min, info.max
    return (int(lo), int(hi)) if float(hi).is_integer() and abs(hi) < 2 ** 63 else (lo, hi)


@_for("aten::random.from", "aten::random.to")
def _random(args):
    x = args["self"]
    lo = args.get("from", 0)
    hi = args.get("to")
    if hi is not None and lo >= hi:
        return f"random_(): expected `from` ({lo}) to be smaller than `to` ({hi})."
    mn, mx = _bounds(x.dtype)
    for what, v in (("from", lo), ("to", None if hi is None else hi - 1)):
        if v is None or mn <= v <= mx:
            continue
        side = "less than the lower" if v < mn else "greater than the upper"
        return (f"random_(): expected `{what}` to be within the range [{mn}, {mx}]. However got "
                f"value {v}, which is {side} bound.")
    return None
