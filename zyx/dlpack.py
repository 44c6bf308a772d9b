"""DLPack exchange: `zyx.from_dlpack(obj)` and `Tensor.__dlpack__` / `__dlpack_device__`, so
numpy, PyTorch, CuPy and zyx hand tensors to each other without copying (CPU and CUDA).

The DLPack structures are declared with ctypes (DLPack 0.8 ABI, the unversioned
"dltensor" capsule every consumer accepts).

Export: the tensor is realized and its buffer gets one more reference (`Buffer.refs`), so
zyx cannot reuse the memory while the consumer holds it; the consumer's call of the
deleter (or the capsule's destructor, if nobody consumed it) drops that reference.
Import: the producer's memory becomes a borrowed buffer of the matching zyx device (never
pooled, never counted); when zyx drops it the producer's deleter runs. Data that is not
compact row-major is copied on the CPU and refused on a GPU (call .contiguous() there).
Writes: both ways the memory stays shared for zyx's in-place ops too. An exported or
imported tensor is registered (`tensor.share_memory`); an in-place op on it (or through
its views and detach() aliases, or an optimizer step) is computed at once and its values
copied into the shared memory, and the tensor goes back to a leaf over that memory, so
the peer sees the write and zyx sees the peer's later writes (zyx/inplace.py).
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from . import dtype as dt
from .errors import DTypeError

# DLDeviceType
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_OPENCL, KDL_ROCM = 1, 2, 3, 4, 10
# DLDataTypeCode
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_BOOL = 0, 1, 2, 4, 6

# DLDeviceType of a zyx device type (also read by Tensor.__dlpack_device__)
DEVICE_TYPE = {"cpu": KDL_CPU, "cuda": KDL_CUDA, "hip": KDL_ROCM}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", _DELETER)]

class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


_VDELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [("version", DLPackVersion),
                                     ("manager_ctx", ctypes.c_void_p),
                                     ("deleter", _VDELETER), ("flags", ctypes.c_uint64),
                                     ("dl_tensor", DLTensor)]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
# the same function declared once more with a raw pointer argument, for the destructor
# (it receives a capsule being deallocated, which must not be turned into a py_object)
_get_pointer_raw = ctypes.pythonapi["PyCapsule_GetPointer"]
_get_pointer_raw.restype = ctypes.c_void_p
_get_pointer_raw.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

_NAME = b"dltensor"
_USED = b"used_dltensor"
_VNAME = b"dltensor_versioned"          # DLPack 1.x (numpy 2 exports read-only arrays only so)
_VUSED = b"used_dltensor_versioned"
_is_valid = ctypes.pythonapi["PyCapsule_IsValid"]
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _dl_dtype(d):
    if d is dt.bool_:
        return DLDataType(KDL_BOOL, 8, 1)
    if d is dt.bfloat16:
        return DLDataType(KDL_BFLOAT, 16, 1)
    code = KDL_FLOAT if d.is_float else (KDL_UINT if d.kind == "u" else KDL_INT)
    return DLDataType(code, d.itemsize * 8, 1)


def _zyx_dtype(t: DLDataType):
    if t.lanes != 1:
        raise DTypeError(f"DLPack tensors with {t.lanes} lanes have no zyx dtype")
    if t.code == KDL_BOOL and t.bits == 8:
        return dt.bool_
    if t.code == KDL_BFLOAT and t.bits == 16:
        return dt.bfloat16
    kind = {KDL_FLOAT: "f", KDL_INT: "i", KDL_UINT: "u"}.get(t.code)
    if kind is not None:
        for d in _ALL_DTYPES:
            if d.kind == kind and d.itemsize * 8 == t.bits and d is not dt.bfloat16 \
                    and d is not dt.bool_:
                return d
    raise DTypeError(f"DLPack dtype (code {t.code}, {t.bits} bits) has no zyx dtype")


_ALL_DTYPES = (dt.bool_, dt.uint8, dt.uint16, dt.uint32, dt.uint64, dt.int8, dt.int16,
               dt.int32, dt.int64, dt.float16, dt.bfloat16, dt.float32, dt.float64)


# -- export -------------------------------------------------------------------------------

class _Export:
    """What one exported capsule keeps alive: the managed tensor struct, its shape array
    and the zyx buffer (one reference, dropped by the deleter)."""
    __slots__ = ("managed", "shape", "buffer", "free")


_live = {}                 # address of DLManagedTensor -> _Export
_live_lock = threading.Lock()


@_DELETER
def _deleter(mt):
    """Called by the consumer (any thread) when it is done with the memory."""
    with _live_lock:
        ex = _live.pop(ctypes.addressof(mt.contents), None)
    if ex is not None:
        ex.free(ex.buffer)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(cap):
    """A capsule nobody consumed still owns its tensor: free it (a consumed capsule was
    renamed "used_dltensor" and its consumer calls the deleter)."""
    if _api.PyCapsule_IsValid(cap, _NAME):
        ptr = _get_pointer_raw(cap, _NAME)
        if ptr:
            _deleter(ctypes.cast(ptr, ctypes.POINTER(DLManagedTensor)))


def export(runtime, nid, device_name, device_id):
    """A "dltensor" capsule over realized node `nid`'s buffer."""
    node = runtime.graph.get(nid)
    buf = node.buffer
    ex = _Export()
    shape = tuple(node.shape)
    ex.shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    ex.buffer = buf
    ex.free = runtime._free_buffer
    mt = DLManagedTensor()
    mt.dl_tensor.data = buf.ptr or None
    mt.dl_tensor.device = DLDevice(DEVICE_TYPE[device_name], device_id)
    mt.dl_tensor.ndim = len(shape)
    mt.dl_tensor.dtype = _dl_dtype(node.dtype)
    mt.dl_tensor.shape = ctypes.cast(ex.shape, ctypes.POINTER(ctypes.c_int64))
    mt.dl_tensor.strides = None            # compact row-major
    mt.dl_tensor.byte_offset = 0
    mt.manager_ctx = None
    mt.deleter = _deleter
    ex.managed = mt
    with runtime.lock:
        buf.refs += 1                      # the consumer's reference
    with _live_lock:
        _live[ctypes.addressof(mt)] = ex
    return _api.PyCapsule_New(ctypes.addressof(mt), _NAME,
                              ctypes.cast(_capsule_destructor, ctypes.c_void_p))


# -- import -------------------------------------------------------------------------------

class Borrowed:
    """The producer's memory while zyx uses it: calls the producer's deleter (`release`)
    when the last reference goes (numpy arrays over it hold this object as their base).
    Also made by zyx.tensor's from_dlpack."""

    def __init__(self, release, data, nbytes):
        self._release = release
        self.ptr = data
        self.nbytes = nbytes
        self.__array_interface__ = {"data": (data, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}

    def __del__(self):
        release, self._release = self._release, None
        if release is not None:
            release()


def request(obj, **kwargs):
    """obj.__dlpack__(...), asking for a versioned capsule (DLPack 1.x) first: numpy 2
    exports a read-only array only that way. zyx never writes borrowed memory (in-place
    ops rebind), so read-only data is fine."""
    try:
        return obj.__dlpack__(max_version=(1, 0), **kwargs)
    except TypeError:          # a producer of the 0.x protocol
        return obj.__dlpack__(**kwargs)


def _releaser(mt):
    """A callable running the producer's deleter of managed tensor `mt` once."""
    def release():
        if mt and mt.contents.deleter:
            mt.contents.deleter(mt)
    return release


def consume(capsule):
    """(release, DLTensor) of a "dltensor" or "dltensor_versioned" capsule, which is
    marked used: its producer no longer frees it, `release()` (called by `Borrowed`)
    runs the producer's deleter."""
    if _is_valid(capsule, _VNAME):
        ptr = _api.PyCapsule_GetPointer(capsule, _VNAME)
        mt = ctypes.cast(ptr, ctypes.POINTER(DLManagedTensorVersioned))
        if mt.contents.version.major > 1:
            raise BufferError(f"DLPack {mt.contents.version.major}.x tensors are not "
                              "supported (1.x and 0.x are)")
        _api.PyCapsule_SetName(capsule, _VUSED)
        return _releaser(mt), mt.contents.dl_tensor
    ptr = _api.PyCapsule_GetPointer(capsule, _NAME)
    mt = ctypes.cast(ptr, ctypes.POINTER(DLManagedTensor))
    _api.PyCapsule_SetName(capsule, _USED)
    return _releaser(mt), mt.contents.dl_tensor


def describe(t: DLTensor):
    """(shape, zyx dtype, data address, compact row-major?) of a DLTensor."""
    shape = tuple(t.shape[i] for i in range(t.ndim))
    d = _zyx_dtype(t.dtype)
    compact = True
    if t.strides:
        expect = 1
        for i in reversed(range(t.ndim)):
            if shape[i] != 1 and t.strides[i] != expect:
                compact = False
                break
            expect *= shape[i]
    return shape, d, (t.data or 0) + t.byte_offset, compact


def host_array(release, t, shape, d, data):
    """A numpy array over CPU DLPack memory (a copy when not compact), and the byte view
    zyx borrows; the producer's deleter runs when neither is referenced any more."""
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    itemsize = d.itemsize
    if n == 0:
        release()
        return np.empty(shape, np.uint8 if d is dt.bool_ else _np_storage(d)), True
    compact = describe(t)[3]
    if compact:
        owner = Borrowed(release, data, n * itemsize)
        return np.asarray(owner).view(_np_storage(d)).reshape(shape), False
    strides = tuple(t.strides[i] * itemsize for i in range(t.ndim))
    if any(s < 0 for s in strides):
        release()
        raise BufferError("DLPack tensors with negative strides are not supported; "
                          "pass a contiguous copy")
    span = sum((s - 1) * abs(st) for s, st in zip(shape, strides)) + itemsize
    owner = Borrowed(release, data, span)
    view = np.lib.stride_tricks.as_strided(np.asarray(owner).view(_np_storage(d)),
                                           shape, strides)
    return np.ascontiguousarray(view), True


def _np_storage(d):
    """numpy dtype holding zyx dtype d's bits (bf16 as uint16)."""
    return np.uint16 if d is dt.bfloat16 else d.np
