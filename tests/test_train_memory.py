"""Memory holds still over a long training loop: 2,000 steps keep the resident set within 5%
of its size after step 10, every intermediate buffer goes back to its pool, and the graph
does not grow. (The 784-128-10 version with printed figures is benches/bench_train_memory.py.)
"""
import os

import numpy as np

import zyx
import zyx.nn.functional as F
from zyx import nn, optim

STEPS = 2000
RT = zyx._RT


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_steps(n_steps, d_in=8, hidden=8, batch=8, tape=False):
    """Train a small MLP for `n_steps`; returns the (rss, pool bytes, graph nodes) after
    step 10 and at the end, plus the pool bytes before the model existed and after it was
    dropped. (Small enough that every kernel runs single-threaded: the test measures
    memory, and stays quick on a busy machine.)"""
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((8, batch, d_in)).astype(np.float32)
    ys = rng.integers(0, 10, (8, batch)).astype(np.int64)
    before = RT.pool_bytes()
    zyx.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    params = list(model.parameters())
    opt = optim.Adam(params, lr=1e-3)
    marks = {}
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
    del model, opt, params
    return marks[10], marks[n_steps], before, RT.pool_bytes()


def _check(tape):
    run_steps(10, tape=tape)   # fill the library's small constant caches (iota tensors ...)
    at10, at_end, before, after = run_steps(STEPS, tape=tape)
    (rss10, pool10, nodes10), (rss_end, pool_end, nodes_end) = at10, at_end
    assert pool_end == pool10, f"pool bytes grew from {pool10} to {pool_end}"
    assert nodes_end == nodes10, f"graph grew from {nodes10} to {nodes_end} nodes"
    assert rss_end <= rss10 * 1.05, f"RSS grew {rss10 / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB"
    assert after == before, f"pool bytes {after} after dropping the model, {before} before"


def test_torch_style_loop_memory_holds_still():
    _check(tape=False)


def test_tape_loop_memory_holds_still():
    _check(tape=True)
