"""Host time of a cached plan of 50 small kernels (issue 31: "a plan of 50 kernels costs
under 100 us of host time"), two plans:

- outputs: 50 realized outputs of a tiny elementwise op, each on its own input, so the
  kernelizer cannot merge them: 50 kernels, 50 targets allocated per run;
- chain: y = tanh(y @ w) 50 times on 32x32 matrices: 50 kernels (a product each, its
  tanh fused), temporaries in one arena, 1 target.

zyx.stats() confirms the launches per run.

    python benches/gpu_plan_launch.py [device] [runs]      (default: cuda, 2000 runs)

Each run builds the lazy outputs first, synchronizes the device, then times
`zyx.realize(...)` (graph collection, plan lookup and execution: host time, the kernels
queued) and, inside it, `scheduler.execute` (the plan's launches with their buffers). The
device is synchronized again after the timed region. Prints the medians and the
per-kernel figure, and the calling thread's CPU time in realize (time.thread_time: on a
loaded machine, or with a CPU OpenCL device whose threads run the kernels on the same
cores, wall time counts the waits for a core too). A/B the launch paths with the
environment: ZYX_CUDA_GRAPHS=0 (CUDA: plain launches of the plan's packed parameters
instead of a CUDA graph replay) and ZYX_PLAN_LAUNCHES=0 (every device: the kernel-by-kernel
launch path of before)."""
import statistics
import sys
import time

import numpy as np

import zyx
from zyx._core import scheduler

KERNELS = 50


def outputs_workload(rng):
    """(make, check): 50 outputs x * 2 + 1 of 50 inputs."""
    xs = [zyx.tensor(rng.standard_normal(1024, dtype=np.float32)).realize()
          for _ in range(KERNELS)]
    want = np.stack([x.numpy() * 2 + 1 for x in xs])
    return (lambda: [x * 2 + 1 for x in xs],
            lambda outs: np.testing.assert_allclose(np.stack([o.numpy() for o in outs]),
                                                    want, rtol=1e-6))


def chain_workload(rng):
    """(make, check): y = tanh(y @ w), 50 times."""
    x = rng.standard_normal((32, 32), dtype=np.float32)
    w = rng.standard_normal((32, 32), dtype=np.float32) * 0.2
    X, W = zyx.tensor(x).realize(), zyx.tensor(w).realize()
    want = x.astype(np.float64)
    for _ in range(KERNELS):
        want = np.tanh(want @ w)

    def make():
        y = X
        for _ in range(KERNELS):
            y = (y @ W).tanh()
        return [y]
    return make, lambda outs: np.testing.assert_allclose(outs[0].numpy(), want, rtol=1e-3,
                                                         atol=1e-4)


def measure(name, make, check, runs):
    execute = scheduler.execute
    inner = []

    def timed_execute(*args, **kwargs):
        t0 = time.perf_counter()
        execute(*args, **kwargs)
        inner.append(time.perf_counter() - t0)

    scheduler.execute = timed_execute
    try:
        outs = make()
        zyx.realize(*outs)
        check(outs)
        before = zyx.stats()["kernels_launched"]
        whole, cpu = [], []
        inner.clear()
        for _ in range(runs):
            outs = None                   # last run's outputs go back to the pool
            outs = make()
            zyx.synchronize(name)
            c0 = time.thread_time()
            t0 = time.perf_counter()
            zyx.realize(*outs)
            whole.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        zyx.synchronize(name)
        launched = (zyx.stats()["kernels_launched"] - before) / runs
        check(outs)
    finally:
        scheduler.execute = execute
    return launched, [statistics.median(t) * 1e6 for t in (whole, inner, cpu)]


def main(name="cuda", runs=2000):
    runs = int(runs)
    zyx.set_default_device(name)
    rng = np.random.default_rng(0)
    for label, workload in (("outputs", outputs_workload), ("chain", chain_workload)):
        launched, (w, e, c) = measure(name, *workload(rng), runs)
        print(f"{name} {label}: plan of {launched:.0f} kernels, median of {runs} runs "
              f"(host time)")
        print(f"  zyx.realize       {w:8.1f} us   {w / launched:6.2f} us per kernel")
        print(f"  scheduler.execute {e:8.1f} us   {e / launched:6.2f} us per kernel")
        print(f"  realize, thread CPU time {c:8.1f} us")


if __name__ == "__main__":
    main(*sys.argv[1:])
