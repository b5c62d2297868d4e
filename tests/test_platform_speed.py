"""Correctness of the first-step and CPU speed levers (never their timing).

`lazy_optimizer_dynamo`: torch.optim's step runs without importing torch._dynamo until
something else imports it, with PyTorch's results and grad-mode handling, and PyTorch's own
wrapper is back once torch._dynamo loads (so Dynamo traces what it always traced).
"""
import json
import os
import subprocess
import sys

import pytest

# A fresh process: the test session may have imported torch._dynamo long ago.
_SCRIPT = r"""
import json, sys
import torch
from torch.optim.optimizer import Optimizer, _use_grad_for_differentiable

class Probe(Optimizer):
    # defined before torch_xla: records the grad mode inside step, can fail on demand
    def __init__(self, params):
        super().__init__(params, {"differentiable": False})
        self.seen, self.fail = [], False

    @_use_grad_for_differentiable
    def step(self, closure=None):
        self.seen.append(torch.is_grad_enabled())
        if self.fail:
            raise ValueError("boom")

def wrapper_file(cls):
    # the file of the class's `_use_grad` wrapper (under the profiling hook once stepped)
    f = cls.step
    return (f.__wrapped__ if getattr(f, "hooked", False) else f).__code__.co_filename

import torch_xla
out = {"after_import": "torch._dynamo" in sys.modules}

def train(device, opt_cls, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(device)
    opt = opt_cls(model.parameters(), **kw)
    x = torch.randn(4, 6).to(device)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        if device != "cpu":
            torch_xla.sync()
    return [p.detach().cpu() for p in model.parameters()]

diffs = {}
for name, cls, kw in (("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                      ("adam", torch.optim.Adam, {"lr": 0.01}),
                      ("adamw", torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})):
    a, b = train("xla", cls, **kw), train("cpu", cls, **kw)
    diffs[name] = max(float((p - q).abs().max()) for p, q in zip(a, b))
out["diffs"] = diffs
out["after_steps"] = "torch._dynamo" in sys.modules
out["stand_in"] = wrapper_file(torch.optim.SGD)

p = Probe([torch.zeros(2, requires_grad=True)])
p.step()
p.fail = True
try:
    p.step()
except ValueError:
    pass
out["grad_mode_inside"] = p.seen
out["grad_mode_after_error"] = torch.is_grad_enabled()
with torch.no_grad():
    p.fail = False
    p.step()
    out["no_grad_kept"] = torch.is_grad_enabled()

import torch._dynamo
out["restored"] = [wrapper_file(c) for c in (torch.optim.SGD, torch.optim.Adam, Probe)]
out["hooks_left"] = [type(f).__name__ for f in sys.meta_path if "OptimizerSteps" in type(f).__name__]

w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
opt = torch.optim.SGD([w], lr=0.5)
w.grad = torch.tensor([0.25, 0.5])
torch.compile(opt.step, backend="eager")()
out["compiled_step"] = w.detach().tolist()
print("RESULT " + json.dumps(out))
"""


def _run(env_extra):
    env = dict(os.environ, PJRT_DEVICE="CPU", **env_extra)
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def lazy():
    return _run({})


def test_optimizer_steps_match_eager_cpu_without_importing_dynamo(lazy):
    assert lazy["after_import"] is False
    assert lazy["after_steps"] is False
    assert lazy["stand_in"].endswith(os.path.join("_engine", "process_patches.py"))
    for name, diff in lazy["diffs"].items():
        assert diff <= 1e-6, (name, diff)


def test_stand_in_keeps_pytorch_grad_mode_handling(lazy):
    # differentiable=False: no grad inside the step; the caller's mode is back afterwards,
    # after an exception too, and a caller's no_grad stays
    assert lazy["grad_mode_inside"] == [False, False, False]
    assert lazy["grad_mode_after_error"] is True
    assert lazy["no_grad_kept"] is False


def test_importing_dynamo_gives_pytorch_its_wrapper_back(lazy):
    suffix = os.path.join("torch", "optim", "optimizer.py")
    assert all(f.endswith(suffix) for f in lazy["restored"]), lazy["restored"]
    assert lazy["hooks_left"] == []
    assert lazy["compiled_step"] == [1.0 - 0.5 * 0.25, -2.0 - 0.5 * 0.5]


def test_opt_out_leaves_the_wrapper_alone():
    off = _run({"PT_XLA_LAZY_OPTIMIZER_DYNAMO": "0"})
    assert off["after_steps"] is True   # PyTorch's wrapper imported it at the first step
    assert off["stand_in"].endswith(os.path.join("torch", "optim", "optimizer.py"))
    assert off["diffs"] == pytest.approx({"sgd": 0.0, "adam": 0.0, "adamw": 0.0}, abs=1e-6)
