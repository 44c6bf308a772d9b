"""The OpenCL backend against numpy, on whatever OpenCL device is installed (PoCL's CPU
device in CI: `pip install "pyopencl[pocl]"`). Skipped, with the reason, when pyopencl or
an OpenCL device is missing.

The runtime is re-initialized with the OpenCL backend alone for this module, so every
realization here compiles OpenCL C, and restored to the normal backends afterwards."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx.errors import NoBackendAvailable

cl = pytest.importorskip("pyopencl", reason="pyopencl is not installed")


@pytest.fixture(scope="module", autouse=True)
def opencl_runtime():
    rt = zyx._RT
    try:
        rt.init(only=["opencl"])
    except NoBackendAvailable as e:
        rt.init()
        pytest.skip(f"no OpenCL device: {e}")
    dev = rt.device()
    assert dev.backend == "opencl"
    yield dev
    rt.init()


def close(t, ref, rtol=1e-5, atol=1e-6):
    out = t.numpy()
    assert out.shape == np.shape(ref)
    np.testing.assert_allclose(out.astype(np.float64), np.asarray(ref, np.float64),
                               rtol=rtol, atol=atol)


def rand(*shape):
    return np.random.randn(*shape).astype(np.float32)


def test_the_device_is_opencl(opencl_runtime):
    info = opencl_runtime.info()
    assert info.name.startswith("OpenCL ")
    assert info.max_local_threads >= 1
    assert [d.name for d in zyx.devices()] == [info.name]
    assert [str(d) for d in zyx.devices()] == ["opencl:0"]


def test_elementwise_chain():
    a, b = rand(5, 7), rand(5, 7)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    close((x * y + x.exp() - y.abs().sqrt()) / 3.0, (a * b + np.exp(a) - np.sqrt(np.abs(b))) / 3.0)
    close((x.tanh() * 0.5).maximum(y), np.maximum(np.tanh(a) * 0.5, b))


def test_broadcasting():
    a, b, c = rand(4, 1, 3), rand(1, 6, 3), rand(3)
    close(zyx.Tensor(a) + zyx.Tensor(b) * zyx.Tensor(c), a + b * c)


@pytest.mark.parametrize("axis", [None, 0, 1, 2])
def test_sum_max_mean(axis):
    a = rand(3, 17, 33)
    x = zyx.Tensor(a)
    close(x.sum(axis), a.sum(axis), rtol=1e-4, atol=1e-4)
    close(x.amax(axis), a.max(axis))
    close(x.mean(axis), a.mean(axis), rtol=1e-4, atol=1e-5)


def test_large_reduction():
    a = rand(1 << 16)
    close(zyx.Tensor(a).sum(), a.astype(np.float64).sum(), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((17, 33), (33, 65)),
                                   ((2, 16, 64), (2, 64, 16)), ((6,), (6, 2))])
def test_matmul(sa, sb):
    a, b = rand(*sa), rand(*sb)
    close(zyx.Tensor(a) @ zyx.Tensor(b), a.astype(np.float64) @ b.astype(np.float64),
          rtol=1e-4, atol=1e-4)


def test_softmax():
    a = rand(8, 10) * 4
    e = np.exp(a - a.max(-1, keepdims=True))
    close(zyx.Tensor(a).softmax(-1), e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_cast_float_to_int_and_back():
    a = rand(20) * 50
    x = zyx.Tensor(a)
    i = x.cast(zyx.int32)
    assert i.dtype is zyx.int32
    np.testing.assert_array_equal(i.numpy(), a.astype(np.int32))
    close(i.cast(zyx.float32) * 2, a.astype(np.int32).astype(np.float32) * 2)


def test_float16_storage():
    a = rand(9, 5).astype(np.float16)
    x = zyx.Tensor(a)
    assert x.dtype is zyx.float16
    y = x * 3 + 1
    out = y.numpy()
    assert out.dtype == np.float16
    # float math, rounded to half once when stored: numpy's result in float32 rounded
    np.testing.assert_array_equal(out, (a.astype(np.float32) * 3 + 1).astype(np.float16))
    np.testing.assert_array_equal(zyx.Tensor(a.astype(np.float32)).cast(zyx.float16).numpy(), a)


def test_bfloat16_round_trip():
    a = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0], np.float32)
    x = zyx.Tensor(a).cast(zyx.bfloat16)
    back = x.cast(zyx.float32).numpy()
    u = a.view(np.uint32)
    ref = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(back, ref)


def test_int_ops():
    a = np.random.randint(-100, 100, size=(6, 7)).astype(np.int32)
    b = np.random.randint(1, 9, size=(6, 7)).astype(np.int32)
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    np.testing.assert_array_equal((x * y - 3).numpy(), a * b - 3)
    np.testing.assert_array_equal(x.sum(1).numpy(), a.sum(1))
    np.testing.assert_array_equal((x // y).numpy(), a // b)
    big = np.array([2**40, -(2**35), 7], np.int64)
    np.testing.assert_array_equal((zyx.Tensor(big) * 3).numpy(), big * 3)


def test_float64():
    a = np.random.randn(4, 5)
    close(zyx.Tensor(a).exp().sum(0), np.exp(a).sum(0), rtol=1e-12, atol=1e-12)


def test_mlp_forward_backward():
    w1, b1, w2 = rand(16, 8) * 0.3, rand(16) * 0.1, rand(3, 16) * 0.3
    xs = rand(5, 8)
    W1, B1, W2 = (zyx.Tensor(v, requires_grad=True) for v in (w1, b1, w2))
    h = zyx.Tensor(xs) @ W1.T + B1
    out = h.relu() @ W2.T
    loss = (out * out).mean()
    loss.backward()
    # numpy reference
    hn = xs @ w1.T + b1
    rn = np.maximum(hn, 0)
    on = rn @ w2.T
    close(loss, (on * on).mean(), rtol=1e-5, atol=1e-6)
    go = 2 * on / on.size
    gw2 = go.T @ rn
    gr = go @ w2
    gh = gr * (hn > 0)
    close(W2.grad, gw2, rtol=1e-4, atol=1e-5)
    close(W1.grad, gh.T @ xs, rtol=1e-4, atol=1e-5)
    close(B1.grad, gh.sum(0), rtol=1e-4, atol=1e-5)


def test_no_fp64_device_refuses_float64(opencl_runtime, monkeypatch):
    # a device without cl_khr_fp64 must say so instead of failing inside the OpenCL build
    monkeypatch.setattr(opencl_runtime, "fp64", False)
    monkeypatch.setattr(opencl_runtime, "_programs", {})
    monkeypatch.setattr(opencl_runtime, "_by_source", {})
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
