"""The lazy engine: graph cache, parameters, donation, IR/HLO dumps, RNG, metrics, saving."""
import os
import subprocess
import sys

import pytest
import torch

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr
from torch_xla import _XLAC
from torch_xla._engine.tensor import state_of

from helpers import assert_same


def compiles():
    d = met.metric_data("CompileTime")
    return d[0] if d else 0


def test_same_graph_compiles_once():
    y = torch.randn(8, 8)
    yd = y.to("xla:0")
    zc = torch.zeros(8, 8)
    zd = zc.to("xla:0")
    xm.mark_step()
    before = None
    for i in range(4):
        zd = zd * 0.5 + yd
        zc = zc * 0.5 + y
        xm.mark_step()
        if i == 1:
            before = compiles()
    assert compiles() == before
    assert_same(zd, zc)


def test_changing_python_scalar_does_not_recompile():
    x = torch.randn(5).to("xla:0")
    xm.mark_step()
    outs = []
    for i, lr in enumerate([0.1, 0.2, 0.3, 0.4]):
        outs.append(x * lr + lr)
        xm.mark_step()
        if i == 1:
            before = compiles()
    assert compiles() == before
    for o, lr in zip(outs, [0.1, 0.2, 0.3, 0.4]):
        assert_same(o, x.cpu() * lr + lr)


def test_operand_binding_is_part_of_the_key():
    a = torch.tensor([1.0, 2.0]).to("xla:0")
    b = torch.tensor([10.0, 20.0]).to("xla:0")
    xm.mark_step()
    r1 = a + a
    xm.mark_step()
    r2 = a + b
    xm.mark_step()
    assert r1.tolist() == [2.0, 4.0]
    assert r2.tolist() == [11.0, 22.0]


def test_static_args_with_colliding_python_hashes_get_their_own_graphs():
    # hash(-1) == hash(-2) and 2 == 2.0 in Python: the graph cache must still tell
    # x.sum(-1) from x.sum(-2), and an int tensor's pow(2) from pow(2.0).
    x = torch.randn(5, 5)
    xx = x.to(xm.xla_device())
    for dim in (-1, -2, -1):
        assert_same(xx.sum(dim).cpu(), x.sum(dim))
        assert_same(xx.softmax(dim).cpu(), x.softmax(dim))
    i = torch.arange(6).reshape(2, 3)
    ii = i.to(xm.xla_device())
    for e in (2, 2.0, True, 1):
        r = ii.pow(e).cpu()
        assert r.dtype == i.pow(e).dtype
        assert_same(r, i.pow(e))


def test_pow_scalar_exponents_match_cpu_edge_cases():
    # Exponents that are part of the program: the ones the CPU kernel computes by other
    # functions (sqrt, rsqrt, products, reciprocals) keep its edge cases.
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -2.5, 1e-30, 3e10, 0.7])
    for e in (2, 2.0, 3, 0.5, -0.5, -1, -2.0, 0, 1, 1.7, -3.3, 4.0):
        got = x.to(xm.xla_device()).pow(e).cpu()
        torch.testing.assert_close(got, x.pow(e), equal_nan=True, rtol=3e-6, atol=0)
        a = x[5:].clone().requires_grad_()
        b = x[5:].to(xm.xla_device()).requires_grad_()
        a.pow(e).sum().backward()
        b.pow(e).sum().backward()
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_overwritten_parameter_buffer_is_donated_and_values_stay_right():
    w = torch.randn(64, 64)
    g = torch.randn(64, 64)
    wd, gd = w.to("xla:0"), g.to("xla:0")
    xm.mark_step()
    old = state_of(wd).node.array
    with torch.no_grad():
        wd.add_(gd, alpha=-0.1)
    xm.mark_step()
    assert old.is_deleted()
    assert_same(wd, w - 0.1 * g)
    # A buffer still read by a live tensor is not donated.
    keep = gd.view(-1)
    with torch.no_grad():
        gd.mul_(3)
    xm.mark_step()
    assert_same(gd, g * 3)
    assert_same(keep, g.view(-1) * 3)


def test_ir_and_hlo_dumps():
    a = torch.randn(2, 3).to("xla:0")
    b = (a * 2 + 1).relu()
    text = _XLAC._get_xla_tensors_text([b])
    assert "aten::mul" in text and "xla::device_data" in text and "ROOT" in text
    hlo = _XLAC._get_xla_tensors_hlo([b])
    assert "HloModule" in hlo and "ENTRY" in hlo and "maximum" in hlo
    shlo = xm.get_stablehlo([b])
    assert "stablehlo" in shlo and "func.func public @main" in shlo
    assert isinstance(xm.get_stablehlo_bytecode([b]), bytes)
    assert_same(b, (a.cpu() * 2 + 1).relu())


def test_ir_text_lists_compiled_in_scalars_as_constants():
    """pow's exponent and the special scalars are compiled in: the IR text lists them
    first as prim::Constant operands; other numbers are graph parameters (device data)."""
    a = torch.tensor([2.0, 3.0]).to("xla:0")
    p = torch.pow(a, 5)
    lines = _XLAC._get_xla_tensors_text([p]).splitlines()
    assert "f32[] prim::Constant(), value=5" in lines[1] and "xla::device_data" not in lines[1]
    assert "aten::pow.Tensor_Scalar(%1, %0)" in lines[3]
    q = a * 2.5 + 1
    text = _XLAC._get_xla_tensors_text([q])
    assert "scalar=2.5" in text and "prim::Constant(), value=1" in text
    assert_same(p, torch.tensor([2.0, 3.0]) ** 5)
    assert_same(q, torch.tensor([2.0, 3.0]) * 2.5 + 1)


def test_lowering_context_module_text_json_and_parameters():
    """`_XLAC.lowering.LoweringContext`: the module as XLA's HloModuleProto (serialized,
    protobuf text, protobuf JSON) under the given name, and the values bound to its
    parameters (on the device without a transfer, or as CPU copies)."""
    import json
    from torch_xla.debug import metrics as met
    a_cpu, b_cpu = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[4.0], [5.0]])
    a, b = a_cpu.to("xla:0"), b_cpu.to("xla:0")
    r = (a + b) * 2.5
    ctx = _XLAC.lowering.LoweringContext("MyModule")
    ctx.build([r])
    assert isinstance(ctx.hlo(), bytes)
    text = ctx.hlo_text()
    assert text.startswith('name: "MyModule"\n')
    assert text.count('opcode: "parameter"') == 3 and 'opcode: "add"' in text and 'opcode: "multiply"' in text
    js = json.loads(ctx.hlo_json())
    params = js["hostProgramShape"]["parameters"]
    assert [p["dimensions"] for p in params[:2]] == [["3"], ["2", "1"]] and params[0]["elementType"] == "F32"
    met.clear_all()
    dev = ctx.device_parameter_id_tensor_mapping()
    assert not met.metric_data("TransferFromDeviceTime")
    host = ctx.parameter_id_tensor_mapping()
    assert met.metric_data("TransferFromDeviceTime")
    assert sorted(host) == sorted(dev) == [0, 1, 2]
    assert_same(host[0], a_cpu)
    assert_same(host[1], b_cpu)
    assert float(host[2]) == 2.5 and dev[0].device.type == "xla"
    assert_same(r, (a_cpu + b_cpu) * 2.5)


def test_metrics_report_format():
    met.clear_all()
    x = torch.randn(3, 3).to("xla:0")
    y = (x @ x).relu()
    y.cpu()
    rep = met.metrics_report()
    for name in ("CompileTime", "ExecuteTime", "TransferToDeviceTime", "TransferFromDeviceTime"):
        assert f"Metric: {name}" in rep
    assert "TotalSamples:" in rep and "Accumulator:" in rep and "Percentiles: 1%=" in rep
    assert "Counter: UncachedCompile" in rep
    assert met.counter_value("UncachedCompile") >= 1
    assert "CompileTime" in met.metric_names()
    total, acc, samples = met.metric_data("CompileTime")
    assert total == len(samples) and acc > 0
    assert _XLAC._xla_metrics_report() == met.metrics_report()
    short = met.short_metrics_report()
    assert "CompileTime" in short
    met.clear_all()
    assert met.counter_names() == [] and met.metric_names() == []


def test_fallback_is_counted_and_correct():
    met.clear_all()
    x = torch.tensor([0.0, 1.0, 0.0, 2.0]).to("xla:0")
    nz = torch.nonzero(x)
    assert met.counter_value("aten::nonzero") == 1
    assert_same(nz, torch.nonzero(x.cpu()))


def test_rng_seed_reproducible_and_no_recompile():
    torch_xla.manual_seed(7)
    a = torch.rand(4, device="xla:0")
    xm.mark_step()
    torch_xla.manual_seed(7)
    b = torch.rand(4, device="xla:0")
    xm.mark_step()
    assert torch.equal(a.cpu(), b.cpu())
    c = torch.rand(4, device="xla:0")
    xm.mark_step()
    assert not torch.equal(a.cpu(), c.cpu())
    xm.set_rng_state(123)
    assert xm.get_rng_state() == 123
    before = compiles()
    for _ in range(3):
        torch.rand(4, device="xla:0")
        xm.mark_step()
    assert compiles() == before


@pytest.mark.parametrize("eager", [False, True])
def test_rng_state_restored_continues_after_drawn_numbers(eager):
    """get_rng_state after a draw, then set_rng_state of it, replays what follows the draw
    (as torch's CPU generator does), in lazy and eager mode."""
    from torch_xla.experimental.eager import eager_mode_context

    def pattern(draw, get, put):
        put(get())
        a = draw()
        s = get()
        b = draw()
        put(s)
        c = draw()
        return torch.equal(a, b), torch.equal(b, c)

    cpu = pattern(lambda: torch.randn(6), torch.get_rng_state, torch.set_rng_state)
    xm.set_rng_state(1234)
    with eager_mode_context(eager):
        dev = pattern(lambda: torch.randn(6, device="xla:0").cpu(), xm.get_rng_state, xm.set_rng_state)
        assert xm.get_rng_state() != 1234    # the draws advanced the state
    assert dev == cpu == (False, True)


def test_get_rng_state_changes_nothing():
    """Reading the state between two draws leaves the second draw as it is without the
    read (as torch's CPU getter does)."""
    def draws(read):
        xm.set_rng_state(77)
        a = torch.rand(4, device="xla:0")
        if read:
            xm.get_rng_state()
        b = torch.rand(4, device="xla:0")
        return torch.cat([a, b]).cpu()
    assert torch.equal(draws(False), draws(True))


def test_torch_checkpoint_replays_dropout_after_earlier_draws():
    """torch.utils.checkpoint saves the device generator's state before the forward and
    restores it for the recomputation: the dropout mask recomputed in the backward is the
    forward's, even when random ops drew earlier in the step (as on the CPU). With x all
    ones, d(sum z)/dx equals z exactly when the two masks agree."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    def grad_is_output(device):
        torch.manual_seed(3)
        torch_xla.manual_seed(3)
        x = torch.ones(16, 32, device=device, requires_grad=True)
        y = F.dropout(x, 0.5)                          # an earlier draw in the same step
        z = checkpoint(lambda t: F.dropout(t * 2, 0.5) * 3, y, use_reentrant=False)
        z.sum().backward()
        return torch.equal(x.grad.cpu(), z.detach().cpu())

    assert grad_is_output("xla:0") == grad_is_output("cpu") is True


def test_step_closures_run_after_barrier_in_order():
    seen = []
    x = torch.ones(2).to("xla:0") * 3
    xm.add_step_closure(lambda t: seen.append(("a", t.tolist())), args=(x,))
    xm.add_step_closure(lambda: seen.append(("b", None)))
    assert seen == []
    xm.mark_step()
    assert seen == [("a", [3.0, 3.0]), ("b", None)]


def test_step_context_and_compile_full_graph():
    w = torch.randn(4).to("xla:0")
    with torch_xla.step():
        y = w * 2
    assert state_of(y).is_data

    def step_fn(t):
        return (t * 3).sum()

    f = torch_xla.compile(step_fn, full_graph=True, name="f")
    assert_same(f(w), (w.cpu() * 3).sum())

    def bad(t):
        s = (t * 3).sum()
        return s * s.item()

    with pytest.raises(RuntimeError, match="full_graph"):
        torch_xla.compile(bad, full_graph=True)(w)


def test_xm_save_moves_to_cpu_and_is_atomic(tmp_path):
    path = tmp_path / "ck.pt"
    data = {"w": torch.arange(4.0).to("xla:0"), "n": 3}
    xm.save(data, str(path))
    loaded = torch.load(str(path))
    assert loaded["w"].device.type == "cpu" and loaded["w"].tolist() == [0.0, 1.0, 2.0, 3.0]

    class Boom:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        xm.save({"w": torch.zeros(2).to("xla:0"), "bad": Boom()}, str(path))
    # The earlier checkpoint is intact and no temporary file is left behind.
    assert torch.load(str(path))["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert os.listdir(tmp_path) == ["ck.pt"]


def test_runtime_queries_single_process():
    assert xr.world_size() == 1
    assert xr.global_ordinal() == 0 and xr.local_ordinal() == 0
    assert xr.device_type() == "CPU"
    assert xm.xla_device_hw(xm.xla_device()) == "CPU"
    assert torch_xla.device() == torch.device("xla:0")
    assert torch_xla.devices()[0] == torch.device("xla:0")
    assert torch_xla.device_count() >= 1
    assert xm.is_master_ordinal() and xm.is_master_ordinal(local=False)
    assert xm.get_ordinal() == 0
    with pytest.warns(DeprecationWarning):
        assert xm.xrt_world_size() == 1
    info = xm.get_memory_info(xm.xla_device())
    assert info["bytes_limit"] > 0 and info["bytes_used"] >= 0
    xm.wait_device_ops()


def test_single_process_collectives_and_mesh_reduce():
    x = torch.arange(3.0).to("xla:0")
    assert_same(xm.all_reduce(xm.REDUCE_SUM, x, scale=2.0), torch.arange(3.0) * 2)
    assert xm.rendezvous("t", b"hi") == [b"hi"]
    assert xm.mesh_reduce("acc", 3.5, lambda v: sum(v) / len(v)) == 3.5
    assert_same(xm.all_gather(x), torch.arange(3.0))


def test_launch_debug_single_process():
    got = []
    torch_xla.launch(lambda i, a: got.append((i, a)), args=("x",), debug_single_process=True)
    assert got == [(0, "x")]


def test_eager_mode_runs_each_op():
    from torch_xla.experimental import eager_mode
    eager_mode(True)
    try:
        a = torch.ones(3).to("xla:0")
        b = a + 1
        assert state_of(b).is_data
        xm.optimization_barrier_([b])            # an engine op runs at once too
        assert state_of(b).is_data
        assert_same(b, torch.full((3,), 2.0))
        f = torch_xla.compile(lambda t: t * 2 + 1)
        assert_same(f(b), torch.full((3,), 5.0))
    finally:
        eager_mode(False)
    c = torch.ones(3).to("xla:0") + 1
    assert not state_of(c).is_data


def test_partial_sync_does_not_donate_buffers_other_pending_graphs_read():
    a0 = torch.randn(3)
    a = a0.to("xla:0")
    b = a * 2
    c = b + 1
    d = b * 3
    del a, b
    assert_same(c, a0 * 2 + 1)
    assert_same(d, a0 * 6)


def test_none_outputs_of_backward_ops():
    conv = torch.nn.Conv2d(2, 3, 3, bias=False)
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    xc = conv(x).sum()
    gx, gw = torch.autograd.grad(xc, (x, conv.weight))
    convd = torch.nn.Conv2d(2, 3, 3, bias=False).to("xla:0")
    with torch.no_grad():
        convd.weight.copy_(conv.weight.to("xla:0"))
    xd = x.detach().to("xla:0").requires_grad_()
    gxd, gwd = torch.autograd.grad(convd(xd).sum(), (xd, convd.weight))
    assert_same(gxd, gx, rtol=1e-5, atol=1e-5)
    assert_same(gwd, gw, rtol=1e-5, atol=1e-5)


def test_attention_sized_batched_matmul_compiles_without_ynnpack_fusions(monkeypatch):
    # The CPU policy's compiler_options: without AVX-512, programs with a large batched
    # matrix product that XLA computes are compiled without XLA:CPU's YNNPACK fusions
    # (measured faster); with AVX-512, or when the BLAS handler computes the (float32)
    # product, they keep them. Values stay the CPU's either way.
    from torch_xla._engine import executor, ir
    from torch_xla._engine.platform import cpu
    from torch_xla._engine.platform.base import ALL_PRODUCTS
    from torch_xla._engine.tensor import pending
    a, b = torch.randn(8, 512, 64), torch.randn(8, 64, 1024)
    small = (a[:, :4] @ b[:, :, :4]).softmax(-1)
    big = (a.to(xm.xla_device()) @ b.to(xm.xla_device())).softmax(-1)
    roots = [(s.node, s.idx) for s in pending.take_live() if type(s.node) is not ir.DeviceData]
    graph = executor.Graph(roots)
    if "xla_cpu_experimental_ynn_fusion_type" not in os.environ.get("XLA_FLAGS", ""):
        monkeypatch.setattr(cpu, "_HOST_CPU_FLAGS", frozenset({"avx2", "fma"}))
        assert cpu.compiler_options(graph.op_avals()) == {"xla_cpu_experimental_ynn_fusion_type": ""}
        assert cpu.compiler_options(graph.op_avals(), library_products=ALL_PRODUCTS) == {}
        monkeypatch.setattr(cpu, "_HOST_CPU_FLAGS", frozenset({"avx2", "fma", "avx512f"}))
        assert cpu.compiler_options(graph.op_avals()) == {}
        monkeypatch.undo()
    del graph
    xa, xb = a[:, :4].to(xm.xla_device()), b[:, :, :4].to(xm.xla_device())
    xsmall = (xa @ xb).softmax(-1)
    roots = [(s.node, s.idx) for s in pending.take_live() if type(s.node) is not ir.DeviceData]
    assert cpu.compiler_options(executor.Graph(roots).op_avals()) == {}
    assert_same(big.cpu(), (a @ b).softmax(-1), rtol=1e-5, atol=1e-6)
    assert_same(xsmall.cpu(), small, rtol=1e-5, atol=1e-6)


_RESIDENT_SCRIPT = r"""
import resource, sys, torch, torch_xla
import torch_xla.core.xla_model as xm
from torch_xla._engine.executor import compile as compiling
from torch_xla._engine.platform import host_memory

def large(t):
    e = torch.exp(t * 0.5)
    return e.sum(0) + (e @ e[:64].t()).sum(0).mean(), e.cumsum(1)[:, -1]

def pieces(t):
    e = torch.exp(t * 0.5)
    m1 = e @ e.t() * 1e-3
    m2 = m1 @ e * 1e-3
    c = e.cumsum(1)
    return (m2 + c).sum(0), m1.sum(0) + c[:, -1]

f = {"large": large, "pieces": pieces}[sys.argv[1]]
x = torch.randn(2048, int(sys.argv[2]))
xd = x.to(xm.xla_device())
want = f(x)
faults, err = [], 0.0
for run in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    got = f(xd)
    xm.mark_step()
    got = [g.cpu() for g in got]
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    err = max(err, *[((g - w).abs() / (w.abs() + 1)).max().item() for g, w in zip(got, want)])
temp = max(host_memory.temp_bytes(e.compiled) for es in compiling._cache.values() for e in es)
print(host_memory.active(), host_memory.mode().replace(" ", "_"), host_memory.temp_piece_bytes(), temp, err,
      faults)
"""


def _resident_runs(tmp_path, program: str, columns: int, env: dict):
    """Runs `program` of _RESIDENT_SCRIPT eight times in a fresh process with `env`:
    (active, mode, piece bytes, temporary bytes, max relative error vs CPU, page faults per run)."""
    script = tmp_path / "resident.py"
    script.write_text(_RESIDENT_SCRIPT)
    out = subprocess.run([sys.executable, str(script), program, str(columns)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    active, mode, piece, temp, err, faults = out.stdout.strip().splitlines()[-1].split(" ", 5)
    return (active == "True", mode, int(piece), int(temp), float(err),
            [int(f) for f in faults.strip("[]").split(",")])


def test_large_programs_reuse_resident_host_memory(tmp_path):
    # host_memory: on CPU the C heap keeps freed buffers, so a program with a large
    # temporary buffer does not page-fault it in again at every execution; values are
    # those of the CPU, run after run. A fresh process: the allocator is set up before
    # jax's CPU client starts (a client started earlier leaves glibc as it is).
    from torch_xla._engine.platform import host_memory
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("PT_XLA_RETAIN_HOST_MEMORY", None)
    active, _, _, temp, err, faults = _resident_runs(tmp_path, "large", 8192, env)
    assert active
    assert err < 1e-4
    assert temp >= host_memory.LARGE_TEMP_BYTES
    # Without retention every run faults its whole temporary buffer in (one fault per
    # 4 KiB page: ~35,000 here). Retained, the heap settles within the first runs (a small
    # allocation may take the start of a freed buffer, which then no longer fits there),
    # then runs touch only resident pages (on a loaded machine settling took up to four
    # runs): the last three together fault less than half a buffer's pages.
    assert sum(faults[-3:]) < temp // 4096 // 2, (faults, temp)


def test_per_thread_arenas_keep_a_large_temporary_buffer_in_pieces(tmp_path):
    # PT_XLA_RETAIN_HOST_MEMORY=threads: an arena per thread, whose heaps hold at most
    # 64 MiB; the program's ~90 MiB temporary buffer (buffers of 16-24 MiB) is compiled
    # in pieces that fit, so it stays resident from run to run like one arena's, with the
    # CPU's values.
    from torch_xla._engine.platform import host_memory
    env = dict(os.environ, PJRT_DEVICE="CPU", PT_XLA_RETAIN_HOST_MEMORY="threads")
    env.pop("XLA_FLAGS", None)
    _, mode, piece, temp, err, faults = _resident_runs(tmp_path, "pieces", 3072, env)
    assert (mode, piece) == ("per_thread", host_memory.TEMP_PIECE_BYTES)
    assert err < 1e-4
    assert temp >= host_memory.LARGE_TEMP_BYTES
    # In one piece (an arena per thread without the cut) every run faults the whole
    # buffer in again (~23,000 faults here); in pieces the heaps settle within a few runs.
    assert sum(faults[-3:]) < temp // 4096 // 2, (faults, temp)


_UNKEPT_SCRIPT = r"""
import torch, torch_xla
x = torch.randn(4096, 4200)   # 65.6 MiB: over a per-thread heap's 64 MiB
xd = x.to(torch_xla.device())
got = [((xd * 2).exp().sum(0)).cpu(), ((xd + 1).abs().sum(1)).cpu()]   # two programs
want = [(x * 2).exp().sum(0), (x + 1).abs().sum(1)]
print(all(torch.allclose(g, w, rtol=1e-4) for g, w in zip(got, want)))
"""


@pytest.mark.parametrize("setting, warns", [("threads", True), ("1", False)])
def test_per_thread_arenas_warn_once_of_an_array_they_cannot_keep(setting, warns):
    # With PT_XLA_RETAIN_HOST_MEMORY=threads a buffer over 64 MiB is mapped afresh at every
    # run: the first program that has such an array says so, once per process, and the
    # values are the CPU's; the default keeps it resident and says nothing.
    env = dict(os.environ, PJRT_DEVICE="CPU", PT_XLA_RETAIN_HOST_MEMORY=setting)
    out = subprocess.run([sys.executable, "-c", _UNKEPT_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True"
    said = out.stderr.count("an arena per thread cannot keep a buffer over 64 MiB")
    assert said == (1 if warns else 0), out.stderr
    if warns:
        assert "PT_XLA_RETAIN_HOST_MEMORY=threads, and a program has an array of 66 MiB" in out.stderr


@pytest.fixture
def retain_host_memory(monkeypatch):
    """Sets PT_XLA_RETAIN_HOST_MEMORY (None: unset) for the test's reads of it."""
    from torch_xla._engine import env_vars

    def set_to(raw):
        if raw is None:
            monkeypatch.delenv("PT_XLA_RETAIN_HOST_MEMORY", raising=False)
        else:
            monkeypatch.setenv("PT_XLA_RETAIN_HOST_MEMORY", raw)
        env_vars.reload()
    yield set_to
    monkeypatch.undo()
    env_vars.reload()


@pytest.mark.parametrize("raw, mode", [(None, "one arena"), ("1", "one arena"), ("threads", "per thread"),
                                       ("0", "off"), ("false", "off"), (" Threads ", "per thread"),
                                       ("", "one arena")])
def test_host_memory_mode_follows_the_variable(retain_host_memory, raw, mode):
    from torch_xla._engine import patches
    from torch_xla._engine.platform import host_memory
    retain_host_memory(raw)
    assert host_memory.mode() == mode
    assert patches.enabled("retain_host_memory") is (mode != "off")


def test_host_memory_mode_refuses_an_unknown_value(retain_host_memory):
    from torch_xla._engine.platform import host_memory
    retain_host_memory("per-thread")
    with pytest.raises(ValueError, match="PT_XLA_RETAIN_HOST_MEMORY='per-thread' is not one of 1, threads, 0"):
        host_memory.mode()


def test_host_memory_retention_can_be_turned_off():
    env = dict(os.environ, PT_XLA_RETAIN_HOST_MEMORY="0", PJRT_DEVICE="CPU")
    code = ("import torch, torch_xla; from torch_xla._engine.platform import host_memory;"
            "(torch.ones(2, device=torch_xla.device()) + 1).cpu(); print(host_memory.active())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


_FIRST_OPS_SCRIPT = r"""
import sys, torch, torch_xla
dev = torch_xla.device()
a = torch.arange(6.0).reshape(2, 3)
b = torch.tensor([1.0, -2.0, 3.0])
# Shape inference runs PyTorch's Python meta kernels; they must not drag in torch._dynamo.
x = (a.to(dev) + b.to(dev)) * 2 - b.to(dev).abs()
got1 = x.cpu()
print("dynamo_after_first_ops", "torch._dynamo" in sys.modules)
assert torch.equal(got1, (a + b) * 2 - b.abs())
import torch._dynamo  # what torch.optim or torch.compile would do
y = torch.where(a.to(dev) > 2, a.to(dev), b.to(dev).sub(1)).div(3)
assert torch.allclose(y.cpu(), torch.where(a > 2, a, b.sub(1)).div(3))
opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(3, device=dev))], lr=0.1)
opt.param_groups[0]["params"][0].grad = b.to(dev)
opt.step()
assert torch.allclose(opt.param_groups[0]["params"][0].cpu(), torch.ones(3) - 0.1 * b)
print("ok")
"""


def test_first_ops_do_not_import_dynamo(tmp_path):
    # A script without torch.optim or torch.compile does not pay for importing
    # torch._dynamo (seconds) on its first op; once something imports it, PyTorch's own
    # wrappers take over and values still match the CPU's.
    script = tmp_path / "first_ops.py"
    script.write_text(_FIRST_OPS_SCRIPT)
    env = dict(os.environ, PJRT_DEVICE="CPU")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "dynamo_after_first_ops False" in lines, out.stdout
    assert lines[-1] == "ok", out.stdout


def test_dynamo_stand_in_hands_over_once_dynamo_is_imported():
    import torch._dynamo  # noqa: F401
    from torch_xla._engine import process_patches

    def double(x):
        return x * 2

    wrapped = torch._disable_dynamo(double)
    stand_in = process_patches._UntilDynamo(double, True)
    setattr(double, "__dynamo_disable", stand_in)
    assert wrapped(torch.tensor([1.0, 2.0])).tolist() == [2.0, 4.0]
    real = getattr(double, "__dynamo_disable")
    assert real is not stand_in and callable(real)
    assert wrapped(torch.tensor([3.0])).tolist() == [6.0]
    assert getattr(double, "__dynamo_disable") is real  # built once, not per call


def test_cpu_fallback_of_a_lowered_op_passes_keyword_only_arguments_by_name():
    # A lowered op whose shape entry falls back to the CPU gets its arguments in schema
    # order; the keyword-only ones (scatter_reduce's include_self) go to the op by name.
    from torch_xla._engine.kernels import KERNELS
    k = KERNELS["scatter_reduce.two"]
    assert k.kwarg_only == ("include_self",)
    src = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    index = torch.tensor([[0, 1, 0], [1, 0, 1]])
    base = torch.full((2, 3), 10.0)
    want = base.scatter_reduce(0, index, src, "amax", include_self=False)
    dev = xm.xla_device()
    inner = [torch._from_functional_tensor(t.to(dev)) for t in (base, index, src)]
    out = k._fallback([inner[0], 0, inner[1], inner[2], "amax", False])
    assert torch.equal(out.cpu(), want)


def test_stream_synchronize_from_another_thread_leaves_pending_operations_alone():
    # torch.distributed.checkpoint's writer waits on the device stream from its own thread
    # while training goes on: the wait must not run (and donate the buffers of) operations
    # the training thread is still recording.
    import threading
    dev = torch_xla.device()
    w = torch.arange(8, dtype=torch.float32, device=dev)
    torch_xla.sync()
    with torch.no_grad():
        w.add_(1.0)
    met.clear_all()
    t = threading.Thread(target=lambda: torch.xla.current_stream().synchronize())
    t.start()
    t.join()
    assert met.metric_data("ExecuteTime") is None or met.metric_data("ExecuteTime")[0] == 0
    with torch.no_grad():
        w.add_(1.0)
    torch_xla.sync()
    torch.testing.assert_close(w.cpu(), torch.arange(8, dtype=torch.float32) + 2)
