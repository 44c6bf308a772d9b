"""Host memory pool: 64-byte aligned numpy-backed buffers with a size-keyed free list, so a
training loop that allocates the same sizes every step reuses memory instead of faulting
in fresh pages."""
from __future__ import annotations

import os

import numpy as np

from ..errors import AllocationError
from .._core.slab import address_of
from . import Buffer, MemoryPool

ALIGN = 64


def _physical_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class HostMemoryPool(MemoryPool):
    name = "host"

    def __init__(self, total_bytes=None, cache_limit=1 << 30):
        super().__init__(total_bytes or _physical_memory())
        self._cache = {}          # nbytes -> [(ndarray, address), ...]
        self._cached_bytes = 0
        self.cache_limit = cache_limit

    def allocate(self, nbytes):
        if nbytes > self.total_bytes - self.used_bytes:
            self.trim()
            raise AllocationError(f"host pool: {nbytes} bytes requested, {self.free_bytes} free")
        lst = self._cache.get(nbytes)
        if lst:   # the steady state of a training loop: same sizes every step
            arr, ptr = lst.pop()
            self._cached_bytes -= nbytes
        else:
            try:
                raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
            except MemoryError:
                self.trim()
                try:
                    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
                except MemoryError:
                    raise AllocationError(f"host pool: cannot allocate {nbytes} bytes") from None
            off = (-address_of(raw)) % ALIGN
            arr = raw[off:off + nbytes]
            ptr = address_of(arr)
        self.used_bytes += nbytes
        return Buffer(self, arr, nbytes, ptr), None

    def borrow(self, arr):
        """A buffer over the memory of the C-contiguous array `arr` (zero copy); freeing
        it only drops the reference. Not counted in used_bytes: the user owns it."""
        flat = arr.reshape(-1).view(np.uint8)
        return Buffer(self, flat, arr.nbytes, address_of(arr), borrowed=True)

    def deallocate(self, buf, wait_events=()):
        if buf.borrowed:
            buf.handle = None
            buf.ptr = 0
            return
        n = buf.nbytes
        self.used_bytes -= n
        if self._cached_bytes + n <= self.cache_limit:
            lst = self._cache.get(n)
            if lst is None:
                self._cache[n] = lst = []
            lst.append((buf.handle, buf.ptr))
            self._cached_bytes += n
        buf.handle = None
        buf.ptr = 0

    @property
    def cached_bytes(self):
        """Bytes of the free blocks kept for reuse."""
        return self._cached_bytes

    def trim(self):
        """Give cached free blocks back to the OS."""
        self._cache.clear()
        self._cached_bytes = 0

    def host_to_pool(self, src, dst, wait_events=()):
        flat = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        dst.handle[:flat.size] = flat
        return None

    def pool_to_host(self, src, dst, wait_events=()):
        dst.reshape(-1).view(np.uint8)[:] = src.handle[:dst.nbytes]

    def view(self, buf, np_dtype, shape):
        """Zero-copy numpy view of a buffer (host memory only)."""
        return buf.handle.view(np_dtype).reshape(shape)
