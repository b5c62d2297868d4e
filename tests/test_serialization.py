"""`torch.load` onto the xla device (patch `load_to_device`, kernels/storage.py), against the
CPU load of the same checkpoint; the paths to PyTorch's missing PrivateUse1 allocator
raise instead of crashing (run in a subprocess: a crash would be a signal)."""
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_xla  # noqa: F401
from torch_xla._engine import patches

from helpers import XLA, assert_same

MAP_LOCATIONS = {
    "str": "xla",
    "device": torch.device("xla"),
    "indexed": "xla:0",
    "dict": {"cpu": "xla"},
    "callable": lambda storage, location: torch.serialization.default_restore_location(storage, "xla"),
}


def _saved(obj, **kw) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    buf.seek(0)
    return buf


def _load_both(obj, map_location, weights_only):
    """(loaded onto the device, loaded on the CPU) from one checkpoint of `obj`."""
    buf = _saved(obj)
    dev = torch.load(buf, map_location=map_location, weights_only=weights_only)
    buf.seek(0)
    cpu = torch.load(buf, map_location="cpu", weights_only=weights_only)
    return dev, cpu


def _tensors():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    return {
        "f32": base,
        "strided": base[1:, ::2],           # offset and non-contiguous, same storage as f32
        "transposed": base.t(),
        "row": base[2],
        "bf16": torch.randn(5, generator=g).bfloat16(),
        "i64": torch.arange(-3, 7),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "grad": torch.randn(3, generator=g).requires_grad_(),
    }


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("where", list(MAP_LOCATIONS))
def test_tensors_load_onto_the_device(where, weights_only):
    dev, cpu = _load_both(_tensors(), MAP_LOCATIONS[where], weights_only)
    assert set(dev) == set(cpu)
    for k, t in dev.items():
        assert t.device == XLA, k
        assert torch._is_functional_tensor(t), k       # a user tensor, as `.to('xla')` makes
        assert (t.dtype, t.shape, t.requires_grad) == (cpu[k].dtype, cpu[k].shape, cpu[k].requires_grad), k
        assert torch.equal(t.cpu(), cpu[k]), k
    # Usable in ops, views of one storage included; the loaded leaf takes gradients.
    assert_same(dev["strided"] * 2 + dev["transposed"][::2, 1:].t(), cpu["strided"] * 2 + cpu["transposed"][::2, 1:].t())
    assert_same(dev["bf16"].float().sum(), cpu["bf16"].float().sum())
    assert_same(dev["i64"][dev["bool"].repeat(4)[:10]], cpu["i64"][cpu["bool"].repeat(4)[:10]])
    (dev["grad"] * dev["row"][:3]).sum().backward()
    assert_same(dev["grad"].grad, cpu["row"][:3])


def test_shared_storages_are_read_once_and_come_back_with_their_values(monkeypatch):
    """Views of one storage (a flat buffer) read its record once (PyTorch keeps a loaded
    storage for the next tensor only when its data pointer is not null, and ours is the
    CPU storage's); each view is its own tensor on the device, with the right values."""
    from torch_xla._engine.kernels import storage
    reads = []

    def counting(s, location):
        out = storage._deserialize(s, location)
        if out is not None:
            reads.append(s.nbytes())
        return out

    monkeypatch.setattr(torch.serialization, "_package_registry",
                        [(p, t, counting if f is storage._deserialize else f)
                         for p, t, f in torch.serialization._package_registry])
    flat = torch.arange(60.)
    views = [flat[i * 12:(i + 1) * 12].view(3, 4) for i in range(5)]
    for weights_only in (True, False):
        reads.clear()
        dev = torch.load(_saved(views + [flat, views[0]]), map_location="xla", weights_only=weights_only)
        assert reads == [flat.nbytes]
        for t, c in zip(dev, views + [flat]):
            assert torch.equal(t.cpu(), c)
        assert dev[0] is dev[6]       # one tensor object saved twice is one object (pickle memo)
        dev[1].add_(100)
        assert torch.equal(dev[5].cpu(), flat)      # views are not aliased on the device


def _lm(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 10))
    m[3].weight = m[0].weight     # tied, as an LM head to its embedding
    return m


def _step(model, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("where", [pytest.param("str", marks=pytest.mark.slow), "dict"])   # ~10 s each
def test_model_and_adam_state_dicts_load_and_train_like_the_cpu(where, weights_only):
    x, y = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[3, 4, 5], [6, 7, 8]])
    ref = _lm(0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    _step(ref, ref_opt, x, y)       # optimizer state exists (exp_avg, exp_avg_sq, step)
    ckpt = _saved({"model": ref.state_dict(), "opt": ref_opt.state_dict()})

    loaded = torch.load(ckpt, map_location=MAP_LOCATIONS[where], weights_only=weights_only)
    assert loaded["model"]["0.weight"].device == XLA
    assert loaded["opt"]["state"][0]["exp_avg"].device == XLA
    m = _lm(1).to(XLA)                               # other initial values
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    m.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["opt"])
    assert m[3].weight is m[0].weight                 # still tied
    for p, q in zip(m.parameters(), ref.parameters()):
        assert_same(p, q)
    for k in ("exp_avg", "exp_avg_sq", "step"):
        assert_same(opt.state[m[0].weight][k], ref_opt.state[ref[0].weight][k])

    loss = _step(m, opt, x.to(XLA), y.to(XLA))
    ref_loss = _step(ref, ref_opt, x, y)
    assert_same(loss, ref_loss)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert_same(p, q)
    # And the trained state goes back through a checkpoint (saved from xla tensors).
    back = torch.load(_saved({"model": m.state_dict(), "opt": opt.state_dict()}), map_location="xla")
    for k, v in back["model"].items():
        assert v.device == XLA, k
        assert_same(v, ref.state_dict()[k])
    assert_same(back["opt"]["state"][1]["exp_avg_sq"], ref_opt.state_dict()["state"][1]["exp_avg_sq"])


def test_cpu_and_device_checkpoints_still_load_as_before(tmp_path):
    t = torch.randn(3, 4)
    cpu = torch.load(_saved({"a": t.to(XLA)}), map_location="cpu")["a"]       # saved from the device
    assert cpu.device.type == "cpu" and torch.equal(cpu, t)
    dev = torch.load(_saved({"a": t.to(XLA)}))["a"]
    assert dev.device == XLA and torch.equal(dev.cpu(), t)
    assert torch.equal(torch.load(_saved({"a": t}))["a"], t)                  # CPU stays CPU
    path = tmp_path / "ckpt.pt"
    torch.save({"a": t, "b": t[1:]}, path)
    mm = torch.load(path, map_location="xla", mmap=True)
    assert mm["a"].device == XLA and torch.equal(mm["b"].cpu(), t[1:])


def test_another_device_index_is_refused_at_load():
    try:
        with pytest.raises(RuntimeError, match="xla:3"):
            torch.load(_saved({"a": torch.ones(2)}), map_location="xla:3")
    finally:
        # PyTorch's torch.load leaves its map_location in a thread-local when the load
        # raises; a later copy.copy / pickle of an xla tensor would then be sent to xla:3.
        torch.serialization._serialization_tls.map_location = None


_ON_INDEX_3 = textwrap.dedent("""
    import io, torch, torch_xla
    from torch_xla._engine import patches, tensor
    tensor.set_device_index(3)           # as a replica of a multi-process CPU job decides it
    patches.install("inline_backward")
    src = {"a": torch.randn(3, 4), "b": torch.arange(6)[1::2]}
    buf = io.BytesIO()
    torch.save(src, buf)
    for where in ("xla", {"cpu": "xla"}, "xla:3"):
        buf.seek(0)
        d = torch.load(buf, map_location=where)
        assert all(v.device == torch.device("xla", 3) and torch.equal(v.cpu(), src[k]) for k, v in d.items())
    for where in ("xla:0", "xla:1"):
        buf.seek(0)
        try:
            torch.load(buf, map_location=where)
            print("LOADED", where)
        except RuntimeError as e:
            print("REFUSED", where, "xla:3" in str(e))
    ref = torch.nn.Linear(4, 2)
    buf = io.BytesIO()
    torch.save(ref.state_dict(), buf)
    buf.seek(0)
    m = torch.nn.Linear(4, 2).to("xla")
    m.load_state_dict(torch.load(buf, map_location="xla"))
    x = torch.randn(5, 4)
    loss = m(x.to("xla")).sum()
    loss.backward()
    print("TRAINED", m.weight.grad.device, abs(loss.item() - ref(x).sum().item()) < 1e-5)
""")


def test_load_in_a_process_whose_device_is_another_index():
    """A replica of a multi-process CPU job computes on xla:<global ordinal>: `xla` (and
    its own index) loads there; another index is refused, as at every op that names one."""
    res = _run(_ON_INDEX_3)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("\n")[:3] == ["REFUSED xla:0 True", "REFUSED xla:1 True", "TRAINED xla:3 True"], res.stdout


def test_set_from_storages():
    """set_ from an xla storage that carries nothing is a RuntimeError naming the op; from a
    CPU storage it uploads that view, on wrappers and on inner tensors."""
    x = torch.arange(4.).to(XLA)
    with pytest.raises(RuntimeError, match=r"set_\.source_Storage_storage_offset: this storage"):
        torch.empty(0, device=XLA).set_(x.untyped_storage(), 0, (2,), (1,))
    with pytest.raises(RuntimeError, match=r"set_\.source_Storage: this storage"):
        torch.empty(0, device=XLA).set_(x.untyped_storage())
    # A CPU storage still gives the device a copy of that view (the CPU fallback did).
    cs = torch.arange(8.).untyped_storage()
    t = torch.empty(0, device=XLA).set_(cs, 1, (2,), (1,))
    assert torch.equal(t.cpu(), torch.tensor([1., 2.]))
    assert torch.equal(torch.empty(0, device=XLA).set_(cs, 2, (2, 3)).cpu(), torch.empty(0).set_(cs, 2, (2, 3)))
    # Below functionalization (an inner tensor), set_ makes the tensor itself hold the view.
    inner = torch._from_functional_tensor(torch.empty(0, device=XLA))
    inner.set_(cs, 1, (2, 2), (1, 2))
    assert inner.shape == (2, 2) and inner._xla.shape == (2, 2)
    assert torch.equal(torch._to_functional_tensor(inner).cpu(), torch.empty(0).set_(cs, 1, (2, 2), (1, 2)))
    inner = torch._from_functional_tensor(torch.empty(0, device=XLA, dtype=torch.int32))
    inner.set_(torch.arange(3, dtype=torch.int32).untyped_storage())
    assert torch.equal(torch._to_functional_tensor(inner).cpu(), torch.arange(3, dtype=torch.int32))


# Each case once crashed the process (SIGSEGV in PyTorch's PrivateUse1 allocator, or the
# load through it); each must now raise a RuntimeError that says why.
_CRASH_CASES = {
    "UntypedStorage(16)": ("torch.UntypedStorage(16, device='xla')", "no storage of the xla device"),
    "UntypedStorage(0)": ("torch.UntypedStorage(0, device=torch.device('xla', 0))", "no storage of the xla device"),
    "TypedStorage": ("torch.TypedStorage(4, dtype=torch.float32, device='xla')", "no storage of the xla device"),
    "storage.to": ("torch.arange(4.).untyped_storage().to(device='xla')", "no storage of the xla device"),
    "clone": ("torch.arange(4.).to('xla').untyped_storage().clone()", "no storage of the xla device"),
    "_new_shared": ("torch.UntypedStorage._new_shared(16, device='xla')", "no storage of the xla device"),
    "legacy load": ("b = io.BytesIO(); torch.save({'a': torch.ones(3)}, b, _use_new_zipfile_serialization=False); "
                    "b.seek(0); torch.load(b, map_location='xla', weights_only=False)", "legacy"),
}
_CRASH_SCRIPT = textwrap.dedent("""
    import io, sys, warnings
    import torch, torch_xla
    warnings.simplefilter("ignore")
    for name, (code, _) in CASES.items():
        try:
            exec(code)
            print(name, "|", "no error")
        except RuntimeError as e:
            print(name, "|", "RuntimeError", str(e).replace("\\n", " "))
    print("normal exit")
""")


def _run(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PJRT_DEVICE="CPU", **env))


def test_missing_allocator_paths_raise_instead_of_crashing():
    res = _run(f"CASES = {_CRASH_CASES!r}\n" + _CRASH_SCRIPT)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])   # negative: killed by a signal
    lines = dict(line.split(" | ", 1) for line in res.stdout.splitlines() if " | " in line)
    assert res.stdout.rstrip().endswith("normal exit")
    for name, (_, words) in _CRASH_CASES.items():
        assert lines[name].startswith("RuntimeError") and words in lines[name], (name, lines.get(name))


def test_opt_out_leaves_pytorchs_deserializers_alone():
    code = ("import torch, torch_xla\n"
            "from torch_xla._engine.kernels import storage\n"
            "print(any(fn is storage._deserialize for _, _, fn in torch.serialization._package_registry))")
    assert _run(code, PT_XLA_LOAD_TO_DEVICE="0").stdout.split() == ["False"]
    assert patches.enabled("load_to_device")
    from torch_xla._engine.kernels import storage
    assert [p for p, _, fn in torch.serialization._package_registry if fn is storage._deserialize] == [storage.PRIORITY]
