"""CUDA backend (through cuda-bindings: the driver API and NVRTC): one device per CUDA
device, each with its primary context, one stream and a caching memory pool. Kernels are
rendered by the shared C-family renderer with `cstyle.CUDADialect`, lowered to launches
by `gpu.lower`, compiled by NVRTC to a cubin for the device's own architecture (cached in
memory and on disk, see rtc.py) and launched with cuLaunchKernel. The pool, programs and
launch path are shared with HIP in gpudriver.py; this module is the cuda-bindings side.

Config (`"cuda"` section of config.json): enabled (default true), device_ids (list of
CUDA device ordinals to use, default all), cache_limit_mb (the freed blocks a device's
pool keeps for reuse, default a tenth of its memory; zyx.empty_cache releases them),
plan_launches (default true; ZYX_PLAN_LAUNCHES=0: each plan's launches prepared once,
gpudriver.DriverPlanLaunches), graphs (default true; ZYX_CUDA_GRAPHS=0: a plan that ran
before replays as one CUDA graph, graphs.GraphReplay).

Kernels are launched by calling the driver's cuLaunchKernel through ctypes with arguments
converted once per program (`CUDADriver.prepared_launch`): cuda-bindings' wrapper converts
and checks its 11 arguments on every call, several microseconds of a tiny realization's
host time. ZYX_CUDA_LAUNCH=bindings launches through cuda-bindings instead.
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

from ..errors import BackendError
from ..codegen.gpu.nvidia import products, tma
from ..codegen.target import DeviceInfo
from ..codegen.gpu.dispatch import GPU_SUM_BLOCK, register_tiles, tile_min_outputs
from ..codegen.cstyle import CUDADialect
from . import switch
from .gpudriver import DriverDevice, DriverMemoryPool, ResultTupleDriver, open_devices
from .rtc import NVRTC_NAMES, RuntimeCompiler

# FP32 lanes per SM by compute capability major (and minor where it differs): the compute
# estimate ranks devices, it need not be exact.
_CORES_PER_SM = {3: 192, 5: 128, 6: 64, 7: 64, 8: 64, 9: 128, 10: 128, 12: 128}
_CORES_PER_SM_MINOR = {(6, 1): 128, (6, 2): 128, (8, 6): 128, (8, 7): 128, (8, 9): 128}

NVRTC_OPTIONS = ("--std=c++17", "-default-device")


def import_bindings():
    """(driver, nvrtc) modules of cuda-bindings 12.x/13.x, or of the older cuda-python
    layout (`from cuda import cuda, nvrtc`)."""
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError:
        from cuda import cuda as driver, nvrtc
    return driver, nvrtc


def cores_per_sm(cc):
    return _CORES_PER_SM_MINOR.get(tuple(cc), _CORES_PER_SM.get(cc[0], 128))


def nvrtc_target(nvrtc, cc):
    """NVRTC's `--gpu-architecture` for a device of compute capability `cc`: a cubin for
    the newest architecture NVRTC knows with the same major and a minor not above the
    device's (cubins run on later minors of their major); PTX for the newest one below
    when NVRTC knows no such architecture (the driver then compiles it, which works only
    when the driver is at least as new as NVRTC)."""
    want = cc[0] * 10 + cc[1]
    try:
        err, archs = nvrtc.nvrtcGetSupportedArchs()
        archs = list(archs) if int(err) == 0 else [want]
    except AttributeError:      # NVRTC older than 11.2 cannot list them
        archs = [want]
    same_major = [a for a in archs if a // 10 == cc[0] and a <= want]
    if same_major:
        best = max(same_major)
        # sm_90a: Hopper's architecture-specific instructions (wgmma.py), in a cubin that
        # runs on compute capability 9.0 alone, which is this device's
        return "sm_90a" if best == want == 90 else f"sm_{best}"
    below = [a for a in archs if a <= want]
    if not below:
        raise BackendError(f"CUDA: NVRTC supports none of the architectures up to "
                           f"sm_{want} (it knows {archs})")
    return f"compute_{max(below)}"


def nvrtc_compiler(cc, debug=0, nvrtc=None):
    """A RuntimeCompiler making CUDA binaries for compute capability `cc` (no driver or
    GPU needed: the codegen tests use it directly)."""
    if nvrtc is None:
        nvrtc = import_bindings()[1]
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as e:      # libnvrtc missing: cuda.pathfinder raises its own errors
        raise BackendError(f"CUDA: NVRTC is not available ({type(e).__name__}: {e})") from None
    if int(err) != 0:
        raise BackendError(f"CUDA: nvrtcVersion failed ({err})")
    target = nvrtc_target(nvrtc, cc)
    options = (f"--gpu-architecture={target}",) + NVRTC_OPTIONS
    ext = "cubin" if target.startswith("sm_") else "ptx"
    comp = RuntimeCompiler(nvrtc, NVRTC_NAMES, "NVRTC", f"{major}.{minor}", target, options,
                           "cuda", ext, debug)
    if ext == "ptx":     # nvrtcGetCUBIN has nothing for a virtual architecture
        comp.fn["size"], comp.fn["get"] = nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX
    return comp


def driver_library():
    """The CUDA driver library as a ctypes CDLL (cuda-bindings loaded it at cuInit, so this
    is the same library), or None where it cannot be opened."""
    try:
        return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return None


def direct_launch(lib):
    """`lib`'s cuLaunchKernel for calls whose 11 arguments are ctypes objects already
    (no argtypes: ctypes then passes them without converting anything), returning the
    CUresult as an int; None when `lib` has no such function or launching through
    cuda-bindings was asked for (ZYX_CUDA_LAUNCH=bindings)."""
    if lib is None or os.environ.get("ZYX_CUDA_LAUNCH", "").lower() == "bindings":
        return None
    try:
        fn = lib.cuLaunchKernel
    except AttributeError:
        return None
    fn.argtypes = None
    fn.restype = ctypes.c_int
    return fn


def launch_arguments(fn, groups, local_size, stream, params, shared=0):
    """cuLaunchKernel's arguments as ctypes objects: function, grid (groups, 1, 1), block
    (local_size, 1, 1), `shared` bytes of dynamic shared memory, stream, kernelParams, no
    extra."""
    u = ctypes.c_uint
    return (ctypes.c_void_p(int(fn)), u(groups), u(1), u(1), u(local_size), u(1), u(1),
            u(shared),
            ctypes.c_void_p(int(stream)), ctypes.c_void_p(int(params)), None)


def tensor_map_encoder(lib):
    """`lib`'s cuTensorMapEncodeTiled as a function (out address, tma.TensorMap, buffer
    address) -> CUresult as an int, or None where the driver has none (before CUDA
    12)."""
    try:
        fn = lib.cuTensorMapEncodeTiled
    except AttributeError:
        return None
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p,
                   ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u32),
                   ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int]

    def encode(out, spec, address):
        rank = len(spec.dims)
        return fn(out, tma.DATA_TYPES[spec.dtype], rank, address + spec.offset,
                  (u64 * rank)(*spec.dims),
                  (u64 * max(rank - 1, 1))(*spec.strides), (u32 * rank)(*spec.box),
                  (u32 * rank)(*([1] * rank)), 0, tma.SWIZZLE_128B, tma.L2_PROMOTION_256B,
                  0)
    return encode


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS (v1: the layout of the unversioned exported symbols
    cuGraphAddKernelNode and cuGraphExecKernelNodeSetParams)."""
    _fields_ = [("func", ctypes.c_void_p),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p),
                ("extra", ctypes.c_void_p)]


class CUDAGraphs:
    """The graph calls graphs.GraphReplay makes, on the driver library through ctypes
    (arguments typed once; the replay and the node rewrites are on every run's path).
    A graph is built node by node (cuGraphAddKernelNode, each after the one before), not
    captured from the stream: the plan's launches are kernels alone (no allocation, copy
    or host read can land in it), and the nodes' handles are what rewriting their
    parameters needs."""
    CALLS = {
        "cuGraphCreate": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
        "cuGraphAddKernelNode": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                 ctypes.POINTER(KernelNodeParams)],
        "cuGraphInstantiateWithFlags": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                        ctypes.c_ulonglong],
        "cuGraphExecKernelNodeSetParams": [ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.POINTER(KernelNodeParams)],
        "cuGraphLaunch": [ctypes.c_void_p, ctypes.c_void_p],
        "cuGraphExecDestroy": [ctypes.c_void_p],
        "cuGraphDestroy": [ctypes.c_void_p],
    }

    def __init__(self, lib, stream, check):
        self.fn = {}
        for name, argtypes in self.CALLS.items():
            f = getattr(lib, name)        # AttributeError: a driver older than CUDA 11.4
            f.argtypes = argtypes
            f.restype = ctypes.c_int
            self.fn[name] = f
        self.stream = ctypes.c_void_p(int(stream))
        self._check = check               # (CUresult as int, call name) -> raise

    def _call(self, name, *args):
        err = self.fn[name](*args)
        if err:
            self._check(err, name)

    def node_params(self, fn, groups, local_size, shared, params_address):
        p = KernelNodeParams(int(fn), groups, 1, 1, local_size, 1, 1, shared,
                             params_address, None)
        return ctypes.pointer(p)

    def build(self, node_params):
        graph = ctypes.c_void_p()
        self._call("cuGraphCreate", ctypes.byref(graph), 0)
        nodes = []
        try:
            for p in node_params:
                node = ctypes.c_void_p()
                if nodes:
                    self._call("cuGraphAddKernelNode", ctypes.byref(node), graph,
                               ctypes.byref(nodes[-1]), 1, p)
                else:
                    self._call("cuGraphAddKernelNode", ctypes.byref(node), graph, None, 0, p)
                nodes.append(node)
        except BaseException:
            self.fn["cuGraphDestroy"](graph)
            raise
        return graph, nodes

    def instantiate(self, graph):
        exe = ctypes.c_void_p()
        self._call("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, 0)
        return exe

    def set_params(self, exe, node, params):
        self._call("cuGraphExecKernelNodeSetParams", exe, node, params)

    def launch(self, exe):
        err = self.fn["cuGraphLaunch"](exe, self.stream)
        if err:
            self._check(err, "cuGraphLaunch")

    def destroy(self, graph, exe):
        if exe is not None:
            self._call("cuGraphExecDestroy", exe)
        if graph is not None:
            self._call("cuGraphDestroy", graph)


class CUDADriver(ResultTupleDriver):
    """The gpudriver protocol for one CUDA device through cuda-bindings: its primary
    context and one non-blocking stream (no implicit synchronization with the legacy
    default stream other libraries may use)."""

    PREFIX = "cu"
    CALLS = {"alloc": "cuMemAlloc", "free": "cuMemFree", "host_free": "cuMemFreeHost"}

    def __init__(self, drv, ordinal, graphs=True):
        self.drv = self.api = drv
        self.ordinal = ordinal
        self.label = "CUDA"
        self.SUCCESS = drv.CUresult.CUDA_SUCCESS
        self._error_name = drv.cuGetErrorName
        self.OOM = drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        self.dev = self.check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ctx = self.check(drv.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        self.make_current()
        self.stream = self.check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING),
                                 "cuStreamCreate")
        self._side = None        # side_stream(), made when first asked for
        self._launch = drv.cuLaunchKernel
        lib = driver_library()
        self._direct = direct_launch(lib)
        self._encode = tensor_map_encoder(lib) if lib is not None else None
        self._no_timing = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        # plans replay as CUDA graphs (gpudriver.DriverPlanLaunches) unless switched off
        # (config "graphs": false, ZYX_CUDA_GRAPHS=0) or the driver cannot call them
        self.graph_api = None
        if graphs and lib is not None:
            try:
                self.graph_api = CUDAGraphs(lib, self.stream, self._raise)
            except AttributeError:
                pass

    def _raise(self, err, what):
        self.check((self.drv.CUresult(err),), what)

    def attribute(self, name, default=None):
        """A device attribute by its CU_DEVICE_ATTRIBUTE_ suffix; `default` when this
        version of the bindings or the driver does not have it."""
        attr = getattr(self.drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name, None)
        if attr is None:
            return default
        err, value = self.drv.cuDeviceGetAttribute(attr, self.dev)
        return value if int(err) == 0 else default

    def name(self):
        raw = self.check(self.drv.cuDeviceGetName(256, self.dev), "cuDeviceGetName")
        return raw.split(b"\x00", 1)[0].decode(errors="replace").strip()

    def make_current(self):
        self.check(self.drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def uuid(self):
        """The GPU's UUID as 32 hex digits (DeviceInfo.hardware: the key Vulkan's
        deviceUUID also gives for it), None where the bindings or driver do not say."""
        for name in ("cuDeviceGetUuid_v2", "cuDeviceGetUuid"):
            fn = getattr(self.drv, name, None)
            if fn is None:
                continue
            try:
                err, u = fn(self.dev)
            except Exception:       # a binding whose signature differs: no key
                continue
            raw = getattr(u, "bytes", None)
            if int(err) != 0 or raw is None:
                continue
            if isinstance(raw, str):
                raw = raw.encode("latin-1")
            return bytes(raw)[:16].hex()
        return None

    def host_alloc(self, nbytes):
        return int(self.check(self.drv.cuMemHostAlloc(nbytes, 0), f"cuMemHostAlloc({nbytes})"))

    def side_stream(self):
        """A second non-blocking stream of this device, made once, for work that runs
        beside the kernels of `stream` (NCCL's collectives), ordered against them only by
        events (event_record / stream_wait_event)."""
        side = self._side
        if side is None:
            self.make_current()
            side = self._side = self.check(
                self.drv.cuStreamCreate(self.drv.CUstream_flags.CU_STREAM_NON_BLOCKING),
                "cuStreamCreate")
        return side

    def event_create(self):
        return self.check(self.drv.cuEventCreate(self._no_timing), "cuEventCreate")

    def module_load(self, image):
        buf = np.frombuffer(image, np.uint8)
        if not image.endswith(b"\x00") and not image.startswith(b"\x7fELF"):
            buf = np.frombuffer(image + b"\x00", np.uint8)   # PTX text must end in NUL
        return self.check(self.drv.cuModuleLoadData(buf.ctypes.data), "cuModuleLoadData")

    def launch(self, fn, groups, local_size, params, shared=0):
        err, = self._launch(fn, groups, 1, 1, local_size, 1, 1, shared, self.stream, params, 0)
        if err is not self.SUCCESS:
            self.check((err,), "cuLaunchKernel")

    def allow_shared(self, fn, nbytes):
        """Let `fn` use `nbytes` of dynamic shared memory (above 48 KiB a function must
        ask: wgmma's stages); returns `nbytes`."""
        attr = self.drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.check(self.drv.cuFuncSetAttribute(fn, attr, nbytes), "cuFuncSetAttribute")
        return nbytes

    @property
    def can_encode_tensor_maps(self):
        return self._encode is not None

    def encode_tensor_map(self, out, spec, address):
        """Write the tensor map `spec` (tma.TensorMap) of the buffer at `address` into
        the 128 bytes at `out`."""
        if self._encode is None:
            raise BackendError("CUDA: this driver has no cuTensorMapEncodeTiled "
                               "(tensor maps need CUDA 12)")
        err = self._encode(out, spec, address)
        if err:
            self.check((self.drv.CUresult(err),), f"cuTensorMapEncodeTiled({spec})")

    def prepared_launch(self, fn, groups, local_size, params, shared=0):
        """A no-argument callable making this launch (gpudriver._PreparedLaunch): the
        driver's cuLaunchKernel through ctypes with the arguments made once, or
        cuda-bindings' when the driver library cannot be called directly."""
        direct = self._direct
        if direct is None:
            return lambda: self.launch(fn, groups, local_size, params, shared)
        args = launch_arguments(fn, groups, local_size, self.stream, params, shared)

        def call():
            err = direct(*args)
            if err:
                self.check((self.drv.CUresult(err),), "cuLaunchKernel")
        return call


class CUDAMemoryPool(DriverMemoryPool):
    """Device memory of one CUDA device (see gpudriver.DriverMemoryPool)."""

    def __init__(self, driver, cache_limit=None):
        super().__init__(driver, "cuda", cache_limit)


class CUDADevice(DriverDevice):
    backend = "cuda"

    def __init__(self, driver, pool, debug=0):
        self.cc = (driver.attribute("COMPUTE_CAPABILITY_MAJOR", 0),
                   driver.attribute("COMPUTE_CAPABILITY_MINOR", 0))
        super().__init__(driver, pool, CUDADialect(), nvrtc_compiler(self.cc, debug), debug)

    def _make_info(self):
        d = self.driver
        sms = d.attribute("MULTIPROCESSOR_COUNT", 1)
        # kHz; CUDA 13 dropped clockRate from cudaDeviceProp, so the attribute may go too
        clock_khz = d.attribute("CLOCK_RATE", 0) or 1_500_000
        return DeviceInfo(
            # kernels with many outputs get the CPU's matmul tiles (not window tiles)
            register_tiles=register_tiles(), window_tiles=False,
            tile_min_outputs=tile_min_outputs(sms),
            sum_block=GPU_SUM_BLOCK,
            name=f"CUDA {d.name()}",
            hardware=d.uuid(),
            compute=float(sms * clock_khz * 1e3 * cores_per_sm(self.cc) * 2),
            max_global_work_dims=(d.attribute("MAX_GRID_DIM_X", 2**31 - 1),
                                  d.attribute("MAX_GRID_DIM_Y", 65535),
                                  d.attribute("MAX_GRID_DIM_Z", 65535)),
            max_local_threads=d.attribute("MAX_THREADS_PER_BLOCK", 1024),
            max_local_work_dims=(d.attribute("MAX_BLOCK_DIM_X", 1024),
                                 d.attribute("MAX_BLOCK_DIM_Y", 1024),
                                 d.attribute("MAX_BLOCK_DIM_Z", 64)),
            local_mem_size=d.attribute("MAX_SHARED_MEMORY_PER_BLOCK", 48 << 10),
            warp_size=d.attribute("WARP_SIZE", 32),
            num_cores=sms,
            tensor_cores=self.cc[0] >= 7,
            product_lowerings=(products.lower_product,),
            k_major_windows=products.k_major_windows,
            extra={"cc": self.cc, "arch": self.compiler.target,
                   # the most shared memory a function may ask for (wgmma's stages)
                   "smem_optin": d.attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", 0),
                   # tensor maps (tma.py): the driver can encode them
                   "tma": d.can_encode_tensor_maps})



def initialize(cfg, debug=0):
    try:
        drv, _ = import_bindings()
    except Exception as e:       # ImportError, or a broken install raising anything else
        raise BackendError(f"CUDA: cuda-bindings is not importable ({type(e).__name__}: {e})") \
            from None
    try:
        err, = drv.cuInit(0)
    except Exception as e:       # no driver: cuda.pathfinder raises DynamicLibNotFoundError
        raise BackendError(f"CUDA: no NVIDIA driver ({type(e).__name__}: {e})") from None
    if int(err) != 0:
        raise BackendError(f"CUDA: cuInit failed ({err})")
    err, count = drv.cuDeviceGetCount()
    if int(err) != 0:
        raise BackendError(f"CUDA: cuDeviceGetCount failed ({err})")
    graphs = switch(cfg, "graphs", "ZYX_CUDA_GRAPHS")
    return open_devices(cfg, count, "CUDA", lambda ordinal: CUDADriver(drv, ordinal, graphs),
                        CUDAMemoryPool, CUDADevice, debug)
