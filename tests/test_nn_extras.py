"""Smaller torch.nn habits against torch: Embedding(max_norm), max_pool2d indices and
max_unpool2d, Module.apply / register_buffer(persistent=False) / named_modules /
requires_grad_ / zero_grad, nn.Transformer and its square subsequent mask."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx import nn
import zyx.nn.functional as F

try:
    import torch
    import torch.nn as tnn
except ImportError:
    torch = tnn = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


def _close(z, t, tol=1e-5):
    np.testing.assert_allclose(z.numpy(), t.detach().numpy(), rtol=tol, atol=tol)


@needs_torch
@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_embedding_max_norm_renormalizes_looked_up_rows_like_torch(norm_type):
    w = np.random.randn(6, 4).astype(np.float32) * 2
    ref = tnn.Embedding(6, 4, max_norm=1.5, norm_type=norm_type)
    ours = nn.Embedding(6, 4, max_norm=1.5, norm_type=norm_type)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(w))
    ours.load_state_dict({"weight": w})
    weight_obj = ours.weight
    idx = np.array([[0, 2], [2, 5]])
    zo, to = ours(zyx.tensor(idx)), ref(torch.tensor(idx))
    _close(zo, to)
    _close(ours.weight, ref.weight)              # rows 0, 2, 5 renormalized, others kept
    assert ours.weight is weight_obj and ours.weight.requires_grad
    (zo ** 2).sum().backward()
    (to ** 2).sum().backward()
    _close(ours.weight.grad, ref.weight.grad)


@needs_torch
@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
                                dict(kernel_size=3, stride=1, dilation=2),
                                dict(kernel_size=2, ceil_mode=True)])
def test_max_pool2d_indices_and_unpool_match_torch(kw):
    x = np.random.randn(2, 3, 7, 7).astype(np.float32)
    x[0, 0, :2, :2] = 1.0                          # ties: the first maximum wins
    zo, zi = F.max_pool2d(zyx.tensor(x), return_indices=True, **kw)
    to, ti = torch.nn.functional.max_pool2d(torch.tensor(x), return_indices=True, **kw)
    _close(zo, to)
    assert zi.dtype == zyx.int64
    np.testing.assert_array_equal(zi.numpy(), ti.numpy())
    if "dilation" in kw or kw.get("ceil_mode"):
        return
    ukw = {k: v for k, v in kw.items() if k in ("kernel_size", "stride", "padding")}
    zx = zyx.tensor(zo.numpy(), requires_grad=True)
    tx = to.detach().clone().requires_grad_(True)
    zu = F.max_unpool2d(zx, zi, output_size=x.shape[-2:], **ukw)
    tu = torch.nn.functional.max_unpool2d(tx, ti, output_size=x.shape[-2:], **ukw)
    _close(zu, tu)
    g = np.random.randn(*tu.shape).astype(np.float32)
    (zu * zyx.tensor(g)).sum().backward()
    (tu * torch.tensor(g)).sum().backward()
    _close(zx.grad, tx.grad)


@needs_torch
def test_maxpool_and_maxunpool_modules():
    x = np.random.randn(1, 2, 4, 6).astype(np.float32)
    pool, unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)
    out, idx = pool(zyx.tensor(x))
    tout, tidx = tnn.MaxPool2d(2, return_indices=True)(torch.tensor(x))
    np.testing.assert_array_equal(idx.numpy(), tidx.numpy())
    _close(unpool(out, idx), tnn.MaxUnpool2d(2)(tout, tidx))
    with pytest.raises(zyx.ShapeError):
        unpool(out, idx[..., :1])


def test_max_unpool_rejects_out_of_range_indices():
    x = zyx.ones(1, 1, 2, 2)
    bad = zyx.tensor(np.full((1, 1, 2, 2), 99, np.int64))
    with pytest.raises(IndexError, match="invalid max index"):
        F.max_unpool2d(x, bad, 2).numpy()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 3)
        self.b = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
        self.shared = self.a
        self.register_buffer("steps", zyx.tensor(0))
        self.register_buffer("cache", zyx.zeros(3), persistent=False)


@needs_torch
def test_module_traversal_and_buffers_match_torch():
    class TNet(tnn.Module):
        def __init__(self):
            super().__init__()
            self.a = tnn.Linear(2, 3)
            self.b = tnn.Sequential(tnn.Linear(3, 3), tnn.ReLU())
            self.shared = self.a
            self.register_buffer("steps", torch.tensor(0))
            self.register_buffer("cache", torch.zeros(3), persistent=False)

    ours, ref = _Net(), TNet()
    for kw in (dict(), dict(prefix="net"), dict(remove_duplicate=False)):
        assert [n for n, _ in ours.named_modules(**kw)] == [n for n, _ in ref.named_modules(**kw)]
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert "cache" not in ours.state_dict()
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in ref.named_buffers()]
    seen = []
    ours.apply(lambda m: seen.append(type(m).__name__))
    tseen = []
    ref.apply(lambda m: tseen.append(type(m).__name__))
    assert seen[:-1] == tseen[:-1] and len(seen) == len(tseen)   # the roots' names differ


def test_apply_initializes_and_requires_grad_freezes():
    net = _Net()

    def init_linear(m):
        if isinstance(m, nn.Linear):
            zyx.nn.init.constant_(m.weight, 0.5)

    assert net.apply(init_linear) is net
    assert np.all(net.b[0].weight.numpy() == 0.5)
    assert net.requires_grad_(False) is net
    assert not any(p.requires_grad for p in net.parameters())
    net.requires_grad_()
    assert all(p.requires_grad for p in net.parameters())


@needs_torch
def test_zero_grad_set_to_none_like_torch():
    net = nn.Linear(2, 2)
    tnet = tnn.Linear(2, 2)
    for m, x in ((net, zyx.ones(1, 2)), (tnet, torch.ones(1, 2))):
        (m(x).sum() * float("nan")).backward()
        m.zero_grad(set_to_none=False)
    np.testing.assert_array_equal(net.weight.grad.numpy(), tnet.weight.grad.numpy())
    assert np.all(net.weight.grad.numpy() == 0)
    net.zero_grad()
    tnet.zero_grad()
    assert net.weight.grad is None and tnet.weight.grad is None


@needs_torch
def test_generate_square_subsequent_mask_and_transformer_match_torch():
    np.testing.assert_array_equal(nn.Transformer.generate_square_subsequent_mask(4).numpy(),
                                  tnn.Transformer.generate_square_subsequent_mask(4).numpy())
    torch.manual_seed(0)
    ref = tnn.Transformer(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=1,
                          dim_feedforward=16, dropout=0.0, batch_first=True).eval()
    ours = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=1,
                          dim_feedforward=16, dropout=0.0, batch_first=True).eval()
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    src = np.random.randn(2, 5, 8).astype(np.float32)
    tgt = np.random.randn(2, 3, 8).astype(np.float32)
    mask = nn.Transformer.generate_square_subsequent_mask(3)
    zo = ours(zyx.tensor(src), zyx.tensor(tgt), tgt_mask=mask)
    to = ref(torch.tensor(src), torch.tensor(tgt),
             tgt_mask=tnn.Transformer.generate_square_subsequent_mask(3))
    _close(zo, to, 1e-4)
    for p in ours.parameters():     # xavier init of every matrix, as torch
        if p.ndim > 1:
            bound = np.sqrt(6 / sum(p.shape))
            assert np.abs(p.numpy()).max() <= bound
