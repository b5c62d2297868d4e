"""Quantize / dequantize (`quantized_decomposed::*`, PT2E models) as StableHLO's uniform ops.

Running a graph, each op computes exactly what PyTorch's decomposition computes on the
CPU (multiply by the reciprocal scale, round half to even, add the zero point, clamp,
cast; dequantize the reverse, in the same dtypes). The StableHLO a user reads carries
`stablehlo.uniform_quantize` / `uniform_dequantize` with `!quant.uniform<...>` types.

The two meet through text, and this is deliberate: jaxlib's MLIR bindings do not load the
`quant` dialect, so no quantized type can be built while jax lowers a program, and XLA's
own lowering of the uniform ops divides by the scale (not PyTorch's arithmetic). So each op
is lowered as a `stablehlo.composite "torch_xla.uniform_(de)quantize"` whose attribute
`quantized_type` is the quantized type's text and whose decomposition is the exact
arithmetic (XLA inlines it when the program runs); `rewrite_text` turns those composites
in a program's text into the uniform ops, bit-casting between the quantized type and its
storage integers where a value crosses the boundary (a quantize feeding a dequantize of
the same type needs no cast).
"""
from __future__ import annotations

import re
from typing import Dict, List, Sequence

import numpy as np

from .composite import composite
from .table import lowering

QUANTIZE = "torch_xla.uniform_quantize"
DEQUANTIZE = "torch_xla.uniform_dequantize"

_STORAGE = {"int8": ("i8", -128, 127), "uint8": ("u8", 0, 255), "int16": ("i16", -32768, 32767),
            "uint16": ("u16", 0, 65535), "int32": ("i32", -2 ** 31, 2 ** 31 - 1)}


def storage_range(dtype_name: str) -> tuple:
    """(min, max) of a storage dtype name ('int8', ...); KeyError if not a storage type."""
    return _STORAGE[dtype_name][1:]


def quantized_type(storage: str, qmin: int, qmax: int, scales: Sequence[float], zero_points: Sequence[int],
                   axis: int) -> str:
    """The MLIR element type `!quant.uniform<...>`, as MLIR prints it (scales with `%e`, a
    zero point of 0 left out); `axis` -1: one scale for the tensor."""
    name, lo, hi = _STORAGE[storage]
    st = name if (qmin, qmax) == (lo, hi) else f"{name}<{qmin}:{qmax}>"

    def param(s, z) -> str:
        return f"{float(s):e}" + (f":{int(z)}" if int(z) else "")
    if axis < 0:
        return f"!quant.uniform<{st}:f32, {param(scales[0], zero_points[0])}>"
    return f"!quant.uniform<{st}:f32:{axis}, {{{','.join(param(s, z) for s, z in zip(scales, zero_points))}}}>"


def _along(values: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """Per-channel values shaped to broadcast along `axis` of an `ndim`-d array."""
    if axis < 0 or values.size == 1:
        return values.reshape(())
    shape = [1] * ndim
    shape[axis] = values.size
    return values.reshape(shape)


@lowering("xla::quantize_tensor")
def quantize_tensor(x, inv_scales, zero_points, qmin, qmax, storage, axis, compute, qtype):
    """x (float32): round(x * inv_scale) + zero point, clamped to [qmin, qmax], as `storage`.
    `inv_scales`: the reciprocal scales as PyTorch computes them, in dtype `compute` (in
    which the arithmetic runs); `axis` -1: one scale."""
    import jax.numpy as jnp
    inv = _along(np.asarray(inv_scales, dtype=compute), axis, x.ndim)
    zp = _along(np.asarray(zero_points, dtype=compute), axis, x.ndim)
    lo, hi = np.asarray(qmin, dtype=compute), np.asarray(qmax, dtype=compute)

    def body(v):
        r = jnp.round(v.astype(compute) * inv) + zp
        return (jnp.clip(r, lo, hi).astype(storage),)
    return composite(body, QUANTIZE, [("quantized_type", qtype)], [x])[0]


@lowering("xla::dequantize_tensor")
def dequantize_tensor(x, scales, zero_points, axis, scale_dtype, zp_dtype, out, qtype):
    """The storage integers `x` back to floats, in PyTorch's dtypes: one scale
    (`zp_dtype` None): (x.to(out) - zero point) * scale, each step in `out`'s compute
    dtype; per channel: (x - zero points) in the zero points' integer dtype, times the
    scales in `scale_dtype`, then cast to `out`."""
    if axis < 0:
        opmath = np.float64 if out == "float64" else np.float32
        zp, s = np.asarray(zero_points[0], dtype=opmath), np.asarray(scales[0], dtype=opmath)

        def body(v):
            a = v.astype(out).astype(opmath)
            b = (a - zp).astype(out).astype(opmath)
            return ((b * s).astype(out),)
    else:
        s = _along(np.asarray(scales, dtype=scale_dtype), axis, x.ndim)
        zp = None if zp_dtype is None else _along(np.asarray(zero_points, dtype=zp_dtype), axis, x.ndim)

        def body(v):
            # integers times floats are floats of the scales' dtype (PyTorch's promotion)
            d = v if zp is None else v.astype(np.result_type(v.dtype, zp.dtype)) - zp
            return ((d.astype(s.dtype) * s).astype(out),)
    return composite(body, DEQUANTIZE, [("quantized_type", qtype)], [x])[0]


# ---- the program text's uniform ops ------------------------------------------------------

_COMPOSITE = re.compile(
    r'^(?P<indent>\s*)(?P<res>%[\w.$-]+) = stablehlo\.composite "(?P<name>torch_xla\.uniform_(?:de)?quantize)" '
    r'(?P<arg>%[\w.$#-]+) \{composite_attributes = \{quantized_type = "(?P<qtype>[^"]*)"\}, '
    r'decomposition = @[\w.$-]+\} : \((?P<tin>tensor<[^>]*>)\) -> (?P<tout>tensor<[^>]*>)(?P<tail>.*)$')


def _with_element(tensor_type: str, element: str) -> str:
    """`tensor<2x3xf32>` with its element type replaced."""
    dims = tensor_type[len("tensor<"):-1].split("x")[:-1]
    return "tensor<" + "".join(d + "x" for d in dims) + element + ">"


def rewrite_text(text: str) -> str:
    """A program's StableHLO text with the quantize / dequantize composites as
    `stablehlo.uniform_quantize` / `uniform_dequantize` on `!quant.uniform` types (their
    decomposition functions dropped). Text without them is returned unchanged."""
    if "torch_xla.uniform_" not in text:
        return text
    lines = text.split("\n")
    out: List[str] = []
    quantized: Dict[str, tuple] = {}   # storage value -> (quantized value, its type)
    fresh = [0]

    def name() -> str:
        fresh[0] += 1
        return f"%uniform_q{fresh[0]}"

    for line in lines:
        m = _COMPOSITE.match(line)
        if m is None:
            out.append(line)
            continue
        ind, res, arg, qtype, tin, tout, tail = (m.group(k) for k in
                                                  ("indent", "res", "arg", "qtype", "tin", "tout", "tail"))
        if m.group("name") == QUANTIZE:
            qt = _with_element(tout, qtype)
            q = name()
            out.append(f"{ind}{q} = stablehlo.uniform_quantize {arg} : ({tin}) -> {qt}{tail}")
            out.append(f"{ind}{res} = stablehlo.bitcast_convert {q} : ({qt}) -> {tout}{tail}")
            quantized[res] = (q, qt)
        else:
            qt = _with_element(tin, qtype)
            known = quantized.get(arg)
            if known is not None and known[1] == qt:
                q = known[0]
            else:
                q = name()
                out.append(f"{ind}{q} = stablehlo.bitcast_convert {arg} : ({tin}) -> {qt}{tail}")
            out.append(f"{ind}{res} = stablehlo.uniform_dequantize {q} : ({qt}) -> {tout}{tail}")
    return _drop_dead(_dedupe(out), set(quantized))


_UNIFORM = re.compile(r"^\s*(%[\w.$-]+) = (stablehlo\.(?:uniform_quantize|uniform_dequantize|bitcast_convert) .*)$")
_VALUE = re.compile(r"%[\w.$-]+")


def _dedupe(lines: List[str]) -> str:
    """One uniform op (or bit cast) per operand and type within a function: PT2E repeats
    a quantize / dequantize for each user of a value, StableHLO's own CSE would keep one."""
    seen: Dict[str, str] = {}
    rename: Dict[str, str] = {}
    out = []
    for line in lines:
        if line.lstrip().startswith("func.func"):
            seen.clear()
            rename.clear()
        if rename:
            line = _VALUE.sub(lambda m: rename.get(m.group(0), m.group(0)), line)
        m = _UNIFORM.match(line)
        if m is not None:
            key = m.group(2)
            first = seen.get(key)
            if first is not None:
                rename[m.group(1)] = first
                continue
            seen[key] = m.group(1)
        out.append(line)
    return "\n".join(out)


def _drop_dead(text: str, candidates: set) -> str:
    """Removes the private functions nobody calls (the composites' decompositions), then
    the bit casts defining `candidates` that nothing in their function reads."""
    while True:
        funcs = _funcs(text, private=True)
        dead = [f for f in funcs if len(re.findall("@" + re.escape(f) + r"(?![\w.$-])", text)) == 1]
        if not dead:
            break
        for f in sorted(dead, key=lambda f: funcs[f][0], reverse=True):
            start, end = funcs[f]
            text = text[:start] + text[end:]
    for v in candidates:
        define = re.compile(r"^[^\n]*" + re.escape(v) + r" = stablehlo\.bitcast_convert [^\n]*\n", flags=re.M)
        for start, end in sorted(_funcs(text).values(), reverse=True):
            body = text[start:end]
            if define.search(body) and len(re.findall(re.escape(v) + r"(?![\w.$-])", body)) == 1:
                text = text[:start] + define.sub("", body, count=1) + text[end:]
    return text


def _funcs(text: str, private: bool = False) -> Dict[str, tuple]:
    """name -> (start, end) offsets of each function (`private`: each private one) in
    `text`, end past its closing line."""
    out = {}
    kind = r"private " if private else r"(?:\w+ )?"
    for m in re.finditer(r"^(\s*)func\.func " + kind + r"@([\w.$-]+)\(", text, flags=re.M):
        close = re.compile("^" + m.group(1) + r"\}[^\n]*\n?", flags=re.M)
        c = close.search(text, m.end())
        if c is not None:
            out[m.group(2)] = (m.start(), c.end())
    return out

