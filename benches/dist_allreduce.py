"""zyx.distributed's speed on the CPU under MPI. Launch with mpirun:

    mpirun -np 2 python benches/dist_allreduce.py [--sizes-mb 1 4 16 64 256] [--repeats 5]

Prints, from rank 0, medians over --repeats runs:
- all-reduce of float32 buffers of 1 MB to 256 MB: zyx.distributed.all_reduce on a zyx
  tensor (with the cross-rank argument check, and without), and mpi4py's Allreduce on
  numpy arrays (the peer: the same MPI underneath, nothing of zyx) in the same run.
  Algorithm bandwidth = bytes / time; bus bandwidth = algbw * 2 (n-1) / n (what each
  link carries in a ring, comparable across world sizes, as nccl-tests report it).
- the argument check's own cost: a 4-byte all_reduce with and without it.
- DDP overhead: one training step of a 784-1024-1024-10 MLP (SGD) with each rank on half
  of a batch, DistributedDataParallel against the same step without DDP on the same half
  batch (run by every rank at the same time, so both see the same CPU contention).
"""
import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import zyx
import zyx.distributed as dist
import zyx.nn.functional as F
from zyx import nn


def timed(fn, iters):
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = (time.perf_counter() - t0) / iters
    return MPI.COMM_WORLD.allreduce(dt, op=MPI.MAX)     # the slowest rank's time


def bench_allreduce(sizes_mb, repeats, world, out):
    comm = MPI.COMM_WORLD
    for mb in sizes_mb:
        n = int(mb * (1 << 20)) // 4
        iters = max(2, min(50, int(64 // mb)))
        arr = np.ones(n, np.float32)
        recv = np.empty_like(arr)
        x = zyx.Tensor(arr).realize()
        rows = {"mpi4py": [], "zyx": [], "zyx, no check": []}
        for _ in range(repeats):
            rows["mpi4py"].append(timed(lambda: comm.Allreduce(arr, recv, op=MPI.SUM), iters))
            dist.set_collective_checks(True)
            rows["zyx"].append(timed(lambda: dist.all_reduce(x), iters))
            dist.set_collective_checks(False)
            rows["zyx, no check"].append(timed(lambda: dist.all_reduce(x), iters))
        dist.set_collective_checks(True)
        for name, ts in rows.items():
            t = statistics.median(ts)
            alg = n * 4 / t / 1e9
            out.append(f"| all_reduce {mb:g} MB | {name} | {t * 1e3:.2f} ms | {alg:.2f} GB/s | "
                       f"{alg * 2 * (world - 1) / world:.2f} GB/s |")


def bench_check(repeats, out):
    x = zyx.Tensor(np.ones(1, np.float32)).realize()
    res = {}
    for on in (True, False):
        dist.set_collective_checks(on)
        res[on] = statistics.median(timed(lambda: dist.all_reduce(x), 200)
                                    for _ in range(repeats))
    dist.set_collective_checks(True)
    out.append(f"| all_reduce 4 B | with check | {res[True] * 1e6:.1f} us | | |")
    out.append(f"| all_reduce 4 B | no check | {res[False] * 1e6:.1f} us | | |")


def bench_ddp(repeats, rank, out, half=64, steps=10):
    rng = np.random.default_rng(rank)
    x = zyx.Tensor(rng.standard_normal((half, 784)).astype(np.float32))
    y = zyx.Tensor(rng.integers(0, 10, half).astype(np.int64))

    def build():
        zyx.manual_seed(0)
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                             nn.ReLU(), nn.Linear(1024, 10))
    plain = build()
    ddp = nn.parallel.DistributedDataParallel(build())
    res = {}
    for name, m in (("plain, half batch", plain), ("DDP, half batch per rank", ddp)):
        opt = zyx.optim.SGD(m.parameters(), lr=0.01)

        def step():
            F.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        for _ in range(3):
            step()                                       # compile, settle
        res[name] = statistics.median(timed(step, steps) for _ in range(repeats))
    base = res["plain, half batch"]
    for name, t in res.items():
        out.append(f"| MLP 784-1024-1024-10 step | {name} | {t * 1e3:.2f} ms | "
                   f"{t / base:.2f}x | |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=float, nargs="*", default=[1, 4, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("mpi")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [f"{world} ranks, Open MPI {'.'.join(map(str, MPI.Get_version()))} "
           f"({MPI.Get_library_version().splitlines()[0].strip()}), medians of "
           f"{args.repeats}",
           "| what | how | time | algbw (or ratio) | busbw |", "| --- | --- | --- | --- | --- |"]
    bench_allreduce(args.sizes_mb, args.repeats, world, out)
    bench_check(args.repeats, out)
    bench_ddp(args.repeats, rank, out)
    if rank == 0:
        print("\n".join(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
