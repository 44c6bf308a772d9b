"""A/B timing of one module-level setting on whole training steps, the values taking
turns in one process (so they share the same seconds of a shared machine).

    python benches/flag_ab.py zyx._core.kernelizer.MULTI_OUTPUT True,False \
        --workloads transformer,convnet,mlp [--device cuda] [--rounds 4]

(The register-tile knobs live in zyx.codegen.heuristics: CHANNEL_LANES, MERGE_REDUCES,
ALIASED_ROWS, SET_STRIDE, UNROLL_MIN_REDUCE, REDUCE_LANES_BELOW.)

Each round, for each value: set it, drop the plan cache and the compiled programs (so the
kernels are built anew under it), run 3 warm-up steps, then time `--steps` steps. Prints
the median step time per value and per workload, and the ratio to the first value.
Workloads: transformer (benches/bench_transformer.py), convnet (the MNIST convnet of
bench_conv.py, batch 128), mlp (bench_train.py, Adam), lstm (bench_rnn.py), and on a GPU
device gpu-convnet / gpu-mlp (bench_gpu.py's models) and gpu-conv / gpu-conv-bf16
(bench_gpu.py's 64x64x56x56 3x3 convolution forward); row ops on 4096x1024: softmax,
log_softmax, row-max, and causal-softmax (32x4x64x64 with a -inf mask)."""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zyx  # noqa: E402
from zyx import nn  # noqa: E402
import bench_tuning  # noqa: E402  (the convnet workload and the PyTorch-habit step)


def transformer():
    import bench_transformer as bt
    zyx.manual_seed(0)
    model = bt.char_transformer(zyx)
    opt = zyx.optim.AdamW(model.parameters(), 1e-3)
    mask = zyx.tensor(bt._causal_mask_numpy())
    batches = [(zyx.tensor(x), zyx.tensor(y)) for x, y in bt._batches()]
    step, it = bt._zyx_step(model, opt, mask), iter(range(1 << 30))
    return lambda: step(*batches[next(it) % len(batches)]).item()


def convnet():
    return bench_tuning._setup()     # (its MNIST convnet step, the one bench_conv times)


def mlp():
    import bench_train as bt
    step, loss = bt.make_zyx(bt.init_weights(), "adam")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((bt.B, bt.D)).astype(np.float32)
    y = rng.integers(0, bt.C, bt.B)
    return lambda: (step(x, y), loss())


def lstm():
    import bench_rnn as br
    step = br._zyx_step()
    return lambda: step().item()


def gpu_convnet():
    import bench_gpu as bg
    zyx.manual_seed(0)
    model = bg._zyx_convnet()
    rng = np.random.default_rng(0)
    x = zyx.tensor(rng.standard_normal((bg.B, 1, 28, 28), dtype=np.float32))
    y = zyx.tensor(rng.integers(0, 10, bg.B))
    return bench_tuning._item_step(model, zyx.optim.Adam(model.parameters(), 1e-3), x, y)


def gpu_mlp():
    import bench_gpu as bg
    zyx.manual_seed(0)
    model = nn.Sequential(nn.Linear(bg.D, bg.H), nn.ReLU(), nn.Linear(bg.H, bg.C))
    (xn, yn), = bg._batches(1)
    return bench_tuning._item_step(model, zyx.optim.Adam(model.parameters(), 1e-3),
                      zyx.tensor(xn), zyx.tensor(yn))


def gpu_conv(dtype="float32"):
    """bench_gpu's conv2d (64x64x56x56, 3x3, padding 1) forward, waited for."""
    import zyx.nn.functional as F
    rng = np.random.default_rng(0)
    x = zyx.tensor(rng.standard_normal((64, 64, 56, 56), dtype=np.float32)).cast(dtype)
    w = zyx.tensor(rng.standard_normal((64, 64, 3, 3), dtype=np.float32) * 0.05).cast(dtype)
    return lambda: (F.conv2d(x, w, padding=1).realize(), zyx.synchronize())


def _rows(fn, shape=(4096, 1024)):
    """A row op on one realized random tensor (bench_rowwise's shape)."""
    x = zyx.tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    return lambda: fn(x).realize()


def causal_softmax():
    mask = zyx.tensor(np.triu(np.full((64, 64), -np.inf, np.float32), 1))
    return _rows(lambda s: (s + mask).softmax(-1), (32, 4, 64, 64))


WORKLOADS = {"transformer": transformer, "convnet": convnet, "mlp": mlp, "lstm": lstm,
             "gpu-convnet": gpu_convnet, "gpu-mlp": gpu_mlp, "gpu-conv": gpu_conv,
             "gpu-conv-bf16": lambda: gpu_conv("bfloat16"),
             "softmax": lambda: _rows(lambda x: x.softmax(-1)),
             "log_softmax": lambda: _rows(lambda x: x.log_softmax(-1)),
             "row-max": lambda: _rows(lambda x: x.amax(-1)),
             "causal-softmax": causal_softmax}
STEPS = {"mlp": 30, "lstm": 30, "gpu-convnet": 30, "gpu-mlp": 30, "gpu-conv": 30,
         "gpu-conv-bf16": 30, "softmax": 30,
         "log_softmax": 30, "row-max": 30, "causal-softmax": 30}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("setting", help="module.NAME, e.g. zyx.codegen.cpu.render.UNROLL_ROWS")
    ap.add_argument("values", help="comma-separated Python literals, the first the baseline")
    ap.add_argument("--workloads", default="transformer,convnet,mlp")
    ap.add_argument("--device", default=None, help="default device (e.g. cuda)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=0, help="timed steps per round (0: auto)")
    args = ap.parse_args(argv)
    modname, name = args.setting.rsplit(".", 1)
    module = importlib.import_module(modname)
    if not hasattr(module, name):
        ap.error(f"{modname} has no setting {name}")
    values = [eval(v, {}) for v in args.values.split(",")]
    if args.device:
        zyx.set_default_device(args.device)
    rt = zyx._RT
    dev = rt.device()
    print(f"{args.setting}: {values} on {dev.info().name}", flush=True)
    for w in args.workloads.split(","):
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w}: one of {', '.join(WORKLOADS)}")
        step = WORKLOADS[w]()
        n = args.steps or STEPS.get(w, 5)
        times = {i: [] for i in range(len(values))}
        for _ in range(args.rounds):
            for i, v in enumerate(values):
                setattr(module, name, v)
                rt.plans.clear()
                for prog in list(getattr(dev, "_programs", {}).values()):
                    dev.release(prog)
                getattr(dev, "_programs", {}).clear()
                for _ in range(3):
                    step()
                for _ in range(n):
                    t0 = time.perf_counter()
                    step()
                    times[i].append(time.perf_counter() - t0)
        base = statistics.median(times[0])
        cells = [f"{values[i]!r}: {statistics.median(t) * 1e3:.3f} ms "
                 f"({statistics.median(t) / base:.2f}x)" for i, t in times.items()]
        print(f"{w:12s} " + "  ".join(cells), flush=True)
    setattr(module, name, values[0])


if __name__ == "__main__":
    main()
