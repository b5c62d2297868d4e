"""Collectives across replicas (one process per device).

Tensor collectives are IR nodes (lowered in lowering/collectives.py) that become
part of the step's graph; with one replica they are the identity. `rendezvous` and
`mesh_reduce` exchange host data through the coordination service's key-value
store, with the job's collective timeout. What `mesh_reduce` exchanges is encoded as
data only (`encode_host` / `decode_host`: tensors through `torch.save` and
`torch.load(weights_only=True)`, containers and scalars as tagged values), never as a
pickle that could run code in the reader.
"""
from __future__ import annotations

import io
import itertools
from typing import Callable, List

import torch

from . import executor, job
from .kernels import engine_op
from .tensor import replace_state, state_of

_REDUCE_TYPES = ("sum", "mul", "and", "or", "min", "max")


def _check_reduce_type(reduce_type: str) -> None:
    if reduce_type not in _REDUCE_TYPES:
        raise ValueError(f"invalid reduce type {reduce_type!r}; expected one of {_REDUCE_TYPES}")


def _groups(groups):
    if not groups:
        return None
    return tuple(tuple(int(r) for r in g) for g in groups)


def _group_size(groups) -> int:
    return len(groups[0]) if groups else job.world_size()


def _always() -> bool:
    """XLA_ALWAYS_ALLREDUCE, read when the op is built: a static of the node, so programs
    traced with and without it never share a compiled executable."""
    from . import env_vars
    return bool(env_vars.get("XLA_ALWAYS_ALLREDUCE"))


def _assign(dst: torch.Tensor, value: torch.Tensor) -> None:
    """`dst` takes `value` (and its shape, as PyTorch/XLA's `output=` does)."""
    with torch.no_grad():
        if dst.shape != value.shape:
            dst.resize_(value.shape)
        dst.copy_(value)


def all_reduce(reduce_type, inputs, scale=1.0, groups=None):
    _check_reduce_type(reduce_type)
    g = _groups(groups)
    single = isinstance(inputs, torch.Tensor)
    tensors = [inputs] if single else list(inputs)
    outs = []
    for t in tensors:
        (o,) = engine_op("xla::all_reduce", [t], (reduce_type, float(scale), g, _always()),
                         [(t.shape, t.dtype)])
        outs.append(o)
    if single:
        return outs[0]
    for t, o in zip(tensors, outs):
        _assign(t, o)
    return inputs


def all_gather(value, dim=0, groups=None, output=None):
    g = _groups(groups)
    n = _group_size(g)

    def gathered(v):
        shape = list(v.shape)
        if shape:
            shape[dim % v.dim()] *= n
        else:
            shape = [n]
        return tuple(shape), v.dtype

    if isinstance(value, (list, tuple)):  # coalesced: one collective over every tensor
        if output is not None and len(output) != len(value):
            raise ValueError(f"`output` length doesn't match `input` length: {len(output)} vs {len(value)}.")
        if not value:
            return output if output is not None else []
        outs = engine_op("xla::all_gather_coalesced", list(value), (dim, g, _always()),
                         [gathered(v) for v in value])
        if output is None:
            return outs
        for o, r in zip(output, outs):
            _assign(o, r)
        return output
    dim = dim % max(value.dim(), 1)
    (o,) = engine_op("xla::all_gather", [value], (dim, g, _always()), [gathered(value)])
    if output is not None:
        _assign(output, o)
        return output
    return o


def reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count, groups=None, output=None):
    _check_reduce_type(reduce_type)
    g = _groups(groups)
    if shard_count != _group_size(g):
        raise ValueError(f"reduce_scatter: shard_count {shard_count} must equal the group size {_group_size(g)}")
    inputs = list(input) if isinstance(input, (list, tuple)) else [input]
    res = []
    for t in inputs:
        d = scatter_dim % t.dim()
        if t.shape[d] % shard_count:
            raise ValueError(f"reduce_scatter: dimension {d} of size {t.shape[d]} is not divisible by "
                             f"shard_count {shard_count}")
        shape = list(t.shape)
        shape[d] //= shard_count
        (o,) = engine_op("xla::reduce_scatter", [t], (reduce_type, float(scale), d, shard_count, g, _always()),
                         [(tuple(shape), t.dtype)])
        res.append(o)
    if output is not None:
        outs = list(output) if isinstance(output, (list, tuple)) else [output]
        for o, r in zip(outs, res):
            _assign(o, r)
        return output
    return res if isinstance(input, (list, tuple)) else res[0]


def optimization_barrier(tensors) -> List[torch.Tensor]:
    """New tensors holding the values of `tensors` (xla tensors) through one XLA
    optimization barrier: what follows cannot be computed before all of them exist."""
    return engine_op("xla::optimization_barrier", list(tensors), (), [(tuple(t.shape), t.dtype) for t in tensors])


def optimization_barrier_(tensors) -> None:
    """Each tensor takes its value through one XLA optimization barrier (in place)."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"]
    if not tensors:
        return
    outs = optimization_barrier(tensors)
    for t, o in zip(tensors, outs):
        replace_state(t, state_of(o))


def bucketized(fn: Callable, inputs, output, bucket_cap_mb: float):
    """Calls `fn(bucket, bucket_output)` on consecutive runs of `inputs` holding at most
    `bucket_cap_mb` MiB (a larger tensor is a bucket of its own); results in order."""
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    outputs = None if output is None else ([output] if isinstance(output, torch.Tensor) else list(output))
    if outputs is not None and len(outputs) != len(inputs):
        raise ValueError(f"`output` length doesn't match `input` length: {len(outputs)} vs {len(inputs)}.")
    cap = bucket_cap_mb * 1024 * 1024
    res, start, size = [], 0, 0
    for i, t in enumerate(inputs + [None]):
        nbytes = 0 if t is None else t.numel() * t.element_size()
        if i > start and (t is None or size + nbytes > cap):
            got = fn(inputs[start:i], None if outputs is None else outputs[start:i])
            res.extend(got)
            start, size = i, 0
        size += nbytes
    return res


def all_to_all(value, split_dimension, concat_dimension, split_count, groups=None):
    g = _groups(groups)
    if split_count != _group_size(g):
        raise ValueError(f"all_to_all: split_count {split_count} must equal the group size {_group_size(g)}")
    sd = split_dimension % value.dim()
    cd = concat_dimension % value.dim()
    if value.shape[sd] % split_count:
        raise ValueError(f"all_to_all: dimension {sd} of size {value.shape[sd]} is not divisible by "
                         f"split_count {split_count}")
    shape = list(value.shape)
    shape[sd] //= split_count
    shape[cd] *= split_count
    (o,) = engine_op("xla::all_to_all", [value], (sd, cd, split_count, g), [(tuple(shape), value.dtype)])
    return o


def collective_permute(value, pairs):
    pairs = tuple((int(s), int(t)) for s, t in pairs)
    (o,) = engine_op("xla::collective_permute", [value], (pairs,), [(value.shape, value.dtype)])
    return o


# ---- host-side exchanges ----------------------------------------------------------------

_rounds = {}


def _round(tag: str) -> int:
    """Each use of a tag is a new round, so tags may be reused."""
    it = _rounds.setdefault(tag, itertools.count())
    return next(it)


def rendezvous(tag: str, payload: bytes = b"", replicas=()) -> List[bytes]:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"rendezvous {tag!r}: the payload must be bytes, got {type(payload).__name__}")
    world = job.world_size()
    if world <= 1:
        return [payload]
    members = sorted(replicas) if replicas else list(range(world))
    me = job.global_ordinal()
    if me not in members:
        raise ValueError(f"rendezvous {tag!r}: replica {me} is not in {members}")
    client = job.kv_client()
    r = _round(tag)
    prefix = f"torch_xla/rendezvous/{tag}/{r}/"
    client.key_value_set_bytes(prefix + str(me), bytes(payload))
    timeout_ms = job.collective_timeout_s() * 1000
    out = []
    for m in members:
        try:
            out.append(client.blocking_key_value_get_bytes(prefix + str(m), timeout_ms))
        except job.service_error() as e:
            raise RuntimeError(job.service_failure(f"rendezvous {tag!r}: waiting for replica {m}", e,
                                                   timeout_ms / 1000)) from e
    return out


_p2p_seq = {}
_loopback = {}


def _p2p_next(side: str, channel: int) -> int:
    """Sends and receives of a channel are numbered on each side: the k-th send is the
    k-th recv's."""
    k = (side, channel)
    n = _p2p_seq.get(k, 0)
    _p2p_seq[k] = n + 1
    return n


def p2p_send(channel: int, value: torch.Tensor) -> None:
    """Posts host tensor `value` as the next message of `channel` (`xm.send`); a job of
    one replica keeps it for its own `p2p_recv`."""
    seq = _p2p_next("send", channel)
    payload = encode_host(value)
    if job.world_size() <= 1:
        _loopback[(channel, seq)] = payload
        return
    key = f"torch_xla/xm/p2p/{channel}/{seq}"
    try:
        job.kv_client().key_value_set_bytes(key, payload)
    except job.service_error() as e:
        raise RuntimeError(job.service_failure(f"send on channel {channel} (message {seq}; a channel id names "
                                               f"one sender and one receiver)", e)) from e


def p2p_recv(channel: int) -> torch.Tensor:
    """The next message of `channel` (a host tensor), waiting up to the collective timeout."""
    seq = _p2p_next("recv", channel)
    if job.world_size() <= 1:
        payload = _loopback.pop((channel, seq), None)
        if payload is None:
            _p2p_seq[("recv", channel)] = seq  # nothing consumed
            raise RuntimeError(f"recv on channel {channel}: nothing was sent on it (a job of one replica "
                               f"receives only what it sent itself)")
        return decode_host(payload)
    client = job.kv_client()
    key = f"torch_xla/xm/p2p/{channel}/{seq}"
    timeout_ms = job.collective_timeout_s() * 1000
    try:
        payload = client.blocking_key_value_get_bytes(key, timeout_ms)
    except job.service_error() as e:
        raise RuntimeError(job.service_failure(f"recv on channel {channel}", e, timeout_ms / 1000)) from e
    try:
        client.key_value_delete(key)
    except job.service_error():  # only the store's tidiness is at stake: the message was read
        pass
    return decode_host(payload)


def mesh_reduce(tag: str, data, reduce_fn: Callable):
    if job.world_size() <= 1:
        return reduce_fn([data])
    payloads = rendezvous(tag, encode_host(data))
    return reduce_fn([decode_host(p) for p in payloads])


_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _tag(x):
    """`x` as nested (kind, value) pairs of the types `torch.load(weights_only=True)` reads."""
    if isinstance(x, torch.Tensor):
        return ("t", x.detach().cpu())
    t = type(x)
    if t in _SCALARS:
        return ("s", x)
    if t is list:
        return ("l", [_tag(v) for v in x])
    if t is tuple:
        return ("u", [_tag(v) for v in x])
    if t is dict:
        return ("d", [(_tag(k), _tag(v)) for k, v in x.items()])
    if t is torch.Size:
        return ("z", list(x))
    if isinstance(x, torch.dtype):
        return ("y", str(x).split(".")[-1])
    import numpy as np
    if isinstance(x, np.ndarray) and x.dtype != object:
        return ("n", torch.from_numpy(np.ascontiguousarray(x).view(np.uint8).reshape(-1).copy()),
                x.dtype.str, list(x.shape))
    if isinstance(x, np.generic) and t is not np.object_:
        return ("g", _tag(np.asarray(x))[1:])
    raise TypeError(f"mesh_reduce cannot exchange a value of type {t.__name__}: tensors, numpy arrays, "
                    f"numbers, strings, bytes, None, dtypes and lists, tuples and dicts of them")


def _untag(x):
    kind = x[0]
    if kind == "t" or kind == "s":
        return x[1]
    if kind == "l":
        return [_untag(v) for v in x[1]]
    if kind == "u":
        return tuple(_untag(v) for v in x[1])
    if kind == "d":
        return {_untag(k): _untag(v) for k, v in x[1]}
    if kind == "z":
        return torch.Size(x[1])
    if kind == "y":
        dt = getattr(torch, x[1])
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"not a dtype: {x[1]!r}")
        return dt
    import numpy as np
    if kind == "n":
        return x[1].numpy().view(np.dtype(x[2])).reshape(x[3])
    if kind == "g":
        return _untag(("n",) + tuple(x[1]))[()]
    raise ValueError(f"unknown host value kind {kind!r}")


def encode_host(data) -> bytes:
    """Host data (tensors read to the CPU) as bytes that `decode_host` reads without pickle."""
    buf = io.BytesIO()
    torch.save(_tag(data), buf)
    return buf.getvalue()


def decode_host(payload: bytes):
    """The value `encode_host` wrote; loading runs no code (`weights_only=True`)."""
    return _untag(torch.load(io.BytesIO(payload), weights_only=True))


def broadcast_master_param(model: torch.nn.Module) -> None:
    if job.world_size() <= 1:
        return
    tensors = [p for p in model.parameters()] + [b for b in model.buffers()]
    if not tensors:
        return
    master = job.global_ordinal() == 0
    # Every replica must trace the same graph (one SPMD program): choose with a device
    # value, not with Python control flow (`t if master else zeros` gave the master a
    # graph with parameters and the others one with constants: the job hung).
    flags = {}
    for t in tensors:
        with torch.no_grad():
            if t.device not in flags:
                flags[t.device] = torch.tensor(master).to(t.device)
            contrib = torch.where(flags[t.device], t, torch.zeros_like(t))
            kind = "or" if t.dtype == torch.bool else "sum"
            (o,) = engine_op("xla::all_reduce", [contrib], (kind, 1.0, None), [(t.shape, t.dtype)])
            t.copy_(o)
    executor.sync()
