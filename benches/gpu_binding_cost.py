"""Time per dispatch of a tiny elementwise kernel (16 float32 elements) by its number of
input buffers and outputs, on one device: does a launch cost more with more bindings?

    python benches/gpu_binding_cost.py [device]        (default: wgpu:0)

Each kernel is realized REPS times back to back (a cached plan of one kernel), then the
device is synchronized; the median of ROUNDS rounds per realization is printed.

(On the H200, 2026-11-29: from 1 to 12 inputs a realization went from 91 to 106 us on
wgpu:0 and from 82 to 111 us on vulkan:0, and 1 to 3 outputs cost the same on both: the
bindings do not explain why the MLP Adam step is slower on WebGPU than on Vulkan.)"""
import os
import sys

import numpy as np

import zyx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_vk import median_per_step  # noqa: E402

REPS, ROUNDS = 50, 7


def timed(fn, dev):
    return median_per_step(fn, lambda: zyx.synchronize(dev), warmups=5, rounds=ROUNDS,
                           reps=REPS)


def main(dev):
    zyx.set_default_device(dev)
    rng = np.random.default_rng(0)
    xs = [zyx.tensor(rng.random(16, dtype=np.float32)) for _ in range(12)]
    for n in (1, 2, 4, 6, 8, 10, 12):
        def one(n=n):
            acc = xs[0]
            for x in xs[1:n]:
                acc = acc + x
            (acc * 1.5).realize()
        print(f"{dev}: {n:2d} inputs, 1 output: {timed(one, dev) * 1e6:7.1f} us per realization")
    for k in (1, 2, 3):
        def outs(k=k):
            zyx.realize(*[xs[0] * (j + 2) + xs[1] for j in range(k)])
        print(f"{dev}:  2 inputs, {k} outputs: {timed(outs, dev) * 1e6:7.1f} us per realization "
              f"({zyx._RT.stats['kernels_launched']} kernels launched so far)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "wgpu:0")
