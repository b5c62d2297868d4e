"""Buffer donation: the buffers of overwritten tensors at a barrier, and those the user
marks (`_XLAC._set_buffer_donation`), with `_xla_set_enable_alias_with_buffer_donor_config`
extending the marked ones to partial syncs. Values are compared with eager CPU; a donated
buffer is never read again (reading its tensor raises)."""
import contextlib

import pytest
import torch

import torch_xla
import torch_xla.debug.metrics as met

X = torch_xla._XLAC


@contextlib.contextmanager
def donor_config(on: bool):
    saved = X._xla_get_enable_alias_with_buffer_donor_config()
    X._xla_set_enable_alias_with_buffer_donor_config(on)
    try:
        yield
    finally:
        X._xla_set_enable_alias_with_buffer_donor_config(saved)


def aliases():
    """(programs compiled, buffers donated by them) since the last clear."""
    data = met.metric_data("InputOutputAliasCount")
    return (0, 0) if data is None else (data[0], int(data[1]))


@pytest.fixture(autouse=True)
def clean():
    torch_xla.sync()   # nothing pending from another test joins this one's graphs
    met.clear_all()


def test_inplace_updates_donate_and_keep_values(dev):
    a, b = torch.randn(3, 7, 5), torch.randn(3, 7, 5)
    xa, xb = a.to(dev), b.to(dev)
    torch_xla.sync()
    met.clear_all()
    s = xa + xb
    xa *= 2.0
    xb += 2.0
    torch_xla.sync()
    assert aliases() == (1, 2)
    torch.testing.assert_close(s.cpu(), a + b)
    torch.testing.assert_close(xa.cpu(), a * 2.0)
    torch.testing.assert_close(xb.cpu(), b + 2.0)


def test_alias_count_is_sampled_per_compiled_program(dev):
    w = torch.randn(6, 11)
    xw = w.to(dev)
    torch_xla.sync()
    met.clear_all()
    for _ in range(4):
        xw.mul_(0.5).add_(1.0)
        torch_xla.sync()
        w = w.mul(0.5).add(1.0)
    assert aliases() == (1, 1)     # one program, compiled once, donating w's buffer
    assert met.counter_value("CachedCompile") == 3
    torch.testing.assert_close(xw.cpu(), w)


def test_value_still_held_is_not_donated(dev):
    a = torch.randn(5, 9, 2)
    xa = a.to(dev)
    torch_xla.sync()
    kept = xa.clone()              # holds the same value as xa's old buffer
    xa.add_(1.0)
    torch_xla.sync()
    torch.testing.assert_close(kept.cpu(), a)
    torch.testing.assert_close(xa.cpu(), a + 1.0)
    assert not X._is_placecholder(kept)


def test_partial_sync_donates_nothing_by_default(dev):
    a = torch.randn(2, 13)
    xa = a.to(dev)
    torch_xla.sync()
    met.clear_all()
    y = xa * 3.0
    xa.sub_(1.0)
    X._xla_sync_multi([xa], [str(dev)], True, True)   # the other pending value reads xa's old buffer
    assert aliases() == (1, 0)
    torch.testing.assert_close(y.cpu(), a * 3.0)
    torch.testing.assert_close(xa.cpu(), a - 1.0)


def test_marked_donor_is_donated_at_barrier_and_not_readable(dev):
    a, b = torch.randn(4, 3, 3), torch.randn(4, 3, 3)
    xa, xb = a.to(dev), b.to(dev)
    assert X._set_buffer_donation(xa, True)
    assert X._get_buffer_donation(xa) and not X._get_buffer_donation(xb)
    assert met.counter_value("XlaSetBufferDonation") == 1
    s = xa + xb
    xb += 2.0
    torch_xla.sync(wait=True)
    assert aliases() == (1, 2)
    torch.testing.assert_close(s.cpu(), a + b)
    torch.testing.assert_close(xb.cpu(), b + 2.0)
    assert X._is_placecholder(xa) and not X._is_placecholder(xb)
    with pytest.raises(RuntimeError):
        xa.cpu()
    with pytest.raises(RuntimeError, match="deleted"):
        X._get_tensors_handle([xa])
    with pytest.raises(RuntimeError):
        (xa * 2).cpu()


def test_pending_tensor_cannot_be_marked(dev):
    x = torch.randn(3, device=dev) + 1
    assert not X._set_buffer_donation(x, True)
    assert not X._get_buffer_donation(x)


def test_config_extends_marked_donors_to_partial_syncs(dev):
    for on in (True, False):
        a = torch.randn(7, 3, 2)
        xa = a.to(dev)
        assert X._set_buffer_donation(xa, True)
        met.clear_all()
        with donor_config(on):
            assert X._xla_get_enable_alias_with_buffer_donor_config() is on
            y = xa + 1.0
            X._xla_sync_multi([xa, y], [str(dev)], True, False)
        assert aliases() == (1, int(on))
        assert X._is_placecholder(xa) is on
        torch.testing.assert_close(y.cpu(), a + 1.0)
        if not on:
            torch.testing.assert_close(xa.cpu(), a)


def test_config_host_read_donates_marked_donor(dev):
    a = torch.randn(3, 17)
    xa = a.to(dev)
    X._set_buffer_donation(xa, True)
    with donor_config(True):
        y = xa.exp()
        torch.testing.assert_close(y.cpu(), a.exp())
    assert X._is_placecholder(xa)


def test_cached_program_without_donation_is_not_reused_for_marked_donor(dev):
    a = torch.randn(9, 2, 3)
    first = a.to(dev)
    kept = first.clone()          # holds the buffer: the program compiled donates nothing
    first.add_(1.0)
    torch_xla.sync()
    assert not X._is_placecholder(kept)
    met.clear_all()
    second = a.to(dev)
    X._set_buffer_donation(second, True)
    held = second                 # still held, but marked: donated all the same
    second = second + 1.0
    torch_xla.sync()
    assert aliases() == (1, 1)
    assert X._is_placecholder(held)
    torch.testing.assert_close(second.cpu(), a + 1.0)
    torch.testing.assert_close(first.cpu(), a + 1.0)
    torch.testing.assert_close(kept.cpu(), a)


def test_unmarking_keeps_the_buffer(dev):
    a = torch.randn(2, 2, 7)
    xa = a.to(dev)
    X._set_buffer_donation(xa, True)
    X._set_buffer_donation(xa, False)
    assert not X._get_buffer_donation(xa)
    y = xa * 2.0
    torch_xla.sync()
    torch.testing.assert_close(xa.cpu(), a)
    torch.testing.assert_close(y.cpu(), a * 2.0)


def test_no_op_sync_keeps_mark(dev):
    xa = torch.randn(5, 5).to(dev)
    assert X._set_buffer_donation(xa, True)
    torch_xla.sync()
    torch_xla.sync()
    assert X._get_buffer_donation(xa)
    assert not X._is_placecholder(xa)


def test_donation_off(dev, monkeypatch):
    from torch_xla._engine import env_vars
    monkeypatch.setenv("XLA_NO_DONATION", "1")
    env_vars.reload()
    try:
        a = torch.randn(8, 1, 3)
        xa = a.to(dev)
        X._set_buffer_donation(xa, True)
        met.clear_all()
        y = xa - 1.0
        torch_xla.sync()
        assert aliases() == (1, 0)
        torch.testing.assert_close(xa.cpu(), a)
        torch.testing.assert_close(y.cpu(), a - 1.0)
    finally:
        monkeypatch.delenv("XLA_NO_DONATION")
        env_vars.reload()


def test_clone_of_updated_tensor_gets_a_copy_and_buffer_is_donated(dev):
    a = torch.randn(4, 2, 2)
    t1 = a.to(dev)
    cloned = torch.clone(t1)       # shares t1's buffer until the barrier
    t1 += 1
    torch_xla.sync()
    assert aliases() == (1, 1)
    assert not X._is_placecholder(cloned)
    torch.testing.assert_close(cloned.cpu(), a)
    torch.testing.assert_close(t1.cpu(), a + 1)
    assert X._get_tensors_handle([cloned]) != X._get_tensors_handle([t1])


def test_copied_alias_read_every_step_is_copied_once(dev):
    a = torch.randn(3, 5)
    t1 = a.to(dev)
    cloned = t1.clone()
    expect = a.clone()
    for _ in range(4):
        t1 += cloned
        torch_xla.sync()
        expect += a
    # step 1 copies the clone's buffer out; later steps read that copy as a plain input
    assert aliases() == (2, 2)
    assert met.counter_value("CachedCompile") == 2
    torch.testing.assert_close(t1.cpu(), expect)
    torch.testing.assert_close(cloned.cpu(), a)


def test_copy_out_changes_the_program_key(dev):
    a, b = torch.randn(6), torch.randn(6)
    xa, xb = a.to(dev), b.to(dev)
    torch_xla.sync()
    ka = xa.clone()                # the same graph, the other input kept by a clone
    xa.add_(1.0)
    xb.add_(1.0)
    torch_xla.sync()
    xc, xd = a.to(dev), b.to(dev)
    kd = xd.clone()
    xc.add_(1.0)
    xd.add_(1.0)
    torch_xla.sync()
    torch.testing.assert_close(ka.cpu(), a)
    torch.testing.assert_close(kd.cpu(), b)
    torch.testing.assert_close(xa.cpu(), a + 1)
    torch.testing.assert_close(xd.cpu(), b + 1)
    assert X._get_tensors_handle([kd]) != X._get_tensors_handle([xd])


def test_owned_buffer_is_not_copied(dev):
    a = torch.randn(2, 8)
    xa = a.to(dev)
    alias = xa.detach()            # xa still holds its own buffer: nothing to copy
    y = xa * 2.0
    torch_xla.sync()
    assert aliases() == (1, 0)
    assert X._get_tensors_handle([alias]) == X._get_tensors_handle([xa])
    torch.testing.assert_close(y.cpu(), a * 2.0)


def test_dynamo_bridge_shares_the_donor_config():
    from torch_xla.core import dynamo_bridge
    saved = X._xla_get_enable_alias_with_buffer_donor_config()
    with dynamo_bridge.alias_with_buffer_donor_config(not saved) as before:
        assert before is saved
        assert X._xla_get_enable_alias_with_buffer_donor_config() is (not saved)
    assert X._xla_get_enable_alias_with_buffer_donor_config() is saved
