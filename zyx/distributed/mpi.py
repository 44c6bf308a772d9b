"""The `mpi` backend: collectives on host memory through mpi4py over the system's MPI.

CPU tensors (the C backend computes in host memory) are read in place: the realized
tensor's buffer is handed to MPI as a numpy view (`HostView`, no copy), and the result
lands in a buffer from the host pool that becomes a leaf and the tensor's value
(`work.set_value`), so a collective costs no copy beyond MPI's own (and no page faults:
the pool gives the same blocks back in a loop).
Tensors on other devices go through a host copy. float16 and bfloat16 have no MPI type:
they are reduced in float32 and cast back.

Every wait is a nonblocking request polled against the group's deadline
(`work.wait_until`): a peer that died or hangs turns into a DistributedError naming the
collective, instead of a hang; the process then aborts the MPI job at exit, since
MPI_Finalize would wait for the lost peer."""
from __future__ import annotations

import atexit
import math
import sys
import time

import numpy as np

from .. import dtype as dt
from ..runtime import RT
from ..tensor import Tensor, from_numpy
from .work import DistributedError, ReduceOp, Work, set_value, wait_until

_WIDEN = (dt.float16, dt.bfloat16)    # no MPI datatype: reduced as float32


class HostView:
    """`t`'s values as a C-contiguous numpy array for MPI to read (`array`).

    A CPU tensor of an MPI-native dtype is read in place: `array` is a view of its realized
    buffer, whose graph node is held (`keep`) until the view is dropped, so the pool cannot
    hand the memory to anyone else while MPI still reads it. The tensor is not marked as
    shared memory (as `np.from_dlpack(t)` would do): a collective's result then becomes its
    value by a plain rebind, with no copy back into the old buffer. float16/bfloat16 (no
    MPI type) are first converted into a temporary float32 tensor, tensors on other
    devices copied to the host."""

    __slots__ = ("array", "keep")

    def __init__(self, t):
        src = t.float() if t.dtype in _WIDEN else t
        if src.device.type != "cpu":
            self.array = np.ascontiguousarray(src.numpy())   # a host copy
            self.keep = None
            return
        src.realize()
        nid = src._id
        node = RT.graph.get(nid)
        buf = node.buffer
        RT.graph.retain(nid)
        self.keep = Tensor._wrap(nid)       # releases the node when this view goes
        npd = np.dtype(node.dtype.np)
        n = math.prod(node.shape)
        self.array = buf.handle[:n * npd.itemsize].view(npd).reshape(node.shape)


def work_dtype(t):
    """The numpy dtype MPI moves for tensor `t`."""
    return np.dtype(np.float32) if t.dtype in _WIDEN else np.dtype(t.dtype.np)


def result_array(t, shape):
    """A fresh numpy array of `shape` for MPI to write t's result into, and the tensor
    over it (None off the CPU: the array then goes through from_numpy). On the CPU the
    array is a buffer from the host pool, reused from its free list in a loop (a new numpy
    array would fault in fresh pages on every call), and the tensor a leaf over that
    buffer: the result becomes t's value without a copy."""
    npd = work_dtype(t)
    if t.device.type != "cpu":
        return np.empty(shape, dtype=npd), None
    pool = RT.device_of(t._id).pool
    n = math.prod(shape)
    with RT.lock:
        buf, _ = pool.allocate(max(n * npd.itemsize, 1))
    d = dt.float32 if t.dtype in _WIDEN else t.dtype
    res = Tensor._wrap(RT.graph.leaf(buf, tuple(shape), d))
    return buf.handle[:n * npd.itemsize].view(npd).reshape(shape), res


def assign(t, array, scale=None):
    """Make `array` (its memory shared, not copied, on the CPU) `t`'s value
    (`work.set_value`); `scale` multiplies lazily (AVG), fusing into whatever reads t
    next."""
    src = from_numpy(np.ascontiguousarray(array).reshape(t.shape))
    set_value(t, src if scale is None else src * scale)


def assign_tensor(t, src, scale=None):
    """Make tensor `src` (a collective's result) t's value, times `scale` (lazily)."""
    set_value(t, src if scale is None else src * scale)


def assign_result(t, array, res, scale=None):
    """Make a result written by MPI t's value: `res`, the leaf over `array`'s pool buffer
    (result_array), else (off the CPU) `array` itself through from_numpy."""
    if res is None:
        assign(t, array, scale)
    else:
        assign_tensor(t, res, scale)


class MpiBackend:
    """Collectives over a duplicate of MPI_COMM_WORLD (so the user's own MPI traffic on
    COMM_WORLD never matches ours)."""

    name = "mpi"

    def __init__(self, timeout):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise DistributedError(
                "the mpi backend needs mpi4py and an MPI library: pip install "
                "'zyx[distributed]' (and e.g. apt install openmpi-bin libopenmpi-dev)") from e
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = timeout
        self.broken = False
        self._meta_rows = None
        self._ops = {"SUM": MPI.SUM, "AVG": MPI.SUM, "PRODUCT": MPI.PROD,
                     "MIN": MPI.MIN, "MAX": MPI.MAX}
        atexit.register(self._abort_if_broken)
        if self.size > 1:
            self._chain_excepthook()

    # -- failure handling ------------------------------------------------------------------
    def _chain_excepthook(self):
        # An uncaught exception on one rank aborts the whole job at once (as
        # `python -m mpi4py` does), so the other ranks fail now instead of at their timeout.
        previous = sys.excepthook

        def hook(kind, value, tb):
            previous(kind, value, tb)
            sys.stderr.write(f"zyx.distributed: rank {self.rank} raised "
                             f"{kind.__name__}; aborting the MPI job\n")
            sys.stderr.flush()
            self.comm.Abort(1)
        sys.excepthook = hook

    def _abort_if_broken(self):
        if self.broken:
            self.comm.Abort(1)

    def on_timeout(self, what):
        """Raise the timeout error (and abort the job when the process exits)."""
        self.broken = True
        msg = (f"zyx.distributed: rank {self.rank}: {what} did not complete within "
               f"{self.timeout:g} s (init_process_group's timeout): another rank failed, "
               "exited or never called it")
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
        raise DistributedError(msg)

    def _waiter(self, reqs, what):
        reqs = list(reqs)

        def test():
            return self.MPI.Request.Testall(reqs)

        def wait(timeout=None):
            t = self.timeout if timeout is None else (
                timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout)
            wait_until(test, time.monotonic() + t, what, self.on_timeout)
        return test, wait

    def _run(self, reqs, what, finish, async_op, keep=None):
        """Wait for `reqs` (now, or in the returned Work's wait()), then run `finish`.
        `keep` (the HostView MPI reads) stays alive until then."""
        test, wait = self._waiter(reqs, what)
        if keep is not None:
            done = finish

            def finish():
                keep.array = None           # MPI is done with the memory: let it go
                if done is not None:
                    done()
        work = Work(test, wait, finish)
        if async_op:
            return work
        work.wait()
        return None

    # -- metadata ----------------------------------------------------------------------------
    def allgather_meta(self, meta: np.ndarray, what: str) -> np.ndarray:
        """Every rank's `meta` (int64 rows), waited for against the deadline. The rows
        land in one array reused by every call (the caller compares them at once)."""
        out = self._meta_rows
        if out is None or out.shape[1] != meta.size:
            out = self._meta_rows = np.empty((self.size, meta.size), dtype=np.int64)
        req = self.comm.Iallgather(meta, out)
        if not req.Test():
            wait_until(req.Test, time.monotonic() + self.timeout, what, self.on_timeout)
        return out

    # -- collectives on tensors ---------------------------------------------------------
    def _op(self, op, t):
        if op is ReduceOp.AVG and not t.dtype.is_float:
            raise DistributedError(f"ReduceOp.AVG needs a floating tensor, got {t.dtype.name}")
        return self._ops[op.name]

    def all_reduce(self, t, op, async_op):
        # Into a separate buffer, not MPI_IN_PLACE, even when t alone owns its buffer:
        # Open MPI's nonblocking Iallreduce (libnbc) in place ran 3.7x slower at 64 MB
        # than with a separate receive buffer, here (benches/dist_allreduce.py's machine).
        # The receive buffer comes from the host pool, so a loop alternates between two
        # blocks (t's old one is freed when t takes the result) and nothing is copied.
        mop = self._op(op, t)
        v = HostView(t)
        scale = 1.0 / self.size if op is ReduceOp.AVG else None
        recv, res = result_array(t, v.array.shape)
        req = self.comm.Iallreduce(v.array, recv, mop)
        return self._run([req], "all_reduce", lambda: assign_result(t, recv, res, scale),
                         async_op, v)

    def broadcast(self, t, src, async_op):
        if self.rank == src:
            v = HostView(t)
            req = self.comm.Ibcast(v.array, root=src)
            return self._run([req], "broadcast", None, async_op, v)
        buf, res = result_array(t, tuple(t.shape))
        req = self.comm.Ibcast(buf, root=src)
        return self._run([req], "broadcast", lambda: assign_result(t, buf, res), async_op)

    def _gather(self, t):
        v = HostView(t)
        recv, res = result_array(t, (self.size,) + v.array.shape)
        return v, recv, res, self.comm.Iallgather(v.array, recv)

    def all_gather(self, outs, t, async_op):
        v, recv, res, req = self._gather(t)

        def finish():
            for i, o in enumerate(outs):
                assign_result(o, recv[i], None if res is None else res[i])
        return self._run([req], "all_gather", finish, async_op, v)

    def all_gather_into_tensor(self, out, t, async_op):
        v, recv, res, req = self._gather(t)
        return self._run([req], "all_gather_into_tensor",
                         lambda: assign_result(out, recv, res), async_op, v)

    def reduce_scatter_tensor(self, out, t, op, async_op):
        mop = self._op(op, t)
        v = HostView(t)
        recv, res = result_array(out, tuple(out.shape))
        req = self.comm.Ireduce_scatter_block(v.array, recv, mop)
        scale = 1.0 / self.size if op is ReduceOp.AVG else None
        return self._run([req], "reduce_scatter",
                         lambda: assign_result(out, recv, res, scale), async_op, v)

    def send(self, t, dst, tag, meta, async_op):
        v = HostView(t)
        reqs = [] if meta is None else [self.comm.Isend(meta, dest=dst, tag=2 * tag)]
        reqs.append(self.comm.Isend(v.array, dest=dst, tag=2 * tag + 1))
        return self._run(reqs, f"send to rank {dst}", None, async_op, v)

    def recv(self, t, src, tag, meta, check, async_op):
        """Receive into t from `src` (None: any rank); returns (work or None, source).
        With the metadata check on, the sender's header names the source first."""
        source = self.MPI.ANY_SOURCE if src is None else src
        if meta is not None:
            got = np.empty_like(meta)
            status = self.MPI.Status()
            req = self.comm.Irecv(got, source=source, tag=2 * tag)
            wait_until(lambda: req.Test(status), time.monotonic() + self.timeout, "recv",
                       self.on_timeout)
            source = status.Get_source()
            check(got, source)
        buf, res = result_array(t, tuple(t.shape))
        status = self.MPI.Status()
        req = self.comm.Irecv(buf, source=source, tag=2 * tag + 1)
        found = [source]

        def finish():
            found[0] = status.Get_source()
            assign_result(t, buf, res)
        work = Work(lambda: req.Test(status),
                    lambda timeout: wait_until(lambda: req.Test(status),
                                               time.monotonic() + self.timeout,
                                               "recv", self.on_timeout), finish)
        if async_op:
            return work, source
        work.wait()
        return None, found[0]

    def barrier(self, async_op=False):
        req = self.comm.Ibarrier()
        return self._run([req], "barrier", None, async_op)

    def destroy(self):
        """Free the duplicate communicator."""
        if not self.broken:
            self.comm.Free()


