"""sort, argsort, topk, kthvalue, median, mode, max/min with a dim: values, indices and
gradients against torch, ties and NaN, both sorting methods (rank counting, bitonic)."""
import numpy as np
import pytest

import zyx
import zyx.sorting as S
from _torch_ref import torch, both, same, grads_match

pytestmark = pytest.mark.usefixtures("device")


@pytest.fixture(params=["rank", "bitonic"])
def method(request, monkeypatch):
    """Run a test with rows sorted by comparison counting, then by the bitonic network."""
    monkeypatch.setattr(S, "RANK_MAX", 1 << 30 if request.param == "rank" else 1)
    return request.param


def tied(shape, seed=0):
    """Few distinct values (many ties), some NaN and infinities."""
    r = np.random.default_rng(seed)
    a = r.integers(-3, 4, shape).astype(np.float32)
    flat = a.reshape(-1)
    flat[r.choice(flat.size, max(1, flat.size // 7), replace=False)] = np.nan
    flat[0] = np.inf
    flat[-1] = -np.inf
    return a


@pytest.mark.parametrize("shape,dim", [((13,), 0), ((4, 9), 1), ((6, 5), 0), ((2, 3, 7), 1)])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_matches_torch_stable_with_ties_and_nan(method, shape, dim, descending):
    z, t = both(tied(shape))
    v, i = zyx.sort(z, dim=dim, descending=descending)
    tv, ti = torch.sort(t, dim=dim, descending=descending, stable=True)
    same(v, tv)
    same(i, ti)
    same(z.argsort(dim, descending=descending), torch.argsort(t, dim=dim, descending=descending,
                                                              stable=True))


@pytest.mark.parametrize("d", [zyx.int32, zyx.int64, zyx.float16, zyx.bfloat16, zyx.float64,
                               zyx.bool])
def test_sort_dtypes(method, d):
    a = np.random.default_rng(1).integers(-5, 6, (3, 11))
    if d is zyx.bool:
        a = a > 0
    z, t = both(a, d)
    for desc in (False, True):
        v, i = z.sort(-1, descending=desc)
        tv, ti = torch.sort(t, dim=-1, descending=desc, stable=True)
        same(v, tv)
        same(i, ti)
        assert v.dtype is d


def test_sort_long_rows_and_gradient(method):
    a = np.random.default_rng(2).standard_normal((3, 40)).astype(np.float32)
    grads_match(lambda x: x.sort(1, descending=True).values,
                lambda x: torch.sort(x, 1, descending=True).values, [a])
    grads_match(lambda x: x.sort(0)[0], lambda x: torch.sort(x, 0)[0], [a])


def test_sort_named_tuple_and_edge_shapes():
    z, t = both(np.float32(3.0))
    r = zyx.sort(z)
    assert r.values.shape == () and r.indices.item() == 0
    e = zyx.zeros(3, 0).sort(1)
    assert e.values.shape == (3, 0) and e.indices.shape == (3, 0)
    with pytest.raises(IndexError):
        zyx.ones(3).sort(1)


@pytest.mark.parametrize("k,largest", [(1, True), (3, True), (4, False), (9, True)])
def test_topk(method, k, largest):
    z, t = both(tied((5, 9), 3))
    v, i = zyx.topk(z, k, largest=largest)
    tv, ti = torch.topk(t, k, largest=largest)
    same(v, tv)
    # torch's topk order among equal values is unspecified: compare values at the indices
    same(z.gather(1, i), tv)
    a = np.random.default_rng(4).standard_normal((4, 9)).astype(np.float32)
    grads_match(lambda x: x.topk(k, dim=0 if k <= 4 else 1, largest=largest).values,
                lambda x: torch.topk(x, k, dim=0 if k <= 4 else 1, largest=largest).values, [a])
    with pytest.raises(IndexError):
        z.topk(10)


@pytest.mark.parametrize("keepdim", [False, True])
def test_kthvalue_median(method, keepdim):
    a = np.random.default_rng(5).permutation(30).astype(np.float32).reshape(5, 6)
    z, t = both(a)
    for k in (1, 3, 6):
        v, i = z.kthvalue(k, 1, keepdim=keepdim)
        tv, ti = torch.kthvalue(t, k, 1, keepdim=keepdim)
        same(v, tv)
        same(i, ti)
    for dim in (0, 1):
        v, i = zyx.median(z, dim, keepdim=keepdim)
        tv, ti = torch.median(t, dim, keepdim=keepdim)
        same(v, tv)
        same(i, ti)
    same(z.median(), t.median())
    grads_match(lambda x: x.median(0).values, lambda x: torch.median(x, 0).values, [a])
    grads_match(lambda x: x.kthvalue(2, 1)[0], lambda x: torch.kthvalue(x, 2, 1)[0], [a])
    with pytest.raises(IndexError):
        z.kthvalue(7, 1)


def test_median_nan_and_ints(method):
    a = np.array([[1.0, np.nan, 3.0, 0.0], [2.0, 1.0, 5.0, 4.0]], np.float32)
    z, t = both(a)
    v, i = z.median(1)
    tv, ti = t.median(1)
    same(v, tv)
    same(i, ti)
    assert np.isnan(z.median().item())
    zi, ti_ = both(np.array([[5, 1, 4, 4], [0, 0, 3, -2]]), zyx.int64)
    same(zi.median(1).values, ti_.median(1).values)
    same(zi.median(), ti_.median())


def test_mode_matches_torch():
    a = np.array([[1, 2, 2, 3, 3], [4, 4, 4, 0, 0], [7, 6, 5, 6, 7]], np.float32)
    z, t = both(a)
    for dim in (1, 0):
        v, i = z.mode(dim)
        tv, ti = t.mode(dim)
        same(v, tv)
        same(i, ti)
    zi, ti_ = both(a.astype(np.int32), zyx.int32)
    same(zi.mode(1, keepdim=True).values, ti_.mode(1, keepdim=True).values)


def test_max_min_with_dim_are_values_and_indices():
    a = np.array([[1.0, 5.0, 5.0, -2.0], [np.nan, 0.0, 3.0, np.nan], [0.5, 0.5, 0.5, 0.5]],
                 np.float32)
    z, t = both(a)
    for fn in ("max", "min"):
        for dim in (0, 1, -1):
            r, tr = getattr(z, fn)(dim), getattr(t, fn)(dim)
            same(r.values, tr.values)
            same(r.indices, tr.indices)
            assert type(r).__name__ == fn
        vals, idx = getattr(z, fn)(dim=1, keepdim=True)
        assert vals.shape == (3, 1) and idx.shape == (3, 1)
        same(getattr(zyx, fn)(z), getattr(torch, fn)(t))
        assert getattr(z, fn)().shape == ()
    b = np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32)
    same(zyx.max(z, zyx.tensor(b)), torch.max(t, torch.tensor(b)))
    same(z.min(zyx.tensor(b)), t.min(torch.tensor(b)))
    # ties: the gradient of max(dim).values goes to the chosen element (torch); amax's splits
    ties = np.array([[2.0, 2.0, 1.0], [0.0, 3.0, 3.0]], np.float32)
    grads_match(lambda x: x.max(1).values, lambda x: x.max(1).values, [ties])
    grads_match(lambda x: x.min(0)[0], lambda x: x.min(0)[0], [ties])
    grads_match(lambda x: x.amax(1), lambda x: x.amax(1), [ties])
    with pytest.raises(TypeError):
        z.max((0, 1))


def test_sort_stays_lazy_and_fuses_with_its_input():
    x = zyx.tensor(np.arange(20, dtype=np.float32)[::-1].copy())
    before = zyx.stats()["realizations"]
    v, i = (x * 2).sort()
    assert zyx.stats()["realizations"] == before       # nothing computed yet
    np.testing.assert_array_equal(v.numpy(), np.arange(20, dtype=np.float32) * 2)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("k", [1, 5, 32])
def test_topk_of_long_rows_by_extraction(k, largest):
    """k <= 32 of rows longer than RANK_MAX: k extraction rounds instead of a sort."""
    a = tied((4, 300), 7)
    a[0, 3] = np.nan
    a[1, :40] = np.nan                       # more NaN than k in one row
    a[2, :] = 1.0                            # one long tie
    z, t = both(a)
    v, i = zyx.topk(z, k, largest=largest)
    tv, _ = torch.topk(t, k, largest=largest)
    same(v, tv)
    same(z.gather(1, i), tv)
    assert all(len(set(row)) == k for row in i.numpy().tolist())   # k distinct positions
    ints = np.random.default_rng(1).integers(-3, 3, (3, 200)).astype(np.int32)
    zi, ti = both(ints)
    same(zyx.topk(zi, k, largest=largest).values, torch.topk(ti, k, largest=largest).values)
    g = np.random.default_rng(2).standard_normal((3, 200)).astype(np.float32)
    grads_match(lambda x: x.topk(k, largest=largest).values * 2.0,
                lambda x: torch.topk(x, k, largest=largest).values * 2.0, [g])
