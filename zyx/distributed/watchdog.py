"""The NCCL backend's watchdog: NCCL work that never finishes (a peer died, hangs or
called another collective) becomes a DistributedError within the process group's timeout
instead of a hang.

NCCL queues a collective on the CUDA stream and returns; a lost peer shows up later as a
kernel that never ends, and any host wait on that stream (`t.numpy()`, a synchronize)
would block forever. So every collective is tracked here with a `done()` probe (a CUDA
event recorded after it on the stream), and every wait on the stream first runs `wait`
here, which polls the probes and `ncclCommGetAsyncError` until the work is done. When the
communicator reports an error, or a work is older than the timeout, it calls
`ncclCommAbort` (which stops NCCL's kernels and proxy threads, so the stream drains) and
raises DistributedError naming the collective and the ranks; the communicator is then
unusable and every later collective raises at once.

The communicator is created non-blocking (`ncclCommInitRankConfig`, blocking=0): NCCL
calls, its creation included, may then return ncclInProgress and finish in the background,
and `settle` polls the async error until they did, against the same deadline, so neither
init nor a collective that waits to connect to a dead peer can hang the host.

The library is any object with NCCL's functions (`ncclCommGetAsyncError(comm, byref(int))`,
`ncclCommAbort(comm)`, `ncclGetErrorString(code)`): the ctypes CDLL in production, a fake
in tests/test_distributed.py."""
from __future__ import annotations

import ctypes
import time
from collections import deque

from .work import DistributedError

NCCL_SUCCESS = 0
NCCL_REMOTE_ERROR = 6
NCCL_IN_PROGRESS = 7

_SPIN_SECONDS = 2e-3      # poll without pause this long: a collective usually ends within it
_NAP_SECONDS = 1e-4       # then between polls, growing ten times to...
_SLEEP_SECONDS = 1e-3     # ...this, once the work is clearly waiting on a peer


class Pending:
    """One collective queued on the stream: its name, its completion probe, when it was
    queued, and `release` (run once when it is found done, e.g. to reuse its event)."""

    __slots__ = ("what", "done", "start", "release", "finished")

    def __init__(self, what, done, start, release=None):
        self.what = what
        self.done = done
        self.start = start
        self.release = release
        self.finished = False


class NcclWatchdog:
    """Deadlines and error checks for one NCCL communicator (see the module docstring).
    `comm` is the ncclComm_t (a ctypes.c_void_p); `timeout` in seconds."""

    def __init__(self, lib, comm, rank, size, timeout, clock=time.monotonic,
                 sleep=time.sleep):
        self.lib = lib
        self.comm = comm
        self.rank = rank
        self.size = size
        self.timeout = float(timeout)
        self.clock = clock
        self.sleep = sleep
        self.pending = deque()
        self.aborted = None           # the error message, once the communicator is aborted

    # -- errors ----------------------------------------------------------------------------
    def _ranks(self):
        return f"ranks 0-{self.size - 1}" if self.size > 1 else "rank 0"

    def error_name(self, code):
        try:
            name = self.lib.ncclGetErrorString(code)
            return name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        except Exception:          # naming an error must never hide it
            return f"error {code}"

    def async_error(self):
        """The communicator's asynchronous state: NCCL_SUCCESS, NCCL_IN_PROGRESS (a
        non-blocking call still working) or an error code."""
        err = ctypes.c_int(NCCL_SUCCESS)
        rc = self.lib.ncclCommGetAsyncError(self.comm, ctypes.byref(err))
        return rc if rc != NCCL_SUCCESS else err.value

    def abort(self, message):
        """ncclCommAbort (once), then raise DistributedError(message)."""
        if self.aborted is None:
            self.aborted = message
            self.pending.clear()
            self.lib.ncclCommAbort(self.comm)
        raise DistributedError(message)

    def check_usable(self, what):
        """Raise at once when an earlier failure aborted the communicator."""
        if self.aborted is not None:
            raise DistributedError(
                f"zyx.distributed: rank {self.rank}: {what}: the NCCL communicator was "
                f"aborted after an earlier failure ({self.aborted}); "
                "destroy_process_group() and init_process_group() again")

    def _failed(self, code, what):
        hint = (" (a peer rank failed or exited)" if code == NCCL_REMOTE_ERROR else "")
        self.abort(f"zyx.distributed: rank {self.rank}: {what} over {self._ranks()} "
                   f"failed: NCCL error {code} ({self.error_name(code)}){hint}; the NCCL "
                   "communicator was aborted")

    def _timed_out(self, what, seconds):
        self.abort(f"zyx.distributed: rank {self.rank}: {what} over {self._ranks()} did "
                   f"not complete within {seconds:g} s (init_process_group's timeout): "
                   "another rank failed, exited or never called it; the NCCL "
                   "communicator was aborted")

    # -- NCCL calls ---------------------------------------------------------------------------
    def settle(self, rc, what, timeout=None):
        """After NCCL call `what` returned `rc`: return once it took effect. Success
        returns at once; ncclInProgress (a non-blocking communicator working in the
        background: creating itself, connecting to peers) is polled through the async
        error until it is done, up to the timeout; an error aborts and raises."""
        if rc == NCCL_SUCCESS:
            return
        if rc != NCCL_IN_PROGRESS:
            self._failed(rc, what)
        limit = self.timeout if timeout is None else float(timeout)
        start = self.clock()
        pause = 0.0
        while True:
            state = self.async_error()
            if state == NCCL_SUCCESS:
                return
            if state != NCCL_IN_PROGRESS:
                self._failed(state, what)
            if self.clock() - start > limit:
                self._timed_out(what, limit)
            pause = self._pause(pause, self.clock() - start)

    def _pause(self, pause, waited):
        if waited < _SPIN_SECONDS:
            return 0.0
        pause = _NAP_SECONDS if pause == 0.0 else min(pause * 10, _SLEEP_SECONDS)
        self.sleep(pause)
        return pause

    # -- queued work ------------------------------------------------------------------------
    def track(self, what, done, release=None):
        """Note a collective queued on the stream (`done()` tells when it has run) and
        sweep the older ones: a failure found there raises now. Returns its Pending."""
        item = Pending(what, done, self.clock(), release)
        self.pending.append(item)
        self.sweep()
        return item

    def _finish(self, item):
        item.finished = True
        if item.release is not None:
            release, item.release = item.release, None
            release()

    def sweep(self):
        """Without waiting: drop the works that finished (they finish in stream order),
        then raise if the communicator reported an error or the oldest unfinished work is
        past the timeout."""
        pending = self.pending
        while pending and pending[0].done():
            self._finish(pending.popleft())
        if not pending:
            return
        state = self.async_error()
        if state not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            self._failed(state, pending[0].what)
        oldest = pending[0]
        if self.clock() - oldest.start > self.timeout:
            self._timed_out(oldest.what, self.timeout)

    def is_done(self, item):
        """True once `item` (a Pending) has run; checks for failures on the way."""
        if item.finished:
            return True
        self.sweep()
        return item.finished

    def wait(self, item=None, timeout=None):
        """Block until `item` (default: every queued work) has run, polling the probes and
        the async error; past the deadline (`timeout` seconds from now when given, else
        each work's own timeout from when it was queued) abort and raise."""
        pending = self.pending
        if item is not None and item.finished:
            return
        until = None if timeout is None else self.clock() + float(timeout)
        start = self.clock()
        pause = 0.0
        while pending:
            head = pending[0]
            if head.done():
                self._finish(pending.popleft())
                if head is item:
                    return
                pause = 0.0
                continue
            state = self.async_error()
            if state not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                self._failed(state, head.what)
            now = self.clock()
            if until is not None and now > until:
                self._timed_out(head.what, float(timeout))
            if until is None and now - head.start > self.timeout:
                self._timed_out(head.what, self.timeout)
            pause = self._pause(pause, now - start)
