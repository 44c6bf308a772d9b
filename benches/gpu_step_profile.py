"""Where a small training step's time goes on a GPU device: the MNIST convnet step of
bench_gpu.py (batch 64, Adam), which is bound by host work, not by the GPU.

    python benches/gpu_step_profile.py [device] [--profile] [--split] [--recipe] [--jit-lm] [--mlp]

(default device: cuda). --torch prints, after zyx's, PyTorch's CUDA kernels for the same
recipe step (torch.profiler, 20 steps), the peer's split of the GPU time. --recipe profiles bench_recipes.py's MNIST convnet instead
(batch 128, two 5x5 convolutions) and, after it, the recipe transformer LM step; --jit-lm
profiles bench_jit.py's LM step (nn.TransformerEncoder, AdamW, gradient clipping); --mlp
bench_gpu.py's MLP step (batch 64) with SGD, then with Adam.

Prints the step's median time (synchronized), the time to build its graph (forward and
backward, nothing realized), the kernels of its plan and the time of each launched
alone (back to back, synchronized: GPU time plus launch), and with --profile the
functions with the most host time (cProfile, 200 steps). --split realizes the gradients
before the optimizer's step (two plans, as DistributedDataParallel runs it)."""
import cProfile
import gc
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


class _GCPauses:
    """Python's garbage collections while it is alive: count and time per generation."""
    def __init__(self):
        self.n, self.t, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.n[g] += 1
            self.t[g] += time.perf_counter() - self._t0

    def stop(self):
        gc.callbacks.remove(self._cb)

    def __str__(self):
        return "gc collections by generation " + ", ".join(
            f"{n} ({t * 1e3:.1f} ms)" for n, t in zip(self.n, self.t)) + \
            f", {len(gc.get_objects())} objects tracked"


def _bench_convnet():
    import bench_gpu as bg
    model = bg._zyx_convnet()
    rng = np.random.default_rng(0)
    x = zyx.tensor(rng.standard_normal((bg.B, 1, 28, 28), dtype=np.float32))
    y = zyx.tensor(rng.integers(0, 10, bg.B, dtype=np.int32))   # (WebGPU: no int64)
    return "convnet step", model, optim.Adam(model.parameters(), lr=1e-3), x, y, \
        lambda out, y: F.cross_entropy(out, y)


def _bench_mlp(opt_name):
    import bench_gpu as bg
    model = zyx.nn.Sequential(zyx.nn.Linear(bg.D, bg.H), zyx.nn.ReLU(), zyx.nn.Linear(bg.H, bg.C))
    rng = np.random.default_rng(0)
    x = zyx.tensor(rng.standard_normal((bg.B, bg.D), dtype=np.float32))
    y = zyx.tensor(rng.integers(0, bg.C, bg.B, dtype=np.int32))   # (WebGPU: no int64)
    opt = (optim.SGD if opt_name == "sgd" else optim.Adam)(model.parameters(),
                                                            lr=bg.LR[opt_name])
    return f"MLP {opt_name} step", model, opt, x, y, lambda out, y: F.cross_entropy(out, y)


def _recipe_convnet():
    from bench_conv import _convnet, _mnist_batch
    model = _convnet(zyx.nn)
    xn, yn = _mnist_batch()
    return "recipe convnet step", model, optim.Adam(model.parameters(), lr=1e-3), \
        zyx.tensor(xn), zyx.tensor(yn), lambda out, y: F.cross_entropy(out, y)


def _recipe_lm():
    import recipe_lm as R
    model = R.make_model(zyx, zyx.get_default_device())
    model.train()
    codes = R.text_codes()
    ix = np.random.default_rng(0).integers(0, len(codes) - R.T - 1, R.B)
    x = zyx.tensor(np.stack([codes[i:i + R.T] for i in ix]))
    y = zyx.tensor(np.stack([codes[i + 1:i + R.T + 1] for i in ix]))
    return "recipe LM step (no clipping)", model, optim.AdamW(model.parameters(), lr=R.LR), \
        x, y, lambda out, y: F.cross_entropy(out.view(-1, R.VOCAB), y.view(-1))


class _Clipped:
    """An optimizer whose step clips the gradients' total norm at 1.0 first."""
    def __init__(self, opt, params):
        self.opt, self.params = opt, list(params)

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self):
        zyx.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()


def _jit_lm():
    import bench_jit as bj
    model = bj.language_model(zyx)
    xn, yn = bj._lm_data(np.random.default_rng(0))
    mask = zyx.tensor(np.triu(np.ones((bj.T, bj.T), bool), 1))
    n = bj.B_LM * bj.T
    return "bench_jit LM step (TransformerEncoder, clipping)", model, \
        _Clipped(optim.AdamW(model.parameters(), lr=1e-3), model.parameters()), \
        zyx.tensor(xn), zyx.tensor(yn), \
        lambda out, y: F.cross_entropy(out.reshape(n, bj.VOCAB), y.reshape(n)), \
        lambda x: model(x, mask)


def main(name="cuda", profile=False, split=False, make=_bench_convnet):
    zyx.set_default_device(name)
    zyx.manual_seed(0)
    what, model, opt, x, y, loss_fn, *forward = make()
    call = forward[0] if forward else model

    def graph():
        loss = loss_fn(call(x), y)
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
    ts, pauses = [], _GCPauses()
    for _ in range(50):
        t0 = time.perf_counter()
        step()
        sync()
        ts.append(time.perf_counter() - t0)
    pauses.stop()
    print(f"{name}: {what}{' (gradients, then the update)' if split else ''} "
          f"{statistics.median(ts) * 1e3:.3f} ms (synchronized, median of 50; mean "
          f"{statistics.mean(ts) * 1e3:.3f} ms); {pauses}")
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
    for t, st in sorted(rows, key=lambda r: -r[0])[:16]:
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


def torch_kernels(recipe):
    """PyTorch's CUDA kernel times for one recipe step ("convnet" or "lm"), the slowest
    first: the GPU time zyx's kernels compete with."""
    import torch
    import bench_recipes as br
    torch.manual_seed(0)
    if recipe == "convnet":
        step = br._convnet_step(torch, torch.nn.functional.cross_entropy, "cuda")
    else:
        step = br._lm_fixed(torch, "cuda")
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile as tprofile
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in rows) / 20
    print(f"torch cuda: recipe {recipe} step, GPU time per step {total / 1e3:.3f} ms "
          f"in {sum(e.count for e in rows) // 20} kernels; the slowest:")
    for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:10]:
        print(f"  {e.self_device_time_total / 20:8.1f} us  x{e.count // 20}  {e.key[:90]}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dev = args[0] if args else "cuda"
    if "--recipe" in sys.argv:
        for make, recipe in ((_recipe_convnet, "convnet"), (_recipe_lm, "lm")):
            main(dev, "--profile" in sys.argv, "--split" in sys.argv, make)
            if "--torch" in sys.argv:
                torch_kernels(recipe)
    elif "--mlp" in sys.argv:
        for name in ("sgd", "adam"):
            main(dev, "--profile" in sys.argv, "--split" in sys.argv,
                 lambda: _bench_mlp(name))
    elif "--jit-lm" in sys.argv:
        main(dev, "--profile" in sys.argv, "--split" in sys.argv, _jit_lm)
    else:
        main(dev, "--profile" in sys.argv, "--split" in sys.argv)
