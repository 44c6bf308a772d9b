"""The autotuner on issue 13's MNIST convnet (Conv 1-32-5, 32-32-5, pool, 32-64-3, pool,
Linear 1024-10, batch 128, Adam): the training step with the heuristics' schedules, then
with tuned ones, in one process, on the default device (ZYX_DEVICE=cuda for a GPU).

Run:  python -m pytest benches/bench_tuning.py --benchmark-only -s

The tuned test first deletes this device's stored schedules, times the first training
step (the search of every kernel: `tune_s` in extra_info, with the number of kernels
searched), then benchmarks the step."""
import os
import time

import numpy as np
import pytest

import zyx
import zyx.nn.functional as F
from zyx import tuning
from bench_conv import _convnet, _mnist_batch


def _setup():
    from zyx import nn
    zyx.manual_seed(0)
    model = _convnet(nn)
    opt = zyx.optim.Adam(model.parameters(), 1e-3)
    xn, yn = _mnist_batch()
    x, y = zyx.tensor(xn).realize(), zyx.tensor(yn).realize()
    return _item_step(model, opt, x, y)


def _item_step(model, opt, x, y):
    """One PyTorch-habit training step on batch (x, y): cross entropy, zero_grad,
    backward, step; returns the loss as a float."""
    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()
    return step


@pytest.fixture
def heuristics():
    zyx.autotune(False)
    yield
    zyx.autotune(False)


@pytest.mark.benchmark(group="mnist convnet step: heuristic vs tuned schedules")
def test_convnet_step_heuristic(benchmark, heuristics):
    step = _setup()
    for _ in range(3):
        step()
    benchmark.extra_info["device"] = str(zyx.get_default_device())
    benchmark(step)


@pytest.mark.benchmark(group="mnist convnet step: heuristic vs tuned schedules")
def test_convnet_step_tuned(benchmark, heuristics):
    dev = zyx._RT.device()
    if not hasattr(dev, "identity"):
        pytest.skip(f"{dev.info().name} is not tunable")
    path = tuning.ScheduleStore(dev.identity).path
    if os.path.exists(path):
        os.remove(path)
    step = _setup()
    zyx.autotune(budget=10)
    tuned0 = zyx.stats()["kernels_tuned"]
    t0 = time.perf_counter()
    step()
    tune_s = time.perf_counter() - t0
    searched = zyx.stats()["kernels_tuned"] - tuned0
    for _ in range(2):
        step()
    benchmark.extra_info.update(device=str(zyx.get_default_device()), tune_s=round(tune_s, 2),
                                kernels_searched=searched)
    print(f"\nzyx autotune: {searched} kernel(s) searched in the first step, {tune_s:.1f} s "
          f"(device {zyx.get_default_device()})")
    benchmark(step)
    assert np.isfinite(step())
