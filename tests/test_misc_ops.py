"""Small ops: isclose/allclose/equal, logical_*, type_as, new_*, flip, random sampling,
size queries, .t(), Size, threads, requires_grad= on factories."""
import numpy as np
import pytest

import zyx
from _torch_ref import torch, both, same

pytestmark = pytest.mark.usefixtures("device")


def test_isclose_allclose_equal():
    a = np.array([1.0, np.nan, np.inf, -np.inf, 1e-9, 2.0], np.float32)
    b = np.array([1.0 + 1e-7, np.nan, np.inf, np.inf, 0.0, 2.1], np.float32)
    za, ta = both(a)
    zb, tb = both(b)
    same(zyx.isclose(za, zb), torch.isclose(ta, tb))
    same(za.isclose(zb, equal_nan=True), ta.isclose(tb, equal_nan=True))
    same(zyx.isclose(za, zb, rtol=0.1, atol=0.0), torch.isclose(ta, tb, rtol=0.1, atol=0.0))
    assert zyx.allclose(za[:1], zb[:1]) and not zyx.allclose(za, zb)
    assert zyx.allclose(za, za, equal_nan=True) == torch.allclose(ta, ta, equal_nan=True)
    assert zyx.equal(zb[2:], zb[2:]) and not zyx.equal(za, za)       # NaN != NaN
    assert not zyx.equal(za, za[:2]) and zyx.tensor([1, 2]).equal(zyx.tensor([1, 2]))


def test_logical_ops_and_type_as():
    a, b = np.array([0, 1, 2, 0]), np.array([0.0, 0.0, 3.0, 1.0], np.float32)
    za, ta = both(a, zyx.int32)
    zb, tb = both(b)
    for fn in ("logical_and", "logical_or", "logical_xor"):
        same(getattr(zyx, fn)(za, zb), getattr(torch, fn)(ta, tb))
    same(zyx.logical_not(zb), torch.logical_not(tb))
    same(za.type_as(zb), ta.type_as(tb))
    assert za.type_as(zb).dtype is zyx.float32


def test_new_factories_and_sizes():
    x = zyx.ones(2, 3, dtype=zyx.float64)
    for z in (x.new_zeros(4), x.new_ones((2, 2)), x.new_empty(3, 1), x.new_full((2,), 7)):
        assert z.dtype is zyx.float64
    np.testing.assert_array_equal(x.new_full((2,), 7).numpy(), [7.0, 7.0])
    np.testing.assert_array_equal(x.new_tensor([1, 2]).numpy(), [1.0, 2.0])
    assert x.new_zeros(2, dtype=zyx.int32).dtype is zyx.int32
    assert x.new_ones(2, requires_grad=True).requires_grad
    assert (x.numel(), x.element_size(), x.nbytes, x.itemsize) == (6, 8, 48, 8)
    assert zyx.numel(x) == 6 and zyx.numel(zyx.ones(0, 5)) == 0 and zyx.numel(zyx.tensor(3.0)) == 1
    assert x.is_contiguous() and x.t().shape == (3, 2) and zyx.ones(4).t().shape == (4,)
    with pytest.raises(zyx.ShapeError):
        zyx.ones(2, 2, 2).t()
    s = zyx.Size((2, 3))
    assert isinstance(s, tuple) and s == (2, 3) and s.numel() == 6 and x.shape == s
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    z, t = both(a)
    same(z.flip(0, 2), t.flip(0, 2))
    same(z.flip([1, 2]), t.flip([1, 2]))
    same(zyx.flip(z, (0,)), torch.flip(t, (0,)))
    same(z.clone(), t.clone())


def test_random_ops_are_seeded_and_valid():
    zyx.manual_seed(3)
    a = zyx.multinomial(zyx.tensor([0.1, 0.0, 0.9, 0.5]), 3).numpy()
    zyx.manual_seed(3)
    b = zyx.multinomial(zyx.tensor([0.1, 0.0, 0.9, 0.5]), 3).numpy()
    np.testing.assert_array_equal(a, b)
    assert len(set(a.tolist())) == 3 and 1 not in a and a.dtype == np.int64
    w = zyx.tensor([[0.0, 1.0], [1.0, 0.0]])
    np.testing.assert_array_equal(w.multinomial(5, replacement=True).numpy(),
                                  [[1] * 5, [0] * 5])
    with pytest.raises(ValueError):
        zyx.multinomial(zyx.tensor([0.0, 1.0]), 2)
    with pytest.raises(ValueError):
        zyx.multinomial(zyx.tensor([-1.0, 1.0]), 1)
    p = zyx.bernoulli(zyx.full((2000,), 0.25)).numpy()
    assert set(np.unique(p)) <= {0.0, 1.0} and 0.2 < p.mean() < 0.3
    assert set(np.unique(zyx.bernoulli(zyx.tensor([0.0, 1.0])).numpy())) == {0.0, 1.0}
    perm = zyx.randperm(50).numpy()
    np.testing.assert_array_equal(np.sort(perm), np.arange(50))
    r = zyx.randint(10, (4, 5))
    assert r.shape == (4, 5) and 0 <= r.numpy().min() and r.numpy().max() < 10
    assert zyx.randint(3, 5, (6,)).numpy().min() >= 3
    x = zyx.ones(3, 2, dtype=zyx.float64)
    for z in (zyx.rand_like(x), zyx.randn_like(x)):
        assert z.shape == (3, 2) and z.dtype is zyx.float64
    ri = zyx.randint_like(zyx.zeros(5, dtype=zyx.int32), 2, 4).numpy()
    assert ri.dtype == np.int32 and set(np.unique(ri)) <= {2, 3}


def test_requires_grad_on_factories():
    for t in (zyx.arange(3.0, requires_grad=True), zyx.linspace(0, 1, 4, requires_grad=True),
              zyx.eye(2, requires_grad=True), zyx.empty(2, requires_grad=True),
              zyx.tensor([1.0], requires_grad=True), zyx.zeros_like(zyx.ones(2), requires_grad=True),
              zyx.ones_like(zyx.ones(2), requires_grad=True), zyx.empty_like(zyx.ones(2), requires_grad=True),
              zyx.full_like(zyx.ones(2), 3.0, requires_grad=True),
              zyx.rand_like(zyx.ones(2), requires_grad=True)):
        assert t.requires_grad
    x = zyx.arange(3.0, requires_grad=True)
    (x * x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [0.0, 2.0, 4.0])
    with pytest.raises(RuntimeError):
        zyx.arange(3, requires_grad=True)


def test_num_threads_roundtrip():
    before = zyx.get_num_threads()
    try:
        zyx.set_num_threads(1)
        assert zyx.get_num_threads() == 1
        np.testing.assert_allclose((zyx.ones(300, 300) @ zyx.ones(300, 300)).numpy()[0, 0], 300.0)
    finally:
        zyx.set_num_threads(before)
    with pytest.raises(ValueError):
        zyx.set_num_threads(0)
