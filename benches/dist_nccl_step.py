"""What DistributedDataParallel over NCCL adds to a training step on one GPU (world size 1,
where NCCL's all-reduce is a device copy): the MNIST convnet of bench_conv.py (Conv 1-32-5,
32-32-5, maxpool, 32-64-3, maxpool, Linear 1024-10), batch 128, Adam, timed plain and
wrapped in DDP in the same process, rounds alternating between the two so both see the
same GPU state; plus one all_reduce of the gradients' size alone.

Run:  python benches/dist_nccl_step.py [--rounds 7] [--steps 20]

It sets the launcher's variables itself (RANK=0, WORLD_SIZE=1, LOCAL_RANK=0,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT) and prints a markdown table of medians. Where
there is no CUDA device or no libnccl it prints why and exits 0 (skipped)."""
import argparse
import os
import socket
import statistics
import sys
import time

import numpy as np

import zyx
import zyx.distributed as dist
import zyx.nn.functional as F
from zyx import nn


def convnet():
    return nn.Sequential(nn.Conv2d(1, 32, 5), nn.ReLU(), nn.Conv2d(32, 32, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 4 * 4, 10))


def skip_reason():
    """Why this machine cannot run the benchmark, or None."""
    try:
        names = [str(d) for d in zyx.devices()]
    except Exception as e:          # no backend at all
        return f"no zyx device ({e})"
    if not any(n.startswith("cuda") for n in names):
        return f"no CUDA device (zyx.devices(): {', '.join(names) or 'none'})"
    if not dist.is_nccl_available():
        return "no libnccl (pip install nvidia-nccl-cu12 or nvidia-nccl-cu13)"
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_step(model, x, y):
    opt = zyx.optim.Adam(model.parameters(), 1e-3)

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()          # reads the loss: the step's work has run
    return step


def per_step(fn, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    why = skip_reason()
    if why is not None:
        print(f"dist_nccl_step: skipped: {why}")
        return 0
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl")
    dev = "cuda:0"
    rng = np.random.default_rng(0)
    x = zyx.Tensor(rng.standard_normal((128, 1, 28, 28), dtype=np.float32), device=dev)
    y = zyx.Tensor(rng.integers(0, 10, 128).astype(np.int64), device=dev)
    zyx.manual_seed(0)
    plain = convnet().to(dev)
    zyx.manual_seed(0)
    wrapped = nn.parallel.DistributedDataParallel(convnet().to(dev))
    steps = {"plain": make_step(plain, x, y),
             "DDP (nccl, world size 1)": make_step(wrapped, x, y)}
    losses = {name: [fn() for _ in range(3)] for name, fn in steps.items()}   # compile
    same = np.allclose(*losses.values(), rtol=1e-4)
    nbytes = sum(p.numel() * p.dtype.itemsize for p in plain.parameters())
    flat = zyx.zeros(nbytes // 4, device=dev).realize()

    def reduce_once():
        dist.all_reduce(flat)
        zyx.cuda.synchronize(dev)
    reduce_once()
    times = {name: [] for name in steps}
    times["all_reduce alone"] = []
    for _ in range(args.rounds):
        for name, fn in steps.items():
            times[name].append(per_step(fn, args.steps))
        times["all_reduce alone"].append(per_step(reduce_once, args.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["plain"]
    gpu = next((repr(d) for d in zyx.devices() if str(d) == dev), dev)
    print(f"MNIST convnet Adam step, batch 128, {gpu}, NCCL {dist_nccl_version()}, "
          f"medians of {args.rounds} rounds x {args.steps} steps; the first 3 steps' "
          f"losses equal with and without DDP: {'yes' if same else 'NO'}")
    print("| what | median | min | vs plain |")
    print("| --- | --- | --- | --- |")
    for name, t in med.items():
        extra = (f"+{(t - base) * 1e3:.3f} ms ({t / base:.3f}x)" if name.startswith("DDP")
                 else ("1.00x" if name == "plain" else
                       f"{nbytes / 2**20:.2f} MB ({nbytes / t / 1e9:.1f} GB/s)"))
        print(f"| {name} | {t * 1e3:.3f} ms | {min(times[name]) * 1e3:.3f} ms | {extra} |")
    dist.destroy_process_group()
    return 0


def dist_nccl_version():
    from zyx.distributed import nccl
    v = nccl.version()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


if __name__ == "__main__":
    sys.exit(main())
