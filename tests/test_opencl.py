"""The OpenCL backend against numpy, on whatever OpenCL device is installed (PoCL's CPU
device in CI: `pip install "pyopencl[pocl]"`). Skipped, with the reason, when pyopencl or
an OpenCL device is missing.

The runtime is re-initialized with the OpenCL backend alone for this module, so every
realization here compiles OpenCL C, and restored to the normal backends afterwards."""
from __future__ import annotations

import os

import numpy as np
import pytest

import zyx
from conftest import only_backend
from gpu_cases import close, rand

cl = pytest.importorskip("pyopencl", reason="pyopencl is not installed")


@pytest.fixture(scope="module", autouse=True)
def opencl_runtime():
    yield from only_backend("opencl", "no OpenCL device")


def test_the_device_is_opencl(opencl_runtime):
    info = opencl_runtime.info()
    assert info.name.startswith("OpenCL ")
    assert info.max_local_threads >= 1
    # every device listed is OpenCL (a machine may have two platforms on one CPU, e.g.
    # Debian's PoCL and the pip wheel's), numbered in order, the default one first
    found = zyx.devices()
    assert found[0].name == info.name and all(d.name.startswith("OpenCL ") for d in found)
    assert [str(d) for d in found] == [f"opencl:{i}" for i in range(len(found))]


# the numerical cases every GPU backend must pass (gpu_cases.py), collected here so that
# they run under this module's OpenCL-only runtime
from gpu_cases import *  # noqa: E402,F401,F403


def test_no_fp64_device_refuses_float64(opencl_runtime, monkeypatch):
    # a device without cl_khr_fp64 must say so instead of failing inside the OpenCL build.
    # The runtime's current device, not the fixture's: a test that re-initializes the
    # runtime (test_c_backend_stays_default) leaves new device objects behind it
    dev = zyx._RT.device()
    assert dev.backend == "opencl"
    monkeypatch.setattr(dev, "fp64", False)
    monkeypatch.setattr(dev, "_programs", {})
    monkeypatch.setattr(dev, "_by_source", {})
    zyx._RT.plans.clear()
    with pytest.raises(zyx.DTypeError, match="float64"):
        (zyx.Tensor(np.arange(3.0)) * 2.5).numpy()
    zyx._RT.plans.clear()


def test_c_backend_stays_default(monkeypatch):
    # a CPU OpenCL device must never outrank the C backend on the same CPU (unless asked)
    monkeypatch.delenv("ZYX_DEVICE", raising=False)
    rt = zyx._RT
    rt.init()
    try:
        names = [type(d).__module__ for d in rt.devices]
        if "zyx.backends.c" in names:
            c = rt.devices[names.index("zyx.backends.c")]
            cpu_opencl = [d for d in rt.devices if type(d).__module__ == "zyx.backends.opencl"
                          and d.info().extra["cpu"]]
            assert rt.device() not in cpu_opencl
            assert all(rt._ranked.index(c) < rt._ranked.index(d) for d in cpu_opencl)
    finally:
        rt.init(only=["opencl"])


def test_zyx_device_env_selects_opencl(monkeypatch):
    rt = zyx._RT
    monkeypatch.setenv("ZYX_DEVICE", "opencl")
    rt.init()
    try:
        assert rt.device().backend == "opencl"
        a = rand(4, 4)
        close(zyx.Tensor(a) * 2, a * 2)
    finally:
        monkeypatch.delenv("ZYX_DEVICE")
        rt.init(only=["opencl"])


def test_platform_ids_config(opencl_runtime):
    from zyx.backends import opencl
    from zyx.errors import BackendError
    with pytest.raises(BackendError, match="no platform"):
        opencl.initialize({"platform_ids": [len(cl.get_platforms())]})   # past the last one
    with pytest.raises(BackendError, match="not a list"):
        opencl.initialize({"platform_ids": "0"})
    mine = cl.get_platforms().index(opencl_runtime.dev.platform)
    _, devices = opencl.initialize({"platform_ids": [mine]})
    assert devices and all(d.dev.platform == opencl_runtime.dev.platform for d in devices)


def test_pocl_without_a_linker_is_skipped_not_aborted(opencl_runtime, monkeypatch):
    # PoCL aborts the process at the first kernel build when `ld` is missing
    from zyx.backends import opencl
    from zyx.errors import BackendError
    if "Portable Computing Language" not in opencl_runtime.dev.platform.name:
        pytest.skip("the OpenCL device is not PoCL")
    monkeypatch.setattr(opencl.shutil, "which", lambda name: None)
    mine = cl.get_platforms().index(opencl_runtime.dev.platform)
    with pytest.raises(BackendError, match="linker"):
        opencl.initialize({"platform_ids": [mine]})


def test_uploads_are_queued_and_the_source_may_change_at_once():
    pool = zyx._RT.device().pool       # (an earlier test may have re-initialized)
    a = np.arange(1000, dtype=np.float32)
    x = zyx.Tensor(a)             # copies a: changing a afterwards must not reach x
    a[:] = -1
    assert len(pool._uploads) >= 1          # queued, not waited for
    np.testing.assert_array_equal(x.numpy(), np.arange(1000, dtype=np.float32))
    assert not pool._uploads                # a read waits for the queue, then forgets them
    many = [zyx.Tensor(np.full(16, i, np.float32)) for i in range(200)]
    assert len(pool._uploads) <= 200
    assert [t.numpy()[0] for t in many] == list(range(200))


def skip_where_plan_launches_crash(dev):
    """Skip on a platform where PlanLaunches is off by default because its driver
    crashed with them (opencl.plan_launches_default: NVIDIA's)."""
    from zyx.backends import opencl
    if not opencl.plan_launches_default(dev.dev.platform.name):
        pytest.skip(f"plan launches are off on {dev.dev.platform.name.strip()}: its driver "
                    f"segfaulted releasing their sub-buffers")


def test_plan_launches_give_the_same_training_as_kernel_by_kernel_launches(monkeypatch):
    """Plans run through their launch record (PlanLaunches: arguments set once, only the
    moved buffers set again, temporaries in one arena as sub-buffers) compute what the
    kernel-by-kernel path computes, over a training loop whose batches and weights move
    every step; and the loss goes down."""
    import launch_loop
    dev = zyx._RT.device()
    assert dev.backend == "opencl"
    skip_where_plan_launches_crash(dev)
    monkeypatch.setattr(dev, "plan_launches", False)
    plain = launch_loop.train_fresh()
    assert not launch_loop.launchers()
    monkeypatch.setattr(dev, "plan_launches", True)
    prepared = launch_loop.train_fresh()
    assert launch_loop.launchers(), "the training step ran through a launch record"
    launch_loop.assert_same(prepared, plain)
    assert prepared[0][-3:].mean() < prepared[0][:3].mean()
    zyx._RT._drop_plans()


def test_plan_launches_rebind_leaves_that_change_between_runs():
    """One plan (several kernels, a temporary in the arena) run over inputs that change
    between runs, earlier outputs kept alive so that the targets move too: every run
    matches numpy, and the launch record sets again only the arguments of the slots
    whose buffer changed."""
    skip_where_plan_launches_crash(zyx._RT.device())
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((16, 24), dtype=np.float32) for _ in range(5)]
    w = rng.standard_normal((24, 8), dtype=np.float32)
    W = zyx.tensor(w)
    X = [zyx.tensor(x) for x in xs]
    kept = []
    for i in range(12):
        out = ((X[i % 5] @ W).softmax(-1) + X[i % 5].mean()).realize()
        kept = (kept + [out])[-3:]
        x = xs[i % 5].astype(np.float64)
        e = np.exp(x @ w - (x @ w).max(-1, keepdims=True))
        close(out, e / e.sum(-1, keepdims=True) + x.mean(), rtol=1e-4, atol=1e-5)
    plan = next(p for p in zyx._RT.plans.values()
                if p.launcher is not None and len(p.launcher.launches) >= 2)
    # the arguments hold the last run's buffers: the weight's (never moved) and the
    # last input's, and the last target's
    bound = [id(h) for h in plan.launcher.bound]
    buffer = lambda t: zyx._RT.graph.get(t._id).buffer.handle   # noqa: E731
    for t in (W, X[11 % 5], kept[-1]):
        assert id(buffer(t)) in bound


def test_dropping_plans_after_their_arena_was_trimmed_keeps_results_right():
    """Plans with arena temporaries, their arenas released by empty_cache while the plans
    live, then every plan dropped and the same work done again: the values match numpy
    (the sequence that crashed NVIDIA's OpenCL with plan launches, which are off there:
    opencl.plan_launches_default)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 48), dtype=np.float32)
    w = rng.standard_normal((48, 16), dtype=np.float32)
    X, W = zyx.tensor(x), zyx.tensor(w)
    e = np.exp(x @ w - (x @ w).max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True) + x.mean()
    for _ in range(3):
        close(((X @ W).softmax(-1) + X.mean()).realize(), want, rtol=1e-4, atol=1e-5)
        zyx.empty_cache()
        zyx._RT.plans.clear()
        zyx.synchronize()


def test_plan_launches_are_off_by_default_only_on_nvidia(monkeypatch):
    """PlanLaunches is the default except on NVIDIA's OpenCL platform (its driver crashed
    releasing their sub-buffers); ZYX_PLAN_LAUNCHES decides over the default."""
    from zyx.backends import opencl
    assert opencl.plan_launches_default("Portable Computing Language")
    assert not opencl.plan_launches_default("NVIDIA CUDA")
    dev = zyx._RT.device()
    want = opencl.plan_launches_default(dev.dev.platform.name)
    if "ZYX_PLAN_LAUNCHES" not in os.environ:
        assert dev.plan_launches == want
