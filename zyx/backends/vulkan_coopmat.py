"""VK_KHR_cooperative_matrix on a Vulkan physical device: the matrix shapes it multiplies
(vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR, reached through
vkGetInstanceProcAddr) and what device creation enables so that the kernels of
`codegen/spirv/coopmat.py` run: the extension and its `cooperativeMatrix` feature, the
Vulkan memory model those modules declare (VK_KHR_vulkan_memory_model,
`vulkanMemoryModel`), float16 arithmetic types (`shaderFloat16`: the matrices' component
type) and, where the device offers bfloat16 shapes, VK_KHR_shader_bfloat16's type and
cooperative-matrix features.

`support()` answers None (nothing enabled, `DeviceInfo.coop_shapes` empty) when
ZYX_VK_COOPMAT=0 at device start (coopmat.requested), when an extension or feature is
missing, or when no subgroup shape multiplies float16 (or bfloat16) into float32.
"""
from __future__ import annotations

from ..codegen.spirv.coopmat import CoopShape, requested

EXTENSION = "VK_KHR_cooperative_matrix"
MEMORY_MODEL_EXTENSION = "VK_KHR_vulkan_memory_model"   # core in 1.2; zyx asks for 1.1
FLOAT16_EXTENSION = "VK_KHR_shader_float16_int8"
BFLOAT16_EXTENSION = "VK_KHR_shader_bfloat16"
# VkComponentTypeKHR -> zyx dtype name (bfloat16 from VK_KHR_shader_bfloat16, newer than
# the `vulkan` package's headers)
COMPONENTS = {0: "float16", 1: "float32", 2: "float64", 3: "int8", 4: "int16", 5: "int32",
              6: "int64", 7: "uint8", 8: "uint16", 9: "uint32", 10: "uint64",
              1000141000: "bfloat16"}
SCOPES = {1: "device", 2: "workgroup", 3: "subgroup", 5: "queue_family"}
# VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_BFLOAT16_FEATURES_KHR
BFLOAT16_FEATURES_STYPE = 1000141000
# VkPhysicalDeviceShaderBfloat16FeaturesKHR, declared here: the `vulkan` package (headers
# 1.3.275) does not know it
BFLOAT16_FEATURES_CDEF = """
typedef struct {
    int32_t sType;
    void* pNext;
    uint32_t shaderBFloat16Type;
    uint32_t shaderBFloat16DotProduct;
    uint32_t shaderBFloat16CooperativeMatrix;
} ZyxShaderBfloat16Features;
"""
_ffi = None          # the cffi FFI of BFLOAT16_FEATURES_CDEF, made on first use


def bfloat16_ffi():
    global _ffi
    if _ffi is None:
        import cffi      # (a dependency of the `vulkan` package)
        _ffi = cffi.FFI()
        _ffi.cdef(BFLOAT16_FEATURES_CDEF)
    return _ffi


def address(ffi, cdata):
    """The address of a cdata pointer as an int (to link structs of two FFIs)."""
    return int(ffi.cast("uintptr_t", cdata))


class CoopSupport:
    """A device's cooperative matrices as device creation enables them: `shapes` (the
    CoopShapes codegen may use), `extensions` to enable, `bfloat16` (its features are
    enabled too)."""

    def __init__(self, shapes, extensions, bfloat16):
        self.shapes = tuple(shapes)
        self.extensions = list(extensions)
        self.bfloat16 = bfloat16
        self.keep = []          # structs linked by raw address: alive while linked

    def chain(self, vk, head):
        """The feature structs this support enables, in front of the VkDeviceCreateInfo
        pNext chain `head` (a struct of the `vulkan` package); returns the new head."""
        nxt = head
        if self.bfloat16:
            ffi = bfloat16_ffi()
            bf = ffi.new("ZyxShaderBfloat16Features*")
            bf.sType = BFLOAT16_FEATURES_STYPE
            bf.pNext = ffi.cast("void*", address(vk.ffi, vk.ffi.addressof(head)))
            bf.shaderBFloat16Type = 1
            bf.shaderBFloat16CooperativeMatrix = 1
            self.keep = [bf, head]
            nxt = vk.ffi.cast("void*", address(ffi, bf))
        model = vk.VkPhysicalDeviceVulkanMemoryModelFeatures(pNext=nxt, vulkanMemoryModel=True)
        return vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(pNext=model,
                                                              cooperativeMatrix=True)


def device_shapes(vk, instance, physical):
    """Every CoopShape the physical device lists (empty when the loader has no
    vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR)."""
    name = "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"
    fn = vk.lib.vkGetInstanceProcAddr(instance, name.encode())
    if fn == vk.ffi.NULL:
        return []
    fn = vk.ffi.cast("PFN_" + name, fn)
    count = vk.ffi.new("uint32_t*")
    if fn(physical, count, vk.ffi.NULL) != 0 or count[0] == 0:
        return []
    props = vk.ffi.new("VkCooperativeMatrixPropertiesKHR[]", count[0])
    for i in range(count[0]):
        props[i].sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
    if fn(physical, count, props) != 0:
        return []
    out = []
    for i in range(count[0]):
        p = props[i]
        names = [COMPONENTS.get(int(t), f"component{int(t)}")
                 for t in (p.AType, p.BType, p.CType, p.ResultType)]
        out.append(CoopShape(int(p.MSize), int(p.NSize), int(p.KSize), *names,
                             SCOPES.get(int(p.scope), f"scope{int(p.scope)}")))
    return out


def usable(shape):
    """Whether coopmat.py's kernels can take `shape`: subgroup scope, float16 or bfloat16
    operands into float32."""
    return shape.scope == "subgroup" and shape.a == shape.b and \
        shape.a in ("float16", "bfloat16") and shape.c == shape.result == "float32"


def features(vk, physical, bfloat16):
    """(cooperativeMatrix, vulkanMemoryModel, bfloat16 type and cooperative matrices)
    as the device reports them."""
    bf = None
    nxt = None
    if bfloat16:
        ffi = bfloat16_ffi()
        bf = ffi.new("ZyxShaderBfloat16Features*")
        bf.sType = BFLOAT16_FEATURES_STYPE
        nxt = vk.ffi.cast("void*", address(ffi, bf))
    model = vk.VkPhysicalDeviceVulkanMemoryModelFeatures(pNext=nxt)
    coop = vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(pNext=model)
    vk.vkGetPhysicalDeviceFeatures2(physical, vk.VkPhysicalDeviceFeatures2(pNext=coop))
    bf_ok = bf is not None and bool(bf.shaderBFloat16Type and bf.shaderBFloat16CooperativeMatrix)
    return bool(coop.cooperativeMatrix), bool(model.vulkanMemoryModel), bf_ok


def compute_stage(vk, physical):
    """Whether cooperative matrices work in compute shaders."""
    props = vk.VkPhysicalDeviceCooperativeMatrixPropertiesKHR()
    vk.vkGetPhysicalDeviceProperties2(physical, vk.VkPhysicalDeviceProperties2(pNext=props))
    return bool(int(props.cooperativeMatrixSupportedStages) & vk.VK_SHADER_STAGE_COMPUTE_BIT)


def support(vk, instance, physical, shader_float16):
    """The CoopSupport of a physical device (`shader_float16`:
    VkPhysicalDeviceShaderFloat16Int8Features.shaderFloat16), or None (module
    docstring). Asks the driver nothing when ZYX_VK_COOPMAT=0."""
    if not requested():
        return None
    extensions = {e.extensionName
                  for e in vk.vkEnumerateDeviceExtensionProperties(physical, None)}
    if EXTENSION not in extensions or MEMORY_MODEL_EXTENSION not in extensions or \
            not shader_float16:
        return None
    offers_bf16 = BFLOAT16_EXTENSION in extensions
    coop, model, bf16 = features(vk, physical, offers_bf16)
    if not (coop and model and compute_stage(vk, physical)):
        return None
    shapes = [s for s in device_shapes(vk, instance, physical)
              if bf16 or "bfloat16" not in (s.a, s.b, s.c, s.result)]
    if not any(usable(s) for s in shapes):
        return None
    exts = [EXTENSION, MEMORY_MODEL_EXTENSION]
    if FLOAT16_EXTENSION in extensions:
        exts.append(FLOAT16_EXTENSION)
    if bf16:
        exts.append(BFLOAT16_EXTENSION)
    return CoopSupport(shapes, exts, bf16)
