"""The benchmark's jax models (bench/models_jax.py) compute the same function as its torch
models (bench/models_torch.py): same weights, same batch -> same loss (1e-4 relative) on the
first step, and the optimizer maths (SGD momentum, Adam) and BatchNorm running statistics
agree over the next steps. Tiny sizes, CPU only, no xla device involved.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import models_torch as mt  # noqa: E402

import jax  # noqa: E402,F401  (a dependency: never skipped)
import models_jax as mj  # noqa: E402


def _tiny(name):
    if name == "mnist":
        return mt.mnist_workload(batch=8)
    if name == "decoder":
        cfg = mt.DecoderConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                               max_seq=16)
        return mt.decoder_workload(batch=2, seq=16, cfg=cfg)
    # 64x64 so the last stage's BatchNorm sees 2x2 positions per sample: at 32x32 it
    # normalises over 4 values, which amplifies rounding differences chaotically.
    return mt.resnet_workload(batch=4, size=64, width=8)


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("name", ["mnist", "decoder", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_jax_model_matches_torch(name):
    wl = _tiny(name)
    torch.manual_seed(0)
    model = wl.make_model()
    model.train()
    # The jax side starts from the torch weights before torch trains them.
    step, params, opt_state, bufs = mj.make_train_step(wl, model)
    opt = wl.make_opt(model.parameters())
    x, y = wl.make_batch(0)
    jx, jy = mj.to_jax(x), mj.to_jax(y)

    torch_losses, jax_losses = [], []
    for _ in range(3):
        opt.zero_grad()
        loss = wl.loss_fn(model, x, y)
        loss.backward()
        opt.step()
        torch_losses.append(loss.item())
        jl, params, opt_state, bufs = step(params, opt_state, bufs, jx, jy)
        jax_losses.append(float(jl))

    assert _rel(jax_losses[0], torch_losses[0]) < 1e-4, (jax_losses, torch_losses)
    # After optimizer steps: same maths, float32 rounding differences only.
    for a, b in zip(jax_losses[1:], torch_losses[1:]):
        assert _rel(a, b) < 1e-3, (jax_losses, torch_losses)
    # BatchNorm running statistics follow torch's (momentum 0.1, unbiased variance).
    for n, b in model.named_buffers():
        if "running" in n:
            assert torch.allclose(torch.from_numpy(jax.device_get(bufs[n]).copy()), b,
                                  rtol=1e-3, atol=1e-4), n


@pytest.mark.parametrize("name", ["decoder", "resnet18"])
def test_jax_inference_matches_torch(name):
    wl = _tiny(name)
    torch.manual_seed(0)
    model = wl.make_model()
    model.eval()
    fwd, params, bufs = mj.make_eval_step(wl, model)
    x = wl.make_batch(0)[0]
    with torch.no_grad():
        ref = model(x)
    out = torch.from_numpy(jax.device_get(fwd(params, bufs, mj.to_jax(x))).copy())
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
