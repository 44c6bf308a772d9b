"""NCCL over several GPUs of one machine, ranks started by tests/test_distributed.py with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): the
TCPStore rendezvous, collectives against numpy, the argument check, and a DDP step with
each rank on its share of the batch against one process on the whole batch."""
import sys

import numpy as np

import zyx
import zyx.distributed as dist
import zyx.nn.functional as F
from zyx import nn
from zyx.distributed import ReduceOp


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = f"cuda:{rank}"
    vals = [np.arange(12).reshape(3, 4).astype(np.float64) - 5 + r for r in range(world)]
    for dtype in ("float32", "float64", "float16", "bfloat16", "int32", "int64"):
        make = lambda v: zyx.Tensor(v.astype(np.float32 if dtype == "bfloat16" else dtype),  # noqa
                                    dtype=dtype, device=dev)
        for op, ref in (("SUM", np.sum), ("MAX", np.max), ("MIN", np.min)):
            t = make(vals[rank])
            dist.all_reduce(t, op=getattr(ReduceOp, op))
            np.testing.assert_allclose(t.numpy(), ref(np.stack(vals), 0), rtol=1e-2,
                                       err_msg=f"{op} {dtype}")
        t = make(vals[rank])
        dist.broadcast(t, world - 1)
        np.testing.assert_allclose(t.numpy(), vals[-1])
        outs = [zyx.zeros(3, 4, dtype=dtype, device=dev) for _ in range(world)]
        dist.all_gather(outs, make(vals[rank]))
        for r in range(world):
            np.testing.assert_allclose(outs[r].numpy(), vals[r])
        out = zyx.zeros(1, 4, dtype=dtype, device=dev)
        big = [np.arange(4 * world).reshape(world, 4).astype(np.float64) * (r + 1)
               for r in range(world)]
        dist.reduce_scatter_tensor(out, make(big[rank]))
        np.testing.assert_allclose(out.numpy(), sum(big)[rank:rank + 1], rtol=1e-2)
        got = zyx.zeros(3, 4, dtype=dtype, device=dev)
        if rank == 0:
            dist.send(make(vals[0]), 1)
        elif rank == 1:
            dist.recv(got, 0)
            np.testing.assert_allclose(got.numpy(), vals[0])
    try:
        dist.all_reduce(zyx.ones(3 + rank, device=dev))
    except dist.DistributedError as e:
        assert "(3,)" in str(e) and "(4,)" in str(e), e
    else:
        raise AssertionError("mismatched shapes did not raise")
    # all_reduce_as_computed between GPUs: lazy values, reduced as each one is computed
    base = zyx.Tensor(vals[rank].astype(np.float32), device=dev)
    lazy = [(base * 2).sum(1), base.exp(), (base - 1).realize()]
    dist.all_reduce_as_computed(lazy).wait()
    for t, want in zip(lazy, (sum((v * 2).sum(1) for v in vals), sum(np.exp(v) for v in vals),
                              sum(v - 1 for v in vals))):
        np.testing.assert_allclose(t.numpy(), want, rtol=1e-5, err_msg="as_computed")
    zyx.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).to(dev)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).to(dev)
    model.load_state_dict({k: v.detach() for k, v in ref.state_dict().items()})
    ddp = nn.parallel.DistributedDataParallel(model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * world, 6)).astype(np.float32)
    y = rng.integers(0, 2, 4 * world).astype(np.int64)
    mine = slice(4 * rank, 4 * rank + 4)
    opts = [zyx.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ref)]
    F.cross_entropy(ddp(zyx.Tensor(x[mine], device=dev)),
                    zyx.Tensor(y[mine], device=dev)).backward()
    F.cross_entropy(ref(zyx.Tensor(x, device=dev)), zyx.Tensor(y, device=dev)).backward()
    for o in opts:
        o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-3, atol=1e-4)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: nccl ranks ok", flush=True)


if __name__ == "__main__":
    sys.exit(main())
