"""Backward templates (zyx/_core/replay.pyx): the second backward over an equal structure
replays the traced gradient nodes instead of running the rules. A replay must build the
very same graph (same structural key, so the same plans and bit-identical values), keep
every error and semantic of the rules, and fall back to the rules whenever it cannot."""
import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import zyx
import zyx.autograd as A
import zyx.nn.functional as F
from zyx import nn
from zyx._core import graph as G
from zyx._core import replay
from zyx.errors import ZyxError
from zyx.runtime import RT


@pytest.fixture
def replay_mode(monkeypatch):
    """Set autograd's replay mode for one test."""
    def set_mode(mode):
        monkeypatch.setattr(A, "_REPLAY_MODE", mode)
    return set_mode


def _mlp_ce(rng):
    zyx.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    x = rng.standard_normal((8, 12)).astype(np.float32)
    y = rng.integers(0, 5, 8)
    return list(model.parameters()), lambda: F.cross_entropy(model(zyx.Tensor(x)), zyx.Tensor(y))


def _conv_pool(rng):
    zyx.manual_seed(1)
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = rng.standard_normal((2, 2, 6, 6)).astype(np.float32)
    return list(conv.parameters()), lambda: F.max_pool2d(conv(zyx.Tensor(x)).tanh(), 2).sum()


def _attention(rng):
    zyx.manual_seed(2)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    ln = nn.LayerNorm(8)
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)

    def loss():
        t = ln(zyx.Tensor(x))
        out, _ = mha(t, t, t, is_causal=True, attn_mask=zyx.Tensor(np.triu(
            np.full((4, 4), -np.inf, np.float32), 1)))
        return F.gelu(out).pow(2).mean()
    return list(mha.parameters()) + list(ln.parameters()), loss


def _shared_and_movement(rng):
    w = zyx.Tensor(rng.standard_normal((4, 6)).astype(np.float32), requires_grad=True)
    b = zyx.Tensor(rng.standard_normal(6).astype(np.float32), requires_grad=True)

    def loss():
        h = w * b + w.exp()                      # w used twice, b broadcast
        cat = zyx.cat([h[1:, ::2], h[:-1, 1::2].flip(0)], 1)
        padded = F.pad(cat, (1, 2)).amax(1) + zyx.where(h > 0, h, h * 0.1).amin(0).sum()
        return (padded.abs() + h.cast(zyx.float64).sum().cast(zyx.float32)).sum()
    return [w, b], loss


MODELS = {"mlp_ce": _mlp_ce, "conv_pool": _conv_pool, "attention": _attention,
          "shared_and_movement": _shared_and_movement}


def _grads(params, loss_fn):
    for p in params:
        p.grad = None
    loss_fn().backward()
    return [p.grad for p in params]


@pytest.mark.parametrize("name", list(MODELS))
def test_replay_builds_the_traced_graph(name, replay_mode):
    """Third backward (replayed) vs rules: same structural key, bit-identical values."""
    rng = np.random.default_rng(0)
    params, loss_fn = MODELS[name](rng)
    replay_mode("off")
    ref = [g.numpy() for g in _grads(params, loss_fn)]
    replay_mode("on")
    _grads(params, loss_fn)                      # traced
    before = zyx.stats()["backward_replays"]
    for p in params:
        p.grad = None
    loss = loss_fn()
    order, visited = A._walk([loss], lambda t: t._ctx is None and t.requires_grad)
    ogs = A._default_out_grads([loss], None, True)
    key, ins = replay.backward_key(RT.graph, [loss], ogs, order, A._FREED)
    assert A._templates.get(key), "the traced structure should have left a template"
    res_replayed, _ = A._run_backward([loss], ogs,
                                      lambda t: t._ctx is None and t.requires_grad, False)
    assert zyx.stats()["backward_replays"] == before + 1
    replay_mode("off")
    res_rules, _ = A._run_backward([loss], ogs,
                                   lambda t: t._ctx is None and t.requires_grad, False)
    assert list(res_replayed) == list(res_rules)           # same sources, same order
    ids_r = [g._id for g in res_replayed.values()]
    ids_s = [g._id for g in res_rules.values()]
    assert RT.graph.collect(ids_r)[1] == RT.graph.collect(ids_s)[1]
    by_id = {id(p): i for i, p in enumerate(params)}
    for k, g in res_replayed.items():
        np.testing.assert_array_equal(g.numpy(), res_rules[k].numpy())
        # realized alone, not with the loss as backward() does: other plans, other rounding
        np.testing.assert_allclose(g.numpy(), ref[by_id[k]], rtol=1e-5, atol=1e-7)


def test_training_steps_replay_and_match_rules(replay_mode, monkeypatch):
    """Ten SGD steps with templates on and off follow the same trajectory exactly."""
    monkeypatch.setattr(A, "_templates", {})
    losses = {}
    for mode in ("off", "on"):
        replay_mode(mode)
        rng = np.random.default_rng(3)
        params, loss_fn = _mlp_ce(rng)
        opt = zyx.optim.SGD(params, lr=0.1, momentum=0.9)
        before = zyx.stats()["backward_replays"]
        out = []
        for _ in range(10):
            opt.zero_grad()
            loss = loss_fn()
            loss.backward()
            opt.step()
            out.append(loss.item())
        losses[mode] = out
        replays = zyx.stats()["backward_replays"] - before
        assert replays == (0 if mode == "off" else 9)   # the first step traces
    assert losses["on"] == losses["off"]


def test_replay_keeps_memory_flat(replay_mode):
    replay_mode("on")
    params, loss_fn = _mlp_ce(np.random.default_rng(4))
    _grads(params, loss_fn)
    _grads(params, loss_fn)
    gc.collect()      # counts of live memory only: not of an earlier test's garbage
    nodes, pool = len(RT.graph), RT.pool_bytes()
    for _ in range(20):
        _grads(params, loss_fn)
    gc.collect()
    assert len(RT.graph) == nodes
    assert RT.pool_bytes() == pool


def test_tape_intermediate_sources_and_retain_grad(replay_mode):
    replay_mode("on")
    rng = np.random.default_rng(5)
    xv = rng.standard_normal((3, 4)).astype(np.float32)
    for _ in range(3):           # trace, then replay twice
        x = zyx.Tensor(xv)
        with zyx.Tape() as tape:
            tape_x = x * 1.0
            h = (tape_x * 2.0).exp()
            y = (h * h).sum()
        gx, gh = tape.gradient(y, [tape_x, h])
        np.testing.assert_allclose(gh.numpy(), 2 * np.exp(2 * xv), rtol=1e-5)
        np.testing.assert_allclose(gx.numpy(), 4 * np.exp(4 * xv), rtol=1e-5)
        w = zyx.Tensor(xv, requires_grad=True)
        mid = w.sin()
        mid.retain_grad()
        (mid * w).sum().backward()
        np.testing.assert_allclose(mid.grad.numpy(), xv, rtol=1e-6)
        np.testing.assert_allclose(w.grad.numpy(), np.cos(xv) * xv + np.sin(xv), rtol=1e-5)


def test_freed_graph_raises_after_replay(replay_mode):
    replay_mode("on")
    w = zyx.Tensor(np.ones(3, np.float32), requires_grad=True)
    for _ in range(2):
        (w * 3.0).exp().sum().backward()
    loss = (w * 3.0).exp().sum()
    loss.backward()
    with pytest.raises(ZyxError, match="already freed"):
        loss.backward()


def test_create_graph_runs_the_rules(replay_mode):
    """Recording backward ops (higher derivatives) never replays; results stay exact."""
    replay_mode("on")
    for _ in range(3):
        x = zyx.Tensor(np.array([0.5, -1.0, 2.0], np.float32), requires_grad=True)
        before = zyx.stats()["backward_replays"]
        (x ** 3).sum().backward(create_graph=True)
        assert zyx.stats()["backward_replays"] == before
        g = x.grad
        x.grad = None
        g.sum().backward()
        np.testing.assert_allclose(x.grad.numpy(), 6 * np.array([0.5, -1.0, 2.0]), rtol=1e-6)


def test_unreplayable_trace_falls_back_to_rules(replay_mode, monkeypatch):
    """A rule that makes a buffer (a new leaf) cannot be replayed: the key remembers it and
    later passes run the rules, with correct results."""
    replay_mode("on")
    rule = A._RULES[G.UNARY]

    def leafy_rule(out, g, uop, srcs, need):
        got = rule(out, g, uop, srcs, need)
        return tuple(None if r is None else r * zyx.Tensor(np.float32(1.0)) for r in got)
    monkeypatch.setattr(A, "_RULES", list(A._RULES))
    A._RULES[G.UNARY] = leafy_rule
    x = zyx.Tensor(np.array([0.1, 0.7], np.float32), requires_grad=True)
    for _ in range(3):
        x.grad = None
        before = zyx.stats()["backward_replays"]
        x.cos().sum().backward()
        assert zyx.stats()["backward_replays"] == before
        # (rtol: Vulkan's sin is only held to an absolute 2^-11 error; NVIDIA's was 1.2e-6)
        np.testing.assert_allclose(x.grad.numpy(), -np.sin([0.1, 0.7]), rtol=1e-5)
    assert None in A._templates.values()


def test_build_template_rejects_unknown_nodes():
    assert replay.build_template([None], [], {}, []) is None
    trace = [(G.UNARY, 0, (123456,), (1,), zyx.float32, 7)]    # reads an undescribed node
    assert replay.build_template(trace, [1], {}, []) is None


def test_template_cache_is_bounded(replay_mode, monkeypatch):
    replay_mode("on")
    monkeypatch.setattr(A, "MAX_TEMPLATES", 2)
    monkeypatch.setattr(A, "_templates", {})
    for n in (2, 3, 4, 5):
        w = zyx.Tensor(np.ones(n, np.float32), requires_grad=True)
        (w * w).sum().backward()
        np.testing.assert_allclose(w.grad.numpy(), 2 * np.ones(n))
        assert len(A._templates) <= 2


def test_autograd_suite_with_every_backward_replayed():
    """ZYX_BACKWARD_REPLAY=always replays even the first (traced) pass: the whole autograd
    and optimizer suites then run on template-built gradients."""
    here = os.path.dirname(__file__)
    env = dict(os.environ, ZYX_BACKWARD_REPLAY="always")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.join(here, "test_autograd.py"),
                        os.path.join(here, "test_optim.py")],
                       env=env, capture_output=True, text=True, cwd=os.path.dirname(here))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout


# -- forward templates (replay.ForwardTemplates): composite forwards replayed ---------------
def test_forward_template_replays_the_traced_nodes():
    """A second call with the same key adds the very nodes the first one traced, on the
    new inputs: the same structure, values computed from the new inputs."""
    cache = replay.ForwardTemplates(4)
    calls = []

    def build(a, b):
        calls.append(1)
        return [(a.reshape((3, 2)).permute((1, 0)) * b).sum(1), a + 1]

    def run(a, b):
        return cache.run(RT.graph, ("t",), [a, b], build, zyx.Tensor._wrap)
    rng = np.random.default_rng(0)
    first = [rng.standard_normal(6).astype(np.float32) for _ in range(2)]
    second = [rng.standard_normal(6).astype(np.float32) for _ in range(2)]
    r1 = run(zyx.Tensor(first[0]), zyx.Tensor(first[1].reshape(2, 3)))
    r2 = run(zyx.Tensor(second[0]), zyx.Tensor(second[1].reshape(2, 3)))
    assert len(calls) == 1 and cache.replayable() == 1
    s1, s2 = (RT.graph.collect([t._id for t in r])[1] for r in (r1, r2))
    assert s1 == s2                    # the same structural key: the same plan
    a, b = second[0], second[1].reshape(2, 3)
    np.testing.assert_allclose(r2[0].numpy(), (a.reshape(3, 2).T * b).sum(1), rtol=1e-6)
    np.testing.assert_allclose(r2[1].numpy(), a + 1, rtol=1e-6)
    # one tensor passed twice is another key (which inputs share a node is part of it)
    x, y = zyx.Tensor(first[0]), zyx.Tensor(second[0])

    def product(a, b):
        return cache.run(RT.graph, ("p",), [a, b], lambda a, b: [a * b], zyx.Tensor._wrap)[0]
    np.testing.assert_allclose(product(x, y).numpy(), first[0] * second[0], rtol=1e-6)
    np.testing.assert_allclose(product(x, x).numpy(), first[0] ** 2, rtol=1e-6)
    assert len(cache) == 3


def test_forward_template_not_replayable_runs_every_time():
    cache = replay.ForwardTemplates(2)
    calls = []

    def build(a):
        calls.append(1)
        return [a * zyx.Tensor(np.float32(2.0))]      # makes a buffer: not replayable
    for v in (1.0, 3.0):
        out, = cache.run(RT.graph, ("leafy",), [zyx.Tensor(np.full(3, v, np.float32))],
                         build, zyx.Tensor._wrap)
        np.testing.assert_array_equal(out.numpy(), np.full(3, 2 * v, np.float32))
    assert len(calls) == 2 and len(cache) == 1 and cache.replayable() == 0
    off = replay.ForwardTemplates(0)                     # limit 0: every call builds
    for v in (1.0, 3.0):
        out, = off.run(RT.graph, ("x",), [zyx.Tensor(np.full(3, v, np.float32))],
                       lambda a: [a + 1], zyx.Tensor._wrap)
        np.testing.assert_array_equal(out.numpy(), np.full(3, v + 1, np.float32))
    assert len(off) == 0
    for n in (4, 5, 6):                                # bounded
        cache.run(RT.graph, ("x",), [zyx.Tensor(np.ones(n, np.float32))],
                  lambda a: [a + 1], zyx.Tensor._wrap)
    assert len(cache) == 2


def test_conv_forward_replays_with_new_values_and_gradients():
    """Convolutions build their forward from a template after the first call of a shape
    and parameters; values and gradients follow the inputs, not the traced call."""
    F._CONV_TEMPLATES.clear()
    rng = np.random.default_rng(2)
    for stride, pad in ((1, 1), (2, 0), (1, 1)):
        for _ in range(2):
            x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
            w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
            zx = zyx.Tensor(x, requires_grad=True)
            zw = zyx.Tensor(w, requires_grad=True)
            y = F.conv2d(zx, zw, stride=stride, padding=pad)
            (y * y).sum().backward()
            xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
            win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), (2, 3))
            win = win[:, :, ::stride, ::stride]
            ref = np.einsum("nchwij,ocij->nohw", win, w)
            np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4)
            gw = np.einsum("nohw,nchwij->ocij", 2 * ref, win)
            np.testing.assert_allclose(zw.grad.numpy(), gw, rtol=1e-3, atol=1e-3)
    assert len(F._CONV_TEMPLATES) == 2 and F._CONV_TEMPLATES.replayable() == 2
