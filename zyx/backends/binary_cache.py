"""On-disk cache of compiled GPU binaries (CUDA cubins, HIP code objects), verified like the
C backend's libraries.

Each binary is `<prefix>-<key>.<ext>` in `cache_dir()` with its SHA-256 beside it
(`<prefix>-<key>.sha256`). A binary is loaded only when its bytes hash to that digest; one
that does not (flipped bits, truncated, replaced, digest missing) is deleted and the caller
rebuilds it. Writes are atomic (temporary file + rename, digest first, mode 0600), so a
reader never sees half a file. A directory that refuses writes (read-only, full) turns the
cache off for this process with one warning; compiling still works.

GPU binaries are handed to the driver from memory (cuModuleLoadData), so the bytes hashed
are the bytes loaded: nothing can change between the check and the load.
"""
from __future__ import annotations

import hashlib
import os

from ..files import write_atomic
from . import cache_dir, warn


def cache_key(*parts) -> str:
    """A 32-hex-digit key of everything that determines a binary (source, compiler
    version, target architecture, options)."""
    return hashlib.sha256("\x00".join(str(p) for p in parts).encode()).hexdigest()[:32]


class BinaryCache:
    """Verified binaries named `<prefix>-<key>.<ext>` in a directory (default: cache_dir())."""

    def __init__(self, prefix, ext, directory=None):
        self.prefix = prefix
        self.ext = ext
        self.directory = directory
        self.enabled = True

    def _dir(self):
        if self.directory is None:
            self.directory = cache_dir()
        return self.directory

    def paths(self, key):
        """(binary path, digest path) of `key`."""
        base = os.path.join(self._dir(), f"{self.prefix}-{key}")
        return base + "." + self.ext, base + ".sha256"

    def load(self, key):
        """The cached bytes of `key`, or None when absent or not matching their digest
        (then deleted)."""
        if not self.enabled:
            return None
        path, sum_path = self.paths(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        try:
            with open(sum_path) as f:
                expected = f.read().strip()
        except OSError:
            expected = None
        if not data or hashlib.sha256(data).hexdigest() != expected:
            self.discard(key)
            return None
        return data

    def store(self, key, data):
        """Publish `data` under `key`: digest first, then the binary, each atomically.
        Returns False (and turns the cache off, with a warning) when the directory
        refuses the write."""
        if not self.enabled:
            return False
        path, sum_path = self.paths(key)
        try:
            write_atomic(sum_path, hashlib.sha256(data).hexdigest().encode())
            write_atomic(path, data)
            return True
        except OSError as e:
            self.discard(key)
            self.enabled = False
            warn(f"zyx: kernel cache {self._dir()} is not usable ({e.strerror or e}); "
                 f"{self.prefix} binaries are compiled without a disk cache in this process")
            return False

    def discard(self, key):
        for p in self.paths(key):
            try:
                os.unlink(p)
            except OSError:
                pass
