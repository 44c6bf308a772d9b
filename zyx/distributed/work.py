"""What every zyx.distributed backend shares: the error class, `ReduceOp`, the work handle
returned by `async_op=True`, and the deadline loop that turns a hung peer into an error."""
from __future__ import annotations

import os
import time

from ..autograd import no_grad
from ..errors import ZyxError
from ..runtime import RT
from ..tensor import rebind


class DistributedError(ZyxError, RuntimeError):
    """A collective failed: not initialized, ranks disagree on shapes or dtypes, or a peer
    did not join within the process group's timeout."""


class ReduceOp:
    """torch.distributed.ReduceOp: how all_reduce / reduce_scatter combine the ranks'
    values. AVG is the SUM divided by the world size (floating dtypes only)."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<ReduceOp.{self.name}>"

    def __reduce__(self):
        return (getattr, (ReduceOp, self.name))


ReduceOp.SUM = ReduceOp("SUM")
ReduceOp.AVG = ReduceOp("AVG")
ReduceOp.PRODUCT = ReduceOp("PRODUCT")
ReduceOp.MIN = ReduceOp("MIN")
ReduceOp.MAX = ReduceOp("MAX")
REDUCE_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)


def wait_until(done, deadline, what, on_timeout):
    """Poll `done()` until it is true; past `deadline` (time.monotonic) call
    `on_timeout(message)`, which must raise or abort.

    Polls without pause for the first half second: with MPI, polling is what moves a
    nonblocking collective on (Open MPI progresses it only inside MPI calls), so a pause
    between polls would cut a large all-reduce's bandwidth several times. It yields the
    core between polls (sched_yield: returns at once when nothing else wants to run), so
    on an oversubscribed host the peer it waits for, or its OpenMP threads, get the core
    (mpirun's --oversubscribe makes MPI's own waits yield for the same reason). After that
    (a peer is late, not a transfer running) it sleeps 1 ms between polls, so a waiting
    rank does not hold its core."""
    start = time.monotonic()
    spins = 0
    slow = False
    while not done():
        if slow:
            if time.monotonic() > deadline:
                on_timeout(what)
            time.sleep(1e-3)
            continue
        _yield()
        spins += 1
        if spins & 1023 == 0:
            now = time.monotonic()
            if now > deadline:
                on_timeout(what)
            slow = now - start > 0.5


_yield = getattr(os, "sched_yield", lambda: None)


class Work:
    """torch's work handle (`async_op=True`): `wait()` blocks until the collective has
    finished and its result is the tensor's value (every later op on that tensor reads
    the result); `is_completed()` polls without blocking. `finish` runs once, after the
    transfer is complete: it assigns the result to the caller's tensors."""

    def __init__(self, test, wait, finish=None):
        self._test = test
        self._wait = wait
        self._finish = finish
        self._done = False

    def is_completed(self) -> bool:
        """True once the collective has finished (wait() then returns at once)."""
        if not self._done and self._test():
            self._complete()
        return self._done

    def wait(self, timeout=None) -> bool:
        """Block until done; returns True (torch's spelling). `timeout` (seconds or a
        timedelta) overrides the process group's for this wait."""
        if not self._done:
            self._wait(timeout)
            self._complete()
        return True

    def _complete(self):
        self._done = True
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


def completed_work():
    """A handle for work that is already done (a synchronous op asked for async_op)."""
    w = Work(lambda: True, lambda timeout: None)
    w._done = True
    return w


def set_value(t, src):
    """Make tensor `src` (a collective's result) the value of `t`, torch's in-place
    semantics: `t` keeps its identity and dtype. A plain tensor (no recorded history, not
    a view, no views) is simply pointed at the result, which costs nothing and leaves no
    trace for autograd's in-place repair; views and recorded tensors go through `copy_`
    (zyx's in-place machinery), so their bases, views and backward follow."""
    if src.dtype is not t.dtype:
        src = src.cast(t.dtype)
    if tuple(src.shape) != tuple(t.shape):
        src = src.reshape(t.shape)
    if t._ctx is None and t._view is None and not t._views:
        rebind(t, src)
    else:
        with no_grad():
            t.copy_(src)


def plain(t) -> bool:
    """True when tensor `t` has no recorded history, is not a view and has no views, and
    alone holds its graph node: a value written into its buffer is seen by nobody else
    (sole_owner adds the buffer's side)."""
    return t._ctx is None and t._view is None and not t._views and \
        RT.graph.get(t._id).rc == 1


def sole_owner(t) -> bool:
    """True when a collective may write realized tensor `t`'s buffer in place: nothing
    but `t` can observe it. `t` is plain (no recorded history, not a view, no views), it
    alone holds its graph node (no other tensor object, no lazy op recorded on it, no
    autograd snapshot), the node alone holds the buffer (no realized reshape aliasing it,
    no live DLPack export) and the memory is the pool's, not a user's array
    (from_numpy / from_dlpack)."""
    if not plain(t):
        return False
    buf = RT.graph.get(t._id).buffer
    return buf is not None and buf.refs == 1 and not buf.borrowed
