"""Host time of a cached plan of 50 small kernels (issue 31: "a plan of 50 kernels costs
under 100 us of host time"): 50 realized outputs of a tiny elementwise op, each on its own
input, so the kernelizer cannot merge them (zyx.stats() confirms 50 launches per run).

    python benches/gpu_plan_launch.py [device] [runs]      (default: cuda, 2000 runs)

Each run builds the lazy outputs first, synchronizes the device, then times
`zyx.realize(*outputs)` (plan lookup and execution: host time, the kernels queued) and,
inside it, `scheduler.execute` (the plan's launches with their buffers). The device is
synchronized again after the timed region. Prints the medians and the per-kernel figure,
and the calling thread's CPU time in realize (time.thread_time: on a loaded machine, or
with a CPU OpenCL device whose threads run the kernels on the same cores, wall time
counts the waits for a core too).
A/B the launch paths with the environment: ZYX_CUDA_GRAPHS=0 (CUDA: plain launches of
the plan's packed parameters instead of a CUDA graph replay) and ZYX_PLAN_LAUNCHES=0
(every device: the per-kernel launch path of before)."""
import statistics
import sys
import time

import numpy as np

import zyx
from zyx._core import scheduler

KERNELS = 50
SIZE = 1024


def main(name="cuda", runs=2000):
    runs = int(runs)
    zyx.set_default_device(name)
    rng = np.random.default_rng(0)
    xs = [zyx.tensor(rng.standard_normal(SIZE, dtype=np.float32)).realize()
          for _ in range(KERNELS)]
    execute = scheduler.execute
    inner = []

    def timed_execute(*args, **kwargs):
        t0 = time.perf_counter()
        execute(*args, **kwargs)
        inner.append(time.perf_counter() - t0)

    scheduler.execute = timed_execute
    try:
        outs = [x * 2 + 1 for x in xs]
        zyx.realize(*outs)
        want = np.stack([x.numpy() * 2 + 1 for x in xs])
        np.testing.assert_allclose(np.stack([o.numpy() for o in outs]), want, rtol=1e-6)
        before = zyx.stats()["kernels_launched"]
        whole, cpu = [], []
        inner.clear()
        for _ in range(runs):
            outs = None                   # last run's outputs go back to the pool
            outs = [x * 2 + 1 for x in xs]
            zyx.synchronize(name)
            c0 = time.thread_time()
            t0 = time.perf_counter()
            zyx.realize(*outs)
            whole.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        zyx.synchronize(name)
        launched = (zyx.stats()["kernels_launched"] - before) / runs
        np.testing.assert_allclose(np.stack([o.numpy() for o in outs]), want, rtol=1e-6)
    finally:
        scheduler.execute = execute
    w = statistics.median(whole) * 1e6
    e = statistics.median(inner) * 1e6
    c = statistics.median(cpu) * 1e6
    print(f"{name}: plan of {launched:.0f} kernels, median of {runs} runs (host time)")
    print(f"  zyx.realize       {w:8.1f} us   {w / launched:6.2f} us per kernel")
    print(f"  scheduler.execute {e:8.1f} us   {e / launched:6.2f} us per kernel")
    print(f"  realize, thread CPU time {c:8.1f} us")


if __name__ == "__main__":
    main(*sys.argv[1:])
