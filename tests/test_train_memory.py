"""Memory holds still over a long training loop: 2,000 steps keep the resident set within 5%
of its size after step 10, every intermediate buffer goes back to its pool, and the graph
does not grow. (The 784-128-10 version with printed figures is benches/bench_train_memory.py.)
"""
from zyx.examples.memory import run_steps

STEPS = 2000


def _small(n_steps, tape):
    # small enough that every kernel runs single-threaded: the test measures memory and
    # stays quick on a busy machine
    return run_steps(n_steps, d_in=8, hidden=8, batch=8, tape=tape)


def _check(tape):
    _small(10, tape)   # fill the library's small constant caches (iota tensors ...)
    r = _small(STEPS, tape)
    (rss10, pool10, nodes10), (rss_end, pool_end, nodes_end) = r["at10"], r["at_end"]
    before, after = r["pool_before"], r["pool_after"]
    assert pool_end == pool10, f"pool bytes grew from {pool10} to {pool_end}"
    assert nodes_end == nodes10, f"graph grew from {nodes10} to {nodes_end} nodes"
    assert rss_end <= rss10 * 1.05, f"RSS grew {rss10 / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB"
    assert after == before, f"pool bytes {after} after dropping the model, {before} before"


def test_torch_style_loop_memory_holds_still():
    _check(tape=False)


def test_tape_loop_memory_holds_still():
    _check(tape=True)
