"""The WGSL writer's product tiles (zyx/codegen/wgsl/gemm.py) on WebGPU, tile by tile, in
one process with torch.matmul / torch conv2d beside them (issue 30: matmul 4096 float32
>= 0.5x cuBLAS through wgpu).

    python3 benches/gpu_wgsl_gemm_sweep.py [tile ...]      (from the repository root)

A tile is a ZYX_WGSL_GEMM_TILE value, BRxBCxBK or BRxBCxBKxTRxTC ("default": the
writer's choice, "off": ZYX_WGSL_GEMM=0, the strategies without product tiles). For each
workload it prints a markdown table row per tile: the median time per realization (wall
clock over rounds of REPS realizations and one synchronize, the host's enqueue included,
as benches/bench_gpu.py measures), TFLOP/s, the strategies and tiles that ran, and the
ratio torch time / zyx time (torch on CUDA where it has a GPU, else on the CPU). Results
are checked against the first tile's; a tile the device cannot run prints its error.

ZYX_SWEEP_DEVICE picks the device (default wgpu:0); ZYX_SWEEP_MM (default 4096) and
ZYX_SWEEP_BATCH (default 64) shrink the workloads for a try on lavapipe; ZYX_SWEEP_ONLY
(words separated by commas) keeps the workloads whose names contain one of them.
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from gpu_elementwise_sweep import per_run  # noqa: E402

TILES = ["default", "128x128x8", "128x128x16", "128x64x8", "64x128x8", "128x128x8x8x4",
         "64x64x16", "64x64x8x8x8", "64x64x16x4x4", "32x32x16", "off"]
ROUNDS = 7
REPS = 10


def _torch():
    try:
        import torch
    except ImportError:
        return None, None
    if torch.cuda.is_available():
        return torch, "cuda"
    return torch, "cpu"


def _workloads(zyx, torch, tdev):
    """name -> (zyx step, torch step or None, flops)."""
    import zyx.nn.functional as F
    mm = int(os.environ.get("ZYX_SWEEP_MM", 4096))
    out = {}
    rng = np.random.default_rng(0)
    a_np, b_np = (rng.standard_normal((mm, mm), dtype=np.float32) for _ in range(2))
    ta = tb = None
    if torch is not None:
        ta, tb = torch.tensor(a_np, device=tdev), torch.tensor(b_np, device=tdev)
    for d in ("float32", "float16"):
        a, b = zyx.Tensor(a_np).cast(d).realize(), zyx.Tensor(b_np).cast(d).realize()
        tad = tbd = None
        if torch is not None:
            tdt = getattr(torch, d) if tdev == "cuda" or d == "float32" else torch.float32
            tad, tbd = ta.to(tdt), tb.to(tdt)
        out[f"matmul {mm} {d}"] = (lambda a=a, b=b: a @ b,
                                   (lambda x=tad, y=tbd: torch.matmul(x, y)) if torch
                                   else None, 2 * mm ** 3)
        if d == "float32":     # a linear layer's: both operands contiguous along K
            out[f"matmul {mm} {d} a @ b.T"] = (lambda a=a, b=b: a @ b.T,
                                               (lambda x=tad, y=tbd: torch.matmul(x, y.T))
                                               if torch else None, 2 * mm ** 3)
    n, c, h, k = int(os.environ.get("ZYX_SWEEP_BATCH", 64)), 64, 56, 3
    x_np = rng.standard_normal((n, c, h, h), dtype=np.float32)
    w_np = rng.standard_normal((c, c, k, k), dtype=np.float32) * 0.05
    x, w = zyx.Tensor(x_np).realize(), zyx.Tensor(w_np).realize()
    tx = tw = None
    if torch is not None:
        tx, tw = torch.tensor(x_np, device=tdev), torch.tensor(w_np, device=tdev)
    out[f"conv2d {n}x{c}x{h}x{h} k{k} float32"] = (
        lambda: F.conv2d(x, w, padding=1),
        (lambda: torch.nn.functional.conv2d(tx, tw, padding=1)) if torch else None,
        2 * n * c * c * h * h * k * k)
    return out


def main(tiles):
    import zyx
    from zyx.codegen.wgsl import gemm as wg
    torch, tdev = _torch()
    if torch is not None and tdev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    name = os.environ.get("ZYX_SWEEP_DEVICE", "wgpu:0")
    zyx.set_default_device(name)
    dev = zyx._RT.resolve(name)
    tsync = (torch.cuda.synchronize if tdev == "cuda" else (lambda: None)) if torch else None

    def use(tile):
        for env in (wg.GEMM_ENV, wg.TILE_ENV):
            os.environ.pop(env, None)
        if tile == "off":
            os.environ[wg.GEMM_ENV] = "0"
        elif tile != "default":
            wg.parse_tile(tile)                   # a malformed tile fails here, loudly
            os.environ[wg.TILE_ENV] = tile
        for cache in ("_programs", "_by_source"):
            getattr(dev, cache).clear()
        zyx._RT.plans.clear()

    def ran():
        out = set()
        for p in dev._programs.values():
            t = getattr(p.wgsl, "tile", None)
            out.add(p.wgsl.strategy + (f"[{t.label()}]" if t is not None else ""))
        return ",".join(sorted(out))

    works = _workloads(zyx, torch, tdev)
    only = [w for w in os.environ.get("ZYX_SWEEP_ONLY", "").split(",") if w]
    if only:
        works = {k: v for k, v in works.items() if any(w in k for w in only)}
    print(f"device: {dev.info().name}; torch on {tdev}; median of {ROUNDS} rounds of "
          f"{REPS} realizations")
    print("| workload | tile | strategies | ms | TFLOP/s | torch ms | torch / zyx |")
    print("|---|---|---|---|---|---|---|")
    for wname, (zstep, tstep, flops) in works.items():
        tt = per_run(tstep, tsync, rounds=ROUNDS, reps=REPS) if tstep else None
        ref = None
        for tile in tiles:
            try:
                use(tile)
                got = zstep().float().numpy()
            except Exception as e:        # a tile the device cannot compile or run
                print(f"| {wname} | {tile} | failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:90]} | | | | |", flush=True)
                continue
            strategies = ran()
            if ref is None:
                ref = got
            else:
                err = np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30)
                if err > 2e-2:
                    strategies += f" (differs: {err:.2g})"
            t = per_run(lambda: zstep().realize(), lambda: zyx.synchronize(name),
                        rounds=ROUNDS, reps=REPS)
            ratio = f"{tt / t:.2f}x" if tt else ""
            print(f"| {wname} | {tile} | {strategies} | {t * 1e3:.3f} | "
                  f"{flops / t / 1e12:.2f} | {tt * 1e3 if tt else float('nan'):.3f} | "
                  f"{ratio} |", flush=True)
    use("default")


if __name__ == "__main__":
    main(sys.argv[1:] or TILES)
