"""Reductions against numpy: every axis form (None, int, negative, tuples) with and without
keepdim, `axis=` and `dim=`, every dtype each op supports, NaN handling, ties, empty and
large inputs, and the composite reductions (var/std/logsumexp/softmax/cumsum)."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from conftest import (ALL_DTYPES, FLOAT_DTYPES, NUMERIC_DTYPES, assert_close, ids, round_to,
                      sample)

pytestmark = pytest.mark.usefixtures("device")

SHAPE = (2, 3, 4)
AXES = [None, 0, 1, -1, (0, 2), (-1, -3), (0, 1, 2)]


def _np_axis(axis):
    return axis if axis is None or isinstance(axis, int) else tuple(axis)


def _sum_dtype(d):
    """torch: sums and products of bools and ints are int64; floats keep their dtype."""
    return d if d.is_float else zyx.int64


@pytest.mark.parametrize("d", ALL_DTYPES, ids=ids(ALL_DTYPES))
def test_sum(d):
    a = sample(SHAPE, d, -9, 9)
    x = zyx.Tensor(a, dtype=d)
    out_d = _sum_dtype(d)
    for axis in AXES:
        for keepdim in (False, True):
            e = a.astype(np.float64 if d.is_float else np.int64).sum(
                axis=_np_axis(axis), keepdims=keepdim)
            assert_close(x.sum(axis, keepdim=keepdim), round_to(e, out_d), dtype=out_d,
                         scale=4, msg=f"sum axis={axis} keepdim={keepdim}")
    # dim= spelling and the module-level function
    assert_close(x.sum(dim=1), round_to(a.astype(np.float64).sum(1), out_d), dtype=out_d,
                 scale=4)
    assert_close(zyx.sum(x, dim=-1, keepdim=True),
                 round_to(a.astype(np.float64).sum(-1, keepdims=True), out_d), dtype=out_d,
                 scale=4)


def test_sum_dtype_argument():
    a = np.array([[100, 100], [27, 1]], dtype=np.int8)
    x = zyx.Tensor(a)
    assert_close(x.sum(0, dtype=zyx.int8), a.sum(0).astype(np.int8), dtype=zyx.int8)
    assert_close(x.sum(dtype=zyx.float32), np.float32(a.sum()), dtype=zyx.float32)
    b = np.array([True, True, False])
    assert_close(zyx.Tensor(b).sum(), np.int64(2), dtype=zyx.int64)


@pytest.mark.parametrize("d", (zyx.bool, zyx.uint8, zyx.int16, zyx.int32, zyx.int64,
                               zyx.float16, zyx.bfloat16, zyx.float32, zyx.float64),
                         ids=ids((zyx.bool, zyx.uint8, zyx.int16, zyx.int32, zyx.int64,
                                  zyx.float16, zyx.bfloat16, zyx.float32, zyx.float64)))
def test_prod(d):
    a = sample(SHAPE, d, -2, 2) if d.is_int else sample(SHAPE, d, 0.5, 1.5)
    if d is zyx.uint8:
        a = sample(SHAPE, d, 0, 3)
    x = zyx.Tensor(a, dtype=d)
    out_d = _sum_dtype(d)
    for axis in (None, 1, -1, (0, 2)):
        for keepdim in (False, True):
            e = a.astype(np.float64 if d.is_float else np.int64).prod(
                axis=_np_axis(axis), keepdims=keepdim)
            assert_close(x.prod(axis, keepdim=keepdim), round_to(e, out_d), dtype=out_d,
                         scale=4, msg=f"prod axis={axis}")


@pytest.mark.parametrize("name", ["amax", "amin"])
@pytest.mark.parametrize("d", ALL_DTYPES, ids=ids(ALL_DTYPES))
def test_max_min(name, d):
    a = sample(SHAPE, d, -50, 50)
    x = zyx.Tensor(a, dtype=d)
    ref = np.max if name == "amax" else np.min
    for axis in AXES:
        for keepdim in (False, True):
            got = getattr(x, name)(axis, keepdim=keepdim)
            assert_close(got, ref(a, axis=_np_axis(axis), keepdims=keepdim), dtype=d,
                         msg=f"{name} axis={axis} keepdim={keepdim}")
    assert_close(getattr(x, name)(dim=2), ref(a, axis=2), dtype=d)


@pytest.mark.parametrize("name", ["max", "min"])
@pytest.mark.parametrize("d", ALL_DTYPES, ids=ids(ALL_DTYPES))
def test_max_min_with_a_dim_give_values_and_indices(name, d):
    """torch: x.max(dim) is (values, indices); x.max() the maximum of all."""
    a = sample(SHAPE, d, -50, 50)
    x = zyx.Tensor(a, dtype=d)
    ref, arg = (np.max, np.argmax) if name == "max" else (np.min, np.argmin)
    assert_close(getattr(x, name)(), ref(a), dtype=d)
    for axis in (0, 1, -1):
        for keepdim in (False, True):
            values, indices = getattr(x, name)(axis, keepdim=keepdim)
            assert_close(values, ref(a, axis=axis, keepdims=keepdim), dtype=d)
            want = arg(a, axis=axis)
            if keepdim:
                want = np.expand_dims(want, axis)
            got = indices.numpy()
            # ties: any index holding the extreme value is right (torch's choice is unspecified)
            picked = np.take_along_axis(a, got if keepdim else np.expand_dims(got, axis), axis)
            np.testing.assert_array_equal(picked.reshape(want.shape),
                                          np.take_along_axis(a, np.expand_dims(
                                              arg(a, axis=axis), axis), axis).reshape(want.shape))
    assert getattr(x, name)(dim=2).values.shape == a.shape[:2]


@pytest.mark.parametrize("d", (zyx.float32, zyx.float64, zyx.float16, zyx.bfloat16),
                         ids=ids((zyx.float32, zyx.float64, zyx.float16, zyx.bfloat16)))
@pytest.mark.parametrize("n", [30, 70000], ids=["small", "parallel"])
def test_max_min_propagate_nan(d, n):
    """torch: max/min of a slice holding NaN is NaN, wherever the NaN sits."""
    a = round_to(np.random.uniform(-5, 5, size=(3, n)), d)
    a[1, n // 3] = np.nan
    a[2, -1] = np.nan
    x = zyx.Tensor(a, dtype=d)
    with np.errstate(all="ignore"):
        assert_close(x.amax(1), np.max(a, axis=1), dtype=d)
        assert_close(x.amin(1), np.min(a, axis=1), dtype=d)
        assert np.isnan(x.max().item()) and np.isnan(x.amin().item())


def test_max_min_infinities():
    a = np.full((2, 40000), -np.inf, dtype=np.float32)
    a[1, 7] = -3.0
    x = zyx.Tensor(a)
    assert_close(x.amax(1), np.array([-np.inf, -3.0], dtype=np.float32), dtype=zyx.float32)
    assert_close((-x).amin(1), np.array([np.inf, 3.0], dtype=np.float32), dtype=zyx.float32)
    assert x.max().item() == -3.0
    assert zyx.Tensor(np.full(8, -np.inf, dtype=np.float32)).max().item() == -np.inf


@pytest.mark.parametrize("d", FLOAT_DTYPES + (zyx.int32, zyx.uint8, zyx.bool),
                         ids=ids(FLOAT_DTYPES + (zyx.int32, zyx.uint8, zyx.bool)))
def test_mean(d):
    a = sample(SHAPE, d, -9, 9)
    x = zyx.Tensor(a, dtype=d)
    out_d = d if d.is_float else zyx.float32
    for axis in AXES:
        for keepdim in (False, True):
            e = a.astype(np.float64).mean(axis=_np_axis(axis), keepdims=keepdim)
            assert_close(x.mean(axis, keepdim=keepdim), round_to(e, out_d), dtype=out_d,
                         scale=4, msg=f"mean axis={axis}")
    assert_close(zyx.mean(x, dim=(0, 1)), round_to(a.astype(np.float64).mean((0, 1)), out_d),
                 dtype=out_d, scale=4)


@pytest.mark.parametrize("d", FLOAT_DTYPES, ids=ids(FLOAT_DTYPES))
def test_var_std(d):
    a = sample(SHAPE, d, -3, 3)
    x = zyx.Tensor(a, dtype=d)
    a64 = a.astype(np.float64)
    for axis in (None, 1, -1, (0, 2)):
        for correction in (0, 1, 2):
            for keepdim in (False, True):
                ev = a64.var(axis=_np_axis(axis), ddof=correction, keepdims=keepdim)
                es = a64.std(axis=_np_axis(axis), ddof=correction, keepdims=keepdim)
                assert_close(x.var(axis, keepdim=keepdim, correction=correction),
                             round_to(ev, d), dtype=d, scale=4, msg=f"var {axis} {correction}")
                assert_close(x.std(axis, keepdim=keepdim, correction=correction),
                             round_to(es, d), dtype=d, scale=4, msg=f"std {axis} {correction}")
    # torch's default is the unbiased estimate; dim= and unbiased= spellings
    assert_close(x.var(dim=2), round_to(a64.var(2, ddof=1), d), dtype=d, scale=4)
    assert_close(x.std(dim=0, unbiased=False), round_to(a64.std(0), d), dtype=d, scale=4)


def test_var_of_ints_and_too_few_elements():
    a = np.array([[1, 2, 3, 4]], dtype=np.int32)
    assert_close(zyx.Tensor(a).var(1), np.array([a.var(ddof=1)], np.float32), dtype=zyx.float32)
    with np.errstate(all="ignore"):
        # one element with correction=1 divides by zero: torch gives nan (or inf)
        v = zyx.Tensor(np.array([3.0], dtype=np.float32)).var().item()
        assert not np.isfinite(v)


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("d", NUMERIC_DTYPES + (zyx.bool,), ids=ids(NUMERIC_DTYPES + (zyx.bool,)))
def test_argmax_argmin(name, d):
    a = sample(SHAPE, d, -3, 3)          # a small range makes many ties: first one wins
    x = zyx.Tensor(a, dtype=d)
    ref = np.argmax if name == "argmax" else np.argmin
    for axis in (None, 0, 1, -1):
        for keepdim in (False, True):
            got = getattr(x, name)(axis, keepdim=keepdim)
            e = ref(a, axis=axis)
            if keepdim:
                e = np.expand_dims(e, axis) if axis is not None else e.reshape((1,) * a.ndim)
            assert_close(got, np.asarray(e, dtype=np.int64), dtype=zyx.int64,
                         msg=f"{name} axis={axis} keepdim={keepdim}")
    assert_close(getattr(x, name)(dim=1), ref(a, axis=1).astype(np.int64), dtype=zyx.int64)


def test_argmax_nan_and_ties():
    a = np.array([[1.0, 3.0, 3.0, 2.0], [np.nan, 1.0, np.nan, 9.0], [0.0, 0.0, 0.0, 0.0]],
                 dtype=np.float32)
    x = zyx.Tensor(a)
    assert x.argmax(1).tolist() == [1, 0, 0]     # NaN counts as the maximum (torch, numpy)
    assert x.argmin(1).tolist() == [0, 0, 0]
    assert x.argmax().item() == 4
    assert zyx.argmax(x, dim=0).tolist() == np.argmax(a, 0).tolist()


@pytest.mark.parametrize("d", (zyx.bool, zyx.int32, zyx.float32, zyx.uint8),
                         ids=ids((zyx.bool, zyx.int32, zyx.float32, zyx.uint8)))
def test_any_all(d):
    a = sample(SHAPE, d, -1, 1)
    if d.is_float:
        a = np.round(a)                      # many exact zeros
    x = zyx.Tensor(a, dtype=d)
    for axis in AXES:
        for keepdim in (False, True):
            assert_close(x.any(axis, keepdim=keepdim),
                         np.any(a, axis=_np_axis(axis), keepdims=keepdim), dtype=zyx.bool)
            assert_close(x.all(axis, keepdim=keepdim),
                         np.all(a, axis=_np_axis(axis), keepdims=keepdim), dtype=zyx.bool)
    assert_close(x.any(dim=1), np.any(a, axis=1), dtype=zyx.bool)


def _np_logsumexp(a, axis, keepdims=False):
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isinf(m), 0, m)
    r = np.log(np.sum(np.exp(a - m), axis=axis, keepdims=True)) + m
    return r if keepdims else np.squeeze(r, axis=axis)


@pytest.mark.parametrize("d", FLOAT_DTYPES, ids=ids(FLOAT_DTYPES))
def test_logsumexp_softmax_log_softmax(d):
    a = sample(SHAPE, d, -8, 8)
    x = zyx.Tensor(a, dtype=d)
    a64 = a.astype(np.float64)
    for axis in (0, 1, -1, 2):
        for keepdim in (False, True):
            assert_close(x.logsumexp(axis, keepdim=keepdim),
                         round_to(_np_logsumexp(a64, axis, keepdim), d), dtype=d, scale=4,
                         msg=f"logsumexp axis={axis}")
        e = np.exp(a64 - a64.max(axis, keepdims=True))
        sm = e / e.sum(axis, keepdims=True)
        assert_close(x.softmax(axis), round_to(sm, d), dtype=d, scale=4, msg=f"softmax {axis}")
        assert_close(x.log_softmax(dim=axis), round_to(np.log(sm), d), dtype=d, scale=4,
                     msg=f"log_softmax {axis}")
    assert_close(x.logsumexp((0, 2)), round_to(_np_logsumexp(a64, (0, 2)), d), dtype=d, scale=4)
    assert_close(zyx.softmax(x), round_to(np.exp(a64) / np.exp(a64).sum(-1, keepdims=True), d),
                 dtype=d, scale=4)


def test_softmax_stability_and_ints():
    a = np.array([[1000.0, 1000.0, -1000.0], [-np.inf, 0.0, -np.inf]], dtype=np.float32)
    x = zyx.Tensor(a)
    assert_close(x.softmax(-1), np.array([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]], np.float32),
                 dtype=zyx.float32)
    assert_close(x.logsumexp(-1), np.array([1000 + np.log(2), 0.0], np.float32),
                 dtype=zyx.float32)
    # a row of -inf stays -inf (no nan from inf - inf)
    assert zyx.Tensor(np.full((1, 3), -np.inf, np.float32)).logsumexp(1).item() == -np.inf
    i = np.array([[1, 2, 3]], dtype=np.int32)
    e = np.exp(i - 3.0)
    assert_close(zyx.Tensor(i).softmax(-1), (e / e.sum()).astype(np.float32), dtype=zyx.float32)
    assert_close(zyx.Tensor(a[:1]).softmax(-1, dtype=zyx.float64),
                 np.array([[0.5, 0.5, 0.0]]), dtype=zyx.float64)


@pytest.mark.parametrize("d", (zyx.int32, zyx.bool, zyx.uint8, zyx.float32, zyx.float64,
                               zyx.float16),
                         ids=ids((zyx.int32, zyx.bool, zyx.uint8, zyx.float32, zyx.float64,
                                  zyx.float16)))
def test_cumsum(d):
    a = sample(SHAPE, d, -5, 5)
    x = zyx.Tensor(a, dtype=d)
    out_d = d if d.is_float else zyx.int64
    for axis in (0, 1, 2, -1, -2):
        e = np.cumsum(a.astype(np.float64 if d.is_float else np.int64), axis=axis)
        assert_close(x.cumsum(axis), round_to(e, out_d), dtype=out_d, scale=4,
                     msg=f"cumsum {axis}")
    assert_close(x.cumsum(dim=1), round_to(np.cumsum(a.astype(np.float64 if d.is_float
                                                              else np.int64), 1), out_d),
                 dtype=out_d, scale=4)
    e = np.cumsum(a.astype(np.float64 if d.is_float else np.int64))
    assert_close(x.cumsum(), round_to(e, out_d), dtype=out_d, scale=4)   # flattened


def test_cumsum_long_axis():
    a = np.random.rand(3, 300).astype(np.float32)
    assert_close(zyx.Tensor(a).cumsum(1), np.cumsum(a.astype(np.float64), 1).astype(np.float32),
                 dtype=zyx.float32, rtol=1e-5, atol=1e-4)
    assert_close(zyx.cumsum(zyx.Tensor(a), dim=0), np.cumsum(a, 0), dtype=zyx.float32)


# ---------------------------------------------------------------------------------------
# views, 0-d, empty and large inputs

def test_reduce_noncontiguous_views():
    a = np.random.randn(6, 8).astype(np.float32)
    x = zyx.Tensor(a)
    assert_close(x.T.sum(0), a.T.sum(0), dtype=zyx.float32)
    assert_close(x[::2, ::-3].amax(1), a[::2, ::-3].max(1), dtype=zyx.float32)
    assert_close(x.flip(1).cumsum(1), np.cumsum(a[:, ::-1], 1), dtype=zyx.float32, scale=4)
    assert_close(x.reshape(4, 12).permute(1, 0).mean(1), a.reshape(4, 12).T.mean(1),
                 dtype=zyx.float32, scale=2)
    e = zyx.Tensor(a[:1]).expand(5, 8)
    assert_close(e.sum(0), 5 * a[0], dtype=zyx.float32, scale=2)
    assert_close(x[1:5].argmax(0), np.argmax(a[1:5], 0), dtype=zyx.int64)
    assert_close(x.permute(1, 0).softmax(-1), np.exp(a.T) / np.exp(a.T).sum(-1, keepdims=True),
                 dtype=zyx.float32, scale=4)


def test_reduce_zero_dim():
    x = zyx.Tensor(3.5)
    assert x.sum().item() == 3.5 and x.sum().shape == ()
    assert x.max().item() == 3.5
    assert x.mean().item() == 3.5
    assert x.sum(0).item() == 3.5 and x.sum(-1, keepdim=True).shape == ()
    assert x.argmax().item() == 0
    assert zyx.Tensor(4).sum().dtype == zyx.int64


def test_reduce_empty():
    x = zyx.Tensor(np.zeros((0, 3), dtype=np.float32))
    assert_close(x.sum(0), np.zeros(3, np.float32), dtype=zyx.float32)
    assert_close(x.sum(1), np.zeros(0, np.float32), dtype=zyx.float32)
    assert x.sum().item() == 0.0
    assert x.prod().item() == 1.0
    assert_close(x.any(0), np.zeros(3, bool), dtype=zyx.bool)
    assert_close(x.all(0), np.ones(3, bool), dtype=zyx.bool)
    assert_close(x.amax(1), np.zeros(0, np.float32), dtype=zyx.float32)  # nothing to reduce
    with np.errstate(all="ignore"):
        assert np.isnan(x.mean().item())
    with pytest.raises(zyx.ShapeError, match=r"\(0, 3\)"):
        x.amax(0)
    with pytest.raises(zyx.ShapeError):
        x.argmax()
    with pytest.raises(zyx.ShapeError):
        x.min()


def test_large_sum():
    n = 1 << 24     # 16M float32
    a = np.random.rand(n).astype(np.float32)
    x = zyx.Tensor(a)
    exact = a.astype(np.float64).sum()
    assert abs(x.sum().item() - exact) <= 1e-5 * exact
    assert abs(x.mean().item() - exact / n) <= 1e-5
    assert x.max().item() == a.max() and x.min().item() == a.min()
    m = a.reshape(4096, 4096)
    y = zyx.Tensor(m)
    np.testing.assert_allclose(y.sum(0).numpy(), m.astype(np.float64).sum(0), rtol=1e-5)
    np.testing.assert_allclose(y.sum(1).numpy(), m.astype(np.float64).sum(1), rtol=1e-5)
    i = zyx.Tensor(np.ones(n, dtype=np.int32))
    assert i.sum().item() == n


def test_large_argmax_softmax_rows():
    a = np.random.randn(4096, 1024).astype(np.float32)
    x = zyx.Tensor(a)
    e = np.exp(a - a.max(-1, keepdims=True))
    assert_close(x.softmax(-1), e / e.sum(-1, keepdims=True), dtype=zyx.float32, atol=1e-7)
    assert np.array_equal(x.argmax(1).numpy(), a.argmax(1))
    assert np.array_equal(x.argmin(0).numpy(), a.argmin(0))
    assert x.reshape(-1).argmax().item() == a.argmax()
