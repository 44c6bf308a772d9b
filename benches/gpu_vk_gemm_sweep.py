"""The Vulkan gemm strategy's tiles (zyx/codegen/spirv/gemm.py; issue 30: matmul 4096
float32 >= 0.5x cuBLAS) side by side in one process, PyTorch beside them.

    python3 benches/gpu_vk_gemm_sweep.py [variant ...]      (from the repository root)

A variant is "default" (the strategy's own tile choice), "off" (ZYX_VK_GEMM=0: the
serial strategy, the figure before the tiles), a tile BRxBCxBK for ZYX_VK_GEMM_TILE
(BR, BC of 16, 32, 64, 128), either optionally followed by ",noprefetch"
(ZYX_VK_GEMM_PREFETCH=0). For each workload it prints a markdown row: the median time
per realization (wall clock over rounds of 10 realizations and one synchronize, as
benches/bench_vk.py measures), TFLOP/s, the strategies of the programs compiled, and the
ratio torch time / zyx time, torch (CUDA) measured the same way in the same process.
Results are checked against the first variant's ("differs" in the strategies column).

ZYX_SWEEP_DEVICE picks the device (default vulkan:0), ZYX_SWEEP_MM the matmul size
(default 4096; for a try on lavapipe ZYX_SWEEP_MM=128 ZYX_VK_GEMM=1, the strategy being
off by default on CPU drivers), ZYX_SWEEP_ONLY (comma-separated words)
keeps the workloads whose names contain one of them.
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from gpu_elementwise_sweep import per_run  # noqa: E402

VARIANTS = ["default", "128x128x8", "128x128x16", "128x64x8", "64x128x8", "64x64x16",
            "128x128x8,noprefetch", "64x64x8"]
ROUNDS = 7
GEMM_FLAG = os.environ.get("ZYX_VK_GEMM")      # (=1: on for a CPU driver too)


def _workloads(zyx, torch, dev):
    """name -> (zyx step, torch step or None, flops)."""
    import zyx.nn.functional as F
    mm = int(os.environ.get("ZYX_SWEEP_MM", 4096))
    rng = np.random.default_rng(0)
    out = {}
    for d in ("float32", "float16"):
        a, b = (zyx.tensor(rng.standard_normal((mm, mm), dtype=np.float32), device=dev)
                .cast(d).realize() for _ in range(2))
        ta = tb = None
        if torch is not None:
            ta, tb = (torch.randn(mm, mm, device="cuda").to(getattr(torch, d)) for _ in range(2))
        out[f"matmul {mm} {d}"] = (lambda a=a, b=b: a @ b,
                                   (lambda ta=ta, tb=tb: ta @ tb) if torch else None,
                                   2 * mm ** 3)
        if d == "float32":      # a linear layer's: both operands contiguous along K
            out[f"matmul {mm} {d} a @ b.T"] = (
                lambda a=a, b=b: a @ b.T,
                (lambda ta=ta, tb=tb: ta @ tb.T) if torch else None, 2 * mm ** 3)
    n, c, h, k = max(mm // 64, 2), 64, 56, 3
    x = zyx.tensor(rng.standard_normal((n, c, h, h), dtype=np.float32), device=dev).realize()
    w = zyx.tensor(rng.standard_normal((c, c, k, k), dtype=np.float32) * 0.05,
                   device=dev).realize()
    tx = tw = None
    if torch is not None:
        tx = torch.randn(n, c, h, h, device="cuda")
        tw = torch.randn(c, c, k, k, device="cuda") * 0.05
    out[f"conv2d {n}x{c}x{h}x{h} k{k} float32"] = (
        lambda: F.conv2d(x, w, padding=1),
        (lambda: torch.nn.functional.conv2d(tx, tw, padding=1)) if torch else None,
        2 * n * c * c * h * h * k * k)
    return out


def _torch():
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return torch


def use(zyx, dev, variant):
    """Set the environment for `variant` and drop compiled plans and programs."""
    spec, _, extra = variant.partition(",")
    for env in ("ZYX_VK_GEMM", "ZYX_VK_GEMM_TILE", "ZYX_VK_GEMM_PREFETCH"):
        os.environ.pop(env, None)
    if GEMM_FLAG is not None:
        os.environ["ZYX_VK_GEMM"] = GEMM_FLAG
    if spec == "off":
        os.environ["ZYX_VK_GEMM"] = "0"
    elif spec != "default":
        os.environ["ZYX_VK_GEMM_TILE"] = spec
    if extra == "noprefetch":
        os.environ["ZYX_VK_GEMM_PREFETCH"] = "0"
    elif extra:
        raise SystemExit(f"unknown variant suffix {extra!r} (only ',noprefetch')")
    zyx._RT.plans.clear()
    dev._programs.clear()


def main(variants):
    import zyx
    torch = _torch()
    name = os.environ.get("ZYX_SWEEP_DEVICE", "vulkan:0")
    zyx.set_default_device(name)
    dev = zyx._RT.resolve(name)
    works = _workloads(zyx, torch, name)
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
            use(zyx, dev, variant)
            try:
                got = zstep().cast(zyx.float32).numpy()
            except Exception as e:        # a variant that does not compile or launch
                print(f"| {wname} | {variant} | failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:80]} | | | | |", flush=True)
                continue
            strategies = ",".join(sorted({p.launches[0].strategy
                                          for p in dev._programs.values()}))
            if ref is None:
                ref = got
            else:
                err = np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30)
                if err > 2e-2:
                    strategies += f" (differs: {err:.2g})"
            t = per_run(lambda: zstep().realize(), lambda: zyx.synchronize(name),
                        rounds=ROUNDS)
            ratio = f"{tt / t:.2f}x" if tt else ""
            print(f"| {wname} | {variant} | {strategies} | {t * 1e3:.3f} | "
                  f"{flops / t / 1e12:.2f} | {tt * 1e3 if tt else float('nan'):.3f} | "
                  f"{ratio} |", flush=True)
    use(zyx, dev, "default")


if __name__ == "__main__":
    main(sys.argv[1:] or VARIANTS)
