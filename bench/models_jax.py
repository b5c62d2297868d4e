"""The benchmark models written directly in jax (jax.numpy / lax), the limit of this design:
the same XLA CPU compiler with no PyTorch front end.

Parameters and buffers come from the torch model of bench/models_torch.py (same names as its
state_dict), so for the same weights and batch both compute the same function. The train
step is one jax.jit of forward + backward + optimizer (SGD with momentum, or Adam, written by
hand with torch.optim's maths) + BatchNorm running-statistics update.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def to_jax(t):
    return jnp.asarray(t.detach().cpu().numpy())


def split_state(model):
    """(params, buffers) of a torch module as dicts of jax arrays keyed like its state_dict."""
    params = {n: to_jax(p) for n, p in model.named_parameters()}
    buffers = {n: to_jax(b) for n, b in model.named_buffers()}
    return params, buffers


# ---------------------------------------------------------------------------------------
# layers

def conv2d(x, w, b=None, stride=1, pad=0):
    y = lax.conv_general_dilated(x, w, (stride, stride), [(pad, pad), (pad, pad)],
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"))
    if b is not None:
        y = y + b[None, :, None, None]
    return y


def max_pool2d(x, k, stride=None, pad=0):
    stride = stride or k
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, k, k), (1, 1, stride, stride),
                             [(0, 0), (0, 0), (pad, pad), (pad, pad)])


def linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def batch_norm(x, p, bufs, name, train, updates, momentum=0.1, eps=1e-5):
    w, b = p[name + ".weight"], p[name + ".bias"]
    if train:
        mean = x.mean(axis=(0, 2, 3))
        var = x.var(axis=(0, 2, 3))
        n = x.size // x.shape[1]
        rm, rv = bufs[name + ".running_mean"], bufs[name + ".running_var"]
        updates[name + ".running_mean"] = (1 - momentum) * rm + momentum * lax.stop_gradient(mean)
        updates[name + ".running_var"] = ((1 - momentum) * rv
                                          + momentum * lax.stop_gradient(var) * n / (n - 1))
        updates[name + ".num_batches_tracked"] = bufs[name + ".num_batches_tracked"] + 1
    else:
        mean, var = bufs[name + ".running_mean"], bufs[name + ".running_var"]
    inv = lax.rsqrt(var + eps)
    return (x - mean[None, :, None, None]) * (inv * w)[None, :, None, None] + b[None, :, None, None]


def nll_loss(logp, y):
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def cross_entropy(logits, y):
    return nll_loss(jax.nn.log_softmax(logits, axis=-1), y)


# ---------------------------------------------------------------------------------------
# the three models: forward(params, buffers, x, train, updates) -> output

def mnist_forward(p, bufs, x, train, updates):
    x = jax.nn.relu(max_pool2d(conv2d(x, p["conv1.weight"], p["conv1.bias"]), 2))
    x = batch_norm(x, p, bufs, "bn1", train, updates)
    x = jax.nn.relu(max_pool2d(conv2d(x, p["conv2.weight"], p["conv2.bias"]), 2))
    x = batch_norm(x, p, bufs, "bn2", train, updates)
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(linear(x, p["fc1.weight"], p["fc1.bias"]))
    x = linear(x, p["fc2.weight"], p["fc2.bias"])
    return jax.nn.log_softmax(x, axis=1)


def _rms(x, w, eps):
    return w * (x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def make_decoder_forward(cfg):
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // nh
    eps = cfg.rms_eps

    def forward(p, bufs, ids, train, updates):
        b, s = ids.shape
        cos, sin = bufs["rope_cos"][:s], bufs["rope_sin"][:s]
        mask = bufs["causal_mask"][:s, :s]
        x = p["embed_tokens.weight"][ids]
        for i in range(cfg.num_hidden_layers):
            pre = f"layers.{i}."
            h = _rms(x, p[pre + "input_layernorm.weight"], eps)
            q = linear(h, p[pre + "self_attn.q_proj.weight"]).reshape(b, s, nh, hd).transpose(0, 2, 1, 3)
            k = linear(h, p[pre + "self_attn.k_proj.weight"]).reshape(b, s, nkv, hd).transpose(0, 2, 1, 3)
            v = linear(h, p[pre + "self_attn.v_proj.weight"]).reshape(b, s, nkv, hd).transpose(0, 2, 1, 3)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if nh // nkv > 1:
                k = jnp.repeat(k, nh // nkv, axis=1)
                v = jnp.repeat(v, nh // nkv, axis=1)
            scores = jnp.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(hd) + mask
            probs = jax.nn.softmax(scores, axis=-1)
            o = jnp.matmul(probs, v).transpose(0, 2, 1, 3).reshape(b, s, nh * hd)
            x = x + linear(o, p[pre + "self_attn.o_proj.weight"])
            h = _rms(x, p[pre + "post_attention_layernorm.weight"], eps)
            m = jax.nn.silu(linear(h, p[pre + "mlp.gate_proj.weight"])) * linear(h, p[pre + "mlp.up_proj.weight"])
            x = x + linear(m, p[pre + "mlp.down_proj.weight"])
        return linear(_rms(x, p["norm.weight"], eps), p["output.weight"])
    return forward


def _basic_block(p, bufs, x, pre, stride, train, updates):
    if pre + "downsample.0.weight" in p:
        idt = conv2d(x, p[pre + "downsample.0.weight"], stride=stride)
        idt = batch_norm(idt, p, bufs, pre + "downsample.1", train, updates)
    else:
        idt = x
    out = conv2d(x, p[pre + "conv1.weight"], stride=stride, pad=1)
    out = jax.nn.relu(batch_norm(out, p, bufs, pre + "bn1", train, updates))
    out = conv2d(out, p[pre + "conv2.weight"], pad=1)
    out = batch_norm(out, p, bufs, pre + "bn2", train, updates)
    return jax.nn.relu(out + idt)


def resnet_forward(p, bufs, x, train, updates):
    x = conv2d(x, p["conv1.weight"], stride=2, pad=3)
    x = jax.nn.relu(batch_norm(x, p, bufs, "bn1", train, updates))
    x = max_pool2d(x, 3, 2, 1)
    for i in range(8):
        stride = 2 if i in (2, 4, 6) else 1
        x = _basic_block(p, bufs, x, f"blocks.{i}.", stride, train, updates)
    x = x.mean(axis=(2, 3))
    return linear(x, p["fc.weight"], p["fc.bias"])


def forward_and_loss(name, model):
    """(forward, loss_of_output) of the torch workload `name` built as `model`."""
    if name == "mnist":
        return mnist_forward, nll_loss
    if name == "decoder":
        fwd = make_decoder_forward(model.cfg)
        return fwd, lambda logits, y: cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    if name == "resnet18":
        return resnet_forward, cross_entropy
    raise ValueError(name)


# ---------------------------------------------------------------------------------------
# optimizers (torch.optim's maths)

def sgd_init(params):
    return {"buf": jax.tree_util.tree_map(jnp.zeros_like, params)}


def sgd_update(params, grads, state, lr, momentum):
    if momentum == 0.0:
        return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads), state
    # torch: buf = g on the first step, then buf = momentum * buf + g; zeros make both equal.
    buf = jax.tree_util.tree_map(lambda b, g: momentum * b + g, state["buf"], grads)
    return jax.tree_util.tree_map(lambda p, b: p - lr * b, params, buf), {"buf": buf}


def adam_init(params):
    z = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"m": z, "v": jax.tree_util.tree_map(jnp.zeros_like, params),
            "step": jnp.zeros((), jnp.float32)}


def adam_update(params, grads, state, lr, b1=0.9, b2=0.999, eps=1e-8):
    step = state["step"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    bc1 = 1 - b1 ** step
    bc2 = 1 - b2 ** step
    step_size = lr / bc1
    new = jax.tree_util.tree_map(
        lambda p, m, v: p - step_size * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + eps), params, m, v)
    return new, {"m": m, "v": v, "step": step}


# ---------------------------------------------------------------------------------------
# train / eval steps

def make_train_step(wl, model, jit=True):
    """(train_step, params, opt_state, buffers) for workload `wl` (bench/models_torch.Workload)
    starting from the weights of the torch module `model`.

    train_step(params, opt_state, buffers, x, y) -> (loss, params, opt_state, buffers).
    """
    fwd, loss_of = forward_and_loss(wl.name, model)
    params, buffers = split_state(model)

    def loss_fn(p, bufs, x, y):
        updates = {}
        out = fwd(p, bufs, x, True, updates)
        return loss_of(out, y), updates

    def step(p, opt_state, bufs, x, y):
        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, bufs, x, y)
        if wl.opt == "adam":
            p, opt_state = adam_update(p, grads, opt_state, wl.lr)
        else:
            p, opt_state = sgd_update(p, grads, opt_state, wl.lr, wl.momentum)
        bufs = dict(bufs, **updates)
        return loss, p, opt_state, bufs

    opt_state = adam_init(params) if wl.opt == "adam" else sgd_init(params)
    if jit:
        step = jax.jit(step, donate_argnums=(0, 1, 2))
    return step, params, opt_state, buffers


def make_eval_step(wl, model, jit=True):
    """(forward(params, buffers, x) -> output, params, buffers), inference mode."""
    fwd, _ = forward_and_loss(wl.name, model)
    params, buffers = split_state(model)

    def f(p, bufs, x):
        return fwd(p, bufs, x, False, {})
    return (jax.jit(f) if jit else f), params, buffers


class CompileCounter:
    """Counts XLA compilations (and their time) of this process through jax.monitoring."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self.total_s = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **kw):
        if event == self.EVENT:
            self.count += 1
            self.total_s += duration
