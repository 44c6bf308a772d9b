"""Memory over a long training loop: an MLP trained with Adam, torch-style
(`backward()` + `step()`) or through `zyx.Tape`, recording the resident set, pool bytes and
graph size after step 10 and at the end. Used by tests/test_train_memory.py (small model)
and benches/bench_train_memory.py (the 784-128-10 benchmark model).

Run:  python -m zyx.examples.memory [steps]
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import zyx
import zyx.nn.functional as F
from zyx import nn, optim
from zyx.runtime import RT


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_steps(n_steps, d_in=784, hidden=128, batch=64, tape=False):
    """Train for `n_steps`. Returns a dict: (rss, pool bytes, graph nodes) after step 10 and
    at the end, pool bytes before the model existed and after it was dropped, ms per step
    after step 10."""
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((8, batch, d_in)).astype(np.float32)
    ys = rng.integers(0, 10, (8, batch)).astype(np.int64)
    before = RT.pool_bytes()
    zyx.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    params = list(model.parameters())
    opt = optim.Adam(params, lr=1e-3)
    marks, t10 = {}, time.perf_counter()
    for i in range(1, n_steps + 1):
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
        del x, y, loss
        if i == 10 or i == n_steps:
            marks[i] = (rss_bytes(), RT.pool_bytes(), len(RT.graph))
            if i == 10:
                t10 = time.perf_counter()
    ms = (time.perf_counter() - t10) / max(n_steps - 10, 1) * 1e3
    del model, opt, params
    return {"steps": n_steps, "at10": marks[10], "at_end": marks[n_steps],
            "pool_before": before, "pool_after": RT.pool_bytes(), "ms_per_step": ms}


def report(tag, r) -> str:
    (r0, p0, n0), (r1, p1, n1) = r["at10"], r["at_end"]
    return (f"{tag}: {r['steps']} steps, RSS {r0 / 2**20:.1f} MiB after step 10 -> "
            f"{r1 / 2**20:.1f} MiB ({100 * (r1 - r0) / r0:+.2f}%), pool bytes {p0} -> {p1}, "
            f"graph nodes {n0} -> {n1}, {r['ms_per_step']:.2f} ms/step")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    n = int(argv[0]) if argv else 2000
    print(report("zyx torch-style", run_steps(n)))
    print(report("zyx tape", run_steps(n, tape=True)))


if __name__ == "__main__":
    main()
