"""Run under `mpirun -np N`: every zyx.distributed collective against numpy, for each
dtype and reduce op. Each rank asserts; any failure exits non-zero (the MPI job fails)."""
import sys

import numpy as np

import zyx
import zyx.distributed as dist
from zyx.distributed import ReduceOp

DTYPES = ["float32", "float64", "int32", "int64", "float16", "bfloat16"]
NP_OPS = {"SUM": np.sum, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max}


def data(rank, dtype, shape=(3, 5), salt=0):
    """Small integers (exact in every dtype, products of 3 ranks included)."""
    rng = np.random.default_rng(100 * rank + salt)
    v = rng.integers(-3, 4, size=shape).astype(np.float64)
    v[v == 0] = 1
    return v


def tensor(v, dtype):
    return zyx.Tensor(v.astype(np.float32 if dtype == "bfloat16" else dtype), dtype=dtype)


def check(got, want, what):
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-2, atol=1e-2):
        print(f"rank {RANK}: {what}: got {got.tolist()} want {want.tolist()}", flush=True)
        sys.exit(1)


def in_place_cases(rank, world):
    """all_reduce's result is the tensor's value; everything else that holds the old value
    or shares the tensor's storage keeps torch's semantics."""
    from zyx.runtime import RT
    total = world * (world + 1) / 2
    mine = lambda: np.full(4 << 10, rank + 1.0, np.float32)  # noqa: E731
    # repeatedly on one tensor: right values, and the result buffers come back to the pool
    # (t's old block is freed when it takes the result): no memory grows per call
    x = zyx.Tensor(mine()).realize()
    held = []
    for k in range(1, 6):
        dist.all_reduce(x)
        check(x.numpy(), np.full(4 << 10, total * world ** (k - 1)), f"repeated all_reduce {k}")
        held.append(RT.pool_bytes())
    assert held[1:] == held[1:2] * 4, f"pool bytes grow per all_reduce: {held}"
    mine = lambda: np.full(4, rank + 1.0, np.float32)  # noqa: E731
    # a lazy op recorded before the all_reduce reads the old values
    x = zyx.Tensor(mine()).realize()
    before = x * 2
    dist.all_reduce(x)
    check(before.numpy(), 2 * mine(), "a lazy reader recorded before all_reduce")
    check(x.numpy(), np.full(4, total), "all_reduce with a lazy reader")
    # a reshape is a view (torch): realized, it even shares the buffer; it sees the result
    x = zyx.Tensor(mine()).realize()
    flat = x.reshape(2, 2).realize()
    dist.all_reduce(x)
    check(flat.numpy(), np.full((2, 2), total), "a realized reshape of the input")
    # memory shared with numpy (from_numpy) and with a DLPack consumer sees the result
    # (shared only when the tensors live on the CPU: with a GPU as the default device,
    # from_numpy copies to it and numpy cannot take a device buffer through DLPack)
    arr = mine()
    shared = zyx.from_numpy(arr)
    dist.all_reduce(shared)
    if shared.device.type == "cpu":
        check(arr, np.full(4, total), "from_numpy memory after all_reduce")
    check(shared.numpy(), np.full(4, total), "from_numpy tensor after all_reduce")
    x = zyx.Tensor(mine()).realize()
    if x.device.type == "cpu":
        peer = np.from_dlpack(x)
        dist.all_reduce(x)
        check(peer, np.full(4, total), "DLPack consumer's view after all_reduce")
    # a detached alias shares storage (torch): it sees the result
    x = zyx.Tensor(mine()).realize()
    alias = x.detach()
    dist.all_reduce(x)
    check(alias.numpy(), np.full(4, total), "detached alias after all_reduce")
    # AVG in place, and an async in-place all_reduce
    x = zyx.Tensor(mine()).realize()
    dist.all_reduce(x, op=ReduceOp.AVG)
    check(x.numpy(), np.full(4, total / world), "in-place AVG")
    x = zyx.Tensor(mine()).realize()
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    check(x.numpy(), np.full(4, total), "async all_reduce of a realized tensor")


def main():
    global RANK
    dist.init_process_group("mpi")
    rank, world = dist.get_rank(), dist.get_world_size()
    RANK = rank
    assert dist.is_initialized() and dist.get_backend() == "mpi"
    everyone = lambda dtype, **k: np.stack([data(r, dtype, **k) for r in range(world)])  # noqa
    for dtype in DTYPES:
        is_float = dtype.startswith(("float", "bfloat"))
        all_v = everyone(dtype)
        ops = list(NP_OPS) + (["AVG"] if is_float else [])
        for op in ops:
            t = tensor(data(rank, dtype), dtype)
            dist.all_reduce(t, op=getattr(ReduceOp, op))
            want = all_v.mean(0) if op == "AVG" else NP_OPS[op](all_v, axis=0)
            assert t.dtype.name == dtype, t.dtype
            check(t.numpy(), want, f"all_reduce {op} {dtype}")
        # async, then the result is read after wait()
        t = tensor(data(rank, dtype), dtype)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        assert w.is_completed()
        check(t.numpy(), all_v.sum(0), f"async all_reduce {dtype}")
        # broadcast from the last rank
        t = tensor(data(rank, dtype), dtype)
        dist.broadcast(t, src=world - 1)
        check(t.numpy(), all_v[world - 1], f"broadcast {dtype}")
        # all_gather into a list, and into one tensor (concatenated and stacked)
        outs = [zyx.zeros(3, 5, dtype=dtype) for _ in range(world)]
        dist.all_gather(outs, tensor(data(rank, dtype), dtype))
        for r in range(world):
            check(outs[r].numpy(), all_v[r], f"all_gather[{r}] {dtype}")
        cat = zyx.zeros(world * 3, 5, dtype=dtype)
        dist.all_gather_into_tensor(cat, tensor(data(rank, dtype), dtype))
        check(cat.numpy(), all_v.reshape(world * 3, 5), f"all_gather_into_tensor {dtype}")
        st = zyx.zeros(world, 3, 5, dtype=dtype)
        dist.all_gather_into_tensor(st, tensor(data(rank, dtype), dtype))
        check(st.numpy(), all_v, f"all_gather_into_tensor stacked {dtype}")
        # reduce_scatter: rank r gets block r of the reduction
        big = everyone(dtype, shape=(world * 2, 3))
        for op in ("SUM", "MAX") + (("AVG",) if is_float else ()):
            out = zyx.zeros(2, 3, dtype=dtype)
            dist.reduce_scatter_tensor(out, tensor(data(rank, dtype, shape=(world * 2, 3)),
                                                   dtype), op=getattr(ReduceOp, op))
            red = big.mean(0) if op == "AVG" else NP_OPS[op](big, axis=0)
            check(out.numpy(), red[2 * rank:2 * rank + 2], f"reduce_scatter_tensor {op} {dtype}")
        out = zyx.zeros(4, dtype=dtype)
        ins = [tensor(data(rank, dtype, shape=(4,), salt=j), dtype) for j in range(world)]
        dist.reduce_scatter(out, ins)
        want = sum(data(r, dtype, shape=(4,), salt=rank) for r in range(world))
        check(out.numpy(), want, f"reduce_scatter {dtype}")
        # send / recv around a ring; isend / irecv the other way
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        got = zyx.zeros(3, 5, dtype=dtype)
        if rank % 2 == 0:
            dist.send(tensor(data(rank, dtype), dtype), nxt)
            src = dist.recv(got, prv)
        else:
            src = dist.recv(got)
            dist.send(tensor(data(rank, dtype), dtype), nxt)
        assert src == prv, (src, prv)
        check(got.numpy(), all_v[prv], f"send/recv {dtype}")
        got = zyx.zeros(3, 5, dtype=dtype)
        ws = dist.isend(tensor(data(rank, dtype), dtype), prv, tag=3)
        wr = dist.irecv(got, nxt, tag=3)
        ws.wait()
        wr.wait()
        check(got.numpy(), all_v[nxt], f"isend/irecv {dtype}")
    # a lazy input, a view written through to its base, a tensor that requires grad
    base = zyx.Tensor(np.zeros((2, 4), np.float32))
    row = base[1]
    row.copy_(zyx.Tensor(np.full(4, rank + 1.0, np.float32)) * 2)
    dist.all_reduce(row)
    check(base.numpy(), np.array([[0] * 4, [world * (world + 1)] * 4], np.float64), "view")
    p = zyx.Tensor(np.full(3, float(rank), np.float32), requires_grad=True)
    dist.broadcast(p, 0)
    check(p.numpy(), np.zeros(3), "broadcast of a leaf that requires grad")
    assert p.requires_grad
    in_place_cases(rank, world)
    # all_reduce_coalesced: a list of mixed dtypes and shapes, one check, every result right
    kinds = (("float32", (3, 5)), ("int32", (4,)), ("float64", ()))
    ts = [tensor(data(rank, d, shape=shape), d) for d, shape in kinds]
    w = dist.all_reduce_coalesced(ts, async_op=True)
    w.wait()
    assert w.is_completed()
    for t, (d, shape) in zip(ts, kinds):
        want = sum(data(r, d, shape=shape) for r in range(world))
        assert t.dtype.name == d
        check(t.numpy(), np.asarray(want), f"all_reduce_coalesced {d}")
    ts = [tensor(data(rank, "float32"), "float32")]
    dist.all_reduce_coalesced(ts, op=ReduceOp.MAX)
    check(ts[0].numpy(), np.stack([data(r, "float32") for r in range(world)]).max(0),
          "all_reduce_coalesced MAX")
    # all_reduce_as_computed: lazy tensors computed in one realization, each reduced in
    # place; one a plain lazy tensor, one that another tensor also reads, one realized
    base = tensor(data(rank, "float32", shape=(4, 5)), "float32")
    lazy = [(base * 2).sum(1), base.exp(), (base - 1).realize()]
    reader = lazy[1] * 1                  # records an op on lazy[1]: not reduced in place
    w = dist.all_reduce_as_computed(lazy)
    w.wait()
    vals = [data(r, "float32", shape=(4, 5)).astype(np.float64) for r in range(world)]
    for t, want in zip(lazy, (sum((v * 2).sum(1) for v in vals), sum(np.exp(v) for v in vals),
                              sum(v - 1 for v in vals))):
        check(t.numpy(), want, "all_reduce_as_computed")
    check(reader.numpy(), np.exp(vals[rank]), "a lazy op recorded before the reduction")
    # 0-d tensors
    s = zyx.Tensor(np.float32(rank + 1))
    dist.all_reduce(s, op=ReduceOp.MAX)
    check(s.numpy(), np.array(float(world)), "0-d all_reduce")
    dist.barrier()
    dist.destroy_process_group()
    assert not dist.is_initialized()
    print(f"rank {rank}: collectives ok", flush=True)


if __name__ == "__main__":
    main()
