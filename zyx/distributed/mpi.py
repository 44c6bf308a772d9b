"""The `mpi` backend: collectives on host memory through mpi4py over the system's MPI.

CPU tensors (the C backend computes in host memory) are read in place: the realized
tensor's buffer is handed to MPI as a numpy view (DLPack, no copy) and the result lands in
a new array that becomes the tensor's value (`work.set_value` with
`zyx.from_numpy(result)`, which shares the array), so a collective costs no copy beyond
MPI's own. Tensors on other devices go through a host copy. float16 and
bfloat16 have no MPI type: they are reduced in float32 and cast back.

Every wait is a nonblocking request polled against the group's deadline
(`work.wait_until`): a peer that died or hangs turns into a DistributedError naming the
collective, instead of a hang; the process then aborts the MPI job at exit, since
MPI_Finalize would wait for the lost peer."""
from __future__ import annotations

import atexit
import sys
import time

import numpy as np

from .. import dtype as dt
from ..tensor import from_numpy
from .work import DistributedError, ReduceOp, Work, set_value, wait_until

_WIDEN = (dt.float16, dt.bfloat16)    # no MPI datatype: reduced as float32


def host_array(t):
    """`t`'s values as a C-contiguous numpy array: a view of its buffer for CPU tensors of
    an MPI-native dtype, else a copy (float16/bfloat16 widened to float32)."""
    if t.dtype in _WIDEN:
        t = t.float()
    t.realize()
    if t.device.type == "cpu":
        return np.from_dlpack(t)
    return t.numpy()


def work_dtype(t):
    """The numpy dtype MPI moves for tensor `t`."""
    return np.dtype(np.float32) if t.dtype in _WIDEN else np.dtype(t.dtype.np)


def assign(t, array, scale=None):
    """Make `array` (its memory shared, not copied, on the CPU) `t`'s value
    (`work.set_value`); `scale` multiplies lazily (AVG), fusing into whatever reads t
    next."""
    src = from_numpy(np.ascontiguousarray(array).reshape(t.shape))
    set_value(t, src if scale is None else src * scale)


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

    def _run(self, reqs, what, finish, async_op):
        test, wait = self._waiter(reqs, what)
        work = Work(test, wait, finish)
        if async_op:
            return work
        work.wait()
        return None

    # -- metadata ----------------------------------------------------------------------------
    def allgather_meta(self, meta: np.ndarray, what: str) -> np.ndarray:
        """Every rank's `meta` (int64 rows), waited for against the deadline."""
        out = np.empty((self.size, meta.size), dtype=np.int64)
        req = self.comm.Iallgather(meta, out)
        self._run([req], what, None, False)
        return out

    # -- collectives on tensors ---------------------------------------------------------
    def _op(self, op, t):
        if op is ReduceOp.AVG and not t.dtype.is_float:
            raise DistributedError(f"ReduceOp.AVG needs a floating tensor, got {t.dtype.name}")
        return self._ops[op.name]

    def all_reduce(self, t, op, async_op):
        mop = self._op(op, t)
        send = host_array(t)
        recv = np.empty_like(send)
        req = self.comm.Iallreduce(send, recv, mop)
        scale = 1.0 / self.size if op is ReduceOp.AVG else None
        return self._run([req], "all_reduce", lambda: assign(t, recv, scale), async_op)

    def broadcast(self, t, src, async_op):
        if self.rank == src:
            buf = host_array(t)
            req = self.comm.Ibcast(buf, root=src)
            return self._run([req], "broadcast", None, async_op)
        buf = np.empty(t.shape, dtype=work_dtype(t))
        req = self.comm.Ibcast(buf, root=src)
        return self._run([req], "broadcast", lambda: assign(t, buf), async_op)

    def all_gather(self, outs, t, async_op):
        send = host_array(t)
        recv = np.empty((self.size,) + send.shape, dtype=send.dtype)
        req = self.comm.Iallgather(send, recv)

        def finish():
            for i, o in enumerate(outs):
                assign(o, recv[i])
        return self._run([req], "all_gather", finish, async_op)

    def all_gather_into_tensor(self, out, t, async_op):
        send = host_array(t)
        recv = np.empty((self.size,) + send.shape, dtype=send.dtype)
        req = self.comm.Iallgather(send, recv)
        return self._run([req], "all_gather_into_tensor", lambda: assign(out, recv),
                         async_op)

    def reduce_scatter_tensor(self, out, t, op, async_op):
        mop = self._op(op, t)
        send = host_array(t)
        recv = np.empty(out.shape, dtype=send.dtype)
        req = self.comm.Ireduce_scatter_block(send, recv, mop)
        scale = 1.0 / self.size if op is ReduceOp.AVG else None
        return self._run([req], "reduce_scatter", lambda: assign(out, recv, scale),
                         async_op)

    def send(self, t, dst, tag, meta, async_op):
        send = host_array(t)
        reqs = [] if meta is None else [self.comm.Isend(meta, dest=dst, tag=2 * tag)]
        reqs.append(self.comm.Isend(send, dest=dst, tag=2 * tag + 1))
        return self._run(reqs, f"send to rank {dst}", None, async_op)

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
        buf = np.empty(t.shape, dtype=work_dtype(t))
        status = self.MPI.Status()
        req = self.comm.Irecv(buf, source=source, tag=2 * tag + 1)
        found = [source]

        def finish():
            found[0] = status.Get_source()
            assign(t, buf)
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


