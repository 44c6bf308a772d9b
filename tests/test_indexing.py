"""__getitem__ (ints, slices with steps and negatives, None, Ellipsis, integer index tensors),
gather and masked_fill against numpy."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from conftest import assert_close, ids, sample

pytestmark = pytest.mark.usefixtures("device")

A = np.arange(120, dtype=np.float32).reshape(4, 5, 6) * 0.5 - 7

BASIC = [
    (1,), (-1,), (0, 2), (3, -1, 5), (slice(None),), (slice(1, 3),), (slice(None, None, 2),),
    (slice(None, None, -1),), (slice(-2, None),), (slice(None), slice(4, 0, -2)),
    (slice(None), slice(None), slice(5, None, -3)), (slice(1, None, 3), 2),
    (Ellipsis, 1), (Ellipsis, slice(None, None, -2)), (1, Ellipsis), (None,),
    (slice(None), None, 2), (None, Ellipsis, None), (2, None, slice(1, 4), None),
    (Ellipsis,), (slice(-100, 100),), (slice(3, 1),), (slice(None), slice(2, 2)),
    (-4, slice(-1, -6, -1), slice(0, 6, 4)), (slice(None, None, 7),), (0, 0, 0),
    (slice(None, None, -5), Ellipsis, slice(1, None, 2)),
]


@pytest.mark.parametrize("idx", BASIC, ids=[repr(i) for i in BASIC])
def test_basic_indexing(idx):
    x = zyx.Tensor(A)
    assert_close(x[idx if len(idx) > 1 else idx[0]], A[idx if len(idx) > 1 else idx[0]],
                 dtype=zyx.float32)


@pytest.mark.parametrize("d", (zyx.int32, zyx.bool, zyx.float16, zyx.int8),
                         ids=ids((zyx.int32, zyx.bool, zyx.float16, zyx.int8)))
def test_indexing_dtypes(d):
    b = sample((4, 6), d, -9, 9)
    x = zyx.Tensor(b, dtype=d)
    assert_close(x[1:, ::-2], b[1:, ::-2], dtype=d)
    assert_close(x[:, 3], b[:, 3], dtype=d)
    assert_close(x[zyx.Tensor(np.array([2, 0, 2]))], b[[2, 0, 2]], dtype=d)


def test_int_indexing_result_is_0d():
    x = zyx.Tensor(A)
    v = x[1, 2, 3]
    assert v.shape == () and v.item() == A[1, 2, 3]
    assert x[np.int64(2)].shape == (5, 6)


def test_index_errors():
    x = zyx.Tensor(A)
    with pytest.raises(IndexError):
        x[4]
    with pytest.raises(IndexError):
        x[0, 0, 0, 0]
    with pytest.raises(IndexError):
        x[..., ...]
    with pytest.raises(IndexError):
        x[1.5]
    with pytest.raises(IndexError):
        x[zyx.Tensor(np.array([0.0]))]
    with pytest.raises(IndexError, match="mask"):     # a mask must match the dims it indexes
        x[zyx.Tensor(np.array([True, False, True]))]
    with pytest.raises(RuntimeError, match="shape mismatch"):   # setitem: tests/test_inplace.py
        x[0] = zyx.Tensor(np.zeros(7, np.float32))


TENSOR_IDX = [
    lambda: (np.array([0, 3, 1]),),
    lambda: (np.array([-1, 0, -4]),),
    lambda: (np.array([[0, 1], [3, 3]]),),
    lambda: (slice(None), np.array([4, 0, 2, 2])),
    lambda: (np.array([0, 2]), np.array([1, 4])),              # adjacent pair: zip
    lambda: (np.array([[0], [3]]), np.array([1, 4, 2])),       # broadcast index shapes
    lambda: (np.array([1, 2]), slice(None), np.array([0, 5])),  # non-adjacent: dims first
    lambda: (1, slice(None), np.array([0, 5, 5])),            # torch: ints index first
    lambda: (Ellipsis, np.array([3, 1])),
    lambda: (slice(1, 3), np.array([0, 4]), slice(None, None, -1)),
    lambda: ([0, 2, 3],),                                       # a plain list
    lambda: (np.array(2),),                                     # 0-d index tensor
    lambda: (slice(None), np.array(1), np.array([5, 0])),
    lambda: (np.array([1, 0]), None),
    lambda: (None, np.array([3, 0])),
    lambda: (np.zeros(0, np.int64),),                           # empty index
]


@pytest.mark.parametrize("k", range(len(TENSOR_IDX)))
def test_integer_tensor_indexing(k):
    idx = TENSOR_IDX[k]()
    x = zyx.Tensor(A)
    zidx = tuple(zyx.Tensor(i) if isinstance(i, np.ndarray) else i for i in idx)
    ref = A[idx if len(idx) > 1 else idx[0]]
    if isinstance(idx[0], int):
        # torch treats an int as basic indexing applied first, so it never counts as an
        # advanced index (numpy would move the index-tensor dims to the front here)
        ref = A[idx[0]][idx[1:]]
    got = x[zidx if len(zidx) > 1 else zidx[0]]
    assert_close(got, ref, dtype=zyx.float32, msg=repr(idx))


def test_index_tensor_int64_and_views():
    x = zyx.Tensor(A)
    i = zyx.Tensor(np.array([2, 0], dtype=np.int64))
    assert_close(x.T[i], A.T[[2, 0]], dtype=zyx.float32)
    assert_close(x[:, ::-1][i], A[:, ::-1][[2, 0]], dtype=zyx.float32)
    # an index tensor that is itself computed lazily
    j = zyx.Tensor(np.array([1, 2, 3], dtype=np.int32)) * 2 - 3     # [-1, 1, 3]
    assert_close(x[0, j], A[0, [-1, 1, 3]], dtype=zyx.float32)


# ---------------------------------------------------------------------------------------
# gather / masked_fill

@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("d", (zyx.float32, zyx.int64, zyx.bool, zyx.float16),
                         ids=ids((zyx.float32, zyx.int64, zyx.bool, zyx.float16)))
def test_gather(axis, d):
    src = sample((3, 4), d, -9, 9)
    n = src.shape[axis]
    shape = list(src.shape)
    shape[axis] = 5          # gather can pick more than the axis holds
    idx = np.random.randint(0, n, size=shape)
    got = zyx.Tensor(src, dtype=d).gather(axis, zyx.Tensor(idx))
    assert_close(got, np.take_along_axis(src, idx, axis=axis), dtype=d)
    got = zyx.gather(zyx.Tensor(src, dtype=d), axis, zyx.Tensor(idx))
    assert_close(got, np.take_along_axis(src, idx, axis=axis), dtype=d)


def test_gather_smaller_index_and_negative():
    src = np.random.randn(4, 5).astype(np.float32)
    idx = np.array([[0, -1], [2, 3], [-5, 4]])         # 3 rows: a prefix of src's rows
    got = zyx.Tensor(src).gather(1, zyx.Tensor(idx))
    assert_close(got, np.take_along_axis(src[:3], idx % 5, axis=1), dtype=zyx.float32)
    with pytest.raises(zyx.DTypeError):
        zyx.Tensor(src).gather(1, zyx.Tensor(np.zeros((4, 1), np.float32)))
    with pytest.raises(zyx.ShapeError):
        zyx.Tensor(src).gather(1, zyx.Tensor(np.zeros(4, np.int64)))


@pytest.mark.parametrize("d", (zyx.float32, zyx.int32, zyx.bool, zyx.bfloat16),
                         ids=ids((zyx.float32, zyx.int32, zyx.bool, zyx.bfloat16)))
def test_masked_fill(d):
    b = sample((3, 4), d, -9, 9)
    mask = np.random.random((3, 4)) < 0.5
    fill = True if d.is_bool else (-2 if d.is_int else -1.5)
    got = zyx.Tensor(b, dtype=d).masked_fill(zyx.Tensor(mask), fill)
    assert_close(got, np.where(mask, np.asarray(fill, dtype=b.dtype), b), dtype=d)
    col = np.array([[True], [False], [True]])             # broadcast mask
    got = zyx.masked_fill(zyx.Tensor(b, dtype=d), zyx.Tensor(col), fill)
    assert_close(got, np.where(col, np.asarray(fill, dtype=b.dtype), b), dtype=d)


def test_masked_fill_with_inf_then_softmax():
    s = np.random.randn(3, 3).astype(np.float32)
    causal = np.triu(np.ones((3, 3), bool), 1)
    x = zyx.Tensor(s).masked_fill(zyx.Tensor(causal), float("-inf")).softmax(-1)
    e = np.exp(np.where(causal, -np.inf, s) - np.where(causal, -np.inf, s).max(-1, keepdims=True))
    assert_close(x, e / e.sum(-1, keepdims=True), dtype=zyx.float32)
