"""C backend: one C99 function per kernel, outer loops parallel with OpenMP, inner loops
written for the compiler's vectorizer; compiled by the system C compiler into a shared
library and called through ctypes with cached function pointers.

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
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref

from ..codegen.cpu.plan import plan_source
from ..codegen.cpu.render import CTarget, prelude, render_kernel, simd_decls
from ..codegen.target import DeviceInfo
from ..errors import BackendError
from ..files import write_atomic
from . import cache_dir, warn
from .binary_cache import BinaryCache
from .host import HostMemoryPool

DEFAULT_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fwrapv", "-fno-math-errno")
DEFAULT_CACHE_MB = 512
DEFAULT_COMPILE_TIMEOUT_S = 300.0
_PROBE_SRC = "int f(int x){return x+1;}"


def _find_compiler(cfg):
    for source, cand in (("c.compiler", cfg.get("compiler")), ("ZYX_CC", os.environ.get("ZYX_CC"))):
        if cand and not (isinstance(cand, str) and shutil.which(cand)):
            warn(f"zyx: ignoring {source}={cand!r}: no such compiler on PATH")
    for cand in (cfg.get("compiler"), os.environ.get("ZYX_CC"), os.environ.get("CC"), "cc", "gcc",
                 "clang"):
        if cand and isinstance(cand, str) and shutil.which(cand):
            return shutil.which(cand)
    raise BackendError("C backend: no C compiler found (set ZYX_CC or install gcc/clang)")


def _config_number(cfg, key, default):
    """A positive number from the config; anything else is ignored with a warning."""
    raw = cfg.get(key, default)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not raw > 0:
        warn(f"zyx: ignoring c.{key}={raw!r}: not a positive number; using {default}")
        return default
    return raw


def _config_flags(cfg):
    """The user's compiler flags (None: the defaults). Not a list of strings: ignored."""
    flags = cfg.get("flags")
    if flags is None:
        return None
    if isinstance(flags, list) and flags and all(isinstance(f, str) for f in flags):
        return list(flags)
    warn(f"zyx: ignoring c.flags={flags!r}: not a list of strings; using the default flags")
    return None


def _thread_limit():
    """Most OpenMP threads zyx asks for: a few per CPU. Far more only slows the team down,
    and OMP_NUM_THREADS=100000 makes libgomp crash the process creating them."""
    return 4 * (os.cpu_count() or 1)


def _thread_count(cfg):
    """`c.threads`, else ZYX_THREADS: 0 (all cores) when unset; a value that is not a
    positive integer is ignored with a warning naming it, an absurd one is clamped."""
    name, raw = ("c.threads", cfg["threads"]) if "threads" in cfg else \
        ("ZYX_THREADS", os.environ.get("ZYX_THREADS"))
    if raw is None or raw == "":
        return 0
    try:
        if isinstance(raw, (bool, float)):
            raise ValueError
        n = int(raw)
        if n < 0:
            raise ValueError
    except (TypeError, ValueError):
        warn(f"zyx: ignoring {name}={raw!r}: not a positive integer; using all cores")
        return 0
    limit = _thread_limit()
    if n > limit:
        warn(f"zyx: {name}={n} is more threads than this machine can use; using {limit}")
        n = limit
    return n


def _clamp_omp_env():
    """OMP_NUM_THREADS far above the CPU count crashes libgomp when it starts the team;
    lower it before the OpenMP runtime reads it (it does once, when first loaded)."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    try:
        n = int(raw.split(",")[0])
    except ValueError:
        return
    limit = _thread_limit()
    if n > limit:
        warn(f"zyx: OMP_NUM_THREADS={raw} is more threads than this machine can use; "
             f"using {limit}")
        os.environ["OMP_NUM_THREADS"] = str(limit)


def _cpu_identity():
    """What -march=native depends on, read cheaply: keys the probe's disk cache so a cache
    shared between machines probes each CPU once."""
    keep = ("vendor_id", "cpu family", "model", "model name", "flags", "Features",
            "CPU implementer", "CPU architecture", "CPU variant", "CPU part")
    lines = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break            # the first processor's block is enough
                if line.split(":")[0].strip() in keep:
                    lines.append(line.strip())
    except OSError:   # no /proc (macOS): this host, whatever CPU it has
        lines += [platform.processor(), platform.node()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _fingerprint(dry_run_output):
    """Hash of what a compiler's `-###` dry run prints: its version and the target flags
    -march=native expands to (the CPU features), so it is part of every cache key.
    Paths (install dirs, clang's working directory) say nothing about the code."""
    words = [w.strip("\"'") for w in dry_run_output.split() if "/" not in w]
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:16]


def _kill_group(proc):
    """Kill a compiler run and everything it started (cc1, as, ld share its group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (OSError, AttributeError):
        proc.kill()
    proc.wait()


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _file_defining(fn):
    """Path of the loaded object that defines ctypes function `fn` (dladdr), or None."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except (OSError, AttributeError, TypeError):   # TypeError: Windows has no CDLL(None)
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)) and info.dli_fname:
        return os.fsdecode(info.dli_fname)
    return None


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
        self.dll = ctypes.CDLL(path)
        self.keep = keep

    def __del__(self):
        # nothing runs in a library once no program refers to it; at exit let the
        # process go down with its mappings
        if not self.keep and not sys.is_finalizing():
            try:
                _ctypes.dlclose(self.dll._handle)
            except (OSError, AttributeError, TypeError):
                pass


class CProgram:
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
    def __init__(self, cfg, pool, debug=0):
        self.debug = debug
        self.pool = pool
        self.cc = _find_compiler(cfg)
        self.cache = cache_dir()
        self.threads = _thread_count(cfg)
        self.disk = BinaryCache(
            "c", "so", self.cache, debug=debug,
            max_bytes=int(_config_number(cfg, "cache_mb", DEFAULT_CACHE_MB) * 2**20),
            fallback="compiling into private temporary directories without a disk cache")
        self.compile_timeout = float(_config_number(cfg, "compile_timeout_s",
                                                    DEFAULT_COMPILE_TIMEOUT_S))
        self.user_flags = _config_flags(cfg)
        self.base_flags = list(self.user_flags or DEFAULT_FLAGS)
        self.openmp, self.mvec, native, wide, self.fingerprint = self._probe()
        if not native:   # e.g. Apple clang < 15 rejects -march=native
            self.base_flags = [f for f in self.base_flags if f != "-march=native"]
        if wide and self.user_flags is None:
            # x86 compilers default to 256-bit vectors even on AVX-512 CPUs; 512-bit ones
            # (and libmvec's 16-wide expf) measured 1.4-1.6x faster on exp-heavy kernels
            self.base_flags.append(WIDE_VECTORS)
        self.flags = list(self.base_flags) + (["-fopenmp"] if self.openmp else [])
        self.libs = (["-lmvec"] if self.mvec else []) + ["-lm"]
        self._programs = weakref.WeakValueDictionary()   # kernel -> CProgram some plan holds
        self._loaded = weakref.WeakValueDictionary()     # cache key -> _Library in use
        self._omp = None           # the OpenMP runtime, opened once more, never closed
        self._can_unload = True    # False where the OpenMP runtime could not be pinned
        self.compiled = 0      # compiler runs (disk-cache misses) in this process
        self._info = DeviceInfo(name=f"C ({os.path.basename(self.cc)}, "
                                     f"{os.cpu_count()} threads{', OpenMP' if self.openmp else ''})",
                                compute=2e10 * (os.cpu_count() or 1),
                                num_cores=os.cpu_count() or 1,
                                preferred_vector_size=_vector_bytes(self.flags))
        if self.openmp:
            _clamp_omp_env()
        if self.openmp and self.threads:
            os.environ.setdefault("OMP_NUM_THREADS", str(self.threads))
        # the team size is also written into every parallel region (CTarget.team_clause):
        # an OpenMP runtime that another library (torch) loaded first read
        # OMP_NUM_THREADS before this; the count at start-up, as it always was
        self._region_threads = self.threads
        if self.openmp and not any(v in os.environ for v in
                                   ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")):
            # How long idle OpenMP threads spin before sleeping (~1.5 ms here). A plan
            # program is one parallel region, and a training loop runs Python for a few
            # hundred microseconds between two of them: a thread that fell asleep in that
            # gap makes the next region wait for its wake-up, which under a hypervisor
            # stealing time costs milliseconds (MLP step 1.38 ms with this spin against
            # 1.61 ms with a 0.3 ms one, same window). "active" (spin forever) would burn a
            # core for good; a loaded machine is handled by scheduler.ThreadChoice moving
            # the plan to one thread. (KMP_BLOCKTIME: the same knob for LLVM's libomp, in
            # ms.) Users can override both.
            os.environ["GOMP_SPINCOUNT"] = "300000"
            os.environ["KMP_BLOCKTIME"] = "2"
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

    # -- capability probe, cached on disk per compiler and CPU ----------------------------
    def _probe(self):
        st = os.stat(self.cc)
        tag = hashlib.sha256(f"{self.cc}|{st.st_mtime}|{st.st_size}|{st.st_ino}|"
                             f"{self.base_flags}|{sys.platform}|{_cpu_identity()}|v5"
                             .encode()).hexdigest()[:16]
        marker = os.path.join(self.cache, f"cprobe-{tag}.txt")
        try:
            with open(marker) as f:
                omp, mvec, native, wide, fingerprint = f.read().split()
                return omp == "1", mvec == "1", native == "1", wide == "1", fingerprint
        except (OSError, ValueError):
            pass
        native = True
        builds = self._try_compile(_PROBE_SRC, [], [])
        if not builds and "-march=native" in self.base_flags:
            self.base_flags = [f for f in self.base_flags if f != "-march=native"]
            native = False
            builds = self._try_compile(_PROBE_SRC, [], [])
        if not builds:
            if self.user_flags is not None:   # a bad config value is no reason to give up
                warn(f"zyx: ignoring c.flags={self.user_flags!r}: {self.cc} cannot build a "
                     f"shared library with them; using the default flags")
                self.user_flags = None
                self.base_flags = list(DEFAULT_FLAGS)
                return self._probe()
            raise BackendError(f"C backend: {self.cc} cannot build a shared library with "
                               f"flags {self.base_flags}")
        # the remaining probes and the dry run are independent: run them at the same time
        runs = {"dry": (self._start_compiler([self.cc, *self.base_flags, "-###", "-E", "-x",
                                               "c", os.devnull, "-o", os.devnull]), None)}
        try:
            if native and _has_avx512():
                runs["wide"] = self._start_try(_PROBE_SRC, [WIDE_VECTORS], [])
            runs["omp"] = self._start_try(
                "int f(int n){int s=0;\n#pragma omp parallel for reduction(+:s)\n"
                "for(int i=0;i<n;i++)s+=i;return s;}", ["-fopenmp"], [])
            if sys.platform.startswith("linux"):
                runs["mvec"] = self._start_try(
                    simd_decls() + "#include <math.h>\nvoid f(float*a,int n){\n#pragma omp simd\n"
                    "for(int i=0;i<n;i++)a[i]=expf(a[i]);}", ["-fopenmp"], ["-lmvec", "-lm"])
            done = {name: self._wait_compiler(proc) for name, (proc, _) in runs.items()}
        finally:
            for proc, work in runs.values():
                if proc.poll() is None:
                    _kill_group(proc)
                if work:
                    shutil.rmtree(work, ignore_errors=True)
        wide = "wide" in done and done["wide"][0] == 0
        omp = done["omp"][0] == 0
        mvec = omp and "mvec" in done and done["mvec"][0] == 0
        fingerprint = _fingerprint(done["dry"][1])
        self._write_private(marker, f"{int(omp)} {int(mvec)} {int(native)} {int(wide)} "
                                    f"{fingerprint}".encode())
        return omp, mvec, native, wide, fingerprint

    def _start_try(self, src, extra, libs):
        """Start compiling `src` into a library in a temporary directory (probes)."""
        work = tempfile.mkdtemp(prefix="zyx-probe-")
        c = os.path.join(work, "p.c")
        with open(c, "w") as f:
            f.write(src)
        return self._start_compiler([self.cc, *self.base_flags, *extra, c, "-o",
                                     os.path.join(work, "p.so"), *libs]), work

    def _try_compile(self, src, extra, libs):
        proc, work = self._start_try(src, extra, libs)
        try:
            return self._wait_compiler(proc)[0] == 0
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _run_compiler(self, cmd):
        """(exit status, output) of one compiler run, killed after `compile_timeout` s."""
        return self._wait_compiler(self._start_compiler(cmd))

    def _start_compiler(self, cmd):
        # its own process group: a timeout or Ctrl-C kills cc1, as and ld with it
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace",
                                start_new_session=True)

    def _wait_compiler(self, proc):
        """(exit status, output) of a started compiler run, killed after `compile_timeout`
        seconds (measured from now: runs started together wait in turn)."""
        try:
            out, _ = proc.communicate(timeout=self.compile_timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise BackendError(f"C backend: {proc.args[0]} did not finish within "
                               f"{self.compile_timeout:g} s and was killed (raise "
                               f"c.compile_timeout_s in config.json if it needs longer)") from None
        except BaseException:       # Ctrl-C while compiling: leave no compiler behind
            _kill_group(proc)
            raise
        return proc.returncode, out

    def _write_private(self, path, data):
        """Write a small cache file atomically (temp + rename), readable by us only."""
        try:
            write_atomic(path, data)
            return True
        except OSError:
            return False

    def info(self):
        return self._info

    @property
    def identity(self):
        """What a tuned schedule depends on besides the kernel (autotune's cache key): the
        compiler, its flags and the CPU."""
        return f"c|{self.cc}|{self.fingerprint}|{' '.join(self.flags)}|{_cpu_identity()}"

    # -- codegen (zyx.codegen.cpu.render / plan) -----------------------------------------
    def target(self):
        """What the C written now depends on besides the kernel (`threads` may change
        after start-up: zyx.set_num_threads)."""
        return CTarget(openmp=self.openmp, mvec=self.mvec,
                       vector_bytes=self._info.preferred_vector_size,
                       team=self.threads or self._info.num_cores,
                       num_threads=self._region_threads if self.openmp else 0)

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
        whole = src if isinstance(src, str) else "\f".join(src)
        key = hashlib.sha256((whole + "|" + self.cc + "|" + " ".join(self.flags + self.libs) +
                              "|" + self.fingerprint).encode()).hexdigest()[:32]
        if self.debug & 8:
            print(f"zyx: C source {key}\n{whole}", file=sys.stderr)
        lib = self._loaded.get(key)
        if lib is not None:
            return lib
        lib = self._load_cached(key, symbols)
        if lib is None:
            lib = self._compile(src, key, symbols)
        if self.openmp and self._omp is None and self._can_unload:
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
        path = _file_defining(fn)
        try:
            self._omp = ctypes.CDLL(path) if path else None
        except OSError:
            self._omp = None
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
            if len(units) == 1:
                rc, out = self._run_compiler([self.cc, *self.flags, c_paths[0], "-o", so_path,
                                              *self.libs])
            else:
                rc, out = self._compile_units(c_paths, so_path)
            if rc != 0:
                if cached:
                    # maybe the cache's disk is full: tell by trying where it is not
                    # (a real compile error fails there too and is raised from there)
                    raise _CacheUnusable(f"the compiler could not write there: "
                                         f"{out.strip()[-300:]}",
                                         self._compile_in(False, src, key, symbols))
                raise BackendError(f"C compiler failed ({self.cc}):\n{out}\n--- source ---\n"
                                   f"{src if isinstance(src, str) else chr(10).join(src)}")
            lib = self._load_fresh(so_path, symbols, out)
            if cached:   # (a cache refusing it turns itself off, with a warning)
                self.disk.publish(key, so_path)
            return lib
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _compile_units(self, c_paths, so_path):
        """(exit status, output) of compiling several translation units at once (one
        compiler each, side by side) and linking them into `so_path`."""
        objects = [c[:-2] + ".o" for c in c_paths]
        procs = [self._start_compiler([self.cc, *self.flags, "-c", c, "-o", o])
                 for c, o in zip(c_paths, objects)]
        rc, outs = 0, []
        try:
            for proc in procs:
                code, out = self._wait_compiler(proc)
                outs.append(out)
                rc = rc or code
        except BaseException:
            for proc in procs:
                _kill_group(proc)
            raise
        if rc != 0:
            return rc, "".join(outs)
        code, out = self._run_compiler([self.cc, *self.flags, *objects, "-o", so_path,
                                        *self.libs])
        return code, "".join(outs) + out

    def _load_fresh(self, so_path, symbols, out):
        """Load what the compiler just wrote; junk from a compiler that exited 0 is an
        error here and never reaches the cache."""
        try:
            lib = _Library(so_path)
        except OSError as e:
            raise BackendError(f"C backend: {self.cc} exited 0 but wrote no loadable library "
                               f"({e}); compiler output:\n{out}") from None
        missing = [s for s in symbols if not hasattr(lib.dll, s)]
        if missing:
            raise BackendError(f"C backend: the library {self.cc} wrote lacks {missing}")
        return lib

    def launch(self, program, pool, args, wait_events=()):
        program.fn(program.argtype(*[b.ptr for b in args]))
        return None

    def release(self, program):
        """Nothing to do here: a program's library is unloaded when the last plan or
        caller holding a program of it drops it (Python's reference count on _Library),
        which is how programs shared by several plans stay loaded while one is in use."""


WIDE_VECTORS = "-mprefer-vector-width=512"


def _vector_bytes(flags):
    """Vector register width the compiled kernels use (a register-tiling hint)."""
    if WIDE_VECTORS in flags:
        return 64
    return 32 if platform.machine().lower() in ("x86_64", "amd64") else 16


def _has_avx512():
    """True on x86-64 CPUs with AVX-512F (read from /proc/cpuinfo; False elsewhere)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " avx512f " in line + " "
    except OSError:
        pass
    return False


def initialize(cfg, debug=0):
    pool = HostMemoryPool()
    dev = CDevice(cfg, pool, debug)
    return [pool], [dev]
