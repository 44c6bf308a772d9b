"""Matmuls and convolutions of shapes beyond issue 13's named ones, zyx beside PyTorch in
one process on the CUDA device: how far the figures in BENCHMARKS.md carry to other
workloads a user would try (ResNet stages, strided and 1x1 convolutions, smaller and
larger matmuls), in float32 ("highest" on both sides), TF32 (both allowed it) and
bfloat16.

    python3 benches/gpu_shapes.py [variant ...]    (from the repository root, on a GPU)

Each row: the median seconds per realization over rounds of 10 and one synchronize (the
host's enqueue included, as bench_gpu.py measures), torch's the same way, the ratio
torch time / zyx time (above 1: zyx faster) and the largest difference from torch's
result relative to its largest value. A variant is a ZYX_GPU_GEMM value (gemm.py
`variant`; "default" for none, the default; "plain-input": convolutions without the
channels-last copy of their input, F.GPU_CHANNELS_LAST_INPUT): each gets a row per
workload, its programs lowered afresh. ZYX_SHAPES_ONLY (words separated by commas)
keeps the rows whose names contain one of them.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from gpu_elementwise_sweep import per_run  # noqa: E402

ROUNDS = 7

# (batch, in channels, out channels, image side, kernel, stride, padding)
CONVS = [(64, 64, 64, 56, 3, 1, 1), (64, 128, 128, 28, 3, 1, 1), (64, 256, 256, 14, 3, 1, 1),
         (64, 64, 128, 56, 3, 2, 1), (64, 64, 256, 56, 1, 1, 0), (32, 3, 64, 224, 7, 2, 3)]
MATMULS = [1024, 2048, 8192]


def _cases(zyx, torch):
    """name -> (zyx step, torch step, precision) for every shape and dtype."""
    import zyx.nn.functional as F
    out = {}
    for n, ci, co, h, k, s, p in CONVS:
        for d in ("float32", "tf32", "bfloat16"):
            zd = "float32" if d == "tf32" else d
            x, w = zyx.randn(n, ci, h, h).cast(zd).realize(), \
                (zyx.randn(co, ci, k, k) * 0.05).cast(zd).realize()
            tx = torch.tensor(x.float().numpy(), device="cuda").to(getattr(torch, zd))
            tw = torch.tensor(w.float().numpy(), device="cuda").to(getattr(torch, zd))
            out[f"conv2d n{n} {ci}->{co} {h}x{h} k{k} s{s} p{p} {d}"] = (
                lambda x=x, w=w, s=s, p=p: F.conv2d(x, w, stride=s, padding=p),
                lambda tx=tx, tw=tw, s=s, p=p: torch.nn.functional.conv2d(tx, tw, stride=s,
                                                                          padding=p),
                "high" if d == "tf32" else "highest")
    for m in MATMULS:
        for d in ("float32", "tf32", "bfloat16"):
            zd = "float32" if d == "tf32" else d
            a, b = (zyx.randn(m, m).cast(zd).realize() for _ in range(2))
            ta, tb = (torch.tensor(v.float().numpy(), device="cuda").to(getattr(torch, zd))
                      for v in (a, b))
            out[f"matmul {m} {d}"] = (lambda a=a, b=b: a @ b, lambda ta=ta, tb=tb: ta @ tb,
                                      "high" if d == "tf32" else "highest")
    return out


def main(variants):
    import numpy as np
    import torch
    import zyx
    import zyx.nn.functional as F
    from zyx.codegen.gpu import gemm
    zyx.set_default_device("cuda")
    dev = zyx._RT.resolve("cuda")
    only = [w for w in os.environ.get("ZYX_SHAPES_ONLY", "").split(",") if w]
    print(f"device: {dev.info().name}; median of {ROUNDS} rounds of 10")
    print("| workload | variant | zyx ms | torch ms | torch / zyx | max diff / max |")
    print("|---|---|---|---|---|---|")
    for name, (zstep, tstep, precision) in _cases(zyx, torch).items():
        if only and not any(w in name for w in only):
            continue
        zyx.set_float32_matmul_precision(precision)
        tf32 = precision != "highest"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
        want = tstep().float().cpu().numpy()
        tt = per_run(tstep, torch.cuda.synchronize, rounds=ROUNDS)
        for variant in variants:
            # ("plain-input": convolutions read x as it is, no channels-last copy)
            F.GPU_CHANNELS_LAST_INPUT = variant != "plain-input"
            os.environ[gemm.GEMM_ENV] = "" if variant in ("default", "plain-input") else variant
            for cache in ("_programs", "_by_source"):
                getattr(dev, cache, {}).clear()
            zyx._RT.plans.clear()
            got = zstep().float().numpy()
            diff = np.abs(got - want).max() / (np.abs(want).max() + 1e-30)
            t = per_run(lambda: zstep().realize(), lambda: zyx.synchronize("cuda"),
                        rounds=ROUNDS)
            print(f"| {name} | {variant} | {t * 1e3:.3f} | {tt * 1e3:.3f} | {tt / t:.2f}x | "
                  f"{diff:.1e} |", flush=True)
    os.environ.pop(gemm.GEMM_ENV, None)
    F.GPU_CHANNELS_LAST_INPUT = True
    zyx.set_float32_matmul_precision("highest")


if __name__ == "__main__":
    main(sys.argv[1:] or ["default"])
