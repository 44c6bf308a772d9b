"""The HIP backend, on a machine without an AMD GPU (there is none here).

What can be checked without ROCm, and is:
- HIPDialect's sources are CUDADialect's except for the prelude, byte for byte: the frame
  and body NVRTC compiles in test_cuda.py are the ones hiprtc would get; where a group
  combines through warp shuffles, HIP's maskless `__shfl_xor` over its 64-lane
  wavefronts is the only other difference;
- the HIP prelude (clang's _Float16 and __builtin_bit_cast) compiled by the host's C++
  compiler, which has both, through a header that maps the few device-only names
  (`__device__`, `__forceinline__`, `__uint_as_float`...) to host C++: its f16/bf16
  conversions against numpy over every f16 bit pattern and many floats, zyx_ipow against
  Python's integers;
- the hiprtc call sequence of rtc.RuntimeCompiler against a recording stand-in with
  hip-python's signatures, and `initialize` turning a missing ROCm into BackendError.
Launches need an AMD GPU: the numerical cases skip with the reason where `initialize`
fails, and run on the HIP device (only=["hip"]) where it does not.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

import zyx
from zyx.codegen.cstyle import CUDA_PRELUDE, HIP_PRELUDE, CUDADialect, HIPDialect
from zyx.codegen.gpu.dispatch import lower
from zyx.errors import BackendError, NoBackendAvailable

from gpu_cases import *  # noqa: F401,F403  (numerical cases, run on the HIP device)
from gpu_cases import GRAPHS, kernels_of


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_hip_source_is_the_cuda_source_but_the_prelude(name):
    made = GRAPHS[name]()
    for t in (made if isinstance(made, tuple) else (made,)):
        for k in kernels_of(t):
            hip_src = lower(k, HIPDialect(), None).source
            cuda_src = lower(k, CUDADialect(), None).source
            assert hip_src.startswith(HIP_PRELUDE)
            assert hip_src[len(HIP_PRELUDE):] == cuda_src[len(CUDA_PRELUDE):]
            assert 'extern "C" __global__ void zyx_k(' in hip_src


def test_hip_warp_combines_use_maskless_shuffles_over_64_lanes():
    from zyx.codegen.target import DeviceInfo
    mi300 = DeviceInfo(name="MI300X", max_local_threads=1024, warp_size=64, num_cores=304,
                       register_tiles=False)
    x = zyx.Tensor(np.random.default_rng(0).standard_normal((64, 4096)).astype(np.float32))
    (k,) = kernels_of(x.softmax(-1))
    hip_src = lower(k, HIPDialect(), mi300).source
    cuda_src = lower(k, CUDADialect(), mi300).source
    assert "__shfl_xor(acc" in hip_src and "__shfl_xor_sync" not in hip_src
    assert "for (int zyx_o = 32; zyx_o > 0" in hip_src        # a 64-lane butterfly
    assert "zyx_lid & 63" in hip_src and "zyx_lid & 3" in hip_src   # 256 = 4 wavefronts
    assert hip_src[len(HIP_PRELUDE):] == cuda_src[len(CUDA_PRELUDE):].replace(
        "__shfl_xor_sync(0xffffffffu, ", "__shfl_xor(")


def test_hip_prelude_has_no_ptx_and_no_headers():
    assert "asm(" not in HIP_PRELUDE and "#include" not in HIP_PRELUDE
    assert "_Float16" in HIP_PRELUDE and "__builtin_bit_cast" in HIP_PRELUDE


# Host spellings of the device-only names the HIP prelude uses (HIP defines them all).
HOST_SHIM = r"""
#include <cstring>
#define __device__
#define __forceinline__ inline
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
"""

EXPORTS = r"""
extern "C" {
void h2f(const unsigned short* x, float* y, long n) { for (long i = 0; i < n; i++) y[i] = zyx_h2f(x[i]); }
void f2h(const float* x, unsigned short* y, long n) { for (long i = 0; i < n; i++) y[i] = zyx_f2h(x[i]); }
void bf2f(const unsigned short* x, float* y, long n) { for (long i = 0; i < n; i++) y[i] = zyx_bf2f(x[i]); }
void f2bf(const float* x, unsigned short* y, long n) { for (long i = 0; i < n; i++) y[i] = zyx_f2bf(x[i]); }
long long ipow(long long b, long long e) { return zyx_ipow(b, e); }
float nan_value() { return NAN; }
float inf_value() { return INFINITY; }
}
"""


@pytest.fixture(scope="module")
def hip_prelude_on_host(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++ or clang++)")
    d = tmp_path_factory.mktemp("hip_prelude")
    src, lib = d / "prelude.cpp", d / "prelude.so"
    src.write_text(HOST_SHIM + HIP_PRELUDE + EXPORTS)
    proc = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", str(src), "-o", str(lib)],
                          capture_output=True, text=True)
    if proc.returncode != 0 and ("_Float16" in proc.stderr and "not supported" in proc.stderr
                                 or "__builtin_bit_cast" in proc.stderr):
        pytest.skip(f"{cxx} lacks _Float16 or __builtin_bit_cast for C++")
    assert proc.returncode == 0, proc.stderr
    so = ctypes.CDLL(str(lib))
    so.ipow.restype = ctypes.c_longlong
    so.ipow.argtypes = [ctypes.c_longlong, ctypes.c_longlong]
    so.nan_value.restype = so.inf_value.restype = ctypes.c_float
    return so


def _call(so, fn, x, out_dtype):
    y = np.empty(x.shape, out_dtype)
    getattr(so, fn)(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data),
                    ctypes.c_long(x.size))
    return y


def test_hip_half_conversions_match_numpy(hip_prelude_on_host):
    so = hip_prelude_on_host
    every = np.arange(1 << 16, dtype=np.uint16)
    got = _call(so, "h2f", every, np.float32)
    ref = every.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, ref)      # NaNs compare equal to NaNs here
    floats = np.concatenate([np.random.randn(20000).astype(np.float32) * 10.0 ** np.random.randint(-8, 6, 20000),
                             np.array([0.0, -0.0, 65504, 65520, 70000, 6e-8, 3e-8, 2049, 2051,
                                       np.inf, -np.inf], np.float32)]).astype(np.float32)
    with np.errstate(over="ignore"):
        ref16 = floats.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(_call(so, "f2h", floats, np.uint16), ref16)


def test_hip_bfloat16_conversions_match_the_c_backend(hip_prelude_on_host):
    so = hip_prelude_on_host
    every = np.arange(1 << 16, dtype=np.uint16)
    np.testing.assert_array_equal(_call(so, "bf2f", every, np.float32).view(np.uint32),
                                  every.astype(np.uint32) << 16)
    x = np.random.randn(50000).astype(np.float32)
    u = x.view(np.uint32)
    ref = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)   # round to nearest even
    np.testing.assert_array_equal(_call(so, "f2bf", x, np.uint16), ref)
    nan = np.array([np.nan], np.float32)
    assert np.isnan(_call(so, "bf2f", _call(so, "f2bf", nan, np.uint16), np.float32))[0]


def test_hip_ipow_and_special_values(hip_prelude_on_host):
    so = hip_prelude_on_host
    for b in range(-5, 6):
        for e in range(0, 12):
            ref = b ** e
            ref = (ref + (1 << 63)) % (1 << 64) - (1 << 63)    # wraps like int64
            assert so.ipow(b, e) == ref, (b, e)
    assert so.ipow(1, -3) == 1 and so.ipow(-1, -3) == -1 and so.ipow(2, -1) == 0
    assert np.isnan(so.nan_value()) and so.inf_value() == np.inf


# -- hiprtc call sequence ------------------------------------------------------------------

class RecordingHipRTC:
    """hiprtc's calls with hip-python's signatures; compiles nothing, records the calls."""

    def __init__(self, fail=False):
        self.calls = []
        self.fail = fail

    def hiprtcVersion(self):
        return 0, 6, 2

    def hiprtcCreateProgram(self, src, name, n, headers, names):
        self.calls.append(("create", src, name, n))
        return 0, "prog"

    def hiprtcCompileProgram(self, prog, n, options):
        self.calls.append(("compile", prog, n, list(options)))
        return (6,) if self.fail else (0,)

    def hiprtcGetProgramLogSize(self, prog):
        return 0, 12

    def hiprtcGetProgramLog(self, prog, buf):
        buf[:12] = b"error: oops\x00"
        return (0,)

    def hiprtcGetCodeSize(self, prog):
        return 0, 8

    def hiprtcGetCode(self, prog, buf):
        buf[:] = b"\x7fELFcode"
        return (0,)

    def hiprtcDestroyProgram(self, prog):
        self.calls.append(("destroy", prog))
        return (0,)

    def hiprtcGetErrorString(self, err):
        return 0, b"HIPRTC_ERROR_COMPILATION"


def test_hiprtc_compiler_targets_the_devices_arch(tmp_path):
    from zyx.backends.binary_cache import BinaryCache
    from zyx.backends.hip import hiprtc_compiler
    rtc = RecordingHipRTC()
    comp = hiprtc_compiler("gfx90a:sramecc+:xnack-", hiprtc=rtc)
    comp.disk = BinaryCache("hip", "hsaco", str(tmp_path))
    assert comp.binary("src") == b"\x7fELFcode"
    assert rtc.calls[1] == ("compile", "prog", 3,
                            [b"--offload-arch=gfx90a:sramecc+:xnack-", b"-std=c++17", b"-O3"])
    assert rtc.calls[-1] == ("destroy", "prog")
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".hsaco", ".sha256"]


def test_hiprtc_failure_shows_the_log():
    from zyx.backends.hip import hiprtc_compiler
    comp = hiprtc_compiler("gfx1100", hiprtc=RecordingHipRTC(fail=True))
    with pytest.raises(BackendError, match="hiprtc failed to compile for gfx1100") as e:
        comp.compile("int x;")
    assert "error: oops" in str(e.value) and "HIPRTC_ERROR_COMPILATION" in str(e.value)


def test_lanes_per_compute_unit():
    from zyx.backends.hip import lanes_per_cu
    assert lanes_per_cu("gfx90a") == 64 and lanes_per_cu("gfx1100") == 128
    assert lanes_per_cu("gfx942") == 64 and lanes_per_cu("gfx1201") == 128


def test_initialize_without_rocm_raises_backend_error():
    from zyx.backends import hip
    try:
        pools, devices = hip.initialize({})
    except BackendError as e:
        assert str(e).startswith("HIP: ")
        return
    assert devices and all(d.info().name.startswith("HIP ") for d in devices)


# -- on an AMD GPU -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hip_runtime():
    from zyx.backends import hip
    try:
        hip.initialize({})
    except BackendError as e:
        pytest.skip(f"no AMD GPU: {e}")
    rt = zyx._RT
    try:
        rt.init(only=["hip"])
    except NoBackendAvailable as e:
        rt.init()
        pytest.skip(f"no HIP device: {e}")
    assert rt.device().backend == "hip"
    yield rt.device()
    rt.init()


@pytest.fixture(autouse=True)
def _numerical_cases_run_on_hip(request):
    if request.function.__module__ == "gpu_cases":
        request.getfixturevalue("hip_runtime")
