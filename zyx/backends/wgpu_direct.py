"""Calls into wgpu-native that wgpu-py (0.32) does not offer, or offers at a cost zyx
cannot pay per kernel. wgpu-py binds every wgpu-native function in its cffi library; this
module fills the same structures its methods fill and uses its objects' native handles. Where
this wgpu-py is not the one these calls know (`available` false), the backend uses wgpu-py's
own methods.

Shader modules with chosen run-time checks (config `wgpu.shader_checks`): wgpu's standard
`create_shader_module` makes naga add index clamping to array accesses and a 64-bit counter to
every loop that breaks it after 2^64 trips ("force loop bounding", so a driver may not assume
a loop ends). Both guard against untrusted shaders in a browser. zyx writes its own shaders,
whose loops have constant trip counts and whose accesses stay inside their buffers (the tests
check both against numpy). The counter costs a compare and two adds per trip and keeps
NVIDIA's compiler from unrolling: on an H200 a sum of 256M float32 took 0.56 ms with it and
0.30 ms without. `wgpuDeviceCreateShaderModuleTrusted(device, descriptor, checks)` builds a
module with the checks asked for.

Dispatches (`Recorder`): wgpu-py's compute pass methods go through a wrapper that captures
errors per call (a lock, a stack of handlers) and `set_bind_group` allocates a C array per
call, three such calls per dispatch. The recorder calls the three functions of a dispatch
directly. A recording error still surfaces: wgpu-native keeps a
pass's first error and reports it when the pass ends, which goes through wgpu-py's wrapper.
"""
from __future__ import annotations

from ..errors import BackendError

# wgpu-native's WGPUShaderRuntimeChecks bits, by the names the config uses
CHECK_BITS = {"bounds": 0x1, "loops": 0x2}


def parse_checks(value):
    """The runtime-check bits for config value `value`: None or "standard" (wgpu's own
    path, every check), "none", or a list / comma-separated string of CHECK_BITS names.
    Returns None for the standard path, else an int."""
    if value is None or value == "standard":
        return None
    if value == "none":
        return 0
    names = value.split(",") if isinstance(value, str) else list(value)
    bits = 0
    for name in (str(n).strip() for n in names):
        if name not in CHECK_BITS:
            raise BackendError(f"wgpu.shader_checks: unknown check {name!r}; expected "
                               f"'standard', 'none' or names among {sorted(CHECK_BITS)}")
        bits |= CHECK_BITS[name]
    return bits


def _native():
    """wgpu-py's wgpu-native module and cffi library, or None when they are not the ones
    this module knows how to call."""
    try:
        from wgpu.backends.wgpu_native import _api
        from wgpu.backends.wgpu_native._ffi import ffi, lib
    except ImportError:
        return None
    needed = ("new_struct_p", "to_c_string_view", "libf", "GPUShaderModule")
    if not all(hasattr(_api, n) for n in needed) \
            or not hasattr(lib, "wgpuDeviceCreateShaderModuleTrusted"):
        return None
    return _api, ffi, lib


def available(device):
    """Whether shader modules with chosen checks can be built on wgpu-py device `device`."""
    native = _native()
    return native is not None and type(device) is getattr(native[0], "GPUDevice", None)


class Recorder:
    """Records dispatches into wgpu-py compute passes by direct wgpu-native calls. The
    objects whose handles it is given (`handle`) must stay alive while recorded commands
    may use them (zyx's caches keep pipelines and bind groups)."""

    def __init__(self):
        native = _native()
        if native is None:
            raise BackendError("wgpu: this wgpu-py has no wgpu-native library zyx can call")
        _, ffi, lib = native
        self._null = ffi.NULL
        self._set_pipeline = lib.wgpuComputePassEncoderSetPipeline
        self._set_group = lib.wgpuComputePassEncoderSetBindGroup
        self._dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups

    @staticmethod
    def handle(obj):
        """The native handle of a wgpu-py object (pass, pipeline, bind group)."""
        return obj._internal

    def dispatch(self, cpass, pipeline, group, gx, gy):
        """Record one dispatch of `pipeline` with bind group `group` at index 0 over gx x
        gy workgroups into pass `cpass` (native handles all three)."""
        self._set_pipeline(cpass, pipeline)
        self._set_group(cpass, 0, group, 0, self._null)
        self._dispatch(cpass, gx, gy, 1)


def shader_module(device, source, checks):
    """A wgpu-py GPUShaderModule of WGSL `source` on `device` with runtime-check bits
    `checks`, or None when this wgpu-py cannot build one (the caller falls back to
    `device.create_shader_module`). A WGSL error raises as wgpu-py's own call raises it."""
    native = _native()
    if native is None or not available(device):
        return None
    api, ffi, lib = native
    wgsl = api.new_struct_p("WGPUShaderSourceWGSL *", code=api.to_c_string_view(source))
    wgsl[0].chain.next = ffi.NULL
    wgsl[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
    # the cast does not own `wgsl`: it stays referenced until the call returns
    descriptor = api.new_struct_p("WGPUShaderModuleDescriptor *",
                                  nextInChain=ffi.cast("WGPUChainedStruct *", wgsl),
                                  label=api.to_c_string_view("zyx"))
    handle = api.libf.wgpuDeviceCreateShaderModuleTrusted(device._internal, descriptor,
                                                          int(checks))
    if handle == ffi.NULL:
        raise BackendError("wgpu: shader module creation failed")
    return api.GPUShaderModule("zyx", handle, device)
