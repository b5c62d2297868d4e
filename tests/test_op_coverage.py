"""OpInfo conformance on a representative subset of ops (tools/op_coverage.py, in-process).

Every compared float32 entry (forward and backward) must equal the CPU (`native` or
`fallback`). Entries that genuinely fail today are listed in KNOWN_FAILURES with the reason;
they are asserted to still fail (strict xfail), so the list stays honest: remove an entry
when its lowering is fixed.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import op_coverage as oc  # noqa: E402

# OpInfo names (exact keys or names; all variants of a name are run).
SUBSET = [
    "add", "mul", "div.no_rounding_mode", "sub", "sum", "mean", "amax", "softmax", "log_softmax",
    "matmul", "mm", "bmm", "addmm", "nn.functional.conv2d", "nn.functional.max_pool2d",
    "nn.functional.avg_pool2d", "nn.functional.batch_norm", "nn.functional.layer_norm",
    "nn.functional.embedding", "nn.functional.cross_entropy", "nn.functional.nll_loss",
    "index_select", "gather", "scatter_add", "index_put", "where", "clamp", "cat", "stack",
    "reshape", "transpose", "permute", "expand", "narrow", "cumsum", "sort", "topk", "exp", "log",
    "sigmoid", "tanh", "nn.functional.relu", "nn.functional.gelu", "nn.functional.linear",
]

# (op key, "fwd" | "bwd") -> reason. Strict: each must still fail.
KNOWN_FAILURES: dict = {
    # None today. (Earlier `("narrow", "bwd")`: "derivative for aten::narrow is not implemented",
    # fixed by the lowering engineers during this sweep.)
}

N_SAMPLES = 2


@pytest.fixture(scope="module")
def results():
    refs = oc.select_ops(",".join(SUBSET))
    out = {}
    for ref in refs:
        op = oc.op_db()[ref]
        out[oc.op_key(op)] = oc.run_op(op, N_SAMPLES, dtypes=("float32",), backward=True, errors=False)
    return out


def _keys():
    return SUBSET


@pytest.mark.parametrize("key", _keys())
def test_opinfo_float32(results, key):
    matching = {k: r for k, r in results.items() if k == key or r["op"] == key}
    assert matching, f"no OpInfo {key}"
    problems = []
    for k, r in matching.items():
        for kind in ("fwd", "bwd"):
            e = oc.entry(r, "float32" if kind == "fwd" else "bwd")
            known = KNOWN_FAILURES.get((k, kind))
            if known is not None:
                assert e["cls"] == "fail", f"{k} {kind} is listed in KNOWN_FAILURES ({known}) but now " \
                                           f"{e['cls']}: remove it from the list"
                continue
            if e["cls"] == "fail":
                problems.append(f"{k} {kind}: {e.get('reason')}")
    assert not problems, "\n".join(problems)


def test_subset_is_compared(results):
    """The subset really exercises the device: most forward entries are compared, not skipped."""
    compared = [k for k, r in results.items() if oc.entry(r, "float32")["cls"] in ("native", "fallback", "fail")]
    assert len(compared) >= 0.9 * len(results), {k: oc.entry(r, "float32") for k, r in results.items()}


def test_harness_survives_raising_op():
    r = oc.run_op(oc.FakeOp("raise"), 2, dtypes=("float32",))
    e = oc.entry(r, "float32")
    assert e["cls"] == "fail"
    assert e["reason"].startswith("ValueError: fake op raised on the device")
    ok = oc.run_op(oc.FakeOp("ok"), 2, dtypes=("float32", "int64"))
    assert oc.entry(ok, "float32")["cls"] == "native"
    assert oc.entry(ok, "int64")["cls"] == "skip"  # dtype not supported by the fake OpInfo


def test_compare_reports_mismatch():
    import torch
    x = torch.tensor([1.0, 2.0]).to("xla:0")
    oc.compare(x, torch.tensor([1.0, 2.0]), 1.3e-6, 1e-5)
    with pytest.raises(oc.Mismatch, match="max abs diff"):
        oc.compare(x, torch.tensor([1.0, 2.5]), 1.3e-6, 1e-5)
    with pytest.raises(oc.Mismatch, match="dtype"):
        oc.compare(x, torch.tensor([1, 2]), 0, 0)
    oc.compare((x, 3), (torch.tensor([1.0, 2.0]), 3), 0, 0)


@pytest.mark.slow   # about 30 s: a chunk process is killed by its time limit
def test_chunk_runner_isolates_crash_and_hang():
    refs = ["fake:ok", "fake:crash", "fake:hang", "fake:raise"]
    res = {r["ref"]: r for r in oc.run_chunk(refs, 1, ("float32",), op_timeout=8)}
    assert set(res) == set(refs)
    assert oc.entry(res["fake:ok"], "float32")["cls"] == "native"
    crash = oc.entry(res["fake:crash"], "float32")
    assert crash["cls"] == "fail" and crash["reason"] == "crashed (signal 11)", crash
    hang = oc.entry(res["fake:hang"], "float32")
    assert hang["cls"] == "fail" and hang["reason"] == "timeout", hang
    raised = oc.entry(res["fake:raise"], "float32")
    assert raised["cls"] == "fail" and raised["reason"].startswith("ValueError"), raised


class _Sample:
    def __init__(self, input, args=(), kwargs=None):
        self.input, self.args, self.kwargs = input, args, kwargs or {}


def test_sort_ties_compared_in_index_order():
    """Equal elements in any order pass; an index that points elsewhere does not."""
    x = torch.tensor([2.0, 1.0, 2.0, 1.0, 2.0])
    s = _Sample(x)
    ref = oc._ties_in_index_order(torch.sort(x, stable=True), s)
    permuted = (torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0], device=oc.XLA), torch.tensor([3, 1, 4, 0, 2], device=oc.XLA))
    oc.compare(oc._ties_in_index_order(permuted, s), ref, 0, 0)
    wrong = (permuted[0], torch.tensor([3, 1, 4, 0, 0], device=oc.XLA))
    with pytest.raises(oc.Mismatch):
        oc.compare(oc._ties_in_index_order(wrong, s), ref, 0, 0)
    # stable=True keeps the exact order.
    stable = _Sample(x, (), {"stable": True})
    assert oc._ties_in_index_order(permuted, stable) is permuted


def test_topk_index_compared_as_the_element():
    x = torch.tensor([[3.0, 5.0, 5.0, 1.0]])
    s = _Sample(x, (1,))
    ref = oc._any_index_of_the_value(torch.topk(x, 1), s)
    five = torch.tensor([[5.0]], device=oc.XLA)
    oc.compare(oc._any_index_of_the_value((five, torch.tensor([[2]], device=oc.XLA)), s), ref, 0, 0)
    with pytest.raises(oc.Mismatch):
        oc.compare(oc._any_index_of_the_value((five, torch.tensor([[0]], device=oc.XLA)), s), ref, 0, 0)


def test_bfloat16_closer_than_cpu_rule():
    """A bfloat16 result passes only where it is as close to the float64 result as the CPU's."""
    class Op:
        name = "fake"

        def __call__(self, t):
            return t * 3

    x = torch.tensor([1.1, 2.3], dtype=torch.bfloat16)
    ref = (x.double() * 3)
    good = ref.to(torch.bfloat16)
    assert oc._closer_than_cpu(Op(), _Sample(x), good, good + 1, 1.6e-2, 1e-2)
    assert not oc._closer_than_cpu(Op(), _Sample(x), good + 1, good, 1.6e-2, 1e-2)
