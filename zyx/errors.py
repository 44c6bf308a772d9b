"""Exceptions raised by zyx. Every error is a ZyxError, so `except zyx.ZyxError` catches all."""


class ZyxError(Exception):
    """Base class of every error zyx raises."""


class ShapeError(ZyxError, ValueError):
    """Shapes do not fit the operation (raised when the op is written, not at realization)."""


class DTypeError(ZyxError, TypeError):
    """A dtype is not supported by the operation."""


class AllocationError(ZyxError, MemoryError):
    """A memory pool could not provide the requested bytes."""


class BackendError(ZyxError, RuntimeError):
    """A backend failed to compile, launch or move data."""


class NoBackendAvailable(BackendError):
    """No backend could be initialized (all failed or were disabled in the config)."""


class DimensionError(ShapeError, IndexError):
    """A dimension index is out of range (an IndexError, as torch raises)."""
