"""8 devices: the API reference's (4, 2) mesh sample, an MLP on a (2, 4) mesh and the
decoder under FSDPv2, in a process of their own, against eager CPU."""
import json
import os
import subprocess
import sys

import numpy as np
import torch

from models import Decoder, lm_data, lm_loss, mlp, mlp_batches, train_classifier

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 20


def _cpu():
    mlp_losses = train_classifier(mlp(32, 32), mlp_batches(STEPS))
    torch.manual_seed(0)
    dec = Decoder(n_layers=1)
    dopt = torch.optim.AdamW(dec.parameters(), lr=1e-3)
    dl = []
    for idx, tgt in lm_data(STEPS):
        dopt.zero_grad()
        loss = lm_loss(dec(idx), tgt)
        loss.backward()
        dopt.step()
        dl.append(float(loss))
    return mlp_losses, dl


def test_eight_devices_train_like_cpu():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "XLA_TEST_SPMD")}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8")
    p = subprocess.run([sys.executable, os.path.join(HERE, "scripts", "eight_devices.py"), str(STEPS)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(HERE))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    mlp_losses, dl = _cpu()
    np.testing.assert_allclose(r["mlp"], mlp_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["decoder"], dl, rtol=1e-4, atol=1e-5)
    assert r["new_compiles_after_warmup"] == 0
    assert r["tok_pieces"] == [[16, 64]] * 8  # the (128, 64) embedding: 1/8 per device
    assert np.isfinite(r["sample"])
