"""A training loop whose inputs change every step, for the plan-level launch paths
(scheduler.prepare_launches: a device's launch record of a whole plan; CUDA graph replay):
test_opencl.py and test_wgpu.py run it with plan launches on and off, test_cuda.py (on an
NVIDIA GPU) with CUDA graphs on and off, and each compares the results."""
from __future__ import annotations

import numpy as np

import zyx
import zyx.nn.functional as F
from zyx import nn, optim


def train(steps=15, seed=0, labels=np.int64):
    """(losses, final weights) of a small MLP trained with Adam for `steps` steps on a
    new random batch each step (the same batches and initial weights for every call);
    the labels (of dtype `labels`: WebGPU has no int64) follow from the inputs (the
    largest of their first four values), so the loss falls as it learns."""
    zyx.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        xs = rng.standard_normal((8, 16), dtype=np.float32)
        x = zyx.tensor(xs)
        y = zyx.tensor(xs[:, :4].argmax(1).astype(labels))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses), [p.numpy() for p in model.parameters()]


def launchers():
    """The launch records of the runtime's cached plans (those that have one)."""
    return [p.launcher for p in zyx._RT.plans.values() if p.launcher is not None]


def train_fresh(**kwargs):
    """train() with every cached plan dropped first, so that each plan is prepared under
    the device's current settings."""
    zyx._RT._drop_plans()
    return train(**kwargs)


def assert_same(a, b):
    """Two train() results are identical (the same kernels ran, only launched another
    way), bit for bit."""
    np.testing.assert_array_equal(a[0], b[0])
    assert len(a[1]) == len(b[1])
    for x, y in zip(a[1], b[1]):
        np.testing.assert_array_equal(x, y)
