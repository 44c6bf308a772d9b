"""`RT.realize(ids, ready=...)`: a callback per target, called once as soon as the kernel
computing it was queued, while the plan's later kernels are still to be queued (what
`zyx.distributed.all_reduce_as_computed` and DistributedDataParallel start their
reductions from). Checked on the default device, kernel by kernel on the dummy device, on
OpenCL's prepared launches (PoCL in CI) and, in tests/test_cuda.py, between CUDA graph
pieces."""
import numpy as np
import pytest

import zyx
from zyx.runtime import RT

A = np.linspace(0.1, 1, 64).astype(np.float32)


def _chain(a):
    """Three reductions, each reading the one before: three kernels in a fixed order."""
    x = (a * 2).exp().sum()
    y = (a * x).sum()
    z = (a + y).max()
    return x, y, z


def _expected():
    x = np.exp(A.astype(np.float64) * 2).sum()
    y = (A * x).sum()
    return x, y, (A + y).max()


def _recorder(log, name, probe=lambda: None):
    def ready(buffer, fresh):
        log.append((name, fresh, probe()))
        assert buffer is not None
    return ready


def test_ready_calls_each_target_once_in_the_order_computed():
    a = zyx.tensor(A)
    leaf = zyx.tensor(A[:8])
    for _ in range(3):                       # a new plan, then the cached one
        x, y, z = _chain(a)
        alias = leaf.reshape(2, 4)           # a leaf's own buffer: not fresh
        log = []
        RT.realize([z._id, x._id, y._id, alias._id, leaf._id],
                   ready={z._id: _recorder(log, "z"), x._id: _recorder(log, "x"),
                          y._id: _recorder(log, "y"), leaf._id: _recorder(log, "leaf")})
        names = [n for n, _, _ in log]
        assert sorted(names) == ["leaf", "x", "y", "z"]
        assert names.index("x") < names.index("y") < names.index("z")
        assert dict((n, f) for n, f, _ in log) == {"leaf": False, "x": True, "y": True,
                                                    "z": True}
        for got, want in zip((x, y, z), _expected()):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)


def test_ready_for_a_target_that_is_already_computed_or_shared():
    a = zyx.tensor(A)
    done = (a * 3).realize()
    twice = a * 5
    view = twice.reshape(8, 8)               # a second target over the same buffer
    log = []
    RT.realize([done._id, twice._id, view._id],
               ready={done._id: _recorder(log, "done"), twice._id: _recorder(log, "twice"),
                      view._id: _recorder(log, "view")})
    assert sorted(log) == [("done", False, None), ("twice", False, None),
                           ("view", False, None)]
    np.testing.assert_allclose(view.numpy(), (A * 5).reshape(8, 8), rtol=1e-6)
    # the reshape of a value computed in the same run, which only it keeps: its own
    alone = (a * 7).exp().reshape(8, 8)
    log = []
    RT.realize([alone._id], ready={alone._id: _recorder(log, "alone")})
    assert log == [("alone", True, None)]
    np.testing.assert_allclose(alone.numpy(), np.exp(A * 7).reshape(8, 8), rtol=1e-5)


def test_ready_waits_for_the_value_checks_and_never_fires_when_they_fail():
    x = zyx.tensor(A)
    zyx.set_checks(True)
    bad = zyx.tensor([3, 1]) * 50            # computed indices: a flag target checks them
    out = x[bad] * 2
    log = []
    with pytest.raises(IndexError):
        RT.realize([out._id], ready={out._id: _recorder(log, "out")})
    assert log == []
    good = zyx.tensor([3, 1]) * 5
    out = x[good] * 2
    RT.realize([out._id], ready={out._id: _recorder(log, "out")})
    assert [n for n, _, _ in log] == ["out"]
    np.testing.assert_allclose(out.numpy(), A[[15, 5]] * 2)


def test_ready_between_kernels_on_the_kernel_by_kernel_path():
    from zyx._core import scheduler
    from zyx._core.graph import Graph, UNARY, REDUCE
    from zyx._core.kernel import U_EXP, R_SUM
    from zyx import dtype as dt
    from zyx.backends import initialize_backends
    pools, devices = initialize_backends({"dummy": {"enabled": True}}, only=["dummy"])
    dev = devices[0]
    g = Graph()
    g.free_buffer = lambda buf: buf.pool.deallocate(buf)
    a = g.leaf(pools[0].allocate(16)[0], (4,), dt.float32)
    b = g.add(REDUCE, (R_SUM, (0,)), (g.add(UNARY, U_EXP, (a,), (4,), dt.float32),), (1,),
              dt.float32)
    c = g.add(UNARY, U_EXP, (b,), (1,), dt.float32)
    d = g.add(REDUCE, (R_SUM, (0,)), (g.add(UNARY, U_EXP, (a,), (4,), dt.float32),), (1,),
              dt.float32)
    order, _ = g.collect([b, c, d])
    plan = scheduler.build_plan(g, order, [b, c, d], dev)
    pos = {nid: p for p, nid in enumerate(order)}
    log = []
    scheduler.execute(plan, g, order, pools[0], None, {"kernels_launched": 0},
                      ready={pos[n]: _recorder(log, name, lambda: dev.launched)
                             for n, name in ((b, "b"), (c, "c"), (d, "d"), (a, "a"))})
    launched = dict((n, k) for n, _, k in log)
    assert launched["a"] == 0                          # a leaf: before any kernel
    assert launched["b"] < launched["c"]               # each right after its own kernel
    assert sorted(launched.values())[1:] == list(range(1, dev.launched + 1))


def _opencl_or_skip():
    try:
        return RT.resolve("opencl:0")
    except Exception as e:      # noqa: BLE001 (any reason the backend is missing)
        pytest.skip(f"no OpenCL device ({e})")


@pytest.mark.parametrize("prepared", [True, False], ids=["plan-launches", "kernel-by-kernel"])
def test_ready_between_opencl_launches(monkeypatch, prepared):
    dev = _opencl_or_skip()
    monkeypatch.setattr(dev, "plan_launches", prepared)
    RT._drop_plans()
    import pyopencl as cl
    enqueued = [0]
    # prepared launches enqueue through pyopencl's function; the kernel-by-kernel path
    # through the device's launch
    owner, name = (cl, "enqueue_nd_range_kernel") if prepared else (dev, "launch")
    real = getattr(owner, name)

    def counting(*args, **kw):
        enqueued[0] += 1
        return real(*args, **kw)
    monkeypatch.setattr(owner, name, counting)
    a = zyx.Tensor(A, device="opencl:0")
    for _ in range(3):
        x, y, z = _chain(a)
        enqueued[0] = 0
        log = []
        probe = lambda: enqueued[0]          # noqa: E731
        RT.realize([x._id, y._id, z._id], ready={z._id: _recorder(log, "z", probe),
                                                 x._id: _recorder(log, "x", probe),
                                                 y._id: _recorder(log, "y", probe)})
        at = dict((n, k) for n, _, k in log)
        # each fired after its kernel was enqueued and before the next one was
        assert 0 < at["x"] < at["y"] < at["z"] == enqueued[0]
        for got, want in zip((x, y, z), _expected()):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-4)
    RT._drop_plans()


def test_driver_launch_record_calls_back_between_its_launches():
    """gpudriver.DriverPlanLaunches (CUDA, HIP) with stops, without a GPU: its prepared
    launches replaced by recorders, no graphs; each stop's callbacks run after the
    launches before its index and before the rest."""
    from zyx.backends.gpudriver import DriverPlanLaunches
    done = []
    lau = DriverPlanLaunches.__new__(DriverPlanLaunches)
    lau.calls = [lambda i=i: done.append(i) for i in range(5)]
    lau.values, lau.bound, lau.positions, lau.mapped = None, [], [], []
    lau.runs, lau.graph, lau.pieces = 0, None, {}
    lau.run([], [(2, [lambda: done.append("a")]), (4, [lambda: done.append("b"),
                                                        lambda: done.append("c")])])
    assert done == [0, 1, "a", 2, 3, "b", "c", 4]
    done.clear()
    lau.run([], [(0, [lambda: done.append("first")]), (5, [lambda: done.append("last")])])
    assert done == ["first", 0, 1, 2, 3, 4, "last"]
