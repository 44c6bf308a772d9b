"""The `nccl` backend: NCCL's collectives on CUDA tensors, NCCL loaded with ctypes.

The library comes from the `nvidia-nccl-cu13` / `nvidia-nccl-cu12` wheel (PyTorch's CUDA
builds depend on it) or the system (`find_library("nccl")`). Every call is enqueued on the
zyx CUDA device's one in-order stream (`device.dlpack_stream`), with the realized tensors'
device pointers: kernels queued before a collective run before it, kernels queued after
run after it, and data never passes through the host. A collective writes a fresh device
buffer (a realized zero tensor) that becomes the caller's tensor's value
(`work.set_value`: torch's in-place semantics).

The ranks meet through the rendezvous store (or MPI when an MPI launcher started them):
rank 0 makes the NCCL unique id, the others read it there."""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

import numpy as np

from .. import dtype as dt
from ..runtime import RT
from ..tensor import Tensor, zeros
from .work import DistributedError, ReduceOp, completed_work, set_value

# ncclDataType_t and ncclRedOp_t values (nccl.h)
_DTYPES = {dt.int32: 2, dt.int64: 4, dt.float16: 6, dt.float32: 7, dt.float64: 8,
           dt.bfloat16: 9}
_OPS = {"SUM": 0, "PRODUCT": 1, "MAX": 2, "MIN": 3, "AVG": 4}


class UniqueId(ctypes.Structure):
    """ncclUniqueId: 128 opaque bytes, passed by value to ncclCommInitRank."""
    _fields_ = [("internal", ctypes.c_char * 128)]


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
                         ("ncclGetVersion", [ctypes.POINTER(i)])):
            f = getattr(lib, fn)
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


class NcclBackend:
    """One NCCL communicator over the world, bound to one zyx CUDA device."""

    name = "nccl"

    def __init__(self, uid: bytes, rank, size, device, timeout):
        self.lib = load_library()
        self.rank, self.size, self.timeout = rank, size, timeout
        self.device = device                 # "cuda:<i>"
        zeros(1, device=device).realize()    # the device's context is current from here
        self.dev = RT.resolve(device)
        self.comm = ctypes.c_void_p()
        uid_s = UniqueId()
        ctypes.memmove(ctypes.addressof(uid_s), uid, ctypes.sizeof(uid_s))
        _check(self.lib.ncclCommInitRank(ctypes.byref(self.comm), size, uid_s, rank),
               "ncclCommInitRank")

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

    def _stream(self):
        return ctypes.c_void_p(self.dev.dlpack_stream)

    def _dtype(self, t):
        code = _DTYPES.get(t.dtype)
        if code is None:
            raise DistributedError(f"nccl has no {t.dtype.name} type")
        return code

    def _fresh(self, shape, dtype):
        """A new realized tensor: its own device buffer for NCCL to write."""
        return zeros(tuple(shape), dtype=dtype, device=self.dev_name).realize()

    @staticmethod
    def _assign(t, src):
        set_value(t, src)

    def _done(self, async_op):
        # stream order is the synchronization: later kernels on the stream run after
        return completed_work() if async_op else None

    # -- collectives -------------------------------------------------------------------------
    def allgather_meta(self, meta: np.ndarray, what: str) -> np.ndarray:
        t = Tensor(meta, device=self.dev_name)
        out = self._fresh((self.size, meta.size), dt.int64)
        _check(self.lib.ncclAllGather(self._ptr(t), self._ptr(out), meta.size, 4,
                                      self.comm, self._stream()), "ncclAllGather")
        return out.numpy()

    def all_reduce(self, t, op, async_op):
        out = self._fresh(t.shape, t.dtype)
        _check(self.lib.ncclAllReduce(self._ptr(t), self._ptr(out), t.numel(),
                                      self._dtype(t), _OPS[op.name], self.comm,
                                      self._stream()), "ncclAllReduce")
        self._assign(t, out)
        return self._done(async_op)

    def broadcast(self, t, src, async_op):
        out = self._fresh(t.shape, t.dtype)
        send = self._ptr(t) if self.rank == src else self._ptr(out)
        _check(self.lib.ncclBroadcast(send, self._ptr(out), t.numel(), self._dtype(t), src,
                                      self.comm, self._stream()), "ncclBroadcast")
        if self.rank != src:
            self._assign(t, out)
        return self._done(async_op)

    def _gather(self, t):
        out = self._fresh((self.size,) + tuple(t.shape), t.dtype)
        _check(self.lib.ncclAllGather(self._ptr(t), self._ptr(out), t.numel(),
                                      self._dtype(t), self.comm, self._stream()),
               "ncclAllGather")
        return out

    def all_gather(self, outs, t, async_op):
        out = self._gather(t)
        for i, o in enumerate(outs):
            self._assign(o, out[i])
        return self._done(async_op)

    def all_gather_into_tensor(self, out, t, async_op):
        self._assign(out, self._gather(t).reshape(out.shape))
        return self._done(async_op)

    def reduce_scatter_tensor(self, out, t, op, async_op):
        res = self._fresh(out.shape, out.dtype)
        _check(self.lib.ncclReduceScatter(self._ptr(t), self._ptr(res), out.numel(),
                                          self._dtype(t), _OPS[op.name], self.comm,
                                          self._stream()), "ncclReduceScatter")
        self._assign(out, res)
        return self._done(async_op)

    def send(self, t, dst, tag, meta, async_op):
        if meta is not None:
            m = Tensor(meta, device=self.dev_name)
            _check(self.lib.ncclSend(self._ptr(m), meta.size, 4, dst, self.comm,
                                     self._stream()), "ncclSend")
        _check(self.lib.ncclSend(self._ptr(t), t.numel(), self._dtype(t), dst, self.comm,
                                 self._stream()), "ncclSend")
        return self._done(async_op)

    def recv(self, t, src, tag, meta, check, async_op):
        if src is None:
            raise DistributedError("the nccl backend needs recv's src rank")
        if meta is not None:
            got = self._fresh((meta.size,), dt.int64)
            _check(self.lib.ncclRecv(self._ptr(got), meta.size, 4, src, self.comm,
                                     self._stream()), "ncclRecv")
            check(got.numpy(), src)
        out = self._fresh(t.shape, t.dtype)
        _check(self.lib.ncclRecv(self._ptr(out), t.numel(), self._dtype(t), src, self.comm,
                                 self._stream()), "ncclRecv")
        self._assign(t, out)
        return self._done(async_op), src

    def barrier(self, async_op=False):
        one = Tensor(np.ones(1, np.float32), device=self.dev_name)
        self.all_reduce(one, ReduceOp.SUM, False)
        one.numpy()                     # waits for the stream: every rank got here
        return self._done(async_op)

    def destroy(self):
        """Destroy the communicator (after the stream drained)."""
        RT.synchronize(self.dev_name)
        _check(self.lib.ncclCommDestroy(self.comm), "ncclCommDestroy")
