"""Multi-output kernels (kernelizer._merge_outputs): stored elementwise results of one
shape that share inputs are computed by one kernel with several stores. Values match
numpy and the separate kernels; a member read at another element, or read by a kernel in
between, keeps its own kernel; Adam's parameter, m and v are one kernel."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx import nn, optim
from zyx._core import kernelizer as KZ

pytestmark = pytest.mark.usefixtures("device")
RT = zyx._RT


def _realize_together(*tensors):
    """One realization computing every tensor (one plan, as an optimizer step does)."""
    RT.realize([t._id for t in tensors])
    return next(reversed(RT.plans.values()))


def _nouts(plan):
    return sorted(st.nout for st in plan.steps if st.kernel is not None)


@pytest.fixture
def fresh():
    RT.plans.clear()
    yield
    RT.plans.clear()


def test_outputs_sharing_an_input_are_one_kernel(fresh):
    a = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((64, 33)).astype(np.float32)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    u, v, w = x * 2 + y, (x - y).exp(), (x * 2 + y) * 0.5 + x
    plan = _realize_together(u, v, w)
    assert _nouts(plan) == [3]
    np.testing.assert_allclose(u.numpy(), a * 2 + b, rtol=1e-6)
    np.testing.assert_allclose(v.numpy(), np.exp(a - b), rtol=1e-6)
    np.testing.assert_allclose(w.numpy(), (a * 2 + b) * 0.5 + a, rtol=1e-6)


def test_unrelated_outputs_stay_apart(fresh):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    x, y = zyx.Tensor(a), zyx.Tensor(a + 1)
    plan = _realize_together(x * 3, y - 1)      # nothing shared: nothing gained
    assert _nouts(plan) == [1, 1]


def test_member_read_at_another_element_keeps_its_kernel(fresh):
    a = np.random.default_rng(2).standard_normal((16, 8)).astype(np.float32)
    x = zyx.Tensor(a)
    first = (x * 2).exp()
    flipped = first.flip(0) + x          # reads `first` at another row: not in one pass
    plan = _realize_together(first, flipped)
    assert _nouts(plan) == [1, 1]
    np.testing.assert_allclose(flipped.numpy(), np.flip(np.exp(a * 2), 0) + a,
                               rtol=1e-6, atol=1e-6)


def test_a_reader_in_between_closes_the_group(fresh):
    a = np.random.default_rng(3).standard_normal((32, 16)).astype(np.float32)
    x = zyx.Tensor(a)
    first = x.exp()
    total = first.sum()                  # a kernel reading `first` before `late` runs
    late = x * 2 + total
    plan = _realize_together(first, total, late)
    assert _nouts(plan) == [1, 1, 1]
    np.testing.assert_allclose(late.numpy(), a * 2 + np.exp(a).sum(), rtol=1e-5)


def test_switch_off_gives_the_same_values(fresh, monkeypatch):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((5, 7, 9)), rng.standard_normal((7, 9))

    def run():
        x, y = zyx.Tensor(a.astype(np.float32)), zyx.Tensor(b.astype(np.float32))
        outs = [(x * y).tanh(), x.abs() + y, ((x * y).tanh() - x).sigmoid()]
        plan = _realize_together(*outs)
        return plan, [o.numpy() for o in outs]

    plan_on, on = run()
    monkeypatch.setattr(KZ, "MULTI_OUTPUT", False)
    RT.plans.clear()
    plan_off, off = run()
    assert _nouts(plan_on) == [3] and _nouts(plan_off) == [1, 1, 1]
    for g, r in zip(on, off):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)


def test_adam_updates_parameter_and_moments_in_one_kernel(fresh, monkeypatch):
    def train(multi):
        monkeypatch.setattr(KZ, "MULTI_OUTPUT", multi)
        RT.plans.clear()
        zyx.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = optim.Adam(model.parameters(), lr=1e-2)
        rng = np.random.default_rng(5)
        x = zyx.Tensor(rng.standard_normal((8, 16)).astype(np.float32))
        y = zyx.Tensor(rng.integers(0, 4, 8))
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        plan = max(RT.plans.values(), key=lambda p: len(p.steps))
        return plan, [p.numpy() for p in model.parameters()]

    plan_on, on = train(True)
    plan_off, off = train(False)
    # one kernel per parameter writes the parameter, m and v
    assert _nouts(plan_on).count(3) == 4, _nouts(plan_on)
    assert len(plan_on.steps) == len(plan_off.steps) - 8
    for g, r in zip(on, off):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402

from test_hypothesis import SETTINGS, random_graph  # noqa: E402


@SETTINGS
@given(data=st.data(), shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
       steps=st.integers(2, 7))
def test_random_graphs_realized_together(data, shape, steps):
    """The hypothesis graphs of test_hypothesis, every intermediate realized in one plan
    (many stored results of one shape, reading one another through any movement)."""
    pool, trace = random_graph(data, shape, steps)
    made = pool[2:]
    RT.realize([x._id for x, _ in made])
    scale = max([1.0] + [float(np.abs(p[1]).max()) for p in pool if p[1].size])
    for x, a in made:
        np.testing.assert_allclose(x.numpy(), a, rtol=2e-4, atol=2e-4 * scale,
                                   err_msg=" | ".join(trace))
