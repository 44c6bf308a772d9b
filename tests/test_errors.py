"""Errors: ShapeError / DTypeError are raised when the op is written (nothing runs), their
messages name the shapes and dtypes, and a failed op leaves every existing tensor intact."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import zyx

pytestmark = pytest.mark.usefixtures("device")

RT = zyx._RT


def _x():
    return zyx.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))


SHAPE_ERRORS = [
    (lambda x: x + zyx.ones(2, 4), r"\(3, 4\).*\(2, 4\)"),
    (lambda x: x * zyx.ones(4, 3), r"\(3, 4\).*\(4, 3\)"),
    (lambda x: zyx.where(zyx.ones(2, 1, dtype=zyx.bool), x, 0.0), r"\(2, 1\).*\(3, 4\)"),
    (lambda x: x.reshape(5, 2), r"\(3, 4\).*\(5, 2\)"),
    (lambda x: x.view(-1, 5), r"\(3, 4\)"),
    (lambda x: x.expand(3, 5), r"\(3, 4\).*\(3, 5\)"),
    (lambda x: x.permute(0, 0), r"\(0, 0\)"),
    (lambda x: x.permute(1, 0, 2), r"\(3, 4\)"),
    (lambda x: x @ zyx.ones(3, 2), r"\(3, 4\).*\(3, 2\)"),
    (lambda x: x.sum(2), r"axis 2.*2 dimension"),
    (lambda x: x.mean(-3), r"axis -3"),
    (lambda x: x.softmax(5), r"axis 5"),
    (lambda x: zyx.cat([x, zyx.ones(3, 5)], 0), r"\(3, 4\).*\(3, 5\)"),
    (lambda x: zyx.stack([x, zyx.ones(4, 3)]), r"\(3, 4\).*\(4, 3\)"),
    (lambda x: x.split([1, 1], 0), r"\[1, 1\].*3"),
    (lambda x: x.squeeze(4), r"axis 4"),
    (lambda x: x.item(), r"\(3, 4\)"),
    (lambda x: x.gather(1, zyx.Tensor(np.zeros(3, np.int64))), r"dims"),
    (lambda x: zyx.Tensor(np.zeros((0, 4), np.float32)).max(0), r"\(0, 4\)"),
    (lambda x: x.pad((1, 1, 1, 1, 1, 1)), r"2 dimension"),
    (lambda x: zyx.ones(3).tril(), r"2 dimensions"),
    (lambda x: x.flatten(1, 0), r"end_dim"),
]

DTYPE_ERRORS = [
    (lambda x: x & x, "float32"),
    (lambda x: x | 1, "float32"),
    (lambda x: ~x, "float32"),
    (lambda x: x << 2, "float32"),
    (lambda x: x.gather(0, x), "float32"),
    (lambda x: x.cast("complex64"), "complex64"),
    (lambda x: zyx.zeros(2, dtype="float8"), "float8"),
    (lambda x: -(x > 0), "bool"),
    (lambda x: (x > 0) - (x > 1), "bool"),
    (lambda x: zyx.Tensor(np.array(["a"])), "<U1"),
    (lambda x: x + "a", "str"),
    (lambda x: zyx.ones(2, dtype=zyx.int8) + 1.5j, "complex"),
    (lambda x: zyx.full((2,), 1.5, dtype=zyx.int32), "1.5.*int32"),
]


@pytest.mark.parametrize("k", range(len(SHAPE_ERRORS)))
def test_shape_errors_when_written(k):
    fn, pattern = SHAPE_ERRORS[k]
    x = _x()
    before = dict(zyx.stats())
    with pytest.raises(zyx.ShapeError, match=pattern):
        fn(x)
    after = zyx.stats()
    assert after["realizations"] == before["realizations"]
    assert after["kernels_launched"] == before["kernels_launched"]


@pytest.mark.parametrize("k", range(len(DTYPE_ERRORS)))
def test_dtype_errors_when_written(k):
    fn, pattern = DTYPE_ERRORS[k]
    x = _x()
    before = zyx.stats()["realizations"]
    with pytest.raises(zyx.DTypeError, match=pattern):
        fn(x)
    assert zyx.stats()["realizations"] == before


def test_error_hierarchy():
    assert issubclass(zyx.ShapeError, zyx.ZyxError) and issubclass(zyx.ShapeError, ValueError)
    assert issubclass(zyx.DTypeError, zyx.ZyxError) and issubclass(zyx.DTypeError, TypeError)
    for e in (zyx.AllocationError, zyx.BackendError, zyx.NoBackendAvailable):
        assert issubclass(e, zyx.ZyxError)
    assert issubclass(zyx.NoBackendAvailable, zyx.BackendError)


def test_failed_ops_leave_tensors_intact():
    a = np.random.randn(3, 4).astype(np.float32)
    x = zyx.Tensor(a)
    y = (x * 2).exp()                      # a lazy graph hanging off x
    gc.collect()
    bytes0, nodes0 = RT.pool_bytes(), len(RT.graph)
    for fn, _ in SHAPE_ERRORS[:16]:
        with pytest.raises(zyx.ShapeError):
            fn(x)
    for fn, _ in DTYPE_ERRORS[:5]:
        with pytest.raises(zyx.DTypeError):
            fn(x)
    with pytest.raises(zyx.ShapeError):
        zyx.ones(3, 4, dtype=zyx.int8) @ x.T.T.reshape(4, 3).T   # promotion casts first
    gc.collect()
    # nothing half-built stays in the graph, no memory is held, and everything still works
    assert len(RT.graph) == nodes0 and RT.pool_bytes() == bytes0
    np.testing.assert_array_equal(x.numpy(), a)
    np.testing.assert_allclose(y.numpy(), np.exp(a * 2), rtol=1e-6)
    np.testing.assert_allclose((x + y).sum(1).numpy(), (a + np.exp(a * 2)).sum(1), rtol=1e-5)


def test_allocation_error_leaves_state_usable():
    gc.collect()
    bytes0 = RT.pool_bytes()
    huge = zyx.zeros(1 << 20, 1 << 20)      # a constant: needs no memory until computed
    with pytest.raises(zyx.AllocationError):
        (huge + 1).realize()                  # 4 TiB cannot be allocated
    assert RT.pool_bytes() == bytes0
    del huge
    x = zyx.Tensor(np.ones(3, np.float32))
    assert (x * 2).tolist() == [2.0, 2.0, 2.0]


def test_index_and_value_errors_are_python_ones():
    x = _x()
    with pytest.raises(IndexError):
        x[3]
    with pytest.raises(ValueError):
        zyx.arange(0, 1, 0)
    with pytest.raises(ValueError):
        x.div(x, rounding_mode="ceil")
    with pytest.raises(TypeError):
        x.sum(axis=0, dim=1)
