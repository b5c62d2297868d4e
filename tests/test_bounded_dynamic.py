"""Bounded dynamic shapes (`XLA_EXPERIMENTAL`): nonzero / masked_select / nms results stay on
the device with symbolic sizes, compared with eager PyTorch on the CPU.

The switch is read at import, so the device side runs in one child process with it set
(this file run as a script prints its observations as JSON); the tests compare them with
the CPU here. Without the switch (this process) nonzero keeps its static result.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

SWITCH = "nonzero:masked_select:masked_scatter:nms"


def _nms_cpu(boxes, scores, thr):
    """Greedy non-maximum suppression on the CPU (torchvision's definition)."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    keep = []
    for i in order:
        ok = True
        for j in keep:
            a, b = boxes[i], boxes[j]
            iw = max(0.0, float(min(a[2], b[2]) - max(a[0], b[0])))
            ih = max(0.0, float(min(a[3], b[3]) - max(a[1], b[1])))
            inter = iw * ih
            union = float((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1])) - inter
            if inter / union > thr:
                ok = False
                break
        if ok:
            keep.append(i)
    return keep


def _train_weight() -> torch.Tensor:
    return torch.linspace(-1, 1, 48).view(6, 8)


def _train_batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 8, generator=g), torch.rand(6, 8, generator=g) > p) for p in (0.2, 0.5, 0.35, 0.8)]


def _child() -> dict:
    """The device side, with the switch on: observations as JSON-able values."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    from torch_xla._engine import telemetry
    from torch_xla._engine.kernels import bounded

    out = {}
    dev = torch_xla.device()

    def shape(t):
        return [[str(s) for s in t.shape], [type(s).__name__ for s in t.shape]]

    def raises(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (the type is the observation)
            return type(e).__name__
        return None

    a = torch.tensor([[1, 0, 0, 5, 0, 6], [1, 3, 2, 0, 0, 1]])
    nz = torch.nonzero(a.to(dev))
    out["nonzero"] = {"shape": shape(nz), "real": [int(s) for s in nz.shape], "value": nz.cpu().tolist(),
                      "text": torch_xla._XLAC._get_xla_tensors_text([nz]),
                      "dim_size": torch_xla._XLAC._get_xla_tensor_dimension_size(nz, 0).item()}

    x = torch.tensor([1, 0, 3, 5, 0, 6])
    n = torch.nonzero(x.to(dev))
    ones = torch.ones(1, 2, device=dev)
    out["ops"] = {
        "expand": [shape(ones.expand(nz.shape[0], 2)), ones.expand(nz.shape[0], 2).cpu().tolist()],
        "unsqueeze": [shape(nz.unsqueeze(0)), nz.unsqueeze(0).cpu().tolist()],
        "t": [shape(nz.t()), nz.t().cpu().tolist()],
        "clone": [shape(n.clone()), n.clone().cpu().tolist()],
        "abs": [shape(torch.abs(n - 3)), torch.abs(n - 3).cpu().tolist()],
        "add": [shape(nz + torch.tensor([[1, 10]], device=dev)),
                (nz + torch.tensor([[1, 10]], device=dev)).cpu().tolist()],
        "empty": shape(torch.empty(nz.shape, dtype=torch.int32, device=dev)),
        "view_static": [shape(torch.ones(2, 3, device=dev).view(torch.nonzero(torch.ones(6, device=dev)).shape[0])),
                        torch.ones(2, 3, device=dev).view(torch.nonzero(torch.ones(6, device=dev)).shape[0]).cpu()
                        .tolist()],
        "float": nz.float().cpu().tolist(),
    }
    rows, cols = torch.nonzero(a.to(dev), as_tuple=True)
    out["as_tuple"] = [shape(rows), rows.cpu().tolist(), cols.cpu().tolist()]
    out["repr"] = repr(nz)
    w = torch.arange(6., device=dev).requires_grad_()
    picked = torch.masked_select(w, w > 2.5)
    (picked * picked).sum().backward()
    out["grad"] = w.grad.cpu().tolist()
    r = torch.arange(nz.shape[0], device=dev)
    col = nz[:, 0] + r
    out["factories"] = {"arange_plus_column": [shape(col), col.cpu().tolist()],
                        "new_zeros": shape(ones.new_zeros(nz.shape[0])),
                        "full": [shape(torch.full((nz.shape[0],), 2.0, device=dev)),
                                 torch.full((nz.shape[0],), 2.0, device=dev).cpu().tolist()]}
    f = torch.nonzero(x.to(dev))
    f.fill_(7)
    out["ops"]["fill_"] = [shape(f), f.cpu().tolist()]

    other = torch.nonzero(torch.tensor([[1]], device=dev))
    out["errors"] = {
        "add_static_mismatch": raises(lambda: nz + torch.ones(2, 2, dtype=torch.int64, device=dev)),
        "add_two_dynamic": raises(lambda: nz + other),
        "add_same_bound_other_value": raises(lambda: nz + torch.nonzero(a.to(dev))),
        "add_itself": raises(lambda: nz + nz),
        "view_dynamic_to_static": raises(lambda: n.view(2, 2)),
        "view_static_bound_mismatch": raises(lambda: torch.ones(2, 2, device=dev).view(n.shape[0])),
        "view_real_mismatch": raises(lambda: torch.ones(2, 3, device=dev).view(n.shape[0])),
    }

    z = torch.zeros(5, 2)
    z[3, 0] = 1
    d = torch.nonzero(z.to(dev))
    met.clear_all()
    s0, s1 = d.shape[0], d.shape[1]
    out["sizes"] = {"add": [str(s0 + s1), int(s0 + s1)], "sub": [str(s0 - s1), int(s0 - s1)],
                    "mul": [str(s0 * 3), int(s0 * 3)], "mod": int(s0 % s1),
                    "ge": int(s0 >= s1), "lt": int(s0 < s1), "ne": int(s0 != s1),
                    "max": int(torch.sym_max(s0, s1)), "min": int(torch.sym_min(s0, s1)),
                    "wrap": type(s0 + 3).__name__,
                    "counters": {k: met.counter_value("xla::size_" + k) for k in ("add", "sub", "mod", "ge", "lt",
                                                                                "ne", "sym_max", "sym_min")}}
    t4 = torch.ones(1, device=dev).expand(d.shape[0] + d.shape[1])
    out["sizes"]["expand_of_sum"] = [shape(t4), t4.cpu().tolist()]

    met.clear_all()
    same = torch.nonzero(x.to(dev))
    equal = bool(same.shape[0] == same.shape[0])
    made = [same.unsqueeze(0), same.t(), torch.ones(1, 1, device=dev).expand(3, same.shape[0], 2)]
    out["identical"] = {"equal": equal, "compiles": met.metric_data("CompileTime"),
                        "reads": met.counter_value("BoundedSizeRead"), "numel": str(made[2].numel()),
                        "size_ops_on_device": [met.counter_value(k) for k in ("xla::mul", "xla::add", "xla::eq")]}

    # one program for every mask: the reduction masks the padding with the real size
    v = torch.arange(64, dtype=torch.float32)
    vd = v.to(dev)
    xm.mark_step()
    met.clear_all()
    sums = []
    for k in range(1, 7):
        sel = torch.masked_select(vd, ((v % (k + 1)) == 0).to(dev))
        r = [sel.sum(), sel.mean(), sel.amax(), sel.min()]
        xm.mark_step()
        sums.append([float(t.item()) for t in r])
    out["loop"] = {"values": sums, "compiles": met.metric_data("CompileTime")[0],
                   "reads": met.counter_value("BoundedSizeRead"),
                   "masked_select_shape": shape(torch.masked_select(vd, (v > 60).to(dev)))}
    out["masked_select_values"] = torch.masked_select(vd.view(8, 8), (v.view(8, 8) > 50).to(dev)).cpu().tolist()

    # training through masked_select: mean's backward divides by the dynamic count, the
    # gradient is a masked_scatter of the padded source; one program after the first step
    w = _train_weight().to(dev).requires_grad_(True)
    losses, compiles = [], []
    met.clear_all()
    for x_, m_ in _train_batches():
        loss = torch.masked_select(w * x_.to(dev), m_.to(dev)).pow(2).mean()
        loss.backward()
        xm.mark_step()
        losses.append(loss.item())
        compiles.append(met.metric_data("CompileTime")[0])
    out["train"] = {"losses": losses, "grad": w.grad.cpu().tolist(), "compiles": compiles,
                    "reads": met.counter_value("BoundedSizeRead"),
                    "fallbacks": [k for k in met.counter_names() if k.startswith("bounded::")]}

    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 9, 9], [21, 21, 29, 29]],
                         dtype=torch.float32)
    scores = torch.tensor([0.9, 0.8, 0.7, 0.95, 0.6])
    keep = bounded.nms(boxes.to(dev), scores.to(dev), 0.5)   # torchvision's kernel under the switch
    out["nms"] = {"sizes": [str(s) for s in keep.shape], "value": bounded.real_value(keep).cpu().tolist()}
    out["reads_counted"] = telemetry.counter("BoundedSizeRead") is not None
    return out


@pytest.fixture(scope="module")
def seen():
    env = dict(os.environ, XLA_EXPERIMENTAL=SWITCH, PJRT_DEVICE="CPU")
    p = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


A = torch.tensor([[1, 0, 0, 5, 0, 6], [1, 3, 2, 0, 0, 1]])
X = torch.tensor([1, 0, 3, 5, 0, 6])


def test_nonzero_is_bounded_and_equal_to_cpu(seen):
    got = seen["nonzero"]
    ref = torch.nonzero(A)
    assert got["shape"] == [["<=12", "2"], ["SymInt", "int"]]
    assert got["real"] == list(ref.shape)
    assert got["value"] == ref.tolist()
    assert "s64[<=12,2]" in got["text"]
    assert got["dim_size"] == ref.shape[0]


def test_sizes_flow_through_ops(seen):
    ops, nz, n = seen["ops"], torch.nonzero(A), torch.nonzero(X)
    assert ops["expand"] == [[["<=12", "2"], ["SymInt", "int"]], torch.ones(1, 2).expand(nz.shape[0], 2).tolist()]
    assert ops["unsqueeze"] == [[["1", "<=12", "2"], ["int", "SymInt", "int"]], nz.unsqueeze(0).tolist()]
    assert ops["t"] == [[["2", "<=12"], ["int", "SymInt"]], nz.t().tolist()]
    assert ops["clone"] == [[["<=6", "1"], ["SymInt", "int"]], n.clone().tolist()]
    assert ops["abs"] == [[["<=6", "1"], ["SymInt", "int"]], torch.abs(n - 3).tolist()]
    assert ops["add"] == [[["<=12", "2"], ["SymInt", "int"]], (nz + torch.tensor([[1, 10]])).tolist()]
    assert ops["empty"] == [["<=12", "2"], ["SymInt", "int"]]
    assert ops["view_static"] == [[["<=6"], ["SymInt"]], torch.ones(2, 3).view(6).tolist()]
    assert ops["float"] == nz.float().tolist()
    f = torch.nonzero(X)
    f.fill_(7)
    assert ops["fill_"] == [[["<=6", "1"], ["SymInt", "int"]], f.tolist()]


def test_as_tuple_printing_and_gradients(seen):
    rows, cols = torch.nonzero(A, as_tuple=True)
    assert seen["as_tuple"] == [[["<=12"], ["SymInt"]], rows.tolist(), cols.tolist()]
    assert seen["repr"] == repr(torch.nonzero(A)).replace("])", "], device='xla:0')")
    w = torch.arange(6.).requires_grad_()
    picked = torch.masked_select(w, w > 2.5)
    (picked * picked).sum().backward()
    assert seen["grad"] == w.grad.tolist()


def test_factories_and_slices_of_dynamic_sizes(seen):
    nz = torch.nonzero(A)
    got = seen["factories"]
    assert got["arange_plus_column"] == [[["<=12"], ["SymInt"]], (nz[:, 0] + torch.arange(nz.shape[0])).tolist()]
    assert got["new_zeros"] == [["<=12"], ["SymInt"]]
    assert got["full"] == [[["<=12"], ["SymInt"]], torch.full((nz.shape[0],), 2.0).tolist()]


def test_incompatible_shapes_raise_runtime_error(seen):
    nz = torch.nonzero(A)
    errors = seen["errors"]
    # what eager PyTorch raises for the real sizes
    with pytest.raises(RuntimeError):
        nz + torch.ones(2, 2, dtype=torch.int64)
    with pytest.raises(RuntimeError):
        torch.ones(2, 3).view(torch.nonzero(X).shape[0])
    assert errors["add_static_mismatch"] == "RuntimeError"
    assert errors["view_real_mismatch"] == "RuntimeError"
    # stricter than eager where only the bounds or the device values could tell
    assert errors["add_two_dynamic"] == "RuntimeError"
    assert errors["add_same_bound_other_value"] == "RuntimeError"
    assert errors["view_dynamic_to_static"] == "RuntimeError"
    assert errors["view_static_bound_mismatch"] == "RuntimeError"
    assert errors["add_itself"] is None


def test_size_arithmetic(seen):
    got = seen["sizes"]
    z = torch.zeros(5, 2)
    z[3, 0] = 1
    r0, r1 = torch.nonzero(z).shape
    assert got["add"] == ["<=12", r0 + r1]
    assert got["sub"] == ["<=8", r0 - r1]
    assert got["mul"] == ["<=30", r0 * 3]
    assert got["mod"] == r0 % r1
    assert [got["ge"], got["lt"], got["ne"]] == [int(r0 >= r1), int(r0 < r1), int(r0 != r1)]
    assert [got["max"], got["min"]] == [max(r0, r1), min(r0, r1)]
    assert got["wrap"] == "SymInt"
    assert all(v and v > 0 for v in got["counters"].values()), got["counters"]
    assert got["expand_of_sum"] == [[["<=12"], ["SymInt"]], torch.ones(1).expand(r0 + r1).tolist()]


def test_identical_sizes_compare_without_device_work(seen):
    # sizes computed while tensors are made (numel, layout) stay on the host
    assert seen["identical"] == {"equal": True, "compiles": None, "reads": None, "numel": "<=36",
                                 "size_ops_on_device": [None, None, None]}


def test_varying_sizes_compile_once(seen):
    v = torch.arange(64, dtype=torch.float32)
    want = []
    for k in range(1, 7):
        sel = torch.masked_select(v, (v % (k + 1)) == 0)
        want.append([float(sel.sum()), float(sel.mean()), float(sel.amax()), float(sel.min())])
    got = seen["loop"]
    assert [v for row in got["values"] for v in row] == pytest.approx([v for row in want for v in row])
    assert got["compiles"] == 1
    assert got["reads"] is None
    assert got["masked_select_shape"] == [["<=64"], ["SymInt"]]
    assert seen["masked_select_values"] == torch.masked_select(v.view(8, 8), v.view(8, 8) > 50).tolist()


def test_training_through_masked_select(seen):
    w = _train_weight().requires_grad_(True)
    losses = []
    for x_, m_ in _train_batches():
        loss = torch.masked_select(w * x_, m_).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    got = seen["train"]
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    torch.testing.assert_close(torch.tensor(got["grad"]), w.grad)
    # step 1 makes the gradient, the later steps accumulate into it: two programs for four masks
    assert got["compiles"] == [1, 2, 2, 2]
    assert got["reads"] is None and got["fallbacks"] == []


def test_nms(seen):
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 9, 9], [21, 21, 29, 29]],
                         dtype=torch.float32)
    scores = torch.tensor([0.9, 0.8, 0.7, 0.95, 0.6])
    assert seen["nms"] == {"sizes": ["<=5"], "value": _nms_cpu(boxes, scores, 0.5)}


def test_without_the_switch_results_stay_static():
    import torch_xla
    from torch_xla._engine import env_vars
    if env_vars.get("XLA_EXPERIMENTAL"):
        pytest.fail("this process must run without XLA_EXPERIMENTAL")
    got = torch.nonzero(A.to(torch_xla.device()))
    assert all(type(s) is int for s in got.shape)
    assert got.cpu().tolist() == torch.nonzero(A).tolist()
    assert torch.masked_select(X.to(torch_xla.device()), X.to(torch_xla.device()) > 2).cpu().tolist() == [3, 5, 6]


if __name__ == "__main__":
    print(json.dumps(_child()))
