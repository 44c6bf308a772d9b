"""Variants of the GPU "group" strategy on row kernels (issue 11: softmax 16384x4096 at or
below PyTorch) measured side by side in one process, with PyTorch CUDA beside them.

    python3 benches/gpu_rows_sweep.py [variant ...]      (from the repository root)

Each variant is a ZYX_GPU_GROUP value (zyx/codegen/gpu/reduce.py `group_variant`: local size,
the row cache, warp-shuffle combines). For softmax, log_softmax and layer_norm of
16384x4096 float32 on the CUDA device it prints the median device time of the compiled
program (CUDA events on zyx's stream, 25 rounds of 10 launches), the realization's wall
time (host path included), and torch's event-timed time for the same op, with GB/s of
the bytes a row kernel must move (read once, write once). Results are checked against
numpy on a few rows. For trying without a GPU, ZYX_SWEEP_DEVICE=opencl runs it on the
OpenCL device (wall clock instead of events).
"""
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from gpu_elementwise_sweep import ROUNDS, REPS, cuda_event_timer, per_run  # noqa: E402

SHAPE = (16384, 4096)
VARIANTS = ["cache=0,warp=0", "cache=0", "warp=0", "", "local=512", "local=1024",
            "local=128"]
OPS = ("softmax", "log_softmax", "layer_norm")


def _zyx_op(zyx, name):
    if name == "layer_norm":
        return lambda x: zyx.nn.functional.layer_norm(x, (SHAPE[1],))
    return lambda x: getattr(x, name)(-1)


def _reference(a, name):
    a = a.astype(np.float64)
    if name == "layer_norm":
        mu = a.mean(-1, keepdims=True)
        return (a - mu) / np.sqrt(((a - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    m = a.max(-1, keepdims=True)
    lse = m + np.log(np.exp(a - m).sum(-1, keepdims=True))
    return np.exp(a - lse) if name == "softmax" else a - lse


def _torch_times():
    try:
        import torch
        if not torch.cuda.is_available():
            return {}
    except ImportError:
        return {}
    x = torch.randn(*SHAPE, device="cuda")
    fns = {"softmax": lambda: torch.softmax(x, -1),
           "log_softmax": lambda: torch.log_softmax(x, -1),
           "layer_norm": lambda: torch.nn.functional.layer_norm(x, (SHAPE[1],))}
    out = {}
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for name, fn in fns.items():
        for _ in range(REPS):
            fn()
        times = []
        for _ in range(ROUNDS):
            s.record()
            for _ in range(REPS):
                fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3 / REPS)
        out[name] = statistics.median(times)
    x = fns = None      # (frees the input before empty_cache)
    torch.cuda.empty_cache()
    return out


def main(variants):
    import zyx
    t0 = time.perf_counter()
    name = os.environ.get("ZYX_SWEEP_DEVICE", "cuda")
    torch_s = _torch_times()
    zyx.set_default_device(name)
    dev = zyx._RT.resolve(name)
    timer = (cuda_event_timer(dev.driver.stream) if dev.backend == "cuda"
             else lambda step: per_run(step, lambda: zyx.synchronize(name)))
    x = zyx.randn(*SHAPE).realize()
    rows = [0, 1, SHAPE[0] // 2, SHAPE[0] - 1]
    a = x.numpy()[rows]
    nbytes = 8 * SHAPE[0] * SHAPE[1]
    print(f"GPU row kernels {SHAPE[0]}x{SHAPE[1]} f32 on {name}: device time per call "
          f"(us) and GB/s of one read + one write\n")
    head = f"{'variant':18} {'op':12} {'used':34} {'kernel us':>9} {'GB/s':>6} " \
           f"{'realize us':>10} {'torch us':>8} {'vs torch':>8} {'err':>8}"
    print(head)
    print("-" * len(head), flush=True)
    for v in variants:
        os.environ["ZYX_GPU_GROUP"] = v
        for op in OPS:
            fn = _zyx_op(zyx, op)
            zyx._RT.plans.clear()
            dev._programs.clear()      # programs are kept per kernel: lower it afresh
            got = fn(x).numpy()[rows]
            err = float(np.max(np.abs(got - _reference(a, op))))
            plan = next(iter(zyx._RT.plans.values()))
            progs = [st.program for st in plan.steps if getattr(st, "program", None)]
            realize = per_run(lambda: fn(x).realize(), lambda: zyx.synchronize(name))
            kernel, used = None, "?"
            if len(progs) == 1:
                prog = progs[0]
                u = prog.gpu.variant or {}
                used = (f"{prog.gpu.strategy} local={u.get('local')} cached="
                        f"{u.get('cached_loads')} warp={u.get('warp')}")
                out, _ = dev.pool.allocate(4 * SHAPE[0] * SHAPE[1])
                args = [out, zyx._RT.graph.get(x._id).buffer]
                if len(prog.kernel.args) == 2:
                    kernel = timer(lambda: dev.launch(prog, dev.pool, args))
                dev.pool.deallocate(out)
            else:
                used = f"{len(progs)} kernels"
            t = torch_s.get(op)
            ks = f"{kernel * 1e6:9.1f}" if kernel else "        -"
            gb = f"{nbytes / kernel / 1e9:6.0f}" if kernel else "     -"
            ts = f"{t * 1e6:8.1f}" if t else "       -"
            ratio = f"{kernel / t:7.2f}x" if kernel and t else "       -"
            print(f"{v or '(default)':18} {op:12} {used:34} {ks} {gb} {realize * 1e6:10.1f} "
                  f"{ts} {ratio} {err:8.1e}", flush=True)
    print(f"\nsweep took {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or VARIANTS)
