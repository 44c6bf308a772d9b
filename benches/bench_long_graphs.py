"""Long graphs (issue 10): building and realizing one long lazy graph, compilation included.

- chain: `x = x + c` n times (n ops) and `t = t * a + c` n/2 times (n ops), n = 10k, 30k,
  100k: time should grow linearly with n (kernels are cut every CHAIN_LIMIT inlined nodes);
- centering: `x = x - x.mean()` n times on 1000 floats, n = 200, 400, 2000 (each step is
  stored once; re-inlining made it n^2 code: 13 s for 200 before).

Every round uses constants no earlier round used, so its kernels are new (the disk cache
cannot serve them): the time includes kernelization and the C compiler.

Run:  python -m pytest benches/bench_long_graphs.py --benchmark-only
"""
import itertools

import numpy as np
import pytest

import zyx

_fresh = itertools.count(1)


def _constant():
    """A constant unlike every earlier one: new kernel source, nothing cached."""
    return 1e-3 * (1 + next(_fresh) * 1e-6)


def _add_chain(n):
    x = zyx.ones(8)
    c = _constant()
    for _ in range(n):
        x = x + c
    return x.numpy()


def _affine_chain(n):
    t = zyx.ones(8)
    c = _constant()
    for _ in range(n // 2):
        t = t * 1.0001 + c
    return t.numpy()


def _centering(n, data):
    x = zyx.Tensor(data) * (1 + _constant())
    for _ in range(n):
        x = x - x.mean()
    return x.numpy()


@pytest.mark.benchmark(group="long-chain")
@pytest.mark.parametrize("kind", ["add", "affine"])
@pytest.mark.parametrize("n", [10_000, 30_000, 100_000])
def test_chain(benchmark, kind, n):
    fn = _add_chain if kind == "add" else _affine_chain
    out = benchmark.pedantic(fn, args=(n,), rounds=3, iterations=1)
    assert np.isfinite(out).all()
    benchmark.extra_info["ops"] = n


@pytest.mark.benchmark(group="centering")
@pytest.mark.parametrize("n", [200, 400, 2000])
def test_centering(benchmark, n):
    data = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    out = benchmark.pedantic(_centering, args=(n, data), rounds=3, iterations=1)
    assert abs(float(out.mean())) < 1e-5
