"""C backend: one C99 function per kernel, outer loops parallel with OpenMP, inner loops
written for the compiler's vectorizer; compiled by the system C compiler into a shared
library and called through ctypes with cached function pointers.

Compiled libraries live in the disk cache keyed by source + compiler + flags, so a second
process compiles nothing. Config (`"c"` section of config.json, or env):
    compiler  (ZYX_CC, then CC, then cc/gcc/clang)   flags  (list, replaces the defaults)
    threads   (OpenMP threads, default: all cores)   enabled (default true)
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from .. import dtype as dt
from .._core import kernel as K
from ..errors import BackendError
from . import DeviceInfo, cache_dir
from .cfamily import CDialect, render_body
from .host import HostMemoryPool

PARALLEL_MIN_WORK = 1 << 15   # below this many iterations threads cost more than they give
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
static inline long long zyx_ipow(long long b, long long e) {
  if (e < 0) return b == 1 ? 1 : (b == -1 ? ((e & 1) ? -1 : 1) : 0);
  unsigned long long r = 1, ub = (unsigned long long)b;
  while (e) { if (e & 1) r *= ub; ub *= ub; e >>= 1; } return (long long)r; }
"""


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


def _find_compiler(cfg):
    for cand in (cfg.get("compiler"), os.environ.get("ZYX_CC"), os.environ.get("CC"), "cc", "gcc",
                 "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    raise BackendError("C backend: no C compiler found (set ZYX_CC or install gcc/clang)")


class CProgram:
    __slots__ = ("fn", "lib", "argtype", "name", "source")

    def __init__(self, lib, name, nargs, source):
        self.lib = lib
        self.name = name
        self.fn = getattr(lib, name)
        self.fn.argtypes = [ctypes.c_void_p]
        self.fn.restype = None
        self.argtype = ctypes.c_void_p * max(nargs, 1)
        self.source = source


class CPlanProgram:
    """A compiled plan: `zyx_plan(void** table, int par)` runs every kernel of one
    realization; `parallel` says whether any of them would use the thread team."""
    __slots__ = ("fn", "lib", "argtype", "source", "parallel")

    def __init__(self, lib, nslots, source, parallel):
        self.lib = lib
        self.fn = lib.zyx_plan
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.fn.restype = None
        self.argtype = ctypes.c_void_p * max(nslots, 1)
        self.source = source
        self.parallel = parallel


class CDevice:
    def __init__(self, cfg, pool, debug=0):
        self.debug = debug
        self.pool = pool
        self.cc = _find_compiler(cfg)
        self.cache = cache_dir()
        self.threads = int(cfg.get("threads", os.environ.get("ZYX_THREADS", 0)) or 0)
        self.base_flags = list(cfg.get("flags", ["-O3", "-march=native", "-fPIC", "-shared",
                                                  "-fwrapv", "-fno-math-errno"]))
        self.openmp, self.mvec, native, wide = self._probe()
        if not native:   # e.g. Apple clang < 15 rejects -march=native
            self.base_flags = [f for f in self.base_flags if f != "-march=native"]
        if wide and "flags" not in cfg:
            # x86 compilers default to 256-bit vectors even on AVX-512 CPUs; 512-bit ones
            # (and libmvec's 16-wide expf) measured 1.4-1.6x faster on exp-heavy kernels
            self.base_flags.append(WIDE_VECTORS)
        self.flags = list(self.base_flags) + (["-fopenmp"] if self.openmp else [])
        self.libs = (["-lmvec"] if self.mvec else []) + ["-lm"]
        self.dialect = CDialect()
        self._programs = {}
        self.compiled = 0      # compiler runs (disk-cache misses) in this process
        self._info = DeviceInfo(name=f"C ({os.path.basename(self.cc)}, "
                                     f"{os.cpu_count()} threads{', OpenMP' if self.openmp else ''})",
                                compute=2e10 * (os.cpu_count() or 1),
                                num_cores=os.cpu_count() or 1,
                                preferred_vector_size=_vector_bytes(self.flags))
        if self.openmp and self.threads:
            os.environ.setdefault("OMP_NUM_THREADS", str(self.threads))
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

    # -- capability probe, cached on disk per compiler -----------------------------------
    def _probe(self):
        st = os.stat(self.cc)
        tag = hashlib.sha256(f"{self.cc}|{st.st_mtime}|{self.base_flags}|{sys.platform}|v4"
                             .encode()).hexdigest()[:16]
        marker = os.path.join(self.cache, f"cprobe-{tag}.txt")
        try:
            with open(marker) as f:
                omp, mvec, native, wide = f.read().split()
                return omp == "1", mvec == "1", native == "1", wide == "1"
        except (OSError, ValueError):
            pass
        native = True
        if not self._try_compile("int f(int x){return x+1;}", [], []):
            if "-march=native" not in self.base_flags:
                raise BackendError(f"C backend: {self.cc} cannot build a shared library with "
                                   f"flags {self.base_flags}")
            self.base_flags = [f for f in self.base_flags if f != "-march=native"]
            native = False
            if not self._try_compile("int f(int x){return x+1;}", [], []):
                raise BackendError(f"C backend: {self.cc} cannot build a shared library")
        wide = native and _has_avx512() and self._try_compile(
            "int f(int x){return x+1;}", [WIDE_VECTORS], [])
        omp = self._try_compile("int f(int n){int s=0;\n#pragma omp parallel for reduction(+:s)\n"
                                "for(int i=0;i<n;i++)s+=i;return s;}", ["-fopenmp"], [])
        mvec = omp and sys.platform.startswith("linux") and self._try_compile(
            _simd_decls() + "#include <math.h>\nvoid f(float*a,int n){\n#pragma omp simd\n"
            "for(int i=0;i<n;i++)a[i]=expf(a[i]);}", ["-fopenmp"], ["-lmvec", "-lm"])
        try:
            with open(marker, "w") as f:
                f.write(f"{int(omp)} {int(bool(mvec))} {int(native)} {int(wide)}")
        except OSError:
            pass
        return omp, bool(mvec), native, wide

    def _try_compile(self, src, extra, libs):
        with tempfile.TemporaryDirectory() as d:
            c = os.path.join(d, "p.c")
            with open(c, "w") as f:
                f.write(src)
            r = subprocess.run([self.cc, *self.base_flags, *extra, c, "-o",
                                os.path.join(d, "p.so"), *libs], capture_output=True)
            return r.returncode == 0

    def info(self):
        return self._info

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
        ops = kernel.ops
        has_loops = any(op[0] == K.LOOP for op in ops)
        idx_work = 1
        for op in ops:
            if op[0] == K.INDEX:
                idx_work *= op[3]
        omp = self.openmp

        def loop_pragma(i, ops):
            depth = 0
            j = i + 1
            inner = False
            lanes = False
            accs = {}
            while True:
                o = ops[j]
                if o[0] == K.LOOP:
                    inner = True
                    depth += 1
                elif o[0] == K.ENDLOOP:
                    if depth == 0:
                        break
                    depth -= 1
                elif o[0] == K.STORE and ops[o[2]][2] == K.SCOPE_REGISTER:
                    if ops[o[2]][5] == 1:   # scalar accumulator: an OpenMP reduction
                        d = ops[o[2]]
                        op_name = _OMP_RED[d[6]]
                        if d[1].is_float and op_name in ("max", "min"):
                            op_name = "zyx_nan" + op_name   # NaN-propagating combiner
                        accs.setdefault(op_name, []).append(f"acc{o[2]}")
                    else:                   # one accumulator per lane: plain SIMD loop
                        lanes = True
                j += 1
            red = " ".join(f"reduction({r}:{','.join(a)})" for r, a in accs.items())
            top = _is_top(ops, i)
            parallel = (omp and idx_work == 1 and top
                        and _loop_work(ops, i) >= PARALLEL_MIN_WORK)
            if not omp:
                return ""
            if parallel:
                kinds.add("region")
                cond = " if(parallel: zyx_par)" if par_if else ""
                return f"#pragma omp parallel for{'' if inner else ' simd'}{cond} {red}".rstrip()
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
            return ""

        r, names = render_body(kernel, dl, loop_pragma)
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
        pfor = "#pragma omp for" if orphan else "#pragma omp parallel for"
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
            for n, (ssa, axis, length) in enumerate(idx):
                pragma = ""
                if omp:
                    last = n == len(idx) - 1
                    if has_loops:
                        if n == 0 and par:
                            pragma = f"{pfor} collapse({len(idx)})" if len(idx) > 1 else pfor
                    elif len(idx) == 1:
                        pragma = f"{pfor} simd" if par else "#pragma omp simd"
                    elif n == 0 and par:
                        pragma = f"{pfor} collapse({len(idx) - 1})" if len(idx) > 2 else pfor
                    elif last:
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
        return (("" if not self.mvec else _simd_decls()) + _PRELUDE +
                ("int omp_get_num_threads(void);\n" + _NAN_REDUCTIONS if self.openmp else ""))

    def compile(self, kernel):
        return self.compile_many([kernel])[0]

    def compile_many(self, kernels):
        """Compile kernels not seen before into ONE shared library (one compiler run per
        plan instead of per kernel); cached on disk by source + compiler + flags."""
        todo = []
        for k in kernels:
            if k not in self._programs and k not in todo:
                todo.append(k)
        if todo:
            names = [f"zyx_k{i}" for i in range(len(todo))]
            funcs = [self.render(k, n) for k, n in zip(todo, names)]
            src = self.prelude() + "".join(funcs)
            lib = self._build(src)
            for k, n, f in zip(todo, names, funcs):
                self._programs[k] = CProgram(lib, n, len(k.args), f)
        return [self._programs[k] for k in kernels]

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
                funcs.append(src.replace("void ", "static __attribute__((noinline)) void ", 1))
        # The calls are data, not code: one row of `zyx_calls` per kernel call (function,
        # first argument), argument locations in `zyx_locs`, and the program below runs
        # ranges of rows. A statement per call with its own argument array made gcc's
        # alias analysis quadratic in the number of calls (4000 calls: 3 s of 3.1).
        calls, fn_rows, loc_rows, nargs = [], [], [], 1
        for k, locs in items:
            name, kind = bodies[k]
            fn_rows.append(f"{{{name}, {len(loc_rows)}}}")
            loc_rows.extend(str(v) if where == "t" else str(-1 - v) for where, v in locs)
            nargs = max(nargs, len(locs))
            calls.append(kind)
        fn_rows.append(f"{{0, {len(loc_rows)}}}")

        def run(i, j):
            return f"zyx_run(s, arena, {i}, {j});"
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
                lines.append("  #pragma omp parallel if(par)\n  {")
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
        src = (self.prelude() + "static int zyx_par = 1;\n" + "".join(funcs) +
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
               "  }\n}\n"
               "\nvoid zyx_plan(void** restrict s, int par) {\n  char* arena = (char*)s[0];\n"
               "  (void)arena;\n  (void)zyx_run;\n  zyx_par = par;\n" + "\n".join(lines) +
               "\n}\n")
        lib = self._build(src)
        parallel = self.openmp and any(kind != "serial" for kind in calls)
        return CPlanProgram(lib, nslots, src, parallel)

    def run_plan(self, program, table, parallel=True):
        """Run a compiled plan; parallel=False keeps every kernel on this thread."""
        program.fn(program.argtype(*table), 1 if parallel else 0)

    def _build(self, src):
        """Load the shared library of `src`, compiling it unless the disk cache (keyed by
        source + compiler + flags) has it."""
        key = hashlib.sha256((src + "|" + self.cc + "|" + " ".join(self.flags + self.libs))
                             .encode()).hexdigest()[:32]
        if self.debug & 8:
            print(f"zyx: C source {key}\n{src}", file=sys.stderr)
        path = os.path.join(self.cache, f"c-{key}.so")
        if not os.path.exists(path):
            t0 = time.perf_counter()
            fd, cpath = tempfile.mkstemp(suffix=".c", dir=self.cache)
            with os.fdopen(fd, "w") as f:
                f.write(src)
            tmp_so = cpath[:-2] + ".so"
            r = subprocess.run([self.cc, *self.flags, cpath, "-o", tmp_so, *self.libs],
                               capture_output=True, text=True)
            os.unlink(cpath)
            if r.returncode != 0:
                raise BackendError(f"C compiler failed ({self.cc}):\n{r.stderr}\n--- source ---\n{src}")
            os.replace(tmp_so, path)   # atomic: concurrent processes never load half a file
            self.compiled += 1
            if self.debug & 32:
                print(f"zyx: compiled {key} in {(time.perf_counter() - t0) * 1e3:.1f} ms",
                      file=sys.stderr)
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            raise BackendError(f"C backend: cannot load {path}: {e}") from None

    def launch(self, program, pool, args, wait_events=()):
        program.fn(program.argtype(*[b.ptr for b in args]))
        return None

    def release(self, program):
        """Programs stay loaded: the shared library is owned by the program cache and
        ctypes cannot unload it safely while a function pointer may still be in use."""


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


_OMP_RED = {K.R_SUM: "+", K.R_MAX: "max", K.R_MIN: "min", K.R_PROD: "*"}
# OpenMP's built-in max/min combiners drop NaN lanes; these keep NaN like numpy/torch do
# (gcc still vectorizes loops using them).
_NAN_REDUCTIONS = "".join(
    f"#pragma omp declare reduction(zyx_nan{op} : {t} : omp_out = (omp_in {cmp} omp_out || "
    f"omp_in != omp_in) ? omp_in : omp_out) initializer(omp_priv = {init})\n"
    for t in ("float", "double")
    for op, cmp, init in (("max", ">", "-INFINITY"), ("min", "<", "INFINITY")))


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
    depth, work, w = 0, 1, ops[i][2]
    for o in ops[i + 1:]:
        if o[0] == K.LOOP:
            depth += 1
            w *= o[2]
        elif o[0] == K.ENDLOOP:
            if depth == 0:
                break
            depth -= 1
    return w


def initialize(cfg, debug=0):
    pool = HostMemoryPool()
    dev = CDevice(cfg, pool, debug)
    return [pool], [dev]
