"""Numerical cases every GPU backend must pass, against numpy: the cases of
test_opencl.py plus the dtypes and ops GPU codegen gets wrong first (f16/bf16 storage,
int64, bool, pow, where, integer division of negatives).

A backend's test module imports these functions (`from gpu_cases import *`), so pytest
collects them there, under that module's autouse fixture that re-initializes the runtime
with the backend alone."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx._core import passes
from zyx._core.kernelizer import kernelize

__all__ = ["test_elementwise_chain", "test_broadcasting", "test_sum_max_mean",
           "test_large_reduction", "test_matmul", "test_softmax", "test_row_kernels",
           "test_cast_float_to_int_and_back", "test_float16_storage", "test_bfloat16_round_trip",
           "test_int_ops", "test_float64", "test_mlp_forward_backward", "test_where_pow_bool",
           "test_float16_reduction_and_matmul", "test_large_elementwise",
           "test_memory_returns_to_start", "test_gemm_products"]


# -- kernels of real zyx graphs, for codegen tests (not run here: rendered and compiled)

def kernels_of(t):
    """The optimized kernels a realization of lazy tensor `t` would run, as build_plan
    makes them (kernelize + optimize), without compiling them for any device."""
    g = zyx._RT.graph
    order, _ = g.collect([t._id])
    steps, _ = kernelize(g, order, [t._id], 16)
    return [passes.optimize(s.kernel) for s in steps if s.kernel is not None]


def gemm_kernels_of(t):
    """The kernels of lazy tensor `t` as a GPU device gets them (no register tiles, sums
    in blocks of GPU_SUM_BLOCK), each with its gemm plan (codegen/gpu/gemm.plan: None
    where the kernel is not a product)."""
    from zyx.codegen.gpu import dispatch
    from zyx.codegen.gpu import gemm as gpu_gemm
    g = zyx._RT.graph
    order, _ = g.collect([t._id])
    steps, _ = kernelize(g, order, [t._id], 64, False, dispatch.GPU_SUM_BLOCK)
    ks = [passes.optimize(s.kernel) for s in steps if s.kernel is not None]
    return [(k, gpu_gemm.plan(k.ops)) for k in ks]


def _f(*shape, dtype=np.float32):
    return zyx.Tensor(np.random.randn(*shape).astype(dtype))


def _i(*shape, dtype=np.int32):
    return zyx.Tensor(np.random.randint(-50, 50, size=shape).astype(dtype))


GRAPHS = {
    "elementwise": lambda: (_f(5, 7) * _f(5, 7) + _f(5, 7).exp()).sqrt().tanh(),
    "broadcast": lambda: _f(4, 1, 3) + _f(1, 6, 3) * _f(3),
    "sum_axis": lambda: _f(3, 17, 33).sum(1),
    "max_all": lambda: _f(3, 17, 33).max(),
    "softmax": lambda: _f(8, 10).softmax(-1),
    # row kernels (reduces computed per row inside the output's kernel; "group" lowering
    # with a store loop split over the work-items)
    "softmax_rows": lambda: _f(64, 512).softmax(-1),
    "layer_norm_rows": lambda: (lambda x: (x - x.mean(-1, keepdim=True))
                                * (x.var(-1, keepdim=True, correction=0) + 1e-5).rsqrt())(
                                    _f(64, 512)),
    "log_softmax_rows_f16": lambda: _f(64, 300, dtype=np.float16).log_softmax(-1),
    "matmul": lambda: _f(17, 33) @ _f(33, 65),
    "batched_matmul": lambda: _f(2, 16, 64) @ _f(2, 64, 16),
    "float16": lambda: (_f(9, 5, dtype=np.float16) * 3 + 1).sum(0),
    "float16_matmul": lambda: _f(8, 16, dtype=np.float16) @ _f(16, 4, dtype=np.float16),
    "bfloat16": lambda: (_f(6, 6).cast(zyx.bfloat16) * 2).cast(zyx.float32),
    "float64": lambda: _f(4, 5, dtype=np.float64).exp().sum(0),
    "int64": lambda: _i(4, 5, dtype=np.int64) * 3 - 7,
    "int_div_mod": lambda: (_i(6, 7) // (_i(6, 7).abs() + 1), _i(6, 7) % 5),
    "bool": lambda: (_f(4, 4) > 0) & (_f(4, 4) < 1),
    "where": lambda: zyx.where(_f(5, 5) > 0, _f(5, 5), _f(5, 5) * 0.1),
    "pow": lambda: (_f(5, 5).abs() ** 1.5, _i(5, 5, dtype=np.int64) ** 3),
    "cast_float_int": lambda: (_f(20) * 50).cast(zyx.int32).cast(zyx.float32),
    "uint8_int16": lambda: _i(8, dtype=np.uint8) + _i(8, dtype=np.int16).cast(zyx.uint8),
    # shared-memory gemm tiles (codegen/gpu/gemm.py): blocked and masked K, an epilogue,
    # transposed operands, a batch, bf16 inputs, a convolution as implicit GEMM
    "gemm_blocked_k": lambda: _f(100, 521) @ _f(521, 80),
    "gemm_bias_relu": lambda: (_f(64, 48) @ _f(96, 48).T + _f(96)).relu(),
    "gemm_batched": lambda: _f(3, 40, 24) @ _f(3, 24, 72),
    "gemm_bf16": lambda: _f(64, 64).cast(zyx.bfloat16) @ _f(64, 32).cast(zyx.bfloat16),
    "gemm_conv2d": lambda: __import__("zyx.nn.functional", fromlist=["conv2d"]).conv2d(
        _f(4, 8, 12, 12), _f(16, 8, 3, 3), padding=1),
}



# -- numerical cases -----------------------------------------------------------------------

def close(t, ref, rtol=1e-5, atol=1e-6):
    out = t.numpy()
    assert out.shape == np.shape(ref)
    np.testing.assert_allclose(out.astype(np.float64), np.asarray(ref, np.float64),
                               rtol=rtol, atol=atol)


def rand(*shape):
    return np.random.randn(*shape).astype(np.float32)


def test_elementwise_chain():
    a, b = rand(5, 7), rand(5, 7)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    close((x * y + x.exp() - y.abs().sqrt()) / 3.0, (a * b + np.exp(a) - np.sqrt(np.abs(b))) / 3.0)
    close((x.tanh() * 0.5).maximum(y), np.maximum(np.tanh(a) * 0.5, b))


def test_broadcasting():
    a, b, c = rand(4, 1, 3), rand(1, 6, 3), rand(3)
    close(zyx.Tensor(a) + zyx.Tensor(b) * zyx.Tensor(c), a + b * c)


@pytest.mark.parametrize("axis", [None, 0, 1, 2])
def test_sum_max_mean(axis):
    a = rand(3, 17, 33)
    x = zyx.Tensor(a)
    close(x.sum(axis), a.sum(axis), rtol=1e-4, atol=1e-4)
    close(x.amax(axis), a.max(axis))
    close(x.mean(axis), a.mean(axis), rtol=1e-4, atol=1e-5)


def test_large_reduction():
    a = rand(1 << 16)
    close(zyx.Tensor(a).sum(), a.astype(np.float64).sum(), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((17, 33), (33, 65)),
                                   ((2, 16, 64), (2, 64, 16)), ((6,), (6, 2))])
def test_matmul(sa, sb):
    a, b = rand(*sa), rand(*sb)
    close(zyx.Tensor(a) @ zyx.Tensor(b), a.astype(np.float64) @ b.astype(np.float64),
          rtol=1e-4, atol=1e-4)


def test_softmax():
    a = rand(8, 10) * 4
    e = np.exp(a - a.max(-1, keepdims=True))
    close(zyx.Tensor(a).softmax(-1), e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_row_kernels():
    # softmax / log_softmax / layer_norm as one kernel each: rows of -inf, all-equal
    # rows, a long row whose float sum is blocked (masked last block), a permuted input
    for shape in [(37, 1000), (20, 4099), (300, 64)]:
        a = rand(*shape) * 4
        a[0] = -np.inf
        a[1] = 2.0
        e = np.exp(a[1:] - a[1:].max(-1, keepdims=True))
        x = zyx.Tensor(a)
        sm = x.softmax(-1).numpy()
        assert np.isnan(sm[0]).all()
        np.testing.assert_allclose(sm[1:], e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
        close(zyx.Tensor(a[1:]).log_softmax(-1),
              a[1:] - a[1:].max(-1, keepdims=True) - np.log(e.sum(-1, keepdims=True)),
              rtol=1e-5, atol=1e-5)
        b = a[1:].astype(np.float64)
        m = b.mean(-1, keepdims=True)
        v = ((b - m) ** 2).mean(-1, keepdims=True)
        y = zyx.Tensor(a[1:])
        close((y - y.mean(-1, keepdim=True)) * (y.var(-1, keepdim=True, correction=0)
                                                + 1e-5).rsqrt(),
              (b - m) / np.sqrt(v + 1e-5), rtol=1e-4, atol=1e-4)
    a = rand(64, 48)
    e = np.exp(a.T - a.T.max(-1, keepdims=True))
    close(zyx.Tensor(a).permute(1, 0).softmax(-1), e / e.sum(-1, keepdims=True))


def test_cast_float_to_int_and_back():
    a = rand(20) * 50
    x = zyx.Tensor(a)
    i = x.cast(zyx.int32)
    assert i.dtype is zyx.int32
    np.testing.assert_array_equal(i.numpy(), a.astype(np.int32))
    close(i.cast(zyx.float32) * 2, a.astype(np.int32).astype(np.float32) * 2)


def test_float16_storage():
    a = rand(9, 5).astype(np.float16)
    x = zyx.Tensor(a)
    assert x.dtype is zyx.float16
    out = (x * 3 + 1).numpy()
    assert out.dtype == np.float16
    # each op's result is a half (torch's rounding): numpy's float16 ops round each one
    np.testing.assert_array_equal(out, a * np.float16(3) + np.float16(1))
    np.testing.assert_array_equal(zyx.Tensor(a.astype(np.float32)).cast(zyx.float16).numpy(), a)
    # overflow to inf, subnormals and ties round to nearest even as numpy does
    edge = np.array([70000.0, -70000.0, 1e-6, 6e-8, 2049.0, 2051.0, 0.0, -0.0], np.float32)
    with np.errstate(over="ignore"):
        ref = edge.astype(np.float16)
    np.testing.assert_array_equal(zyx.Tensor(edge).cast(zyx.float16).numpy(), ref)


def test_bfloat16_round_trip():
    a = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0], np.float32)
    back = zyx.Tensor(a).cast(zyx.bfloat16).cast(zyx.float32).numpy()
    u = a.view(np.uint32)
    ref = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(back, ref)


def test_int_ops():
    a = np.random.randint(-100, 100, size=(6, 7)).astype(np.int32)
    b = np.random.randint(1, 9, size=(6, 7)).astype(np.int32)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    np.testing.assert_array_equal((x * y - 3).numpy(), a * b - 3)
    np.testing.assert_array_equal(x.sum(1).numpy(), a.sum(1))
    np.testing.assert_array_equal((x // y).numpy(), a // b)
    big = np.array([2**40, -(2**35), 7], np.int64)
    np.testing.assert_array_equal((zyx.Tensor(big) * 3).numpy(), big * 3)


def test_float64():
    a = np.random.randn(4, 5)
    close(zyx.Tensor(a).exp().sum(0), np.exp(a).sum(0), rtol=1e-12, atol=1e-12)


def test_where_pow_bool():
    a = rand(6, 5)
    x = zyx.Tensor(a)
    close(zyx.where(x > 0, x, x * 0.1), np.where(a > 0, a, a * np.float32(0.1)))
    close(x.abs() ** 1.5, np.abs(a) ** 1.5, rtol=1e-5, atol=1e-6)
    m = (x > 0) & (x < 1)
    np.testing.assert_array_equal(m.numpy(), (a > 0) & (a < 1))
    n = np.arange(-4, 5, dtype=np.int64)
    np.testing.assert_array_equal((zyx.Tensor(n) ** 3).numpy(), n ** 3)


def test_float16_reduction_and_matmul():
    a = (rand(16, 32) * 0.5).astype(np.float16)
    b = (rand(32, 8) * 0.5).astype(np.float16)
    ref = a.astype(np.float32) @ b.astype(np.float32)
    out = (zyx.Tensor(a) @ zyx.Tensor(b)).numpy()
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float32), ref, rtol=2e-3, atol=2e-3)


def test_large_elementwise():
    # more than one staging chunk each way, and a grid of many groups
    a = rand(5 << 20)
    np.testing.assert_array_equal((zyx.Tensor(a) * 2.0).numpy(), a * 2)


def test_memory_returns_to_start():
    import gc
    gc.collect()        # an earlier test's garbage freed during this one would count
    start = zyx.stats()["bytes_allocated"]
    a = rand(64, 64)
    for _ in range(3):
        close((zyx.Tensor(a) * 2 + 1).sum(1), (a * 2 + 1).sum(1), rtol=1e-5, atol=1e-4)
    gc.collect()
    assert zyx.stats()["bytes_allocated"] == start


def test_mlp_forward_backward():
    w1, b1, w2 = rand(16, 8) * 0.3, rand(16) * 0.1, rand(3, 16) * 0.3
    xs = rand(5, 8)
    W1, B1, W2 = (zyx.Tensor(v, requires_grad=True) for v in (w1, b1, w2))
    h = zyx.Tensor(xs) @ W1.T + B1
    out = h.relu() @ W2.T
    loss = (out * out).mean()
    loss.backward()
    hn = xs @ w1.T + b1
    rn = np.maximum(hn, 0)
    on = rn @ w2.T
    close(loss, (on * on).mean(), rtol=1e-5, atol=1e-6)
    go = 2 * on / on.size
    gw2 = go.T @ rn
    gr = go @ w2
    gh = gr * (hn > 0)
    close(W2.grad, gw2, rtol=1e-4, atol=1e-5)
    close(W1.grad, gh.T @ xs, rtol=1e-4, atol=1e-5)
    close(B1.grad, gh.sum(0), rtol=1e-4, atol=1e-5)


# products the GPU lowerings give shared-memory tiles (codegen/gpu/gemm.py): sizes that do
# and do not fill a tile, float sums blocked with a masked last block, transposed
# operands (copied K-fastest or rows-fastest), a batch axis, an epilogue, 16-bit inputs,
# convolutions as implicit GEMM and their gradients
def test_gemm_products():
    import zyx.nn.functional as F
    f64 = np.float64
    for m, k, n in ((16, 8, 16), (33, 65, 17), (100, 521, 80), (130, 300, 129)):
        a, b = rand(m, k), rand(k, n)
        ref = a.astype(f64) @ b.astype(f64)
        close(zyx.Tensor(a) @ zyx.Tensor(b), ref, rtol=1e-4, atol=1e-4)
        close(zyx.Tensor(a.T.copy()).T @ zyx.Tensor(b.T.copy()).T, ref, rtol=1e-4, atol=1e-4)
    a, b, c = rand(3, 40, 24), rand(3, 24, 72), rand(72)
    close((zyx.Tensor(a) @ zyx.Tensor(b) + zyx.Tensor(c)).relu(),
          np.maximum(a.astype(f64) @ b + c, 0), rtol=1e-4, atol=1e-4)
    close(zyx.Tensor(a) @ zyx.Tensor(b[0]), a.astype(f64) @ b[0], rtol=1e-4, atol=1e-4)
    h = (rand(64, 96) * 0.5).astype(np.float16)
    w = (rand(96, 48) * 0.5).astype(np.float16)
    out = (zyx.Tensor(h) @ zyx.Tensor(w)).numpy()
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float32), h.astype(np.float32) @ w.astype(np.float32),
                               rtol=2e-3, atol=2e-3)
    x, wt = rand(4, 8, 12, 12), rand(16, 8, 3, 3) * 0.3
    X = zyx.Tensor(x, requires_grad=True)
    W = zyx.Tensor(wt, requires_grad=True)
    y = F.conv2d(X, W, padding=1)
    ref = _conv2d_ref(x, wt, 1)
    close(y, ref, rtol=1e-4, atol=1e-4)
    g = rand(*ref.shape)
    (y * zyx.Tensor(g)).sum().backward()
    gx, gw = _conv2d_grads_ref(x, wt, g, 1)
    close(X.grad, gx, rtol=1e-4, atol=1e-4)
    close(W.grad, gw, rtol=1e-4, atol=1e-3)


def _windows(x, k, pad):
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, c, hp, wp = xp.shape
    ho, wo = hp - k + 1, wp - k + 1
    win = np.empty((n, c, k, k, ho, wo))
    for i in range(k):
        for j in range(k):
            win[:, :, i, j] = xp[:, :, i:i + ho, j:j + wo]
    return win


def _conv2d_ref(x, w, pad):
    return np.einsum("ncijhw,ocij->nohw", _windows(x, w.shape[-1], pad), w.astype(np.float64))


def _conv2d_grads_ref(x, w, g, pad):
    k = w.shape[-1]
    gw = np.einsum("ncijhw,nohw->ocij", _windows(x, k, pad), g.astype(np.float64))
    n, c, h, wd = x.shape
    gxp = np.zeros((n, c, h + 2 * pad, wd + 2 * pad))
    ho, wo = g.shape[2:]
    for i in range(k):
        for j in range(k):
            gxp[:, :, i:i + ho, j:j + wo] += np.einsum("nohw,oc->nchw", g, w[:, :, i, j])
    return gxp[:, :, pad:pad + h, pad:pad + wd], gw
