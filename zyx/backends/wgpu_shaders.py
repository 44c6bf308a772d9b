"""WGSL shader modules built with the runtime checks zyx chooses (config `wgpu.shader_checks`).

wgpu's standard `create_shader_module` makes naga add two run-time checks to every shader
it translates: index clamping on array accesses, and a 64-bit counter on every loop that
breaks it after 2^64 trips ("force loop bounding", so a driver may not assume a loop ends).
Both guard against untrusted shaders in a browser. zyx writes its own shaders, whose loops
have constant trip counts and whose accesses stay inside their buffers (the tests check
both against numpy). The counter costs a compare and two adds per trip and keeps NVIDIA's
compiler from unrolling, which halved the speed of long reduce loops (a sum, a softmax row)
next to zyx's own SPIR-V on the same driver.

wgpu-native offers `wgpuDeviceCreateShaderModuleTrusted(device, descriptor, checks)` for
that; wgpu-py (0.32) binds the function in its cffi library but has no Python method for it,
so this module fills the same descriptor wgpu-py's `create_shader_module` fills and wraps
the result in wgpu-py's shader module class. Where that is not possible (another wgpu-py,
another backend), `shader_module` returns None and the caller uses the standard path.
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
