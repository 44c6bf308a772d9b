"""Run under `mpirun -np 2`: DistributedDataParallel with each rank on half the batch
matches one process on the whole batch (checked on every rank, which also trains the
single-process reference itself): an MLP for 20 steps with SGD and with Adam, a convnet
step, and no_sync() gradient accumulation. Usage: ddp.py sgd|adam|conv|no_sync"""
import sys

import numpy as np

import zyx
import zyx.distributed as dist
import zyx.nn.functional as F
from zyx import nn
from zyx.nn.parallel import DistributedDataParallel as DDP


def mlp():
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def convnet():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 3))


def make_opt(name, params):
    if name == "adam":
        return zyx.optim.Adam(params, lr=1e-2)
    return zyx.optim.SGD(params, lr=0.1, momentum=0.9)


def same(a, b, what, rtol=1e-4, atol=1e-5):
    for (n, x), y in zip(a.named_parameters(), b.parameters()):
        if not np.allclose(x.numpy(), y.numpy(), rtol=rtol, atol=atol):
            print(f"rank {dist.get_rank()}: {what}: {n} differs by "
                  f"{np.abs(x.numpy() - y.numpy()).max()}", flush=True)
            sys.exit(1)


def main(mode):
    # the CPU path: on a GPU machine the default device would be the GPU, whose TF32
    # products differ between half and whole batches by more than float32 tolerance
    zyx.set_default_device("cpu")
    dist.init_process_group("mpi")
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(7)
    build = convnet if mode == "conv" else mlp
    zyx.manual_seed(1)
    ref = build()
    zyx.manual_seed(1 + rank)            # other ranks start elsewhere: DDP broadcasts rank 0's
    model = build()
    ref.load_state_dict({k: v.detach() for k, v in ref.state_dict().items()})
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets even for this small model
    assert ddp.module is model and len(ddp.bucket_sizes) > 1, ddp.bucket_sizes
    same(model, ref, "parameters after wrapping")
    opt = make_opt("sgd" if mode in ("conv", "no_sync") else mode, ddp.parameters())
    ref_opt = make_opt("sgd" if mode in ("conv", "no_sync") else mode, ref.parameters())
    steps = {"conv": 2, "no_sync": 5}.get(mode, 20)
    batch = 8 * world
    for step in range(steps):
        if mode == "conv":
            x = rng.standard_normal((batch, 2, 6, 6)).astype(np.float32)
        else:
            x = rng.standard_normal((batch, 12)).astype(np.float32)
        y = rng.integers(0, 3, batch).astype(np.int64)
        mine = slice(rank * 8, rank * 8 + 8)
        if mode == "no_sync":
            # two micro-batches: the first without synchronisation, the second with
            halves = (slice(rank * 8, rank * 8 + 4), slice(rank * 8 + 4, rank * 8 + 8))
            with ddp.no_sync():
                F.cross_entropy(ddp(zyx.Tensor(x[halves[0]])), zyx.Tensor(y[halves[0]])).backward()
            g_local = model[0].weight.grad.numpy()
            F.cross_entropy(ddp(zyx.Tensor(x[halves[1]])), zyx.Tensor(y[halves[1]])).backward()
            for k in range(2):
                rows = np.concatenate([np.arange(r * 8 + 4 * k, r * 8 + 4 * k + 4)
                                       for r in range(world)])
                F.cross_entropy(ref(zyx.Tensor(x[rows])), zyx.Tensor(y[rows])).backward()
            if step == 0:
                assert not np.allclose(g_local, ref[0].weight.grad.numpy()), \
                    "no_sync gradient was averaged"
        else:
            loss = F.cross_entropy(ddp(zyx.Tensor(x[mine])), zyx.Tensor(y[mine]))
            loss.backward()
            F.cross_entropy(ref(zyx.Tensor(x)), zyx.Tensor(y)).backward()
        # .grad is the average as soon as backward() returns (torch's semantics)
        for p, q in zip(model.parameters(), ref.parameters()):
            if not np.allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-4, atol=1e-6):
                print(f"rank {rank}: step {step}: gradient differs", flush=True)
                sys.exit(1)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    same(model, ref, f"{mode}: parameters after {steps} steps")
    dist.destroy_process_group()
    print(f"rank {rank}: ddp {mode} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
