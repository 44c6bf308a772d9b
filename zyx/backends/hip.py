"""HIP backend (AMD GPUs, through hip-python: `from hip import hip, hiprtc`): the CUDA
backend's structure with HIP's calls. Kernels are rendered with `cstyle.HIPDialect`,
compiled by hiprtc into a code object for the device's gcnArchName (`--offload-arch`),
loaded with hipModuleLoadData and launched with hipModuleLaunchKernel. Pool, programs and
launch path are gpudriver.py's, shared with CUDA; the compiler driver is rtc.py's.

hip-python imports without ROCm, but its first call dlopens libamdhip64.so and raises
RuntimeError where ROCm is missing: `initialize` turns that into BackendError.

Config (`"hip"` section of config.json): enabled (default true), device_ids (list of HIP
device ordinals to use, default all), cache_limit_mb (as CUDA's: the freed blocks a pool
keeps, default a tenth of the device's memory).
"""
from __future__ import annotations

import numpy as np

from ..errors import BackendError
from ..codegen.target import DeviceInfo
from ..codegen.gpu.dispatch import GPU_SUM_BLOCK, register_tiles, tile_min_outputs
from ..codegen.cstyle import HIPDialect
from .gpudriver import DriverDevice, DriverMemoryPool, ResultTupleDriver, open_devices
from .rtc import HIPRTC_NAMES, RuntimeCompiler

HIPRTC_OPTIONS = ("-std=c++17", "-O3")

# FP32 lanes per compute unit: 64 on GCN/CDNA, 128 on RDNA (dual-issue); a ranking
# estimate only.
_LANES_PER_CU = {"gfx9": 64, "gfx10": 128, "gfx11": 128, "gfx12": 128}


def import_bindings():
    """(hip, hiprtc) modules of hip-python."""
    from hip import hip, hiprtc
    return hip, hiprtc


def hiprtc_compiler(arch, debug=0, hiprtc=None):
    """A RuntimeCompiler making HIP code objects for `arch` (a gcnArchName such as
    "gfx90a:sramecc+:xnack-"; its features select the code object variant)."""
    if hiprtc is None:
        hiprtc = import_bindings()[1]
    try:
        err, major, minor = hiprtc.hiprtcVersion()
    except Exception as e:      # libhiprtc missing
        raise BackendError(f"HIP: hiprtc is not available ({type(e).__name__}: {e})") from None
    if int(err) != 0:
        raise BackendError(f"HIP: hiprtcVersion failed ({err})")
    options = (f"--offload-arch={arch}",) + HIPRTC_OPTIONS
    return RuntimeCompiler(hiprtc, HIPRTC_NAMES, "hiprtc", f"{major}.{minor}", arch, options,
                           "hip", "hsaco", debug)


def lanes_per_cu(arch):
    for prefix in sorted(_LANES_PER_CU, key=len, reverse=True):
        if arch.startswith(prefix):
            return _LANES_PER_CU[prefix]
    return 64


class HIPDriver(ResultTupleDriver):
    """The gpudriver protocol for one HIP device through hip-python: HIP's current device
    (hipSetDevice) and one non-blocking stream."""

    PREFIX = "hip"
    CALLS = {"alloc": "hipMalloc", "free": "hipFree", "host_free": "hipHostFree"}

    def __init__(self, hip, ordinal):
        self.hip = self.api = hip
        self.ordinal = ordinal
        self.label = "HIP"
        self.SUCCESS = hip.hipError_t.hipSuccess
        self.OOM = hip.hipError_t.hipErrorOutOfMemory
        self._error_name = hip.hipGetErrorName
        self.make_current()
        self.props = self.check(hip.hipGetDeviceProperties(ordinal), "hipGetDeviceProperties")
        self.stream = self.check(hip.hipStreamCreateWithFlags(hip.hipStreamNonBlocking),
                                 "hipStreamCreateWithFlags")
        self._launch = hip.hipModuleLaunchKernel

    def arch(self):
        raw = self.props.gcnArchName
        raw = raw if isinstance(raw, bytes) else bytes(raw)
        return raw.split(b"\x00", 1)[0].decode().strip()

    def name(self):
        raw = self.props.name
        raw = raw if isinstance(raw, bytes) else bytes(raw)
        return raw.split(b"\x00", 1)[0].decode(errors="replace").strip()

    def attribute(self, name, default=None):
        """A device attribute by its hipDeviceAttribute suffix (e.g. "WarpSize")."""
        attr = getattr(self.hip.hipDeviceAttribute_t, "hipDeviceAttribute" + name, None)
        if attr is None:
            return default
        err, value = self.hip.hipDeviceGetAttribute(attr, self.ordinal)
        return value if int(err) == 0 else default

    def make_current(self):
        self.check(self.hip.hipSetDevice(self.ordinal), "hipSetDevice")

    def host_alloc(self, nbytes):
        ptr = self.check(self.hip.hipHostMalloc(nbytes, self.hip.hipHostMallocDefault),
                         f"hipHostMalloc({nbytes})")
        return int(ptr)

    def event_create(self):
        return self.check(self.hip.hipEventCreateWithFlags(self.hip.hipEventDisableTiming),
                          "hipEventCreateWithFlags")

    def module_load(self, image):
        buf = np.frombuffer(image, np.uint8)
        return self.check(self.hip.hipModuleLoadData(buf.ctypes.data), "hipModuleLoadData")

    def launch(self, fn, groups, local_size, params):
        err, = self._launch(fn, groups, 1, 1, local_size, 1, 1, 0, self.stream, params, None)
        if err is not self.SUCCESS:
            self.check((err,), "hipModuleLaunchKernel")


class HIPMemoryPool(DriverMemoryPool):
    """Device memory of one HIP device (see gpudriver.DriverMemoryPool)."""

    def __init__(self, driver, cache_limit=None):
        super().__init__(driver, "hip", cache_limit)


class HIPDevice(DriverDevice):
    backend = "hip"

    def __init__(self, driver, pool, debug=0):
        self.arch = driver.arch()
        super().__init__(driver, pool, HIPDialect(), hiprtc_compiler(self.arch, debug), debug)

    def _make_info(self):
        d = self.driver
        cus = d.attribute("MultiprocessorCount", 1)
        clock_khz = d.attribute("ClockRate", 0) or 1_500_000
        base = self.arch.split(":", 1)[0]
        return DeviceInfo(
            # kernels with many outputs get the CPU's matmul tiles (not window tiles)
            register_tiles=register_tiles(), window_tiles=False,
            tile_min_outputs=tile_min_outputs(cus),
            sum_block=GPU_SUM_BLOCK,
            name=f"HIP {d.name()} ({base})",
            compute=float(cus * clock_khz * 1e3 * lanes_per_cu(base) * 2),
            max_local_threads=d.attribute("MaxThreadsPerBlock", 1024),
            max_local_work_dims=(d.attribute("MaxBlockDimX", 1024),
                                 d.attribute("MaxBlockDimY", 1024),
                                 d.attribute("MaxBlockDimZ", 1024)),
            local_mem_size=d.attribute("MaxSharedMemoryPerBlock", 64 << 10),
            warp_size=d.attribute("WarpSize", 64),
            num_cores=cus,
            # matrix cores: CDNA (gfx908, gfx90a, gfx94x, gfx95x) and RDNA3+ WMMA
            tensor_cores=base.startswith(("gfx908", "gfx90a", "gfx94", "gfx95", "gfx11",
                                          "gfx12")),
            extra={"arch": self.arch})



def initialize(cfg, debug=0):
    try:
        hip, _ = import_bindings()
    except Exception as e:
        raise BackendError(f"HIP: hip-python is not importable ({type(e).__name__}: {e})") \
            from None
    try:
        err, = hip.hipInit(0)
    except Exception as e:     # no ROCm: hip-python raises RuntimeError from its dlopen
        raise BackendError(f"HIP: no ROCm runtime ({type(e).__name__}: {e})") from None
    if int(err) != 0:
        raise BackendError(f"HIP: hipInit failed ({err})")
    err, count = hip.hipGetDeviceCount()
    if int(err) != 0:
        raise BackendError(f"HIP: hipGetDeviceCount failed ({err})")
    return open_devices(cfg, count, "HIP", lambda ordinal: HIPDriver(hip, ordinal),
                        HIPMemoryPool, HIPDevice, debug)
