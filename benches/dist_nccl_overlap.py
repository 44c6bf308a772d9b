"""What DistributedDataParallel over NCCL costs on several GPUs of one machine, and what
overlapping its bucket all-reduces with the backward buys: an MLP of --layers Linear
layers --width wide (ReLU between, SGD), each rank on --batch samples, timed in the same
processes, rounds alternating between

  plain        the step on one GPU, no DDP (what each rank computes)
  DDP overlap  DistributedDataParallel as it is: each bucket's all-reduce starts on
               NCCL's stream as soon as the plan has queued the kernel computing it
  DDP after    the same with `ddp.overlap_reduction = False`: every all-reduce starts
               once the whole backward was computed

plus one all_reduce of the gradients' size alone.

Run:  python benches/dist_nccl_overlap.py [--gpus 2] [--rounds 7] [--steps 10]

It starts one process per GPU with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) and rank 0 prints a markdown table of medians. Where there are
fewer CUDA devices than --gpus or no libnccl it prints why and exits 0 (skipped)."""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args):
    import zyx
    import zyx.distributed as dist
    cuda = [str(d) for d in zyx.devices() if str(d).startswith("cuda")]
    if len(cuda) < args.gpus:
        print(f"dist_nccl_overlap: skipped: {len(cuda)} CUDA device(s), --gpus {args.gpus}")
        return 0
    if not dist.is_nccl_available():
        print("dist_nccl_overlap: skipped: no libnccl")
        return 0
    port = free_port()
    procs = []
    for r in range(args.gpus):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.gpus), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__] + sys.argv[1:], env=env))
    return max(p.wait() for p in procs)


def rank_main(args):
    import zyx
    import zyx.distributed as dist
    import zyx.nn.functional as F
    from zyx import nn
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = f"cuda:{rank}"

    def mlp():
        zyx.manual_seed(0)
        layers = []
        for i in range(args.layers):
            layers += [nn.Linear(args.width, args.width if i < args.layers - 1 else 10)]
            if i < args.layers - 1:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers).to(dev)
    rng = np.random.default_rng(rank)
    x = zyx.Tensor(rng.standard_normal((args.batch, args.width), dtype=np.float32),
                   device=dev)
    y = zyx.Tensor(rng.integers(0, 10, args.batch).astype(np.int64), device=dev)
    plain = mlp()
    ddp_on = nn.parallel.DistributedDataParallel(mlp())
    ddp_off = nn.parallel.DistributedDataParallel(mlp())
    ddp_off.overlap_reduction = False

    def make_step(model):
        opt = zyx.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return step
    steps = {"plain (one GPU, no DDP)": make_step(plain),
             "DDP overlap": make_step(ddp_on), "DDP after backward": make_step(ddp_off)}
    nbytes = sum(p.numel() * p.dtype.itemsize for p in plain.parameters())
    flat = zyx.zeros(nbytes // 4, device=dev).realize()
    steps["all_reduce of the gradients' size alone"] = lambda: dist.all_reduce(flat)
    for fn in steps.values():                  # compile and warm up
        for _ in range(3):
            fn()
    zyx.cuda.synchronize(dev)
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            zyx.cuda.synchronize(dev)
            times[name].append((time.perf_counter() - t0) / args.steps)
    same = all(np.allclose(p.numpy(), q.numpy(), rtol=1e-5, atol=1e-6)
               for p, q in zip(ddp_on.parameters(), ddp_off.parameters()))
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        base = med["plain (one GPU, no DDP)"]
        after = med["DDP after backward"]
        gpu = next((repr(d) for d in zyx.devices() if str(d) == dev), dev)
        print(f"MLP {args.layers} x Linear({args.width}), SGD, batch {args.batch} per rank, "
              f"{world} ranks (NCCL, rank 0 on {gpu}), "
              f"{nbytes / 2**20:.0f} MB of gradients in {len(ddp_on.bucket_sizes)} buckets; "
              f"medians of {args.rounds} rounds x {args.steps} steps; parameters equal with "
              f"and without overlap: {'yes' if same else 'NO'}")
        print("| what | median | min | vs plain | vs DDP after backward |")
        print("| --- | --- | --- | --- | --- |")
        for name, t in med.items():
            if name.startswith("all_reduce"):
                extra = f"{nbytes / t / 1e9:.0f} GB/s | |"
            else:
                extra = f"{t / base:.3f}x | {t / after:.3f}x |"
            print(f"| {name} | {t * 1e3:.3f} ms | {min(times[name]) * 1e3:.3f} ms | {extra}")
    dist.destroy_process_group()
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    return rank_main(args) if "RANK" in os.environ else launch(args)


if __name__ == "__main__":
    sys.exit(main())
