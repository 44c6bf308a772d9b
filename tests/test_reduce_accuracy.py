"""Accuracy of float reductions (issue 10): sums on every reduce layout the kernelizer
makes (plain loop, parallel to a scalar, per-lane "lanes" tiles, the 4x4 "unroll" tile,
several axes, keepdim, a masked last block) are compared with numpy in float64; float16
and bfloat16 mean/var/std accumulate in float32 like torch.

The data sit far from zero (values near 1000) so that one float32 accumulator per SIMD
lane drifts (16M values: mean 998.13 instead of 1000.50) and counts stop at 2**24."""
import numpy as np
import pytest

import zyx


def near_1000(rng, shape):
    return (rng.random(shape) + 1000).astype(np.float32)


def f64(a):
    return a.astype(np.float64)


@pytest.fixture(scope="module")
def big():
    """2**24 float32 values in [1000, 1001): the issue's example."""
    return near_1000(np.random.default_rng(0), 2 ** 24)


def test_mean_of_16m_values_far_from_zero(big):
    # parallel reduce to a scalar
    np.testing.assert_allclose(zyx.from_numpy(big).mean().item(), f64(big).mean(), rtol=1e-7)
    np.testing.assert_allclose(zyx.from_numpy(big).sum().item(), f64(big).sum(), rtol=1e-7)


def test_var_std_of_16m_values_far_from_zero(big):
    x = zyx.from_numpy(big)
    np.testing.assert_allclose(x.var().item(), f64(big).var(ddof=1), rtol=1e-5)
    np.testing.assert_allclose(x.std().item(), f64(big).std(ddof=1), rtol=1e-5)
    np.testing.assert_allclose(x.var(correction=0).item(), f64(big).var(), rtol=1e-5)
    np.testing.assert_allclose(x.var(unbiased=False).item(), f64(big).var(), rtol=1e-5)


def test_sum_counts_past_2_24():
    # a CONST expanded to 2**30 elements: one accumulator per lane stopped at 2**24 each
    assert zyx.ones(2 ** 30).sum().item() == 2.0 ** 30
    assert zyx.ones(2 ** 25).mean().item() == 1.0


def test_sum_over_last_axis_rows():
    a = near_1000(np.random.default_rng(1), (64, 2 ** 18))
    np.testing.assert_allclose(zyx.from_numpy(a).sum(1).numpy(), f64(a).sum(1), rtol=1e-7)


def test_mean_over_axis_0_strided():
    # (2**20, 4): the "lanes" layout, one accumulator per output column
    a = near_1000(np.random.default_rng(2), (2 ** 20, 4))
    x = zyx.from_numpy(a)
    np.testing.assert_allclose(x.mean(0).numpy(), f64(a).mean(0), rtol=1e-7)
    np.testing.assert_allclose(x.var(0).numpy(), f64(a).var(0, ddof=1), rtol=1e-4)


def test_sum_over_axis_0_wide_rows():
    # 1001 columns split by no lane count: one strided scalar loop per output
    # (4096 sequential adds per block: within 1 float32 ulp of the result; 3e-7 before)
    a = near_1000(np.random.default_rng(3), (2 ** 14, 1001))
    np.testing.assert_allclose(zyx.from_numpy(a).sum(0).numpy(), f64(a).sum(0), rtol=2e-7)


@pytest.mark.parametrize("shape,axes", [((64, 512, 512), (1, 2)), ((1024, 8, 2048), (0, 2)),
                                        ((4096, 4096), (0, 1))])
def test_sum_over_several_axes(shape, axes):
    a = near_1000(np.random.default_rng(4), shape)
    np.testing.assert_allclose(zyx.from_numpy(a).sum(axes).numpy(), f64(a).sum(axes),
                               rtol=1e-7)


def test_sum_keepdim():
    a = near_1000(np.random.default_rng(5), (4, 2 ** 22))
    r = zyx.from_numpy(a).sum(1, keepdim=True).numpy()
    assert r.shape == (4, 1)
    np.testing.assert_allclose(r, f64(a).sum(1, keepdims=True), rtol=1e-7)
    m = zyx.from_numpy(a).mean(1, keepdim=True).numpy()
    np.testing.assert_allclose(m, f64(a).mean(1, keepdims=True), rtol=1e-7)


def test_sum_of_prime_length():
    # no block length divides 1000003: the last block is masked
    a = near_1000(np.random.default_rng(6), 1000003)
    np.testing.assert_allclose(zyx.from_numpy(a).sum().item(), f64(a).sum(), rtol=1e-7)
    b = near_1000(np.random.default_rng(7), (3, 1000003))
    np.testing.assert_allclose(zyx.from_numpy(b).sum(1).numpy(), f64(b).sum(1), rtol=1e-7)


def test_sum_of_expression_in_blocks():
    # the reduced value is an expression (fused elementwise body), not a plain load
    a = near_1000(np.random.default_rng(8), 2 ** 23)
    x = zyx.from_numpy(a)
    np.testing.assert_allclose((x * 2.0 - 1.0).sum().item(), (f64(a) * 2 - 1).sum(), rtol=1e-7)


@pytest.fixture(scope="module")
def long_k():
    rng = np.random.default_rng(9)
    k = 2 ** 16
    a = (1 + 0.01 * rng.random((16, k))).astype(np.float32)
    b = (1 + 0.01 * rng.random((k, 32))).astype(np.float32)
    return a, b, f64(a) @ f64(b)


def test_matmul_long_k_lanes(long_k):
    # row-major right operand: the R x 16 "lanes" tile, each lane adding sequentially
    a, b, ref = long_k
    r = (zyx.from_numpy(a) @ zyx.from_numpy(b)).numpy()
    np.testing.assert_allclose(r, ref, rtol=4e-7)   # numpy's own sgemm: 5e-7


def test_matmul_long_k_unroll(long_k):
    # x @ W.T, both operands contiguous along k: the 4x4 "unroll" tile
    a, b, ref = long_k
    w = np.ascontiguousarray(b.T)
    r = (zyx.from_numpy(a) @ zyx.from_numpy(w).T).numpy()
    np.testing.assert_allclose(r, ref, rtol=4e-7)


def test_matmul_short_k_unchanged():
    # (not the MLP's 64x784 @ 784x128: tests/test_step_path.py reads the source of the
    # last plan made and would find this one's plan cached)
    rng = np.random.default_rng(10)
    a = rng.standard_normal((48, 784)).astype(np.float32)
    w = rng.standard_normal((96, 784)).astype(np.float32)
    np.testing.assert_allclose((zyx.from_numpy(a) @ zyx.from_numpy(w).T).numpy(),
                               f64(a) @ f64(w).T, rtol=1e-4, atol=1e-4)


def test_float64_sum_far_from_zero():
    a = np.random.default_rng(11).random(2 ** 22) + 1e6
    assert zyx.from_numpy(a).sum().item() == pytest.approx(a.sum(), rel=1e-15)


def test_int_sums_exact():
    a = np.random.default_rng(12).integers(-2 ** 20, 2 ** 20, size=(2 ** 12, 2 ** 10),
                                           dtype=np.int32)
    x = zyx.from_numpy(a)
    assert x.sum().item() == int(a.astype(np.int64).sum())
    np.testing.assert_array_equal(x.sum(0).numpy(), a.astype(np.int64).sum(0))
    np.testing.assert_array_equal(x.sum(1).numpy(), a.astype(np.int64).sum(1))
    assert x.sum().dtype is zyx.int64
    big = zyx.ones(2 ** 26, dtype=zyx.int32)
    assert big.sum().item() == 2 ** 26


def test_max_min_unchanged_by_blocks():
    a = near_1000(np.random.default_rng(13), 2 ** 22)
    x = zyx.from_numpy(a)
    assert x.max().item() == a.max() and x.min().item() == a.min()
    b = a.reshape(2 ** 20, 4)
    np.testing.assert_array_equal(zyx.from_numpy(b).amax(0).numpy(), b.max(0))


def test_float16_mean_var_std_accumulate_in_float32():
    ones = zyx.tensor(np.ones(70000, np.float16))
    m = ones.mean()
    assert m.dtype is zyx.float16 and m.item() == 1.0
    s = zyx.tensor(np.ones(100000, np.float16)).std()
    assert s.dtype is zyx.float16 and s.item() == 0.0
    assert zyx.tensor(np.ones(100000, np.float16)).var().item() == 0.0
    # like torch, sum keeps float16 (70000 does not fit)
    assert ones.sum().dtype is zyx.float16 and ones.sum().item() == float("inf")


def test_float16_bfloat16_against_torch():
    torch = pytest.importorskip("torch")
    a = (np.random.default_rng(14).standard_normal((2000, 50)) * 3 + 300).astype(np.float16)
    for zd, td in ((zyx.float16, torch.float16), (zyx.bfloat16, torch.bfloat16)):
        x = zyx.tensor(a).cast(zd)
        t = torch.from_numpy(a).to(td)
        for name in ("mean", "var", "std"):
            for kw in ({}, {"dim": 0}, {"dim": 1, "keepdim": True}):
                z = getattr(x, name)(**kw)
                ref = getattr(t, name)(**kw)
                assert z.dtype is zd and z.shape == tuple(ref.shape)
                np.testing.assert_allclose(z.cast(zyx.float32).numpy(),
                                           ref.float().numpy(), rtol=1e-2, err_msg=name)
        # the whole computation in float32: the values' squares (~90000) do not fit
        # float16 -- the variance (~9) is finite and right all the same
        exact = t.double().var().item()   # of the values as rounded to this dtype
        np.testing.assert_allclose(x.var().item(), exact, rtol=1e-2)


def test_bfloat16_mean_of_many_values():
    torch = pytest.importorskip("torch")
    a = near_1000(np.random.default_rng(15), 2 ** 20)
    x = zyx.from_numpy(a).cast(zyx.bfloat16)
    t = torch.from_numpy(a).bfloat16()
    ref = t.double().mean().item()   # exact mean of the bfloat16 values
    m = x.mean()
    assert m.dtype is zyx.bfloat16
    # one bfloat16 rounding of the result (8 bits of mantissa), nothing accumulated
    np.testing.assert_allclose(m.cast(zyx.float32).item(), ref, rtol=2 ** -8)
    np.testing.assert_allclose(m.cast(zyx.float32).item(), t.mean().float().item(),
                               rtol=2 ** -8)
