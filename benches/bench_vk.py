"""The Vulkan / WebGPU issue's cases on one zyx device, PyTorch CUDA beside it when present:

    python benches/bench_vk.py vulkan:0 [case ...]      (BENCH_SCALE=k: sizes / k)

Cases: copy (x + 0 over 64M float32: the bandwidth the others are held against),
ew (an elementwise chain over 64M float32), sum (256M float32), softmax (16384 x 4096),
mm32 / mm16 (4096^2 matmul, float32 / float16), cold (a fresh process: import zyx to the
first result of a small computation on the device, with an empty cache directory and
again with the one it filled). Each case times REPS runs queued
back to back, then a device synchronize; the median of ROUNDS rounds is printed per run,
as a markdown table (ms, GB/s or TFLOP/s, and the ratio to torch). The MLP and convnet
Adam steps are in benches/bench_gpu.py, which runs on every GPU device zyx lists
(vulkan:N included). BENCH_TORCH=0 leaves PyTorch out (the knob sweep,
gpu_vk_bandwidth_sweep.py, times it once, not per variant).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import zyx

REPS = 10
ROUNDS = 7


def median_per_step(step, sync, warmups=1, rounds=ROUNDS, reps=REPS):
    """Median seconds per step() over `rounds` rounds of `reps` calls queued back to back
    and one sync() each, after `warmups` calls and a sync (compilation, pipelines and
    allocations outside the timing)."""
    for _ in range(warmups):
        step()
    sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        sync()
        times.append((time.perf_counter() - t0) / reps)
    return float(np.median(times))


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def cases(dev, scale=1):
    """name -> factory of (step, bytes, flops, torch fn, shape, dtype name); `scale`
    divides the sizes (a quick run on a CPU driver)."""
    n_ew, n_sum, mm = (64 << 20) // scale, (256 << 20) // scale, max(4096 // scale, 64)
    sm = (max(16384 // scale, 1), 4096)
    rng = np.random.default_rng(0)

    def vec(n, fn=rng.standard_normal):
        return zyx.tensor(fn(n, dtype=np.float32), device=dev)

    def copy():
        x = vec(n_ew)
        return lambda: (x + 0).realize(), 8 * n_ew, 0, lambda a: a + 0, (n_ew,), "float32"

    def ew():
        x = vec(n_ew)
        return (lambda: ((x * 2 + 1).exp() * 0.5 - x).realize(), 8 * n_ew, 0,
                lambda a: (a * 2 + 1).exp() * 0.5 - a, (n_ew,), "float32")

    def total():
        s = vec(n_sum, rng.random)
        return lambda: s.sum().realize(), 4 * n_sum, 0, lambda a: a.sum(), (n_sum,), "float32"

    def softmax():
        r = zyx.tensor(rng.standard_normal(sm, dtype=np.float32), device=dev)
        return (lambda: r.softmax(-1).realize(), 8 * sm[0] * sm[1], 0,
                lambda a: a.softmax(-1), sm, "float32")

    def matmul(dtype):
        def make():
            a = zyx.tensor(rng.standard_normal((mm, mm), dtype=np.float32),
                           device=dev).cast(dtype).realize()
            return (lambda: (a @ a).realize(), 0, 2 * mm ** 3, lambda t: t @ t, (mm, mm),
                    dtype.name)
        return make
    return {"copy": copy, "ew": ew, "sum": total, "softmax": softmax,
            "mm32": matmul(zyx.float32), "mm16": matmul(zyx.float16)}


def cold(dev):
    """Seconds from a fresh interpreter's start to a checked first result on `dev`, with
    an empty cache directory and then again with the one the first run filled (compiled
    programs, the Vulkan pipeline cache): (empty, warm)."""
    code = ("import time; t0 = time.perf_counter(); import numpy as np, zyx\n"
            f"x = zyx.tensor(np.arange(1 << 20, dtype=np.float32), device='{dev}')\n"
            "v = float((x * 2 + 1).sum().item()); assert v > 0\n"
            "print(time.perf_counter() - t0)")
    out = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, XDG_CACHE_HOME=cache)
        for _ in range(2):
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env=env)
            out.append(float(r.stdout.split()[-1]) if r.returncode == 0 else float("nan"))
    return tuple(out)


def main(argv):
    dev = argv[0] if argv else "vulkan:0"
    wanted = argv[1:]
    scale = int(os.environ.get("BENCH_SCALE", "1"))
    torch = _torch() if os.environ.get("BENCH_TORCH", "1") != "0" else None
    sync = lambda: zyx.synchronize(dev)      # noqa: E731
    print(f"| case ({dev}) | zyx ms | zyx GB/s or TFLOP/s | torch ms | zyx / torch time |")
    print("|---|---|---|---|---|")
    for name, make in cases(dev, scale).items():
        if wanted and name not in wanted:
            continue
        step, nbytes, flops, tfn, shape, dtn = make()
        t = median_per_step(step, sync)
        rate = f"{nbytes / t / 1e9:.0f} GB/s" if nbytes else f"{flops / t / 1e12:.1f} TFLOP/s"
        tt = ""
        ratio = ""
        if torch is not None:
            ta = torch.randn(*shape, device="cuda", dtype=getattr(torch, dtn))
            tt_s = median_per_step(lambda: tfn(ta), torch.cuda.synchronize)
            tt, ratio = f"{tt_s * 1e3:.3f}", f"{t / tt_s:.2f}"
        print(f"| {name} | {t * 1e3:.3f} | {rate} | {tt} | {ratio} |", flush=True)
    if not wanted or "cold" in wanted:
        empty, warm = cold(dev)
        print(f"| cold start, empty cache (import to first result) | {empty * 1e3:.0f} | | | |")
        print(f"| cold start, warm cache | {warm * 1e3:.0f} | | | |")


if __name__ == "__main__":
    main(sys.argv[1:])
