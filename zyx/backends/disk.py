"""Disk memory pool: a file mapped into memory, so tensors stored in it are read lazily.

A `DiskMemoryPool` maps one file (read-only by default). `zyx.load` hands out `view`s of
the mapping as Buffers of LEAF nodes; nothing is read until a kernel needs the tensor, when
the runtime moves the leaf into the device pool (`Runtime._move_to_pool` calls
`pool_to_host`), or until `numpy()` copies it out. Pages the OS never faults in are never
read from disk, so a model file of which only a few tensors are used costs only those.

The pool is not a backend of its own (there is no device computing in it): `initialize` is
not defined, so `initialize_backends` never lists it. Pools are made per file.

A writable pool (`writable=True`) also supports `allocate`/`host_to_pool` with a simple
bump allocator and a size-keyed free list over the file's bytes, which is all a file of
fixed size needs.

A mapping reads whatever the file holds now: a file truncated under it would kill the
process with SIGBUS on the next read, and one rewritten in place would silently give other
values. So the pool keeps a descriptor of the mapped file and checks before every read that
its size and modification time are still those seen at load (`FileChangedError` otherwise,
naming the file). Replacing the file by a rename (what `zyx.save` does) is fine: the
mapping and the descriptor keep the old file. A change racing with a read in progress
cannot be caught this way.
"""
from __future__ import annotations

import mmap
import os
import weakref

import numpy as np

from ..errors import AllocationError, BackendError
from . import Buffer, MemoryPool


class FileChangedError(BackendError):
    """A file mapped by a disk pool was truncated or rewritten after it was loaded."""


def _identity(st):
    """What must not change while a file is mapped: which file, its size, its last write
    (not ctime: renaming another file over this one changes it, and that is fine)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class DiskMemoryPool(MemoryPool):
    """Memory pool over one memory-mapped file.

    Buffer handles are byte offsets into the file. `bytes_read` counts the bytes copied out
    by `pool_to_host` (what a laziness test watches)."""
    name = "disk"

    def __init__(self, path, writable=False):
        self.path = os.fspath(path)
        self.writable = writable
        # a missing or unreadable file raises the usual OSError (FileNotFoundError ...)
        with open(self.path, "r+b" if writable else "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            # mmap cannot map an empty file; such a pool simply holds nothing. The mapping
            # outlives the descriptor and keeps the file's inode alive even if the path is
            # replaced (zyx.save writes a new file and renames it over the old one).
            self._map = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE if writable
                                   else mmap.ACCESS_READ) if size else None)
            # our own descriptor of the mapped file, to see it change (`_check_unchanged`)
            self._fd = os.dup(f.fileno())
        weakref.finalize(self, os.close, self._fd)
        self._identity = _identity(st)
        super().__init__(size)
        self.bytes_read = 0
        self.bytes_written = 0
        self._next = 0          # bump pointer of the writable allocator
        self._free = {}         # nbytes -> [offset, ...] given back by deallocate

    def __repr__(self):
        return (f"DiskMemoryPool({self.path!r}, {self.total_bytes} B, "
                f"{'rw' if self.writable else 'ro'})")

    # -- buffers -------------------------------------------------------------------------
    def view(self, offset, nbytes) -> Buffer:
        """A Buffer over bytes [offset, offset + nbytes) of the file, already valid."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.total_bytes:
            raise AllocationError(f"disk pool: bytes [{offset}, {offset + nbytes}) are outside "
                                  f"{self.path!r} of {self.total_bytes} bytes")
        self.used_bytes += nbytes
        return Buffer(self, offset, nbytes)

    def allocate(self, nbytes):
        """Reserve `nbytes` of a writable file (read-only mappings cannot allocate)."""
        if not self.writable:
            raise AllocationError(f"disk pool over {self.path!r} is read-only; "
                                  f"it cannot allocate {nbytes} bytes")
        lst = self._free.get(nbytes)
        if lst:
            off = lst.pop()
        elif self._next + nbytes <= self.total_bytes:
            off = self._next
            self._next += nbytes
        else:
            raise AllocationError(f"disk pool {self.path!r}: {nbytes} bytes requested, "
                                  f"{self.total_bytes - self._next} left at the end of the file")
        self.used_bytes += nbytes
        return Buffer(self, off, nbytes), None

    def deallocate(self, buf, wait_events=()):
        if buf.handle is None:
            return
        self.used_bytes -= buf.nbytes
        if self.writable:
            self._free.setdefault(buf.nbytes, []).append(buf.handle)
        buf.handle = None

    def read(self, offset, nbytes) -> bytes:
        """Raw bytes of the file (for headers; not counted in `bytes_read`)."""
        if self._map is None:
            return b""
        self._check_unchanged()
        return self._map[offset:offset + nbytes]

    def _check_unchanged(self):
        """Raise FileChangedError when the mapped file is no longer what was loaded."""
        if self.writable:
            return      # the pool writes it itself
        now = _identity(os.fstat(self._fd))
        if now == self._identity:
            return
        size, was = now[2], self._identity[2]
        what = (f"truncated from {was} to {size} bytes" if size < was else
                f"grown from {was} to {size} bytes" if size > was else
                "rewritten in place (same size, new modification time)")
        raise FileChangedError(
            f"{self.path!r} was {what} after it was loaded; its lazily loaded tensors "
            "would read other bytes (or crash on a truncated file). Load it again, and "
            "replace model files by writing a new file and renaming it (zyx.save does)")

    # -- transfers -----------------------------------------------------------------------
    def _bytes(self, buf):
        if buf.handle is None:
            raise BackendError("disk pool: buffer was already deallocated")
        self._check_unchanged()
        return np.frombuffer(self._map, dtype=np.uint8, count=buf.nbytes, offset=buf.handle)

    def host_to_pool(self, src, dst, wait_events=()):
        if not self.writable:
            raise BackendError(f"disk pool over {self.path!r} is read-only")
        flat = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        if flat.size > dst.nbytes:
            raise BackendError(f"disk pool: {flat.size} bytes do not fit a "
                               f"{dst.nbytes}-byte buffer")
        if flat.size:
            self._map[dst.handle:dst.handle + flat.size] = flat.tobytes()
        self.bytes_written += flat.size
        return None

    def pool_to_host(self, src, dst, wait_events=()):
        """Copy the buffer's bytes into numpy array `dst` (blocking: disk reads are synchronous)."""
        n = dst.nbytes
        if n > src.nbytes:
            raise BackendError(f"disk pool: {n} bytes requested from a {src.nbytes}-byte buffer")
        if n:
            dst.reshape(-1).view(np.uint8)[:] = self._bytes(src)[:n]
        self.bytes_read += n

    def flush(self):
        """Write a writable mapping back to the file."""
        if self._map is not None and self.writable:
            self._map.flush()
