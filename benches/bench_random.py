"""Random numbers on the CPU (issue 31): zyx's device generator (zyx/random.py) next to
PyTorch's.

Run:  python -m pytest benches/bench_random.py --benchmark-only

- rand of 16M float32 realized (the generator's throughput; the plan is cached, and the
  call number is a value read at launch, so every round runs the same compiled kernel);
- an MLP forward with dropout after each hidden layer (the mask fuses into the kernel
  that reads it);
- building, not realizing, `F.dropout(zyx.rand(1024, 1024))`: the host cost of the
  generator's graph (about 100 nodes per call).
"""
import numpy as np
import pytest

import zyx
import zyx.nn as nn
import zyx.nn.functional as F
from conftest import need_torch

N16M = 1 << 24


def test_rand_16m_zyx(benchmark):
    benchmark.group = "rand 16M float32"
    zyx.manual_seed(0)
    u = zyx.rand(N16M).numpy()
    assert 0 <= u.min() and u.max() < 1 and abs(float(u.mean()) - 0.5) < 1e-3
    benchmark(lambda: zyx.rand(N16M).realize())


def test_rand_16m_torch(benchmark):
    benchmark.group = "rand 16M float32"
    torch = need_torch()
    benchmark(lambda: torch.rand(N16M))


class _MLP(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(512, 1024), nn.Linear(1024, 1024), \
            nn.Linear(1024, 10)
        self.p = p

    def forward(self, x):
        x = F.dropout(F.relu(self.l1(x)), self.p)
        x = F.dropout(F.relu(self.l2(x)), self.p)
        return self.l3(x)


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_mlp_dropout_forward_zyx(benchmark, p):
    benchmark.group = "MLP 512-1024-1024-10 forward, batch 256, dropout"
    zyx.manual_seed(0)
    model = _MLP(p)
    x = zyx.tensor(np.random.default_rng(0).standard_normal((256, 512), dtype=np.float32))
    x.realize()
    out = model(x).numpy()
    assert out.shape == (256, 10) and np.isfinite(out).all()
    benchmark(lambda: model(x).realize())


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_mlp_dropout_forward_torch(benchmark, p):
    benchmark.group = "MLP 512-1024-1024-10 forward, batch 256, dropout"
    torch = need_torch()
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Dropout(p), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Dropout(p),
                                torch.nn.Linear(1024, 10)).train()
    x = torch.randn(256, 512)
    with torch.no_grad():
        benchmark(lambda: model(x))


def test_build_dropout_step_zyx(benchmark):
    """Graph building only: rand(1024, 1024) and a dropout of it, nothing realized."""
    benchmark.group = "build rand(1024, 1024) + dropout (no realize)"
    x = zyx.rand(1024, 1024)
    assert x.shape == (1024, 1024)
    benchmark(lambda: (zyx.rand(1024, 1024), F.dropout(x, 0.1)))
