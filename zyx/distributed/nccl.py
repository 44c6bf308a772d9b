"""The `nccl` backend: NCCL's collectives on CUDA tensors, NCCL loaded with ctypes.

The library comes from the `nvidia-nccl-cu13` / `nvidia-nccl-cu12` wheel (PyTorch's CUDA
builds depend on it) or the system (`find_library("nccl")`). Every call is enqueued on a
second stream of the zyx CUDA device (`driver.side_stream()`), with the realized
tensors' device pointers, after an event recorded on the device's own stream: kernels
queued before a collective run before it, and, once the collective is joined (at once
for torch's calls; when DistributedDataParallel needs the sums for its buckets), kernels
queued after run after it. Data never passes through the host. A collective writes the
tensor's own buffer where nothing else can see it, else a fresh device buffer that
becomes the caller's tensor's value (`work.set_value`: torch's in-place semantics).

The ranks meet through the rendezvous store (or MPI when an MPI launcher started them):
rank 0 makes the NCCL unique id, the others read it there."""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import math
import os
import sys

import numpy as np

from .. import dtype as dt
from ..runtime import RT
from ..tensor import Tensor, zeros
from .watchdog import NcclWatchdog
from .work import DistributedError, ReduceOp, Work, completed_work, set_value, sole_owner

# ncclDataType_t and ncclRedOp_t values (nccl.h)
_DTYPES = {dt.int32: 2, dt.int64: 4, dt.float16: 6, dt.float32: 7, dt.float64: 8,
           dt.bfloat16: 9}
_OPS = {"SUM": 0, "PRODUCT": 1, "MAX": 2, "MIN": 3, "AVG": 4}


class UniqueId(ctypes.Structure):
    """ncclUniqueId: 128 opaque bytes, passed by value to ncclCommInitRank."""
    _fields_ = [("internal", ctypes.c_char * 128)]


class Config(ctypes.Structure):
    """The head of ncclConfig_t as NCCL 2.14 defined it. NCCL copies `size` bytes of it
    and, for a `version` older than its own, gives every later field its default, so
    this prefix is valid for every NCCL since 2.14."""
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint),
                ("version", ctypes.c_uint), ("blocking", ctypes.c_int)]


def nonblocking_config():
    """An ncclConfig_t asking for a non-blocking communicator (blocking=0)."""
    return Config(ctypes.sizeof(Config), 0xCAFEBEEF, 21400, 0)


def library_candidates():
    """Where libnccl.so.2 may be: the NVIDIA wheels in every site-packages on sys.path,
    then the system's."""
    found = []
    for base in sys.path:
        for pattern in ("nvidia/nccl/lib/libnccl.so*", "nvidia/cu13/lib/libnccl.so*",
                        "nvidia/cu12/lib/libnccl.so*"):
            found += sorted(glob.glob(os.path.join(base, pattern)))
    name = ctypes.util.find_library("nccl")
    if name:
        found.append(name)
    found.append("libnccl.so.2")
    return found


_lib = [None]


def load_library():
    """The loaded NCCL (ctypes.CDLL), loaded once; DistributedError when none is found."""
    if _lib[0] is not None:
        return _lib[0]
    errors = []
    for path in library_candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for fn, args in (("ncclAllReduce", [vp, vp, sz, i, i, vp, vp]),
                         ("ncclBroadcast", [vp, vp, sz, i, i, vp, vp]),
                         ("ncclAllGather", [vp, vp, sz, i, vp, vp]),
                         ("ncclReduceScatter", [vp, vp, sz, i, i, vp, vp]),
                         ("ncclSend", [vp, sz, i, i, vp, vp]),
                         ("ncclRecv", [vp, sz, i, i, vp, vp]),
                         ("ncclCommInitRank", [ctypes.POINTER(vp), i, UniqueId, i]),
                         ("ncclGetUniqueId", [ctypes.POINTER(UniqueId)]),
                         ("ncclCommDestroy", [vp]), ("ncclCommAbort", [vp]),
                         ("ncclGroupStart", []), ("ncclGroupEnd", []),
                         ("ncclGetVersion", [ctypes.POINTER(i)]),
                         ("ncclCommGetAsyncError", [vp, ctypes.POINTER(i)]),
                         ("ncclCommFinalize", [vp]),
                         ("ncclCommInitRankConfig", [ctypes.POINTER(vp), i, UniqueId, i,
                                                     ctypes.POINTER(Config)])):
            f = getattr(lib, fn, None)
            if f is None:      # ncclCommInitRankConfig, ncclCommFinalize: NCCL 2.14 on
                continue
            f.argtypes = args
            f.restype = ctypes.c_int
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        _lib[0] = lib
        return lib
    raise DistributedError("the nccl backend could not load libnccl.so.2 (pip install "
                           "nvidia-nccl-cu12 or nvidia-nccl-cu13, or install NCCL): "
                           + "; ".join(errors[-3:]))


def available() -> bool:
    """True when libnccl can be loaded."""
    try:
        load_library()
        return True
    except DistributedError:
        return False


def version() -> int:
    """NCCL's version code (e.g. 22703 for 2.27.3)."""
    v = ctypes.c_int()
    load_library().ncclGetVersion(ctypes.byref(v))
    return v.value


def new_unique_id() -> bytes:
    """A fresh ncclUniqueId (made by rank 0, shared through the rendezvous)."""
    uid = UniqueId()
    _check(load_library().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    # all 128 bytes (reading the c_char array field would stop at the first zero byte)
    return ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid))


def _check(rc, what):
    if rc != 0:
        msg = load_library().ncclGetErrorString(rc).decode(errors="replace")
        raise DistributedError(f"{what} failed: NCCL error {rc} ({msg})")


class SideReduce:
    """A collective queued on the side stream (NcclBackend._call). `join()`
    makes the work queued afterwards on the device's stream wait for it (the host does
    not wait: the watchdog guards host waits); `result` is a flat tensor holding the sum
    (None: the input's own buffer holds it). Its event goes back to the backend once it
    ran and was joined."""

    __slots__ = ("backend", "event", "result", "item", "joined", "finished")

    def __init__(self, backend, event):
        self.backend = backend
        self.event = event
        self.result = None
        self.item = None
        self.joined = self.finished = False

    def is_done(self):
        return self.backend.watchdog.is_done(self.item)

    def join(self):
        if not self.joined:
            self.backend.driver.stream_wait_event(self.event)
            self.joined = True
            self._recycle()

    def ran(self):
        self.finished = True
        self._recycle()

    def _recycle(self):
        if self.joined and self.finished:
            self.backend._events.append(self.event)


class NcclBackend:
    """One NCCL communicator over the world, bound to one zyx CUDA device, created
    non-blocking and watched (watchdog.NcclWatchdog): every collective is tracked by a CUDA
    event, and every host wait on the device's stream first waits for the collectives
    against the timeout, so a failed peer raises DistributedError instead of hanging."""

    name = "nccl"

    def __init__(self, uid: bytes, rank, size, device, timeout):
        self.lib = load_library()
        self.rank, self.size, self.timeout = rank, size, timeout
        self.device = device                 # "cuda:<i>"
        zeros(1, device=device).realize()    # the device's context is current from here
        self.dev = RT.resolve(device)
        self.driver = self.dev.driver
        self._events = []                    # CUDA events free for reuse
        self.comm = ctypes.c_void_p()
        self.watchdog = NcclWatchdog(self.lib, self.comm, rank, size, timeout)
        uid_s = UniqueId()
        ctypes.memmove(ctypes.addressof(uid_s), uid, ctypes.sizeof(uid_s))
        if hasattr(self.lib, "ncclCommInitRankConfig"):
            config = nonblocking_config()
            rc = self.lib.ncclCommInitRankConfig(ctypes.byref(self.comm), size, uid_s, rank,
                                                 ctypes.byref(config))
            if rc not in (0, 7):             # 7: ncclInProgress, polled below
                _check(rc, "ncclCommInitRankConfig")
            self.watchdog.settle(rc, "ncclCommInitRank (creating the communicator)")
        else:                                # NCCL < 2.14: creation blocks, no deadline
            _check(self.lib.ncclCommInitRank(ctypes.byref(self.comm), size, uid_s, rank),
                   "ncclCommInitRank")
        self.driver.add_wait_guard(self._guard)

    def _guard(self):
        """Before the host waits on the stream: the queued collectives first (raises on a
        failure or past the timeout; the stream then drains)."""
        if self.watchdog.pending:
            self.watchdog.wait()

    def _call(self, what, fn, *args, join=True):
        """Run NCCL call `fn(*args, comm, stream)` for collective `what` on the device's
        side stream, after everything queued on its stream so far (an event orders it);
        track it. Every collective goes there, so NCCL sees them in one stream's order.
        With `join` the device's stream waits for it (kernels queued later read its
        result); else the caller joins the returned SideReduce when it needs the result,
        and kernels queued before that run beside the transfer."""
        self.watchdog.check_usable(what)
        driver = self.driver
        side = driver.side_stream()
        before = self._event()
        driver.event_record(before)
        driver.stream_wait_event(before, side)
        self._events.append(before)       # the wait took its state: free to record again
        rc = fn(*args, self.comm, ctypes.c_void_p(int(side)))
        self.watchdog.settle(rc, what)
        ev = self._event()
        driver.event_record(ev, side)
        job = SideReduce(self, ev)
        job.item = self.watchdog.track(what, lambda: driver.event_query(ev), job.ran)
        if join:
            job.join()
        return job

    def _event(self):
        return self._events.pop() if self._events else self.driver.event_create()

    # -- collectives beside the kernels --------------------------------------------------------
    def start_all_reduce(self, buffer, numel, dtype, op, in_place):
        """All-reduce the device Buffer `buffer` (`numel` elements of `dtype`) without
        joining: kernels queued after it run beside the transfer (see _call). In place
        when `in_place` (nothing else can see the buffer), else into a fresh buffer, the
        SideReduce's `result` (a flat tensor). Join it before anything reads the result."""
        code = self.dtype_code(dtype)
        out = None if in_place else self._fresh((numel,), dtype)
        job = self._call("all_reduce", self.lib.ncclAllReduce, buffer.ptr,
                         buffer.ptr if out is None else self._ptr(out), numel, code,
                         _OPS[op.name], join=False)
        job.result = out
        return job

    # -- buffers -------------------------------------------------------------------------
    def _ptr(self, t):
        if str(t.device) != str(self.dev_name):
            raise DistributedError(f"the nccl process group works on {self.dev_name}, "
                                   f"got a tensor on {t.device}: move it there (or use the "
                                   "mpi backend for CPU tensors)")
        t.realize()
        return RT.graph.get(t._id).buffer.ptr

    @property
    def dev_name(self):
        return RT.name_of(self.dev)

    def _dtype(self, t):
        return self.dtype_code(t.dtype)

    @staticmethod
    def dtype_code(dtype):
        """NCCL's ncclDataType_t of a zyx dtype; DistributedError when NCCL has none."""
        code = _DTYPES.get(dtype)
        if code is None:
            raise DistributedError(f"nccl has no {dtype.name} type")
        return code

    def _fresh(self, shape, dtype):
        """A new leaf over its own device buffer for NCCL to write (from the pool, not
        filled: NCCL writes every element)."""
        n = math.prod(shape)
        with RT.lock:
            buf, _ = self.dev.pool.allocate(max(n * dtype.itemsize, 1))
        return Tensor._wrap(RT.graph.leaf(buf, tuple(shape), dtype))

    @staticmethod
    def _assign(t, src):
        set_value(t, src)

    def _done(self, job, async_op):
        """Stream order is the synchronization (later kernels on the stream run after),
        so a synchronous collective returns at once; the watchdog waits for it at the
        next host wait. The work handle's wait() blocks until it ran, against the timeout
        (or wait's own), as torch's does."""
        if not async_op:
            return None
        item = job.item
        return Work(lambda: self.watchdog.is_done(item),
                    lambda timeout: self.watchdog.wait(
                        item, None if timeout is None else
                        getattr(timeout, "total_seconds", lambda: timeout)()))

    # -- collectives -------------------------------------------------------------------------
    def allgather_meta(self, meta: np.ndarray, what: str) -> np.ndarray:
        t = Tensor(np.array(meta), device=self.dev_name)
        out = self._fresh((self.size, meta.size), dt.int64)
        self._call(what, self.lib.ncclAllGather, self._ptr(t), self._ptr(out), meta.size, 4)
        return out.numpy()              # a host wait: the watchdog guards it

    def all_reduce(self, t, op, async_op):
        src = self._ptr(t)
        if sole_owner(t):
            # nothing but t can see its buffer: NCCL reduces in place (send == recv)
            job = self._call("all_reduce", self.lib.ncclAllReduce, src, src, t.numel(),
                             self._dtype(t), _OPS[op.name])
            return self._done(job, async_op)
        out = self._fresh(t.shape, t.dtype)
        job = self._call("all_reduce", self.lib.ncclAllReduce, src, self._ptr(out),
                         t.numel(), self._dtype(t), _OPS[op.name])
        self._assign(t, out)
        return self._done(job, async_op)

    def broadcast(self, t, src, async_op):
        out = self._fresh(t.shape, t.dtype)
        send = self._ptr(t) if self.rank == src else self._ptr(out)
        job = self._call("broadcast", self.lib.ncclBroadcast, send, self._ptr(out),
                         t.numel(), self._dtype(t), src)
        if self.rank != src:
            self._assign(t, out)
        return self._done(job, async_op)

    def _gather(self, t, what):
        out = self._fresh((self.size,) + tuple(t.shape), t.dtype)
        job = self._call(what, self.lib.ncclAllGather, self._ptr(t), self._ptr(out),
                         t.numel(), self._dtype(t))
        return out, job

    def all_gather(self, outs, t, async_op):
        out, job = self._gather(t, "all_gather")
        for i, o in enumerate(outs):
            self._assign(o, out[i])
        return self._done(job, async_op)

    def all_gather_into_tensor(self, out, t, async_op):
        res, job = self._gather(t, "all_gather_into_tensor")
        self._assign(out, res.reshape(out.shape))
        return self._done(job, async_op)

    def reduce_scatter_tensor(self, out, t, op, async_op):
        res = self._fresh(out.shape, out.dtype)
        job = self._call("reduce_scatter", self.lib.ncclReduceScatter, self._ptr(t),
                         self._ptr(res), out.numel(), self._dtype(t), _OPS[op.name])
        self._assign(out, res)
        return self._done(job, async_op)

    def send(self, t, dst, tag, meta, async_op):
        what = f"send to rank {dst}"
        if meta is not None:
            m = Tensor(np.array(meta), device=self.dev_name)
            self._call(what, self.lib.ncclSend, self._ptr(m), meta.size, 4, dst)
        job = self._call(what, self.lib.ncclSend, self._ptr(t), t.numel(), self._dtype(t),
                         dst)
        return self._done(job, async_op)

    def recv(self, t, src, tag, meta, check, async_op):
        if src is None:
            raise DistributedError("the nccl backend needs recv's src rank")
        what = f"recv from rank {src}"
        if meta is not None:
            got = self._fresh((meta.size,), dt.int64)
            self._call(what, self.lib.ncclRecv, self._ptr(got), meta.size, 4, src)
            check(got.numpy(), src)
        out = self._fresh(t.shape, t.dtype)
        job = self._call(what, self.lib.ncclRecv, self._ptr(out), t.numel(),
                         self._dtype(t), src)
        self._assign(t, out)
        return self._done(job, async_op), src

    def barrier(self, async_op=False):
        one = Tensor(np.ones(1, np.float32), device=self.dev_name)
        self.all_reduce(one, ReduceOp.SUM, False)
        one.numpy()                     # waits for the stream: every rank got here
        return completed_work() if async_op else None

    def destroy(self):
        """Destroy the communicator once its work ran (within the timeout); after an
        abort there is nothing left to destroy."""
        self.driver.remove_wait_guard(self._guard)
        try:
            if self.watchdog.aborted is None:
                self.watchdog.wait()
                RT.synchronize(self.dev_name)
                if hasattr(self.lib, "ncclCommFinalize"):
                    # a non-blocking communicator flushes its work here (ncclInProgress,
                    # polled against the timeout); destroy then only frees it
                    self.watchdog.settle(self.lib.ncclCommFinalize(self.comm),
                                         "ncclCommFinalize (destroy_process_group)")
                rc = self.lib.ncclCommDestroy(self.comm)
                if rc != 7:
                    _check(rc, "ncclCommDestroy")
        finally:
            for ev in self._events:
                self.driver.event_destroy(ev)
            self._events = []
