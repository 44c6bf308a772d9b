"""matmul / @ / dot against numpy: matrix, batched, broadcast batches, vector cases, dtypes,
non-contiguous operands, empty inner dimension and shape errors."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from conftest import assert_close, ids, round_to, sample

pytestmark = pytest.mark.usefixtures("device")

CASES = [
    ((3, 4), (4, 5)),
    ((1, 7), (7, 1)),
    ((4,), (4, 3)),            # vector @ matrix
    ((3, 4), (4,)),            # matrix @ vector
    ((6,), (6,)),              # vector @ vector -> 0-d
    ((2, 3, 4), (4, 5)),       # batched @ matrix
    ((4,), (2, 4, 3)),         # vector @ batched
    ((2, 3, 4), (4,)),         # batched @ vector
    ((2, 1, 3, 4), (5, 4, 2)),  # broadcast batch dims
    ((3, 4), (2, 4, 5)),
    ((17, 33), (33, 65)),      # sizes that are not multiples of vector widths
    ((2, 16, 64), (2, 64, 16)),
]


@pytest.mark.parametrize("sa,sb", CASES, ids=[f"{a}@{b}" for a, b in CASES])
def test_matmul_shapes(sa, sb):
    a = np.random.randn(*sa).astype(np.float32)
    b = np.random.randn(*sb).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    assert_close(x @ y, ref.astype(np.float32), dtype=zyx.float32, rtol=1e-5, atol=1e-5)
    assert_close(x.matmul(y), ref.astype(np.float32), dtype=zyx.float32, rtol=1e-5, atol=1e-5)
    assert_close(zyx.matmul(x, y), ref.astype(np.float32), dtype=zyx.float32, rtol=1e-5,
                 atol=1e-5)


@pytest.mark.parametrize("d", (zyx.float64, zyx.float16, zyx.bfloat16, zyx.int32, zyx.int64,
                               zyx.uint8, zyx.int8),
                         ids=ids((zyx.float64, zyx.float16, zyx.bfloat16, zyx.int32, zyx.int64,
                                  zyx.uint8, zyx.int8)))
def test_matmul_dtypes(d):
    a = sample((5, 6), d, -3, 3)
    b = sample((6, 4), d, -3, 3)
    got = zyx.Tensor(a, dtype=d) @ zyx.Tensor(b, dtype=d)
    if d.is_float:
        ref = round_to(a.astype(np.float64) @ b.astype(np.float64), d)
        assert_close(got, ref, dtype=d, scale=2)
    else:
        # integer matmul keeps the dtype and wraps like integer arithmetic does
        ref = (a.astype(np.int64) @ b.astype(np.int64)).astype(d.np)
        assert_close(got, ref, dtype=d)


def test_matmul_mixed_dtypes_promote():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = np.random.randn(3, 2).astype(np.float32)
    got = zyx.Tensor(a) @ zyx.Tensor(b)
    assert_close(got, (a @ b).astype(np.float32), dtype=zyx.float32, rtol=1e-5, atol=1e-5)
    got = zyx.Tensor(b.T.astype(np.float64)) @ zyx.Tensor(b)
    assert got.dtype == zyx.float64


def test_matmul_noncontiguous_operands():
    a = np.random.randn(8, 5).astype(np.float32)
    b = np.random.randn(8, 6).astype(np.float32)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    assert_close(x.T @ y, a.T @ b, dtype=zyx.float32, rtol=1e-5, atol=1e-5)
    assert_close(x[::2].T @ y.flip(0)[::2], a[::2].T @ b[::-1][::2], dtype=zyx.float32,
                 rtol=1e-5, atol=1e-5)
    c = np.random.randn(5, 1).astype(np.float32)
    assert_close(x @ zyx.Tensor(c).expand(5, 3), a @ np.broadcast_to(c, (5, 3)),
                 dtype=zyx.float32, rtol=1e-5, atol=1e-5)
    # reflected: numpy array on the left
    assert_close(a.T @ x, a.T @ a, dtype=zyx.float32, rtol=1e-5, atol=1e-5)


def test_matmul_fused_with_elementwise():
    a = np.random.randn(4, 8).astype(np.float32)
    w = np.random.randn(8, 3).astype(np.float32)
    bias = np.random.randn(3).astype(np.float32)
    got = (zyx.Tensor(a).relu() @ zyx.Tensor(w) + zyx.Tensor(bias)).tanh()
    ref = np.tanh(np.maximum(a, 0) @ w + bias)
    assert_close(got, ref, dtype=zyx.float32, rtol=1e-5, atol=1e-5)


def test_matmul_larger_square():
    a = np.random.randn(128, 96).astype(np.float32)
    b = np.random.randn(96, 112).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert_close(zyx.Tensor(a) @ zyx.Tensor(b), ref.astype(np.float32), dtype=zyx.float32,
                 rtol=1e-4, atol=1e-4)


def test_matmul_empty_inner_dim():
    a = np.zeros((3, 0), np.float32)
    b = np.zeros((0, 2), np.float32)
    assert_close(zyx.Tensor(a) @ zyx.Tensor(b), np.zeros((3, 2), np.float32), dtype=zyx.float32)
    assert (zyx.zeros(0, 4) @ zyx.zeros(4, 2)).numpy().shape == (0, 2)


def test_dot():
    a = np.random.randn(9).astype(np.float64)
    b = np.random.randn(9).astype(np.float64)
    got = zyx.Tensor(a).dot(zyx.Tensor(b))
    assert got.shape == () and got.dtype == zyx.float64
    assert got.item() == pytest.approx(float(a @ b), rel=1e-12)
    assert zyx.dot(zyx.Tensor(a), zyx.Tensor(b)).item() == pytest.approx(float(a @ b), rel=1e-12)
    with pytest.raises(zyx.ShapeError):
        zyx.Tensor(a).dot(zyx.ones(3, 3))


def test_matmul_errors_name_shapes():
    with pytest.raises(zyx.ShapeError, match=r"\(3, 4\).*\(5, 2\)"):
        zyx.ones(3, 4) @ zyx.ones(5, 2)
    with pytest.raises(zyx.ShapeError):
        zyx.ones(2, 3, 4) @ zyx.ones(3, 4, 2)      # batch dims 2 and 3 do not broadcast
    with pytest.raises(zyx.ShapeError):
        zyx.Tensor(1.0) @ zyx.ones(1)
    with pytest.raises(zyx.ShapeError):
        zyx.ones(4) @ zyx.ones(3)


@pytest.mark.parametrize("k", [4, 8, 12, 20, 32, 48, 60])
def test_short_contiguous_reductions_in_register_tiles(k):
    """x @ W.T with a short inner dimension: the 4x4 tile's innermost reduce loop is split
    into lanes (length/J x J partial sums per accumulator, folded after the loops)."""
    rng = np.random.default_rng(k)
    a = rng.standard_normal((36, k)).astype(np.float32)
    b = rng.standard_normal((44, k)).astype(np.float32)
    got = (zyx.tensor(a) @ zyx.tensor(b).T).numpy()
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.T.astype(np.float64),
                               rtol=1e-5, atol=1e-5)
    # batched, and a long outer reduction on top (blocked float sums around the lanes)
    a3 = rng.standard_normal((8, 12, 500, k)).astype(np.float32)
    b3 = rng.standard_normal((8, 16, 500, k)).astype(np.float32)
    got = zyx.einsum("bine,bjne->bij", zyx.tensor(a3), zyx.tensor(b3)).numpy()
    ref = np.einsum("bine,bjne->bij", a3.astype(np.float64), b3.astype(np.float64))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("n, rows", [(1024, 8), (768, 16)])
def test_lane_tile_rows_that_share_cache_sets_are_capped(n, rows):
    """A row-major n x n matmul's "lanes" tile broadcasts one value from each of its rows
    per step; rows 1024 floats apart (4 KB) all map to the same L1 sets, and 16 of them
    overflow the sets' ways (1024: 20 -> 10.6 ms with 8 rows on this machine's 12-way
    L1). Such tiles take ALIASED_ROWS (8) rows, others 16 (on 64-byte vectors). The
    product matches numpy."""
    from zyx._core import kernel as K
    from zyx._core.kernelizer import kernelize
    rng = np.random.default_rng(8)
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    out = zyx.tensor(a) @ zyx.tensor(b)
    g = zyx._RT.graph
    order, _ = g.collect([out._id])
    (step,) = [s for s in kernelize(g, order, [out._id], 64)[0] if s.kernel is not None]
    ops = step.kernel.ops
    loops = [i for i, op in enumerate(ops) if op[0] == K.LOOP]
    # the rows loop directly holds the 16-lane loop
    lane = [i for i in loops if ops[i][2] == 16][-1]
    assert ops[loops[loops.index(lane) - 1]][2] == rows
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-3, atol=1e-3)
