"""zyx.optim against torch.optim (ten steps on the same small model) and a numpy reference."""
import gc
import math

import numpy as np
import pytest

import zyx
from zyx import optim

# every test runs on every device zyx finds (conftest `device`: the CPU, OpenCL on PoCL
# in CI, CUDA on a GPU machine)
pytestmark = pytest.mark.usefixtures("device")

STEPS = 10


def _data():
    rng = np.random.RandomState(0)
    return {
        "x": rng.randn(8, 4).astype(np.float32),
        "y": rng.randn(8, 3).astype(np.float32),
        "w1": (rng.randn(4, 5) * 0.5).astype(np.float32),
        "b1": (rng.randn(5) * 0.1).astype(np.float32),
        "w2": (rng.randn(5, 3) * 0.5).astype(np.float32),
        "b2": (rng.randn(3) * 0.1).astype(np.float32),
    }


PARAM_NAMES = ("w1", "b1", "w2", "b2")


def _zyx_loss(ps, x, y):
    w1, b1, w2, b2 = ps
    h = (x @ w1 + b1).tanh()
    return ((h @ w2 + b2 - y) ** 2).mean()


def _zyx_run(make_opt, mode, steps=STEPS, scheduler=None):
    """Train with zyx; mode 'torch' (backward/step) or 'tape' (Tape/update)."""
    d = _data()
    x, y = zyx.Tensor(d["x"]), zyx.Tensor(d["y"])
    ps = [zyx.Tensor(d[n], requires_grad=(mode == "torch")) for n in PARAM_NAMES]
    opt = make_opt(ps)
    sched = scheduler(opt) if scheduler else None
    lrs, losses = [], []
    for _ in range(steps):
        if mode == "torch":
            opt.zero_grad()
            loss = _zyx_loss(ps, x, y)
            loss.backward()
            opt.step()
        else:
            with zyx.Tape() as tape:
                loss = _zyx_loss(ps, x, y)
            opt.update(ps, tape.gradient(loss, ps), realize=[loss])
        losses.append(loss.item())
        if sched:
            lrs.append(sched.get_last_lr()[0])
            sched.step()
    return [p.numpy() for p in ps], losses, lrs


def _torch_run(make_opt, steps=STEPS, scheduler=None):
    torch = pytest.importorskip("torch")
    d = _data()
    x, y = torch.tensor(d["x"]), torch.tensor(d["y"])
    ps = [torch.tensor(d[n], requires_grad=True) for n in PARAM_NAMES]
    opt = make_opt(torch.optim, ps)
    sched = scheduler(torch.optim.lr_scheduler, opt) if scheduler else None
    lrs, losses = [], []
    for _ in range(steps):
        opt.zero_grad()
        w1, b1, w2, b2 = ps
        loss = (((x @ w1 + b1).tanh() @ w2 + b2 - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if sched:
            lrs.append(sched.get_last_lr()[0])
            sched.step()
    return [p.detach().numpy() for p in ps], losses, lrs


CONFIGS = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02)),
    ("SGD", dict(lr=0.05, momentum=0.5, maximize=True)),
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.02, betas=(0.8, 0.99), weight_decay=0.1)),
    ("Adam", dict(lr=0.02, amsgrad=True)),
    ("Adam", dict(lr=0.01, maximize=True)),
    ("AdamW", dict(lr=0.02)),
    ("AdamW", dict(lr=0.02, weight_decay=0.1, amsgrad=True)),
    ("RMSprop", dict(lr=0.01)),
    ("RMSprop", dict(lr=0.01, centered=True)),
    ("RMSprop", dict(lr=0.005, momentum=0.9, weight_decay=0.01)),
    ("RMSprop", dict(lr=0.005, alpha=0.9, centered=True, momentum=0.5)),
]


@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}-{'-'.join(k)}" for n, k in CONFIGS])
@pytest.mark.parametrize("mode", ["torch", "tape"])
def test_matches_torch(name, kw, mode):
    ref, ref_losses, _ = _torch_run(lambda mod, ps: getattr(mod, name)(ps, **kw))
    got, losses, _ = _zyx_run(lambda ps: getattr(optim, name)(ps, **kw), mode)
    for n, g, r in zip(PARAM_NAMES, got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"{name} {kw} {n}")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert losses[-1] != losses[0]


def _numpy_sgd_momentum(lr, momentum, dampening, steps):
    """Hand-written forward, backward and SGD-momentum update of the same model."""
    d = {k: v.astype(np.float64) for k, v in _data().items()}
    x, y = d["x"], d["y"]
    ps = [d[n].copy() for n in PARAM_NAMES]
    bufs = [None] * 4
    for _ in range(steps):
        w1, b1, w2, b2 = ps
        h = np.tanh(x @ w1 + b1)
        r = h @ w2 + b2 - y
        dout = 2 * r / r.size
        gw2, gb2 = h.T @ dout, dout.sum(0)
        dh = dout @ w2.T * (1 - h * h)
        gw1, gb1 = x.T @ dh, dh.sum(0)
        for i, g in enumerate((gw1, gb1, gw2, gb2)):
            bufs[i] = g.copy() if bufs[i] is None else momentum * bufs[i] + (1 - dampening) * g
            ps[i] = ps[i] - lr * bufs[i]
    return ps


@pytest.mark.parametrize("mode", ["torch", "tape"])
def test_sgd_momentum_matches_numpy(mode):
    ref = _numpy_sgd_momentum(0.1, 0.9, 0.1, STEPS)
    got, _, _ = _zyx_run(lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1), mode)
    for n, g, r in zip(PARAM_NAMES, got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=n)


SCHEDULERS = [
    ("StepLR", dict(step_size=3, gamma=0.5)),
    ("CosineAnnealingLR", dict(T_max=4, eta_min=0.001)),
]


@pytest.mark.parametrize("name,kw", SCHEDULERS, ids=[s[0] for s in SCHEDULERS])
def test_scheduler_matches_torch(name, kw):
    steps = 12
    ref, _, ref_lrs = _torch_run(lambda mod, ps: mod.SGD(ps, lr=0.1, momentum=0.9),
                                 steps, lambda mod, o: getattr(mod, name)(o, **kw))
    got, _, lrs = _zyx_run(lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9), "torch", steps,
                           lambda o: getattr(optim, name)(o, **kw))
    np.testing.assert_allclose(lrs, ref_lrs, rtol=1e-12, atol=1e-15)
    assert len(set(lrs)) > 2
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_scheduler_formulas_without_torch():
    p = zyx.Tensor(np.zeros(2, np.float32))
    opt = optim.SGD([p], lr=1.0)
    s = optim.StepLR(opt, step_size=2, gamma=0.1)
    seen = []
    for _ in range(5):
        seen.append(s.get_last_lr()[0])
        s.step()
    np.testing.assert_allclose(seen, [1.0, 1.0, 0.1, 0.1, 0.01])
    opt = optim.SGD([p], lr=1.0)
    c = optim.CosineAnnealingLR(opt, T_max=10, eta_min=0.0)
    seen = []
    for _ in range(11):
        seen.append(c.get_last_lr()[0])
        c.step()
    expected = [(1 + math.cos(math.pi * e / 10)) / 2 for e in range(11)]
    np.testing.assert_allclose(seen, expected, atol=1e-12)


def test_changing_lr_compiles_no_new_kernel():
    """A new lr value is a new leaf, not a new constant: the cached plan is reused."""
    p = zyx.Tensor(np.ones(16, np.float32))
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.update([p], [zyx.Tensor(np.full(16, 0.5, np.float32))])
    compiled = zyx.stats()["kernels_compiled"]
    expected = p.numpy().astype(np.float64)
    buf = np.full(16, 0.5 + 0.9 * 0.5)
    for step in range(4):
        opt.param_groups[0]["lr"] = 0.1 / (step + 2)
        opt.update([p], [zyx.Tensor(np.full(16, 0.5, np.float32))])
        buf = 0.9 * buf + 0.5
        expected -= 0.1 / (step + 2) * buf
    assert zyx.stats()["kernels_compiled"] == compiled
    np.testing.assert_allclose(p.numpy(), expected, rtol=1e-6)


def test_adam_under_a_schedule_compiles_no_new_kernel():
    """Bias corrections and scheduled lrs change every step; kernels stay the same."""
    p = zyx.Tensor(np.linspace(-1, 1, 16).astype(np.float32))
    opt = optim.AdamW(p, lr=0.1, amsgrad=True)
    sched = optim.StepLR(opt, step_size=1, gamma=0.7)
    g = zyx.Tensor(np.linspace(0.5, 1.5, 16).astype(np.float32))
    for _ in range(3):   # warm-up: at step 2 the AMSGrad max and exp_avg_sq share a node
        opt.update([p], [g])
        sched.step()
    compiled = zyx.stats()["kernels_compiled"]
    for _ in range(3):
        opt.update([p], [g])
        sched.step()
    assert zyx.stats()["kernels_compiled"] == compiled
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.7 ** 6)


def test_params_rebound_in_place_and_groups():
    a = zyx.Tensor(np.ones(3, np.float32), requires_grad=True)
    b = zyx.Tensor(np.ones(2, np.float32), requires_grad=True)
    alias = a
    opt = optim.SGD([{"params": [a], "lr": 0.5}, {"params": [b]}], lr=0.1)
    assert opt.param_groups[1]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.0
    ((a * 2).sum() + (b * 3).sum()).backward()
    opt.step()
    np.testing.assert_allclose(alias.numpy(), [0.0, 0.0, 0.0])
    np.testing.assert_allclose(b.numpy(), [0.7, 0.7])
    assert a.requires_grad and a.is_leaf
    opt.zero_grad()
    assert a.grad is None and b.grad is None
    opt.step()     # no grads: nothing changes
    np.testing.assert_allclose(b.numpy(), [0.7, 0.7])


def test_update_with_dicts_and_errors():
    w = zyx.Tensor(np.array([1.0, 2.0], np.float32))
    opt = optim.Adam({"w": w}.values(), lr=0.1)
    with zyx.Tape() as tape:
        loss = (w * w).sum()
    opt.update({"w": w}, tape.gradient(loss, {"w": w}))
    # first Adam step moves each weight by lr * sign(grad)
    np.testing.assert_allclose(w.numpy(), [0.9, 1.9], rtol=1e-5)
    with pytest.raises(zyx.ZyxError, match="2 gradients"):
        opt.update([w], [w, w])
    with pytest.raises(zyx.ZyxError, match="shape"):
        opt.update([w], [zyx.Tensor(np.ones(3, np.float32))])
    with pytest.raises(ValueError):
        optim.SGD([w], lr=0.1, nesterov=True)
    with pytest.raises(zyx.ZyxError):
        optim.SGD([zyx.Tensor(np.ones(2, np.int32))], lr=0.1)


def test_one_realization_per_update_and_memory_returns():
    """All parameters and states update in a single realization; buffers come back."""
    ps = [zyx.Tensor(np.random.randn(6, 5).astype(np.float32)) for _ in range(3)]
    opt = optim.Adam(ps, lr=0.01)

    def step():
        with zyx.Tape() as tape:
            loss = sum((p * p).sum() for p in ps)
        grads = tape.gradient(loss, ps)
        before = zyx.stats()["realizations"]
        opt.update(ps, grads, realize=[loss])
        return zyx.stats()["realizations"] - before

    assert step() == 1
    assert step() == 1
    gc.collect()      # counts of live memory only: not of an earlier test's garbage
    used = zyx._RT.pool_bytes()
    for _ in range(5):
        step()
    gc.collect()
    assert zyx._RT.pool_bytes() == used


def test_state_dict_round_trip_resumes_exactly():
    full, _, _ = _zyx_run(lambda ps: optim.Adam(ps, lr=0.02, amsgrad=True), "tape", steps=6)
    d = _data()
    x, y = zyx.Tensor(d["x"]), zyx.Tensor(d["y"])
    ps = [zyx.Tensor(d[n]) for n in PARAM_NAMES]
    opt = optim.Adam(ps, lr=0.02, amsgrad=True)
    for i in range(6):
        if i == 3:   # checkpoint, then continue with a fresh optimizer
            saved = opt.state_dict()
            assert saved["state"][0]["step"] == 3 and saved["param_groups"][0]["params"] == [0, 1, 2, 3]
            opt = optim.Adam(ps, lr=0.5)
            opt.load_state_dict(saved)
            assert opt.param_groups[0]["lr"] == 0.02
        with zyx.Tape() as tape:
            loss = _zyx_loss(ps, x, y)
        opt.update(ps, tape.gradient(loss, ps))
    for g, r in zip(ps, full):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-6, atol=1e-7)
    with pytest.raises(zyx.ZyxError, match="layout"):
        optim.Adam(ps[:2]).load_state_dict(saved)
