"""Issue 10, "silent wrong numbers": out-of-range index tensors and integer division by zero
raise (torch's exception types) from the realization that reads them, before any of its
results is stored; Python numbers that do not fit a dtype raise when the op is written.

Every error case is compared with torch when it is installed: the zyx exception must be an
instance of the exception type torch raises for the same call."""
from __future__ import annotations

import gc
import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from zyx import nn, optim
from zyx.runtime import RT
from zyx._core.graph import LEAF

try:
    import torch
except ImportError:      # the comparisons with torch are skipped, the zyx checks still run
    torch = None


@pytest.fixture(autouse=True)
def _checks_on():
    zyx.set_checks(True)
    yield
    zyx.set_checks(True)


def torch_raises(fn):
    """The exception type torch raises for fn(torch), or None without torch."""
    if torch is None:
        return None
    try:
        fn(torch)
    except Exception as e:   # noqa: BLE001  (whatever torch raises is the reference)
        return type(e)
    raise AssertionError("torch did not raise: the case is not an error")


def raises_like_torch(zyx_fn, torch_fn, zyx_type, *fragments):
    """zyx_fn() raises zyx_type, which is also torch's type, with every fragment in the
    message."""
    with pytest.raises(zyx_type) as info:
        zyx_fn()
    ref = torch_raises(torch_fn)
    if ref is not None:
        assert isinstance(info.value, ref), f"torch raises {ref.__name__}, zyx {info.value!r}"
    assert isinstance(info.value, zyx.ZyxError)
    for f in fragments:
        assert f in str(info.value), f"{f!r} not in {str(info.value)!r}"
    return info.value


def is_realized(t):
    return RT.graph.get(t._id).op == LEAF


X = np.arange(30, dtype=np.float32).reshape(10, 3)


# ---------------------------------------------------------------------------------------
# indices
def test_getitem_out_of_range_raises_index_error():
    x = zyx.tensor(X)
    raises_like_torch(lambda: x[zyx.tensor([0, 15])].numpy(),
                      lambda t: t.tensor(X)[t.tensor([0, 15])], IndexError,
                      "index 15", "dimension 0", "size 10", "getitem")
    raises_like_torch(lambda: x[zyx.tensor([0, -11])].numpy(),
                      lambda t: t.tensor(X)[t.tensor([0, -11])], IndexError, "index -11")
    v = np.arange(5, dtype=np.float32)
    raises_like_torch(lambda: zyx.tensor(v)[zyx.tensor(7)].numpy(),
                      lambda t: t.tensor(v)[t.tensor(7)], IndexError, "index 7", "size 5")
    raises_like_torch(lambda: x[zyx.tensor([1]), zyx.tensor([5])].numpy(),
                      lambda t: t.tensor(X)[t.tensor([1]), t.tensor([5])], IndexError,
                      "index 5", "dimension 1", "size 3")


def test_getitem_in_range_and_negative_indices_match_numpy():
    x = zyx.tensor(X)
    np.testing.assert_array_equal(x[zyx.tensor([-1])].numpy(), X[[-1]])
    idx = np.array([[0, -10], [9, -1]])
    np.testing.assert_array_equal(x[zyx.tensor(idx)].numpy(), X[idx])
    np.testing.assert_array_equal(x[zyx.tensor([2, -3]), zyx.tensor([-1, 0])].numpy(),
                                  X[[2, -3], [-1, 0]])
    np.testing.assert_array_equal(x[:, zyx.tensor([2, 0])].numpy(), X[:, [2, 0]])


def test_computed_index_is_checked_in_the_same_plan():
    """An index that is not realized yet is checked by a flag target of the plan that reads
    it, and the failure names the computed value."""
    x = zyx.tensor(X)
    idx = zyx.tensor([3, 1]) * 5                # 15, 5: computed, not a leaf
    assert not is_realized(idx)
    raises_like_torch(lambda: x[idx].numpy(), lambda t: t.tensor(X)[t.tensor([15, 5])],
                      IndexError, "index 15", "size 10")
    assert not is_realized(idx)                 # read for the message, not realized
    ok = zyx.tensor([3, 1]) * 3 - 1             # 8, 2
    np.testing.assert_array_equal(x[ok].numpy(), X[[8, 2]])


def test_gather_out_of_range():
    x = zyx.tensor(X)
    bad = np.zeros((10, 1), np.int64)
    bad[1, 0] = 3
    raises_like_torch(lambda: zyx.gather(x, 1, zyx.tensor(bad)).numpy(),
                      lambda t: t.gather(t.tensor(X), 1, t.tensor(bad)), RuntimeError,
                      "index 3", "dimension 1", "size 3", "gather")
    good = np.array([[2], [0], [1]] * 3 + [[2]])
    np.testing.assert_array_equal(zyx.gather(x, 1, zyx.tensor(good)).numpy(),
                                  np.take_along_axis(X, good, 1))


def test_one_hot_out_of_range():
    raises_like_torch(lambda: F.one_hot(zyx.tensor([0, 5]), 3).numpy(),
                      lambda t: t.nn.functional.one_hot(t.tensor([0, 5]), 3), RuntimeError,
                      "smaller than num_classes", "5", "one_hot")
    raises_like_torch(lambda: F.one_hot(zyx.tensor([0, -1]), 3).numpy(),
                      lambda t: t.nn.functional.one_hot(t.tensor([0, -1]), 3), RuntimeError,
                      "non-negative", "-1")
    np.testing.assert_array_equal(F.one_hot(zyx.tensor([2, 0]), 3).numpy(), np.eye(3)[[2, 0]])


def test_embedding_out_of_range():
    w = np.random.randn(3, 2).astype(np.float32)
    raises_like_torch(lambda: F.embedding(zyx.tensor([0, 5]), zyx.tensor(w)).numpy(),
                      lambda t: t.nn.functional.embedding(t.tensor([0, 5]), t.tensor(w)),
                      IndexError, "index out of range", "index 5", "size 3", "embedding")
    emb = nn.Embedding(3, 2)
    with pytest.raises(IndexError, match="index 7"):
        emb(zyx.tensor([[1, 7]])).numpy()
    np.testing.assert_allclose(F.embedding(zyx.tensor([2, 0]), zyx.tensor(w)).numpy(), w[[2, 0]])


@pytest.mark.parametrize("kw", [{}, {"reduction": "none"}, {"reduction": "sum"},
                                {"label_smoothing": 0.1}, {"weight": np.ones(3, np.float32)}],
                         ids=["fast-mean", "none", "sum", "smoothing", "weight"])
def test_cross_entropy_target_out_of_range(kw):
    logits = np.random.randn(4, 3).astype(np.float32)
    zkw = {k: zyx.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    for bad in (5, -1):
        target = np.array([0, 2, bad, 1])
        raises_like_torch(
            lambda: F.cross_entropy(zyx.tensor(logits), zyx.tensor(target), **zkw).numpy(),
            lambda t: t.nn.functional.cross_entropy(
                t.tensor(logits), t.tensor(target),
                **{k: t.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}),
            IndexError, f"Target {bad} is out of bounds", "cross_entropy")


def test_nll_loss_and_3d_targets_out_of_range():
    logp = np.log(np.full((2, 3), 1 / 3, np.float32))
    raises_like_torch(lambda: F.nll_loss(zyx.tensor(logp), zyx.tensor([0, 3])).numpy(),
                      lambda t: t.nn.functional.nll_loss(t.tensor(logp), t.tensor([0, 3])),
                      IndexError, "Target 3", "nll_loss")
    x = np.random.randn(2, 3, 4).astype(np.float32)
    y = np.zeros((2, 4), np.int64)
    y[1, 2] = 7
    raises_like_torch(lambda: F.cross_entropy(zyx.tensor(x), zyx.tensor(y)).numpy(),
                      lambda t: t.nn.functional.cross_entropy(t.tensor(x), t.tensor(y)),
                      IndexError, "Target 7")


@pytest.mark.parametrize("ignore", [-100, 255, 1])
def test_ignore_index_targets_are_allowed(ignore):
    logits = np.random.randn(3, 4).astype(np.float32)
    target = np.array([0, ignore, 3])
    got = F.cross_entropy(zyx.tensor(logits), zyx.tensor(target), ignore_index=ignore).item()
    keep = target != ignore
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    want = -logp[np.arange(3)[keep], target[keep]].mean()
    np.testing.assert_allclose(got, want, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# nothing half-written, the graph stays usable
def test_failed_check_binds_no_target_and_graph_stays_usable():
    x = zyx.tensor(X)
    doubled = x * 2
    picked = x[zyx.tensor([1, 12])]
    with pytest.raises(IndexError, match="index 12"):
        RT.realize([doubled._id, picked._id])
    assert not is_realized(doubled) and not is_realized(picked)
    with pytest.raises(IndexError):          # the same mistake, asked again
        picked.numpy()
    np.testing.assert_array_equal(doubled.numpy(), X * 2)     # the rest still computes
    np.testing.assert_array_equal(x[zyx.tensor([1, 2])].numpy(), X[[1, 2]])


def _mlp(opt_cls, **kw):
    zyx.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    return model, opt_cls(model.parameters(), **kw)


def _train_step(model, opt, x, y):
    loss = F.cross_entropy(model(zyx.tensor(x)), zyx.tensor(y))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("opt_cls,kw", [(optim.SGD, {"lr": 0.1}), (optim.Adam, {"lr": 0.01})],
                         ids=["sgd", "adam"])
def test_optimizer_step_with_bad_target_changes_nothing(opt_cls, kw):
    x = np.random.randn(4, 6).astype(np.float32)
    good, bad = np.array([0, 2, 1, 2]), np.array([0, 2, 3, 2])
    model, opt = _mlp(opt_cls, **kw)
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    with pytest.raises(IndexError, match="Target 3"):
        _train_step(model, opt, x, bad)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
    for p in model.parameters():    # deferred gradients: still lazy, none half-stored
        assert p.grad is not None and not is_realized(p.grad)
    # fix and go on: the step after the failure is the first step (Adam's count too)
    _train_step(model, opt, x, good)
    ref_model, ref_opt = _mlp(opt_cls, **kw)
    _train_step(ref_model, ref_opt, x, good)
    for (k, v), r in zip(model.state_dict().items(), ref_model.state_dict().values()):
        np.testing.assert_array_equal(v.numpy(), r.numpy(), err_msg=k)


def test_gradients_alone_are_checked():
    """The watched node is the one-hot compare, which the backward graph reads too: a
    realization of the gradients without the loss still checks the targets."""
    model, _ = _mlp(optim.SGD, lr=0.1)
    params = list(model.parameters())
    with zyx.Tape() as tape:
        loss = F.cross_entropy(model(zyx.tensor(np.ones((2, 6), np.float32))),
                               zyx.tensor([1, 9]))
    grads = tape.gradient(loss, params)
    del loss
    with pytest.raises(IndexError, match="Target 9"):
        grads[0].numpy()


# ---------------------------------------------------------------------------------------
# integer division by zero
@pytest.mark.parametrize("op", ["floordiv", "mod", "rfloordiv", "fmod", "trunc"])
def test_integer_division_by_zero(op):
    a, b = np.array([7, -7, 3]), np.array([2, 0, 1])
    fns = {"floordiv": lambda m, x, y: x // y, "mod": lambda m, x, y: x % y,
           "rfloordiv": lambda m, x, y: 5 // y, "fmod": lambda m, x, y: m.fmod(x, y),
           "trunc": lambda m, x, y: m.div(x, y, rounding_mode="trunc")}
    f = fns[op]
    zfmod = type("Z", (), {"fmod": staticmethod(lambda x, y: x.fmod(y)),
                           "div": staticmethod(lambda x, y, rounding_mode: x.div(
                               y, rounding_mode=rounding_mode))})
    raises_like_torch(lambda: f(zfmod, zyx.tensor(a), zyx.tensor(b)).numpy(),
                      lambda t: f(t, t.tensor(a), t.tensor(b)), ZeroDivisionError,
                      "division by zero")
    lazy = zyx.tensor(b) - 1 + 1              # a computed divisor: the flag path
    with pytest.raises(ZeroDivisionError):
        f(zfmod, zyx.tensor(a), lazy).numpy()
    nz = np.array([2, -3, 1])
    want = f(type("N", (), {"fmod": staticmethod(np.fmod),
                            "div": staticmethod(lambda x, y, rounding_mode: np.trunc(x / y).astype(x.dtype))}),
             a, nz)
    np.testing.assert_array_equal(f(zfmod, zyx.tensor(a), zyx.tensor(nz)).numpy(), want)


def test_division_by_scalar_zero_raises_when_written():
    x = zyx.tensor([4, 5])
    with pytest.raises(ZeroDivisionError):
        x // 0                      # no realization needed: the divisor is known
    with pytest.raises(ZeroDivisionError):
        x % 0
    np.testing.assert_array_equal((zyx.tensor([4.0]) // 0).numpy(), [np.inf])  # floats: inf
    np.testing.assert_array_equal((x // 2).numpy(), [2, 2])


# ---------------------------------------------------------------------------------------
# numbers that do not fit their dtype
OVERFLOW_CASES = [
    ("full 1e30 int32", lambda m: m.full((2,), 1e30, dtype=m.int32)),
    ("full 2**40 int32", lambda m: m.full((2,), 2 ** 40, dtype=m.int32)),
    ("full inf int32", lambda m: m.full((2,), float("inf"), dtype=m.int32)),
    ("full 256 uint8", lambda m: m.full((2,), 256, dtype=m.uint8)),
    ("full 200 int8", lambda m: m.full((2,), 200, dtype=m.int8)),
    ("full_like", lambda m: m.full_like(m.tensor([1], dtype=m.int32), 2 ** 40)),
    ("tensor list", lambda m: m.tensor([2 ** 40], dtype=m.int32)),
    ("tensor nested", lambda m: m.tensor([[1, 2 ** 40]], dtype=m.int32)),
    ("tensor scalar", lambda m: m.tensor(2 ** 40, dtype=m.int32)),
    ("tensor float", lambda m: m.tensor([1e30], dtype=m.int32)),
    ("tensor uint8 300", lambda m: m.tensor([300], dtype=m.uint8)),
    ("where", lambda m: m.where(m.tensor([True]), m.tensor([1], dtype=m.int32), 2 ** 40)),
    ("masked_fill", lambda m: m.tensor([1], dtype=m.int32).masked_fill(m.tensor([True]), 2 ** 40)),
    ("clamp", lambda m: m.tensor([1], dtype=m.int32).clamp(max=2 ** 40)),
    ("pow", lambda m: m.tensor([1], dtype=m.int32) ** 2 ** 40),
    ("pad", lambda m: m.nn.functional.pad(m.tensor([1], dtype=m.int32), (1, 1), value=2 ** 40)),
]


@pytest.mark.parametrize("case", OVERFLOW_CASES, ids=[c[0] for c in OVERFLOW_CASES])
def test_overflow_raises_like_torch(case):
    _, f = case
    raises_like_torch(lambda: f(zyx), f, OverflowError, "without overflow")


def test_arange_out_of_dtype_raises():
    # torch wraps here (arange(0, 2**40, 2**39, dtype=int32) is [0, 0]); zyx raises
    with pytest.raises(OverflowError, match="int32"):
        zyx.arange(0, 2 ** 40, 2 ** 39, dtype=zyx.int32)
    with pytest.raises(OverflowError, match="int8"):
        zyx.arange(0, 200, 50, dtype=zyx.int8)
    np.testing.assert_array_equal(zyx.arange(0, 120, 40, dtype=zyx.int8).numpy(), [0, 40, 80])


def test_values_that_fit_or_wrap_like_torch():
    np.testing.assert_array_equal(zyx.full((2,), -1, dtype=zyx.uint8).numpy(), [255, 255])
    np.testing.assert_array_equal(zyx.tensor([-1], dtype=zyx.uint8).numpy(), [255])
    np.testing.assert_array_equal(zyx.full((1,), 2 ** 31 - 1, dtype=zyx.int32).numpy(),
                                  [2 ** 31 - 1])
    a = zyx.tensor([0, 1], dtype=zyx.int32)
    np.testing.assert_array_equal((a + 2 ** 40).numpy(), [0, 1])   # torch wraps too
    # comparisons give the mathematical answer (zyx used to wrap 2**40 to 0)
    np.testing.assert_array_equal((a == 2 ** 40).numpy(), [False, False])
    np.testing.assert_array_equal((a < 2 ** 40).numpy(), [True, True])
    np.testing.assert_array_equal((a > -2 ** 40).numpy(), [True, True])
    with pytest.raises(OverflowError):
        zyx.tensor([2 ** 64])


# ---------------------------------------------------------------------------------------
# switch, plan cache, registry
def test_set_checks_false_restores_unchecked_behaviour():
    zyx.set_checks(False)
    x = zyx.tensor(X)
    np.testing.assert_array_equal(x[zyx.tensor([0, 15])].numpy(), [X[0], np.zeros(3)])
    np.testing.assert_array_equal((zyx.tensor([1, 2]) // zyx.tensor([1, 0])).numpy(), [1, 0])
    loss = F.cross_entropy(zyx.tensor(np.zeros((2, 3), np.float32)), zyx.tensor([0, 5]))
    assert np.isfinite(loss.item())
    assert not RT.checks.watch
    zyx.set_checks(True)
    with pytest.raises(IndexError):
        x[zyx.tensor([0, 15])].numpy()


@pytest.mark.parametrize("lazy_targets", [False, True], ids=["leaf-targets", "computed-targets"])
def test_training_steps_reuse_their_plan(lazy_targets):
    model, opt = _mlp(optim.SGD, lr=0.1)
    x = np.random.randn(4, 6).astype(np.float32)
    y = np.array([0, 2, 1, 2])

    def step():
        target = zyx.tensor(y) + 0 if lazy_targets else zyx.tensor(y)
        loss = F.cross_entropy(model(zyx.tensor(x)), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for _ in range(3):
        step()
    s0 = zyx.stats()
    for _ in range(5):
        step()
    s1 = zyx.stats()
    assert s1["plans_built"] == s0["plans_built"]
    assert s1["plan_cache_hits"] - s0["plan_cache_hits"] == 5
    assert len(RT.checks.watch) <= 2           # one per live step, not one per step ever


class _KernelByKernel:
    """The device in use without compile_plan: the scheduler launches kernel by kernel
    (scheduler.execute's other path)."""

    def __init__(self, dev):
        self._dev = dev

    def __getattr__(self, name):
        if name == "compile_plan":
            raise AttributeError(name)
        return getattr(self._dev, name)


@pytest.mark.parametrize("path", ["one-program", "kernel-by-kernel"])
def test_failed_check_frees_what_the_plan_allocated(path, monkeypatch):
    if path == "kernel-by-kernel":
        dev = _KernelByKernel(RT.device())
        monkeypatch.setattr(RT, "device", lambda: dev)
    x = zyx.tensor(X).realize()
    x[zyx.tensor([0])].numpy()         # getitem's cached arange(10) exists before `base`
    # Python's collector frees, whenever it runs, the buffers of tensors caught in
    # reference cycles: an earlier test's leftovers (a full run), or an exception's frames
    # here. Collected before each count, the pool holds exactly what is alive.
    gc.collect()
    base = RT.pool_bytes()
    for make_index in (lambda: zyx.tensor([3, 1]) * 5,      # computed: a flag in the plan
                       lambda: zyx.tensor([15, 5])):        # a leaf: read on the host
        idx = make_index()
        doubled, picked = x * 2, x[idx] * 2
        with pytest.raises(IndexError, match="index 15"):
            RT.realize([doubled._id, picked._id])
        assert not is_realized(doubled) and not is_realized(picked)
        del idx, doubled, picked
        gc.collect()
        assert RT.pool_bytes() == base
    ok = x[zyx.tensor([3, 1]) * 3] * 2
    np.testing.assert_array_equal(ok.numpy(), X[[9, 3]] * 2)
