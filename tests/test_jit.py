"""zyx.jit (zyx/jit.py, docs/jit.md): a jitted step gives what the same Python gives
without jit, replays without running its body, takes Python floats and random draws as
inputs of every replay, and raises JitError where it cannot replay."""
import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from zyx import nn, optim


def _mlp(seed):
    zyx.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(n, rows=6):
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((rows, 8)).astype(np.float32),
             rng.integers(0, 4, rows)) for _ in range(n)]


def _params(model):
    return [p.numpy().copy() for p in model.parameters()]


def _train(make_opt, jitted, steps=10):
    """Parameters and losses after `steps` cross-entropy steps of the MLP, with or
    without zyx.jit around the step, and how often the step's body ran."""
    model = _mlp(0)
    opt = make_opt(model.parameters())
    ran = [0]

    def step(x, y):
        ran[0] += 1
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    if jitted:
        step = zyx.jit(step)
    losses = [step(zyx.tensor(x), zyx.tensor(y)).item() for x, y in _batches(steps)]
    return _params(model), losses, ran[0], model


@pytest.mark.parametrize("make_opt", [
    lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: optim.Adam(ps, lr=0.01),
    lambda ps: optim.AdamW(ps, lr=0.01, weight_decay=0.1),
], ids=["sgd", "adam", "adamw"])
def test_training_under_jit_matches_eager(device, make_opt):
    want, want_losses, _, _ = _train(make_opt, False)
    got, got_losses, ran, model = _train(make_opt, True)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # the body ran on calls 1 and 2 only
    assert ran == 2
    # .grad after a replay is that replay's gradient (the objects are rebound)
    assert all(p.grad is not None for p in model.parameters())


def test_grads_after_replay_are_the_last_steps(device):
    model = _mlp(0)
    opt = optim.SGD(model.parameters(), lr=0.1)

    @zyx.jit
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    data = _batches(4)
    for x, y in data:
        step(zyx.tensor(x), zyx.tensor(y))
    # the gradient of the last step: recompute it at the parameters before that step
    before = _mlp(0)
    ref_opt = optim.SGD(before.parameters(), lr=0.1)
    for x, y in data[:-1]:
        loss = F.cross_entropy(before(zyx.tensor(x)), zyx.tensor(y))
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
    x, y = data[-1]
    loss = F.cross_entropy(before(zyx.tensor(x)), zyx.tensor(y))
    ref_opt.zero_grad()
    loss.backward()
    for p, q in zip(model.parameters(), before.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_body_runs_twice_in_ten_calls(device):
    w = zyx.tensor(np.ones(4, np.float32))
    ran = [0]

    @zyx.jit
    def f(x):
        ran[0] += 1
        return (x * w).sum()

    for i in range(10):
        out = f(zyx.tensor(np.full(4, float(i), np.float32)))
        assert out.item() == pytest.approx(4.0 * i)
    assert ran[0] == 2
    assert f.calls == {"runs": 2, "captures": 1, "replays": 8}


def test_lr_schedule_as_python_float(device):
    """lr passed in changes the result and builds no plan after the capture."""
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(10)]
    ys = [rng.standard_normal((5, 1)).astype(np.float32) for _ in range(10)]
    lrs = [0.1 * 0.8 ** i for i in range(10)]

    def run(jitted):
        w = zyx.tensor(np.full((3, 1), 0.5, np.float32))

        def step(x, y, lr):
            g = x.T @ (x @ w - y)
            w.sub_(g * lr)
            return ((x @ w - y) ** 2).mean()

        if jitted:
            step = zyx.jit(step)
        out, plans = [], []
        for x, y, lr in zip(xs, ys, lrs):
            out.append(step(zyx.tensor(x), zyx.tensor(y), lr).item())
            plans.append(zyx.stats()["plans_built"])
        return w.numpy(), out, plans

    want_w, want, _ = run(False)
    got_w, got, plans = run(True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-7)
    assert plans[-1] == plans[2]        # replays (calls 3..10) build nothing

    # numpy reference: the learning rates really changed the trajectory
    w = np.full((3, 1), 0.5)
    for x, y, lr in zip(xs, ys, lrs):
        w = w - lr * (x.T @ (x @ w - y))
    np.testing.assert_allclose(got_w, w, rtol=1e-4, atol=1e-6)


def test_lr_changed_in_param_groups_is_replayed(device):
    def run(jitted):
        model = _mlp(0)
        opt = optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        if jitted:
            step = zyx.jit(step)
        for i, (x, y) in enumerate(_batches(8)):
            opt.param_groups[0]["lr"] = 0.1 / (1 + i)
            step(zyx.tensor(x), zyx.tensor(y))
        return _params(model)

    for g, w in zip(run(True), run(False)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_dropout_differs_per_call_and_matches_eager(device):
    x = zyx.tensor(np.ones((64,), np.float32))

    def drop(x):
        return F.dropout(x, 0.5, training=True)

    zyx.manual_seed(7)
    want = [drop(x).numpy() for _ in range(6)]
    after = zyx.random.seed_state() if hasattr(zyx, "random") else None
    zyx.manual_seed(7)
    jitted = zyx.jit(drop)
    got = [jitted(x).numpy() for _ in range(6)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    # masks differ between calls, replays included
    assert len({g.tobytes() for g in got}) == 6
    assert jitted.calls["replays"] == 4
    if after is not None:
        assert zyx.random.seed_state() == after


def test_dropout_in_a_training_step(device):
    def run(jitted):
        zyx.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
        opt = optim.Adam(model.parameters(), lr=0.01)

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        if jitted:
            step = zyx.jit(step)
        losses = [step(zyx.tensor(x), zyx.tensor(y)).item() for x, y in _batches(6)]
        return losses, _params(model)

    want, wp = run(False)
    got, gp = run(True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(gp, wp):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_shape_change_captures_again(device):
    w = zyx.tensor(np.arange(8, dtype=np.float32))
    ran = [0]

    @zyx.jit
    def f(x):
        ran[0] += 1
        return x * w

    rng = np.random.default_rng(0)
    for rows in (4, 4, 4, 2, 2, 2, 2, 4):
        x = rng.standard_normal((rows, 8)).astype(np.float32)
        np.testing.assert_allclose(f(zyx.tensor(x)).numpy(), x * np.arange(8), rtol=1e-6)
    assert ran[0] == 4      # twice per shape
    assert f.calls["captures"] == 2


def test_too_many_structures_raise(device):
    f = zyx.jit(lambda x: x + 1, max_captures=1)
    f(zyx.tensor(np.zeros(3, np.float32)))
    with pytest.raises(zyx.JitError, match="argument structures"):
        f(zyx.tensor(np.zeros(4, np.float32)))


def test_static_arguments_are_keys(device):
    ran = [0]

    @zyx.jit(static=("scale",))
    def f(x, scale):
        ran[0] += 1
        return x * 2 if scale > 1 else x

    x = zyx.tensor(np.ones(3, np.float32))
    for s in (2.0, 2.0, 2.0, 0.5, 0.5, 0.5):
        assert f(x, scale=s).numpy().tolist() == ([2.0] * 3 if s > 1 else [1.0] * 3)
    assert ran[0] == 4


def test_output_must_be_tensors(device):
    f = zyx.jit(lambda x: (x * 2).sum().item())
    with pytest.raises(zyx.JitError, match="returned a float"):
        f(zyx.tensor(np.ones(3, np.float32)))


def test_numpy_argument_raises(device):
    f = zyx.jit(lambda x: x)
    with pytest.raises(zyx.JitError, match="numpy array"):
        f(np.ones(3, np.float32))


def test_host_data_inside_is_frozen_with_a_warning(device):
    @zyx.jit
    def f(x):
        return x + zyx.tensor(np.random.default_rng().standard_normal(3).astype(np.float32))

    x = zyx.tensor(np.zeros(3, np.float32))
    f(x)
    with pytest.warns(UserWarning, match="frozen"):
        second = f(x).numpy()
    np.testing.assert_array_equal(f(x).numpy(), second)


def test_input_on_another_device_raises():
    devs = [d for d in zyx.devices() if d.type != "wgpu"]
    if len(devs) < 2:
        pytest.skip("needs two devices")
    big = zyx.tensor(np.ones(4096, np.float32), device=devs[1])

    @zyx.jit
    def f(x):
        return (big + x.sum()).sum()

    x = zyx.tensor(np.ones(4, np.float32), device=devs[0])
    f(x)
    with pytest.raises(zyx.JitError, match="move it there"):
        f(x)


def test_returned_structure(device):
    @zyx.jit
    def f(x):
        return {"double": x * 2, "pair": (x + 1, None)}

    for i in range(4):
        x = np.full(3, float(i), np.float32)
        out = f(zyx.tensor(x))
        np.testing.assert_array_equal(out["double"].numpy(), x * 2)
        np.testing.assert_array_equal(out["pair"][0].numpy(), x + 1)
        assert out["pair"][1] is None


def test_label_check_runs_on_replay(device):
    @zyx.jit
    def f(logits, y):
        return F.cross_entropy(logits, y)

    logits = zyx.tensor(np.zeros((4, 3), np.float32))
    for _ in range(3):
        f(logits, zyx.tensor(np.array([0, 1, 2, 1])))
    with pytest.raises(IndexError):
        f(logits, zyx.tensor(np.array([0, 1, 7, 1])))
