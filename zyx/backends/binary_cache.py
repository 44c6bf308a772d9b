"""The on-disk cache of compiled kernels every backend uses: the C backend's shared
libraries, CUDA cubins, HIP code objects, OpenCL device binaries.

Each binary is `<prefix>-<key>.<ext>` in `cache_dir()` with its SHA-256 beside it
(`<prefix>-<key>.sha256`). A binary is used only when its bytes hash to that digest; one
that does not (flipped bits, truncated, replaced, digest missing) is deleted and the caller
rebuilds it. Writes are atomic (temporary file + rename, digest first, mode 0600; a
library built elsewhere is moved in by a rename, 0700), so a reader never sees half a
file. A directory that refuses a write (read-only, full) turns writing off for this
process with one warning; verified binaries already there are still used, and compiling
still works.

GPU binaries are handed to the driver from memory (`load`), so the bytes hashed are the
bytes loaded. Shared libraries must be dlopen()ed from a file (`verified_path`): the file
could change between the hash and the load only by the hand of someone who can write the
directory, and cache_dir makes sure no one else can.

A cache given `max_bytes` keeps its binaries under that many bytes: past it the least
recently used (by access time, which loading sets) go first, down to 3/4 of it. Temporary
files and directories (`tmp-*`) left by a process killed while writing are removed an
hour later: only those zyx makes (this user's, named as tempfile names them).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import sys
import tempfile
import time

from ..files import write_atomic
from . import cache_dir, warn

STALE_S = 3600     # a temporary this old was left by a killed process
# the names tempfile.mkdtemp/mkstemp(prefix="tmp-") give (BinaryCache.workdir, write_atomic)
_TEMP_NAME = re.compile(r"tmp-[a-z0-9_]{8}")


def cache_key(*parts) -> str:
    """A 32-hex-digit key of everything that determines a binary (source, compiler
    version, target architecture, options)."""
    return hashlib.sha256("\x00".join(str(p) for p in parts).encode()).hexdigest()[:32]


class BinaryCache:
    """Verified binaries named `<prefix>-<key>.<ext>` in a directory (default: cache_dir()).

    `max_bytes`: bound on the bytes of this cache's binaries (None: unbounded).
    `fallback`: what happens instead once the directory refused a write (the warning's
    end). `debug`: ZYX_DEBUG; bit 32 prints why a cached binary was not used."""

    def __init__(self, prefix, ext, directory=None, max_bytes=None, fallback=None, debug=0):
        self.prefix = prefix
        self.ext = ext
        self.directory = directory
        self.max_bytes = max_bytes
        self.fallback = fallback or (f"{prefix} binaries are compiled without a disk cache "
                                     f"in this process")
        self.debug = debug
        self.enabled = True      # False once the directory refused a write: no more writes
        self._bytes = None       # bytes of our binaries on disk (None: not counted yet)

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
        found = self._verified(key)
        return None if found is None else found[1]

    def verified_path(self, key):
        """The path of `key`'s binary after checking its bytes against its digest, for
        what must be loaded from a file (dlopen); None when absent or not matching (then
        deleted). A caller that then cannot load it calls `discard`."""
        found = self._verified(key)
        return None if found is None else found[0]

    def _verified(self, key):
        """(path, bytes) of `key` when they match the digest written with them."""
        path, sum_path = self.paths(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._note(f"cannot read cached {path} ({e.strerror}); rebuilding")
            return None
        try:
            with open(sum_path) as f:
                expected = f.read().strip()
        except OSError:
            expected = None
        if not data or hashlib.sha256(data).hexdigest() != expected:
            self._note(f"cached {path} does not match its digest; deleted, rebuilding")
            self.discard(key)
            return None
        if self.max_bytes is not None:
            try:
                os.utime(path)     # the bound drops least recently used binaries first
            except OSError:
                pass
        return path, data

    def store(self, key, data):
        """Publish `data` under `key`: digest first, then the binary, each atomically.
        Returns False (and turns writing off, with a warning) when the directory refuses
        the write."""
        return self._put(key, lambda: data, lambda path: write_atomic(path, data))

    def publish(self, key, built):
        """Move the file `built` (written in a `workdir`, so on the cache's file system)
        into the cache under `key`: its digest first, then the file by a rename, 0700
        whatever the umask. A file mapped from `built` keeps its mapping, now named by the
        cache path. Returns False (and turns writing off, with a warning) when the
        directory refuses."""
        def read():
            with open(built, "rb") as f:
                return f.read()

        def move(path):
            os.chmod(built, 0o700)
            os.replace(built, path)
        return self._put(key, read, move)

    def _put(self, key, read, put):
        """The binary's bytes from `read()`, their digest written, then `put(path)` places
        the binary; a refusal discards both and turns writing off."""
        if not self.enabled:
            return False
        path, sum_path = self.paths(key)
        try:
            data = read()
            write_atomic(sum_path, hashlib.sha256(data).hexdigest().encode())
            put(path)
        except OSError as e:
            self.discard(key)
            self.disable(e.strerror or e)
            return False
        self._bound(len(data))
        return True

    def workdir(self):
        """A new private temporary directory `tmp-*` in the cache directory, for building a
        binary to `publish` (the caller removes it; one a killed process left is removed
        later). OSError when the directory refuses."""
        return tempfile.mkdtemp(prefix="tmp-", dir=self._dir())

    def discard(self, key):
        for p in self.paths(key):
            try:
                os.unlink(p)
            except OSError:
                pass

    def disable(self, reason):
        """The directory refused a write: warn once and write nothing more."""
        if self.enabled:
            self.enabled = False
            warn(f"zyx: kernel cache {self._dir()} is not usable ({reason}); {self.fallback}")

    def _note(self, message):
        if self.debug & 32:
            print(f"zyx: {message}", file=sys.stderr)

    def _bound(self, added):
        """Keep the binaries on disk under `max_bytes`: past it, delete the least recently
        used (by access time) down to 3/4 of it."""
        if self.max_bytes is None:
            return
        if self._bytes is None:   # this process's first write: look at the directory
            self._bytes = sum(size for _, size, _ in self._entries())
            self._remove_stale_temporaries()
        else:
            self._bytes += added
        if self._bytes <= self.max_bytes:
            return
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        start, end = len(self.prefix) + 1, -len(self.ext) - 1
        for _, size, name in entries:
            if total <= self.max_bytes * 3 // 4:
                break
            self.discard(name[start:end])
            total -= size
        self._bytes = total
        self._remove_stale_temporaries()

    def _entries(self):
        """(access time, bytes, file name) of every binary of this cache."""
        out = []
        head, tail = self.prefix + "-", "." + self.ext
        try:
            with os.scandir(self._dir()) as it:
                for e in it:
                    if e.name.startswith(head) and e.name.endswith(tail):
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        out.append((st.st_atime, st.st_size, e.name))
        except OSError:
            pass
        return out

    def _remove_stale_temporaries(self):
        """Temporaries (`tmp-*`: work directories, half-written files) left by a process
        killed while compiling or writing, an hour old. Only what zyx could have made is
        touched: a name of the shape tempfile gives (`tmp-` and 8 characters), owned by this
        user, a plain file or a directory (never a symbolic link, never followed)."""
        limit = time.time() - STALE_S
        uid = os.getuid() if hasattr(os, "getuid") else None
        try:
            with os.scandir(self._dir()) as it:
                entries = list(it)
        except OSError:
            return
        for e in entries:
            if not _TEMP_NAME.fullmatch(e.name):
                continue
            try:
                st = e.stat(follow_symlinks=False)
                if st.st_mtime >= limit or (uid is not None and st.st_uid != uid):
                    continue
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(e.path, ignore_errors=True)
                elif stat.S_ISREG(st.st_mode):
                    os.unlink(e.path)
            except OSError:
                pass
