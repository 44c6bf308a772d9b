"""The per-step fast path of a training loop: whole-plan device programs with an arena for
temporaries, zero-copy zyx.from_numpy, the direct node builders of linear / relu /
cross_entropy / 2-D matmul, register tiles of matmul-like reductions and Adam's reused
bias-correction leaves. Every check is against numpy or PyTorch."""
import os

import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from zyx._core import scheduler
from zyx.runtime import RT

# the plan layout, zero-copy from_numpy and the thread choice are the C backend's
pytestmark = pytest.mark.usefixtures("on_cpu")


# -- whole-plan programs and the arena ------------------------------------------------------

def _last_plan():
    return next(reversed(RT.plans.values()))


def test_arena_temporaries_never_overlap_while_alive():
    """Temporaries sharing arena bytes must have disjoint lifetimes (first fit reuse)."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((64, 33), dtype=np.float32) for _ in range(3)]
    a, b, c = (zyx.Tensor(x) for x in xs)
    # softmaxes and reductions force several stored temporaries of different sizes
    out = (a.softmax(1) * b).sum(0) + (b.softmax(0) * c).sum(0) + (c.exp().sum(1).max())
    ref = ((np.exp(xs[0] - xs[0].max(1, keepdims=True)) /
            np.exp(xs[0] - xs[0].max(1, keepdims=True)).sum(1, keepdims=True) * xs[1]).sum(0) +
           (np.exp(xs[1] - xs[1].max(0)) / np.exp(xs[1] - xs[1].max(0)).sum(0) * xs[2]).sum(0) +
           np.exp(xs[2]).sum(1).max())
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5)
    plan = _last_plan()
    if plan.runner is None:
        pytest.skip("the default device runs kernels one by one (no compile_plan)")
    spans = {}   # arena offset ranges with the steps each temporary is alive in
    for si, st in enumerate(plan.steps):
        for p in st.args:
            where, v = plan.slot.get(plan.root.get(p, p), ("t", 0))
            if where == "a":
                lo, hi = spans.get(p, (si, si))
                spans[p] = (min(lo, si), max(hi, si))
    placed = [(plan.slot[p][1], plan.nbytes[p], lo, hi) for p, (lo, hi) in spans.items()]
    assert len(placed) >= 2
    for i, (o1, n1, l1, h1) in enumerate(placed):
        assert o1 + n1 <= plan.arena_bytes
        for o2, n2, l2, h2 in placed[i + 1:]:
            if o1 < o2 + n2 and o2 < o1 + n1:      # bytes overlap ...
                assert h1 < l2 or h2 < l1          # ... so lifetimes must not


def test_plan_targets_alias_reshapes_of_leaves_and_temporaries():
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    a = zyx.Tensor(x)
    s = a.exp()
    r1 = a.reshape(6, 4)          # a target aliasing a leaf
    r2 = s.reshape(24)            # a target aliasing another target
    r3 = (a * 2).reshape(3, 8)    # a target aliasing a temporary
    RT.realize([t._id for t in (s, r1, r2, r3)])      # one plan, four targets
    del a
    np.testing.assert_allclose(r1.numpy(), x.reshape(6, 4))
    np.testing.assert_allclose(r2.numpy(), np.exp(x).reshape(24), rtol=1e-6)
    np.testing.assert_allclose(r3.numpy(), (x * 2).reshape(3, 8))
    np.testing.assert_allclose(s.numpy(), np.exp(x), rtol=1e-6)


def test_plan_with_serial_parallel_and_region_kernels_in_one_call():
    """Small kernels (one thread), big elementwise ones (omp for) and a big full reduction
    (its own parallel region) in one realization."""
    rng = np.random.default_rng(2)
    big = rng.standard_normal(1 << 17, dtype=np.float32)
    small = rng.standard_normal(7, dtype=np.float32)
    B, S = zyx.Tensor(big), zyx.Tensor(small)
    t1 = (B * 3).exp()
    t2 = (S + 1).sum()
    t3 = B.abs().sum()
    t4 = t1.max() + t2
    RT.realize([t._id for t in (t1, t2, t3, t4)])     # one plan
    np.testing.assert_allclose(t1.numpy(), np.exp(big * 3), rtol=1e-5)
    np.testing.assert_allclose(t2.item(), (small + 1).sum(), rtol=1e-5)
    np.testing.assert_allclose(t3.item(), np.abs(big).sum(dtype=np.float64), rtol=1e-4)
    np.testing.assert_allclose(t4.item(), np.exp(big * 3).max() + (small + 1).sum(), rtol=1e-5)


def test_layout_memory_gives_every_stored_position_a_place():
    a = zyx.Tensor(np.ones((8, 8), np.float32))
    t = (a.softmax(1) + 1).sum(0)
    order, _ = RT.graph.collect([t._id])
    plan = scheduler.build_plan(RT.graph, order, [t._id], RT.device())
    if plan.runner is None:
        pytest.skip("the default device runs kernels one by one (no compile_plan)")
    for p, stored in enumerate(plan.stored):
        if stored:
            assert p in plan.slot
    assert plan.nslots == 1 + len(plan.leaves) + len(plan.owned)


# -- zyx.from_numpy ---------------------------------------------------------------------------

def test_from_numpy_shares_memory_until_realized():
    x = np.arange(6, dtype=np.float32)
    t = zyx.from_numpy(x)
    y = t * 2
    x[0] = 100.0                      # written before realization: seen, as in torch
    np.testing.assert_allclose(y.numpy(), np.array([200, 2, 4, 6, 8, 10], np.float32))
    assert t.dtype is zyx.float32 and t.shape == (6,)


def test_from_numpy_memory_is_never_reused_by_the_pool():
    x = np.full(1024, 3.0, np.float32)
    used = RT.pool_bytes()
    t = zyx.from_numpy(x)
    assert RT.pool_bytes() == used    # the user owns it
    del t
    # same-size temporaries afterwards must not land in the user's array
    for _ in range(3):
        (zyx.Tensor(np.zeros(1024, np.float32)) + 7).numpy()
    assert (x == 3.0).all()


def test_from_numpy_copies_when_it_cannot_share():
    x = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]   # not contiguous
    t = zyx.from_numpy(x)
    x[0, 0] = 55
    np.testing.assert_array_equal(t.numpy(), np.arange(12).reshape(3, 4)[:, ::2])
    with pytest.raises(TypeError):
        zyx.from_numpy([1, 2, 3])


def test_from_numpy_in_a_gradient():
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    w = zyx.Tensor(np.ones((4, 2), np.float32), requires_grad=True)
    (zyx.from_numpy(x) @ w).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), np.repeat(x.sum(0)[:, None], 2, 1), rtol=1e-6)


# -- direct node builders ---------------------------------------------------------------------

def test_relu_fast_path_nan_inf_and_gradient_at_zero():
    x = np.array([-np.inf, -2.0, -0.0, 0.0, 1.5, np.inf, np.nan], np.float32)
    t = zyx.Tensor(x, requires_grad=True)
    y = t.relu()
    np.testing.assert_array_equal(y.numpy(), np.array([0, 0, 0, 0, 1.5, np.inf, np.nan],
                                                      np.float32))
    y[:6].sum().backward()
    np.testing.assert_array_equal(t.grad.numpy()[:6], [0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(zyx.Tensor(np.array([-3, 0, 4], np.int32)).relu().numpy(),
                                  [0, 0, 4])


@pytest.mark.parametrize("shape", [(64, 10), (5, 3), (1, 7)])
def test_cross_entropy_fast_path_matches_torch(shape):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32) * 4
    y = rng.integers(0, shape[1], shape[0])
    t = zyx.Tensor(x, requires_grad=True)
    loss = F.cross_entropy(t, zyx.Tensor(y))
    loss.backward()
    tx = torch.tensor(x, requires_grad=True)
    tl = torch.nn.functional.cross_entropy(tx, torch.tensor(y))
    tl.backward()
    np.testing.assert_allclose(loss.item(), tl.item(), rtol=1e-6)
    np.testing.assert_allclose(t.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert loss.shape == ()


def test_cross_entropy_fast_path_agrees_with_the_general_path():
    """ignore_index inside [0, C) takes the general path; outside it the fast one: both
    give the mean NLL over the rows they count."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 5)).astype(np.float32)
    y = rng.integers(0, 5, 16)
    fast = F.cross_entropy(zyx.Tensor(x), zyx.Tensor(y)).item()
    general = F.cross_entropy(zyx.Tensor(x), zyx.Tensor(y), label_smoothing=0.0,
                              reduction="none").mean().item()
    logp = x - x.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    np.testing.assert_allclose(fast, -logp[np.arange(16), y].mean(), rtol=1e-5)
    np.testing.assert_allclose(fast, general, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_linear_and_2d_matmul_fast_paths(dtype):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 9)) * 3).astype(dtype)
    w = (rng.standard_normal((4, 9)) * 3).astype(dtype)
    b = (rng.standard_normal(4) * 3).astype(dtype)
    tol = dict(rtol=1e-5) if dtype != np.int32 else {}
    np.testing.assert_allclose(F.linear(zyx.Tensor(x), zyx.Tensor(w), zyx.Tensor(b)).numpy(),
                               x @ w.T + b, **tol)
    np.testing.assert_allclose((zyx.Tensor(x) @ zyx.Tensor(w.T.copy())).numpy(), x @ w.T, **tol)


def test_linear_fast_path_gradients_match_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((8, 5), (3, 5), (3,)))
    tz = [zyx.Tensor(v, requires_grad=True) for v in (x, w, b)]
    tt = [torch.tensor(v, requires_grad=True) for v in (x, w, b)]
    (F.linear(*tz).relu() ** 2).sum().backward()
    (torch.nn.functional.linear(*tt).relu() ** 2).sum().backward()
    for a, c in zip(tz, tt):
        np.testing.assert_allclose(a.grad.numpy(), c.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sa,sb", [((2, 3, 5, 4), (2, 3, 4, 6)), ((4, 1, 7), (4, 7, 1)),
                                   ((3, 6, 2), (3, 2, 5)), ((1, 2, 1, 3), (1, 2, 3, 1))])
def test_batched_matmul_fast_path_values_and_gradients(sa, sb):
    """a @ b of one dtype and equal batch dims (attention's products) against torch,
    including m = 1 and n = 1 (no expand on that side)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    za, zb = zyx.Tensor(a, requires_grad=True), zyx.Tensor(b, requires_grad=True)
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    zo, to = za @ zb.exp(), ta @ tb.exp()
    np.testing.assert_allclose(zo.numpy(), to.detach().numpy(), rtol=1e-5, atol=1e-6)
    (zo.tanh() * 3).sum().backward()
    (to.tanh() * 3).sum().backward()
    np.testing.assert_allclose(za.grad.numpy(), ta.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(zb.grad.numpy(), tb.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,ns,affine", [((4, 6, 8), (8,), "both"),
                                             ((3, 5, 4), (5, 4), "weight"),
                                             ((7, 3), (3,), "bias"), ((2, 9), (9,), "none")])
def test_layer_norm_fast_path_values_and_gradients(dtype, shape, ns, affine):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    x = (rng.standard_normal(shape) * 2 + 1).astype(dtype)
    w = rng.standard_normal(ns).astype(dtype) if affine in ("both", "weight") else None
    b = rng.standard_normal(ns).astype(dtype) if affine in ("both", "bias") else None
    zs = [zyx.Tensor(v, requires_grad=True) if v is not None else None for v in (x, w, b)]
    ts = [torch.tensor(v, requires_grad=True) if v is not None else None for v in (x, w, b)]
    zo = F.layer_norm(zs[0], ns, zs[1], zs[2], eps=1e-4)
    to = torch.nn.functional.layer_norm(ts[0], ns, ts[1], ts[2], eps=1e-4)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(zo.numpy(), to.detach().numpy(), **tol)
    (zo * zo.detach().exp()).sum().backward()
    (to * to.detach().exp()).sum().backward()
    for z, t in zip(zs, ts):
        if z is not None:
            np.testing.assert_allclose(z.grad.numpy(), t.grad.numpy(), **tol)


def test_embedding_fast_path_wraps_negative_indices_and_checks_the_range():
    rng = np.random.default_rng(9)
    w = rng.standard_normal((5, 3)).astype(np.float32)
    for idt in (np.int64, np.int32):
        idx = np.array([[0, 4, -1], [2, -5, 3]], dtype=idt)
        out = F.embedding(zyx.Tensor(idx), zyx.Tensor(w))
        np.testing.assert_array_equal(out.numpy(), w[idx % 5])
    with pytest.raises(IndexError, match="out of range"):
        F.embedding(zyx.Tensor(np.array([1, 5])), zyx.Tensor(w)).numpy()
    wz = zyx.Tensor(w, requires_grad=True)
    F.embedding(zyx.Tensor(np.array([1, 1, 3])), wz).sum().backward()
    expect = np.zeros_like(w)
    expect[1], expect[3] = 2, 1
    np.testing.assert_array_equal(wz.grad.numpy(), expect)


@pytest.mark.parametrize("dtype", [None, zyx.float64, zyx.float16])
def test_square_subsequent_mask_is_torchs(dtype):
    m = zyx.nn.Transformer.generate_square_subsequent_mask(6, dtype=dtype)
    assert m.dtype is (dtype or zyx.float32) and m.shape == (6, 6)
    np.testing.assert_array_equal(m.numpy().astype(np.float64),
                                  np.triu(np.full((6, 6), -np.inf), k=1))


@pytest.mark.parametrize("k,split", [(128, True), (1024, False)])
def test_gelu_after_a_short_matmul_is_split_from_it(k, split, monkeypatch):
    """A linear layer's GELU (an erf call) after a product of length <= 512 becomes its own
    elementwise kernel on the CPU (kernelizer._split_call_epilogues); a long product keeps
    it fused; the values are the same either way."""
    from math import erf
    from zyx._core import kernelizer
    rng = np.random.default_rng(10)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((16, k), (48, k), (48,)))
    pre = x.astype(np.float64) @ w.T.astype(np.float64) + b
    ref = 0.5 * pre * (1 + np.vectorize(erf)(pre / np.sqrt(2)))
    for on in (True, False):
        monkeypatch.setattr(kernelizer, "SPLIT_CALL_EPILOGUES", on)
        RT.plans.clear()
        y = F.gelu(F.linear(zyx.Tensor(x), zyx.Tensor(w), zyx.Tensor(b)))
        np.testing.assert_allclose(y.numpy(), ref, rtol=2e-4, atol=2e-4)
        assert len(_last_plan().steps) == (2 if on and split else 1)


# -- register tiles of matmul-like reductions -------------------------------------------------

@pytest.mark.parametrize("m,k,n", [(64, 784, 128), (128, 64, 784), (16, 8, 48), (24, 64, 32),
                                   (8, 100, 16)])
def test_matmul_tiles(m, k, n):
    """Shapes picking 16-, 8- and 4-row lane tiles (weight-gradient form: reduce over the
    strided batch axis) and the 4x4 tile with reassociated sums (k contiguous)."""
    rng = np.random.default_rng(7)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    np.testing.assert_allclose((zyx.Tensor(a) @ zyx.Tensor(b)).numpy(), a @ b,
                               rtol=1e-4, atol=1e-4)
    at = np.ascontiguousarray(a.T)
    np.testing.assert_allclose((zyx.Tensor(at).T @ zyx.Tensor(b)).numpy(), a @ b,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,k,n", [(64, 784, 128), (8, 300, 256), (12, 200, 100),
                                   (64, 64, 16), (128, 96, 64)])
def test_matmul_nt_tiles_and_column_blocks(m, k, n):
    """x @ W.T with both operands contiguous along k (nn.Linear): the 4x4 tile with
    reassociated sums; when W has more rows than x, each thread of the team takes a
    contiguous block of W's rows (uneven for n=100). The first runs of a plan alternate
    between the team and one thread, so both are checked."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    for _ in range(3):
        got = (zyx.Tensor(x) @ zyx.Tensor(w).T).numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    src = getattr(_last_plan().runner, "source", "")
    if (m, n) == (64, 128) and "omp for" in src and (os.cpu_count() or 1) <= 8:
        assert "zyx_nt" in src       # the MLP's first layer: column blocks per thread
    if n <= m:
        assert "zyx_nt" not in src


def test_reassociated_sum_keeps_nan_and_inf():
    a = np.ones((8, 128), np.float32)
    b = np.ones((128, 8), np.float32)
    a[1, 5] = np.nan
    a[2, 7] = np.inf
    got = (zyx.Tensor(a) @ zyx.Tensor(np.ascontiguousarray(b.T)).T).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(a @ b))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(a @ b))


# -- Adam's step leaves -------------------------------------------------------------------------

def test_adam_with_parameters_at_different_step_counts_matches_torch():
    """A parameter without a gradient is skipped, so its step count falls behind: its bias
    corrections differ from the others' in the same update."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    w0 = [rng.standard_normal(4).astype(np.float32) for _ in range(2)]
    zp = [zyx.Tensor(w, requires_grad=True) for w in w0]
    tp = [torch.tensor(w, requires_grad=True) for w in w0]
    zo = zyx.optim.Adam(zp, lr=0.1)
    to = torch.optim.Adam(tp, lr=0.1)
    for step in range(6):
        use = [0, 1] if step % 2 else [0]
        zo.zero_grad()
        to.zero_grad()
        sum(((zp[i] * (i + 2)) ** 2).sum() for i in use).backward()
        sum(((tp[i] * (i + 2)) ** 2).sum() for i in use).backward()
        zo.step()
        to.step()
    for a, c in zip(zp, tp):
        np.testing.assert_allclose(a.numpy(), c.detach().numpy(), rtol=1e-5, atol=1e-6)


# -- thread team or calling thread, measured per plan -----------------------------------------

def _run_choice(tc, times, n):
    """Feed `n` runs to `tc` with run times {parallel: seconds}; returns the modes used."""
    modes = []
    for _ in range(n):
        m = tc.next()
        modes.append(m)
        tc.record(m, times[m], 0)
    return modes


def test_thread_choice_keeps_the_faster_mode():
    tc = scheduler.ThreadChoice(True)
    modes = []
    times = {True: 3e-4, False: 1e-4}     # serial is faster here
    while tc.parallel is None:
        modes += _run_choice(tc, times, 1)
    assert modes[0] is True and set(modes[1:]) == {True, False}
    assert tc.parallel is False and tc.next() is False
    tc = scheduler.ThreadChoice(True)
    _run_choice(tc, {True: 1.0, False: 2.0}, 2)   # long in both modes: parallel at once,
    assert tc.parallel is True and tc.watching    # probed at the longest interval
    assert _run_choice(tc, {True: 1.0, False: 2.0}, 100) == [True] * 100
    _run_choice(tc, {True: 5.0, False: 2.0}, tc.WINDOW + tc.PROBE)   # the team stalls
    assert tc.parallel is False
    tc = scheduler.ThreadChoice(True)
    _run_choice(tc, {True: 1.0, False: 1e-4}, 2)  # slow only in parallel: keeps measuring
    assert tc.parallel is None and tc.watching
    # long in both, but the team far slower (a busy core: each barrier waits out a time
    # slice; a 2.4 ms sampling step took 110 ms parallel): measured, and kept on one thread
    tc = scheduler.ThreadChoice(True)
    loaded = {True: 0.11, False: 2.4e-3}
    _run_choice(tc, loaded, 2)
    assert tc.parallel is None
    while tc.parallel is None:
        _run_choice(tc, loaded, 1)
    assert tc.parallel is False
    no_choice = scheduler.ThreadChoice(False)     # nothing parallel in the plan
    assert _run_choice(no_choice, {True: 1e-4, False: 1e-5}, 200) == [True] * 200


def test_thread_choice_follows_a_change_of_load():
    """A machine that gets loaded (parallel runs 10x slower) moves the plan to one thread
    within a window of runs, and back when the load goes; a mode that stays worse is
    probed less and less often."""
    tc = scheduler.ThreadChoice(True)
    quiet, loaded = {True: 1e-4, False: 2e-4}, {True: 2e-3, False: 2.2e-4}
    while tc.parallel is None:
        _run_choice(tc, quiet, 1)
    assert tc.parallel is True
    modes = _run_choice(tc, loaded, 2 * tc.WINDOW + tc.PROBE)
    assert tc.parallel is False and tc.switches == 1
    assert modes[-1] is False
    # settled on one thread: probes of the team come ever more rarely
    modes = _run_choice(tc, loaded, 3000)
    assert tc.parallel is False and tc.interval == tc.PROBE_MAX
    assert 0 < modes.count(True) <= 8 * tc.PROBE
    # the load goes: the next probe finds the team faster again
    _run_choice(tc, quiet, tc.PROBE_MAX + tc.PROBE)
    assert tc.parallel is True and tc.switches == 2


def test_thread_choice_is_not_moved_by_single_stalls():
    """A noisy machine stalls one run in a while for milliseconds, whatever its mode: the
    plan keeps the faster mode instead of following each stall to the other one."""
    tc = scheduler.ThreadChoice(True)
    times = {True: 2e-4, False: 3e-4}
    while tc.parallel is None:
        _run_choice(tc, times, 1)
    assert tc.parallel is True
    modes = []
    for i in range(3000):
        m = tc.next()
        modes.append(m)
        tc.record(m, 5e-3 if i % 50 == 7 else times[m], 0)
    assert tc.switches == 0 and tc.parallel is True
    assert modes.count(False) <= 8 * tc.PROBE     # probes only, ever rarer


def test_plan_results_are_the_same_in_both_thread_modes():
    """The first runs of a plan alternate between the thread team and one thread."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((256, 300), dtype=np.float32)
    b = rng.standard_normal((300, 64), dtype=np.float32)
    ref = np.exp(np.tanh(a @ b)).sum(0)
    for _ in range(2 * scheduler.ThreadChoice.RUNS + 3):
        got = (zyx.Tensor(a) @ zyx.Tensor(b)).tanh().exp().sum(0).numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-4)
    plan = _last_plan()
    if plan.runner is not None and plan.runner.parallel:
        assert plan.threads.parallel in (True, False)
