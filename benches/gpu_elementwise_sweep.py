"""Variants of the GPU "elementwise" strategy (issue 11: the 64M float32 chain must reach
90% of the device-to-device copy bandwidth) measured side by side on one machine.

    python3 benches/gpu_elementwise_sweep.py [variant ...]      (from the repository root)

Each variant (a ZYX_GPU_EW value, see zyx/codegen/gpu/elementwise.py `elementwise_variant`) runs in
a process of its own, so every kernel is lowered afresh (programs are cached by source).
In that process, on the CUDA device and every OpenCL GPU zyx finds, for bench_gpu.py's
`_chain` and `_arith_chain` on 64M float32, it measures (medians of 25 rounds after a
warm-up, each round 10 runs then a device synchronize):

- realize: `_chain(x).realize()` as bench_gpu.py times it (host path included);
- kernel: the same compiled program launched directly (CUDA: timed by events on zyx's
  stream, so device time only; OpenCL: wall clock);
- copy: `torch.Tensor.copy_` of 64M float32 in the same process (wall clock as
  "realize", and by CUDA events as "kernel" is), the 100% of the "% copy" columns.

Bytes are read + written (8 per element). Last, processes time a cached tiny realization
(4096 float32, `(x + 1).realize()`: issue 11's launch-overhead figure) as bench_gpu.py
does, with CUDA launches through ctypes (the default) and through cuda-bindings
(ZYX_CUDA_LAUNCH=bindings), twice each in turn. The whole sweep takes about a minute and a half on an H100.

For trying the script without a GPU: ZYX_SWEEP_CPU=1 includes OpenCL CPU devices (PoCL)
and ZYX_SWEEP_N sets the element count.
"""
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

# baseline (one element per work-item, scalar), then the levers one at a time and combined
VARIANTS = [
    "items=1,vec=1",
    "items=4,vec=1",
    "items=1,vec=4",
    "items=2,vec=4",
    "items=4,vec=4",
    "items=8,vec=4",
    "items=2,vec=8",
    "items=4,vec=4,local=128",
    "items=4,vec=4,local=512",
    "items=2,vec=4,local=1024",
    "items=4,vec=4,waves=4",
    "items=1,vec=4,waves=8",
]
ROUNDS, REPS = 25, 10
CHILD_TIMEOUT = 90


def per_run(step, sync, rounds=ROUNDS, reps=REPS):
    """Median seconds per call of step() over `rounds` rounds of `reps` calls + sync."""
    for _ in range(2):
        for _ in range(reps):
            step()
        sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        sync()
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def cuda_event_timer(stream):
    """f(step) -> median seconds per call of step(), timed by CUDA events on `stream`."""
    from zyx.backends.cuda import import_bindings
    drv = import_bindings()[0]

    def ok(res):
        if int(res[0]) != 0:
            raise RuntimeError(f"CUDA event call failed: {res[0]}")
        return res[1] if len(res) > 1 else None
    start, end = ok(drv.cuEventCreate(0)), ok(drv.cuEventCreate(0))

    def timed(step):
        for _ in range(REPS):
            step()
        times = []
        for _ in range(ROUNDS):
            ok(drv.cuEventRecord(start, stream))
            for _ in range(REPS):
                step()
            ok(drv.cuEventRecord(end, stream))
            ok(drv.cuEventSynchronize(end))
            times.append(ok(drv.cuEventElapsedTime(start, end)) / 1e3 / REPS)
        return statistics.median(times)
    return timed


def torch_copy(n):
    """(wall-clock, event-timed) seconds per torch copy of n float32, or (None, None)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None, None
    except ImportError:
        return None, None
    a = torch.randn(n, device="cuda")
    b = torch.empty_like(a)
    wall = per_run(lambda: b.copy_(a), torch.cuda.synchronize)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(ROUNDS):
        s.record()
        for _ in range(REPS):
            b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / REPS)
    del a, b
    torch.cuda.empty_cache()
    return wall, statistics.median(times)


def gpu_devices(zyx):
    out = []
    for d in zyx.devices():
        if d.type == "cuda" or (d.type == "opencl" and (
                os.environ.get("ZYX_SWEEP_CPU") or not zyx._RT.resolve(d).info().extra.get("cpu"))):
            out.append(str(d))
    return out


def child(variant):
    """Measure one variant on every GPU; print one RESULT json line per measurement."""
    import numpy as np
    import zyx
    from bench_gpu import N_EW, _arith_chain, _chain
    n = int(os.environ.get("ZYX_SWEEP_N", N_EW))
    copy_wall, copy_ev = torch_copy(n)
    workloads = {"chain": _chain, "arith": lambda x: _arith_chain(x, zyx.maximum)}
    for name in gpu_devices(zyx):
        zyx.set_default_device(name)
        dev = zyx._RT.resolve(name)
        sync = lambda: zyx.synchronize(name)          # noqa: E731
        x = zyx.randn(n).realize()
        # checked against numpy on the first 1M elements and the last 1000 (the tail)
        a = x.numpy()
        part = np.r_[0:min(n, 1 << 20), max(n - 1000, 0):n]
        a = a[part]
        ref = {"chain": np.tanh(np.sin(a * 1.5 + 0.5) * 0.25 + a),
               "arith": np.maximum((a * 1.5 + 0.5) * a - 0.25, a * 0.5)}
        for wname, fn in workloads.items():
            zyx._RT.plans.clear()
            got = fn(x).numpy()[part]
            err = float(np.max(np.abs(got - ref[wname])))      # absolute: values are O(1)
            plan = next(iter(zyx._RT.plans.values()))
            progs = [st.program for st in plan.steps if getattr(st, "program", None)]
            realize = per_run(lambda: fn(x).realize(), sync)
            kernel, var, geometry = None, None, None
            if len(progs) == 1 and len(progs[0].kernel.args) == 2:
                prog = progs[0]
                var = prog.gpu.variant
                la = prog.gpu.launches[0]
                geometry = f"{la.groups}x{la.local_size}"
                out, _ = dev.pool.allocate(4 * n)
                args = [out, zyx._RT.graph.get(x._id).buffer]
                step = lambda: dev.launch(prog, dev.pool, args)      # noqa: E731
                if dev.backend == "cuda":
                    kernel = cuda_event_timer(dev.driver.stream)(step)
                else:
                    kernel = per_run(step, sync)
                dev.pool.deallocate(out)
            print("RESULT " + json.dumps({
                "variant": variant, "device": name, "workload": wname, "kernels": len(progs),
                "realize_s": realize, "kernel_s": kernel, "copy_wall_s": copy_wall,
                "copy_event_s": copy_ev, "bytes": 8 * n, "max_abs_err": err,
                "used": var, "geometry": geometry}), flush=True)
        del x
        zyx._RT.plans.clear()
        zyx.set_default_device(None)


def child_tiny():
    import zyx
    for name in gpu_devices(zyx):
        zyx.set_default_device(name)
        x = zyx.randn(4096).realize()
        (x + 1).realize()
        t = per_run(lambda: (x + 1).realize(), lambda: zyx.synchronize(name), rounds=30)
        print("TINY " + json.dumps({"device": name, "us": t * 1e6}), flush=True)
        zyx.set_default_device(None)


def run_child(args, variant="", **extra_env):
    env = dict(os.environ, ZYX_GPU_EW=variant, **extra_env)
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__)] + args, env=env,
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        print(f"  {variant or args}: timed out after {CHILD_TIMEOUT} s", flush=True)
        return ""
    if p.returncode != 0:
        print(f"  {variant or args}: failed (rc {p.returncode})\n{p.stderr[-3000:]}", flush=True)
    return p.stdout


def gbs(nbytes, s):
    return f"{nbytes / s / 1e9:7.0f}" if s else "      -"


def pct(s, copy_s):
    return f"{100 * copy_s / s:5.1f}%" if s and copy_s else "     -"


def main(variants):
    t0 = time.perf_counter()
    print("GPU elementwise sweep: 64M float32, GB/s of bytes read + written; % of torch's "
          "copy in the same process\n(realize vs wall-clock copy; kernel vs event-timed "
          "copy on CUDA, wall-clock copy on OpenCL)\n", flush=True)
    head = (f"{'variant':28} {'device':9} {'work':5} {'used (items,vec,local,tile)':27} "
            f"{'grid':12} {'realize':>7} {'%copy':>6} {'kernel':>7} {'%copy':>6} "
            f"{'copy':>6} {'err':>7}")
    print(head)
    print("-" * len(head), flush=True)
    for v in variants:
        for line in run_child(["--child", v], v).splitlines():
            if not line.startswith("RESULT "):
                continue
            r = json.loads(line[7:])
            u = r["used"]
            used = (f"{u['items']},{u['vec']},{u['local']},{u['tile']}"
                    + (f",waves={u['waves']}" if u["waves"] else "")) if u else "?"
            ev_copy = r["copy_event_s"] if r["device"].startswith("cuda") else r["copy_wall_s"]
            print(f"{v:28} {r['device']:9} {r['workload']:5} {used:27} "
                  f"{r['geometry'] or '?':12} {gbs(r['bytes'], r['realize_s'])} "
                  f"{pct(r['realize_s'], r['copy_wall_s'])} {gbs(r['bytes'], r['kernel_s'])} "
                  f"{pct(r['kernel_s'], ev_copy)} {gbs(r['bytes'], r['copy_wall_s'])} "
                  f"{r['max_abs_err']:7.1e}", flush=True)
    print()
    # CUDA launches through ctypes (the default) and through cuda-bindings, in turn
    for launch in ("ctypes", "bindings", "ctypes", "bindings"):
        for line in run_child(["--tiny"], ZYX_CUDA_LAUNCH=launch).splitlines():
            if line.startswith("TINY "):
                r = json.loads(line[5:])
                how = f", launch through {launch}" if r["device"].startswith("cuda") else ""
                print(f"cached tiny realization (4096 f32, (x + 1).realize()) on {r['device']}"
                      f"{how}: {r['us']:.1f} us per call (host, queued)", flush=True)
    print(f"\nsweep took {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    elif sys.argv[1:2] == ["--tiny"]:
        child_tiny()
    else:
        main(sys.argv[1:] or VARIANTS)
