"""float16 (and bfloat16) matmuls on Vulkan's cooperative matrices
(zyx/codegen/spirv/coopmat.py) beside torch.matmul on CUDA, in one process:

    python3 benches/gpu_vk_coopmat.py [device] [variant ...]     (from the repository root)

The device defaults to vulkan:0. It prints the device's cooperative-matrix shapes
(DeviceInfo.coop_shapes; none: VK_KHR_cooperative_matrix is absent or ZYX_VK_COOPMAT=0
was set at start),
then one markdown row per size, dtype and variant: the strategies of the programs
compiled (coopmat: cooperative matrices; gemm: the float tiles), the check against
torch (CUDA; without it numpy on the first 64 rows: the largest error over the largest
reference value, "ok" under 4 units of the dtype's last place), the median time per
product over ROUNDS rounds of REPS realizations and one synchronize after a warm-up,
TFLOP/s, and torch.matmul on CUDA timed the same way (a torch.cuda.synchronize per
round). A size or variant that fails prints its error in its row and the run goes on.

Variants: "default" (the strategy's own tile), "off" (ZYX_VK_COOPMAT=0: the float tiles,
the figure before), or a tile for ZYX_VK_COOPMAT_TILE (BMxBNxBK or BMxBNxBK:WMxWN, e.g.
128x128x32:2x4), optionally followed by ",noprefetch" (ZYX_VK_GEMM_PREFETCH=0) and/or
",novector" (ZYX_VK_COOPMAT_VECTOR=0: operands copied value by value) and/or ",single"
(ZYX_VK_COOPMAT_DOUBLE=0: one staged copy of the operand tiles, two barriers a step;
rows otherwise say "double" where two copies fit). Default
variants: "default" and "off"; SWEEP (below) with the single argument "sweep".
ZYX_COOPMAT_SIZES (default 1024,2048,4096) and ZYX_COOPMAT_DTYPES (default
float16,bfloat16; bfloat16 rows run where the device lists a bfloat16 shape) choose the
products.
"""
from __future__ import annotations

import os
import re
import sys
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from bench_vk import median_per_step  # noqa: E402  (after the path is set)

REPS = 5
ROUNDS = 15
SWEEP = ["default", "off", "128x128x32", "128x128x16", "128x128x64", "128x64x32",
         "64x128x32", "64x64x32", "128x128x32:4x2", "128x128x32:2x2", "128x256x32:2x4",
         "128x256x32:4x2", "128x256x16", "256x128x32:4x2", "128x128x32,noprefetch",
         "128x128x32,novector", "128x128x32,single"]
CHECK_ROWS = 64          # rows numpy checks where torch has no CUDA
ENVS = ("ZYX_VK_COOPMAT", "ZYX_VK_COOPMAT_TILE", "ZYX_VK_GEMM_PREFETCH",
        "ZYX_VK_COOPMAT_VECTOR", "ZYX_VK_COOPMAT_DOUBLE")


def cuda_torch():
    """torch when it has a CUDA device (TF32 off: the comparison is float16 products),
    else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def use(zyx, dev, variant):
    """Set the environment for `variant` and drop compiled plans and programs."""
    spec, *extras = variant.split(",")
    for env in ENVS:
        os.environ.pop(env, None)
    os.environ["ZYX_VK_COOPMAT"] = "0" if spec == "off" else "1"
    if spec not in ("off", "default"):
        os.environ["ZYX_VK_COOPMAT_TILE"] = spec
    for extra in extras:
        if extra == "noprefetch":
            os.environ["ZYX_VK_GEMM_PREFETCH"] = "0"
        elif extra == "novector":
            os.environ["ZYX_VK_COOPMAT_VECTOR"] = "0"
        elif extra == "single":
            os.environ["ZYX_VK_COOPMAT_DOUBLE"] = "0"
        else:
            raise ValueError(f"unknown variant suffix {extra!r} (',noprefetch', ',novector', "
                             f"',single')")
    zyx._RT.plans.clear()
    dev._programs.clear()


def check(got, ref, dtype):
    """'ok' or 'MISMATCH' with the largest error over the largest reference value."""
    err = float(np.abs(got.astype(np.float64) - ref).max() / (np.abs(ref).max() + 1e-30))
    ulp = 2.0 ** (-10 if dtype == "float16" else -7)
    return f"{'ok' if err < 4 * ulp else 'MISMATCH'} {err:.1e}"


def strategy_label(program, info):
    """A compiled program's strategy, with its tile where it is the coopmat one."""
    from zyx.codegen.spirv import coopmat
    strategy = program.launches[0].strategy
    if strategy == "coopmat":
        got = coopmat.choose(program.kernel.ops, info)
        if got is not None:
            return f"coopmat {got[1].label()}" + (" double" if got[1].buffers > 1 else "")
    return strategy


def run_case(zyx, torch, dev, name, n, dtype, variants, t_torch):
    """The rows of one product: n x n times n x n in `dtype`, each variant."""
    info = dev.info()
    rng = np.random.default_rng(n)
    host = [rng.standard_normal((n, n), dtype=np.float32) for _ in range(2)]
    a, b = (zyx.tensor(x, device=name).cast(dtype).realize() for x in host)
    if torch is not None:
        ta, tb = (torch.tensor(x, device="cuda").to(getattr(torch, dtype)) for x in host)
        ref = (ta @ tb).float().cpu().numpy().astype(np.float64)
        rows = n
    else:
        # the operands' 16-bit values, multiplied in float64 (the first rows only)
        a16, b16 = (x.cast(zyx.float32).numpy().astype(np.float64) for x in (a, b))
        ref = a16[:CHECK_ROWS] @ b16
        rows = CHECK_ROWS
    flops = 2 * n ** 3
    for variant in variants:
        label = f"| {n} | {dtype} | {variant} |"
        try:
            use(zyx, dev, variant)
            got = (a @ b).cast(zyx.float32).numpy()[:rows]
            strategies = ",".join(sorted({strategy_label(p, info)
                                          for p in dev._programs.values()}))
            verdict = check(got, ref, dtype)
            t = median_per_step(lambda: (a @ b).realize(), lambda: zyx.synchronize(name),
                                warmups=2 * REPS, rounds=ROUNDS, reps=REPS)
        except Exception as e:          # a variant that does not compile, launch or fit
            first = (str(e).splitlines() or [""])[0][:100]
            print(f"{label} failed: {type(e).__name__}: {first} | | | | | |", flush=True)
            if os.environ.get("ZYX_COOPMAT_TRACE"):
                traceback.print_exc()
            continue
        tt = f"{t_torch * 1e3:.3f}" if t_torch else ""
        tflops_t = f"{flops / t_torch / 1e12:.1f}" if t_torch else ""
        ratio = f"{t_torch / t:.2f}" if t_torch else ""
        print(f"{label} {strategies} | {verdict} | {t * 1e3:.3f} | {flops / t / 1e12:.1f} | "
              f"{tt} | {tflops_t} | {ratio} |", flush=True)


def main(argv):
    import zyx
    devices = [a for a in argv if re.fullmatch(r"[a-z]+:\d+", a)]
    name = devices[0] if devices else "vulkan:0"
    variants = [a for a in argv if a not in devices]
    if variants == ["sweep"]:
        variants = SWEEP
    variants = variants or ["default", "off"]
    sizes = [int(s) for s in os.environ.get("ZYX_COOPMAT_SIZES", "1024,2048,4096").split(",")]
    dtypes = os.environ.get("ZYX_COOPMAT_DTYPES", "float16,bfloat16").split(",")
    torch = cuda_torch()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False
    zyx.set_default_device(name)
    dev = zyx._RT.resolve(name)
    info = dev.info()
    print(f"device: {info.name}")
    shapes = info.coop_shapes
    if shapes:
        print("cooperative-matrix shapes:")
        for s in shapes:
            print(f"  {s.label()}")
    else:
        print("cooperative-matrix shapes: none (no VK_KHR_cooperative_matrix, or "
              "ZYX_VK_COOPMAT=0 at start): the rows show the float tiles")
    where = f"CUDA {torch.cuda.get_device_name()}" if torch else \
        "no CUDA (numpy checks the first rows)"
    print(f"torch: {where}; median of {ROUNDS} rounds of {REPS} products")
    print()
    print("| n | dtype | variant | strategies | check | ms | TFLOP/s | torch ms | torch TFLOP/s "
          "| torch / zyx time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in dtypes:
        if dtype == "bfloat16" and not any(s.a == "bfloat16" for s in shapes):
            print("| | bfloat16 | | skipped: the device lists no bfloat16 shape | | | | | | |")
            continue
        for n in sizes:
            t_torch = None
            if torch is not None:
                x = torch.randn(n, n, device="cuda").to(getattr(torch, dtype))
                y = torch.randn(n, n, device="cuda").to(getattr(torch, dtype))
                t_torch = median_per_step(lambda: x @ y, torch.cuda.synchronize,
                                          warmups=2 * REPS, rounds=ROUNDS, reps=REPS)
            try:
                run_case(zyx, torch, dev, name, n, dtype, variants, t_torch)
            except Exception as e:      # the operands themselves (memory, dtype)
                print(f"| {n} | {dtype} | | failed: {type(e).__name__}: "
                      f"{(str(e).splitlines() or [''])[0][:100]} | | | | | | |", flush=True)
    use(zyx, dev, "default")


if __name__ == "__main__":
    main(sys.argv[1:])
