"""Where the host time of a cached tiny realization goes on a GPU device (issue 11's
launch-overhead figure): the raw driver launch of the same kernel, zyx's whole
realization, and a profile of the latter.

    python benches/gpu_launch_profile.py [device]        (default: cuda)
"""
import cProfile
import pstats
import sys
import time

import zyx


def per_call_us(fn, n=20000, sync=None):
    for _ in range(200):
        fn()
    if sync:
        sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if sync:
        sync()
    return (time.perf_counter() - t0) / n * 1e6


def main(name="cuda"):
    zyx.set_default_device(name)
    dev = zyx._RT.resolve(name)
    x = zyx.randn(4096).realize()
    (x + 1).realize()
    sync = lambda: zyx.synchronize(name)          # noqa: E731
    whole = per_call_us(lambda: (x + 1).realize(), sync=sync)
    print(f"{name}: cached tiny realization {whole:.1f} us per call (host, queued)")
    graph_only = per_call_us(lambda: x + 1)
    print(f"{name}: building the lazy (x + 1) alone {graph_only:.1f} us")
    plan = next(iter(zyx._RT.plans.values()))
    step = next(st for st in plan.steps if getattr(st, "program", None) is not None)
    out, _ = dev.pool.allocate(4096 * 4)
    src = zyx._RT.graph.get(x._id).buffer
    launch = per_call_us(lambda: dev.launch(step.program, dev.pool, [out, src]), sync=sync)
    print(f"{name}: device.launch of its kernel alone {launch:.1f} us")
    alloc = per_call_us(lambda: dev.pool.deallocate(dev.pool.allocate(4096 * 4)[0]))
    print(f"{name}: pool allocate + deallocate {alloc:.1f} us")
    dev.pool.deallocate(out)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5000):
        (x + 1).realize()
    prof.disable()
    sync()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main(*sys.argv[1:])
