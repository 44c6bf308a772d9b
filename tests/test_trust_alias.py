"""Writes through shared storage (issue 29): detach() and state_dict() values alias their
source as in torch (writes go both ways, also through views), autograd stays right, and
tensors that share memory with numpy (from_numpy) or a DLPack peer write it in place.
Values are checked against torch (CPU) and numpy."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import zyx
from zyx import nn, optim

RT = zyx._RT


def rnd(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def close(z, ref, tol=1e-5):
    ref = ref.detach().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    np.testing.assert_allclose(z.numpy(), ref, rtol=tol, atol=tol)


@pytest.fixture
def on_cpu():
    """numpy and DLPack memory is shared with the C backend only (elsewhere: copies)."""
    if not any(d.type == "cpu" for d in zyx.devices()):
        pytest.skip("no C backend device")
    before = RT.default
    RT.set_default_device("cpu")
    yield
    RT.default = before


# ---------------------------------------------------------------------------------------
# detach(): an alias

@pytest.mark.usefixtures("device")
def test_detach_write_reaches_source_and_back():
    w0 = rnd(3, 4)
    w, tw = zyx.tensor(w0, requires_grad=True), torch.tensor(w0, requires_grad=True)
    d, td = w.detach(), tw.detach()
    d.mul_(2)
    td.mul_(2)
    close(w, tw)
    assert w.requires_grad and w.is_leaf and not d.requires_grad
    with zyx.no_grad():
        w.add_(1)
    with torch.no_grad():
        tw.add_(1)
    close(d, td)
    close(w, tw)


@pytest.mark.usefixtures("device")
def test_detach_views_write_through():
    m, tm = nn.Linear(4, 3), torch.nn.Linear(4, 3)
    with torch.no_grad():
        tm.weight.copy_(torch.from_numpy(m.weight.numpy()))
    m.weight.detach()[0].fill_(1)
    tm.weight.detach()[0].fill_(1)
    close(m.weight, tm.weight)
    m.weight.detach().zero_()
    tm.weight.detach().zero_()
    close(m.weight, tm.weight)
    # a view of the alias, the source written afterwards: the view follows
    v, tv = m.weight.detach()[1], tm.weight.detach()[1]
    r, tr = m.weight.detach().reshape(-1), tm.weight.detach().reshape(-1)
    r[5] = 7.0
    tr[5] = 7.0
    with zyx.no_grad():
        m.weight.add_(zyx.tensor(rnd(3, 4, seed=1)))
    with torch.no_grad():
        tm.weight.add_(torch.from_numpy(rnd(3, 4, seed=1)))
    close(v, tv)
    close(r, tr)
    close(m.weight, tm.weight)
    assert m.weight.requires_grad and m.weight.is_leaf


@pytest.mark.usefixtures("device")
def test_detach_write_before_use_gives_gradient_of_new_value():
    w0 = rnd(5)
    w, tw = zyx.tensor(w0, requires_grad=True), torch.tensor(w0, requires_grad=True)
    w.detach().fill_(2.0)
    tw.detach().fill_(2.0)
    (w * w * w).sum().backward()
    (tw * tw * tw).sum().backward()
    close(w.grad, tw.grad)


@pytest.mark.usefixtures("device")
def test_detach_write_after_use_raises_like_torch():
    w0 = rnd(5)
    tw = torch.tensor(w0, requires_grad=True)
    ty = (tw * tw).sum()
    tw.detach().zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ty.backward()
    w = zyx.tensor(w0, requires_grad=True)
    y = (w * w).sum()
    w.detach().zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.usefixtures("device")
def test_detach_write_into_non_leaf_keeps_its_graph():
    x0 = rnd(4)
    x, tx = zyx.tensor(x0, requires_grad=True), torch.tensor(x0, requires_grad=True)
    h, th = x * 3, tx * 3
    h.detach().add_(1)
    th.detach().add_(1)
    assert h.requires_grad and h.grad_fn is not None and not h.is_leaf
    close(h, th)
    (h * h).sum().backward()
    (th * th).sum().backward()
    close(x.grad, tx.grad)


@pytest.mark.usefixtures("device")
def test_detached_leaf_made_to_require_grad_refuses_inplace():
    d = zyx.tensor(rnd(3)).detach().requires_grad_()
    with pytest.raises(RuntimeError, match="leaf Variable"):
        d.add_(1)


@pytest.mark.usefixtures("device")
def test_clone_deepcopy_and_parameter_do_not_alias():
    w = zyx.tensor(rnd(3), requires_grad=True)
    c = w.detach().clone()
    p = nn.Parameter(w.detach())
    c.zero_()
    with zyx.no_grad():
        p.add_(5)
    np.testing.assert_allclose(w.numpy(), rnd(3))
    m = nn.Linear(2, 2)
    before = m.weight.numpy()
    m2 = copy.deepcopy(m)
    with zyx.no_grad():
        m2.weight.zero_()
    np.testing.assert_allclose(m.weight.numpy(), before)


# ---------------------------------------------------------------------------------------
# state_dict(): detached aliases

def _pair(seed=0):
    m = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    tm = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    rng = np.random.RandomState(seed)
    with torch.no_grad():
        for (k, v), (tk, tv) in zip(m.state_dict().items(), tm.state_dict().items()):
            a = (rng.randn(*v.shape) * 0.5).astype(np.float32)
            v.copy_(zyx.tensor(a))
            tv.copy_(torch.from_numpy(a))
    return m, tm


@pytest.mark.usefixtures("device")
def test_state_dict_copy_updates_module():
    m, tm = _pair()
    w2 = rnd(5, 4, seed=3)
    m.state_dict()["0.weight"].copy_(zyx.tensor(w2))
    tm.state_dict()["0.weight"].copy_(torch.from_numpy(w2))
    close(m[0].weight, tm[0].weight)
    assert m[0].weight.requires_grad and m[0].weight.is_leaf
    x = rnd(2, 4, seed=4)
    close(m(zyx.tensor(x)), tm(torch.from_numpy(x)))


@pytest.mark.usefixtures("device")
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_ema_loop_and_optimizer_steps_match_torch(opt):
    m, tm = _pair()
    ema, tema = _pair(seed=1)
    ema.load_state_dict(m.state_dict())
    tema.load_state_dict(tm.state_dict())
    if opt == "sgd":
        o, to = optim.SGD(m.parameters(), lr=0.1, momentum=0.9), \
            torch.optim.SGD(tm.parameters(), lr=0.1, momentum=0.9)
    else:
        o, to = optim.Adam(m.parameters(), lr=0.05), torch.optim.Adam(tm.parameters(), lr=0.05)
    sd_before, tsd_before = m.state_dict(), tm.state_dict()     # taken before the steps
    decay = 0.9
    for step in range(3):
        x, y = rnd(6, 4, seed=10 + step), rnd(6, 3, seed=20 + step)
        o.zero_grad()
        to.zero_grad()
        ((m(zyx.tensor(x)) - zyx.tensor(y)) ** 2).mean().backward()
        ((tm(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).mean().backward()
        o.step()
        to.step()
        msd, tmsd = m.state_dict(), tm.state_dict()
        with zyx.no_grad():
            for k, v in ema.state_dict().items():
                v.mul_(decay).add_(msd[k] * (1 - decay))
        with torch.no_grad():
            for k, v in tema.state_dict().items():
                v.mul_(decay).add_(tmsd[k] * (1 - decay))
        for p, tp in zip(m.parameters(), tm.parameters()):
            close(p, tp, 1e-4)
        for p, tp in zip(ema.parameters(), tema.parameters()):
            close(p, tp, 1e-4)
    for k in tsd_before:
        close(sd_before[k], tsd_before[k], 1e-4)   # reflects the steps, as torch's
    assert all(p.requires_grad and p.is_leaf for p in m.parameters())
    assert all(p.requires_grad and p.is_leaf for p in ema.parameters())


@pytest.mark.usefixtures("device")
def test_load_state_dict_from_aliases_and_into_them():
    a, ta = _pair()
    b, tb = _pair(seed=2)
    sd_b = b.state_dict()
    b.load_state_dict(a.state_dict())
    tb.load_state_dict(ta.state_dict())
    for k, v in tb.state_dict().items():
        close(sd_b[k], v)                           # b's earlier aliases see the load
    # writing b afterwards does not change a (load copies values, as torch)
    b.state_dict()["2.bias"].fill_(3.0)
    tb.state_dict()["2.bias"].fill_(3.0)
    close(a[2].bias, ta[2].bias)
    close(b[2].bias, tb[2].bias)


# ---------------------------------------------------------------------------------------
# numpy memory (from_numpy)

@pytest.mark.usefixtures("on_cpu")
def test_from_numpy_inplace_writes_the_array():
    a = rnd(3, 4)
    ta = a.copy()
    t, tt = zyx.from_numpy(a), torch.from_numpy(ta)
    before = t * 2                      # computed from the old values, lazily
    t.add_(1)
    tt.add_(1)
    np.testing.assert_allclose(a, ta)
    t.mul_(3)
    tt.mul_(3)
    np.testing.assert_allclose(a, ta)
    t[1] = 5.0
    tt[1] = 5.0
    t[:, 2] = zyx.tensor(np.arange(3, dtype=np.float32))
    tt[:, 2] = torch.arange(3, dtype=torch.float32)
    np.testing.assert_allclose(a, ta)
    np.testing.assert_allclose(before.numpy(), rnd(3, 4) * 2)
    # through a view and a detached alias
    t[0].fill_(-1)
    tt[0].fill_(-1)
    t.detach()[2, 3] = 9.0
    tt.detach()[2, 3] = 9.0
    np.testing.assert_allclose(a, ta)
    # and the array's own later writes are still seen by the tensor
    a[2, 0] = 42.0
    assert t.numpy()[2, 0] == 42.0


@pytest.mark.usefixtures("on_cpu")
def test_from_numpy_parameter_updated_by_optimizer():
    a = rnd(4)
    p = zyx.from_numpy(a)
    p.requires_grad = True
    o = optim.SGD([p], lr=0.5)
    (p * p).sum().backward()
    o.step()
    np.testing.assert_allclose(a, rnd(4) - 0.5 * 2 * rnd(4), rtol=1e-6)
    np.testing.assert_allclose(p.numpy(), a)


@pytest.mark.usefixtures("on_cpu")
def test_from_numpy_resize_raises():
    t = zyx.from_numpy(rnd(4))
    with pytest.raises(RuntimeError, match="not resizable"):
        t.resize_(8)


# ---------------------------------------------------------------------------------------
# DLPack

@pytest.mark.usefixtures("on_cpu")
def test_dlpack_export_sees_inplace_writes():
    z = zyx.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    t = torch.from_dlpack(z)
    z.add_(10)
    np.testing.assert_allclose(t.numpy(), np.arange(6).reshape(2, 3) + 10)
    z[1, 2] = -1.0
    z.detach()[0].mul_(2)
    np.testing.assert_allclose(t.numpy(), z.numpy())
    np.testing.assert_allclose(t.numpy(), [[20, 22, 24], [13, 14, -1]])
    # numpy through DLPack too
    z2 = zyx.tensor(rnd(5))
    a = np.from_dlpack(z2)
    z2.clamp_(min=0.0)
    np.testing.assert_allclose(a, np.maximum(rnd(5), 0))


@pytest.mark.usefixtures("on_cpu")
def test_dlpack_import_writes_reach_the_producer():
    tt = torch.arange(6, dtype=torch.float32)
    z = zyx.from_dlpack(tt)
    z.mul_(2).add_(1)
    np.testing.assert_allclose(tt.numpy(), np.arange(6) * 2 + 1)
    z[0] = 100.0
    assert tt[0].item() == 100.0
    tt[1] = -7.0                      # and the producer's writes reach zyx
    assert z.numpy()[1] == -7.0


class _Peer:
    """A DLPack producer handing on a zyx tensor's capsule (so zyx imports zyx memory on
    any device that exports: CPU here, CUDA on a GPU machine, without torch's CUDA)."""

    def __init__(self, z):
        self.z = z

    def __dlpack__(self, stream=None, **kwargs):
        return self.z.__dlpack__()

    def __dlpack_device__(self):
        return self.z.__dlpack_device__()


@pytest.mark.parametrize("dev", [d for d in zyx.devices() if d.type in ("cpu", "cuda")],
                         ids=str)
def test_dlpack_round_trip_writes_both_ways(dev):
    z = zyx.tensor(np.arange(8, dtype=np.float32), device=dev)
    peer = zyx.from_dlpack(_Peer(z))            # a second tensor over z's memory
    kept = z * 1                                # lazy: must keep the values before the writes
    z.add_(10)
    np.testing.assert_allclose(peer.numpy(), np.arange(8) + 10)
    peer[2:4] = 0.0
    peer.mul_(2)
    want = (np.arange(8) + 10) * 2
    want[2:4] = 0
    np.testing.assert_allclose(z.numpy(), want)
    np.testing.assert_allclose(kept.numpy(), np.arange(8))


@pytest.mark.skipif(not torch.cuda.is_available() or
                    not any(d.type == "cuda" for d in zyx.devices()),
                    reason="needs CUDA in both torch and zyx")
def test_dlpack_cuda_writes_reach_torch_both_ways():
    z = zyx.tensor(np.arange(6, dtype=np.float32), device="cuda")
    t = torch.from_dlpack(z)
    z.add_(10)
    z[0] = -1.0
    np.testing.assert_allclose(t.cpu().numpy(), [-1, 11, 12, 13, 14, 15])
    tt = torch.arange(4, dtype=torch.float32, device="cuda")
    z2 = zyx.from_dlpack(tt)
    z2.mul_(3)
    np.testing.assert_allclose(tt.cpu().numpy(), np.arange(4) * 3)
