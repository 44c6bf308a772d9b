"""Trust in the C backend's start-up and kernel cache (issue 10): the disk cache never loads
a library zyx did not write or one that was damaged, cache directories are private, a
compiler that hangs, writes junk or finds the disk full never wedges or poisons zyx,
libraries of dropped plans are unloaded and the disk cache is bounded, bad configuration
is ignored with a warning, and fork()ed children compute.

Every scenario runs in a subprocess with its own cache, config and environment."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
REAL_CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
pytestmark = [pytest.mark.skipif(REAL_CC is None or not sys.platform.startswith("linux"),
                                reason="needs a C compiler on Linux"),
              pytest.mark.usefixtures("on_cpu")]   # in-process tests of the C backend too

# exp/sum/max: a plan with a reduction; checked against numpy inside the subprocess
COMPUTE = """
import numpy as np, zyx
a = np.arange(12, dtype=np.float32).reshape(3, 4) / 4
r = (zyx.Tensor(a).exp() * 1.25 - 0.75).sum(1).numpy()
ref = (np.exp(a) * 1.25 - 0.75).sum(1)
assert np.allclose(r, ref, rtol=1e-5), (r, ref)
print("RESULT OK")
"""

# big enough for the thread team: a matmul of 384x384 takes milliseconds
MATMUL = """
import numpy as np, zyx
a = np.random.default_rng(1).standard_normal((384, 384)).astype(np.float32)
r = (zyx.Tensor(a) @ zyx.Tensor(a)).numpy()
assert np.allclose(r, a @ a, rtol=1e-4, atol=1e-3)
print("RESULT OK")
"""


# these tests are about the C backend: in their child processes GPU backends stay off
# unless a test's config says otherwise
C_ONLY = {name: {"enabled": False} for name in ("opencl", "cuda", "hip", "vulkan", "wgpu")}


def run_zyx(tmp_path, code, config=None, env=None, cache=None, timeout=120):
    """Run `code` (or a script file) in a fresh interpreter importing this checkout's zyx,
    with a private
    cache (`cache` or tmp_path/cache) and config; zyx-related variables of this process
    are not inherited."""
    cfg_home = tmp_path / "config"
    (cfg_home / "zyx").mkdir(parents=True, exist_ok=True)
    cfg = dict(C_ONLY)
    cfg.update(config or {})
    (cfg_home / "zyx" / "config.json").write_text(json.dumps(cfg))
    e = {k: v for k, v in os.environ.items()
         if k not in ("ZYX_THREADS", "OMP_NUM_THREADS", "ZYX_CC", "CC", "ZYX_DEBUG",
                      "ZYX_DEVICE")}
    e.update(XDG_CACHE_HOME=str(cache or tmp_path / "cache"), XDG_CONFIG_HOME=str(cfg_home),
             PYTHONPATH=str(ROOT) + os.pathsep + e.get("PYTHONPATH", ""))
    e.update(env or {})
    args = [str(code)] if isinstance(code, pathlib.Path) else ["-c", code]
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


def ok(r):
    assert r.returncode == 0 and "RESULT OK" in r.stdout, (r.returncode, r.stdout, r.stderr)
    return r


def libraries(cache):
    return sorted((cache / "zyx").glob("c-*.so"))


def fake_compiler(tmp_path, kernel_action, name="fakecc", extra=""):
    """A compiler script passing everything to the real one, except that compiling a plan
    (a source defining zyx_plan) runs `kernel_action` first ($out: the -o path)."""
    script = tmp_path / name
    script.write_text(f"""#!/bin/sh
out=""; src=""; prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out="$a"
  case "$a" in *.c) src="$a";; esac
  prev="$a"
done
{extra}
if [ -n "$src" ] && grep -q zyx_plan "$src"; then
{kernel_action}
fi
exec {REAL_CC} "$@"
""")
    script.chmod(0o755)
    return str(script)


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A cache holding the libraries of COMPUTE, written by zyx."""
    tmp = tmp_path_factory.mktemp("warm")
    ok(run_zyx(tmp, COMPUTE))
    assert libraries(tmp / "cache")
    return tmp / "cache"


# -- the disk cache never runs foreign code nor loads a damaged library ------------------

def _foreign_library(tmp_path, marker):
    src = tmp_path / "evil.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void evil(void) '
                   f'{{ FILE* f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
                   'void zyx_plan(void** s, int par) { (void)s; (void)par; }\n')
    so = tmp_path / "evil.so"
    subprocess.run([REAL_CC, "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    return so


@pytest.mark.parametrize("damage", ["foreign", "flipped", "truncated"])
def test_damaged_or_foreign_cached_library_is_rebuilt_not_loaded(tmp_path, warm_cache, damage):
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    marker = tmp_path / "constructor-ran"
    foreign = _foreign_library(tmp_path, marker) if damage == "foreign" else None
    for lib in libraries(cache):
        if damage == "foreign":
            shutil.copyfile(foreign, lib)
        elif damage == "flipped":
            data = bytearray(lib.read_bytes())
            for i in range(len(data) // 3, len(data), 97):   # code and data sections
                data[i] ^= 0x5A
            lib.write_bytes(bytes(data))
        else:
            with open(lib, "r+b") as f:                       # SIGBUS on main
                f.truncate(lib.stat().st_size // 2)
    r = ok(run_zyx(tmp_path, COMPUTE, env={"ZYX_DEBUG": "32"}))
    assert not marker.exists(), "a foreign library's constructor ran"
    assert "does not match its digest" in r.stderr, r.stderr
    assert "compiled" in r.stderr
    # rebuilt: the next process loads the new libraries without compiling
    r = ok(run_zyx(tmp_path, COMPUTE, env={"ZYX_DEBUG": "32"}))
    assert "compiled" not in r.stderr and "digest" not in r.stderr, r.stderr


def test_junk_from_a_compiler_exiting_0_is_an_error_and_never_cached(tmp_path):
    mark = tmp_path / "junk-written"
    cc = fake_compiler(tmp_path, f'  if [ ! -e {mark} ]; then touch {mark}; '
                                 f'echo "not a library" > "$out"; exit 0; fi')
    r = run_zyx(tmp_path, COMPUTE, env={"ZYX_CC": cc})
    assert r.returncode != 0 and "BackendError" in r.stderr and "no loadable library" in r.stderr, \
        r.stderr
    assert mark.exists()
    assert not list((tmp_path / "cache" / "zyx").glob("tmp*"))
    ok(run_zyx(tmp_path, COMPUTE, env={"ZYX_CC": cc}))   # the compiler works now: so does zyx


def test_hanging_compiler_times_out_with_a_clear_error_and_no_leftovers(tmp_path):
    cc = fake_compiler(tmp_path, "  sleep 100")
    r = run_zyx(tmp_path, COMPUTE, env={"ZYX_CC": cc},
                config={"c": {"compile_timeout_s": 2}}, timeout=60)
    assert r.returncode != 0 and "BackendError" in r.stderr, r.stderr
    assert "did not finish within 2 s" in r.stderr and "compile_timeout_s" in r.stderr
    assert not list((tmp_path / "cache" / "zyx").glob("tmp*"))


def test_interrupted_compile_leaves_no_temporaries_nor_compiler(tmp_path):
    started = tmp_path / "compiling"
    cc = fake_compiler(tmp_path, f"  echo $$ > {started}; sleep 100")
    cfg_home = tmp_path / "config"
    (cfg_home / "zyx").mkdir(parents=True)
    (cfg_home / "zyx" / "config.json").write_text(json.dumps(C_ONLY))
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_CONFIG_HOME=str(cfg_home),
               ZYX_CC=cc, PYTHONPATH=str(ROOT))
    env.pop("ZYX_DEVICE", None)
    p = subprocess.Popen([sys.executable, "-c", COMPUTE], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if started.exists() and started.read_text().strip():
                break
            time.sleep(0.05)
        assert started.exists(), "the compiler never started"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert "KeyboardInterrupt" in err, err
    assert not list((tmp_path / "cache" / "zyx").glob("tmp*"))
    compiler_pid = int(started.read_text())
    with pytest.raises(ProcessLookupError):      # killed with zyx's compile, not left running
        os.kill(compiler_pid, 0)


def test_temporaries_of_a_killed_process_are_removed_later(tmp_path):
    stale = tmp_path / "cache" / "zyx" / "tmp-k1lled_0"   # a name mkdtemp gives
    stale.mkdir(parents=True, mode=0o700)
    (stale / "k.c").write_text("void f(void) {}")
    hours_ago = time.time() - 7200
    os.utime(stale / "k.c", (hours_ago, hours_ago))
    os.utime(stale, (hours_ago, hours_ago))
    recent = stale.with_name("tmp-compiling-now")    # maybe another process at work
    recent.mkdir()
    ok(run_zyx(tmp_path, COMPUTE))
    assert not stale.exists() and recent.exists()


def test_full_disk_in_cache_still_computes_with_one_warning(tmp_path):
    cache = tmp_path / "cache"
    cc = fake_compiler(tmp_path, f'  case "$out" in {cache}/*) head -c 100 /dev/zero > "$out"; '
                                 f'echo "$out: No space left on device" >&2; exit 1;; esac')
    code = COMPUTE + "b = zyx.Tensor(np.ones(5, np.float32)); assert (b * 3).numpy().tolist() == [3] * 5\n"
    r = ok(run_zyx(tmp_path, code, env={"ZYX_CC": cc}))
    assert r.stderr.count("is not usable") == 1 and "No space left" in r.stderr, r.stderr
    assert not list((cache / "zyx").glob("tmp*")), "temporary files left in the cache"


def _make_unwritable(d):
    """chmod 0500; root ignores modes, so also make it immutable when possible. False when
    nothing makes it unwritable here."""
    d.chmod(0o500)
    try:
        (d / "probe").touch()
    except OSError:
        return True
    (d / "probe").unlink()
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(d)],
                                                 capture_output=True).returncode == 0:
        return True
    return False


def test_read_only_cache_still_computes_with_one_warning(tmp_path):
    d = tmp_path / "cache" / "zyx"
    d.mkdir(parents=True, mode=0o700)
    if not _make_unwritable(d):
        pytest.skip("cannot make a directory read-only here")
    try:
        code = COMPUTE + "b = zyx.Tensor(np.ones(5, np.float32)); assert (b * 3).numpy().tolist() == [3] * 5\n"
        r = ok(run_zyx(tmp_path, code))
        assert r.stderr.count("is not usable") == 1, r.stderr
        assert not list(d.iterdir())
    finally:
        subprocess.run(["chattr", "-i", str(d)], capture_output=True)
        d.chmod(0o700)


@pytest.mark.parametrize("problem", ["group-writable", "other owner"])
def test_cache_directory_others_can_write_is_refused(tmp_path, problem):
    d = tmp_path / "cache" / "zyx"
    d.mkdir(parents=True)
    if problem == "group-writable":
        d.chmod(0o770)
        expected = "group- or world-writable"
    else:
        if os.getuid() != 0:
            pytest.skip("chown needs root")
        os.chown(d, 65534, 65534)
        d.chmod(0o700)
        expected = "owned by uid 65534"
    r = ok(run_zyx(tmp_path, COMPUTE))
    assert expected in r.stderr and "private directory" in r.stderr, r.stderr
    assert not list(d.iterdir()), "zyx wrote into a directory others can write"


def test_cache_files_are_private_whatever_the_umask(tmp_path):
    ok(run_zyx(tmp_path, "import os; os.umask(0)\n" + COMPUTE))
    d = tmp_path / "cache" / "zyx"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    files = list(d.iterdir())
    assert any(f.suffix == ".so" for f in files) and any(f.suffix == ".sha256" for f in files)
    for f in files:
        mode = stat.S_IMODE(f.stat().st_mode)
        assert mode & 0o077 == 0, (f.name, oct(mode))


def test_cache_key_holds_the_cpu_features_native_resolves_to(tmp_path):
    """The same compiler on a CPU with other features (simulated: its -### dry run names
    one more target flag) must compile anew instead of loading the other CPU's code."""
    cc = fake_compiler(tmp_path, "  :", extra='case "$*" in *-###*) [ -n "$FAKE_CPU" ] && '
                                             'echo "-m$FAKE_CPU" >&2;; esac')
    cache = tmp_path / "cache"
    env = {"ZYX_CC": cc, "ZYX_DEBUG": "32"}
    assert "compiled" in ok(run_zyx(tmp_path, COMPUTE, env=env)).stderr
    for probe in (cache / "zyx").glob("cprobe-*"):   # a second machine probes afresh
        probe.unlink()
    r = ok(run_zyx(tmp_path, COMPUTE, env=dict(env, FAKE_CPU="avx9000")))
    assert "compiled" in r.stderr, "loaded a library built for another CPU"
    for probe in (cache / "zyx").glob("cprobe-*"):
        probe.unlink()
    assert "compiled" not in ok(run_zyx(tmp_path, COMPUTE, env=env)).stderr


# -- memory and disk stay bounded ---------------------------------------------------------

def test_dropped_plans_unload_their_libraries_and_disk_cache_is_bounded(tmp_path):
    code = """
import numpy as np, zyx, os
def mapped():
    with open("/proc/self/maps") as f:
        return len({l.split()[-1] for l in f if "/c-" in l and l.rstrip().endswith(".so")})
most = 0
for n in range(1, 101):          # 100 shapes: 100 plans, 100 libraries
    x = zyx.Tensor(np.arange(n, dtype=np.float32))
    assert (x * 2 + 1).numpy().tolist() == [2 * i + 1 for i in range(n)]
    most = max(most, mapped())
print("MOST", most)
print("RESULT OK")
"""
    r = ok(run_zyx(tmp_path, code, config={"max_plans": 10, "c": {"cache_mb": 0.1}}))
    most = int(r.stdout.split("MOST")[1].split()[0])
    assert most <= 10, most              # the libraries of the plans in the plan cache
    on_disk = sum(f.stat().st_size for f in libraries(tmp_path / "cache"))
    assert 0 < on_disk <= 0.1 * 2**20, on_disk


SHARED_PROGRAM = """
import gc, numpy as np, zyx
def mapped(path):
    with open("/proc/self/maps") as f:
        return any(l.rstrip().endswith(path) for l in f)
x = zyx.Tensor(np.arange(7, dtype=np.float32))
assert (x * 2 + 1).numpy().tolist() == [2 * i + 1 for i in range(7)]
(plan,) = zyx._RT.plans.values()
dev = zyx._RT.device()
items = [(st.kernel, [plan.slot[a] for a in st.args]) for st in plan.steps
         if st.kernel is not None and plan.nbytes.get(st.args[0])]
other = dev.compile_plan(items, plan.nslots)       # a second plan of the same program
assert other.lib is plan.runner.lib
path = "/c-" + [k for k, v in dev._loaded.items() if v is other.lib][0] + ".so"
del plan
zyx._RT.plans.clear()                               # the first plan leaves the cache
gc.collect()
assert mapped(path), "unloaded while another plan still uses it"
src = np.arange(7, dtype=np.float32) * 3
out = np.zeros(7, np.float32)
table = [0] * other.argtype._length_
table[items[0][1][1][1]] = src.ctypes.data
table[items[0][1][0][1]] = out.ctypes.data
dev.run_plan(other, table, False)
assert out.tolist() == (src * 2 + 1).tolist(), out
del other
gc.collect()
assert not mapped(path), "still mapped after its last plan was dropped"
print("RESULT OK")
"""


def test_program_shared_by_two_plans_stays_loaded_until_both_are_gone(tmp_path):
    ok(run_zyx(tmp_path, SHARED_PROGRAM))


# -- start-up and configuration -----------------------------------------------------------

def test_dummy_in_config_never_computes_when_the_c_backend_has_a_bad_setting(tmp_path):
    r = ok(run_zyx(tmp_path, COMPUTE, config={"dummy": {"enabled": True}},
                   env={"ZYX_THREADS": "abc"}))
    assert "ZYX_THREADS='abc'" in r.stderr, r.stderr
    r = ok(run_zyx(tmp_path, "import zyx; print(zyx.devices())\n" + COMPUTE,
                   config={"dummy": {"enabled": True}}))
    assert "dummy" not in r.stdout


@pytest.mark.parametrize("config,env,named", [
    ({"c": {"threads": "many"}}, {}, "c.threads"),
    ({"c": {"threads": -2}}, {}, "c.threads"),
    ({"c": {"flags": ["-fno-such-flag-zyx"]}}, {}, "c.flags"),
    ({"c": {"flags": "-O2"}}, {}, "c.flags"),
    ({"c": {"cache_mb": "big"}}, {}, "c.cache_mb"),
    ({"c": {"compiler": "no-such-cc-zyx"}}, {}, "c.compiler"),
    ({"c": 5}, {}, "config section c"),
    ({"max_plans": "lots"}, {}, "max_plans"),
])
def test_bad_config_value_is_ignored_with_a_warning_naming_it(tmp_path, config, env, named):
    r = ok(run_zyx(tmp_path, COMPUTE, config=config, env=env))
    assert f"ignoring {named}=" in r.stderr, r.stderr


@pytest.mark.parametrize("var", ["ZYX_THREADS", "OMP_NUM_THREADS"])
def test_absurd_thread_count_is_clamped_with_a_warning(tmp_path, var):
    r = ok(run_zyx(tmp_path, MATMUL, env={var: "100000"}))   # segfaulted on main
    assert f"{var}=100000 is more threads" in r.stderr, r.stderr


@pytest.mark.parametrize("threads", ["1", ""])
def test_thread_count_holds_when_another_library_started_openmp_first(tmp_path, threads):
    """ZYX_THREADS sets the team of every parallel region the C backend writes
    (num_threads), not only OMP_NUM_THREADS: an OpenMP runtime another library loaded
    first (torch brings its own libgomp) read that variable before zyx set it, and the
    setting was ignored. Unset: no clause, the runtime's default team."""
    code = ("import ctypes, ctypes.util\n"
            "gomp = ctypes.util.find_library('gomp')\n"
            "if gomp:\n"
            "    lib = ctypes.CDLL(gomp, mode=ctypes.RTLD_GLOBAL)\n"
            "    lib.omp_get_max_threads()    # the runtime reads its environment now\n"
            + MATMUL)
    r = ok(run_zyx(tmp_path, code, env={"ZYX_THREADS": threads, "ZYX_DEBUG": "8"}))
    regions = [ln for ln in r.stderr.splitlines() if "#pragma omp parallel" in ln]
    assert regions, r.stderr[-2000:]
    if threads:
        assert all(f"num_threads({threads})" in ln for ln in regions), regions
    else:
        assert not any("num_threads(" in ln for ln in regions), regions


def test_no_compiler_error_names_the_reason(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    r = run_zyx(tmp_path, COMPUTE, env={"PATH": str(empty)})
    assert r.returncode != 0 and "NoBackendAvailable" in r.stderr
    assert "no C compiler found" in r.stderr, r.stderr


def test_dummy_by_name_needs_no_config(tmp_path):
    code = ("import zyx, numpy as np\nzyx._RT.init(only=['dummy'])\n"
            "print(zyx.devices())\nprint('RESULT OK')\n")
    r = ok(run_zyx(tmp_path, code))
    assert "dummy" in r.stdout


# -- fork ---------------------------------------------------------------------------------

FORK_POOL = """
import multiprocessing as mp
import numpy as np, zyx

def matmul_error(seed):
    a = np.random.default_rng(seed).standard_normal((384, 384)).astype(np.float32)
    return float(np.abs((zyx.Tensor(a) @ zyx.Tensor(a)).numpy() - a @ a).max())

if __name__ == "__main__":
    assert matmul_error(0) < 1e-3
    (plan,) = zyx._RT.plans.values()
    assert plan.runner.parallel
    # on a loaded machine ThreadChoice could keep the plan on one thread: pin it to the
    # thread team, so the parent's team exists when the children are forked
    plan.threads.parallel, plan.threads.until_probe = True, -1
    for _ in range(3):
        assert matmul_error(0) < 1e-3
    with mp.get_context("fork").Pool(2) as pool:
        errors = pool.map_async(matmul_error, [1, 2, 3, 4]).get(timeout=40)
    assert max(errors) < 1e-3, errors
    print("RESULT OK")
"""


def test_fork_children_compute_after_the_parent_ran_parallel(tmp_path):
    script = tmp_path / "forkpool.py"
    script.write_text(FORK_POOL)
    ok(run_zyx(tmp_path, script, timeout=90))


def test_plan_cache_drops_the_least_recently_used_plan(monkeypatch):
    """A plan that keeps running survives new shapes filling the cache; the one that ran
    longest ago goes first (in this process: no compiler scenario)."""
    import zyx
    from zyx.runtime import RT

    def run(n):
        x = zyx.Tensor(np.arange(n, dtype=np.float32))
        np.testing.assert_array_equal((x * 3 - 1).numpy(), np.arange(n) * 3 - 1)

    run(2)                                   # the device is up before the cache is bounded
    monkeypatch.setattr(RT, "plans", {})
    monkeypatch.setattr(RT, "max_plans", 3)
    monkeypatch.setattr(RT, "growing_sizes", False)    # a plan per size, as counted here
    built = lambda: RT.stats["plans_built"]   # noqa: E731
    run(101), run(102), run(103)
    run(101)                                 # hot again: 102 is now the oldest
    before = built()
    run(104)                                 # full: drops 102
    run(101), run(103)                       # still cached
    assert built() == before + 1
    run(102)                                 # was dropped: built again
    assert built() == before + 2


# a plan of many kernels (an MLP training step): big enough to be split in units when the
# threshold is lowered
SPLIT_PLAN = """
import numpy as np, zyx, zyx.backends.ctoolchain as ctoolchain, zyx.codegen.cpu.plan as cplan
cplan.PART_MIN_CHARS = 2000
units = []
orig = ctoolchain.Toolchain.compile_units
def spy(self, c_paths, so_path):
    units.append(len(c_paths))
    return orig(self, c_paths, so_path)
ctoolchain.Toolchain.compile_units = spy
rng = np.random.default_rng(0)
x, w = rng.standard_normal((16, 32)).astype(np.float32), rng.standard_normal((8, 32)).astype(np.float32)
W = zyx.tensor(w, requires_grad=True)
y = zyx.nn.functional.linear(zyx.tensor(x), W).relu()
loss = (y * y).mean()
loss.backward()
g = W.grad.numpy()
h = np.maximum(x @ w.T, 0)
ref = (2 * h * (h > 0) / h.size).T @ x
assert np.allclose(g, ref, rtol=1e-4, atol=1e-5), (g, ref)
assert units and min(units) >= 2, units
print("RESULT OK", units)
"""


def test_big_plan_compiles_as_several_units_side_by_side(tmp_path):
    # (the threshold lowered so a small step splits; a second process loads the library
    # from the cache and compiles nothing)
    cache = tmp_path / "cache"
    r = ok(run_zyx(tmp_path, SPLIT_PLAN, cache=cache))
    assert "RESULT OK" in r.stdout
    again = run_zyx(tmp_path, SPLIT_PLAN.replace("assert units and min(units) >= 2, units",
                                                 "assert not units, units"), cache=cache)
    ok(again)
