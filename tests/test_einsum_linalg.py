"""einsum, bmm/mm/mv/outer, diag/diagonal/trace, tensordot, kron, cross, norms, cumprod,
cummax/cummin, logcumsumexp, diff, meshgrid: values and gradients against torch."""
import numpy as np
import pytest

import zyx
from _torch_ref import torch, both, same, grads_match

pytestmark = pytest.mark.usefixtures("device")


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


EINSUMS = [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij,jk", [(3, 4), (4, 2)]),
    ("ii->i", [(4, 4)]),
    ("ii", [(4, 4)]),
    ("ij->ji", [(3, 5)]),
    ("i,i->", [(6,), (6,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (5, 4, 2)]),
    ("b...,b...->b", [(3, 2, 2), (3, 2, 2)]),
    ("ijk->", [(2, 3, 4)]),
    ("iij->ij", [(3, 3, 2)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    ("ij,ij->ij", [(3, 1), (1, 4)]),
    ("Ab,bC->CA", [(2, 3), (3, 4)]),
]


@pytest.mark.parametrize("eq,shapes", EINSUMS, ids=[e for e, _ in EINSUMS])
def test_einsum_matches_torch(eq, shapes):
    arrays = [rnd(*s, seed=k) for k, s in enumerate(shapes)]
    zs = [zyx.tensor(a) for a in arrays]
    ts = [torch.tensor(a) for a in arrays]
    same(zyx.einsum(eq, *zs), torch.einsum(eq, *ts), rtol=1e-4, atol=1e-5)
    grads_match(lambda *xs: zyx.einsum(eq, *xs), lambda *xs: torch.einsum(eq, *xs), arrays)


def test_einsum_ints_list_operands_and_errors():
    a = np.arange(6).reshape(2, 3)
    z, t = both(a, zyx.int64)
    same(zyx.einsum("ij,kj->ik", [z, z]), torch.einsum("ij,kj->ik", [t, t]))
    with pytest.raises(ValueError):
        zyx.einsum("ij,jk->ik", z)
    with pytest.raises(zyx.ShapeError):
        zyx.einsum("ijk->i", z)
    with pytest.raises(zyx.ShapeError):
        zyx.einsum("ij,ij->i", z, zyx.ones(3, 2, dtype=zyx.int64))
    with pytest.raises(ValueError):
        zyx.einsum("ij->iz", z)


def test_products():
    a, b, v = rnd(2, 3, 4), rnd(2, 4, 5, seed=1), rnd(4, seed=2)
    za, ta = both(a)
    zb, tb = both(b)
    zv, tv = both(v)
    same(zyx.bmm(za, zb), torch.bmm(ta, tb), rtol=1e-5)
    same(za[0].mm(zb[0]), ta[0].mm(tb[0]), rtol=1e-5)
    same(zyx.mv(za[1], zv), torch.mv(ta[1], tv), rtol=1e-5)
    same(zyx.outer(zv, zv), torch.outer(tv, tv))
    same(zv.ger(zv[:2]), tv.outer(tv[:2]))
    same(zyx.tensordot(za, zb, dims=([1, 2], [2, 1])) if False else zyx.tensordot(za, zb[0], 1),
         torch.tensordot(ta, tb[0], 1), rtol=1e-5)
    same(zyx.tensordot(za, zb, dims=([0, 2], [0, 1])), torch.tensordot(ta, tb, dims=([0, 2], [0, 1])),
         rtol=1e-5)
    same(zyx.kron(za[0], zb[0, :2, :3]), torch.kron(ta[0], tb[0, :2, :3]))
    same(zyx.kron(zv, za[0]), torch.kron(tv, ta[0]))
    grads_match(lambda x, y: zyx.kron(x, y), lambda x, y: torch.kron(x, y), [a[0], b[0, :2]])
    grads_match(lambda x, y: zyx.tensordot(x, y, 2), lambda x, y: torch.tensordot(x, y, 2),
                [a, rnd(3, 4, 2, seed=3)])
    with pytest.raises(zyx.ShapeError):
        zyx.bmm(za[0], zb[0])
    with pytest.raises(zyx.ShapeError):
        zyx.mv(za[0], zyx.ones(3))


@pytest.mark.parametrize("offset", [0, 1, -2, 5])
def test_diagonal_diag_trace(offset):
    a = rnd(4, 5, 3)
    z, t = both(a)
    same(zyx.diagonal(z, offset), torch.diagonal(t, offset))
    same(z.diagonal(offset, 2, 0), t.diagonal(offset, 2, 0))
    same(z[:, :, 0].diag(offset), t[:, :, 0].diag(offset))
    same(zyx.diag(z[0, :, 0], offset), torch.diag(t[0, :, 0], offset))
    grads_match(lambda x: x.diagonal(offset, -1, 0), lambda x: x.diagonal(offset, -1, 0), [a])
    grads_match(lambda x: zyx.diag(x, offset), lambda x: torch.diag(x, offset), [a[0, :, 0]])
    same(zyx.trace(z[:, :, 1]), torch.trace(t[:, :, 1]))
    zi, ti = both(np.arange(9).reshape(3, 3), zyx.int32)
    same(zi.trace(), ti.trace())


def test_cross():
    a, b = rnd(4, 3), rnd(4, 3, seed=1)
    za, ta = both(a)
    zb, tb = both(b)
    same(zyx.cross(za, zb), torch.cross(ta, tb, dim=1), rtol=1e-5)
    same(zyx.linalg.cross(za.T, zb.T, dim=0), torch.linalg.cross(ta.T, tb.T, dim=0), rtol=1e-5)
    grads_match(lambda x, y: x.cross(y, dim=-1), lambda x, y: torch.linalg.cross(x, y), [a, b])
    with pytest.raises(zyx.ShapeError):
        zyx.cross(za, zb, dim=0)


@pytest.mark.parametrize("p", [2, 1, float("inf"), float("-inf"), 0, 3.5, 0.5])
@pytest.mark.parametrize("dim", [None, 1, (0, 2)])
def test_vector_norms(p, dim):
    a = rnd(3, 4, 2)
    z, t = both(a)
    same(zyx.linalg.vector_norm(z, p, dim), torch.linalg.vector_norm(t, p, dim), rtol=1e-5)
    same(zyx.norm(z, p, dim, keepdim=True), torch.norm(t, p, dim, keepdim=True), rtol=1e-5)
    if p != 0:
        grads_match(lambda x: zyx.linalg.vector_norm(x, p, dim),
                    lambda x: torch.linalg.vector_norm(x, p, dim), [a])


@pytest.mark.parametrize("ord", ["fro", 1, -1, float("inf"), float("-inf")])
def test_matrix_norms(ord):
    a = rnd(2, 4, 3)
    z, t = both(a)
    same(zyx.linalg.matrix_norm(z, ord), torch.linalg.matrix_norm(t, ord), rtol=1e-5)
    same(zyx.linalg.norm(z, ord, dim=(0, 2), keepdim=True),
         torch.linalg.norm(t, ord, dim=(0, 2), keepdim=True), rtol=1e-5)
    same(zyx.linalg.norm(z[0], ord), torch.linalg.norm(t[0], ord), rtol=1e-5)
    grads_match(lambda x: zyx.linalg.matrix_norm(x, ord), lambda x: torch.linalg.matrix_norm(x, ord),
                [a])
    same(zyx.linalg.norm(z), torch.linalg.norm(t), rtol=1e-5)
    same(z.norm(), t.norm(), rtol=1e-5)


@pytest.mark.parametrize("ord", ["nuc", 2, -2])
@pytest.mark.parametrize("shape,dim", [((3, 4), (-2, -1)), ((2, 5, 3), (0, 2)),
                                       ((4, 4), (1, 0))])
def test_singular_value_norms(ord, shape, dim):
    a = rnd(*shape)
    z, t = both(a)
    for keepdim in (False, True):
        same(zyx.linalg.matrix_norm(z, ord, dim, keepdim),
             torch.linalg.matrix_norm(t, ord, dim, keepdim), rtol=1e-5)
    grads_match(lambda x: zyx.linalg.matrix_norm(x, ord, dim),
                lambda x: torch.linalg.matrix_norm(x, ord, dim), [a])
    if ord == "nuc" and len(shape) == 2:
        same(zyx.norm(z, "nuc"), torch.norm(t, "nuc"), rtol=1e-5)


def test_clone_function_copies():
    z = zyx.tensor(np.arange(4.0, dtype=np.float32))
    c = zyx.clone(z)
    c[0] = 7.0
    assert z.numpy()[0] == 0.0 and c.numpy()[0] == 7.0


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scans(dim):
    a = rnd(4, 5) * 0.8 + 0.1
    z, t = both(a)
    same(zyx.cumprod(z, dim), torch.cumprod(t, dim), rtol=1e-5)
    same(zyx.logcumsumexp(z, dim), torch.logcumsumexp(t, dim), rtol=1e-5)
    grads_match(lambda x: x.cumprod(dim), lambda x: x.cumprod(dim), [a])
    grads_match(lambda x: x.logcumsumexp(dim), lambda x: x.logcumsumexp(dim), [a])
    ties = np.array([[1, 3, 3, 2, 5], [np.nan, 0, 4, 4, 1], [2, 2, 2, -1, 7], [0, 9, 9, np.nan, 9]],
                    np.float32)
    zt, tt = both(ties)
    for fn in ("cummax", "cummin"):
        v, i = getattr(zt, fn)(dim)
        tv, ti = getattr(tt, fn)(dim)
        same(v, tv)
        same(i, ti)
        grads_match(lambda x: getattr(x, fn)(dim).values, lambda x: getattr(x, fn)(dim).values,
                    [ties[:, :4] if dim != 1 else np.nan_to_num(ties)])
    zi, ti_ = both(np.array([[3, -1, 2], [4, 1, 1]]), zyx.int32)
    same(zi.cumprod(1), ti_.cumprod(1))
    same(zi.cummax(1).indices, ti_.cummax(1).indices)


def test_logcumsumexp_wide_range():
    a = np.array([-1000.0, 0.0, 1000.0, -np.inf], np.float32)
    z, t = both(a)
    same(zyx.logcumsumexp(z, 0), torch.logcumsumexp(t, 0))


@pytest.mark.parametrize("n", [1, 2])
def test_diff(n):
    a = rnd(3, 5)
    z, t = both(a)
    same(zyx.diff(z, n), torch.diff(t, n))
    same(z.diff(n, 0), t.diff(n, 0))
    pre, tpre = both(rnd(3, 2, seed=4))
    same(zyx.diff(z, n, 1, prepend=pre, append=pre), torch.diff(t, n, 1, prepend=tpre, append=tpre))
    grads_match(lambda x: x.diff(n, 1), lambda x: x.diff(n, 1), [a])
    zb, tb = both(np.array([True, False, False, True]), zyx.bool)
    same(zb.diff(), tb.diff())


@pytest.mark.parametrize("indexing", ["ij", "xy"])
def test_meshgrid(indexing):
    xs = [np.arange(3, dtype=np.float32), np.arange(4, dtype=np.float32) * 2,
          np.array([5.0], np.float32)]
    zs = [zyx.tensor(x) for x in xs]
    ts = [torch.tensor(x) for x in xs]
    for z, t in zip(zyx.meshgrid(*zs, indexing=indexing), torch.meshgrid(*ts, indexing=indexing)):
        same(z, t)
    for z, t in zip(zyx.meshgrid(zs[:2], indexing=indexing),
                    torch.meshgrid(ts[:2], indexing=indexing)):
        same(z, t)
    with pytest.raises(ValueError):
        zyx.meshgrid(*zs, indexing="yx")


def test_two_norm_gradient_at_zero_is_zero_like_torch():
    for data in (np.zeros(4, np.float32), np.array([3.0, 0.0, -4.0, 0.0], np.float32)):
        grads_match(lambda x: zyx.linalg.norm(x) * 2.0, lambda x: torch.linalg.norm(x) * 2.0,
                    [data])
    grads_match(lambda x: zyx.linalg.matrix_norm(x), lambda x: torch.linalg.matrix_norm(x),
                [np.zeros((2, 3), np.float32)])
