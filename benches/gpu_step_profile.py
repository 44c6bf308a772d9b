"""Where a small training step's time goes on a GPU device: the MNIST convnet step of
bench_gpu.py (batch 64, Adam), which is bound by host work, not by the GPU.

    python benches/gpu_step_profile.py [device] [--profile] [--split]    (default: cuda)

Prints the step's median time (synchronized), the time to build its graph (forward and
backward, nothing realized), the kernels of its plan and the time of each launched
alone (back to back, synchronized: GPU time plus launch), and with --profile the
functions with the most host time (cProfile, 200 steps). --split realizes the gradients
before the optimizer's step (two plans, as DistributedDataParallel runs it)."""
import cProfile
import os
import pstats
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zyx  # noqa: E402
import zyx.nn.functional as F  # noqa: E402
from zyx import optim  # noqa: E402


def main(name="cuda", profile=False, split=False):
    import bench_gpu as bg
    zyx.set_default_device(name)
    zyx.manual_seed(0)
    model = bg._zyx_convnet()
    opt = optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x = zyx.tensor(rng.standard_normal((bg.B, 1, 28, 28), dtype=np.float32))
    y = zyx.tensor(rng.integers(0, 10, bg.B))

    def graph():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        return loss

    def step():
        graph()
        if split:
            zyx.realize(*[p.grad for p in model.parameters()])
        opt.step()

    sync = lambda: zyx.synchronize(name)      # noqa: E731
    for _ in range(5):
        step()
    sync()
    ts = []
    for _ in range(50):
        t0 = time.perf_counter()
        step()
        sync()
        ts.append(time.perf_counter() - t0)
    print(f"{name}: convnet step{' (gradients, then the update)' if split else ''} "
          f"{statistics.median(ts) * 1e3:.3f} ms (synchronized, median of 50)")
    gs = []
    for _ in range(50):
        t0 = time.perf_counter()
        loss = graph()
        gs.append(time.perf_counter() - t0)
        opt.step()
    sync()
    first = zyx._RT.stats["realizations"]
    step()
    print(f"{name}: building the graph (forward + backward, lazy) {statistics.median(gs) * 1e3:.3f} ms")
    plans = [p for p in zyx._RT.plans.values() if p.last_used >= first]
    kernels = [st for plan in plans for st in plan.steps if st.kernel is not None]
    print(f"{name}: {len(plans)} plan(s) of {len(kernels)} kernels "
          f"({sum(st.nout > 1 for st in kernels)} with several outputs), "
          f"{sum(len(plan.steps) for plan in plans)} steps")
    # each kernel of the plan launched alone, back to back (GPU time plus the launch)
    from zyx import tuning
    dev = zyx._RT.resolve(name)
    tu = tuning.Tuner(dev, tuning.Settings(enabled=True, launches=3, progress=False), {},
                      store=object())
    rows, bufs = [], {}
    for st in kernels:
        prog = st.program if st.program is not None else dev.compile(st.kernel)
        rows.append((tu._time(prog, tu._args(st.kernel, bufs, dev.pool)), st))
    total = sum(t for t, _ in rows)
    print(f"{name}: kernels alone {total * 1e3:.3f} ms in all; the slowest:")
    for t, st in sorted(rows, key=lambda r: -r[0])[:12]:
        k = st.kernel
        label = getattr(st.program, "gpu", None)
        label = getattr(label, "strategy", "") if label is not None else ""
        print(f"  {t * 1e6:8.1f} us  {label:10s} outputs {st.nout}  args "
              + " ".join(f"{d.name}[{n}]" for d, n, _ in k.args))
    if profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            step()
        sync()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0] if args else "cuda", "--profile" in sys.argv, "--split" in sys.argv)
