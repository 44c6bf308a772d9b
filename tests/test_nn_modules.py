"""zyx.nn modules: registration and state_dict mechanics, and every layer loaded with a torch
state_dict reproducing torch's outputs (and gradients for a few)."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest

import zyx
from zyx import nn
import zyx.nn.functional as F

# every test runs on every device zyx finds (conftest `device`: the CPU, OpenCL on PoCL
# in CI, CUDA on a GPU machine)
pytestmark = pytest.mark.usefixtures("device")

try:
    import torch
    import torch.nn as tnn
except ImportError:
    torch = tnn = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


def Z(a, dtype=None):
    return zyx.Tensor(np.asarray(a), dtype=dtype)


def T(a):
    return torch.tensor(np.asarray(a))


def rnd(*shape, lo=-2.0, hi=2.0):
    return np.random.uniform(lo, hi, size=shape).astype(np.float32)


def close(z, ref, rtol=1e-4, atol=1e-5):
    got = z.numpy() if isinstance(z, zyx.Tensor) else np.asarray(z)
    exp = ref.detach().numpy() if torch is not None and isinstance(ref, torch.Tensor) else np.asarray(ref)
    assert got.shape == exp.shape, f"shape {got.shape} != {exp.shape}"
    np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol, equal_nan=True)


def port(zmod, tmod, as_numpy=True):
    """Load torch module's state into the zyx module (keys must match exactly)."""
    sd = tmod.state_dict()
    assert list(zmod.state_dict().keys()) == list(sd.keys())
    zmod.load_state_dict({k: v.numpy() for k, v in sd.items()} if as_numpy else sd)
    return zmod


# ---------------------------------------------------------------------------------------
# Module mechanics
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.ReLU())
        self.scale = zyx.Tensor(np.ones(6, np.float32), requires_grad=True)
        self.register_buffer("offset", zyx.zeros(6), persistent=True)
        self.register_buffer("cache", zyx.zeros(2), persistent=False)
        self.plain = zyx.zeros(3)   # no requires_grad: a plain attribute, not state

    def forward(self, x):
        return self.head(self.bn(self.conv(x)).relu()) * self.scale + self.offset


def test_registration_and_traversal():
    m = Net()
    names = [n for n, _ in m.named_parameters()]
    assert names == ["scale", "conv.weight", "conv.bias", "bn.weight", "bn.bias",
                     "head.1.weight", "head.1.bias"]
    assert len(list(m.parameters())) == 7 and all(p.requires_grad for p in m.parameters())
    assert [n for n, _ in m.named_buffers()] == ["offset", "cache", "bn.running_mean",
                                                "bn.running_var", "bn.num_batches_tracked"]
    assert list(m.state_dict().keys()) == [
        "scale", "offset", "conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean",
        "bn.running_var", "bn.num_batches_tracked", "head.1.weight", "head.1.bias"]
    assert [type(c).__name__ for c in m.children()] == ["Conv2d", "BatchNorm2d", "Sequential"]
    assert len(list(m.modules())) == 7
    assert "plain" not in m.state_dict() and isinstance(m.plain, zyx.Tensor)
    assert m.get_submodule("head.1") is m.head[1]
    # shared submodules and parameters are listed once
    shared = nn.Linear(2, 2)
    seq = nn.Sequential(shared, nn.ReLU(), shared)
    assert len(list(seq.parameters())) == 2
    with pytest.raises(AttributeError):
        m.nothing
    p = nn.Parameter(np.ones(2, np.float32))
    assert p.requires_grad and isinstance(p, zyx.Tensor)
    m.extra = p
    assert dict(m.named_parameters())["extra"] is p
    del m.scale
    assert "scale" not in dict(m.named_parameters())


def test_module_needs_super_init():
    class Bad(nn.Module):
        def __init__(self):
            self.w = zyx.zeros(2)

    with pytest.raises(zyx.ZyxError, match="super"):
        Bad()


def test_train_eval_zero_grad_and_dtype():
    m = Net()
    assert m.training and m.head[1].training
    m.eval()
    assert not m.training and not m.bn.training and not m.head[2].training
    m.train()
    assert m.bn.training
    for p in m.parameters():
        p.grad = zyx.ones(*p.shape)
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    w = m.conv.weight
    m.double()
    assert m.conv.weight is w and w.dtype == zyx.float64 and w.requires_grad
    assert m.bn.num_batches_tracked.dtype == zyx.int64   # integer buffers keep their dtype
    m.float()
    assert w.dtype == zyx.float32


def test_state_dict_round_trip_and_errors():
    a, b = Net(), Net()
    x = Z(rnd(2, 3, 5, 5))
    a.eval(), b.eval()
    assert not np.allclose(a(x).numpy(), b(x).numpy())
    w_before = b.conv.weight
    res = b.load_state_dict(a.state_dict())
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert b.conv.weight is w_before            # same tensor object, new value
    close(b(x), a(x).numpy(), 1e-6, 1e-6)
    # as in torch, state_dict values share storage with the module (they follow later
    # changes); clone() makes a snapshot that does not
    sd = a.state_dict()
    snap = {k: v.clone() for k, v in sd.items()}
    nn.init.zeros_(a.conv.bias)
    assert np.abs(sd["conv.bias"].numpy()).sum() == 0
    assert np.abs(snap["conv.bias"].numpy()).sum() > 0
    # errors name the key; nothing is loaded when loading fails
    bad = dict(sd)
    del bad["conv.bias"]
    with pytest.raises(zyx.ZyxError, match="conv.bias"):
        b.load_state_dict(bad)
    bad = dict(sd, extra=zyx.zeros(1))
    with pytest.raises(zyx.ZyxError, match="extra"):
        b.load_state_dict(bad)
    bad = dict(sd)
    bad["head.1.weight"] = zyx.zeros(6, 99)
    before = b.head[1].weight.numpy()
    with pytest.raises(zyx.ZyxError, match=r"head\.1\.weight.*\(6, 99\).*\(6, 100\)"):
        b.load_state_dict(bad)
    np.testing.assert_array_equal(b.head[1].weight.numpy(), before)
    with pytest.raises(zyx.ZyxError, match="size mismatch"):
        b.load_state_dict(bad, strict=False)
    partial = {"conv.bias": np.full(4, 7.0, np.float32), "unknown": np.zeros(1)}
    res = b.load_state_dict(partial, strict=False)
    assert res.unexpected_keys == ["unknown"] and "conv.weight" in res.missing_keys
    np.testing.assert_array_equal(b.conv.bias.numpy(), np.full(4, 7.0))


def test_containers_and_repr():
    seq = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert len(seq) == 3 and isinstance(seq[1], nn.ReLU) and isinstance(seq[-1], nn.Linear)
    assert len(seq[:2]) == 2
    x = Z(rnd(5, 3))
    close(seq(x), seq[2](seq[1](seq[0](x))).numpy(), 1e-6, 1e-6)
    ml = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    ml.append(nn.Tanh())
    ml.insert(0, nn.Identity())
    assert len(ml) == 5 and isinstance(ml[0], nn.Identity)
    assert [k for k in ml.state_dict()][:2] == ["1.weight", "1.bias"]
    md = nn.ModuleDict({"a": nn.Linear(2, 3)})
    assert list(md.state_dict()) == ["a.weight", "a.bias"] and "a" in md
    r = repr(seq)
    assert r == ("Sequential(\n  (0): Linear(in_features=3, out_features=4, bias=True)\n"
                 "  (1): ReLU()\n  (2): Linear(in_features=4, out_features=2, bias=True)\n)")
    assert repr(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)) == \
        "Conv2d(3, 8, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), bias=False)"


def test_deepcopy_is_independent():
    a = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    b = copy.deepcopy(a)
    assert b[0].weight is not a[0].weight and b[0].weight.requires_grad
    np.testing.assert_array_equal(b[0].weight.numpy(), a[0].weight.numpy())
    nn.init.zeros_(b[0].weight)
    assert np.abs(a[0].weight.numpy()).sum() > 0


def test_init_distributions():
    zyx.manual_seed(0)
    lin = nn.Linear(400, 300)
    w = lin.weight.numpy()
    bound = 1 / math.sqrt(400)
    assert np.abs(w).max() <= bound and abs(w.std() - bound / math.sqrt(3)) < 0.02 * bound
    assert np.abs(lin.bias.numpy()).max() <= bound
    t = zyx.zeros(200, 300)
    nn.init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu")
    assert abs(t.numpy().std() - math.sqrt(2 / 200)) < 0.01 * math.sqrt(2 / 200) * 3
    nn.init.xavier_uniform_(t, gain=2.0)
    a = 2.0 * math.sqrt(6 / 500)
    assert np.abs(t.numpy()).max() <= a and t.numpy().max() > 0.95 * a
    nn.init.xavier_normal_(t)
    assert abs(t.numpy().std() - math.sqrt(2 / 500)) < 0.05 * math.sqrt(2 / 500)
    nn.init.trunc_normal_(t, std=1.0, a=-0.5, b=0.5)
    assert np.abs(t.numpy()).max() <= 0.5
    nn.init.orthogonal_(t)
    q = t.numpy()
    np.testing.assert_allclose(q @ q.T, np.eye(200), atol=1e-4)
    conv = nn.Conv2d(6, 8, 3, groups=2)   # fan_in = 3 * 9
    assert np.abs(conv.weight.numpy()).max() <= 1 / math.sqrt(27)
    zyx.manual_seed(0)
    np.testing.assert_array_equal(nn.Linear(400, 300).weight.numpy(), w)   # reproducible
    assert nn.init.calculate_gain("leaky_relu", 0.2) == pytest.approx(math.sqrt(2 / 1.04))
    emb = nn.Embedding(50, 4, padding_idx=3)
    assert not emb.weight.numpy()[3].any() and emb.weight.numpy().std() > 0.5


# ---------------------------------------------------------------------------------------
# every layer against torch
def _same(zmod, tmod, *inputs, rtol=1e-4, atol=1e-5, train=False, as_numpy=True, **kw):
    port(zmod, tmod, as_numpy)
    zmod.train(train)
    tmod.train(train)
    zo = zmod(*[Z(a) if isinstance(a, np.ndarray) else a for a in inputs], **kw)
    to = tmod(*[T(a) if isinstance(a, np.ndarray) else a for a in inputs],
              **{k: (T(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()})
    if isinstance(zo, tuple):
        for a, b in zip(zo, to):
            if a is None:
                assert b is None
            else:
                close(a, b, rtol, atol)
    else:
        close(zo, to, rtol, atol)
    return zo, to


X4 = (2, 4, 9, 8)

LAYER_CASES = [
    ("Linear", lambda m: m.Linear(8, 5), [(3, 9, 8)]),
    ("Linear_nobias", lambda m: m.Linear(8, 5, bias=False), [(6, 8)]),
    ("Bilinear", lambda m: m.Bilinear(3, 4, 5), [(6, 3), (6, 4)]),
    ("Conv1d", lambda m: m.Conv1d(4, 6, 3, stride=2, padding=1), [(2, 4, 9)]),
    ("Conv2d", lambda m: m.Conv2d(4, 6, 3, padding=1), [X4]),
    ("Conv2d_groups", lambda m: m.Conv2d(4, 8, (3, 2), stride=(2, 1), dilation=(1, 2), groups=2), [X4]),
    ("Conv2d_reflect", lambda m: m.Conv2d(4, 3, 3, padding=2, padding_mode="reflect"), [X4]),
    ("Conv2d_circular_same", lambda m: m.Conv2d(4, 3, 3, padding="same", padding_mode="circular"), [X4]),
    ("Conv3d", lambda m: m.Conv3d(2, 3, 2, padding=(1, 0, 1)), [(1, 2, 4, 5, 3)]),
    ("ConvTranspose2d", lambda m: m.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1), [X4]),
    ("ConvTranspose2d_groups", lambda m: m.ConvTranspose2d(4, 6, 2, stride=2, groups=2, bias=False), [X4]),
    ("ConvTranspose1d", lambda m: m.ConvTranspose1d(4, 2, 3, stride=3), [(2, 4, 9)]),
    ("MaxPool2d", lambda m: m.MaxPool2d(3, 2, 1, ceil_mode=True), [X4]),
    ("AvgPool2d", lambda m: m.AvgPool2d(2), [X4]),
    ("AvgPool2d_pad", lambda m: m.AvgPool2d(3, 2, 1, count_include_pad=False), [X4]),
    ("AdaptiveAvgPool2d", lambda m: m.AdaptiveAvgPool2d((3, 2)), [X4]),
    ("Flatten", lambda m: m.Flatten(), [X4]),
    ("Unflatten", lambda m: m.Unflatten(1, (2, 2)), [X4]),
    ("LayerNorm", lambda m: m.LayerNorm((9, 8)), [X4]),
    ("LayerNorm_noaffine", lambda m: m.LayerNorm(8, elementwise_affine=False, eps=1e-3), [X4]),
    ("GroupNorm", lambda m: m.GroupNorm(2, 4), [X4]),
    ("RMSNorm", lambda m: m.RMSNorm(8), [X4]),
    ("InstanceNorm2d", lambda m: m.InstanceNorm2d(4, affine=True), [X4]),
    ("Dropout_eval", lambda m: m.Dropout(0.5), [X4]),
    ("Identity", lambda m: m.Identity(), [X4]),
    ("PReLU", lambda m: m.PReLU(4), [X4]),
    ("Softmax", lambda m: m.Softmax(dim=1), [X4]),
    ("LogSoftmax", lambda m: m.LogSoftmax(dim=-1), [X4]),
    ("GELU_tanh", lambda m: m.GELU("tanh"), [X4]),
    ("ConvTranspose3d", lambda m: m.ConvTranspose3d(2, 3, 2, stride=(2, 1, 1), padding=(0, 1, 0)),
     [(1, 2, 3, 4, 3)]),
    ("MaxPool1d", lambda m: m.MaxPool1d(3, 2, 1), [(2, 4, 9)]),
    ("AvgPool1d", lambda m: m.AvgPool1d(3, 2, 1, ceil_mode=True), [(2, 4, 9)]),
    ("MaxPool3d", lambda m: m.MaxPool3d(2, 1), [(1, 2, 3, 4, 3)]),
    ("AvgPool3d", lambda m: m.AvgPool3d((1, 2, 2)), [(1, 2, 3, 4, 3)]),
    ("AdaptiveAvgPool1d", lambda m: m.AdaptiveAvgPool1d(4), [(2, 4, 9)]),
    ("InstanceNorm1d", lambda m: m.InstanceNorm1d(4), [(2, 4, 9)]),
    ("Dropout2d_eval", lambda m: m.Dropout2d(0.5), [X4]),
    ("PixelShuffle", lambda m: m.Sequential(m.Conv2d(4, 8, 1), m.PixelShuffle(2)), [X4]),
    ("Sequential", lambda m: m.Sequential(m.Conv2d(4, 4, 3), m.SiLU(), m.MaxPool2d(2), m.Flatten(),
                                          m.Linear(4 * 3 * 3, 5), m.Tanh()), [X4]),
]


@needs_torch
@pytest.mark.parametrize("name,make,shapes", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_layer_matches_torch(name, make, shapes):
    torch.manual_seed(0)
    tmod = make(tnn)
    zmod = make(nn)
    _same(zmod, tmod, *[rnd(*s) for s in shapes], as_numpy=name != "Linear")


ACT_MODULES = ["ReLU", "ReLU6", "SiLU", "Tanh", "Sigmoid", "SELU", "Mish", "Hardsigmoid",
               "Hardswish", "Softsign", "LogSigmoid", "Tanhshrink", "GELU", "CELU"]


@needs_torch
def test_activation_modules_match_torch():
    x = rnd(3, 7, lo=-6, hi=6)
    for name in ACT_MODULES:
        close(getattr(nn, name)()(Z(x)), getattr(tnn, name)()(T(x)), 1e-5, 1e-6)
    for name, args in [("LeakyReLU", (0.2,)), ("ELU", (0.5,)), ("Hardtanh", (-2.0, 0.5)),
                       ("Softplus", (2.0, 3.0)), ("Threshold", (0.1, 20.0)), ("Softshrink", (0.3,)),
                       ("Hardshrink", (0.3,)), ("Softmin", (1,)), ("GLU", (0,))]:
        x2 = x[:2] if name == "GLU" else x
        close(getattr(nn, name)(*args)(Z(x2)), getattr(tnn, name)(*args)(T(x2)), 1e-5, 1e-6)


@needs_torch
def test_conv_transpose_output_size_matches_torch():
    torch.manual_seed(0)
    t, z = tnn.ConvTranspose2d(4, 3, 3, stride=2), nn.ConvTranspose2d(4, 3, 3, stride=2)
    port(z, t)
    x = rnd(*X4)
    close(z(Z(x), output_size=(20, 18)), t(T(x), output_size=(20, 18)), 1e-4, 1e-5)
    with pytest.raises(zyx.ShapeError, match="output size"):
        z(Z(x), output_size=(30, 18))


@needs_torch
def test_embedding_matches_torch():
    torch.manual_seed(0)
    t, z = tnn.Embedding(20, 6, padding_idx=0), nn.Embedding(20, 6, padding_idx=0)
    idx = np.array([[0, 5, 19], [3, 3, 7]])
    _same(z, t, idx)
    # the padding row gets no gradient
    z(Z(idx)).sum().backward()
    t(T(idx)).sum().backward()
    close(z.weight.grad, t.weight.grad)
    assert not z.weight.grad.numpy()[0].any()
    pre = rnd(5, 3)
    e = nn.Embedding.from_pretrained(Z(pre))
    assert not e.weight.requires_grad
    close(e(Z(np.array([4, 0]))), pre[[4, 0]])


@needs_torch
@pytest.mark.parametrize("cls,shape", [("BatchNorm1d", (8, 4)), ("BatchNorm1d", (6, 4, 5)),
                                       ("BatchNorm2d", X4), ("BatchNorm3d", (2, 4, 3, 2, 3))])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_matches_torch(cls, shape, momentum):
    t, z = getattr(tnn, cls)(4, momentum=momentum), getattr(nn, cls)(4, momentum=momentum)
    with torch.no_grad():
        t.weight.uniform_(0.5, 1.5)
        t.bias.uniform_(-1, 1)
    port(z, t)
    z.train(), t.train()
    for step in range(3):   # the running stats must follow torch step by step
        x = rnd(*shape) * (step + 1) + step
        close(z(Z(x)), t(T(x)), 1e-4, 1e-4)
    sd_t, sd_z = t.state_dict(), z.state_dict()
    for k in ("running_mean", "running_var"):
        close(sd_z[k], sd_t[k], 1e-5, 1e-5)
    assert sd_z["num_batches_tracked"].item() == 3 == sd_t["num_batches_tracked"].item()
    z.eval(), t.eval()
    x = rnd(*shape)
    close(z(Z(x)), t(T(x)), 1e-4, 1e-4)
    with pytest.raises(zyx.ShapeError, match="channels"):
        z(Z(rnd(*shape[:1], 3, *shape[2:])))


def test_batchnorm_numpy_reference_without_torch():
    bn = nn.BatchNorm1d(3, momentum=0.5)
    x = rnd(10, 3) * 2 + 1
    y = bn(Z(x)).numpy()
    ref = (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(bn.running_mean.numpy(), 0.5 * x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(bn.running_var.numpy(), 0.5 + 0.5 * x.var(0, ddof=1), rtol=1e-5)
    bn2 = nn.BatchNorm1d(3, track_running_stats=False)
    bn2.eval()    # no running stats: batch statistics even in eval
    np.testing.assert_allclose(bn2(Z(x)).numpy(), ref, rtol=1e-4, atol=1e-4)
    assert "running_mean" not in bn2.state_dict()


def test_batchnorm_running_stats_do_not_chain():
    """A training loop that never reads the running stats keeps their pending graph one
    step deep instead of growing a step longer every forward."""
    bn = nn.BatchNorm1d(3)
    x = Z(rnd(10, 3))

    def pending_nodes():
        order, _ = zyx._RT.graph.collect([bn.running_mean._id])
        return len(order)

    sizes = []
    for _ in range(6):
        bn(x).realize()
        sizes.append(pending_nodes())
    assert sizes[1] > 1 and sizes[-1] == sizes[1]
    np.testing.assert_allclose(bn.running_mean.numpy(), (1 - 0.9 ** 6) * x.numpy().mean(0),
                               rtol=1e-5, atol=1e-6)


def test_tape_gradients_of_module_parameters():
    zyx.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))
    x, y = Z(rnd(5, 4)), Z(np.array([0, 2, 1, 1, 0]))
    params = list(m.parameters())
    with zyx.Tape() as tape:
        loss = F.cross_entropy(m(x), y)
    grads = tape.gradient(loss, params)
    F.cross_entropy(m(x), y).backward()
    for p, g in zip(params, grads):
        np.testing.assert_allclose(g.numpy(), p.grad.numpy(), rtol=1e-5, atol=1e-7)
    # numpy check of the last bias: d(mean CE)/db = mean(softmax - onehot)
    logits = m(x).numpy()
    sm = np.exp(logits - logits.max(1, keepdims=True))
    sm /= sm.sum(1, keepdims=True)
    sm[np.arange(5), y.numpy()] -= 1
    np.testing.assert_allclose(grads[-1].numpy(), sm.mean(0), rtol=1e-4, atol=1e-6)


@needs_torch
@pytest.mark.parametrize("cls", ["RNNCell", "GRUCell", "LSTMCell"])
def test_recurrent_cells_match_torch(cls):
    torch.manual_seed(0)
    t, z = getattr(tnn, cls)(5, 7), getattr(nn, cls)(5, 7)
    port(z, t)
    xs = rnd(3, 4, 5)
    h_t = h_z = None
    for x in xs:   # three steps, feeding the state back
        h_t = t(T(x), h_t)
        h_z = z(Z(x), h_z)
    if cls == "LSTMCell":
        close(h_z[0], h_t[0], 1e-4, 1e-5)
        close(h_z[1], h_t[1], 1e-4, 1e-5)
        h, c = z(Z(xs[0, 0]))    # unbatched
        assert h.shape == (7,) and c.shape == (7,)
    else:
        close(h_z, h_t, 1e-4, 1e-5)
        assert z(Z(xs[0, 0])).shape == (7,)
    if cls == "RNNCell":
        t2, z2 = tnn.RNNCell(5, 7, nonlinearity="relu", bias=False), \
            nn.RNNCell(5, 7, nonlinearity="relu", bias=False)
        _same(z2, t2, xs[0])


@needs_torch
@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_attention_matches_torch(batch_first):
    torch.manual_seed(0)
    t = tnn.MultiheadAttention(8, 2, batch_first=batch_first)
    z = nn.MultiheadAttention(8, 2, batch_first=batch_first)
    port(z, t)
    z.eval(), t.eval()
    shp = (lambda L: (3, L, 8)) if batch_first else (lambda L: (L, 3, 8))
    q, k = rnd(*shp(5)), rnd(*shp(6))
    kpm = np.zeros((3, 6), bool)
    kpm[0, 4:] = True
    am = np.random.rand(5, 6) > 0.7
    am[:, 0] = False
    for kw in [dict(), dict(key_padding_mask=kpm), dict(attn_mask=am, average_attn_weights=False),
               dict(attn_mask=rnd(6, 5, 6), key_padding_mask=kpm), dict(need_weights=False)]:
        zo = z(Z(q), Z(k), Z(k), **{a: Z(b) if isinstance(b, np.ndarray) else b for a, b in kw.items()})
        to = t(T(q), T(k), T(k), **{a: T(b) if isinstance(b, np.ndarray) else b for a, b in kw.items()})
        close(zo[0], to[0], 1e-4, 1e-5)
        if to[1] is None:
            assert zo[1] is None
        else:
            close(zo[1], to[1], 1e-4, 1e-5)
    # unbatched input (L, E)
    u = q[0] if batch_first else q[:, 0]
    zo, to = z(Z(u), Z(u), Z(u)), t(T(u), T(u), T(u))
    close(zo[0], to[0], 1e-4, 1e-5)
    close(zo[1], to[1], 1e-4, 1e-5)


@needs_torch
def test_multihead_attention_kdim_vdim_matches_torch():
    torch.manual_seed(0)
    t = tnn.MultiheadAttention(8, 4, kdim=5, vdim=3, batch_first=True, bias=False)
    z = nn.MultiheadAttention(8, 4, kdim=5, vdim=3, batch_first=True, bias=False)
    _same(z, t, rnd(2, 4, 8), rnd(2, 6, 5), rnd(2, 6, 3))


@needs_torch
def test_causal_self_attention_matches_reference():
    torch.manual_seed(0)
    z = nn.CausalSelfAttention(12, 3)
    c_attn, c_proj = tnn.Linear(12, 36), tnn.Linear(12, 12)
    sd = {**{f"c_attn.{k}": v for k, v in c_attn.state_dict().items()},
          **{f"c_proj.{k}": v for k, v in c_proj.state_dict().items()}}
    z.load_state_dict(sd)
    x = rnd(2, 5, 12)
    # nanoGPT's forward in torch
    q, k, v = c_attn(T(x)).split(12, dim=2)
    q, k, v = (a.view(2, 5, 3, 4).transpose(1, 2) for a in (q, k, v))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = c_proj(y.transpose(1, 2).contiguous().view(2, 5, 12))
    z.eval()
    close(z(Z(x)), ref, 1e-4, 1e-5)


def test_positional_encoding_numpy_reference():
    pe = nn.PositionalEncoding(6, max_len=20)
    x = rnd(2, 7, 6)
    pos = np.arange(7)[:, None]
    div = np.exp(np.arange(0, 6, 2) * (-math.log(10000.0) / 6))
    table = np.zeros((7, 6))
    table[:, 0::2], table[:, 1::2] = np.sin(pos * div), np.cos(pos * div)
    close(pe(Z(x)), x + table, 1e-5, 1e-5)
    close(nn.PositionalEncoding(6, batch_first=False)(Z(x.transpose(1, 0, 2))),
          x.transpose(1, 0, 2) + table[:, None], 1e-5, 1e-5)
    assert pe.state_dict() == {}     # the table is not saved
    with pytest.raises(zyx.ShapeError, match="max_len"):
        pe(Z(rnd(1, 21, 6)))


@needs_torch
@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("norm_first,activation,batch_first", [(False, "relu", True),
                                                              (True, "gelu", False)])
def test_transformer_encoder_layer_matches_torch(norm_first, activation, batch_first):
    torch.manual_seed(0)
    kw = dict(dim_feedforward=16, norm_first=norm_first, activation=activation,
              batch_first=batch_first)
    t, z = tnn.TransformerEncoderLayer(8, 2, **kw), nn.TransformerEncoderLayer(8, 2, **kw)
    src = rnd(3, 5, 8) if batch_first else rnd(5, 3, 8)
    kpm = np.zeros((3, 5), bool)
    kpm[1, 3:] = True
    mask = np.triu(np.full((5, 5), -np.inf, np.float32), 1)
    _same(z, t, src, src_mask=mask, src_key_padding_mask=kpm)
    _same(z, t, src, src_mask=mask, is_causal=True)
    stack_t = tnn.TransformerEncoder(t, 2, enable_nested_tensor=False)
    stack_z = nn.TransformerEncoder(z, 2)
    _same(stack_z, stack_t, src)


@needs_torch
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_decoder_layer_matches_torch(norm_first):
    torch.manual_seed(0)
    kw = dict(dim_feedforward=16, norm_first=norm_first, batch_first=True)
    t, z = tnn.TransformerDecoderLayer(8, 2, **kw), nn.TransformerDecoderLayer(8, 2, **kw)
    tgt, mem = rnd(2, 4, 8), rnd(2, 6, 8)
    mask = np.triu(np.ones((4, 4), bool), 1)
    mkpm = np.zeros((2, 6), bool)
    mkpm[0, 5] = True
    _same(z, t, tgt, mem, tgt_mask=mask, memory_key_padding_mask=mkpm)
    _same(nn.TransformerDecoder(z, 2, norm=nn.LayerNorm(8)),
          tnn.TransformerDecoder(t, 2, norm=tnn.LayerNorm(8)), tgt, mem)


@needs_torch
def test_loss_modules_match_torch():
    x, y = rnd(6, 5), np.array([0, 4, 2, 2, 1, 3])
    w = rnd(5, lo=0.5, hi=2)
    z = nn.CrossEntropyLoss(weight=Z(w), label_smoothing=0.1)
    t = tnn.CrossEntropyLoss(weight=T(w), label_smoothing=0.1)
    assert list(z.state_dict()) == list(t.state_dict()) == ["weight"]
    close(z(Z(x), Z(y)), t(T(x), T(y)), 1e-5, 1e-6)
    p = np.random.rand(6, 5).astype(np.float32)
    for name in ("MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss", "BCEWithLogitsLoss"):
        close(getattr(nn, name)()(Z(x), Z(p)), getattr(tnn, name)()(T(x), T(p)), 1e-5, 1e-6)
    close(nn.BCELoss(reduction="sum")(Z(p), Z(p > 0.5).float()),
          tnn.BCELoss(reduction="sum")(T(p), T(p > 0.5).float()), 1e-5, 1e-4)
    lp = x - np.log(np.exp(x).sum(1, keepdims=True))
    close(nn.KLDivLoss(reduction="batchmean")(Z(lp), Z(p)),
          tnn.KLDivLoss(reduction="batchmean")(T(lp), T(p)), 1e-5, 1e-6)
    close(nn.NLLLoss(ignore_index=2)(Z(lp), Z(y)), tnn.NLLLoss(ignore_index=2)(T(lp), T(y)), 1e-5, 1e-6)


def test_dropout_module_train_and_eval():
    d = nn.Dropout(0.25)
    x = zyx.ones(100, 100)
    zyx.manual_seed(1)
    y = d(x).numpy()
    assert abs((y == 0).mean() - 0.25) < 0.02
    d.eval()
    np.testing.assert_array_equal(d(x).numpy(), x.numpy())
    assert repr(d) == "Dropout(p=0.25, inplace=False)"


# ---------------------------------------------------------------------------------------
# gradients of module parameters against torch
GRAD_MODULES = [
    ("Conv2d+BatchNorm2d", lambda m: m.Sequential(m.Conv2d(4, 3, 3, padding=1, stride=2),
                                                  m.BatchNorm2d(3), m.ReLU(), m.Flatten(),
                                                  m.Linear(3 * 5 * 4, 5)), X4),
    ("ConvTranspose2d+GroupNorm", lambda m: m.Sequential(m.ConvTranspose2d(4, 4, 2, stride=2),
                                                         m.GroupNorm(2, 4), m.Flatten(),
                                                         m.Linear(4 * 18 * 16, 5)), X4),
    ("Embedding+LayerNorm+MHA", lambda m: _EmbAttn(m), None),
    ("LSTMCell", lambda m: _LSTMHead(m), (4, 6)),
]


def _EmbAttn(m):
    class EmbAttn(m.Module):
        def __init__(self):
            super().__init__()
            self.emb = m.Embedding(11, 8)
            self.norm = m.LayerNorm(8)
            self.attn = m.MultiheadAttention(8, 2, batch_first=True)
            self.out = m.Linear(8, 5)

        def forward(self, idx):
            h = self.norm(self.emb(idx))
            a, _ = self.attn(h, h, h, need_weights=False)
            return self.out(a + h).mean(1)
    return EmbAttn()


def _LSTMHead(m):
    class LSTMHead(m.Module):
        def __init__(self):
            super().__init__()
            self.cell = m.LSTMCell(6, 5)

        def forward(self, x):
            h, c = self.cell(x)
            h, c = self.cell(x * 0.5, (h, c))
            return h + c
    return LSTMHead()


@needs_torch
@pytest.mark.parametrize("name,make,shape", GRAD_MODULES, ids=[g[0] for g in GRAD_MODULES])
def test_parameter_gradients_match_torch(name, make, shape):
    torch.manual_seed(0)
    t, z = make(tnn), make(nn)
    port(z, t)
    if shape is None:
        x = np.random.randint(0, 11, size=(3, 7))
    else:
        x = rnd(*shape)
    y = np.array([0, 3, 1, 4][:x.shape[0]] + [2] * max(0, x.shape[0] - 4))
    lz = F.cross_entropy(z(Z(x)), Z(y))
    lt = torch.nn.functional.cross_entropy(t(T(x)), T(y))
    close(lz, lt, 1e-4, 1e-5)
    lz.backward()
    lt.backward()
    tg = dict(t.named_parameters())
    for n, p in z.named_parameters():
        assert p.grad is not None, n
        close(p.grad, tg[n].grad, 2e-3, 2e-5)


def test_clip_grad_then_step_is_one_pass():
    """backward(), clipping and the optimizer step realize together, and afterwards the
    clipped gradients and the norm are stored values (reading them computes nothing)."""
    zyx.manual_seed(0)
    z = nn.Linear(6, 4)
    w0 = z.weight.numpy()
    opt = zyx.optim.SGD(z.parameters(), lr=0.1)
    x = rnd(5, 6) * 10
    before = zyx.stats()["realizations"]
    (z(Z(x)) ** 2).sum().backward()
    total = nn.utils.clip_grad_norm_(z.parameters(), 1.5)
    opt.step()
    assert zyx.stats()["realizations"] - before == 1
    g, n = z.weight.grad.numpy(), total.item()
    assert zyx.stats()["realizations"] - before == 1      # stored by the step's plan
    assert n > 1.5
    gb = z.bias.grad.numpy()
    assert abs(np.sqrt((g ** 2).sum() + (gb ** 2).sum()) - 1.5) < 1e-3
    close(z.weight, w0 - 0.1 * g, 1e-5, 1e-6)


@needs_torch
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_matches_torch(norm_type):
    torch.manual_seed(0)
    t, z = tnn.Linear(6, 4), nn.Linear(6, 4)
    port(z, t)
    x = rnd(5, 6) * 10
    (z(Z(x)) ** 2).sum().backward()
    (t(T(x)) ** 2).sum().backward()
    nz = nn.utils.clip_grad_norm_(z.parameters(), 1.5, norm_type)
    nt = torch.nn.utils.clip_grad_norm_(t.parameters(), 1.5, norm_type)
    close(nz, nt, 1e-5, 1e-5)
    for (n, p), (_, q) in zip(z.named_parameters(), t.named_parameters()):
        close(p.grad, q.grad, 1e-5, 1e-6)
    nn.utils.clip_grad_value_(z.parameters(), 0.1)
    torch.nn.utils.clip_grad_value_(t.parameters(), 0.1)
    close(z.weight.grad, t.weight.grad, 1e-5, 1e-6)
    v = nn.utils.parameters_to_vector(z.parameters())
    close(v, torch.nn.utils.parameters_to_vector(t.parameters()))
    w = z.weight
    nn.utils.vector_to_parameters(v * 2, z.parameters())
    assert z.weight is w
    close(z.bias, 2 * t.bias.detach().numpy())


def test_state_dict_through_safetensors_file(tmp_path):
    a, b = Net(), Net()
    a(Z(rnd(2, 3, 5, 5))).realize()          # one training step moves the BatchNorm stats
    path = str(tmp_path / "net.safetensors")
    zyx.save(a.state_dict(), path)
    b.load_state_dict(zyx.load(path))
    a.eval(), b.eval()
    x = Z(rnd(2, 3, 5, 5))
    np.testing.assert_array_equal(b(x).numpy(), a(x).numpy())
    assert b.bn.num_batches_tracked.item() == 1
