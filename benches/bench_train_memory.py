"""Memory over a long training loop, at benchmark size: the 784-128-10 MLP of
bench_train.py (batch 64, cross-entropy, Adam) for 2,000 steps (zyx.examples.memory).
Prints the resident set after step 10 and at the end, the pool bytes and graph size, and the
step time. tests/test_train_memory.py asserts the same on a model small enough for the
test suite.

Run:  python -m zyx.examples.memory [steps]
      python -m pytest benches/bench_train_memory.py --benchmark-only -s
"""
from zyx.examples.memory import report, run_steps


def test_memory_2000_steps(benchmark):
    for tape in (False, True):
        r = benchmark.pedantic(run_steps, args=(2000,), kwargs={"tape": tape}, rounds=1,
                               iterations=1) if not tape else run_steps(2000, tape=True)
        (r0, p0, _), (r1, p1, _) = r["at10"], r["at_end"]
        benchmark.extra_info["tape" if tape else "torch_style"] = report("", r)
        print(report("zyx " + ("tape" if tape else "torch-style"), r))
        assert p1 == p0 and r1 <= r0 * 1.05
