"""Shared fixtures and helpers for the zyx test suite.

* `device`: parametrized over the first device of each backend zyx lists (see
  `_test_devices`); while a test runs, that device is the
  default one (zyx.set_default_device), so its tensors live and compute there.
* numpy's global generator is seeded before every test, so failures reproduce.
* `tol(dtype)` / `assert_close(...)`: per-dtype tolerances and a comparison that also checks
  the result dtype and shape and treats NaNs at the same positions as equal.
* bfloat16 helpers: round numpy float32 values to bfloat16 the way zyx stores them
  (round to nearest even), so references can be computed at bf16 precision.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import zyx
from zyx import dtype as zdt
from zyx.errors import DeviceLimitError, UnsupportedDTypeError

# float32 convolutions are exact in the suite, as in torch's own tests: a test that wants
# TF32 on CUDA turns zyx.backends.cudnn.allow_tf32 (default True) on itself
zyx.backends.cudnn.allow_tf32 = False

# ---------------------------------------------------------------------------------------
# dtypes

ALL_DTYPES = (zyx.bool, zyx.uint8, zyx.uint16, zyx.uint32, zyx.uint64, zyx.int8, zyx.int16,
              zyx.int32, zyx.int64, zyx.float16, zyx.bfloat16, zyx.float32, zyx.float64)
FLOAT_DTYPES = (zyx.float16, zyx.bfloat16, zyx.float32, zyx.float64)
INT_DTYPES = (zyx.uint8, zyx.uint16, zyx.uint32, zyx.uint64, zyx.int8, zyx.int16, zyx.int32,
              zyx.int64)
SIGNED_INT_DTYPES = (zyx.int8, zyx.int16, zyx.int32, zyx.int64)
NUMERIC_DTYPES = INT_DTYPES + FLOAT_DTYPES

# numpy dtype used for the reference computation of each zyx dtype (bf16 has none: we keep
# its values in float32, rounded to bf16 precision)
_REF_NP = {d: (np.float32 if d is zyx.bfloat16 else d.np.type) for d in ALL_DTYPES}


def ref_np(d):
    """The numpy dtype that holds values of zyx dtype `d` (float32 for bfloat16)."""
    return _REF_NP[d]


def ids(dtypes):
    return [d.name for d in dtypes]


def bf16_round(a):
    """Round float32 values to the nearest bfloat16 (ties to even), back as float32."""
    a = np.asarray(a, dtype=np.float32)
    shape = a.shape
    a = np.ascontiguousarray(a).reshape(-1)
    u = a.view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32)
    out = r.view(np.float32).copy()
    out[nan] = np.nan
    return out.reshape(shape)


def round_to(a, d):
    """Values of numpy array `a` as zyx dtype `d` would store them (numpy dtype ref_np(d))."""
    if d is zyx.bfloat16:
        return bf16_round(a)
    return np.asarray(a).astype(ref_np(d))


def sample(shape, d, lo=-4.0, hi=4.0, rng=None):
    """Random values of zyx dtype `d` as a numpy array (dtype ref_np(d)), inside [lo, hi]
    clipped to the dtype's range. Integers are whole numbers, bools are random."""
    rng = rng or np.random
    if d is zyx.bool:
        return rng.random(shape) < 0.5
    if d.is_int:
        info = np.iinfo(d.np)
        lo_i = max(int(np.floor(lo)), int(info.min))
        hi_i = min(int(np.ceil(hi)), int(info.max))
        return rng.randint(lo_i, hi_i + 1, size=shape).astype(d.np)
    a = rng.uniform(lo, hi, size=shape).astype(np.float32)
    return round_to(a, d)


# ---------------------------------------------------------------------------------------
# tolerances and comparison

_TOL = {zyx.float16: (2e-3, 2e-3), zyx.bfloat16: (1.6e-2, 1.6e-2),
        zyx.float32: (2e-5, 1e-6), zyx.float64: (1e-12, 1e-13)}


def tol(d, scale=1.0):
    """(rtol, atol) for results of zyx dtype `d`; `scale` widens them for long chains."""
    if d in _TOL:
        r, a = _TOL[d]
        return r * scale, a * scale
    return 0.0, 0.0


def assert_close(got, expected, dtype=None, rtol=None, atol=None, scale=1.0, msg=""):
    """Compare a zyx Tensor (or array) with a numpy reference.

    Checks the zyx dtype (when `dtype` is given), the shape, and values: exact for ints and
    bools, within `tol(dtype)` for floats, NaN where the reference has NaN, and infinities
    of the same sign."""
    if isinstance(got, zyx.Tensor):
        if dtype is not None:
            assert got.dtype == dtype, f"{msg} dtype {got.dtype} != expected {dtype}"
        d = got.dtype
        g = got.numpy()
    else:
        d = dtype
        g = np.asarray(got)
    e = np.asarray(expected)
    assert g.shape == e.shape, f"{msg} shape {g.shape} != expected {e.shape}"
    if d is not None and not d.is_float:
        assert np.array_equal(g.astype(e.dtype) if e.dtype != g.dtype else g, e), \
            f"{msg}\n got {g}\n expected {e}"
        return
    r, a = tol(d, scale) if d is not None else (1e-6, 1e-6)
    r = r if rtol is None else rtol
    a = a if atol is None else atol
    np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=r, atol=a,
                               equal_nan=True, err_msg=msg)


# ---------------------------------------------------------------------------------------
# fixtures

@pytest.fixture(autouse=True)
def _seed_numpy():
    """Every test starts from the same numpy random state, so failures reproduce, and
    with no graph families from earlier tests (values read at launch, growing sizes), so
    its plan counts do not depend on what ran before it."""
    np.random.seed(1234)
    zyx._RT._families.clear()
    zyx._RT._bound_families.clear()
    yield


def _test_devices():
    """The devices the `device` fixture runs on.

    * ZYX_TEST_DEVICES names backends (comma-separated, e.g. "vulkan": the GPU machine's
      runs, .ci/gpu_run.sh suites, give each backend its own run at once) and every device
      of those backends runs; ZYX_TEST_DEVICES=all runs every device zyx lists.
    * Otherwise the first device of each backend. One device per backend because a
      second device of the same backend runs the same generated code (CI has two PoCL
      platforms, and the second one added a fifth of the suite's time for nothing)."""
    wanted = [w.strip() for w in os.environ.get("ZYX_TEST_DEVICES", "").split(",") if w.strip()]
    devs = zyx.devices()
    if wanted == ["all"]:
        return devs
    if wanted:
        return [d for d in devs if d.type in wanted]
    first_of_each, seen = [], set()
    for d in devs:
        if d.type not in seen:
            seen.add(d.type)
            first_of_each.append(d)
    return first_of_each


@pytest.fixture(params=_test_devices(), ids=str)
def device(request):
    """Run the test on one device, each of `_test_devices()` (the CPU, PoCL's OpenCL, and
    Vulkan and WebGPU on lavapipe in CI): it is the default device while the test runs,
    so the tensors the test creates live there and its realizations run there. A test skipped mid-way on one device can
    leave work deferred there (a write to a realized tensor, kept alive by the skip's
    traceback); the runtime computes deferred work only with a realization on its own
    device (`Runtime._take_pending`), so it never reaches the next test's device."""
    rt = zyx._RT
    if len(rt.devices) == 1:
        yield request.param
        return
    before = rt.default
    rt.set_default_device(request.param)
    try:
        yield request.param
    finally:
        rt.default = before


_NO_WIDE_DTYPES = ("wgpu", "vulkan")   # backends without float64 / 64-bit integers


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test that runs into UnsupportedDTypeError (float64, int64: WGSL has no such types)
    or DeviceLimitError (lavapipe binds 32 storage buffers to a Vulkan shader) on a WebGPU
    or Vulkan device is skipped with that error as the reason: the `device` it is
    parametrized with, or the default device (ZYX_DEVICE=wgpu) for a test that takes none.
    On any other device, and any other error, it fails."""
    try:
        return (yield)
    except (UnsupportedDTypeError, DeviceLimitError) as e:
        dev = pyfuncitem.funcargs.get("device")
        if dev is None:
            dev = zyx.get_default_device()
        if str(dev).split(":")[0] in _NO_WIDE_DTYPES:
            pytest.skip(f"{type(e).__name__} on {dev}: {e}")
        raise


def skip_on_lavapipe(why):
    """Skip the running test when the default device is Mesa's lavapipe under Vulkan or
    WebGPU and the test needs what lavapipe lacks (`why`: denormals, IEEE edge cases it
    folds): a limit of that CPU driver, not of the backends on a GPU."""
    dev = zyx.get_default_device()
    if str(dev).split(":")[0] in _NO_WIDE_DTYPES and "llvmpipe" in repr(dev):
        pytest.skip(f"lavapipe on {dev}: {why}")


def skip_without_signed_zeros(why):
    """Skip the running test where a computed zero's sign may be lost (`why`: how the test
    brings a -0.0 back): on lavapipe, which folds such expressions, and on WebGPU, whose
    WGSL specification lets an implementation ignore the sign of a zero (NVIDIA's driver
    through wgpu does, in the gather case)."""
    skip_on_lavapipe(f"{why}: lavapipe folds it without signed zeros")
    dev = zyx.get_default_device()
    if str(dev).startswith("wgpu"):
        pytest.skip(f"{dev}: {why}: WGSL lets implementations ignore the sign of a zero")


def only_backend(name, reason):
    """Body of a module fixture running a test module on backend `name` alone: the
    runtime is re-initialized with only that backend (skipping the module with `reason`
    when it cannot start) and restored afterwards. Yields the device."""
    rt = zyx._RT
    try:
        rt.init(only=[name])
    except zyx.NoBackendAvailable as e:
        rt.init()
        pytest.skip(f"{reason}: {e}")
    dev = rt.device()
    assert dev.backend == name
    yield dev
    rt.init()


@pytest.fixture
def on_cpu():
    """For tests of the C backend itself (its compiler, cache, thread team, zero-copy host
    memory): the CPU is the default device while they run, whatever ZYX_DEVICE says."""
    rt = zyx._RT
    rt._ensure()
    if not any(n.type == "cpu" for n in rt.names()):
        pytest.skip("no C backend device")
    before = rt.default
    rt.set_default_device("cpu")
    try:
        yield
    finally:
        rt.default = before


@pytest.fixture
def kernel_counter():
    """Call it around an action: returns (kernels launched by the action, its result)."""
    def count(fn):
        before = zyx.stats()["kernels_launched"]
        out = fn()
        return zyx.stats()["kernels_launched"] - before, out
    return count


def torch_dtype(d):
    """The torch dtype of zyx dtype `d` (torch must be installed)."""
    import torch
    return {"bool": torch.bool, "uint8": torch.uint8, "uint16": torch.uint16,
            "uint32": torch.uint32, "uint64": torch.uint64, "int8": torch.int8,
            "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
            "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float64": torch.float64}[d.name]


def from_torch_dtype(td):
    return zdt.to_dtype(str(td).replace("torch.", ""))
