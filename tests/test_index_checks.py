"""Out-of-range indices are never a silent wrong answer: the program checks them on the
device and the host read (or `wait_device_ops`, or the next barrier) raises the
exception the CPU raises, same type and message, with a note naming the op and the
line that created it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch_xla._engine import env_vars, executor, launcher, pjrt

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mp_scripts import safety_workers  # noqa: E402


def _cases(dev):
    t = lambda v: torch.tensor(v, device=dev)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    x = torch.arange(4.0, device=dev)
    x2 = torch.zeros(3, 4, device=dev)
    one = torch.ones(1, device=dev)

    def setitem():
        y = x.clone()
        y[t([7])] = 1.0
        return y

    return {
        "index": lambda: x[t([7])],
        "index_negative": lambda: x[t([-5])],
        "index_2d": lambda: x2[t([0]), t([9])],
        "index_put": lambda: x.clone().index_put_((t([7]),), t([1.0])),
        "index_put_accumulate": lambda: x.clone().index_put_((t([-9]),), t([1.0]), accumulate=True),
        "setitem": setitem,
        "gather": lambda: torch.gather(x2, 1, t([[9]])),
        "gather_negative": lambda: torch.gather(x2, 1, t([[-1]])),
        "scatter": lambda: x2.clone().scatter_(1, t([[9]]), 1.0),
        "scatter_add": lambda: x2.clone().scatter_add_(0, t([[9]]), torch.ones(1, 1, device=dev)),
        "scatter_reduce": lambda: x2.clone().scatter_reduce_(0, t([[9]]), torch.ones(1, 1, device=dev), "amax"),
        "index_select": lambda: x.index_select(0, t([7])),
        "index_select_negative": lambda: x.index_select(0, t([-1])),
        "index_add": lambda: x.clone().index_add_(0, t([7]), one),
        "index_copy": lambda: x.clone().index_copy_(0, t([7]), one),
        "index_fill": lambda: x.clone().index_fill_(0, t([-5]), 1.0),
        "take": lambda: torch.take(x, t([7])),
        "put": lambda: x.clone().put_(t([-5]), one),
        "embedding": lambda: F.embedding(t([[1, 7]]), x2),
        "embedding_negative": lambda: F.embedding(t([-1]), x2),
        "embedding_bag": lambda: F.embedding_bag(t([0, 2, 9]), x2, t([0])),
        "nll_loss": lambda: F.nll_loss(r(2, 4), t([1, 7])),
        "nll_loss_negative": lambda: F.nll_loss(r(2, 4), t([1, -3])),
        "nll_loss_2d": lambda: F.nll_loss(r(2, 4, 3, 3), torch.full((2, 3, 3), 7, device=dev)),
        "cross_entropy": lambda: F.cross_entropy(r(2, 4), t([1, 7])),
        "cross_entropy_smoothing": lambda: F.cross_entropy(r(2, 4), t([1, 7]), label_smoothing=0.1),
        "cross_entropy_module": lambda: torch.nn.CrossEntropyLoss()(r(2, 4), t([1, 7])),
        "nll_loss_module": lambda: torch.nn.NLLLoss(weight=torch.ones(4, device=dev))(r(2, 4), t([7, 1])),
    }


CASES = sorted(_cases("cpu"))


def _cpu_error(name):
    with pytest.raises(Exception) as ei:
        _cases("cpu")[name]()
    return ei.value


@pytest.mark.parametrize("name", CASES)
def test_out_of_range_raises_cpu_error_at_host_read(name):
    cerr = _cpu_error(name)
    out = _cases("xla")[name]()   # no error at trace time: the index is data
    line = f"{__file__}:"
    with pytest.raises(Exception) as ei:
        out.cpu()
    assert type(ei.value) is type(cerr)
    assert str(ei.value) == str(cerr)
    note = "".join(getattr(ei.value, "__notes__", []))
    assert "raised by aten::" in note and line in note, note


def test_message_names_the_creating_line():
    x = torch.arange(4, device="xla")
    i = torch.tensor([7], device="xla")
    y = x[i]; here = sys._getframe().f_lineno  # noqa: E702
    with pytest.raises(IndexError, match="index 7 is out of bounds for dimension 0 with size 4") as ei:
        y.cpu()
    assert f"raised by aten::index.Tensor (created at {__file__}:{here})" in ei.value.__notes__[0]


def test_valid_indices_match_cpu():
    def run(dev):
        x = torch.arange(12.0, device=dev).reshape(3, 4)
        i = torch.tensor([-1, 0, 2], device=dev)
        tgt = torch.tensor([3, -100, 0], device=dev)
        return [x[i], x[:, i], x.index_select(1, i + 1), torch.gather(x, 1, (i + 1).reshape(3, 1)),
                torch.take(x, i), F.embedding(i + 1, x.T.contiguous()), F.cross_entropy(x, tgt),
                x.clone().index_put_((i,), torch.tensor(5.0, device=dev), accumulate=True)]
    for a, b in zip(run("cpu"), run("xla")):
        torch.testing.assert_close(b.cpu(), a)


def test_error_surfaces_at_wait_device_ops_and_next_barrier():
    x = torch.arange(4.0, device="xla")
    y = x[torch.tensor([7], device="xla")] + 1  # noqa: F841  (never read)
    xm.mark_step()
    with pytest.raises(IndexError, match="index 7 is out of bounds"):
        xm.wait_device_ops()
    y = x[torch.tensor([9], device="xla")] * 2  # noqa: F841
    xm.mark_step()
    pjrt.wait_all_buffers()  # the program has finished: the next barrier sees its result
    z = x + 1
    with pytest.raises(IndexError, match="index 9 is out of bounds"):
        xm.mark_step()
    # the barrier that raised ran nothing: its pending values are computed by the next one
    xm.mark_step()
    torch.testing.assert_close(z.cpu(), torch.arange(4.0) + 1)
    xm.wait_device_ops()  # nothing left to report


def test_training_step_with_bad_target_raises_and_good_one_matches():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 8)
    head = torch.nn.Linear(8, 5)
    ref = [p.detach().clone() for p in (*emb.parameters(), *head.parameters())]

    def step(dev, tokens, target):
        e, h = torch.nn.Embedding(10, 8).to(dev), torch.nn.Linear(8, 5).to(dev)
        with torch.no_grad():
            for p, v in zip((*e.parameters(), *h.parameters()), ref):
                p.copy_(v)
        loss = F.cross_entropy(h(e(tokens.to(dev))), target.to(dev))
        loss.backward()
        return loss, e.weight.grad

    tokens, good, bad = torch.tensor([1, 4, 9]), torch.tensor([0, 4, 2]), torch.tensor([0, 5, 2])
    want = step("cpu", tokens, good)
    got = step("xla", tokens, good)
    xm.mark_step()
    for a, b in zip(want, got):
        torch.testing.assert_close(b.cpu(), a)
    cerr = pytest.raises(IndexError, step, "cpu", tokens, bad).value
    loss, _ = step("xla", tokens, bad)
    xm.mark_step()
    with pytest.raises(IndexError) as ei:
        loss.item()
    assert str(ei.value) == str(cerr) == "Target 5 is out of bounds."


@pytest.mark.parametrize("target", [(2, 3), (2, 4, 1)])
def test_float_targets_of_another_shape_raise_at_the_op(target):
    """A float target that is neither class probabilities nor a batch of class indices is
    refused at the op, as on the CPU (class indices in a float tensor are PyTorch/XLA's:
    test_ops_nn.test_floating_class_targets_as_pytorch_xla_takes_them)."""
    def run(dev):
        return F.cross_entropy(torch.randn(2, 4, device=dev), torch.randn(*target, device=dev))
    cerr = _cpu_error_of(run, "cpu")
    with pytest.raises(type(cerr)) as ei:
        run("xla")
    assert str(ei.value) == str(cerr)


def _cpu_error_of(fn, *args):
    with pytest.raises(Exception) as ei:
        fn(*args)
    return ei.value


@pytest.mark.parametrize("case", ["nll_int32", "nll2d_target_dim", "nll_weight"])
def test_nll_loss_argument_errors_match_cpu(case):
    # (Float class indices, refused by the CPU, are PyTorch/XLA's: test_ops_nn.)
    def run(dev):
        r = lambda *s: torch.randn(*s, device=dev)  # noqa: E731
        long = lambda *s: torch.zeros(*s, dtype=torch.long, device=dev)  # noqa: E731
        if case == "nll_int32":
            return F.nll_loss(r(2, 4), torch.tensor([1, 2], dtype=torch.int32, device=dev))
        if case == "nll2d_target_dim":
            return F.cross_entropy(r(2, 4, 3, 3), r(2, 4, 3, 2))
        return F.nll_loss(r(2, 4), long(2), weight=torch.ones(3, device=dev))
    cerr = _cpu_error_of(run, "cpu")
    with pytest.raises(type(cerr)) as ei:
        run("xla")
    assert str(ei.value) == str(cerr)


def test_checks_off(monkeypatch):
    monkeypatch.setenv("XLA_CHECK_INDICES", "0")
    env_vars.reload()
    executor.clear_cache()
    try:
        x = torch.arange(4.0, device="xla")
        got = x[torch.tensor([7], device="xla")].cpu()   # the unchecked gather clamps
        torch.testing.assert_close(got, torch.tensor([3.0]))
    finally:
        monkeypatch.delenv("XLA_CHECK_INDICES")
        env_vars.reload()
        executor.clear_cache()


def test_dynamo_bridge_checks():
    def fn(x, i):
        return x[i] * 2

    compiled = torch.compile(fn, backend="openxla")
    x = torch.arange(4.0, device="xla")
    torch.testing.assert_close(compiled(x, torch.tensor([1], device="xla")).cpu(), torch.tensor([2.0]))
    cerr = _cpu_error_of(fn, torch.arange(4.0), torch.tensor([7]))
    out = compiled(x, torch.tensor([7], device="xla"))
    with pytest.raises(IndexError) as ei:
        out.cpu()
    assert str(ei.value) == str(cerr)


def test_multiprocess_collective_graph_checks():
    res = launcher.spawn(safety_workers.index_error_in_collective_graph, nprocs=2, return_results=True)
    want = sum(torch.arange(4.0) * (r + 1) for r in range(2))[torch.tensor([1])]  # the CPU's all-reduce
    assert res[0] == ("ok", want.tolist())
    kind, msg, note = res[1]
    assert (kind, msg) == ("IndexError", "index 7 is out of bounds for dimension 0 with size 4")
    assert "aten::index.Tensor" in note and "safety_workers.py" in note


def test_eager_mode_checks():
    torch_xla.experimental.eager_mode(True)
    try:
        x = torch.arange(4.0, device="xla")
        y = x[torch.tensor([7], device="xla")]
        with pytest.raises(IndexError, match="index 7 is out of bounds"):
            y.cpu()
    finally:
        torch_xla.experimental.eager_mode(False)


def test_indexing_that_reads_nothing_checks_nothing():
    """The CPU checks only the indices it reads: a result with no elements is no error,
    whatever the (broadcast) index tensors hold."""
    x = torch.rand(10, 0, 10, 10)
    i0, i1 = torch.randint(0, 100, (5, 0, 5)), torch.randint(0, 100, (5, 1, 1))
    out = x[:, i0, :, i1]
    got = x.to("xla")[:, i0.to("xla"), :, i1.to("xla")]
    assert got.cpu().shape == out.shape
    e = torch.zeros(3, 0)
    assert e.to("xla")[torch.tensor([9], device="xla")].cpu().shape == e[torch.tensor([9])].shape



# ---- the line of this run's call ------------------------------------------------------------

def _counter(name):
    return met.counter_value(name) or 0


def _note(e):
    return "".join(getattr(e, "__notes__", []))


def test_note_names_this_runs_line_when_the_program_is_cached():
    """Two call sites build the same graph: the second runs the executable traced for the
    first, and its error names the second's line, not the first trace's."""
    cerr = _cpu_error_of(lambda: torch.arange(4.0)[torch.tensor([7])])
    x = torch.arange(4.0, device="xla")
    xm.mark_step()
    first = x[torch.tensor([7], device="xla")]; line_a = sys._getframe().f_lineno  # noqa: E702
    with pytest.raises(IndexError) as ei:
        first.cpu()
    assert str(ei.value) == str(cerr)
    assert f"(created at {__file__}:{line_a})" in _note(ei.value)
    cached = _counter("CachedCompile")
    second = x[torch.tensor([9], device="xla")]; line_b = sys._getframe().f_lineno  # noqa: E702
    with pytest.raises(IndexError) as ei:
        second.cpu()
    assert _counter("CachedCompile") == cached + 1   # the same program, not traced again
    assert str(ei.value) == str(_cpu_error_of(lambda: torch.arange(4.0)[torch.tensor([9])]))
    assert f"(created at {__file__}:{line_b})" in _note(ei.value)


def test_division_note_names_this_runs_line_when_the_program_is_cached():
    a = torch.tensor([5, 6], device="xla")
    xm.mark_step()
    good = a // torch.tensor([2, 3], device="xla")
    torch.testing.assert_close(good.cpu(), torch.tensor([5, 6]) // torch.tensor([2, 3]))
    cached = _counter("CachedCompile")
    bad = a // torch.tensor([2, 0], device="xla"); here = sys._getframe().f_lineno  # noqa: E702
    cerr = _cpu_error_of(lambda: torch.tensor([5, 6]) // torch.tensor([2, 0]))
    with pytest.raises(type(cerr)) as ei:
        bad.cpu()
    assert _counter("CachedCompile") == cached + 1
    assert str(ei.value) == str(cerr)
    assert f"raised by aten::floor_divide (created at {__file__}:{here})" in _note(ei.value)


@pytest.fixture
def persistent_cache(tmp_path, monkeypatch):
    from torch_xla._engine.executor import persistent
    monkeypatch.setattr(persistent._cache, "warned", False)
    persistent.configure(str(tmp_path / "cache"))
    executor.clear_cache()
    try:
        yield
    finally:
        persistent.configure(None)
        executor.clear_cache()


def test_note_names_this_runs_line_for_a_program_from_the_persistent_cache(persistent_cache):
    """A program loaded from the disk cache was traced by another process (here: before
    the in-memory cache was emptied); its one checked op is this run's."""
    x = torch.arange(4.0, device="xla")
    xm.mark_step()
    x[torch.tensor([1], device="xla")].cpu()
    executor.clear_cache()
    hits = _counter("PersistentCacheHit")
    bad = x[torch.tensor([7], device="xla")]; here = sys._getframe().f_lineno  # noqa: E702
    with pytest.raises(IndexError) as ei:
        bad.cpu()
    assert _counter("PersistentCacheHit") == hits + 1
    assert f"(created at {__file__}:{here})" in _note(ei.value)


# ---- integer division by zero ---------------------------------------------------------------

def _division_cases(dev):
    a = torch.tensor([7, -7, 5, 0], device=dev)
    b = torch.tensor([2, 0, -3, 1], device=dev)
    return {
        "div_trunc": lambda: torch.div(a, b, rounding_mode="trunc"),
        "div_floor": lambda: torch.div(a, b, rounding_mode="floor"),
        "floordiv_operator": lambda: a // b,
        "floor_divide": lambda: torch.floor_divide(a, b),
        "mod_operator": lambda: a % b,
        "remainder": lambda: torch.remainder(a, b),
        "fmod": lambda: torch.fmod(a, b),
        "div_trunc_scalar": lambda: torch.div(a, 0, rounding_mode="trunc"),
        "div_floor_scalar": lambda: torch.div(a, 0, rounding_mode="floor"),
        "floordiv_scalar": lambda: a // 0,
        "mod_scalar": lambda: a % 0,
        "fmod_scalar": lambda: torch.fmod(a, 0),
        "rfloordiv": lambda: 5 // b,
        "rmod": lambda: 5 % b,
        "zero_dim_divisor": lambda: a % torch.tensor(0, device=dev),
        "int32": lambda: a.int() // b.int(),
        "uint8": lambda: torch.remainder(a.abs().to(torch.uint8), b.abs().to(torch.uint8)),
        "broadcast": lambda: a.reshape(4, 1) // b,
        "floor_divide_inplace": lambda: a.clone().floor_divide_(b),
        "remainder_inplace": lambda: a.clone().remainder_(b),
        "fmod_inplace": lambda: a.clone().fmod_(b),
        "div_inplace": lambda: a.clone().div_(b, rounding_mode="floor"),
    }


DIVISIONS = sorted(_division_cases("cpu"))


@pytest.mark.parametrize("name", DIVISIONS)
def test_integer_division_by_zero_raises_cpu_error_at_host_read(name):
    cerr = _cpu_error_of(_division_cases("cpu")[name])
    out = _division_cases("xla")[name]()   # the divisor is data: nothing raised while tracing
    with pytest.raises(Exception) as ei:
        out.cpu()
    assert type(ei.value) is type(cerr)
    assert str(ei.value) == str(cerr)
    assert "raised by aten::" in _note(ei.value) and f"{__file__}:" in _note(ei.value)


def test_division_error_surfaces_with_the_index_errors():
    """Both kinds are checks of one program, raised at the same points (here the next
    barrier, then wait_device_ops); a program failing both raises the first it lowered."""
    a = torch.tensor([4, 9], device="xla")
    q = a % torch.tensor([0, 2], device="xla")  # noqa: F841
    xm.mark_step()
    pjrt.wait_all_buffers()
    with pytest.raises(RuntimeError) as ei:
        xm.mark_step()
    assert str(ei.value) == "ZeroDivisionError"
    y = torch.arange(4.0, device="xla")[torch.tensor([9], device="xla")]  # noqa: F841
    q = a // torch.tensor([0, 2], device="xla")  # noqa: F841
    xm.mark_step()
    with pytest.raises(IndexError, match="index 9 is out of bounds"):
        xm.wait_device_ops()
    xm.wait_device_ops()  # nothing left to report


def _valid_divisions(dev):
    a = torch.tensor([7, -7, 5, -5, 0], device=dev)
    b = torch.tensor([2, 2, -3, -3, 4], device=dev)
    return [torch.div(a, b, rounding_mode="trunc"), torch.div(a, b, rounding_mode="floor"), a // b, a % b,
            torch.fmod(a, b), 7 // b, -7 % b, a.int() % b.int()]


def test_integer_division_with_nonzero_divisors_matches_cpu():
    for want, got in zip(_valid_divisions("cpu"), _valid_divisions("xla")):
        torch.testing.assert_close(got.cpu(), want)


def _by_zero_not_an_error(dev):
    f = torch.tensor([1.0, -1.0, 0.0, 2.5], device=dev)
    i = torch.tensor([1, -1, 0, 2], device=dev)
    z = torch.zeros(4, device=dev)
    return [f / 0, f // 0, f % 0, torch.fmod(f, 0), f // z, f % z, torch.fmod(f, z),
            torch.div(f, z, rounding_mode="trunc"), torch.div(f, z, rounding_mode="floor"),
            torch.div(i, torch.zeros(4, dtype=torch.long, device=dev)),  # true division of integers: a float
            i // z,  # an integer by a float zero: a float division
            torch.empty(0, dtype=torch.long, device=dev) // torch.tensor([0], device=dev),  # nothing computed
            torch.empty(2, 0, dtype=torch.long, device=dev) % torch.tensor([[0], [1]], device=dev)]


def test_float_division_by_zero_is_not_an_error():
    """inf and nan as on the CPU; an integer division computing no element checks nothing."""
    for want, got in zip(_by_zero_not_an_error("cpu"), _by_zero_not_an_error("xla")):
        torch.testing.assert_close(got.cpu(), want, equal_nan=True)
    xm.wait_device_ops()


def test_division_checks_off(monkeypatch):
    monkeypatch.setenv("XLA_CHECK_INDICES", "0")
    env_vars.reload()
    executor.clear_cache()
    try:
        a, b = torch.tensor([7, -7, 5]), torch.tensor([2, 0, -3])
        got = (a.to("xla") // b.to("xla")).cpu()   # no error: XLA's value where the divisor is 0
        want = a // torch.tensor([2, 1, -3])
        torch.testing.assert_close(got[[0, 2]], want[[0, 2]])
        xm.wait_device_ops()
    finally:
        monkeypatch.delenv("XLA_CHECK_INDICES")
        env_vars.reload()
        executor.clear_cache()


# ---- the last step before exit --------------------------------------------------------------

_LAST_STEP = """\
import atexit
import sys

atexit.register(lambda: print("handler registered before: ran", flush=True))
import torch
import torch_xla.core.xla_model as xm

case, log = sys.argv[1], open(sys.argv[2], "w")  # left open: the exit flushes it
x = torch.arange(4.0, device="xla")
a = torch.tensor([5, 6], device="xla")
for step in range(3):
    last = step == 2
    i = torch.tensor([7 if last and case == "index" else 1], device="xla")
    d = torch.tensor([0 if last and case == "division" else 2, 3], device="xla")
    y = x[i] + 1  # INDEX
    q = a // d  # DIVISION
    xm.mark_step()
    if step == 0:
        atexit.register(lambda: print("handler registered after: ran", flush=True))
log.write("the last step ran")
print("main: done", flush=True)
"""


@pytest.mark.parametrize("case", ["index", "division", "none"])
def test_error_of_the_last_step_is_reported_at_exit(tmp_path, case):
    script = tmp_path / "last_step.py"
    script.write_text(_LAST_STEP)
    log = tmp_path / "log.txt"
    r = subprocess.run([sys.executable, str(script), case, str(log)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PJRT_DEVICE="CPU"))
    # the program ran to its end and every exit handler ran once, the failing check or not
    assert r.stdout.splitlines() == ["main: done", "handler registered after: ran", "handler registered before: ran"], \
        r.stdout + r.stderr[-3000:]
    assert log.read_text() == "the last step ran"
    if case == "none":
        assert r.returncode == 0, r.stderr[-3000:]
        assert "device-side check" not in r.stderr
        return
    if case == "index":
        cerr = _cpu_error_of(lambda: torch.arange(4.0)[torch.tensor([7])] + 1)
        op, marker = "aten::index.Tensor", "# INDEX"
    else:
        cerr = _cpu_error_of(lambda: torch.tensor([5, 6]) // torch.tensor([0, 3]))
        op, marker = "aten::floor_divide", "# DIVISION"
    line = 1 + next(k for k, text in enumerate(_LAST_STEP.splitlines()) if text.endswith(marker))
    assert r.returncode != 0
    assert f"\n{type(cerr).__name__}: {cerr}\n" in r.stderr, r.stderr[-3000:]
    assert f"raised by {op} (created at {script}:{line})" in r.stderr, r.stderr[-3000:]
