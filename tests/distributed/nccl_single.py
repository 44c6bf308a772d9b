"""NCCL with one rank (world size 1), on a machine with a CUDA GPU and libnccl: the
communicator, every collective against numpy for each dtype, and a DDP training step
against a plain one. Run by tests/test_distributed.py (and .ci/gpu_run.sh nccl)."""
import os
import sys

import numpy as np

import zyx
import zyx.distributed as dist
import zyx.nn.functional as F
from zyx import nn
from zyx.distributed import ReduceOp

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def main():
    dist.init_process_group("nccl")
    assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
    dev = "cuda:0"
    for dtype in ("float32", "float64", "float16", "bfloat16", "int32", "int64"):
        v = np.arange(-6, 6).reshape(3, 4).astype(np.float64)
        make = lambda: zyx.Tensor(v.astype(np.float32 if dtype == "bfloat16" else dtype),  # noqa
                                  dtype=dtype, device=dev)
        ops = ["SUM", "PRODUCT", "MIN", "MAX"] + (["AVG"] if "float" in dtype else [])
        for op in ops:
            t = make()
            w = dist.all_reduce(t, op=getattr(ReduceOp, op), async_op=(op == "SUM"))
            if w is not None:
                w.wait()
            assert str(t.device) == dev and t.dtype.name == dtype
            np.testing.assert_allclose(t.numpy(), v, err_msg=f"all_reduce {op} {dtype}")
        t = make()
        dist.broadcast(t, 0)
        np.testing.assert_allclose(t.numpy(), v)
        outs = [zyx.zeros(3, 4, dtype=dtype, device=dev)]
        dist.all_gather(outs, make())
        np.testing.assert_allclose(outs[0].numpy(), v)
        out = zyx.zeros(3, 4, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, make())
        np.testing.assert_allclose(out.numpy(), v)
        out = zyx.zeros(3, 4, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(out, make())
        np.testing.assert_allclose(out.numpy(), v)
        out = zyx.zeros(3, 4, dtype=dtype, device=dev)
        dist.reduce_scatter(out, [make()])
        np.testing.assert_allclose(out.numpy(), v)
    dist.barrier()
    # the watchdog: a non-blocking communicator where NCCL has it, every collective
    # tracked and found done at the next host wait; an owned tensor reduced in place
    from zyx.distributed.group import State
    backend = State.group.backend
    assert hasattr(backend.lib, "ncclCommInitRankConfig"), "NCCL < 2.14: no non-blocking init"
    x = zyx.Tensor(np.arange(6, dtype=np.float32), device=dev).realize()
    node = x._id
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    assert w.is_completed() and x._id == node, "owned tensor not reduced in place"
    for _ in range(3):
        dist.all_reduce(x)
    np.testing.assert_allclose(x.numpy(), np.arange(6))
    assert not backend.watchdog.pending and backend.watchdog.aborted is None
    # all_reduce_as_computed: each tensor reduced on the side stream once its kernel is
    # queued, in place where nothing else reads it, else into a buffer of its own
    base = zyx.Tensor(np.arange(20, dtype=np.float32).reshape(4, 5) / 10, device=dev)
    lazy = [(base * 2).sum(1), base.exp(), (base - 1).realize()]
    reader = lazy[1] * 1
    dist.all_reduce_as_computed(lazy).wait()
    b = np.arange(20, dtype=np.float64).reshape(4, 5) / 10
    for t, want in zip(lazy + [reader], ((b * 2).sum(1), np.exp(b), b - 1, np.exp(b))):
        np.testing.assert_allclose(t.numpy(), want, rtol=1e-5, err_msg="as_computed")
    with_int8 = [zyx.ones(3, dtype="int8", device=dev) * 2]
    try:
        dist.all_reduce_as_computed(with_int8)
    except dist.DistributedError as e:
        assert "int8" in str(e), e
    else:
        raise AssertionError("an int8 tensor was not refused")
    # a DDP step equals a plain step
    zyx.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).to(dev)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).to(dev)
    model.load_state_dict({k: v.detach() for k, v in ref.state_dict().items()})
    ddp = nn.parallel.DistributedDataParallel(model)
    opts = [zyx.optim.Adam(m.parameters(), lr=1e-2) for m in (ddp, ref)]
    x = zyx.Tensor(np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32),
                   device=dev)
    y = zyx.Tensor(np.array([0, 1, 1, 0, 1], np.int64), device=dev)
    for m, opt in zip((ddp, ref), opts):
        F.cross_entropy(m(x), y).backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-5, atol=1e-6)
    dist.destroy_process_group()
    print("nccl world size 1 ok", flush=True)


if __name__ == "__main__":
    sys.exit(main())
