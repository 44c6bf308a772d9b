"""Memory over a long training loop, at benchmark size: the 784-128-10 MLP of
bench_train.py (batch 64, cross-entropy, Adam) for 2,000 steps. Prints the resident set
(/proc/self/statm) after step 10 and at the end, the pool bytes and graph size, and the
step time. tests/test_train_memory.py asserts the same on a model small enough for the
test suite.

Run:  python benches/bench_train_memory.py [steps]
      python -m pytest benches/bench_train_memory.py --benchmark-only -s
"""
import os
import sys
import time

import numpy as np

import zyx
import zyx.nn.functional as F
from zyx import nn, optim

RT = zyx._RT


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(steps=2000, tape=False, d=784, h=128, batch=64):
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((8, batch, d)).astype(np.float32)
    ys = rng.integers(0, 10, (8, batch)).astype(np.int64)
    zyx.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, 10))
    params = list(model.parameters())
    opt = optim.Adam(params, lr=1e-3)
    marks, t10 = {}, None
    for i in range(1, steps + 1):
        x, y = zyx.Tensor(xs[i % 8]), zyx.Tensor(ys[i % 8])
        if tape:
            with zyx.Tape() as t:
                loss = F.cross_entropy(model(x), y)
            opt.update(params, t.gradient(loss, params), realize=[loss])
        else:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if i == 10 or i == steps:
            marks[i] = (rss_bytes(), RT.pool_bytes(), len(RT.graph))
            if i == 10:
                t10 = time.perf_counter()
    ms = (time.perf_counter() - t10) / max(steps - 10, 1) * 1e3
    (r0, p0, n0), (r1, p1, n1) = marks[10], marks[steps]
    return {"steps": steps, "rss_step10_mib": r0 / 2**20, "rss_end_mib": r1 / 2**20,
            "rss_growth_pct": 100 * (r1 - r0) / r0, "pool_step10": p0, "pool_end": p1,
            "graph_nodes_step10": n0, "graph_nodes_end": n1, "ms_per_step": ms}


def _report(tag, r):
    print(f"{tag}: {r['steps']} steps, RSS {r['rss_step10_mib']:.1f} MiB after step 10 -> "
          f"{r['rss_end_mib']:.1f} MiB ({r['rss_growth_pct']:+.2f}%), pool bytes "
          f"{r['pool_step10']} -> {r['pool_end']}, graph nodes {r['graph_nodes_step10']} -> "
          f"{r['graph_nodes_end']}, {r['ms_per_step']:.2f} ms/step")


def test_memory_2000_steps(benchmark):
    for tape in (False, True):
        r = benchmark.pedantic(measure, kwargs={"tape": tape}, rounds=1, iterations=1) \
            if not tape else measure(tape=True)
        benchmark.extra_info["tape" if tape else "torch_style"] = r
        _report("zyx " + ("tape" if tape else "torch-style"), r)
        assert r["pool_end"] == r["pool_step10"] and r["rss_growth_pct"] <= 5.0


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    _report("zyx torch-style", measure(n))
    _report("zyx tape", measure(n, tape=True))
