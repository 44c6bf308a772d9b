"""scatter family, index_*, take_along_dim, masked_select, nonzero, where(cond), unique:
values and gradients against torch, out-of-range indices, bad arguments."""
import numpy as np
import pytest

import zyx
from _torch_ref import torch, both, same, grads_match

pytestmark = pytest.mark.usefixtures("device")


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def unique_index(shape, n, dim, seed=0):
    """An index of `shape` whose entries along dim are distinct values in [0, n)."""
    r = np.random.default_rng(seed)
    moved = np.moveaxis(np.empty(shape, np.int64), dim, -1)
    flat = moved.reshape(-1, moved.shape[-1])
    for row in flat:
        row[:] = r.permutation(n)[:len(row)]
    return np.moveaxis(flat.reshape(moved.shape), -1, dim)


@pytest.mark.parametrize("dim", [0, 1])
def test_scatter_src_and_value(dim):
    idx = unique_index((2, 3), 4 if dim == 0 else 5, dim)
    x, tx = both(rnd(4, 5))
    s, ts = both(rnd(3, 4, seed=1))
    zi, ti = zyx.tensor(idx), torch.tensor(idx)
    same(zyx.scatter(x, dim, zi, s), torch.scatter(tx, dim, ti, ts))
    same(x.scatter(dim, zi, 2.5), tx.scatter(dim, ti, 2.5))
    same(x.scatter_add(dim, zi, s), tx.scatter_add(dim, ti, ts))
    # (torch's scatter backward needs src shaped like the index)
    grads_match(lambda a, b: a.scatter(dim, zi, b), lambda a, b: a.scatter(dim, ti, b),
                [rnd(4, 5), rnd(2, 3, seed=1)])
    grads_match(lambda a, b: a.scatter_add(dim, zi, b), lambda a, b: a.scatter_add(dim, ti, b),
                [rnd(4, 5), rnd(2, 3, seed=1)])


def test_scatter_add_repeated_indices_and_ints():
    idx = np.array([[0, 1, 0, 0], [2, 2, 1, 0]])
    x, tx = both(np.zeros((3, 4), np.int64), zyx.int64)
    s, ts = both(np.arange(8).reshape(2, 4), zyx.int64)
    same(x.scatter_add(0, zyx.tensor(idx), s), tx.scatter_add(0, torch.tensor(idx), ts))


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(reduce, include_self):
    idx = np.array([[0, 1, 0], [2, 0, 0], [1, 1, 3]])
    zi, ti = zyx.tensor(idx), torch.tensor(idx)
    a, b = rnd(4, 3), rnd(3, 3, seed=2)
    x, tx = both(a)
    s, ts = both(b)
    same(x.scatter_reduce(0, zi, s, reduce, include_self=include_self),
         tx.scatter_reduce(0, ti, ts, reduce, include_self=include_self))
    if reduce in ("sum", "mean", "prod"):
        grads_match(lambda p, q: p.scatter_reduce(0, zi, q, reduce, include_self=include_self),
                    lambda p, q: p.scatter_reduce(0, ti, q, reduce, include_self=include_self),
                    [a, b])
    ints = np.array([[5, -3, 8], [1, 2, 7], [0, 4, -6], [9, 9, 1]])
    xi, txi = both(ints, zyx.int64)
    si, tsi = both(ints[:3] * 2 + 1, zyx.int64)
    same(xi.scatter_reduce(0, zi, si, reduce, include_self=include_self),
         txi.scatter_reduce(0, ti, tsi, reduce, include_self=include_self))


def test_scatter_errors():
    x = zyx.zeros(3, 4)
    with pytest.raises(IndexError, match="out of bounds"):
        x.scatter(0, zyx.tensor([[0, 3]]), 1.0).numpy()
    with pytest.raises(IndexError, match="out of bounds"):
        x.scatter_add(1, zyx.tensor(np.array([[-1]])), zyx.ones(1, 1)).numpy()
    with pytest.raises(zyx.ShapeError):
        x.scatter(0, zyx.tensor([0, 1]), 1.0)
    with pytest.raises(zyx.DTypeError):
        x.scatter(0, zyx.tensor([[0.5]]), 1.0)
    with pytest.raises(ValueError):
        x.scatter_reduce(0, zyx.tensor([[0]]), zyx.ones(1, 1), "median")


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_select_add_copy_fill(dim):
    a = rnd(4, 5, 3)
    n = a.shape[dim]
    idx = np.array([n - 1, 0, 1])
    x, tx = both(a)
    zi, ti = zyx.tensor(idx), torch.tensor(idx)
    same(zyx.index_select(x, dim, zi), torch.index_select(tx, dim, ti))
    src_shape = list(a.shape)
    src_shape[dim] = 3
    b = rnd(*src_shape, seed=3)
    s, ts = both(b)
    same(x.index_add(dim, zi, s), tx.index_add(dim, ti, ts))
    same(x.index_add(dim, zi, s, alpha=2), tx.index_add(dim, ti, ts, alpha=2))
    same(x.index_copy(dim, zi, s), tx.index_copy(dim, ti, ts))
    same(x.index_fill(dim, zi, -1.5), tx.index_fill(dim, ti, -1.5))
    grads_match(lambda p: p.index_select(dim, zi), lambda p: p.index_select(dim, ti), [a])
    grads_match(lambda p, q: p.index_add(dim, zi, q), lambda p, q: p.index_add(dim, ti, q), [a, b])
    grads_match(lambda p, q: p.index_copy(dim, zi, q), lambda p, q: p.index_copy(dim, ti, q),
                [a, b])
    grads_match(lambda p: p.index_fill(dim, zi, 0.0), lambda p: p.index_fill(dim, ti, 0.0), [a])


def test_index_ops_ints_and_errors():
    x, tx = both(np.arange(12).reshape(3, 4), zyx.int32)
    same(x.index_select(1, zyx.tensor([3, 3, 0])), tx.index_select(1, torch.tensor([3, 3, 0])))
    same(x.index_fill(0, zyx.tensor([1]), 7), tx.index_fill(0, torch.tensor([1]), 7))
    with pytest.raises(IndexError, match="out of bounds"):
        x.index_select(1, zyx.tensor([4])).numpy()
    with pytest.raises(IndexError):
        x.index_select(0, zyx.tensor([[0]]))
    with pytest.raises(zyx.ShapeError):
        x.index_add(0, zyx.tensor([0]), zyx.ones(2, 4, dtype=zyx.int32))


def test_take_along_dim():
    a = rnd(3, 4)
    idx = np.array([[0, 3], [1, 1], [2, 0]])
    x, tx = both(a)
    same(zyx.take_along_dim(x, zyx.tensor(idx), 1), torch.take_along_dim(tx, torch.tensor(idx), 1))
    same(x.take_along_dim(zyx.tensor(np.array([5, 0, 11]))),
         tx.take_along_dim(torch.tensor([5, 0, 11])))
    bidx = np.array([[2], [0], [1]])      # broadcast along dim 1
    same(zyx.take_along_dim(x, zyx.tensor(bidx).expand(3, 4), 0),
         torch.take_along_dim(tx, torch.tensor(bidx).expand(3, 4), 0))
    sorted_idx = x.argsort(1)
    same(zyx.take_along_dim(x, sorted_idx, 1), torch.sort(tx, 1).values)
    grads_match(lambda p: p.take_along_dim(zyx.tensor(idx), 1),
                lambda p: p.take_along_dim(torch.tensor(idx), 1), [a])


def test_masked_select_nonzero_where_unique():
    a = np.array([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]], np.float32)
    x, tx = both(a)
    m = x > 0.5
    same(zyx.masked_select(x, m), torch.masked_select(tx, tx > 0.5))
    same(x.masked_select(zyx.tensor([True, False, True])),
         tx.masked_select(torch.tensor([True, False, True])))
    same(zyx.nonzero(x), torch.nonzero(tx))
    for z, t in zip(x.nonzero(as_tuple=True), torch.nonzero(tx, as_tuple=True)):
        same(z, t)
    for z, t in zip(zyx.where(x != 0), torch.where(tx != 0)):
        same(z, t)
    same(zyx.where(x > 0, x, 0.0), torch.where(tx > 0, tx, 0.0))
    grads_match(lambda p: p.masked_select(zyx.tensor(a != 0)),
                lambda p: p.masked_select(torch.tensor(a != 0)), [a])
    u = np.array([[3, 1, 3], [2, 1, 5]])
    zu, tu = both(u, zyx.int64)
    same(zyx.unique(zu), torch.unique(tu))
    for z, t in zip(zu.unique(return_inverse=True, return_counts=True),
                    torch.unique(tu, return_inverse=True, return_counts=True)):
        same(z, t)
    for z, t in zip(zyx.unique(zu, dim=1, return_counts=True),
                    torch.unique(tu, dim=1, return_counts=True)):
        same(z, t)
    with pytest.raises(zyx.DTypeError):
        zyx.masked_select(x, x)
