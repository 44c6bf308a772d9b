"""Core engine benchmarks (issue 2), zyx next to numpy and PyTorch in one run.

Run:  python -m pytest benches/bench_core.py --benchmark-only
      python benches/report.py          # table of ratios for BENCHMARKS.md

Each benchmark stores its work (FLOPs or bytes) in extra_info so report.py can print
GFLOP/s and GB/s; groups put the peers side by side."""
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import zyx
from conftest import need_torch, torch

N_CHAIN = 4 * 1024 * 1024
N_SUM = 16 * 1024 * 1024


def chain_np(a, b):
    return np.exp(np.maximum(a * 1.5 + b, 0) * b - a)


def chain_zyx(a, b):
    return ((a * 1.5 + b).relu() * b - a).exp()


@pytest.fixture(scope="module")
def chain_data(rng):
    a = rng.random(N_CHAIN, dtype=np.float32)
    b = rng.random(N_CHAIN, dtype=np.float32)
    return a, b


@pytest.mark.benchmark(group="chain-4M")
def test_chain_zyx(benchmark, chain_data):
    a, b = chain_data
    xa, xb = zyx.Tensor(a), zyx.Tensor(b)
    np.testing.assert_allclose(chain_zyx(xa, xb).numpy(), chain_np(a, b), rtol=1e-5)
    benchmark.extra_info["bytes"] = 3 * 4 * N_CHAIN
    benchmark(lambda: chain_zyx(xa, xb).realize())


@pytest.mark.benchmark(group="chain-4M")
def test_chain_numpy(benchmark, chain_data):
    a, b = chain_data
    benchmark.extra_info["bytes"] = 3 * 4 * N_CHAIN
    benchmark(chain_np, a, b)


@pytest.mark.benchmark(group="chain-4M")
def test_chain_torch(benchmark, chain_data):
    t = need_torch()
    a, b = (t.from_numpy(x) for x in chain_data)
    benchmark.extra_info["bytes"] = 3 * 4 * N_CHAIN
    benchmark(lambda: t.exp(t.relu(a * 1.5 + b) * b - a))


# -- cat of a DDP bucket: the gradients of an MLP 784-1024-1024-10, scaled and flattened -----
GRAD_SHAPES = [(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]
N_GRADS = sum(int(np.prod(s)) for s in GRAD_SHAPES)


@pytest.fixture(scope="module")
def grad_parts(rng):
    return [rng.random(s, dtype=np.float32) for s in GRAD_SHAPES]


@pytest.mark.benchmark(group="cat-grads-1.86M")
def test_cat_grads_zyx(benchmark, grad_parts):
    """Each part scaled, flattened and concatenated (DistributedDataParallel's bucket):
    the C lowering copies each part's range in a loop of its own (codegen/cpu/rangesplit)."""
    ps = [zyx.Tensor(p).realize() for p in grad_parts]
    cat = lambda: zyx.cat([(p * 0.5).reshape(-1) for p in ps])      # noqa: E731
    np.testing.assert_array_equal(cat().numpy(),
                                  np.concatenate([p.reshape(-1) * 0.5 for p in grad_parts]))
    benchmark.extra_info["bytes"] = 2 * 4 * N_GRADS
    benchmark(lambda: cat().realize())


@pytest.mark.benchmark(group="cat-grads-1.86M")
def test_cat_grads_numpy(benchmark, grad_parts):
    benchmark.extra_info["bytes"] = 2 * 4 * N_GRADS
    benchmark(lambda: np.concatenate([p.reshape(-1) * 0.5 for p in grad_parts]))


@pytest.mark.benchmark(group="cat-grads-1.86M")
def test_cat_grads_torch(benchmark, grad_parts):
    t = need_torch()
    ps = [t.from_numpy(p) for p in grad_parts]
    benchmark.extra_info["bytes"] = 2 * 4 * N_GRADS
    benchmark(lambda: t.cat([(p * 0.5).reshape(-1) for p in ps]))


@pytest.fixture(scope="module")
def sum_data(rng):
    return rng.random(N_SUM, dtype=np.float32)


@pytest.mark.benchmark(group="sum-16M")
def test_sum_zyx(benchmark, sum_data):
    x = zyx.Tensor(sum_data)
    np.testing.assert_allclose(x.sum().item(), sum_data.astype(np.float64).sum(), rtol=1e-4)
    benchmark.extra_info["bytes"] = 4 * N_SUM
    benchmark(lambda: x.sum().realize())


@pytest.mark.benchmark(group="sum-16M")
def test_sum_numpy(benchmark, sum_data):
    benchmark.extra_info["bytes"] = 4 * N_SUM
    benchmark(sum_data.sum)


@pytest.mark.benchmark(group="sum-16M")
def test_sum_torch(benchmark, sum_data):
    t = need_torch()
    x = t.from_numpy(sum_data)
    benchmark.extra_info["bytes"] = 4 * N_SUM
    benchmark(x.sum)


SAME_WINDOW_BLOCK, SAME_WINDOW_ROUNDS = 10, 30


@pytest.mark.benchmark(group="sum-16M-same-window")
def test_sum_blocked_same_window(benchmark, sum_data):
    """The 16M sum as it is (blocks of SUM_BLOCK added into a float64 total: "zyx") and
    as it was (kernelizer.SUM_BLOCK = 0: one float32 accumulator per SIMD lane), in turn,
    SAME_WINDOW_BLOCK runs each per round: on a shared machine the two separate sum
    tests above get different seconds of it, these share them. Per-run medians go to
    extra_info["median_ms"]."""
    from zyx._core import kernelizer
    x = zyx.Tensor(sum_data)
    blocked = lambda: x.sum()
    one_block = lambda: x.reshape(1, N_SUM).sum()   # another plan, same kernel otherwise
    ref = sum_data.astype(np.float64).sum()
    np.testing.assert_allclose(blocked().item(), ref, rtol=1e-6)
    saved = kernelizer.SUM_BLOCK
    kernelizer.SUM_BLOCK = 0          # compiled (and its plan cached) without blocks
    try:
        np.testing.assert_allclose(one_block().item(), ref, rtol=1e-3)
    finally:
        kernelizer.SUM_BLOCK = saved
    runs = {"zyx": (blocked, []), "one_accumulator_per_lane": (one_block, [])}
    names = list(runs)
    for f, _ in runs.values():        # past the thread-choice measurements
        for _ in range(20):
            f().realize()
    rounds = iter(range(10 ** 9))

    def one_block_each():
        r = next(rounds) % 2
        for n in names[r:] + names[:r]:
            f, ts = runs[n]
            for _ in range(SAME_WINDOW_BLOCK):
                t0 = time.perf_counter()
                f().realize()
                ts.append(time.perf_counter() - t0)

    benchmark.extra_info["bytes"] = 4 * N_SUM
    benchmark.pedantic(one_block_each, rounds=SAME_WINDOW_ROUNDS, iterations=1)
    med = {n: float(np.median(ts)) * 1e3 for n, (_, ts) in runs.items()}
    benchmark.extra_info["median_ms"] = med
    print("\nsum-16M same window: " + ", ".join(f"{n} {m:.3f} ms" for n, m in med.items()))


@pytest.mark.benchmark(group="var-16M")
def test_var_zyx(benchmark, sum_data):
    """Two passes (mean, then mean square deviation), each summed in blocks."""
    x = zyx.Tensor(sum_data)
    # (a sanity check that also passes before blocked sums, for before/after timings;
    # tests/test_reduce_accuracy.py checks the accuracy)
    np.testing.assert_allclose(x.var().item(), sum_data.astype(np.float64).var(ddof=1),
                               rtol=1e-3)
    benchmark.extra_info["bytes"] = 2 * 4 * N_SUM
    benchmark(lambda: x.var().realize())


@pytest.mark.benchmark(group="var-16M")
def test_var_numpy(benchmark, sum_data):
    benchmark.extra_info["bytes"] = 2 * 4 * N_SUM
    benchmark(sum_data.var, ddof=1)


@pytest.mark.benchmark(group="var-16M")
def test_var_torch(benchmark, sum_data):
    t = need_torch()
    x = t.from_numpy(sum_data)
    benchmark.extra_info["bytes"] = 2 * 4 * N_SUM
    benchmark(x.var)


SUM0_SHAPE = (N_SUM // 16, 16)


@pytest.mark.benchmark(group="sum-axis0-1Mx16")
def test_sum_axis0_zyx(benchmark, sum_data):
    """Column sums: one accumulator per output lane ("lanes" layout), blocks of 1024 rows."""
    a = sum_data.reshape(SUM0_SHAPE)
    x = zyx.Tensor(a)
    np.testing.assert_allclose(x.sum(0).numpy(), a.astype(np.float64).sum(0), rtol=1e-3)
    benchmark.extra_info["bytes"] = 4 * N_SUM
    benchmark(lambda: x.sum(0).realize())


@pytest.mark.benchmark(group="sum-axis0-1Mx16")
def test_sum_axis0_numpy(benchmark, sum_data):
    a = sum_data.reshape(SUM0_SHAPE)
    benchmark.extra_info["bytes"] = 4 * N_SUM
    benchmark(a.sum, 0)


@pytest.mark.benchmark(group="sum-axis0-1Mx16")
def test_sum_axis0_torch(benchmark, sum_data):
    t = need_torch()
    x = t.from_numpy(sum_data.reshape(SUM0_SHAPE))
    benchmark.extra_info["bytes"] = 4 * N_SUM
    benchmark(x.sum, 0)


def softmax_np(x):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.fixture(scope="module")
def sm_data(rng):
    return rng.standard_normal((4096, 1024), dtype=np.float32)


@pytest.mark.benchmark(group="softmax-4096x1024")
def test_softmax_zyx(benchmark, sm_data):
    x = zyx.Tensor(sm_data)
    np.testing.assert_allclose(x.softmax(1).numpy(), softmax_np(sm_data), rtol=1e-5, atol=1e-7)
    benchmark.extra_info["bytes"] = 2 * sm_data.nbytes
    benchmark(lambda: x.softmax(1).realize())


@pytest.mark.benchmark(group="softmax-4096x1024")
def test_softmax_numpy(benchmark, sm_data):
    benchmark.extra_info["bytes"] = 2 * sm_data.nbytes
    benchmark(softmax_np, sm_data)


@pytest.mark.benchmark(group="softmax-4096x1024")
def test_softmax_torch(benchmark, sm_data):
    t = need_torch()
    x = t.from_numpy(sm_data)
    benchmark.extra_info["bytes"] = 2 * sm_data.nbytes
    benchmark(lambda: t.softmax(x, 1))


# stack of 64 (64, 256) float32 tensors, times 2 (a many-part cat: tensor.CAT_GROUP)
@pytest.fixture(scope="module")
def stack_parts(rng):
    return [rng.standard_normal((64, 256), dtype=np.float32) for _ in range(64)]


@pytest.mark.benchmark(group="stack-64x(64x256)")
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "flat"])
def test_stack_zyx(benchmark, stack_parts, grouped, monkeypatch):
    mod = sys.modules["zyx.tensor"]
    if not grouped:
        monkeypatch.setattr(mod, "CAT_GROUP_NUMEL", 1 << 62)
    parts = [zyx.Tensor(p).realize() for p in stack_parts]
    np.testing.assert_array_equal((zyx.stack(parts) * 2).numpy(), np.stack(stack_parts) * 2)
    benchmark(lambda: (zyx.stack(parts) * 2).realize())


@pytest.mark.benchmark(group="stack-64x(64x256)")
def test_stack_torch(benchmark, stack_parts):
    t = need_torch()
    parts = [t.from_numpy(p) for p in stack_parts]
    benchmark(lambda: t.stack(parts) * 2)


@pytest.mark.parametrize("n", [512, 1024])
def test_matmul_zyx(benchmark, rng, n):
    benchmark.group = f"matmul-{n}"
    a = rng.random((n, n), dtype=np.float32)
    b = rng.random((n, n), dtype=np.float32)
    xa, xb = zyx.Tensor(a), zyx.Tensor(b)
    np.testing.assert_allclose((xa @ xb).numpy(), a @ b, rtol=1e-4)
    benchmark.extra_info["flops"] = 2 * n ** 3
    # The first runs of a plan time the thread team against one thread (ThreadChoice).
    # Right after numpy's check above, OpenBLAS's threads still spin on both cores, so
    # the team's first runs are slow and one thread wins; the plan's first re-probe
    # (after 32 runs) takes the team back. 40 warm-up rounds time the settled plan, as a
    # loop calling it would see it (512: 2.4 ms before that probe, 1.2 ms after).
    benchmark.pedantic(lambda: (xa @ xb).realize(), rounds=10, iterations=1, warmup_rounds=40)


@pytest.mark.parametrize("n", [512, 1024])
def test_matmul_numpy(benchmark, rng, n):
    benchmark.group = f"matmul-{n}"
    a = rng.random((n, n), dtype=np.float32)
    benchmark.extra_info["flops"] = 2 * n ** 3
    benchmark(np.matmul, a, a)


@pytest.mark.parametrize("n", [512, 1024])
def test_matmul_torch(benchmark, rng, n):
    t = need_torch()
    benchmark.group = f"matmul-{n}"
    a = t.from_numpy(rng.random((n, n), dtype=np.float32))
    benchmark.extra_info["flops"] = 2 * n ** 3
    benchmark(t.matmul, a, a)


OPS_PER_GRAPH = 100


def _build_ops(x, y):
    """OPS_PER_GRAPH elementwise ops; the same code builds a zyx graph or runs torch eager."""
    z = x
    for _ in range(OPS_PER_GRAPH // 2):
        z = z * y + 1.0
    return z


@pytest.mark.benchmark(group="graph-build-100-ops")
def test_graph_build_zyx(benchmark):
    """Building 100 lazy ops (no realization): the per-op Python overhead."""
    x = zyx.Tensor(np.ones((8, 8), dtype=np.float32))
    y = zyx.Tensor(np.ones((8, 8), dtype=np.float32))
    benchmark.extra_info["ops"] = OPS_PER_GRAPH
    benchmark(_build_ops, x, y)


@pytest.mark.benchmark(group="graph-build-100-ops")
def test_graph_build_torch_eager(benchmark):
    t = need_torch()
    benchmark.extra_info["ops"] = OPS_PER_GRAPH
    benchmark(_build_ops, t.ones(8, 8), t.ones(8, 8))


@pytest.mark.benchmark(group="tiny-realize")
def test_tiny_realize_cached(benchmark):
    """(x + 1) on 3 elements, then read: graph build + cached plan + launch + copy out."""
    x = zyx.Tensor(np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal((x + 1).numpy(), [1, 2, 3])
    hits = zyx.stats()["plan_cache_hits"]
    benchmark(lambda: (x + 1).numpy())
    assert zyx.stats()["plan_cache_hits"] > hits


@pytest.mark.benchmark(group="tiny-realize")
def test_tiny_realize_cold(benchmark):
    """Same with the in-memory plan/program caches dropped each round (disk cache warm):
    kernelize + optimize + render + load the compiled library."""
    x = zyx.Tensor(np.arange(3, dtype=np.float32))
    rt = zyx._RT

    def cold():
        rt.plans.clear()
        for d in rt.devices:
            d._programs.clear()
        return (x + 1).numpy()
    benchmark(cold)


@pytest.mark.benchmark(group="tiny-realize")
def test_tiny_numpy(benchmark):
    x = np.arange(3, dtype=np.float32)
    benchmark(lambda: x + 1)


FIRST = ("import zyx; x = zyx.Tensor([1.0, 2.0, 3.0]); "
         "assert (x * 2 + 1).sum().item() == 15.0")


def _fresh_env(cache_dir):
    """A fresh interpreter as a pip-installed user has it: bytecode compiled once (pip does
    that at install; some CI images set PYTHONDONTWRITEBYTECODE and would recompile every
    module of zyx and numpy in every process)."""
    import compileall
    compileall.compile_dir(os.path.dirname(zyx.__file__), quiet=1)
    env = dict(os.environ, XDG_CACHE_HOME=cache_dir)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _first_result(cache_dir):
    env = _fresh_env(cache_dir)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", FIRST], check=True, env=env)
    return time.perf_counter() - t


@pytest.mark.benchmark(group="first-result-process")
def test_first_result_cold_cache(benchmark):
    """Fresh interpreter, empty disk cache: import + compiler probe + compile + run."""
    def run():
        with tempfile.TemporaryDirectory() as d:
            return _first_result(d)
    benchmark.pedantic(run, rounds=3, iterations=1)


@pytest.mark.benchmark(group="first-result-process")
def test_first_result_warm_cache(benchmark):
    with tempfile.TemporaryDirectory() as d:
        _first_result(d)
        benchmark.pedantic(lambda: _first_result(d), rounds=5, iterations=1)


@pytest.mark.benchmark(group="first-result-process")
def test_python_numpy_startup(benchmark):
    """Baseline: a fresh interpreter importing numpy only."""
    env = _fresh_env(tempfile.gettempdir())
    benchmark.pedantic(lambda: subprocess.run([sys.executable, "-c", "import numpy"], check=True,
                                              env=env), rounds=5, iterations=1)
