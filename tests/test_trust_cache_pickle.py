"""Trust II: a kernel cache directory planted as a symbolic link is refused, stale
temporaries zyx did not make survive the cache's clean-up, malformed JSON (config,
autotune schedules) is ignored with a warning, a failing C compiler is named, and tensors
pickle (multiprocessing spawn queues)."""
from __future__ import annotations

import os
import sys
import time

import pytest

import zyx.backends as backends
from zyx.backends.binary_cache import BinaryCache

OTHER_UID = 12345
root_only = pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                               reason="chown to another uid needs root")


def _cache_dir(monkeypatch, tmp_path):
    """cache_dir() with XDG_CACHE_HOME=tmp_path/xdg: (directory used, warnings)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        d = backends.cache_dir()
    return d, [str(x.message) for x in w]


def _planted_link(tmp_path, target):
    (tmp_path / "xdg").mkdir()
    link = tmp_path / "xdg" / "zyx"
    link.symlink_to(target)
    return link


@root_only
def test_cache_link_to_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    target = tmp_path / "theirs"
    target.mkdir(mode=0o700)
    os.chown(target, OTHER_UID, OTHER_UID)
    link = _planted_link(tmp_path, target)
    d, warned = _cache_dir(monkeypatch, tmp_path)
    assert d != str(link) and not d.startswith(str(target))
    assert any(f"owned by uid {OTHER_UID}" in m and "private directory" in m for m in warned), warned
    assert not list(target.iterdir())


@root_only
def test_cache_link_owned_by_another_user_is_refused_even_to_our_directory(tmp_path, monkeypatch):
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    link = _planted_link(tmp_path, ours)
    os.lchown(link, OTHER_UID, OTHER_UID)
    d, warned = _cache_dir(monkeypatch, tmp_path)
    assert d != str(link)
    assert any(f"symbolic link owned by uid {OTHER_UID}" in m for m in warned), warned


def test_cache_link_of_ours_to_a_directory_of_ours_is_used(tmp_path, monkeypatch):
    ours = tmp_path / "bigdisk"
    ours.mkdir(mode=0o700)
    link = _planted_link(tmp_path, ours)
    d, warned = _cache_dir(monkeypatch, tmp_path)
    assert d == str(link) and not warned


def test_cache_link_of_ours_to_a_shared_directory_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    link = _planted_link(tmp_path, shared)
    d, warned = _cache_dir(monkeypatch, tmp_path)
    assert d != str(link)
    assert any("group- or world-writable" in m for m in warned), warned


def test_dangling_cache_link_is_refused_and_its_target_not_created(tmp_path, monkeypatch):
    target = tmp_path / "nowhere"
    link = _planted_link(tmp_path, target)
    d, warned = _cache_dir(monkeypatch, tmp_path)
    assert d != str(link) and not target.exists()
    assert any("symbolic link to a missing" in m for m in warned), warned


def _stale(path):
    hours_ago = time.time() - 7200
    os.utime(path, (hours_ago, hours_ago), follow_symlinks=False)


@root_only
def test_stale_temporaries_zyx_did_not_make_survive_the_clean_up(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    theirs_dir = cache / "tmp-abcd1234"          # zyx's shape, another user's
    theirs_dir.mkdir()
    (theirs_dir / "data").write_text("keep")
    os.chown(theirs_dir, OTHER_UID, OTHER_UID)
    theirs_file = cache / "tmp-x"                 # not zyx's shape, another user's
    theirs_file.write_text("keep")
    os.chown(theirs_file, OTHER_UID, OTHER_UID)
    our_odd = cache / "tmp-not-a-tempfile-name"   # ours, but no name tempfile gives
    our_odd.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep")
    link = cache / "tmp-lnk12345"                 # zyx's shape, a link: never followed
    link.symlink_to(elsewhere)
    ours = cache / "tmp-zz_9abcd"                 # what a killed zyx process leaves
    ours.mkdir(mode=0o700)
    (ours / "k0.c").write_text("void f(void) {}")
    ours_file = cache / "tmp-q1w2e3r4"
    ours_file.write_bytes(b"half")
    for p in (theirs_dir, theirs_file, our_odd, link, ours, ours_file):
        _stale(p)
    bc = BinaryCache("c", "so", str(cache), max_bytes=1 << 30)
    assert bc.store("0" * 32, b"library")       # a process's first write cleans up
    assert not ours.exists() and not ours_file.exists()
    assert (theirs_dir / "data").read_text() == "keep" and theirs_file.read_text() == "keep"
    assert our_odd.is_dir() and link.is_symlink()
    assert (elsewhere / "precious").read_text() == "keep"


# -- malformed JSON is ignored with a warning; a failing C compiler is named -------------

DEEP = "[" * 100_000


def test_deeply_nested_config_is_ignored_with_a_warning(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(DEEP)
    with pytest.warns(RuntimeWarning, match="ignoring malformed config .*nested too deeply"):
        assert backends.load_config(str(p)) == {}
    p.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring malformed config"):
        assert backends.load_config(str(p)) == {}


def test_deeply_nested_schedules_are_ignored_with_a_warning_and_rewritten(tmp_path):
    from zyx import tuning
    probe = tuning.ScheduleStore("ident", str(tmp_path))
    with open(probe.path, "w") as f:
        f.write(DEEP)
    with pytest.warns(RuntimeWarning, match="malformed autotune schedules .*nested too deeply"):
        store = tuning.ScheduleStore("ident", str(tmp_path))
    assert store.entries == {}
    store.put("k", {"label": "fast"})        # rewritten, readable again
    assert tuning.ScheduleStore("ident", str(tmp_path)).entries == {"k": {"label": "fast"}}


def _run(tmp_path, code, env=None, config=None, timeout=180):
    """`code` in a fresh interpreter with this checkout's zyx, a private cache and config."""
    import json
    import subprocess
    cfg_home = tmp_path / "config"
    (cfg_home / "zyx").mkdir(parents=True, exist_ok=True)
    (cfg_home / "zyx" / "config.json").write_text(json.dumps(config or {}))
    e = {k: v for k, v in os.environ.items()
         if k not in ("ZYX_THREADS", "OMP_NUM_THREADS", "ZYX_CC", "CC", "ZYX_DEBUG", "ZYX_DEVICE")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    e.update(XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_CONFIG_HOME=str(cfg_home),
             PYTHONPATH=root + os.pathsep + e.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=e, capture_output=True,
                          text=True, timeout=timeout)


def _script(tmp_path, name, body):
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(0o755)
    return str(p)


def _pocl():
    return os.path.exists("/etc/OpenCL/vendors/pocl.icd")


needs_linux_cc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not any(
        os.path.exists(os.path.join(d, "cc")) for d in os.environ.get("PATH", "").split(":")),
    reason="needs a C compiler on Linux")


@needs_linux_cc
@pytest.mark.parametrize("compiler", ["/bin/false", "exits 0, writes nothing"])
def test_a_failing_c_compiler_is_named_in_a_warning(tmp_path, compiler):
    cc = compiler if compiler.startswith("/") else _script(tmp_path, "silentcc", "exit 0\n")
    code = "import zyx; print('DEVICES', zyx.devices())"
    r = _run(tmp_path, code, env={"ZYX_CC": cc},
             config=None if _pocl() else {"dummy": {"enabled": True}})
    assert "the C backend is off" in r.stderr and cc in r.stderr, r.stderr
    reason = "exit status 1" if compiler == "/bin/false" else "exited 0 but wrote no library"
    assert reason in r.stderr, r.stderr
    if _pocl():
        assert r.returncode == 0 and "DEVICES" in r.stdout, r.stderr


@needs_linux_cc
def test_junk_library_from_the_compiler_leaves_no_exception_in_del(tmp_path):
    # the probe builds (real compiler), the plan's library is never written
    cc = _script(tmp_path, "planless", 'for a in "$@"; do case "$a" in *.c) src="$a";; esac; done\n'
                 'if [ -n "$src" ] && grep -q zyx_plan "$src"; then exit 0; fi\nexec cc "$@"\n')
    code = ("import numpy as np, zyx\n"
            "try:\n    (zyx.Tensor(np.ones(4, np.float32)) * 2).numpy()\n"
            "except Exception as e:\n    print('RAISED', type(e).__name__, e)\n")
    r = _run(tmp_path, code, env={"ZYX_CC": cc},
             config={n: {"enabled": False} for n in ("opencl", "cuda", "hip")})
    assert "RAISED BackendError" in r.stdout and "no loadable library" in r.stdout, (r.stdout, r.stderr)
    assert "Exception ignored" not in r.stderr, r.stderr


# -- tensors pickle as torch's do ----------------------------------------------------------

def _roundtrip(t):
    import pickle
    return pickle.loads(pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int8", "int32",
                                   "int64", "uint8", "uint64", "bool"])
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (5,), (3, 4)])
def test_tensor_pickle_round_trip_keeps_values_dtype_shape_device(dtype, shape):
    import numpy as np
    import zyx
    rng = np.random.default_rng(0)
    vals = rng.standard_normal(shape) * 7
    if dtype == "bool":
        vals = vals > 0
    elif dtype.startswith("u"):
        vals = np.abs(vals)
    t = zyx.Tensor(vals, dtype=dtype) * 1 if dtype != "bool" else zyx.Tensor(vals, dtype=dtype)
    u = _roundtrip(t)
    assert type(u) is zyx.Tensor and u.dtype == t.dtype and u.shape == t.shape
    assert str(u.device) == str(t.device) and not u.requires_grad
    np.testing.assert_array_equal(u.numpy(), t.numpy())


def test_bfloat16_pickles_exactly():
    import numpy as np
    import zyx
    t = zyx.Tensor(np.array([1.5, -3.25, 1e-3, 3e38, -0.0, 65504.0], np.float32), dtype="bfloat16")
    u = _roundtrip(t)
    assert u.dtype == zyx.bfloat16
    np.testing.assert_array_equal(u.numpy(), t.numpy())


def test_requires_grad_and_parameters_survive_pickling():
    import numpy as np
    import zyx
    import zyx.nn as nn
    x = zyx.Tensor(np.ones(3, np.float32), requires_grad=True)
    y = _roundtrip(x * 2)                  # a non-leaf comes back as a leaf, as in torch
    assert y.requires_grad and y.tolist() == [2.0, 2.0, 2.0]
    y.sum().backward()
    np.testing.assert_array_equal(y.grad.numpy(), np.ones(3, np.float32))
    p = _roundtrip(nn.Parameter(zyx.ones(2, 2)))
    assert p.requires_grad and p.numpy().tolist() == [[1.0, 1.0], [1.0, 1.0]]
    import copy
    c = copy.deepcopy(x)
    assert c is not x and c.requires_grad and c.tolist() == [1.0, 1.0, 1.0]


def test_unpickling_onto_a_missing_device_names_it():
    import pickle
    import numpy as np
    import zyx
    from zyx.errors import BackendError

    class Foreign:          # what a process with a cuda:7 would have pickled
        def __reduce__(self):
            return zyx.Tensor, (np.ones(2, np.float32), "float32", False, "cuda:7")
    data = pickle.dumps(Foreign())
    with pytest.raises(BackendError, match="cuda:7"):
        pickle.loads(data)


SPAWN = """
import multiprocessing as mp, numpy as np, zyx

def child(inq, outq):
    t = inq.get(timeout=60)
    outq.put((t * 2, t.dtype.name, t.requires_grad, str(t.device)))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(inq, outq))
    p.start()
    inq.put(zyx.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), requires_grad=True))
    doubled, dtype, rg, dev = outq.get(timeout=90)
    p.join(30)
    assert p.exitcode == 0, p.exitcode
    assert doubled.numpy().tolist() == [[0, 2, 4], [6, 8, 10]] and dtype == "float32" and rg
    assert dev == "cpu", dev
    print("RESULT OK")
"""


@needs_linux_cc
def test_tensor_crosses_a_spawn_queue(tmp_path):
    script = tmp_path / "spawn_queue.py"
    script.write_text(SPAWN)
    r = _run(tmp_path, f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
             config={n: {"enabled": False} for n in ("opencl", "cuda", "hip")}, timeout=150)
    assert r.returncode == 0 and "RESULT OK" in r.stdout, (r.stdout, r.stderr[-3000:])
