"""sort / topk / einsum, zyx against torch (CPU): median of timed runs after warm-up.
Run: XDG_CACHE_HOME=... PYTHONPATH=. python benches/bench_sort_einsum.py [repeats]"""
import statistics
import sys
import time

import numpy as np
import torch

import zyx
from zyx.runtime import RT


def median_ms(fn, repeats):
    fn()
    fn()        # compile and warm the plan cache
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def realize(*ts):
    RT.realize([t._id for t in ts])      # values and indices in one plan


def main(repeats=7):
    r = np.random.default_rng(0)
    cases = []
    a = r.standard_normal((64, 4096)).astype(np.float32)
    ta = torch.tensor(a)
    cases.append(("sort 64x4096 f32 (last dim)",
                  lambda: realize(*zyx.sort(zyx.tensor(a))),
                  lambda: torch.sort(ta, stable=True)))
    b = r.standard_normal((256, 10000)).astype(np.float32)
    tb = torch.tensor(b)
    cases.append(("topk k=10 of 256x10000 f32",
                  lambda: realize(*zyx.topk(zyx.tensor(b), 10)),
                  lambda: torch.topk(tb, 10)))
    x = r.standard_normal((32, 128, 128)).astype(np.float32)
    y = r.standard_normal((32, 128, 128)).astype(np.float32)
    tx, ty = torch.tensor(x), torch.tensor(y)
    zx, zy = zyx.tensor(x), zyx.tensor(y)
    cases.append(("einsum bij,bjk->bik 32x128x128",
                  lambda: zyx.einsum("bij,bjk->bik", zx, zy).realize(),
                  lambda: torch.einsum("bij,bjk->bik", tx, ty)))
    print(f"{'case':34s} {'zyx ms':>10s} {'torch ms':>10s}")
    for name, zfn, tfn in cases:
        print(f"{name:34s} {median_ms(zfn, repeats):10.2f} {median_ms(tfn, repeats):10.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
