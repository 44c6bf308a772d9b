"""nn.RNN / nn.LSTM / nn.GRU against torch: weights loaded from torch's state_dict give the
same outputs, final states and gradients; every option (layers, bidirectional, batch_first,
bias, initial states, unbatched input); pad_sequence; the LSTM's per-step kernels are shared."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx import nn

try:
    import torch
    import torch.nn as tnn
except ImportError:
    torch = tnn = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


def _pair(kind, **kw):
    """(zyx module, torch module) with torch's weights loaded into zyx."""
    torch.manual_seed(0)
    ref = getattr(tnn, kind)(**kw).double()
    ours = getattr(nn, kind)(**kw).double()
    ours.load_state_dict({k: v.detach().numpy() for k, v in ref.state_dict().items()})
    return ours, ref


def _close(z, t, tol=1e-5):
    np.testing.assert_allclose(z.numpy(), t.detach().numpy(), rtol=tol, atol=tol)


CONFIGS = [
    dict(num_layers=1),
    dict(num_layers=2, bidirectional=True),
    dict(num_layers=2, batch_first=True, bias=False),
    dict(num_layers=3, bidirectional=True, batch_first=True),
]


@needs_torch
@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_outputs_states_and_gradients_match_torch(kind, cfg):
    ours, ref = _pair(kind, input_size=4, hidden_size=5, **cfg)
    assert list(ours.state_dict()) == list(ref.state_dict())
    shape = (3, 6, 4) if cfg.get("batch_first") else (6, 3, 4)
    x = np.random.randn(*shape)
    zx, tx = zyx.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    zo, zh = ours(zx)
    to, th = ref(tx)
    _close(zo, to)
    if kind == "LSTM":
        _close(zh[0], th[0])
        _close(zh[1], th[1])
        (to.sum() + th[1].sum()).backward()
        (zo.sum() + zh[1].sum()).backward()
    else:
        _close(zh, th)
        (to.sum() + (th ** 2).sum()).backward()
        (zo.sum() + (zh ** 2).sum()).backward()
    _close(zx.grad, tx.grad)
    tgrads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        _close(p.grad, tgrads[name].grad)


@needs_torch
@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
def test_initial_states_and_unbatched_input(kind):
    ours, ref = _pair(kind, input_size=3, hidden_size=4, num_layers=2, bidirectional=True)
    x = np.random.randn(5, 2, 3)
    h0 = np.random.randn(4, 2, 4)
    c0 = np.random.randn(4, 2, 4)
    zs = (zyx.tensor(h0), zyx.tensor(c0)) if kind == "LSTM" else zyx.tensor(h0)
    ts = (torch.tensor(h0), torch.tensor(c0)) if kind == "LSTM" else torch.tensor(h0)
    zo, _ = ours(zyx.tensor(x), zs)
    to, _ = ref(torch.tensor(x), ts)
    _close(zo, to)
    zs1 = (zyx.tensor(h0[:, 0]), zyx.tensor(c0[:, 0])) if kind == "LSTM" else zyx.tensor(h0[:, 0])
    ts1 = (torch.tensor(h0[:, 0]), torch.tensor(c0[:, 0])) if kind == "LSTM" else \
        torch.tensor(h0[:, 0])
    zo, zh = ours(zyx.tensor(x[:, 0]), zs1)
    to, th = ref(torch.tensor(x[:, 0]), ts1)
    assert zo.shape == tuple(to.shape) == (5, 8)
    _close(zo, to)
    _close(zh[0] if kind == "LSTM" else zh, th[0] if kind == "LSTM" else th)


@needs_torch
def test_lstm_forward_template_replays_exactly():
    """An LSTM layer's steps are traced on the first call of a structure and added from
    the template afterwards (rnn._lstm_nodes): later calls, with new inputs, with h0 and
    c0 one tensor or two, give torch's values and gradients."""
    from zyx.nn.modules import rnn
    ours, ref = _pair("LSTM", input_size=3, hidden_size=4)
    rnn._FORWARD_TEMPLATES.clear()
    for k, same in enumerate((True, True, False, False, True)):
        x = np.random.randn(7, 2, 3)
        h0 = np.random.randn(1, 2, 4)
        c0 = h0 if same else np.random.randn(1, 2, 4)
        zx = zyx.tensor(x, requires_grad=True)
        zh0 = zyx.tensor(h0, requires_grad=True)
        zc0 = zh0 if same else zyx.tensor(c0, requires_grad=True)
        tx = torch.tensor(x, requires_grad=True)
        th0 = torch.tensor(h0, requires_grad=True)
        tc0 = th0 if same else torch.tensor(c0, requires_grad=True)
        zo, (zh, zc) = ours(zx, (zh0, zc0))
        to, (th, tc) = ref(tx, (th0, tc0))
        ours.zero_grad()
        ref.zero_grad()
        (zo.sum() + (zc ** 2).sum()).backward()
        (to.sum() + (tc ** 2).sum()).backward()
        for a, b in ((zo, to), (zh, th), (zc, tc), (zx.grad, tx.grad), (zh0.grad, th0.grad)):
            _close(a, b)
        if not same:
            _close(zc0.grad, tc0.grad)
        tgrads = dict(ref.named_parameters())
        for name, p in ours.named_parameters():
            _close(p.grad, tgrads[name].grad)
    # (each layer reads its own slice of h0 and c0: one structure, traced once, replayed)
    assert len(rnn._FORWARD_TEMPLATES) == 1
    assert rnn._FORWARD_TEMPLATES.replayable() == 1


@needs_torch
def test_relu_rnn_and_dropout_between_layers():
    ours, ref = _pair("RNN", input_size=3, hidden_size=4, nonlinearity="relu")
    x = np.random.randn(4, 2, 3)
    _close(ours(zyx.tensor(x))[0], ref(torch.tensor(x))[0])
    m = nn.LSTM(3, 4, num_layers=2, dropout=0.5)
    a = m(zyx.tensor(x, dtype=zyx.float32))[0].numpy()
    b = m(zyx.tensor(x, dtype=zyx.float32))[0].numpy()
    assert not np.allclose(a, b)             # dropout active in training mode
    m.eval()
    np.testing.assert_array_equal(m(zyx.tensor(x, dtype=zyx.float32))[0].numpy(),
                                  m(zyx.tensor(x, dtype=zyx.float32))[0].numpy())


def test_init_range_and_parameter_shapes_follow_torch():
    m = nn.LSTM(10, 20, num_layers=2, bidirectional=True)
    assert m.weight_ih_l0.shape == (80, 10) and m.weight_ih_l1.shape == (80, 40)
    assert m.weight_hh_l1_reverse.shape == (80, 20) and m.bias_hh_l0.shape == (80,)
    bound = 1 / np.sqrt(20)
    for p in m.parameters():
        v = p.numpy()
        assert np.abs(v).max() <= bound and np.abs(v).max() > 0.8 * bound


def test_bad_inputs_raise_like_torch():
    m = nn.GRU(3, 4)
    with pytest.raises(RuntimeError, match="input_size"):
        m(zyx.zeros(5, 2, 7))
    with pytest.raises(ValueError, match="2D or 3D"):
        m(zyx.zeros(5))
    with pytest.raises(RuntimeError, match="Expected hidden size"):
        m(zyx.zeros(5, 2, 3), zyx.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="nonlinearity"):
        nn.RNN(3, 4, nonlinearity="gelu")
    with pytest.raises(ValueError, match="dropout"):
        nn.LSTM(3, 4, dropout=1.5)


def test_lstm_step_kernels_are_shared_across_timesteps():
    """A longer sequence adds kernel calls but little code to compile: every timestep's
    heavy kernels are the same source; what is new per step is the small copy of its
    projected input (and of its output gradient). Measured: ~1.3 distinct kernels and
    ~80 IR ops per extra step (~190 before c was stored and W_hh read through a flip)."""
    from zyx.runtime import RT

    def kernels(seq_len):
        zyx.manual_seed(0)
        m = nn.LSTM(8, 16, batch_first=True)
        opt = zyx.optim.Adam(m.parameters())
        x = zyx.randn(4, seq_len, 8)
        before = set(RT.plans)
        out, _ = m(x)
        out.sum().backward()
        opt.step()
        plans = [p for k, p in RT.plans.items() if k not in before]
        calls = [st.kernel for p in plans for st in p.steps if st.kernel is not None]
        distinct = set(calls)
        return len(calls), len(distinct), sum(len(k.ops) for k in distinct)

    (c5, d5, ops5), (c17, d17, ops17) = kernels(5), kernels(17)
    assert c17 - c5 >= 12 * 4                      # the steps are there (4+ kernels each)...
    assert (d17 - d5) / 12 <= 2, (d5, d17)        # ...but mostly compiled once
    assert (ops17 - ops5) / 12 <= 120, (ops5, ops17)


@needs_torch
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_sequence_matches_torch(batch_first, side):
    from zyx.nn.utils.rnn import pad_sequence
    seqs = [np.random.randn(n, 2).astype(np.float32) for n in (3, 1, 4)]
    ours = pad_sequence([zyx.tensor(s) for s in seqs], batch_first=batch_first,
                        padding_value=-1.0, padding_side=side)
    ref = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs],
                                          batch_first=batch_first, padding_value=-1.0,
                                          padding_side=side)
    np.testing.assert_array_equal(ours.numpy(), ref.numpy())
    with pytest.raises(ValueError, match="padding_side"):
        pad_sequence([zyx.tensor(seqs[0])], padding_side="middle")
