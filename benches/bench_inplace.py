"""In-place training loop benchmark (issue 12): a 784-128-10 MLP, batch 64, cross-entropy,
SGD written by hand the PyTorch way (`with zyx.no_grad(): p -= lr * p.grad`) beside the
optimizer-based step (`opt.zero_grad(); loss.backward(); opt.step()`). Target: the
hand-written step within 10% of the optimizer's.

The hand-written loop realizes nothing itself: each in-place update is deferred and the
next step's first update computes the previous updates, this step's forward and backward
in one plan (zyx/inplace.py), so it runs one plan per step like the optimizer.

Run:  python -m pytest benches/bench_inplace.py --benchmark-only -s
"""
import numpy as np
import pytest

import zyx
from zyx.runtime import RT
from bench_train import (B, D, C, CHECK_STEPS, LR, N_BATCHES, SETTLE_S, _settle,
                         _zyx_model, init_weights, make_numpy, make_zyx)


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((B, D), dtype=np.float32),
             rng.integers(0, C, B).astype(np.int64)) for _ in range(N_BATCHES)]


def make_handwritten(w, opt="sgd"):
    """loss.backward(), then every parameter updated in place under no_grad."""
    import zyx.nn.functional as F
    model, _ = _zyx_model(w, opt)
    params = list(model.parameters())
    lr = LR[opt]
    last = {}

    def step(x, y):
        loss = F.cross_entropy(model(zyx.from_numpy(x)), zyx.from_numpy(y))
        loss.backward()
        with zyx.no_grad():
            for p in params:
                p -= lr * p.grad
                p.grad = None
        last["loss"] = loss
    return step, lambda: last["loss"].item()


IMPLS = {"optimizer": make_zyx, "handwritten": make_handwritten}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_sgd_step(benchmark, batches, impl):
    w = init_weights()
    step, loss = IMPLS[impl](w, "sgd")
    ref_step, ref_loss = make_numpy(w, "sgd")
    for i in range(CHECK_STEPS):          # both follow the numpy reference
        step(*batches[i])
        ref_step(*batches[i])
    np.testing.assert_allclose(loss(), ref_loss(), rtol=2e-4)
    plans = RT.stats["plans_built"]
    _settle(SETTLE_S)
    benchmark.group = "mlp-784-128-10-b64-sgd-inplace"
    k = iter(range(10 ** 9))

    def one():
        x, y = batches[next(k) % N_BATCHES]
        step(x, y)
    benchmark.pedantic(one, rounds=300, iterations=1, warmup_rounds=10)
    loss()
    # one plan per step, built once: the hand-written loop's graph does not grow
    assert RT.stats["plans_built"] - plans <= 2
    print(f"\n{impl} sgd: median {benchmark.stats.stats.median * 1e3:.3f} ms/step")
