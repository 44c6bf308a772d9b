"""Exceptions raised by zyx. Every error is a ZyxError, so `except zyx.ZyxError` catches all."""


class ZyxError(Exception):
    """Base class of every error zyx raises."""


class ShapeError(ZyxError, ValueError):
    """Shapes do not fit the operation (raised when the op is written, not at realization)."""


class DTypeError(ZyxError, TypeError):
    """A dtype is not supported by the operation."""


class UnsupportedDTypeError(DTypeError):
    """A device cannot hold or compute a dtype at all (float64, int64 on WebGPU/Vulkan):
    the tensor or kernel belongs on another device. The message names the device."""


class AllocationError(ZyxError, MemoryError):
    """A memory pool could not provide the requested bytes."""


class BackendError(ZyxError, RuntimeError):
    """A backend failed to compile, launch or move data."""


class DeviceLimitError(BackendError):
    """A kernel exceeds a fixed limit of its device (storage buffers bound to one shader,
    a driver's loop cap): the plan cannot run there as built; the message names the
    device and the limit."""


class NoBackendAvailable(BackendError):
    """No backend could be initialized (all failed or were disabled in the config)."""


class DimensionError(ShapeError, IndexError):
    """A dimension index is out of range (an IndexError, as torch raises)."""


# -- values checked at realization (zyx.set_checks) or when the op is written ------------------
# Each is also the builtin exception torch raises for the same mistake, so code written for
# torch (`except IndexError`, `except RuntimeError`) catches it unchanged.
class IndexOutOfRangeError(ZyxError, IndexError, RuntimeError):
    """An index tensor (getitem, gather, one_hot, embedding, loss targets) holds a value
    outside the indexed dimension. Raised by the realization that reads it, before any of
    its results is stored. torch raises IndexError for most of these and RuntimeError for
    gather and one_hot; this is both."""


class IntegerDivisionByZeroError(ZyxError, ZeroDivisionError, RuntimeError):
    """Integer `//`, `%`, fmod or trunc division by zero (torch: RuntimeError
    "ZeroDivisionError")."""


class ValueOverflowError(ZyxError, OverflowError, RuntimeError):
    """A Python number does not fit the dtype it is converted to (torch: RuntimeError "value
    cannot be converted to type ... without overflow")."""


class InvalidArgumentError(ZyxError, ValueError, RuntimeError):
    """An argument outside its domain, such as a non-positive convolution stride (torch:
    RuntimeError)."""


class JitError(ZyxError, RuntimeError):
    """A `zyx.jit` function that cannot be captured or replayed: its output is not tensors,
    an argument is host data (a numpy array), its inputs live on another device than its
    work, or its structure kept changing past `max_captures` (see docs/jit.md)."""
