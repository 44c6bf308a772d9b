"""C backend: the device runtime. One C99 function per kernel (outer loops parallel with
OpenMP, inner loops written for the compiler's vectorizer), a whole plan as one function
running them all, compiled by the system C compiler into a shared library and called
through ctypes with cached function pointers.

What is where: the C text comes from zyx.codegen.cpu (`render` for a kernel, `plan` for a
plan), the compiler and what it can do from `ctoolchain`, the verified disk cache of
libraries from `binary_cache`. Here: the device (compile, compile_many, compile_plan,
launch, run_plan), loading and unloading libraries, and fork() handling.

Compiled libraries live in the disk cache keyed by source + compiler version + the CPU
features -march=native resolves to + flags, so a second process compiles nothing and a
cache shared between machines never loads code built for another CPU. Every library zyx
writes has its SHA-256 beside it (`c-<key>.sha256`); a library that does not match is
deleted and rebuilt, never loaded. Config (`"c"` section of config.json, or env):
    compiler  (ZYX_CC, then CC, then cc/gcc/clang)   flags  (list, replaces the defaults)
    threads   (OpenMP threads, default: all cores; ZYX_THREADS)   enabled (default true)
    cache_mb  (disk cache bound, least recently used libraries go first; default 512)
    compile_timeout_s  (a compiler run taking longer is killed; default 300)
"""
from __future__ import annotations

import _ctypes
import ctypes
import hashlib
import os
import shutil
import sys
import tempfile
import time
import weakref

from ..codegen.cpu.plan import plan_source
from ..codegen.cpu.render import CTarget, prelude, render_kernel
from ..codegen.target import DeviceInfo
from ..errors import BackendError
from . import cache_dir
from .binary_cache import BinaryCache
from .ctoolchain import (Toolchain, config_number, configure_openmp, cpu_identity,
                         open_library_defining, thread_count, vector_bytes)
from .host import HostMemoryPool

DEFAULT_CACHE_MB = 512


class _CacheUnusable(Exception):
    """The cache directory cannot take a new library (read-only, full, ...); `lib` is the
    library when it could be built elsewhere."""

    def __init__(self, reason, lib=None):
        super().__init__(reason)
        self.lib = lib


class _Library:
    """A loaded kernel library. Programs hold it; when the last one is dropped (its plans
    left the plan cache) it is unloaded, so a process running many shapes does not keep
    every library it ever built mapped."""
    __slots__ = ("dll", "keep", "__weakref__")

    def __init__(self, path, keep=False):
        self.keep = keep
        self.dll = None
        self.dll = ctypes.CDLL(path)     # OSError: __del__ still runs, with dll None

    def __del__(self):
        # nothing runs in a library once no program refers to it; at exit let the
        # process go down with its mappings. A library that failed to load (the
        # compiler wrote junk) has nothing to close.
        dll = getattr(self, "dll", None)
        if dll is not None and not getattr(self, "keep", True) and not sys.is_finalizing():
            try:
                _ctypes.dlclose(dll._handle)
            except (OSError, AttributeError, TypeError):
                pass


class CProgram:
    """One kernel compiled alone: `fn(void** args)` in its library."""
    __slots__ = ("fn", "lib", "argtype", "name", "source", "__weakref__")

    def __init__(self, lib, name, nargs, source):
        self.lib = lib
        self.name = name
        self.fn = getattr(lib.dll, name)
        self.fn.argtypes = [ctypes.c_void_p]
        self.fn.restype = None
        self.argtype = ctypes.c_void_p * max(nargs, 1)
        self.source = source


class CPlanProgram:
    """A compiled plan: `zyx_plan(void** table, int par)` runs every kernel of one
    realization; `parallel` says whether any of them would use the thread team."""
    __slots__ = ("fn", "lib", "argtype", "source", "parallel", "__weakref__")

    def __init__(self, lib, nslots, source, parallel):
        self.lib = lib
        self.fn = lib.dll.zyx_plan
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.fn.restype = None
        self.argtype = ctypes.c_void_p * max(nslots, 1)
        self.source = source
        self.parallel = parallel


_LIVE_DEVICES = weakref.WeakSet()
_FORKED = False     # this process was fork()ed from one that had imported zyx


def _after_fork_in_child():
    global _FORKED
    _FORKED = True
    for dev in list(_LIVE_DEVICES):
        dev.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class CDevice:
    """The CPU as a zyx device: kernels and plans rendered to C, compiled by the
    toolchain into libraries kept in the disk cache, run through ctypes."""

    def __init__(self, cfg, pool, debug=0):
        self.debug = debug
        self.pool = pool
        self.cache = cache_dir()
        self.toolchain = tc = Toolchain(cfg, self.cache)
        self.threads = thread_count(cfg)
        self.disk = BinaryCache(
            "c", "so", self.cache, debug=debug,
            max_bytes=int(config_number(cfg, "cache_mb", DEFAULT_CACHE_MB) * 2**20),
            fallback="compiling into private temporary directories without a disk cache")
        self._programs = weakref.WeakValueDictionary()   # kernel -> CProgram some plan holds
        self._loaded = weakref.WeakValueDictionary()     # cache key -> _Library in use
        self._omp = None           # the OpenMP runtime, opened once more, never closed
        self._can_unload = True    # False where the OpenMP runtime could not be pinned
        self.compiled = 0      # compiler runs (disk-cache misses) in this process
        self._info = DeviceInfo(name=f"C ({os.path.basename(tc.cc)}, "
                                     f"{os.cpu_count()} threads{', OpenMP' if tc.openmp else ''})",
                                compute=2e10 * (os.cpu_count() or 1),
                                num_cores=os.cpu_count() or 1,
                                preferred_vector_size=vector_bytes(tc.flags))
        if tc.openmp:
            configure_openmp(self.threads)
        # the team size is also written into every parallel region (CTarget.team_clause):
        # an OpenMP runtime that another library (torch) loaded first read
        # OMP_NUM_THREADS before this; the count at start-up, as it always was
        self._region_threads = self.threads
        _LIVE_DEVICES.add(self)
        if _FORKED:     # the parent may have started a thread team (this or another device)
            self.forked()

    def forked(self):
        """Called in a fork()ed child: the parent's OpenMP thread team did not survive the
        fork (only the forking thread did), and libgomp would wait for it forever in the
        next parallel region. The child runs every plan on its one thread."""
        self.run_plan = self._run_plan_serial
        if self._omp is not None:
            self._omp.omp_set_num_threads(1)   # kernels compiled alone (compile()) too

    def set_threads(self, n):
        """zyx.set_num_threads: the OpenMP team size of this device's plans from now on
        (read when a plan runs, so plans compiled before follow it too)."""
        self.threads = n
        if self._omp is not None:
            self._omp.omp_set_num_threads(n)

    def info(self):
        return self._info

    @property
    def identity(self):
        """What a tuned schedule depends on besides the kernel (autotune's cache key): the
        compiler, its flags and the CPU."""
        tc = self.toolchain
        return f"c|{tc.cc}|{tc.fingerprint}|{' '.join(tc.flags)}|{cpu_identity()}"

    # -- codegen (zyx.codegen.cpu.render / plan) -----------------------------------------
    def target(self):
        """What the C written now depends on besides the kernel (`threads` may change
        after start-up: zyx.set_num_threads)."""
        tc = self.toolchain
        return CTarget(openmp=tc.openmp, mvec=tc.mvec,
                       vector_bytes=self._info.preferred_vector_size,
                       team=self.threads or self._info.num_cores,
                       num_threads=self._region_threads if tc.openmp else 0)

    def render(self, kernel, name):
        """C source of `kernel` as a function `void name(void** args)` callable on its own."""
        return render_kernel(kernel, name, self.target())[0]

    def compile(self, kernel):
        return self.compile_many([kernel])[0]

    def compile_many(self, kernels):
        """Compile kernels not seen before into ONE shared library (one compiler run per
        plan instead of per kernel); cached on disk by source + compiler + flags."""
        found = {}          # strong references: _programs only keeps what someone holds
        for k in kernels:
            prog = self._programs.get(k)
            if prog is not None:
                found[k] = prog
        todo = [k for k in dict.fromkeys(kernels) if k not in found]
        if todo:
            names = [f"zyx_k{i}" for i in range(len(todo))]
            target = self.target()
            funcs = [render_kernel(k, n, target)[0] for k, n in zip(todo, names)]
            src = prelude(target) + "".join(funcs)
            lib = self._build(src, names)
            for k, n, f in zip(todo, names, funcs):
                found[k] = self._programs[k] = CProgram(lib, n, len(k.args), f)
        return [found[k] for k in kernels]

    def compile_plan(self, items, nslots):
        """One function running a whole plan: `items` are (kernel, arg locations) in order,
        a location being ("t", i) = pointer table entry i or ("a", off) = arena + off
        (table entry 0 is the arena). Consecutive kernels share one OpenMP parallel region:
        the thread team starts once per realization, kernels are separated by the barrier
        that ends each `omp for` / `omp single`, and Python makes one call instead of one
        per kernel."""
        src, parallel = plan_source(items, self.target())
        lib = self._build(src, ["zyx_plan"])
        return CPlanProgram(lib, nslots, src, parallel)

    def run_plan(self, program, table, parallel=True):
        """Run a compiled plan; parallel=False keeps every kernel on this thread."""
        program.fn(program.argtype(*table), 1 if parallel else 0)

    def _run_plan_serial(self, program, table, parallel=True):
        """run_plan of a fork()ed child (see `forked`): never the thread team."""
        program.fn(program.argtype(*table), 0)

    # -- the kernel library cache ---------------------------------------------------------
    def _build(self, src, symbols):
        """The loaded library of `src` (exporting `symbols`): already loaded, from the disk
        cache after checking its digest, or compiled now."""
        tc = self.toolchain
        whole = src if isinstance(src, str) else "\f".join(src)
        key = hashlib.sha256((whole + "|" + tc.cc + "|" + " ".join(tc.flags + tc.libs) +
                              "|" + tc.fingerprint).encode()).hexdigest()[:32]
        if self.debug & 8:
            print(f"zyx: C source {key}\n{whole}", file=sys.stderr)
        lib = self._loaded.get(key)
        if lib is not None:
            return lib
        lib = self._load_cached(key, symbols)
        if lib is None:
            lib = self._compile(src, key, symbols)
        if tc.openmp and self._omp is None and self._can_unload:
            self._pin_openmp_runtime(lib)
        lib.keep = not self._can_unload
        self._loaded[key] = lib
        return lib

    def _pin_openmp_runtime(self, lib):
        """Once a kernel library has brought in the OpenMP runtime, open that runtime once
        more and never close it: kernel libraries are unloaded when their plans go, and
        unloading libgomp under its idle thread team would crash the process. Where the
        runtime cannot be found (no dladdr), libraries are never unloaded instead."""
        try:
            fn = lib.dll.omp_set_num_threads   # searched in lib and its dependencies
        except AttributeError:
            return            # this library has no parallel code: it did not load OpenMP
        self._omp = open_library_defining(fn)
        if self._omp is None:
            self._can_unload = False
            return
        if _FORKED:
            self._omp.omp_set_num_threads(1)

    def _load_cached(self, key, symbols):
        """The cached library of `key`, its bytes checked against the digest written with
        it (BinaryCache.verified_path: loading a replaced or damaged one would run whatever
        its constructors do, or die of SIGBUS on a truncated file); None when absent,
        damaged or not loadable (then deleted)."""
        path = self.disk.verified_path(key)
        if path is None:
            return None
        try:
            lib = _Library(path)
        except OSError:
            self.disk.discard(key)
            return None
        if not all(hasattr(lib.dll, s) for s in symbols):
            self.disk.discard(key)
            return None
        return lib

    def _note(self, message):
        if self.debug & 32:
            print(f"zyx: {message}", file=sys.stderr)

    def _compile(self, src, key, symbols):
        """Compile `src` in a temporary directory of the cache and publish the library
        (with its digest) by renaming; when the cache directory cannot take it (read-only,
        full disk) compile in a private temporary directory instead, without disk cache."""
        t0 = time.perf_counter()
        lib = None
        if self.disk.enabled:
            try:
                lib = self._compile_in(True, src, key, symbols)
            except _CacheUnusable as e:
                self.disk.disable(e)
                lib = e.lib
        if lib is None:
            lib = self._compile_in(False, src, key, symbols)
        self.compiled += 1
        self._note(f"compiled {key} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        return lib

    def _compile_in(self, cached, src, key, symbols):
        """Compile and load in a fresh temporary directory, in the cache when `cached` (else
        the system's temp dir), removed afterwards whatever happens; the library is
        published into the cache only when `cached`."""
        try:
            work = self.disk.workdir() if cached else tempfile.mkdtemp(prefix="tmp-")
        except OSError as e:
            if not cached:
                raise BackendError(f"C backend: cannot create a temporary directory: {e}") \
                    from None
            raise _CacheUnusable(e.strerror) from None
        try:
            units = [src] if isinstance(src, str) else src
            c_paths = [os.path.join(work, f"k{n}.c") for n in range(len(units))]
            so_path = os.path.join(work, "k.so")
            try:
                for c_path, text in zip(c_paths, units):
                    with open(c_path, "w") as f:
                        f.write(text)
            except OSError as e:
                if not cached:
                    raise BackendError(f"C backend: cannot write {c_paths[0]}: {e}") from None
                raise _CacheUnusable(e.strerror) from None
            rc, out = self.toolchain.build_library(c_paths, so_path)
            if rc != 0:
                if cached:
                    # maybe the cache's disk is full: tell by trying where it is not
                    # (a real compile error fails there too and is raised from there)
                    raise _CacheUnusable(f"the compiler could not write there: "
                                         f"{out.strip()[-300:]}",
                                         self._compile_in(False, src, key, symbols))
                raise BackendError(f"C compiler failed ({self.toolchain.cc}):\n{out}\n--- source ---\n"
                                   f"{src if isinstance(src, str) else chr(10).join(src)}")
            lib = self._load_fresh(so_path, symbols, out)
            if cached:   # (a cache refusing it turns itself off, with a warning)
                self.disk.publish(key, so_path)
            return lib
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _load_fresh(self, so_path, symbols, out):
        """Load what the compiler just wrote; junk from a compiler that exited 0 is an
        error here and never reaches the cache."""
        try:
            lib = _Library(so_path)
        except OSError as e:
            raise BackendError(f"C backend: {self.toolchain.cc} exited 0 but wrote no loadable library "
                               f"({e}); compiler output:\n{out}") from None
        missing = [s for s in symbols if not hasattr(lib.dll, s)]
        if missing:
            raise BackendError(f"C backend: the library {self.toolchain.cc} wrote lacks {missing}")
        return lib

    def launch(self, program, pool, args, wait_events=()):
        program.fn(program.argtype(*[b.ptr for b in args]))
        return None

    def release(self, program):
        """Nothing to do here: a program's library is unloaded when the last plan or
        caller holding a program of it drops it (Python's reference count on _Library),
        which is how programs shared by several plans stay loaded while one is in use."""


def initialize(cfg, debug=0):
    pool = HostMemoryPool()
    dev = CDevice(cfg, pool, debug)
    return [pool], [dev]
