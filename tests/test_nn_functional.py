"""zyx.nn.functional against PyTorch (when installed) and numpy references.

Shapes are shared between tests where possible: each new kernel costs a C compilation."""
from __future__ import annotations


import numpy as np
import pytest

import zyx
import zyx.nn.functional as F

# every test runs on every device zyx finds (conftest `device`: the CPU, OpenCL on PoCL
# in CI, CUDA on a GPU machine)
pytestmark = pytest.mark.usefixtures("device")

try:
    import torch
    import torch.nn.functional as TF
except ImportError:   # numpy references still run
    torch = TF = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


def Z(a, dtype=None):
    return zyx.Tensor(np.asarray(a), dtype=dtype)


def T(a):
    return torch.tensor(np.asarray(a))


def close(z, ref, rtol=1e-4, atol=1e-5):
    got = z.numpy() if isinstance(z, zyx.Tensor) else np.asarray(z)
    exp = ref.detach().numpy() if torch is not None and isinstance(ref, torch.Tensor) else np.asarray(ref)
    assert got.shape == exp.shape, f"shape {got.shape} != {exp.shape}"
    np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol, equal_nan=True)


def rnd(*shape, lo=-2.0, hi=2.0):
    return np.random.uniform(lo, hi, size=shape).astype(np.float32)


X4 = (2, 4, 9, 8)   # the conv/pool input shape most tests share


# ---------------------------------------------------------------------------------------
# numpy references (run without torch)
def np_conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    s, p, d = (stride,) * 2, (padding,) * 2, (dilation,) * 2
    x = np.pad(x, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])))
    n, cin, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    oh = (h - d[0] * (kh - 1) - 1) // s[0] + 1
    ow = (wd - d[1] * (kw - 1) - 1) // s[1] + 1
    out = np.zeros((n, cout, oh, ow), np.float64)
    og = cout // groups
    for co in range(cout):
        g = co // og
        for i in range(kh):
            for j in range(kw):
                patch = x[:, g * cg:(g + 1) * cg, i * d[0]:i * d[0] + s[0] * (oh - 1) + 1:s[0],
                          j * d[1]:j * d[1] + s[1] * (ow - 1) + 1:s[1]]
                out[:, co] += np.einsum("nchw,c->nhw", patch, w[co, :, i, j])
    if b is not None:
        out += b[None, :, None, None]
    return out


def np_log_softmax(x, axis):
    m = x.max(axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis, keepdims=True))


@pytest.mark.parametrize("stride,padding,dilation,groups", [(1, 1, 1, 1), (2, 0, 1, 2), (1, 2, 2, 4)])
def test_conv2d_numpy_reference(stride, padding, dilation, groups):
    x, w, b = rnd(*X4), rnd(8, 4 // groups, 3, 3), rnd(8)
    z = F.conv2d(Z(x), Z(w), Z(b), stride, padding, dilation, groups)
    close(z, np_conv2d(x, w, b, stride, padding, dilation, groups), 1e-4, 1e-4)


def test_linear_numpy_reference():
    x, w, b = rnd(5, 7), rnd(3, 7), rnd(3)
    close(F.linear(Z(x), Z(w), Z(b)), x @ w.T + b)
    close(F.linear(Z(x[0]), Z(w)), x[0] @ w.T)
    with pytest.raises(zyx.ShapeError, match="linear"):
        F.linear(Z(x), Z(rnd(3, 6)))


def test_layer_norm_numpy_reference():
    x, w, b = rnd(3, 4, 6), rnd(4, 6), rnd(4, 6)
    m = x.mean((1, 2), keepdims=True)
    v = x.var((1, 2), keepdims=True)
    ref = (x - m) / np.sqrt(v + 1e-5) * w + b
    close(F.layer_norm(Z(x), (4, 6), Z(w), Z(b)), ref, 1e-4, 1e-4)
    with pytest.raises(zyx.ShapeError, match="normalized_shape"):
        F.layer_norm(Z(x), (5,))


def test_cross_entropy_numpy_reference():
    x = rnd(6, 5)
    y = np.array([0, 4, 2, 2, 1, 3])
    lp = np_log_softmax(x.astype(np.float64), 1)
    nll = -lp[np.arange(6), y]
    close(F.cross_entropy(Z(x), Z(y)), nll.mean(), 1e-5, 1e-6)
    close(F.cross_entropy(Z(x), Z(y), reduction="none"), nll, 1e-5, 1e-6)
    close(F.cross_entropy(Z(x), Z(y), reduction="sum"), nll.sum(), 1e-5, 1e-5)
    w = np.array([1.0, 2.0, 0.5, 1.5, 3.0], np.float32)
    close(F.cross_entropy(Z(x), Z(y), weight=Z(w)), (nll * w[y]).sum() / w[y].sum(), 1e-5, 1e-6)
    # an ignored target counts neither in the sum nor in the mean's denominator
    y2 = y.copy()
    y2[1] = -100
    keep = y2 != -100
    close(F.cross_entropy(Z(x), Z(y2)), nll[keep].mean(), 1e-5, 1e-6)
    # huge logits stay finite (log_softmax is max-shifted)
    big = np.array([[1000.0, 0.0, -1000.0]], np.float32)
    close(F.cross_entropy(Z(big), Z(np.array([1]))), 1000.0, 1e-6, 1e-3)


# ---------------------------------------------------------------------------------------
# convolutions against torch
CONV_CASES = [  # (cout, kernel, stride, padding, dilation, groups)
    (6, 3, 1, 1, 1, 1), (6, 3, 2, 0, 1, 2), (4, (3, 2), (2, 1), (1, 0), (2, 1), 4),
    (6, 1, 1, 0, 1, 1), (6, 2, 2, 0, 1, 1), (2, 2, 7, 0, 2, 1), (6, 3, 1, "same", 2, 1),
    (6, (4, 3), 1, "same", 1, 2), (6, 3, 1, "valid", 1, 1)]


@needs_torch
@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("cout,k,s,p,d,g", CONV_CASES)
def test_conv2d_matches_torch(cout, k, s, p, d, g):
    k2 = (k, k) if isinstance(k, int) else k
    x, w, b = rnd(*X4), rnd(cout, 4 // g, *k2), rnd(cout)
    close(F.conv2d(Z(x), Z(w), Z(b), s, p, d, g),
          TF.conv2d(T(x), T(w), T(b), s, p, d, g), 1e-4, 1e-4)


@needs_torch
@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("cout,k,s,p,d,g", CONV_CASES)
def test_conv2d_gradients_match_torch(cout, k, s, p, d, g):
    """conv is one composite autograd op (hand-written backward: a transposed conv for the
    input, a window reduce for the weight): first and second derivatives against torch."""
    import torch as _t
    k2 = (k, k) if isinstance(k, int) else k
    x, w, b = rnd(*X4), rnd(cout, 4 // g, *k2), rnd(cout)
    zx, zw, zb = (zyx.Tensor(a, requires_grad=True) for a in (x, w, b))
    tx, tw, tb = (_t.tensor(a, requires_grad=True) for a in (x, w, b))
    zy = F.conv2d(zx, zw, zb, s, p, d, g)
    ty = TF.conv2d(tx, tw, tb, s, p, d, g)
    assert F.conv2d(zx, zw, None, s, p, d, g).grad_fn == "conv"
    gx, gw, gb = zyx.autograd.grad((zy * zy).sum(), [zx, zw, zb], create_graph=True)
    hx, hw, hb = _t.autograd.grad((ty * ty).sum(), [tx, tw, tb], create_graph=True)
    for z_, t_ in ((gx, hx), (gw, hw), (gb, hb)):
        close(z_, t_, 1e-4, 1e-3)
    # second order: d/dw of sum(grad_x ** 2)
    g2 = zyx.autograd.grad((gx * gx).sum(), [zw])[0]
    h2 = _t.autograd.grad((hx * hx).sum(), [tw])[0]
    close(g2, h2, 1e-3, 1e-5 * float(h2.abs().max()))   # (values up to ~1e6: cancellation)


@needs_torch
def test_conv_under_no_grad_and_tape():
    import torch as _t
    x, w = rnd(*X4), rnd(3, 4, 3, 3)
    with zyx.no_grad():
        y = F.conv2d(zyx.Tensor(x, requires_grad=True), zyx.Tensor(w))
    assert not y.requires_grad and y.grad_fn is None
    zw = zyx.Tensor(w)
    with zyx.autograd.Tape() as tape:
        tape.watch(zw) if hasattr(tape, "watch") else None
        out = F.conv2d(zyx.Tensor(x), zw).sum()
    tw = _t.tensor(w, requires_grad=True)
    TF.conv2d(T(x), tw).sum().backward()
    close(tape.gradient(out, [zw])[0], tw.grad, 1e-4, 1e-3)


@needs_torch
def test_conv1d_conv3d_and_unbatched_match_torch():
    x1, w1, b1 = rnd(2, 3, 10), rnd(5, 3, 3), rnd(5)
    close(F.conv1d(Z(x1), Z(w1), Z(b1), stride=2, padding=1),
          TF.conv1d(T(x1), T(w1), T(b1), stride=2, padding=1), 1e-4, 1e-4)
    close(F.conv1d(Z(x1[0]), Z(w1), padding="same"), TF.conv1d(T(x1[0]), T(w1), padding="same"),
          1e-4, 1e-4)
    x3, w3 = rnd(1, 2, 5, 6, 4), rnd(3, 2, 2, 3, 2)
    close(F.conv3d(Z(x3), Z(w3), stride=(1, 2, 1), padding=1, dilation=(1, 1, 2)),
          TF.conv3d(T(x3), T(w3), stride=(1, 2, 1), padding=1, dilation=(1, 1, 2)), 1e-4, 1e-4)


@needs_torch
@pytest.mark.parametrize("s,p,op,d,g", [(1, 0, 0, 1, 1), (2, 1, 1, 1, 1), (2, 0, 0, 2, 2),
                                         (3, 2, 1, 1, 2), (2, 1, 0, 1, 4), (1, 2, 0, 1, 1)])
def test_conv_transpose2d_matches_torch(s, p, op, d, g):
    x = rnd(*X4)
    w, b = rnd(4, 6 // 2 if g == 2 else (2 if g == 4 else 6), 3, 3), None
    b = rnd(w.shape[1] * g)
    close(F.conv_transpose2d(Z(x), Z(w), Z(b), s, p, op, g, d),
          TF.conv_transpose2d(T(x), T(w), T(b), s, p, op, g, d), 1e-4, 1e-4)


@needs_torch
def test_conv_transpose1d_3d_match_torch():
    x1, w1 = rnd(2, 3, 7), rnd(3, 2, 4)
    close(F.conv_transpose1d(Z(x1), Z(w1), stride=3, padding=1, output_padding=2),
          TF.conv_transpose1d(T(x1), T(w1), stride=3, padding=1, output_padding=2), 1e-4, 1e-4)
    x3, w3 = rnd(1, 2, 3, 4, 3), rnd(2, 3, 2, 2, 3)
    close(F.conv_transpose3d(Z(x3), Z(w3), stride=2), TF.conv_transpose3d(T(x3), T(w3), stride=2),
          1e-4, 1e-4)


def test_conv_errors_name_shapes():
    x = Z(rnd(*X4))
    with pytest.raises(zyx.ShapeError, match=r"groups=3"):
        F.conv2d(x, Z(rnd(6, 4, 3, 3)), groups=3)
    with pytest.raises(zyx.ShapeError, match=r"\(2, 4, 9, 8\)"):
        F.conv2d(x, Z(rnd(6, 4, 10, 3)))
    with pytest.raises(zyx.ShapeError, match="4-D"):
        F.conv2d(Z(rnd(9, 8)), Z(rnd(6, 4, 3, 3)))
    with pytest.raises(zyx.ZyxError, match="same"):
        F.conv2d(x, Z(rnd(6, 4, 3, 3)), stride=2, padding="same")
    with pytest.raises(zyx.ShapeError, match="output_padding"):
        F.conv_transpose2d(x, Z(rnd(4, 2, 3, 3)), stride=1, output_padding=1)


def test_conv_bias_relu_is_one_kernel(kernel_counter):
    x, w, b = Z(rnd(*X4)), Z(rnd(6, 4, 3, 3)), Z(rnd(6))
    y = F.relu(F.conv2d(x, w, b, padding=1))
    n, _ = kernel_counter(lambda: y.realize())
    assert n == 1
    close(y, np.maximum(np_conv2d(x.numpy(), w.numpy(), b.numpy(), padding=1), 0), 1e-4, 1e-4)


# ---------------------------------------------------------------------------------------
# pooling, resampling, padding
@needs_torch
@pytest.mark.parametrize("k,s,p,d,ceil", [(2, None, 0, 1, False), (3, 2, 1, 1, False),
                                          (3, 2, 1, 1, True), (3, 2, 0, 2, True),
                                          ((2, 3), (1, 2), (1, 1), 1, True)])
def test_max_pool2d_matches_torch(k, s, p, d, ceil):
    x = rnd(*X4)
    close(F.max_pool2d(Z(x), k, s, p, d, ceil), TF.max_pool2d(T(x), k, s, p, d, ceil))


@needs_torch
@pytest.mark.parametrize("k,s,p,ceil,cip", [(2, None, 0, False, True), (3, 2, 1, False, True),
                                            (3, 2, 1, True, True), (3, 2, 1, True, False),
                                            ((2, 3), (1, 2), (1, 1), True, False)])
def test_avg_pool2d_matches_torch(k, s, p, ceil, cip):
    x = rnd(*X4)
    close(F.avg_pool2d(Z(x), k, s, p, ceil, cip), TF.avg_pool2d(T(x), k, s, p, ceil, cip))


@needs_torch
def test_pool1d_3d_adaptive_and_divisor_match_torch():
    x = rnd(*X4)
    close(F.avg_pool2d(Z(x), 3, 2, 1, divisor_override=2),
          TF.avg_pool2d(T(x), 3, 2, 1, divisor_override=2))
    close(F.max_pool1d(Z(x[0]), 3, 2, 1), TF.max_pool1d(T(x[0]), 3, 2, 1))
    close(F.avg_pool1d(Z(x[0]), 2), TF.avg_pool1d(T(x[0]), 2))
    close(F.max_pool3d(Z(x[:1]), 2), TF.max_pool3d(T(x[:1]), 2))
    for size in [(3, 4), (4, 3), 1, (None, 5)]:
        close(F.adaptive_avg_pool2d(Z(x), size), TF.adaptive_avg_pool2d(T(x), size))


def test_max_pool2d_numpy_reference_and_int_dtype():
    x = np.random.randint(-50, 50, size=(1, 2, 4, 6)).astype(np.int32)
    ref = x.reshape(1, 2, 2, 2, 3, 2).max((3, 5))
    got = F.max_pool2d(Z(x), 2)
    assert got.dtype == zyx.int32
    np.testing.assert_array_equal(got.numpy(), ref)


@needs_torch
@pytest.mark.parametrize("kw", [dict(scale_factor=2), dict(size=(5, 11)), dict(size=(4, 4)),
                                dict(scale_factor=(0.5, 1.5))])
@pytest.mark.parametrize("mode,ac", [("nearest", None), ("bilinear", False), ("bilinear", True),
                                     ("nearest-exact", None), ("area", None)])
def test_interpolate_matches_torch(kw, mode, ac):
    x = rnd(*X4)
    close(F.interpolate(Z(x), mode=mode, align_corners=ac, **kw),
          TF.interpolate(T(x), mode=mode, align_corners=ac, **kw), 1e-5, 1e-5)


@needs_torch
def test_interpolate_linear_1d_matches_torch():
    x = rnd(2, 3, 7)
    for ac in (False, True):
        close(F.interpolate(Z(x), size=12, mode="linear", align_corners=ac),
              TF.interpolate(T(x), size=12, mode="linear", align_corners=ac), 1e-5, 1e-5)
    x3 = rnd(1, 2, 3, 4, 5)
    close(F.interpolate(Z(x3), size=(4, 3, 7), mode="trilinear"),
          TF.interpolate(T(x3), size=(4, 3, 7), mode="trilinear"), 1e-5, 1e-5)
    close(F.interpolate(Z(x3), scale_factor=2), TF.interpolate(T(x3), scale_factor=2))
    with pytest.raises(zyx.ShapeError, match="bilinear"):
        F.interpolate(Z(x), size=5, mode="bilinear")


@needs_torch
@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
def test_pad_modes_match_torch(mode):
    x = rnd(2, 3, 5, 6)
    pads = (2, 1, 1, 3)
    kw = dict(value=1.5) if mode == "constant" else {}
    close(F.pad(Z(x), pads, mode=mode, **kw), TF.pad(T(x), pads, mode=mode, **kw))
    if mode == "constant":   # negative padding crops
        close(F.pad(Z(x), (-1, 2), value=0.5), TF.pad(T(x), (-1, 2), value=0.5))
    else:                    # torch allows 1-D padding of a 3-D input in these modes
        close(F.pad(Z(x[0]), (1, 2), mode=mode), TF.pad(T(x[0]), (1, 2), mode=mode))


@needs_torch
def test_pixel_shuffle_matches_torch():
    x = rnd(2, 8, 3, 5)
    close(F.pixel_shuffle(Z(x), 2), TF.pixel_shuffle(T(x), 2))
    close(F.pixel_unshuffle(Z(x), 1), TF.pixel_unshuffle(T(x), 1))
    y = rnd(2, 3, 6, 4)
    close(F.pixel_unshuffle(Z(y), 2), TF.pixel_unshuffle(T(y), 2))
    close(F.pixel_shuffle(F.pixel_unshuffle(Z(y), 2), 2), y)
    with pytest.raises(zyx.ShapeError, match="divisible"):
        F.pixel_shuffle(Z(y), 2)


@needs_torch
def test_unfold_matches_torch():
    x = rnd(*X4)
    close(F.unfold(Z(x), (2, 3), dilation=1, padding=1, stride=(2, 1)),
          TF.unfold(T(x), (2, 3), dilation=1, padding=1, stride=(2, 1)))


# ---------------------------------------------------------------------------------------
# normalization
@needs_torch
def test_norms_match_torch():
    x, w, b = rnd(*X4), rnd(4), rnd(4)
    close(F.group_norm(Z(x), 2, Z(w), Z(b)), TF.group_norm(T(x), 2, T(w), T(b)), 1e-4, 1e-4)
    close(F.instance_norm(Z(x), weight=Z(w), bias=Z(b)),
          TF.instance_norm(T(x), weight=T(w), bias=T(b)), 1e-4, 1e-4)
    w8 = rnd(8)
    close(F.rms_norm(Z(x), (8,), Z(w8)), TF.rms_norm(T(x), (8,), T(w8)), 1e-4, 1e-5)
    close(F.rms_norm(Z(x), (9, 8), eps=1e-3), TF.rms_norm(T(x), (9, 8), eps=1e-3), 1e-4, 1e-5)
    for p, dim in [(2.0, 1), (1.0, -1), (float("inf"), 2), (3.0, 1)]:
        close(F.normalize(Z(x), p, dim), TF.normalize(T(x), p, dim), 1e-4, 1e-5)
    a, c = rnd(5, 7), rnd(5, 7)
    close(F.cosine_similarity(Z(a), Z(c)), TF.cosine_similarity(T(a), T(c)), 1e-5, 1e-5)
    close(F.pairwise_distance(Z(a), Z(c)), TF.pairwise_distance(T(a), T(c)), 1e-5, 1e-5)


@needs_torch
@pytest.mark.parametrize("shape", [(8, 4), X4])
def test_batch_norm_training_and_eval_match_torch(shape):
    x, w, b = rnd(*shape) * 3 + 1, rnd(4), rnd(4)
    rm, rv = rnd(4), np.abs(rnd(4)) + 0.5
    zrm, zrv = Z(rm), Z(rv)
    trm, trv = T(rm), T(rv)
    for step in range(2):   # two steps: the running stats compound
        y = F.batch_norm(Z(x + step), zrm, zrv, Z(w), Z(b), training=True, momentum=0.3)
        ty = TF.batch_norm(T(x + step), trm, trv, T(w), T(b), training=True, momentum=0.3)
        close(y, ty, 1e-4, 1e-4)
    close(zrm, trm, 1e-5, 1e-5)
    close(zrv, trv, 1e-5, 1e-5)    # unbiased variance in the running estimate
    close(F.batch_norm(Z(x), zrm, zrv, Z(w), Z(b), training=False),
          TF.batch_norm(T(x), trm, trv, T(w), T(b), training=False), 1e-4, 1e-4)
    with pytest.raises(zyx.ShapeError, match="more than 1 value"):
        F.batch_norm(Z(rnd(1, 4)), None, None, training=True)


# ---------------------------------------------------------------------------------------
# dropout, embedding, one_hot
def test_dropout_statistics_and_modes():
    x = zyx.ones(200, 100)
    zyx.manual_seed(3)
    y = F.dropout(x, 0.3).numpy()
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.02
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)
    zyx.manual_seed(3)
    np.testing.assert_array_equal(F.dropout(x, 0.3).numpy(), y)    # same seed, same mask
    np.testing.assert_array_equal(F.dropout(x, 0.3, training=False).numpy(), x.numpy())
    assert not F.dropout(x, 1.0).numpy().any()
    ch = F.dropout2d(zyx.ones(8, 16, 3, 3), 0.5).numpy()
    per_channel = ch.reshape(8, 16, 9)
    assert ((per_channel == 0).all(-1) | (per_channel == 2.0).all(-1)).all()
    with pytest.raises(ValueError):
        F.dropout(x, 1.5)


def test_embedding_and_one_hot():
    w = rnd(10, 4)
    idx = np.array([[1, 9, 0], [3, 3, -1]])
    close(F.embedding(Z(idx), Z(w)), w[idx])
    oh = F.one_hot(Z(np.array([0, 3, 1])), 5)
    assert oh.dtype == zyx.int64
    np.testing.assert_array_equal(oh.numpy(), np.eye(5, dtype=np.int64)[[0, 3, 1]])
    np.testing.assert_array_equal(F.one_hot(Z(np.array([2, 0]))).numpy(), np.eye(3)[[2, 0]])
    with pytest.raises(zyx.DTypeError):
        F.embedding(Z(np.array([0.5])), Z(w))


# ---------------------------------------------------------------------------------------
# attention
@needs_torch
def test_scaled_dot_product_attention_matches_torch():
    q, k, v = rnd(2, 3, 5, 8), rnd(2, 3, 7, 8), rnd(2, 3, 7, 6)
    close(F.scaled_dot_product_attention(Z(q), Z(k), Z(v)),
          TF.scaled_dot_product_attention(T(q), T(k), T(v)), 1e-5, 1e-5)
    bm = np.random.rand(5, 7) > 0.3
    bm[:, 0] = True   # no fully masked row
    close(F.scaled_dot_product_attention(Z(q), Z(k), Z(v), attn_mask=Z(bm)),
          TF.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=T(bm)), 1e-5, 1e-5)
    fm = rnd(2, 1, 5, 7)
    close(F.scaled_dot_product_attention(Z(q), Z(k), Z(v), attn_mask=Z(fm), scale=0.3),
          TF.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=T(fm), scale=0.3), 1e-5, 1e-5)
    close(F.scaled_dot_product_attention(Z(q), Z(k[:, :, :5]), Z(v[:, :, :5]), is_causal=True),
          TF.scaled_dot_product_attention(T(q), T(k[:, :, :5]), T(v[:, :, :5]), is_causal=True),
          1e-5, 1e-5)
    kq = rnd(2, 1, 7, 8)   # grouped-query attention: one key/value head for three query heads
    close(F.scaled_dot_product_attention(Z(q), Z(kq), Z(kq), enable_gqa=True),
          TF.scaled_dot_product_attention(T(q), T(kq), T(kq), enable_gqa=True), 1e-5, 1e-5)


def test_sdpa_numpy_reference_and_dropout():
    q, k, v = rnd(3, 4), rnd(5, 4), rnd(5, 2)
    s = q @ k.T / 2.0
    a = np.exp(s - s.max(1, keepdims=True))
    a /= a.sum(1, keepdims=True)
    close(F.scaled_dot_product_attention(Z(q), Z(k), Z(v)), a @ v, 1e-5, 1e-6)
    zyx.manual_seed(0)
    d = F.scaled_dot_product_attention(Z(q), Z(k), Z(v), dropout_p=0.5).numpy()
    assert d.shape == (3, 2) and np.isfinite(d).all() and not np.allclose(d, a @ v)


# ---------------------------------------------------------------------------------------
# activations
ACTS = [
    ("relu", {}), ("relu6", {}), ("sigmoid", {}), ("tanh", {}), ("gelu", {}),
    ("gelu", {"approximate": "tanh"}), ("silu", {}), ("softplus", {}),
    ("softplus", {"beta": 2.0, "threshold": 5.0}), ("leaky_relu", {"negative_slope": 0.2}),
    ("elu", {"alpha": 0.7}), ("selu", {}), ("celu", {"alpha": 1.3}), ("mish", {}),
    ("hardtanh", {"min_val": -0.5, "max_val": 2.0}), ("hardsigmoid", {}), ("hardswish", {}),
    ("softsign", {}), ("logsigmoid", {}), ("tanhshrink", {}), ("softshrink", {"lambd": 0.7}),
    ("hardshrink", {}), ("softmax", {"dim": 1}), ("log_softmax", {"dim": -1}),
    ("softmin", {"dim": 0}), ("glu", {"dim": 1}),
]


@needs_torch
@pytest.mark.parametrize("name,kw", ACTS, ids=[a + str(i) for i, (a, _) in enumerate(ACTS)])
def test_activations_match_torch(name, kw):
    # include large magnitudes: the stable forms must not overflow
    x = np.concatenate([rnd(4, 6, lo=-5, hi=5), np.array([[-80, -30, -1e-3, 0, 30, 90]], np.float32)])
    close(getattr(F, name)(Z(x), **kw), getattr(TF, name)(T(x), **kw), 1e-5, 1e-6)


@needs_torch
def test_prelu_threshold_match_torch():
    x, w = rnd(*X4), rnd(4)
    close(F.prelu(Z(x), Z(w)), TF.prelu(T(x), T(w)))
    close(F.threshold(Z(x), 0.3, -2.0), TF.threshold(T(x), 0.3, -2.0))


# ---------------------------------------------------------------------------------------
# losses
@needs_torch
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_regression_losses_match_torch(reduction):
    x, y = rnd(5, 6, lo=-3, hi=3), rnd(5, 6)
    for name, kw in [("mse_loss", {}), ("l1_loss", {}), ("smooth_l1_loss", {"beta": 0.5}),
                     ("smooth_l1_loss", {}), ("huber_loss", {"delta": 0.7})]:
        close(getattr(F, name)(Z(x), Z(y), reduction=reduction, **kw),
              getattr(TF, name)(T(x), T(y), reduction=reduction, **kw), 1e-5, 1e-6)
    with pytest.raises(zyx.ShapeError, match="mse_loss"):
        F.mse_loss(Z(x), Z(y[:2]))


CE_CASES = [
    dict(), dict(reduction="sum"), dict(reduction="none"), dict(label_smoothing=0.2),
    dict(weight=True), dict(weight=True, label_smoothing=0.1), dict(ignore_index=2),
    dict(ignore=True), dict(ignore=True, label_smoothing=0.3, weight=True),
    dict(ignore=True, label_smoothing=0.3, reduction="sum"),
    dict(ignore=True, label_smoothing=0.3, reduction="none", weight=True),
]


@needs_torch
@pytest.mark.parametrize("spatial", [False, True])
@pytest.mark.parametrize("case", CE_CASES, ids=[str(i) for i in range(len(CE_CASES))])
def test_cross_entropy_matches_torch(case, spatial):
    c = 5
    x = rnd(6, c, 3) * 3 if spatial else rnd(6, c) * 3
    y = np.random.randint(0, c, size=(6, 3) if spatial else (6,))
    kw = dict(case)
    if kw.pop("ignore", False):
        y.reshape(-1)[[1, 4]] = -100
    w = rnd(c, lo=0.2, hi=2.0) if kw.pop("weight", False) else None
    zk = dict(kw, weight=Z(w) if w is not None else None)
    tk = dict(kw, weight=T(w) if w is not None else None)
    close(F.cross_entropy(Z(x), Z(y), **zk), TF.cross_entropy(T(x), T(y), **tk), 1e-5, 1e-5)
    if "label_smoothing" not in kw:
        lp = np_log_softmax(x, 1)
        close(F.nll_loss(Z(lp), Z(y), **zk), TF.nll_loss(T(lp), T(y), **tk), 1e-5, 1e-5)


@needs_torch
@pytest.mark.parametrize("kw", [dict(), dict(label_smoothing=0.25), dict(weight=True),
                                dict(reduction="none"), dict(reduction="sum", weight=True)])
def test_cross_entropy_probability_targets_match_torch(kw):
    kw = dict(kw)
    x = rnd(6, 5) * 3
    p = np.random.rand(6, 5).astype(np.float32)
    p /= p.sum(1, keepdims=True)
    w = rnd(5, lo=0.2, hi=2.0) if kw.pop("weight", False) else None
    close(F.cross_entropy(Z(x), Z(p), weight=Z(w) if w is not None else None, **kw),
          TF.cross_entropy(T(x), T(p), weight=T(w) if w is not None else None, **kw), 1e-5, 1e-5)


@needs_torch
def test_cross_entropy_unbatched_and_errors():
    x = rnd(5)
    close(F.cross_entropy(Z(x), Z(np.array(3))), TF.cross_entropy(T(x), T(np.array(3))), 1e-5, 1e-6)
    with pytest.raises(zyx.ShapeError, match="target shape"):
        F.cross_entropy(Z(rnd(6, 5)), Z(np.zeros(4, np.int64)))
    with pytest.raises(zyx.ShapeError, match="weight"):
        F.cross_entropy(Z(rnd(6, 5)), Z(np.zeros(6, np.int64)), weight=Z(rnd(4)))


@needs_torch
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_losses_match_torch(reduction):
    logits = np.concatenate([rnd(4, 6) * 4, np.array([[-200, -50, 0, 50, 200, 1]], np.float32)])
    y = (np.random.rand(5, 6) > 0.5).astype(np.float32)
    w, pw = rnd(6, lo=0.1, hi=2.0), rnd(6, lo=0.1, hi=3.0)
    close(F.binary_cross_entropy_with_logits(Z(logits), Z(y), reduction=reduction),
          TF.binary_cross_entropy_with_logits(T(logits), T(y), reduction=reduction), 1e-5, 1e-5)
    close(F.binary_cross_entropy_with_logits(Z(logits), Z(y), Z(w), reduction=reduction,
                                             pos_weight=Z(pw)),
          TF.binary_cross_entropy_with_logits(T(logits), T(y), T(w), reduction=reduction,
                                              pos_weight=T(pw)), 1e-5, 1e-5)
    p = np.random.rand(5, 6).astype(np.float32)
    p[0, :2] = [0.0, 1.0]    # log(0) clamps at -100, as in torch
    close(F.binary_cross_entropy(Z(p), Z(y), Z(w), reduction=reduction),
          TF.binary_cross_entropy(T(p), T(y), T(w), reduction=reduction), 1e-5, 1e-4)
    lp = np_log_softmax(rnd(5, 6), 1)
    q = np.random.rand(5, 6).astype(np.float32)
    q[0, 0] = 0
    red = "batchmean" if reduction == "mean" else reduction
    close(F.kl_div(Z(lp), Z(q), reduction=red), TF.kl_div(T(lp), T(q), reduction=red), 1e-5, 1e-6)


# ---------------------------------------------------------------------------------------
# gradients through the functional ops (autograd against torch.autograd)
def _grads_zyx(fn, *arrays):
    ts = [zyx.Tensor(a, requires_grad=True) for a in arrays]
    fn(*ts).backward()
    return [t.grad.numpy() for t in ts]


def _grads_torch(fn, *arrays):
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    fn(*ts).backward()
    return [t.grad.numpy() for t in ts]


GRAD_CASES = [
    ("conv2d", lambda m, x, w, b: (m.conv2d(x, w, b, 2, 1, 1, 2).tanh() * _probe(m, (2, 8, 5, 4))).sum(),
     [X4, (8, 2, 3, 3), (8,)]),
    ("conv_transpose2d", lambda m, x, w: (m.conv_transpose2d(x, w, stride=2, padding=1) *
                                          _probe(m, (2, 6, 17, 15))).sum(),
     [X4, (4, 6, 3, 3)]),
    ("max_pool2d", lambda m, x: (m.max_pool2d(x, 3, 2, 1) * _probe(m, (2, 4, 5, 4))).sum(), [X4]),
    ("avg_pool2d", lambda m, x: (m.avg_pool2d(x, 3, 2, 1, True, False) * _probe(m, (2, 4, 5, 5))).sum(),
     [X4]),
    ("layer_norm", lambda m, x, w, b: (m.layer_norm(x, (8,), w, b) * _probe(m, X4)).sum(),
     [X4, (8,), (8,)]),
    ("batch_norm", lambda m, x, w, b: (m.batch_norm(x, None, None, w, b, training=True) *
                                       _probe(m, X4)).sum(), [X4, (4,), (4,)]),
    ("cross_entropy", lambda m, x: m.cross_entropy(x, _labels(m), label_smoothing=0.1), [(6, 5)]),
    ("bce_logits", lambda m, x: m.binary_cross_entropy_with_logits(x, _probe(m, (6, 5)) * 0.5 + 0.5),
     [(6, 5)]),
    ("sdpa", lambda m, q, k, v: (m.scaled_dot_product_attention(q, k, v, is_causal=True) *
                                 _probe(m, (2, 5, 4))).sum(), [(2, 5, 4), (2, 5, 4), (2, 5, 4)]),
    ("gelu_softplus", lambda m, x: (m.gelu(x) * m.softplus(x) * _probe(m, (6, 5))).sum(), [(6, 5)]),
]

_PROBES = {}


def _probe(m, shape):
    """A fixed random tensor (the same for both libraries) to weight the outputs."""
    a = _PROBES.setdefault(shape, np.random.RandomState(len(shape) + sum(shape)).uniform(
        -1, 1, size=shape).astype(np.float32))
    return zyx.Tensor(a) if m is F else torch.tensor(a)


def _labels(m):
    y = np.array([0, 4, 2, 1, 1, 3])
    return zyx.Tensor(y) if m is F else torch.tensor(y)


@needs_torch
@pytest.mark.parametrize("name,fn,shapes", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gradients_match_torch(name, fn, shapes):
    arrays = [rnd(*s) for s in shapes]
    gz = _grads_zyx(lambda *t: fn(F, *t), *arrays)
    gt = _grads_torch(lambda *t: fn(TF, *t), *arrays)
    for a, b in zip(gz, gt):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
