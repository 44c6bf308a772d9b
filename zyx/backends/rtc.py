"""Runtime compilation of GPU kernels: NVRTC (CUDA) and hiprtc (HIP) take the same calls
under different names (create program, compile with options, read the log, read the
binary, destroy), so one `RuntimeCompiler` drives both from a table of names. Binaries are
cached in memory by source and on disk (`binary_cache`) by source + compiler version +
target + options, so a second process compiles nothing.
"""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from ..errors import BackendError
from .binary_cache import BinaryCache, cache_key

MAX_THREADS = 16      # most compiler runs at once (`binaries`)

NVRTC_NAMES = {"create": "nvrtcCreateProgram", "compile": "nvrtcCompileProgram",
               "log_size": "nvrtcGetProgramLogSize", "log": "nvrtcGetProgramLog",
               "size": "nvrtcGetCUBINSize", "get": "nvrtcGetCUBIN",
               "destroy": "nvrtcDestroyProgram", "error": "nvrtcGetErrorString"}
HIPRTC_NAMES = {"create": "hiprtcCreateProgram", "compile": "hiprtcCompileProgram",
                "log_size": "hiprtcGetProgramLogSize", "log": "hiprtcGetProgramLog",
                "size": "hiprtcGetCodeSize", "get": "hiprtcGetCode",
                "destroy": "hiprtcDestroyProgram", "error": "hiprtcGetErrorString"}


class RuntimeCompiler:
    """Compiles kernel sources for one target with `api` (the nvrtc or hiprtc module of the
    bindings, whose calls return (result, values...)); `label` names it in errors."""

    def __init__(self, api, names, label, version, target, options, cache_prefix, ext,
                 debug=0):
        self.api = api
        self.fn = {k: getattr(api, v) for k, v in names.items()}
        self.label = label
        self.version = version
        self.target = target
        self.options = list(options)
        self.debug = debug
        self.disk = BinaryCache(cache_prefix, ext)
        self.compiled = 0          # compiler runs in this process (cache misses)
        self._memory = {}          # source -> binary

    def binary(self, source):
        """The compiled binary of `source`: from memory, from the disk cache (verified),
        or compiled now and published to the disk cache."""
        data = self._memory.get(source)
        return data if data is not None else self.binaries([source])[0]

    def binaries(self, sources):
        """`binary` of each of `sources`, the ones neither cache holds compiled in parallel
        threads (one program per thread: NVRTC and hiprtc compile programs independently,
        and the bindings release the GIL while they do; a plan's first realization then
        waits for the slowest kernel, not for their sum). A failure raises the first
        source's error, as compiling them in turn would."""
        missing = []
        for src in dict.fromkeys(sources):
            if src in self._memory:
                continue
            key = cache_key(src, self.label, self.version, self.target, *self.options)
            data = self.disk.load(key)
            if data is None:
                missing.append((src, key))
            else:
                self._memory[src] = data
        if len(missing) > 1:
            workers = min(len(missing), os.cpu_count() or 1, MAX_THREADS)
            with ThreadPoolExecutor(workers) as pool:
                built = list(pool.map(lambda sk: self._run(sk[0]), missing))
        else:
            built = [self._run(src) for src, _ in missing]
        self.compiled += len(missing)
        for (src, key), data in zip(missing, built):
            self.disk.store(key, data)
            self._memory[src] = data
        return [self._memory[src] for src in sources]

    def compile(self, source):
        """Run the compiler (no cache); BackendError with its log and the source on failure."""
        out = self._run(source)
        self.compiled += 1
        return out

    def _run(self, source):
        """`compile` without counting the run (threads of `binaries` count together)."""
        t0 = time.perf_counter()
        fn = self.fn
        err, prog = fn["create"](source.encode(), b"zyx.cu", 0, [], [])
        self._check(err, "create program")
        try:
            opts = [o.encode() for o in self.options]
            err, = fn["compile"](prog, len(opts), opts)
            if int(err) != 0:
                raise BackendError(f"{self.label} failed to compile for {self.target} "
                                   f"({self._error(err)}):\n{self._log(prog)}\n"
                                   f"--- source ---\n{source}")
            err, size = fn["size"](prog)
            self._check(err, "binary size")
            out = bytearray(size)
            err, = fn["get"](prog, out)
            self._check(err, "read binary")
        finally:
            fn["destroy"](prog)
        if not size:
            raise BackendError(f"{self.label} compiled {self.target} code of 0 bytes")
        if self.debug & 32:
            print(f"zyx: {self.label} compiled {size} bytes for {self.target} in "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms", file=sys.stderr)
        return bytes(out)

    def _log(self, prog):
        err, n = self.fn["log_size"](prog)
        if int(err) != 0 or n <= 1:
            return ""
        buf = bytearray(n)
        self.fn["log"](prog, buf)
        return bytes(buf).rstrip(b"\x00").decode(errors="replace")

    def _error(self, err):
        try:
            res = self.fn["error"](err)
            msg = res[-1] if isinstance(res, tuple) else res
            return msg.decode() if isinstance(msg, bytes) else str(msg)
        except Exception:   # naming the error must never hide it
            return str(err)

    def _check(self, err, what):
        if int(err) != 0:
            raise BackendError(f"{self.label}: {what} failed ({self._error(err)})")
