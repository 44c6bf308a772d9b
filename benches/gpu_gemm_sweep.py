"""The GPU gemm strategy's variants (issue 13: matmul 4096 float32 >= 0.9x and bfloat16
>= 0.7x cuBLAS, conv2d >= 0.7x cuDNN) side by side in one process, PyTorch beside them.

    python3 benches/gpu_gemm_sweep.py [variant ...]      (from the repository root)

A variant is a ZYX_GPU_GEMM value (zyx/codegen/gpu/gemm.py `variant`: "mma=0" keeps 16-bit
products on the float tiles, "vector=0", "prefetch=0", ...; "default" for none)
optionally followed by "@RxC", a forced tile of gemm.TILES (e.g. "@64x128"). For each workload it prints the median time per
realization (wall clock over rounds of REPS realizations and one synchronize, the host's
enqueue included, as benches/bench_gpu.py measures), the TFLOP/s, the strategy that ran
and the ratio to torch's time measured the same way. Results are checked against the
default variant's. ZYX_SWEEP_DEVICE picks the device (default cuda); ZYX_SWEEP_MM and
ZYX_SWEEP_BATCH shrink the workloads for a try on a CPU OpenCL device; ZYX_SWEEP_ONLY
(words separated by commas) keeps the workloads whose names contain one of them.
ZYX_FLOAT32_MATMUL_PRECISION=high runs float32 on TF32 on both sides (zyx and torch).
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from gpu_elementwise_sweep import per_run  # noqa: E402

VARIANTS = ["default", "mma=0", "vector=0", "@128x64", "@64x128"]
ROUNDS = 7


def _workloads(zyx, torch):
    """name -> (zyx step, torch step or None, flops)."""
    import zyx.nn.functional as F
    mm = int(os.environ.get("ZYX_SWEEP_MM", 4096))
    out = {}
    for d in ("float32", "bfloat16", "float16"):
        a, b = (zyx.randn(mm, mm).cast(d).realize() for _ in range(2))
        ta = tb = None
        if torch is not None:
            ta, tb = (torch.randn(mm, mm, device="cuda").to(getattr(torch, d)) for _ in range(2))
        out[f"matmul {mm} {d}"] = (lambda a=a, b=b: a @ b,
                                   (lambda ta=ta, tb=tb: ta @ tb) if torch else None,
                                   2 * mm ** 3)
        if d in ("bfloat16", "float32"):    # a linear layer's: both contiguous along K
            out[f"matmul {mm} {d} a @ b.T"] = (
                lambda a=a, b=b: a @ b.T,
                (lambda ta=ta, tb=tb: ta @ tb.T) if torch else None, 2 * mm ** 3)
    n, c, h, k = int(os.environ.get("ZYX_SWEEP_BATCH", 64)), 64, 56, 3
    for d in ("float32", "bfloat16"):
        x = zyx.randn(n, c, h, h).cast(d).realize()
        w = (zyx.randn(c, c, k, k) * 0.05).cast(d).realize()
        tx = tw = None
        if torch is not None:
            tx = torch.randn(n, c, h, h, device="cuda").to(getattr(torch, d))
            tw = (torch.randn(c, c, k, k, device="cuda") * 0.05).to(getattr(torch, d))
        out[f"conv2d {n}x{c}x{h}x{h} k{k} {d}"] = (
            lambda x=x, w=w: F.conv2d(x, w, padding=1),
            (lambda tx=tx, tw=tw: torch.nn.functional.conv2d(tx, tw, padding=1)) if torch
            else None,
            2 * n * c * c * h * h * k * k)
    return out


def main(variants):
    import zyx
    from zyx.backends import gpudriver, opencl
    from zyx.codegen.gpu import gemm
    try:
        import torch
        torch = torch if torch.cuda.is_available() else None
    except ImportError:
        torch = None
    if torch is not None:
        # float32 on TF32 on both sides where ZYX_FLOAT32_MATMUL_PRECISION allows it
        tf32 = zyx.get_float32_matmul_precision() != "highest"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    name = os.environ.get("ZYX_SWEEP_DEVICE", "cuda")
    zyx.set_default_device(name)
    dev = zyx._RT.resolve(name)
    plain_lower = gpudriver.lower
    drivers = (gpudriver, opencl)       # the modules whose devices call `lower`
    ran = []

    def use(variant):
        spec, _, tile = variant.partition("@")
        spec = "" if spec == "default" else spec
        os.environ[gemm.GEMM_ENV] = spec
        sched = {"gemm": tuple(int(v) for v in tile.split("x"))} if tile else None

        def spy(kernel, dl, info=None, nm="zyx_k", schedule=None):
            g = plain_lower(kernel, dl, info, nm, sched or schedule)
            ran.append(g.strategy)
            return g
        for mod in drivers:
            mod.lower = spy
        for cache in ("_programs", "_by_source"):
            getattr(dev, cache, {}).clear()
        zyx._RT.plans.clear()

    works = _workloads(zyx, torch)
    only = [w for w in os.environ.get("ZYX_SWEEP_ONLY", "").split(",") if w]
    if only:
        works = {k: v for k, v in works.items() if any(w in k for w in only)}
    print(f"device: {dev.info().name}; median of {ROUNDS} rounds of 10 realizations")
    print("| workload | variant | strategies | ms | TFLOP/s | torch ms | torch / zyx |")
    print("|---|---|---|---|---|---|---|")
    for wname, (zstep, tstep, flops) in works.items():
        tt = per_run(tstep, torch.cuda.synchronize, rounds=ROUNDS) if tstep else None
        ref = None
        for variant in variants:
            use(variant)
            ran.clear()
            try:
                got = zstep().float().numpy()
            except Exception as e:        # a variant that does not compile or launch
                print(f"| {wname} | {variant} | failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:80]} | | | | |")
                continue
            strategies = ",".join(sorted(set(ran)))
            if ref is None:
                ref = got
            else:
                scale = np.abs(ref).max() + 1e-30
                err = np.abs(got - ref).max() / scale
                if err > 2e-2:
                    strategies += f" (differs: {err:.2g})"
            t = per_run(lambda: zstep().realize(), lambda: zyx.synchronize(name),
                        rounds=ROUNDS)
            ratio = f"{tt / t:.2f}x" if tt else ""
            print(f"| {wname} | {variant} | {strategies} | {t * 1e3:.3f} | "
                  f"{flops / t / 1e12:.1f} | {tt * 1e3 if tt else float('nan'):.3f} | "
                  f"{ratio} |", flush=True)
    for mod in drivers:
        mod.lower = plain_lower
    os.environ.pop(gemm.GEMM_ENV, None)


if __name__ == "__main__":
    main(sys.argv[1:] or VARIANTS)
