"""zyx.distributed, DistributedDataParallel and DistributedSampler.

Multi-process cases launch `mpirun -np 2|3` on the scripts in tests/distributed/ (each
rank asserts against numpy and exits non-zero on failure); they skip when mpirun or mpi4py
is missing. The NCCL case needs a CUDA device and libnccl (world size 1)."""
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import zyx
import zyx.distributed as dist
from zyx.utils.data import DistributedSampler

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MPIRUN = shutil.which("mpirun")


def _have_mpi4py():
    try:
        import mpi4py  # noqa: F401
        return True
    except ImportError:
        return False


needs_mpi = pytest.mark.skipif(MPIRUN is None or not _have_mpi4py(),
                               reason="needs mpirun (Open MPI) and mpi4py")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
    env.pop("ZYX_DISTRIBUTED_CHECKS", None)
    return env


def mpirun(n, script, *args, timeout=300):
    """Run tests/distributed/<script> on n ranks; (returncode, output, seconds)."""
    cmd = [MPIRUN, "--oversubscribe", "-np", str(n), sys.executable,
           os.path.join(HERE, "distributed", script), *map(str, args)]
    start = time.monotonic()
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - start


# -- in one process -----------------------------------------------------------------------

def test_collective_before_init_raises():
    assert not dist.is_initialized()
    for call in (lambda: dist.all_reduce(zyx.ones(2)), dist.get_rank, dist.get_world_size,
                 dist.barrier, lambda: dist.broadcast(zyx.ones(2), 0)):
        with pytest.raises(dist.DistributedError, match="has not been initialized"):
            call()
    with pytest.raises(dist.DistributedError, match="init_process_group"):
        zyx.nn.parallel.DistributedDataParallel(zyx.nn.Linear(2, 2))
    assert dist.is_main_process()


def test_unknown_backend():
    with pytest.raises(dist.DistributedError, match="unknown backend"):
        dist.init_process_group("gloo-ish")
    assert not dist.is_initialized()


def test_reduce_ops_are_torch_names():
    names = {op.name for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT,
                                dist.ReduceOp.MIN, dist.ReduceOp.MAX)}
    assert names == {"SUM", "AVG", "PRODUCT", "MIN", "MAX"}
    import pickle
    assert pickle.loads(pickle.dumps(dist.ReduceOp.MAX)) is dist.ReduceOp.MAX


def test_tcp_store_rendezvous():
    import socket
    import threading
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, 2, True, timeout=20)
    got = []
    t = threading.Thread(target=lambda: got.append(
        dist.TCPStore("127.0.0.1", port, 2, False, timeout=20).get("uid")))
    t.start()
    master.set("uid", b"\x01\x02")
    t.join(20)
    assert got == [b"\x01\x02"]
    short = dist.TCPStore("127.0.0.1", port, 2, False, timeout=0.3)
    with pytest.raises(dist.DistributedError, match="no rank set 'missing'"):
        short.get("missing")
    master.close()


def test_post_accumulate_grad_hook():
    w = zyx.Tensor(np.ones(3, np.float32), requires_grad=True)
    seen = []
    h = w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.numpy()))
    (w * 2).sum().backward()
    assert len(seen) == 1 and np.allclose(seen[0], 2)
    h.remove()
    (w * 3).sum().backward()
    assert len(seen) == 1 and np.allclose(w.grad.numpy(), 5)
    with pytest.raises(RuntimeError, match="non-leaf"):
        (w * 2).register_post_accumulate_grad_hook(print)


@pytest.mark.parametrize("n,world,drop_last", [(10, 3, False), (10, 3, True), (12, 4, False),
                                               (5, 2, False), (2, 4, False)])
def test_distributed_sampler_covers_disjoint(n, world, drop_last):
    parts = [list(DistributedSampler(range(n), world, r, seed=3, drop_last=drop_last))
             for r in range(world)]
    lens = {len(p) for p in parts}
    assert len(lens) == 1
    flat = sum(parts, [])
    if drop_last:
        assert len(set(flat)) == len(flat) == (n // world) * world
    else:
        assert set(flat) == set(range(n))
        assert len(flat) == -(-n // world) * world
        if n % world == 0:
            assert len(set(flat)) == n      # disjoint when nothing is padded


def test_distributed_sampler_epochs_and_torch_order():
    s = DistributedSampler(range(20), 2, 0, seed=5)
    a = list(s)
    assert list(s) == a                       # same epoch, same order
    s.set_epoch(1)
    assert list(s) != a
    other = DistributedSampler(range(20), 2, 1, seed=5)
    other.set_epoch(1)
    assert sorted(list(s) + list(other)) == list(range(20))
    torch = pytest.importorskip("torch")
    from torch.utils.data.distributed import DistributedSampler as TorchSampler
    for n, w, dl in ((10, 3, False), (10, 3, True), (7, 4, False)):
        for r in range(w):
            assert list(DistributedSampler(range(n), w, r, shuffle=False, drop_last=dl)) == \
                list(TorchSampler(range(n), w, r, shuffle=False, drop_last=dl))
    del torch


def test_distributed_sampler_bad_rank():
    with pytest.raises(ValueError, match="Invalid rank"):
        DistributedSampler(range(4), 2, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedSampler(range(4))


# -- under mpirun -------------------------------------------------------------------------

@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_match_numpy(n):
    rc, out, _ = mpirun(n, "collectives.py")
    assert rc == 0, out
    assert out.count("collectives ok") == n


@needs_mpi
@pytest.mark.parametrize("mode", ["sgd", "adam", "conv", "no_sync"])
def test_ddp_matches_one_process(mode):
    rc, out, _ = mpirun(2, "ddp.py", mode)
    assert rc == 0, out
    assert out.count(f"ddp {mode} ok") == 2


@needs_mpi
def test_distributed_sampler_under_mpi():
    rc, out, _ = mpirun(3, "sampler.py")
    assert rc == 0, out
    assert out.count("sampler ok") == 3


@needs_mpi
def test_mismatched_shapes_raise_on_every_rank():
    rc, out, _ = mpirun(2, "failures.py", "mismatch", 20)
    assert rc == 0, out
    assert out.count("mismatched shape raised") == 2
    assert out.count("mismatched dtype raised") == 2
    assert out.count("mismatched list raised") == 2


@needs_mpi
def test_rank_that_exits_fails_the_job():
    rc, out, secs = mpirun(2, "failures.py", "exit", 10, timeout=120)
    assert rc != 0, out
    assert "returned without its peer" not in out
    assert secs < 60, secs


@needs_mpi
def test_rank_that_raises_aborts_the_job():
    rc, out, secs = mpirun(2, "failures.py", "raise", 30, timeout=120)
    assert rc != 0, out
    assert "rank 1 fails on purpose" in out and "rank 1 raised ValueError" in out, out
    assert "returned without its peer" not in out
    assert secs < 25, secs          # well before the 30 s timeout


@needs_mpi
def test_rank_that_hangs_times_out_with_a_clear_error():
    rc, out, secs = mpirun(2, "failures.py", "hang", 10, timeout=120)
    assert rc != 0, out
    assert "rank 0: raised after" in out and "did not complete within 10 s" in out, out
    assert "all_reduce" in out
    assert secs < 60, secs


# -- NCCL (a CUDA GPU and libnccl) ----------------------------------------------------------

def _cuda_and_nccl():
    try:
        names = [str(d) for d in zyx.devices()]
    except Exception:
        return False
    return any(n.startswith("cuda") for n in names) and dist.is_nccl_available()


@pytest.mark.skipif(not _cuda_and_nccl(), reason="needs a CUDA device and libnccl "
                    "(nvidia-nccl-cu12/cu13 wheel or a system NCCL)")
def test_nccl_world_size_one():
    env = _env()
    for k in ("MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, os.path.join(HERE, "distributed", "nccl_single.py")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "nccl world size 1 ok" in p.stdout


def _cuda_count():
    try:
        return sum(str(d).startswith("cuda") for d in zyx.devices())
    except Exception:
        return 0


def _two_gpu_ranks(script, *args, timeout=600):
    """Start `script` as ranks 0 and 1 with torchrun's environment (one GPU each);
    [(returncode, output)] once both ended (or were killed after `timeout` seconds)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = _env()
        for k in [k for k in env if k.startswith(("OMPI_COMM_WORLD", "PMI", "PMIX"))]:
            env.pop(k)
        env.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "distributed", script)] +
            [str(a) for a in args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        try:
            out = p.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0] + "\n(killed: past the test's timeout)"
        results.append((p.returncode, out))
    return results


_TWO_GPUS = pytest.mark.skipif(_cuda_count() < 2 or not _cuda_and_nccl(),
                               reason="needs two CUDA devices and libnccl")


@_TWO_GPUS
def test_nccl_two_gpus_torchrun_env():
    results = _two_gpu_ranks("nccl_ranks.py")
    assert [rc for rc, _ in results] == [0, 0], "\n".join(o for _, o in results)
    assert all("nccl ranks ok" in o for _, o in results)


@_TWO_GPUS
@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_nccl_two_gpus_a_lost_peer_raises_within_the_timeout(tmp_path, mode):
    """A rank that exits, or never calls the collective: the other raises DistributedError
    (the watchdog aborts the communicator) within the group's timeout, then exits."""
    start = time.monotonic()
    results = _two_gpu_ranks("nccl_failure.py", mode, 15, tmp_path / "reported",
                             timeout=240)
    rc0, out0 = results[0]
    assert rc0 == 0 and f"nccl failure {mode} ok" in out0, "\n".join(o for _, o in results)
    secs = float(out0.split("raised after ")[1].split(" s")[0])
    assert secs < 15 + 30, out0
    assert time.monotonic() - start < 200


# -- the NCCL watchdog, against a fake NCCL (no GPU needed) ----------------------------------

class FakeNccl:
    """Stands in for the ctypes NCCL library: the test sets the communicator's async state
    (`states`: the values ncclCommGetAsyncError reports, one per call, the last repeated)
    and counts aborts and collectives."""

    def __init__(self, states=(0,), call_rc=0):
        self.states = list(states)
        self.calls = 0
        self.aborts = 0
        self.collectives = 0
        self.call_rc = call_rc

    def ncclCommGetAsyncError(self, comm, err):
        self.calls += 1
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        err._obj.value = state
        return 0

    def ncclCommAbort(self, comm):
        self.aborts += 1
        return 0

    def ncclGetErrorString(self, code):
        return {6: b"remote process exited or there was a network error",
                3: b"internal error"}.get(code, b"unknown")

    def ncclAllReduce(self, send, recv, count, dtype, op, comm, stream):
        self.collectives += 1
        return self.call_rc


class FakeEvent:
    """A CUDA event whose completion the test controls: done after `after` queries."""

    def __init__(self, after=None):
        self.after = after
        self.queries = 0

    def __call__(self):
        self.queries += 1
        return self.after is not None and self.queries > self.after


def _watchdog(lib, timeout=0.3, size=2):
    import ctypes
    from zyx.distributed.watchdog import NcclWatchdog
    return NcclWatchdog(lib, ctypes.c_void_p(), 0, size, timeout)


def test_nccl_watchdog_waits_for_work_that_finishes():
    lib = FakeNccl()
    wd = _watchdog(lib)
    released = []
    ev = FakeEvent(after=5)
    item = wd.track("all_reduce", ev, lambda: released.append(1))
    assert not wd.is_done(item)
    wd.wait(item)
    assert item.finished and released == [1] and not wd.pending
    assert lib.aborts == 0 and ev.queries == 6      # done at the 6th: track, is_done, 4 in wait
    wd.wait()                                       # nothing queued: returns at once


def test_nccl_watchdog_times_out_and_aborts():
    lib = FakeNccl()
    wd = _watchdog(lib, timeout=0.2)
    wd.track("all_reduce", FakeEvent(after=None))
    start = time.monotonic()
    with pytest.raises(dist.DistributedError) as e:
        wd.wait()
    took = time.monotonic() - start
    assert 0.15 < took < 2.0, took
    msg = str(e.value)
    assert "all_reduce over ranks 0-1 did not complete within 0.2 s" in msg, msg
    assert "rank 0" in msg and "aborted" in msg
    assert lib.aborts == 1 and not wd.pending
    # the communicator is unusable from then on, with a clear error, and aborts only once
    with pytest.raises(dist.DistributedError, match="broadcast: the NCCL communicator was "
                       "aborted after an earlier failure"):
        wd.check_usable("broadcast")
    assert lib.aborts == 1


def test_nccl_watchdog_raises_on_an_async_error_without_waiting_for_the_timeout():
    lib = FakeNccl(states=[0, 0, 0, 6])            # a peer dies during the collective
    wd = _watchdog(lib, timeout=60)
    wd.track("reduce_scatter", FakeEvent(after=None))
    start = time.monotonic()
    with pytest.raises(dist.DistributedError, match=r"reduce_scatter over ranks 0-1 failed: "
                       r"NCCL error 6 \(remote process exited.*a peer rank failed"):
        wd.wait()
    assert time.monotonic() - start < 5 and lib.aborts == 1


def test_nccl_watchdog_explicit_wait_timeout():
    lib = FakeNccl()
    wd = _watchdog(lib, timeout=60)
    item = wd.track("all_gather", FakeEvent(after=None))
    with pytest.raises(dist.DistributedError, match="all_gather over ranks 0-1 did not "
                       "complete within 0.1 s"):
        wd.wait(item, timeout=0.1)
    assert lib.aborts == 1


def test_nccl_watchdog_sweep_on_the_next_collective():
    # a synchronous collective nobody waits for: the next one finds it past the deadline
    lib = FakeNccl()
    wd = _watchdog(lib, timeout=0.05)
    wd.track("all_reduce", FakeEvent(after=None))
    time.sleep(0.1)
    with pytest.raises(dist.DistributedError, match="all_reduce over ranks 0-1 did not"):
        wd.track("broadcast", FakeEvent(after=0))
    assert lib.aborts == 1
    # finished works are dropped by the sweep, in order
    lib2 = FakeNccl()
    wd2 = _watchdog(lib2)
    a = wd2.track("a", FakeEvent(after=0))
    b = wd2.track("b", FakeEvent(after=None))
    assert a.finished and not b.finished and list(wd2.pending) == [b]


def test_nccl_watchdog_settles_nonblocking_calls():
    from zyx.distributed.watchdog import NCCL_IN_PROGRESS
    lib = FakeNccl(states=[NCCL_IN_PROGRESS] * 4 + [0])
    wd = _watchdog(lib)
    wd.settle(NCCL_IN_PROGRESS, "ncclCommInitRank")           # init finishes: returns
    assert lib.calls == 5 and lib.aborts == 0
    wd.settle(0, "all_reduce")                                # success: no polling
    assert lib.calls == 5
    hung = FakeNccl(states=[NCCL_IN_PROGRESS])                # a peer never joins
    wd = _watchdog(hung, timeout=0.1)
    with pytest.raises(dist.DistributedError, match="ncclCommInitRank over ranks 0-1 did "
                       "not complete within 0.1 s"):
        wd.settle(NCCL_IN_PROGRESS, "ncclCommInitRank")
    assert hung.aborts == 1
    bad = FakeNccl()
    wd = _watchdog(bad)
    with pytest.raises(dist.DistributedError, match=r"all_reduce over ranks 0-1 failed: "
                       r"NCCL error 3 \(internal error\)"):
        wd.settle(3, "all_reduce")


class FakeDriverApi:
    """cuda-bindings' calls a ResultTupleDriver makes here: results as tuples."""

    def __init__(self):
        self.synced = 0
        self.ready = set()
        self.recorded = []              # (event, stream)
        self.waits = []                 # (stream, event): cuStreamWaitEvent's

    def cuStreamSynchronize(self, stream):
        self.synced += 1
        return (0,)

    def cuEventQuery(self, ev):
        return (0,) if ev in self.ready else (600,)

    def cuEventRecord(self, ev, stream):
        self.recorded.append((ev, stream))
        self.ready.discard(ev)          # as CUDA: pending again until the new work ran
        return (0,)

    def cuStreamWaitEvent(self, stream, ev, flags):
        self.waits.append((stream, ev))
        return (0,)

    def cuEventCreate(self, flags):
        return (0, object())

    def cuEventDestroy(self, ev):
        self.destroyed = getattr(self, "destroyed", 0) + 1
        return (0,)


def _fake_driver():
    from zyx.backends.gpudriver import ResultTupleDriver

    class Driver(ResultTupleDriver):
        PREFIX = "cu"
        label = "fake"
        SUCCESS = 0
        ordinal = 0
        stream = 0

        def __init__(self):
            self.api = FakeDriverApi()
            self._error_name = str

        def event_create(self):
            return self.check(self.api.cuEventCreate(0), "cuEventCreate")

        def side_stream(self):
            return 1
    return Driver()


def test_nccl_backend_guards_host_waits_on_its_stream():
    """NcclBackend's tracking through a fake driver and library: a synchronous all_reduce
    returns at once; a host wait on the stream (stream_sync) first waits for it and, when
    it never ends, raises the timeout error instead of hanging in the driver."""
    import ctypes
    import types
    from zyx.distributed.nccl import NcclBackend
    from zyx.distributed.watchdog import NcclWatchdog
    lib = FakeNccl()
    drv = _fake_driver()
    b = NcclBackend.__new__(NcclBackend)
    b.lib, b.comm, b.driver, b._events = lib, ctypes.c_void_p(), drv, []
    b.dev = types.SimpleNamespace(dlpack_stream=0)
    b.watchdog = NcclWatchdog(lib, b.comm, 1, 3, 0.2)
    drv.add_wait_guard(b._guard)
    job = b._call("all_reduce", lib.ncclAllReduce, 1, 1, 4, 7, 0)
    # on the side stream (1) after an event of the device's stream (0), which then waits
    # for the collective's own event: kernels queued later read its result. One event
    # does both (a wait takes the state of the record before it)
    (ev, s0), (ev1, s1) = drv.api.recorded
    assert ev is ev1 and (s0, s1) == (0, 1) and drv.api.waits == [(1, ev), (0, ev)]
    work = b._done(job, True)
    assert b._done(job, False) is None and lib.collectives == 1
    assert not work.is_completed() and b._events == []
    # the collective's event completes: stream_sync passes, the event goes back for reuse
    drv.api.ready.add(ev)
    drv.stream_sync()
    assert drv.api.synced == 1 and job.item.finished and work.is_completed()
    assert b._events == [ev]
    # a collective that never finishes (its event, reused, is pending again): the host
    # wait raises after the timeout, naming it, instead of blocking in the driver
    b._call("all_reduce", lib.ncclAllReduce, 1, 1, 4, 7, 0)
    assert [e for e, _ in drv.api.recorded[2:]] == [ev, ev]         # reused, none made
    start = time.monotonic()
    with pytest.raises(dist.DistributedError, match=r"rank 1: all_reduce over ranks 0-2 did "
                       r"not complete within 0.2 s"):
        drv.stream_sync()
    assert time.monotonic() - start < 3 and drv.api.synced == 1 and lib.aborts == 1
    with pytest.raises(dist.DistributedError, match="aborted after an earlier failure"):
        b._call("all_reduce", lib.ncclAllReduce, 1, 1, 4, 7, 0)
    assert lib.collectives == 2
    # destroy_process_group after the abort: nothing left to destroy in NCCL; the guard
    # and the events go
    lib.ncclCommDestroy = lambda comm: pytest.fail("destroyed an aborted communicator")
    b._events.append(ev)
    b.destroy()
    assert drv.wait_guards == () and b._events == [] and drv.api.destroyed == 1
    drv.stream_sync()
    assert drv.api.synced == 2


def test_nccl_start_all_reduce_runs_beside_later_kernels_until_joined():
    """start_all_reduce (DistributedDataParallel's buckets): queued on the side stream
    after the device stream's work so far, but the device's stream does not wait for it
    until join(); its event is reused only once it ran and was joined."""
    import ctypes
    import types
    from zyx import dtype as zdt
    from zyx.distributed.nccl import NcclBackend
    from zyx.distributed.watchdog import NcclWatchdog
    lib = FakeNccl()
    drv = _fake_driver()
    b = NcclBackend.__new__(NcclBackend)
    b.lib, b.comm, b.driver, b._events = lib, ctypes.c_void_p(), drv, []
    b.watchdog = NcclWatchdog(lib, b.comm, 0, 2, 5.0)
    buf = types.SimpleNamespace(ptr=4096)
    job = b.start_all_reduce(buf, 10, zdt.float32, dist.ReduceOp.SUM, True)
    (ev, _), (_, side) = drv.api.recorded
    assert side == 1 and drv.api.waits == [(1, ev)] and job.result is None
    drv.api.ready.add(ev)
    assert job.is_done() and b._events == []            # ran, not joined: kept
    job.join()
    assert drv.api.waits == [(1, ev), (0, ev)] and b._events == [ev]
    with pytest.raises(dist.DistributedError, match="nccl has no int8 type"):
        b.start_all_reduce(buf, 10, zdt.int8, dist.ReduceOp.SUM, True)


def test_nccl_nonblocking_config_layout():
    import ctypes
    from zyx.distributed.nccl import Config, nonblocking_config
    c = nonblocking_config()
    assert ctypes.sizeof(Config) == c.size == 24
    assert (c.magic, c.version, c.blocking) == (0xCAFEBEEF, 21400, 0)
    assert Config.blocking.offset == 16
