"""LSTM training step, zyx next to PyTorch (issue 12: nn.LSTM must be fast).

Run:  python -m pytest benches/bench_rnn.py --benchmark-only -s

The step: batch 32, sequence 30, input 64, hidden 128, one layer, batch_first, a Linear
head on the last output, cross-entropy, Adam. Also the first step of a fresh process with
an empty kernel cache (every kernel compiled), and the plan's kernel counts: calls per
step and distinct kernels (what the C compiler sees; identical step kernels share one)."""
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import zyx
from conftest import need_torch

B, T, I, H, C = 32, 30, 64, 128, 10


def _data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, T, I), dtype=np.float32),
            (np.arange(B) % C).astype(np.int64))


def _zyx_step():
    from zyx import nn
    import zyx.nn.functional as F
    zyx.manual_seed(0)
    lstm, head = nn.LSTM(I, H, batch_first=True), nn.Linear(H, C)
    opt = zyx.optim.Adam(list(lstm.parameters()) + list(head.parameters()))
    x, y = _data()

    def step():
        out, _ = lstm(zyx.from_numpy(x))
        loss = F.cross_entropy(head(out[:, -1]), zyx.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    return step


@pytest.mark.benchmark(group="lstm-train-step")
def test_lstm_step_zyx(benchmark):
    from zyx.runtime import RT
    step = _zyx_step()
    for _ in range(5):
        step().item()
    plan = max(RT.plans.values(), key=lambda p: p.last_used)
    kernels = [st.kernel for st in plan.steps if st.kernel is not None]
    benchmark.extra_info.update(kernel_calls=len(kernels), distinct_kernels=len(set(kernels)))
    benchmark(lambda: step().item())
    print(f"\nzyx LSTM step: {len(kernels)} kernel calls, {len(set(kernels))} distinct kernels")


@pytest.mark.benchmark(group="lstm-train-step")
def test_lstm_step_torch(benchmark):
    torch = need_torch()
    torch.manual_seed(0)
    lstm, head = torch.nn.LSTM(I, H, batch_first=True), torch.nn.Linear(H, C)
    opt = torch.optim.Adam(list(lstm.parameters()) + list(head.parameters()))
    x, y = (torch.from_numpy(a) for a in _data())

    def step():
        out, _ = lstm(x)
        loss = torch.nn.functional.cross_entropy(head(out[:, -1]), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()
    for _ in range(5):
        step()
    benchmark(step)


_COLD = """
import time, sys
sys.path.insert(0, {benches!r})
from bench_rnn import _zyx_step
import zyx
zyx.devices()
step = _zyx_step()
t0 = time.perf_counter(); step().item(); t1 = time.perf_counter(); step().item()
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, zyx.stats()["compiler_runs"])
"""


def test_lstm_first_step_cold_cache(benchmark):
    """First step of a fresh process with an empty kernel cache (target: under 3 s)."""
    benchmark.group = "lstm-first-step"
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, XDG_CACHE_HOME=cache)
        code = _COLD.format(benches=os.path.dirname(os.path.abspath(__file__)))
        res = benchmark.pedantic(lambda: subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True),
            rounds=1, iterations=1)
    first, second, runs = res.stdout.split()
    benchmark.extra_info.update(first_step_ms=float(first) * 1e3,
                                second_step_ms=float(second) * 1e3, compiler_runs=int(runs))
    print(f"\nzyx LSTM cold first step {float(first):.2f} s ({runs} compiler runs), second "
          f"step {float(second) * 1e3:.1f} ms")
