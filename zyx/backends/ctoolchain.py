"""The C backend's toolchain: finding the C compiler, probing what it can do (OpenMP,
glibc's vector math, -march=native, 512-bit vectors, a fingerprint of its version and of
the target flags -march=native expands to), the flags and thread counts from the config,
OpenMP's environment, and running compiler processes (each in its own process group,
killed on a timeout or Ctrl-C with everything it started).

The probe's result is kept in the cache directory per compiler, flags and CPU
(`cprobe-<tag>.txt`), so a second process starts without running the compiler.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile

from ..codegen.cpu.render import simd_decls
from ..errors import BackendError
from ..files import write_atomic
from . import warn

# -fno-trapping-math: zyx never unmasks floating-point traps, and without it gcc will not
# if-convert a select or a NaN test inside a loop ("control flow in loop"), so a fused
# epilogue (GELU's backward times a dropout mask after a matmul) stayed scalar: the LM
# recipe's CPU step went from 213 to 144 ms with it. IEEE results are unchanged (only
# whether an operation may trap is assumed).
DEFAULT_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fwrapv", "-fno-math-errno",
                 "-fno-trapping-math")
DEFAULT_COMPILE_TIMEOUT_S = 300.0
WIDE_VECTORS = "-mprefer-vector-width=512"
_PROBE_SRC = "int f(int x){return x+1;}"


def _find_compiler(cfg):
    """Path of the C compiler: c.compiler, ZYX_CC, CC, then cc/gcc/clang on PATH (a
    configured one that is not there is skipped with a warning)."""
    for source, cand in (("c.compiler", cfg.get("compiler")), ("ZYX_CC", os.environ.get("ZYX_CC"))):
        if cand and not (isinstance(cand, str) and shutil.which(cand)):
            warn(f"zyx: ignoring {source}={cand!r}: no such compiler on PATH")
    for cand in (cfg.get("compiler"), os.environ.get("ZYX_CC"), os.environ.get("CC"), "cc", "gcc",
                 "clang"):
        if cand and isinstance(cand, str) and shutil.which(cand):
            return shutil.which(cand)
    raise BackendError("C backend: no C compiler found (set ZYX_CC or install gcc/clang)")


def config_number(cfg, key, default):
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


def thread_count(cfg):
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


def cpu_identity():
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


def open_library_defining(fn):
    """The loaded object defining ctypes function `fn` (found with dladdr), opened once
    more: a handle never closed keeps it loaded whatever else is unloaded (the C backend
    pins the OpenMP runtime so). None where it cannot be found or opened."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except (OSError, AttributeError, TypeError):   # TypeError: Windows has no CDLL(None)
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not (dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)) and info.dli_fname):
        return None
    try:
        return ctypes.CDLL(os.fsdecode(info.dli_fname))
    except OSError:
        return None


def configure_openmp(threads):
    """OpenMP's environment, set before the runtime is loaded (it reads it once): an
    absurd OMP_NUM_THREADS lowered, `threads` (0: all cores) as its default, and the time
    idle threads spin before sleeping."""
    _clamp_omp_env()
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if not any(v in os.environ for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")):
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


class Toolchain:
    """The C compiler (`cc`), its flags and libraries, and what the probe found it can do:
    `openmp`, `mvec` (glibc's vector math links), `fingerprint` (of its version and the
    target -march=native resolves to: part of every cache key). `directory` keeps the
    probe's result."""

    def __init__(self, cfg, directory):
        self.cc = _find_compiler(cfg)
        self.directory = directory
        self.compile_timeout = float(config_number(cfg, "compile_timeout_s",
                                                   DEFAULT_COMPILE_TIMEOUT_S))
        self.user_flags = _config_flags(cfg)
        self.base_flags = list(self.user_flags or DEFAULT_FLAGS)
        try:
            self.openmp, self.mvec, native, wide, self.fingerprint = self._probe()
        except BackendError as e:
            # a compiler that is there but fails would otherwise drop the C backend
            # silently (zyx then computes on whatever else it finds, e.g. PoCL)
            warn(f"zyx: the C backend is off: {e}")
            raise
        if not native:   # e.g. Apple clang < 15 rejects -march=native
            self.base_flags = [f for f in self.base_flags if f != "-march=native"]
        if wide and self.user_flags is None:
            # x86 compilers default to 256-bit vectors even on AVX-512 CPUs; 512-bit ones
            # (and libmvec's 16-wide expf) measured 1.4-1.6x faster on exp-heavy kernels
            self.base_flags.append(WIDE_VECTORS)
        self.flags = list(self.base_flags) + (["-fopenmp"] if self.openmp else [])
        self.libs = (["-lmvec"] if self.mvec else []) + ["-lm"]

    def build_library(self, c_paths, so_path):
        """(exit status, output) of compiling the translation units `c_paths` into the
        shared library `so_path`: one compiler run, or for several units `compile_units`."""
        if len(c_paths) == 1:
            return self.run([self.cc, *self.flags, c_paths[0], "-o", so_path, *self.libs])
        return self.compile_units(c_paths, so_path)

    # -- capability probe, cached on disk per compiler and CPU ----------------------------
    def _probe(self):
        st = os.stat(self.cc)
        tag = hashlib.sha256(f"{self.cc}|{st.st_mtime}|{st.st_size}|{st.st_ino}|"
                             f"{self.base_flags}|{sys.platform}|{cpu_identity()}|v5"
                             .encode()).hexdigest()[:16]
        marker = os.path.join(self.directory, f"cprobe-{tag}.txt")
        try:
            with open(marker) as f:
                omp, mvec, native, wide, fingerprint = f.read().split()
                return omp == "1", mvec == "1", native == "1", wide == "1", fingerprint
        except (OSError, ValueError):
            pass
        native = True
        failure = self._try_compile(_PROBE_SRC, [], [])
        if failure and "-march=native" in self.base_flags:
            self.base_flags = [f for f in self.base_flags if f != "-march=native"]
            native = False
            failure = self._try_compile(_PROBE_SRC, [], [])
        if failure:
            if self.user_flags is not None:   # a bad config value is no reason to give up
                warn(f"zyx: ignoring c.flags={self.user_flags!r}: {self.cc} cannot build a "
                     f"shared library with them; using the default flags")
                self.user_flags = None
                self.base_flags = list(DEFAULT_FLAGS)
                return self._probe()
            raise BackendError(f"C backend: {self.cc} cannot build a shared library with "
                               f"flags {self.base_flags} ({failure})")
        # the remaining probes and the dry run are independent: run them at the same time
        runs = {"dry": (self.start([self.cc, *self.base_flags, "-###", "-E", "-x",
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
            done = {name: self.wait(proc) for name, (proc, _) in runs.items()}
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
        try:    # (a cache that refuses it only means probing again next time)
            write_atomic(marker, f"{int(omp)} {int(mvec)} {int(native)} {int(wide)} "
                                 f"{fingerprint}".encode())
        except OSError:
            pass
        return omp, mvec, native, wide, fingerprint

    def _start_try(self, src, extra, libs):
        """Start compiling `src` into a library in a temporary directory (probes)."""
        work = tempfile.mkdtemp(prefix="zyx-probe-")
        c = os.path.join(work, "p.c")
        with open(c, "w") as f:
            f.write(src)
        return self.start([self.cc, *self.base_flags, *extra, c, "-o",
                                     os.path.join(work, "p.so"), *libs]), work

    def _try_compile(self, src, extra, libs):
        """None when `src` builds into a library; else why not (exit status and the end of
        the compiler's output, or that it exited 0 but wrote nothing)."""
        proc, work = self._start_try(src, extra, libs)
        try:
            rc, out = self.wait(proc)
            out = " ".join(out.split())[-300:]
            if rc != 0:
                return f"exit status {rc}" + (f": {out}" if out else ", no output")
            try:
                if os.path.getsize(os.path.join(work, "p.so")) > 0:
                    return None
            except OSError:
                pass
            return "it exited 0 but wrote no library"
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def run(self, cmd):
        """(exit status, output) of one compiler run, killed after `compile_timeout` s."""
        return self.wait(self.start(cmd))

    def start(self, cmd):
        # its own process group: a timeout or Ctrl-C kills cc1, as and ld with it
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace",
                                start_new_session=True)

    def wait(self, proc):
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

    def compile_units(self, c_paths, so_path):
        """(exit status, output) of compiling several translation units at once (one
        compiler each, side by side) and linking them into `so_path`."""
        objects = [c[:-2] + ".o" for c in c_paths]
        procs = [self.start([self.cc, *self.flags, "-c", c, "-o", o])
                 for c, o in zip(c_paths, objects)]
        rc, outs = 0, []
        try:
            for proc in procs:
                code, out = self.wait(proc)
                outs.append(out)
                rc = rc or code
        except BaseException:
            for proc in procs:
                _kill_group(proc)
            raise
        if rc != 0:
            return rc, "".join(outs)
        code, out = self.run([self.cc, *self.flags, *objects, "-o", so_path, *self.libs])
        return code, "".join(outs) + out


def vector_bytes(flags):
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
