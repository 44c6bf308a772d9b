"""Freed device blocks kept for reuse: `FreeBlocks`, the bounded cache a GPU pool keeps.

Realizations allocate the same sizes every step, and asking the driver for memory is slow
(cuMemAlloc synchronizes the device), so a pool keeps what it freed, by size. Sizes a
program stops using must not pile up: past `limit` bytes the blocks freed longest ago go
back to the driver (the pool releases what `evict` hands it), so memory returns to other
programs and libraries (PyTorch in the same process).
"""
from __future__ import annotations

from ..errors import BackendError

CACHE_FRACTION = 0.1    # default bound: this much of the device's memory


class FreeBlocks:
    """Blocks (the pool's handles: device addresses, cl.Buffers) by size; `cached_bytes`
    their total, `limit` its bound (the pool evicts past it)."""

    def __init__(self, limit):
        self.limit = limit
        self.cached_bytes = 0
        self._by_size = {}      # nbytes -> [handle], the newest last
        self._order = {}        # id(handle) -> (handle, nbytes), the oldest first

    def take(self, nbytes):
        """A kept block of `nbytes` (the newest), or None."""
        blocks = self._by_size.get(nbytes)
        if not blocks:
            return None
        handle = blocks.pop()
        del self._order[id(handle)]
        self.cached_bytes -= nbytes
        return handle

    def put(self, handle, nbytes):
        """Keep a freed block; True when the cache is now past its limit."""
        self._by_size.setdefault(nbytes, []).append(handle)
        self._order[id(handle)] = (handle, nbytes)
        self.cached_bytes += nbytes
        return self.cached_bytes > self.limit

    def evict(self, keep=0):
        """The blocks to release, the ones freed longest ago first, until at most `keep`
        bytes stay kept (0: every block); they are forgotten here."""
        out = []
        for key, (handle, nbytes) in list(self._order.items()):
            if self.cached_bytes <= keep:
                break
            self._by_size[nbytes].remove(handle)
            del self._order[key]
            self.cached_bytes -= nbytes
            out.append(handle)
        self._by_size = {n: b for n, b in self._by_size.items() if b}
        return out


def default_limit(total_bytes, configured=None):
    """The bound of a pool's kept blocks: `configured` bytes (config cache_limit_mb) or
    CACHE_FRACTION of the device's `total_bytes`."""
    return int(total_bytes * CACHE_FRACTION) if configured is None else configured


def configured_limit(cfg):
    """A backend config section's `cache_limit_mb` in bytes; None (the default) when
    absent; BackendError when it is not a non-negative number."""
    mb = cfg.get("cache_limit_mb")
    if mb is None:
        return None
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or mb < 0:
        raise BackendError(f"cache_limit_mb={mb!r} is not a non-negative number")
    return int(mb * (1 << 20))
