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

from .. import dtype as dt
from .._core import kernel as K
from ..errors import BackendError
from ..codegen.cpu import padtaps
from ..codegen.target import DeviceInfo
from ..files import write_atomic
from . import cache_dir, warn
from .binary_cache import BinaryCache
from ..codegen.cstyle import CDialect, alu_operands, render_body
from .host import HostMemoryPool
from ..codegen.cpu.hoist import hoist_invariants
from ..codegen.cpu.nanflag import NAN_MAX, NAN_MIN, flag_nan_reductions
from ..codegen.cpu.rowstash import stash_row_values

PARALLEL_MIN_WORK = 1 << 15   # below this many iterations threads cost more than they give
SIMD_COLLAPSE = True          # elementwise kernels: one simd loop over the last two index
SHORT_SIMD = 4                # loops when the last is at most this long
UNROLL_ROWS = 16              # lane tiles: rows loops this short or shorter are unrolled
UNROLL_INSIDE = 64            # ... when the reduce loop around them is this short or shorter
STASH_ROWS = True             # row kernels keep a costly value for their next loop (rowstash)
HOIST_INVARIANTS = True       # loop-invariant loads made before their loops (hoist.py)
FLAG_NAN = True               # long max/min reductions keep NaN in a flag (nanflag.py)
_SIMD_FUNCS = ("exp", "exp2", "log", "log2", "sin", "cos", "tanh", "erf", "pow")

_PRELUDE = r"""
#include <string.h>
#include <math.h>
#if defined(__clang__)
#define ZYX_ASSOC_FN
#define ZYX_REASSOC _Pragma("clang fp reassociate(on)")
#elif defined(__GNUC__)
#define ZYX_ASSOC_FN __attribute__((optimize("associative-math", "no-signed-zeros", "no-trapping-math")))
#define ZYX_REASSOC
#else
#define ZYX_ASSOC_FN
#define ZYX_REASSOC
#endif
#if defined(__FLT16_MAX__) && !defined(ZYX_NO_FLOAT16)
static inline float zyx_h2f(unsigned short h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }
static inline unsigned short zyx_f2h(float x) { _Float16 f = (_Float16)x; unsigned short h; memcpy(&h, &f, 2); return h; }
#else
static inline float zyx_h2f(unsigned short h) {
  unsigned int s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu, u;
  if (e == 0) { if (m == 0) u = s; else { e = 113; while (!(m & 0x400u)) { m <<= 1; e--; } m &= 0x3ffu; u = s | (e << 23) | (m << 13); } }
  else if (e == 31) u = s | 0x7f800000u | (m << 13);
  else u = s | ((e + 112) << 23) | (m << 13);
  float f; memcpy(&f, &u, 4); return f; }
static inline unsigned short zyx_f2h(float x) {
  unsigned int u; memcpy(&u, &x, 4);
  unsigned int s = (u >> 16) & 0x8000u; int e = (int)((u >> 23) & 0xff) - 112; unsigned int m = u & 0x7fffffu;
  if (((u >> 23) & 0xff) == 0xff) return (unsigned short)(s | 0x7c00u | (m ? 0x200u : 0));
  if (e >= 31) return (unsigned short)(s | 0x7c00u);
  if (e <= 0) { if (e < -10) return (unsigned short)s; m |= 0x800000u; unsigned int sh = (unsigned int)(14 - e);
    unsigned int r = m >> sh, rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);
    if (rem > half || (rem == half && (r & 1))) r++; return (unsigned short)(s | r); }
  unsigned int r = ((unsigned int)e << 10) | (m >> 13), rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) r++;
  return (unsigned short)(s | r); }
#endif
static inline float zyx_bf2f(unsigned short h) { unsigned int u = ((unsigned int)h) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline unsigned short zyx_f2bf(float x) {
  unsigned int u; memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 64u);
  u += 0x7fffu + ((u >> 16) & 1u); return (unsigned short)(u >> 16); }
/* expf without glibc libmvec's slow path: a vector with a lane below about -87 (a
   masked softmax's -inf) goes through scalar calls, 5-7x slower. Arguments below -80
   are shifted into range and scaled back (exp(x) = exp(x + 64) e^-64), below -150 the
   result is 0 anyway; NaN stays NaN. The shift and scale are chosen with integer bit
   masks: written as float selects, gcc computed both exps or did not vectorize. */
static inline float zyx_expf(float x) {
  const unsigned int low = (unsigned int)-(int)(x < -80.0f);
  const unsigned int sb = low & 0x42800000u;                       /* 64.0f or 0 */
  const unsigned int cb = (low & 0x114b4ea4u) | (~low & 0x3f800000u);   /* e^-64 or 1 */
  float shift, scale;
  memcpy(&shift, &sb, 4); memcpy(&scale, &cb, 4);
  return expf((x < -150.0f ? -150.0f : x) + shift) * scale; }
/* float exp inlined where the kernel runs (INLINE_EXP): x = n ln2 + r with |r| <= ln2/2,
   e^r by a degree-7 polynomial (Cephes' expf coefficients), 2^n applied as two
   power-of-two factors so that results down to the denormals round once and results past
   FLT_MAX become inf. Under 1 ulp from the exact exp for every float (checked over a
   stride through all of them), exp(-inf) = 0, exp(inf) = inf, NaN stays NaN; every
   operation vectorizes, so no lane ever takes a scalar path. */
static inline float zyx_exp_inline(float x) {
  const float c = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  const float n = __builtin_rintf(c * 1.44269504088896341f);
  float r = c - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int e = (int)n, e1 = e >> 1, e2 = e - e1;
  const int b1 = (e1 + 127) << 23, b2 = (e2 + 127) << 23;
  float s1, s2;
  memcpy(&s1, &b1, 4); memcpy(&s2, &b2, 4);
  const float out = p * s1 * s2;
  return x != x ? x : out; }
static inline long long zyx_ipow(long long b, long long e) {
  if (e < 0) return b == 1 ? 1 : (b == -1 ? ((e & 1) ? -1 : 1) : 0);
  unsigned long long r = 1, ub = (unsigned long long)b;
  while (e) { if (e & 1) r *= ub; ub *= ub; e >>= 1; } return (long long)r; }
"""


EXP_LOW = -80.0     # a constant at or below this reaching an exp: zyx_expf (_PRELUDE)
INLINE_EXP = True   # float exps through zyx_exp_inline (_PRELUDE) instead of expf


class _CBackendDialect(CDialect):
    """C99 for this backend's prelude. A float exp calls `zyx_exp_inline` (INLINE_EXP): a
    polynomial gcc vectorizes in the kernel's loop, under 1 ulp like libmvec's expf, which
    is a call per vector (benches/flag_ab.py, softmax 4096x1024: 1.40 -> 1.27 ms; a causal
    softmax 32x4x64x64 0.60 -> 0.31 ms). Without it,
    an exp whose argument is computed from a constant at or below EXP_LOW (a masked
    softmax's -inf) calls `zyx_expf`, which keeps such lanes off libmvec's scalar slow
    path (3-4x faster exp, 1.5 -> 1.0 ms for a causal softmax of 32x4x64x64); other exps
    stay `expf` (zyx_expf costs 30% on them)."""

    def unary_fn(self, ops, op, name, d):
        if name == "exp" and d is not dt.float64:
            if INLINE_EXP:
                return "zyx_exp_inline"
            if _reaches_low_constant(ops, op[3]):
                return "zyx_expf"
        return self.math_fn(name, d)


def _reaches_low_constant(ops, root):
    """True when the value `root` of `ops` is computed (through ALU ops) from a float
    constant at or below EXP_LOW."""
    seen, stack = set(), [root]
    while stack:
        j = stack.pop()
        if j in seen or j < 0:
            continue
        seen.add(j)
        o = ops[j]
        if o[0] == K.CONST:
            if o[1].is_float and o[2] <= EXP_LOW:
                return True
        else:
            stack.extend(alu_operands(o))
    return False


def _simd_decls():
    # Declared before <math.h> so gcc may call glibc's libmvec vector variants without
    # -ffast-math (which would break isnan/isinf semantics).
    out = []
    for f in _SIMD_FUNCS:
        args = "float, float" if f == "pow" else "float"
        dargs = "double, double" if f == "pow" else "double"
        out.append(f"#pragma omp declare simd notinbranch\nfloat {f}f({args});")
        out.append(f"#pragma omp declare simd notinbranch\ndouble {f}({dargs});")
    return "\n".join(out) + "\n"


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


DIRECT_CALLS = 256   # plans with more kernel calls run them from a table (compile_plan)


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
        self.dialect = _CBackendDialect()
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
        # the team size is also written into every parallel region: an OpenMP runtime
        # that another library (torch) loaded first read OMP_NUM_THREADS before this
        self._team = f" num_threads({self.threads})" if self.openmp and self.threads else ""
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
                    _simd_decls() + "#include <math.h>\nvoid f(float*a,int n){\n#pragma omp simd\n"
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

    # -- codegen -------------------------------------------------------------------------
    def render(self, kernel, name):
        """C source of `kernel` as a function `void name(void** args)` callable on its own."""
        return self._render(kernel, name, False)[0]

    def _render(self, kernel, name, orphan, par_if=False):
        """(source, kind). With `orphan`, parallel index loops use `omp for` so the function
        must be called by every thread of an enclosing parallel region (kind "for");
        kind "serial" kernels run on one thread and kind "region" ones (a parallel
        reduction into a scalar, whose accumulator must be shared) open their own region."""
        dl = self.dialect
        kinds = set()
        if STASH_ROWS:
            kernel = stash_row_values(kernel)
        if HOIST_INVARIANTS:   # (after the stash, which compares the loops as written)
            kernel = hoist_invariants(kernel)
        if FLAG_NAN:
            kernel = flag_nan_reductions(kernel)
        bounds = {}
        if padtaps.ENABLED:
            kernel, bounds = padtaps.narrow_padding_taps(kernel)
        ops = kernel.ops
        has_loops = any(op[0] == K.LOOP for op in ops)
        idx_work = 1
        for op in ops:
            if op[0] == K.INDEX:
                idx_work *= op[3]
        omp = self.openmp

        vector_bytes = self._info.preferred_vector_size

        def loop_pragma(i, ops):
            depth = 0
            j = i + 1
            inner = False
            lanes = False
            accs = {}
            arrays = {}   # per-lane accumulators: OpenMP array-section reductions
            stores = False   # stores to memory (a row kernel's loop writing the row)
            tile = False     # reads per-lane accumulators (a lane tile's epilogue)
            nested = 0       # loops inside this one
            lane_len, lane_item = 0, 0   # the loop inside: its length, its lanes' bytes
            tile_len = 0     # longest per-lane accumulator array (rows x lanes of a tile)
            while True:
                o = ops[j]
                if o[0] == K.STORE and ops[o[2]][2] == K.SCOPE_GLOBAL:
                    stores = True
                elif (o[0] == K.LOAD and ops[o[2]][2] == K.SCOPE_REGISTER and o[3] != -1
                      and ops[o[2]][6] >= 0):
                    tile = True
                if o[0] == K.LOOP:
                    inner = True
                    nested += 1
                    depth += 1
                    lane_len = o[2]
                elif o[0] == K.ENDLOOP:
                    if depth == 0:
                        break
                    depth -= 1
                elif (o[0] == K.STORE and ops[o[2]][2] == K.SCOPE_REGISTER and o[2] < i
                      and ops[o[2]][6] >= 0):
                    # (a scratch row buffer, reduce op -1, is no accumulator: rowstash.py)
                    # (an accumulator defined inside the loop, a reduce block's, is private
                    # to each iteration already)
                    d = ops[o[2]]
                    op_name = _OMP_RED[d[6]]
                    if d[1].is_float and d[6] in (K.R_MAX, K.R_MIN):
                        op_name = "zyx_nan" + op_name   # NaN-propagating combiner
                    # (NAN_MAX / NAN_MIN: NaN kept by a flag beside it, nanflag.py)
                    if d[5] == 1:   # scalar accumulator: an OpenMP reduction
                        accs.setdefault(op_name, []).append(f"acc{o[2]}")
                    else:           # one accumulator per lane: plain SIMD loop
                        lanes = True
                        lane_item = max(lane_item, d[1].itemsize)
                        tile_len = max(tile_len, d[5])
                        arrays.setdefault(op_name, {})[f"acc{o[2]}[:{d[5]}]"] = None
                j += 1
            red = " ".join(f"reduction({r}:{','.join(a)})" for r, a in accs.items())
            top = _is_top(ops, i)
            parallel = (omp and idx_work == 1 and top
                        and _loop_work(ops, i) >= PARALLEL_MIN_WORK
                        and not any(r.startswith("zyx_nan") for r in arrays))
            if (UNROLL_ROWS and not parallel and nested == 1 and lanes
                    and ops[i][2] <= UNROLL_ROWS and lane_len * lane_item <= vector_bytes
                    and tile_len >= ops[i][2] * lane_len
                    and _enclosing_loop_length(ops, i) <= UNROLL_INSIDE):
                # The rows of a lane tile around its one-vector loop, inside a short
                # reduce loop: gcc leaves such a rows loop rolled, and every multiply-add
                # then loads and stores its accumulator (a transformer's weight gradient
                # over (T, B) in nested loops of 32: 1.2 -> 0.7 ms unrolled, the tile in
                # vector registers). Inside a long loop gcc unrolls it itself, with one
                # address register where the pragma gives one per row (a 4096-long weight
                # gradient: 2.4 vs 2.7 ms); rows of two vectors it keeps in registers
                # itself (forced, a conv's channel tile ran 25% slower). tile_len: the
                # loop is a tile's rows, each with accumulators of its own, not a reduce
                # loop around one set of per-lane partial sums (unrolled, those only
                # compiled slower).
                return f"#pragma GCC unroll {ops[i][2]}"
            if not omp:
                return ""
            if parallel:
                # threads split the loop, each with private copies of the accumulators
                # defined before it (per-lane arrays too), combined at its end
                red = " ".join([red] + [f"reduction({r}:{','.join(a)})"
                                        for r, a in arrays.items()]).strip()
                kinds.add("region")
                cond = " if(parallel: zyx_par)" if par_if else ""
                return (f"#pragma omp parallel for{'' if inner else ' simd'}{cond}"
                        f"{self._team} {red}").rstrip()
            if not inner and list(accs) == ["+"] and _sums_products_only(ops) and all(
                    ops[o[2]][1].is_float for o in ops[i + 1:j] if o[0] == K.STORE
                    and ops[o[2]][2] == K.SCOPE_REGISTER):
                # Float sums into scalar accumulators (a matmul's 4x4 tile): gcc turns
                # `omp simd reduction` into a serial lane-by-lane epilogue per accumulator
                # that costs as much as the loop; allowing reassociation in this kernel
                # vectorizes the same loop with a tree epilogue (matmul 148 -> 124 us).
                kinds.add("assoc")
                return ("", "ZYX_REASSOC")
            if not inner and accs:
                return f"#pragma omp simd {red}"
            if not inner and lanes:
                return "#pragma omp simd"
            if not inner and stores and not accs and not lanes and not tile:
                # a row kernel's store loop: element j of the row from the row's registers
                # and loads, stored at a distinct address per iteration (a vector of exp)
                return "#pragma omp simd"
            return ""

        frame = padtaps.BoundsFrame(bounds, loop_pragma, ops) if bounds else None
        r, names = render_body(kernel, dl, loop_pragma, frame)
        params = []
        for argno, d, ro in sorted(r.params):
            const = "const " if ro else ""
            params.append(f"  {const}{dl.storage_type(d)}* restrict g{argno} = "
                          f"({const}{dl.storage_type(d)}*)args[{argno}];")
        head = []
        idx = r.indices
        loop_work = 1
        for op in ops:
            if op[0] == K.LOOP:
                loop_work *= op[2]
        work = idx_work * loop_work
        par = omp and work >= PARALLEL_MIN_WORK and idx
        if par:
            kinds.add("for")
        pfor = "#pragma omp for" if orphan else f"#pragma omp parallel for{self._team}"
        team = self.threads or os.cpu_count() or 1
        column_chunks = (orphan and par and has_loops and "assoc" in kinds and len(idx) == 2
                         and idx[1][2] > idx[0][2] and idx[1][2] >= 4 * team)
        if column_chunks:
            # A register-tiled product whose column operand is the bigger one (x @ W.T with
            # more weight rows than batch rows): each thread takes a contiguous block of
            # columns, so it reads its part of W and all of x instead of all of W and part
            # of x, and the part of W it reads is the part the same thread wrote in the
            # previous step's elementwise update (same static split of W's rows), still in
            # its own core's cache (MLP x @ W1.T inside the step: 78 -> 65 us).
            (s0, _, n0), (s1, _, n1) = idx
            head += ["  const long long zyx_nt = omp_get_num_threads();", "  " + pfor,
                     "  for (long long c = 0; c < zyx_nt; c++)",
                     f"  for (long long i{s0} = 0; i{s0} < {n0}LL; i{s0}++) {{",
                     f"  for (long long i{s1} = {n1}LL * c / zyx_nt; "
                     f"i{s1} < {n1}LL * (c + 1) / zyx_nt; i{s1}++) {{"]
        else:
            # an elementwise kernel whose innermost index loop is a few elements long (an
            # axis split at a pooling window: 2) vectorizes the last two loops as one
            short_last = (SIMD_COLLAPSE and not has_loops and len(idx) >= 3
                          and idx[-1][2] <= SHORT_SIMD)
            for n, (ssa, axis, length) in enumerate(idx):
                pragma = ""
                # a kernel whose reduce loop runs in parallel ("region") has only size-1
                # index loops: a parallel pragma there would nest the reduce's region
                if omp and "region" not in kinds:
                    last = n == len(idx) - 1
                    if has_loops:
                        if n == 0 and par:
                            pragma = f"{pfor} collapse({len(idx)})" if len(idx) > 1 else pfor
                    elif len(idx) == 1:
                        pragma = f"{pfor} simd" if par else "#pragma omp simd"
                    elif n == 0 and par:
                        outer = len(idx) - (2 if short_last else 1)
                        pragma = f"{pfor} collapse({outer})" if outer > 1 else pfor
                    elif short_last and n == len(idx) - 2:
                        pragma = "#pragma omp simd collapse(2)"
                    elif last and not short_last:
                        pragma = "#pragma omp simd"
                if pragma:
                    head.append("  " + pragma)
                head.append(f"  for (long long i{ssa} = 0; i{ssa} < {length}LL; i{ssa}++) {{")
        body = ["  " + ln for ln in r.lines] if idx else r.lines
        kind = "region" if "region" in kinds else ("for" if "for" in kinds else "serial")
        if orphan and kind == "region":
            return self._render(kernel, name, False, par_if)
        attr = "ZYX_ASSOC_FN " if "assoc" in kinds else ""
        return (f"\n{attr}void {name}(void** restrict args) {{\n" + "\n".join(params) + "\n" +
                "\n".join(head) + "\n" + "\n".join(body) + "\n" + "}" * len(idx) + "\n}\n"), kind

    def prelude(self):
        return (("" if not self.mvec else _simd_decls()) + _PRELUDE + padtaps.HELPERS +
                ("int omp_get_num_threads(void);\n" + _NAN_REDUCTIONS if self.openmp else ""))

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
            funcs = [self.render(k, n) for k, n in zip(todo, names)]
            src = self.prelude() + "".join(funcs)
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
        bodies, funcs = {}, []
        for k, _ in items:
            if k not in bodies:
                name = f"zyx_b{len(bodies)}"
                src, kind = self._render(k, name, True, True)
                bodies[k] = (name, kind)
                funcs.append(src)
        # Past DIRECT_CALLS calls, the calls are data, not code: one row of `zyx_calls` per
        # kernel call (function, first argument), argument locations in `zyx_locs`, and the
        # program below runs ranges of rows. A statement per call with its own argument
        # array made gcc's alias analysis quadratic in the number of calls (4000 calls: 3 s
        # of 3.1); below that, direct calls with constant arguments are a little cheaper
        # to run (a training step's plan has tens of calls).
        calls, fn_rows, loc_rows, nargs = [], [], [], 1
        for k, locs in items:
            name, kind = bodies[k]
            fn_rows.append(f"{{{name}, {len(loc_rows)}}}")
            loc_rows.extend(str(v) if where == "t" else str(-1 - v) for where, v in locs)
            nargs = max(nargs, len(locs))
            calls.append(kind)
        fn_rows.append(f"{{0, {len(loc_rows)}}}")

        direct = len(items) <= DIRECT_CALLS

        def run(i, j):
            if not direct:
                return f"zyx_run(s, arena, {i}, {j});"
            stmts = []
            for k, locs in items[i:j]:
                args = ", ".join(f"s[{v}]" if where == "t" else f"(void*)(arena + {v}LL)"
                                 for where, v in locs)
                stmts.append(f"{{ void* a[] = {{{args}}}; {bodies[k][0]}(a); }}")
            return stmts[0] if len(stmts) == 1 else "{ " + " ".join(stmts) + " }"
        lines = []
        i = 0
        if calls and not self.openmp:
            lines.append("  " + run(0, len(calls)))
            i = len(calls)
        while i < len(calls):
            if calls[i] == "region":
                lines.append("  " + run(i, i + 1))
                i += 1
                continue
            j = i
            while j < len(calls) and calls[j] != "region":
                j += 1
            if "for" in calls[i:j]:
                lines.append(f"  #pragma omp parallel if(par){self._team}\n  {{")
                n = i
                while n < j:
                    m = n
                    kind = calls[n]
                    while m < j and calls[m] == kind:
                        m += 1
                    if kind == "for":       # every thread calls them, in order
                        lines.append("    " + run(n, m))
                    else:   # a run of small kernels: one thread does them all, one barrier after
                        lines.append("    #pragma omp single\n    " + run(n, m))
                    n = m
                lines.append("  }")
            else:   # nothing parallel: do not wake the thread team
                lines.append("  " + run(i, j))
            i = j
        # `par` = 0 runs every kernel on the calling thread: for small plans, waking the
        # thread team and the barriers between kernels can cost more than they save (the
        # scheduler measures both and keeps the faster, see scheduler.ThreadChoice)
        table = "" if direct else (
            "\nstatic const struct { void (*fn)(void**); int first; } zyx_calls[] = {\n  " +
            ",\n  ".join(fn_rows) + "};\n"
            "static const long long zyx_locs[] = {" + (", ".join(loc_rows) or "0") + "};\n"
            # a location >= 0 is pointer table entry s[v], below 0 arena offset -1 - v
            "static void zyx_run(void** restrict s, char* arena, int from, int to) {\n"
            f"  void* a[{nargs}];\n"
            "  for (int c = from; c < to; c++) {\n"
            "    for (int k = zyx_calls[c].first; k < zyx_calls[c + 1].first; k++) {\n"
            "      const long long v = zyx_locs[k];\n"
            "      a[k - zyx_calls[c].first] = v >= 0 ? s[v] : (void*)(arena + (-1 - v));\n"
            "    }\n"
            "    zyx_calls[c].fn(a);\n"
            "  }\n}\n")
        plan = (table + "\nvoid zyx_plan(void** restrict s, int par) {\n"
                "  char* arena = (char*)s[0];\n  (void)arena;\n  zyx_par = par;\n" +
                "\n".join(lines) + "\n}\n")
        parts = _plan_parts(funcs, self.threads or os.cpu_count() or 1)
        if len(parts) == 1:
            src = (self.prelude() + "static int zyx_par = 1;\n" +
                   "".join(f.replace("void ", _PLAN_FN, 1) for f in funcs) + plan)
        else:
            # a big plan in several translation units, compiled side by side (gcc runs on
            # one core): the first holds the plan function, the kernels are shared
            # between them (hidden: nothing outside the library sees them)
            decls = "".join(f"void zyx_b{i}(void** restrict args);\n"
                            for i in range(len(funcs)))
            src = [self.prelude() + ("int zyx_par = 1;\n" if n == 0 else
                                     "extern int zyx_par;\n") + decls +
                   "".join(f.replace("void ", _PART_FN, 1) for f in part) +
                   (plan if n == 0 else "")
                   for n, part in enumerate(parts)]
        lib = self._build(src, ["zyx_plan"])
        parallel = self.openmp and any(kind != "serial" for kind in calls)
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


_OMP_RED = {K.R_SUM: "+", K.R_MAX: "max", K.R_MIN: "min", K.R_PROD: "*",
            NAN_MAX: "max", NAN_MIN: "min"}
# OpenMP's built-in max/min combiners drop NaN lanes; these keep NaN like numpy/torch do
# (gcc still vectorizes loops using them).
_NAN_REDUCTIONS = "".join(
    f"#pragma omp declare reduction(zyx_nan{op} : {t} : omp_out = (omp_in {cmp} omp_out || "
    f"omp_in != omp_in) ? omp_in : omp_out) initializer(omp_priv = {init})\n"
    for t in ("float", "double")
    for op, cmp, init in (("max", ">", "-INFINITY"), ("min", "<", "INFINITY")))


# A plan's kernel functions: static in a one-unit plan, hidden (library-internal) when
# the plan is compiled as several units; never inlined into the plan function.
_PLAN_FN = "static __attribute__((noinline)) void "
_PART_FN = '__attribute__((noinline, visibility("hidden"))) void '
PART_MIN_CHARS = 150_000   # a plan source below this compiles as one unit
PART_MAX = 4               # most units (and compilers run at once) per plan


def _plan_parts(funcs, cores):
    """The plan's kernel functions in groups of about equal source size, one group per
    translation unit: one group for a small plan or one core; else as many as the cores
    (at most PART_MAX), each at least PART_MIN_CHARS / 2 of source."""
    total = sum(len(f) for f in funcs)
    n = min(cores, PART_MAX, len(funcs), max(total * 2 // PART_MIN_CHARS, 1))
    if total < PART_MIN_CHARS or n < 2:
        return [funcs]
    parts, sizes = [[] for _ in range(n)], [0] * n
    for f in funcs:             # in order, each part a run of consecutive kernels
        k = min(sum(sizes) * n // total, n - 1)
        parts[k].append(f)
        sizes[k] += len(f)
    return [p for p in parts if p]


def _enclosing_loop_length(ops, i):
    """Trip count of the LOOP directly around op i (0 when none is)."""
    depth = 0
    for j in range(i - 1, -1, -1):
        c = ops[j][0]
        if c == K.ENDLOOP:
            depth += 1
        elif c == K.LOOP:
            if depth == 0:
                return ops[j][2]
            depth -= 1
    return 0


def _sums_products_only(ops):
    """True when the kernel's float arithmetic is only + - * (a plain matmul, maybe with a
    bias): reassociating it reorders sums and nothing else. Kernels with exp, division or
    selects keep strict evaluation (an LSTM's fused gates gave NaN gradients with gcc's
    associative-math)."""
    for op in ops:
        c = op[0]
        if c in (K.CONST, K.DEFINE, K.INDEX, K.LOOP, K.ENDLOOP, K.LOAD, K.STORE, K.IF_OP,
                 K.END_IF, K.BARRIER) or not op[1].is_float:
            continue
        if c == K.MAD or (c == K.BINARY and op[2] in (K.B_ADD, K.B_SUB, K.B_MUL)):
            continue
        if c == K.CAST and ops[op[2]][1].is_float:
            continue   # float to float (a reduce block's sum into its float64 total and
                       # back): reassociation moves no operation across a conversion
        return False
    return True


def _is_top(ops, i):
    depth = 0
    for o in ops[:i]:
        if o[0] == K.LOOP:
            depth += 1
        elif o[0] == K.ENDLOOP:
            depth -= 1
    return depth == 0


def _loop_work(ops, i):
    """Innermost iterations run by the loop opened at op `i`: its length times the work
    of its body, where loops one after the other add (a reduce block's loop and the loop
    folding the block into the totals) and nested ones multiply."""
    stack = [[ops[i][2], 0]]   # per open loop: its length, work of the loops in its body
    for o in ops[i + 1:]:
        if o[0] == K.LOOP:
            stack.append([o[2], 0])
        elif o[0] == K.ENDLOOP:
            n, body = stack.pop()
            if not stack:
                return n * max(body, 1)
            stack[-1][1] += n * max(body, 1)
    return stack[0][0]


def initialize(cfg, debug=0):
    pool = HostMemoryPool()
    dev = CDevice(cfg, pool, debug)
    return [pool], [dev]
