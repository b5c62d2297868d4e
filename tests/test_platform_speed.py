"""Correctness of the first-step and CPU speed levers (never their timing).

`lazy_optimizer_dynamo`: torch.optim's step runs without importing torch._dynamo until
something else imports it, with PyTorch's results and grad-mode handling, and PyTorch's own
wrapper is back once torch._dynamo loads (so Dynamo traces what it always traced).

`lazy_symbolic_shapes`: a first training step imports neither sympy nor PyTorch's
symbolic_shapes; the stand-ins answer plain values as PyTorch's helpers do, and the first use
that needs PyTorch's module gets it in the same module object.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

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
from torch_xla._engine import process_patches
out["hooks_left"] = [repr(f) for f in sys.meta_path
                     if getattr(f, "undo", None) is process_patches.restore_optimizer_steps]

w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
opt = torch.optim.SGD([w], lr=0.5)
w.grad = torch.tensor([0.25, 0.5])
torch.compile(opt.step, backend="eager")()
out["compiled_step"] = w.detach().tolist()
print("RESULT " + json.dumps(out))
"""


def _run(env_extra, script=_SCRIPT):
    env = dict(os.environ, PJRT_DEVICE="CPU", **env_extra)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
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


@pytest.mark.slow   # ~8 s: a fresh process
def test_opt_out_leaves_the_wrapper_alone():
    off = _run({"PT_XLA_LAZY_OPTIMIZER_DYNAMO": "0"})
    assert off["after_steps"] is True   # PyTorch's wrapper imported it at the first step
    assert off["stand_in"].endswith(os.path.join("torch", "optim", "optimizer.py"))
    assert off["diffs"] == pytest.approx({"sgd": 0.0, "adam": 0.0, "adamw": 0.0}, abs=1e-6)


# ---- lazy_symbolic_shapes -----------------------------------------------------------------------
# A first training step (convolution, pooling, batch norm, embedding, power, softmax, Adam)
# imports neither sympy nor PyTorch's symbolic_shapes, with PyTorch's losses; the first use that
# needs PyTorch's module gets it in the same module object, and Dynamo's symbolic shapes work.

_SYMBOLIC_SCRIPT = r"""
import json, sys
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
from torch_xla._engine import process_patches as pp

NAME = "torch.fx.experimental.symbolic_shapes"
out = {"lazy_at_import": type(sys.modules.get(NAME)).__name__}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 3 * 3 + 8, 5)

    def forward(self, img, ids):
        x = self.bn(F.max_pool2d(F.relu(self.conv(img)), 2)).flatten(1)
        e = self.emb(ids).pow(2).mean(1)
        return F.log_softmax(self.fc(torch.cat([x, e], 1)), 1)

def losses(device):
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    img, ids, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4, 3)), torch.randint(0, 5, (4,))
    img, ids, y = img.to(device), ids.to(device), y.to(device)
    got = []
    for _ in range(2):
        opt.zero_grad()
        loss = F.nll_loss(model(img, ids), y)
        loss.backward()
        opt.step()
        if device != "cpu":
            torch_xla.sync()
        got.append(loss.item())
    return got

out["xla"] = losses("xla")
out["sympy_after_steps"] = "sympy" in sys.modules
out["lazy_after_steps"] = type(sys.modules.get(NAME)).__name__
out["cpu"] = losses("cpu")

if out["lazy_after_steps"] == "_LazySymbolicShapes":
    lazy = sys.modules[NAME]
    import torch.fx.experimental.symbolic_shapes as ss
    env = ss.ShapeEnv()   # a name without a stand-in: PyTorch's module, run into the same object
    out["same_object"] = sys.modules[NAME] is lazy and torch.fx.experimental.symbolic_shapes is lazy
    out["class_after_load"] = type(lazy).__name__
    u = env.create_unbacked_symint()
    s = pp._STAND_INS
    out["symbolic_delegated"] = [s["guard_or_false"](u == 3), s["guard_or_true"](u == 3),
                                 s["has_guarding_hint"](u), s["is_nested_int"](u)]
    out["symbolic_pytorch"] = [ss.guard_or_false(u == 3), ss.guard_or_true(u == 3),
                               ss.has_guarding_hint(u), ss.is_nested_int(u)]
    f = torch.compile(lambda x: (x * 2).sum(0), backend="eager", dynamic=True)
    out["compiled"] = [f(torch.ones(3, 2)).tolist(), f(torch.ones(5, 2)).tolist()]
    import torch._prims_common as pc
    out["dtypes_restored"] = pc.elementwise_dtypes is pp._pytorch_elementwise_dtypes
    out["hooks_left"] = [repr(f) for f in sys.meta_path if getattr(f, "undo", None) is pp.restore_elementwise_dtypes]
print("RESULT " + json.dumps(out))
"""


def _run_symbolic(env_extra):
    return _run(env_extra, _SYMBOLIC_SCRIPT)


@pytest.fixture(scope="module")
def symbolic():
    return _run_symbolic({})


def test_first_steps_import_no_sympy_and_match_eager_cpu(symbolic):
    assert symbolic["lazy_at_import"] == "_LazySymbolicShapes"
    assert symbolic["sympy_after_steps"] is False
    assert symbolic["lazy_after_steps"] == "_LazySymbolicShapes"
    assert symbolic["xla"] == pytest.approx(symbolic["cpu"], rel=1e-5, abs=1e-6)


def test_first_real_use_gets_pytorchs_module_in_the_same_object(symbolic):
    assert symbolic["same_object"] is True
    assert symbolic["class_after_load"] == "module"
    assert symbolic["symbolic_delegated"] == symbolic["symbolic_pytorch"]
    assert symbolic["compiled"] == [[6.0, 6.0], [10.0, 10.0]]
    assert symbolic["dtypes_restored"] is True
    assert symbolic["hooks_left"] == []


@pytest.mark.slow   # ~7 s: a fresh process
def test_symbolic_shapes_opt_out_imports_sympy_at_the_first_step():
    off = _run_symbolic({"PT_XLA_LAZY_SYMBOLIC_SHAPES": "0"})
    assert off["lazy_at_import"] == "NoneType"
    assert off["sympy_after_steps"] is True
    assert off["xla"] == pytest.approx(off["cpu"], rel=1e-5, abs=1e-6)


def _pytorch_symbolic_shapes():
    from torch_xla._engine import process_patches as pp
    return pp.load_symbolic_shapes(), pp


_PLAIN_CALLS = [
    ("expect_true", (True,)), ("expect_true", (False,)), ("guard_or_false", (True,)), ("guard_or_false", (False,)),
    ("guard_or_true", (False,)), ("statically_known_true", (False,)),
    ("guarding_hint_or_throw", (7,)), ("guarding_hint_or_throw", (True,)), ("has_guarding_hint", (3,)),
    ("is_nested_int", (3,)), ("is_nested_int", (2.5,)), ("sym_and", (True, True, False)), ("sym_and", (True,)),
    ("sym_or", (False, False)), ("sym_or", (False, True)), ("sym_eq", ([1, 2], (1, 2))), ("sym_eq", ([1], [1, 2])),
    ("sym_eq", ((1, (2, 3)), [1, [2, 3]])), ("sym_eq", (3, 4)), ("sym_eq", (True, 1)),
    ("sym_eq", (torch.Size([2, 3]), (2, 3))), ("sym_eq", (torch.Size([2, 3]), torch.Size([2, 4]))),
    # wrong types: PyTorch's error
    ("guard_or_false", (1,)), ("expect_true", (1,)), ("sym_eq", ([1], 1)), ("guarding_hint_or_throw", (1.5,)),
]


@pytest.mark.parametrize("name,args", _PLAIN_CALLS, ids=[f"{n}{a}" for n, a in _PLAIN_CALLS])
def test_stand_ins_answer_plain_values_as_pytorch(name, args):
    ss, pp = _pytorch_symbolic_shapes()

    def call(fn):
        try:
            return ("ok", fn(*args))
        except Exception as e:   # noqa: BLE001  (the exception type is compared)
            return ("raised", type(e))
    got, want = call(pp._STAND_INS[name]), call(getattr(ss, name))
    assert got == want and type(got[1]) is type(want[1])


def test_free_unbacked_symbols_of_a_plain_tensor_is_empty_as_pytorch():
    ss, pp = _pytorch_symbolic_shapes()
    t = torch.empty(2, 3, device="meta")
    assert list(pp._STAND_INS["free_unbacked_symbols"](t)) == list(ss.free_unbacked_symbols(t)) == []


def test_elementwise_dtypes_stand_in_equals_pytorchs():
    import random

    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as kinds

    from torch_xla._engine import process_patches as pp
    pytorch = pp._pytorch_elementwise_dtypes or torch._prims_common.elementwise_dtypes
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128, torch.uint16,
              torch.float8_e4m3fn]
    scalars = [True, 3, 2.5, 1j, None]
    rng = random.Random(0)

    def call(fn, args, kind):
        try:
            return fn(*args, type_promotion_kind=kind)
        except Exception as e:   # noqa: BLE001  (the exception type is compared)
            return type(e)
    for _ in range(3000):
        args = [rng.choice(scalars) if rng.random() < 0.3 else
                torch.empty((2,) if rng.random() < 0.6 else (), dtype=rng.choice(dtypes), device="meta")
                for _ in range(rng.randint(1, 4))]
        kind = rng.choice(list(kinds))
        assert call(pp._elementwise_dtypes, args, kind) == call(pytorch, args, kind), (args, kind)
