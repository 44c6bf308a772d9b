"""A SPIR-V module assembled as 32-bit words: ids, types, constants and instructions, each
kept in the section the SPIR-V specification orders them in (capabilities, extensions,
imports, memory model, entry points, execution modes, decorations, types/constants/global
variables, functions). Types and constants are interned: asking twice gives one id.

Only what zyx's compute kernels need is here: scalar int/float/bool types, arrays,
runtime arrays, structs, pointers, one entry point. Opcode numbers are the
specification's (SPIR-V 1.6 unified, section 3)."""
from __future__ import annotations

import struct

MAGIC = 0x07230203
GENERATOR = 0          # no registered generator id: 0 is "unknown", valid for any tool

# opcodes (spec section 3.52)
OP = dict(
    ExtInstImport=11, ExtInst=12, MemoryModel=14, EntryPoint=15, ExecutionMode=16,
    Capability=17, Extension=10, TypeVoid=19, TypeBool=20, TypeInt=21, TypeFloat=22,
    TypeVector=23, TypeArray=28, TypeRuntimeArray=29, TypeStruct=30, TypePointer=32,
    TypeFunction=33, ConstantTrue=41, ConstantFalse=42, Constant=43, ConstantComposite=44,
    Function=54, FunctionEnd=56, Variable=59, Load=61, Store=62, AccessChain=65,
    Decorate=71, MemberDecorate=72, CompositeExtract=81, CompositeConstruct=80,
    ConvertFToU=109, ConvertFToS=110, ConvertSToF=111, ConvertUToF=112, UConvert=113,
    SConvert=114, FConvert=115, Bitcast=124, SNegate=126, FNegate=127,
    IAdd=128, FAdd=129, ISub=130, FSub=131, IMul=132, FMul=133, UDiv=134, SDiv=135,
    FDiv=136, UMod=137, SRem=138, SMod=139, FRem=140, FMod=141,
    IsNan=156, IsInf=157, LogicalEqual=164, LogicalNotEqual=165, LogicalOr=166, LogicalAnd=167,
    LogicalNot=168, Select=169, IEqual=170, INotEqual=171, UGreaterThan=172,
    SGreaterThan=173, UGreaterThanEqual=174, SGreaterThanEqual=175, ULessThan=176,
    SLessThan=177, ULessThanEqual=178, SLessThanEqual=179, FOrdEqual=180, FUnordEqual=181,
    FOrdNotEqual=182, FUnordNotEqual=183, FOrdLessThan=184, FOrdGreaterThan=186, FOrdGreaterThanEqual=190,
    ShiftRightLogical=194, ShiftRightArithmetic=195, ShiftLeftLogical=196,
    BitwiseOr=197, BitwiseXor=198, BitwiseAnd=199, Not=200,
    ControlBarrier=224, Phi=245, LoopMerge=246, SelectionMerge=247, Label=248, Branch=249,
    BranchConditional=250, Return=253,
    GroupNonUniformShuffleDown=348, GroupNonUniformIAdd=349, GroupNonUniformFAdd=350,
    GroupNonUniformSMin=353, GroupNonUniformUMin=354, GroupNonUniformSMax=356,
    GroupNonUniformUMax=357,
    # SPV_KHR_cooperative_matrix
    TypeCooperativeMatrixKHR=4456, CooperativeMatrixLoadKHR=4457,
    CooperativeMatrixStoreKHR=4458, CooperativeMatrixMulAddKHR=4459,
    CooperativeMatrixLengthKHR=4460,
)

# enumerants
CAP = dict(Shader=1, Float16=9, Float64=10, Int64=11, Int16=22, Int8=39,
           StorageBuffer16BitAccess=4433, StorageBuffer8BitAccess=4448,
           DenormPreserve=4464, SignedZeroInfNanPreserve=4466, GroupNonUniform=61,
           GroupNonUniformArithmetic=63, GroupNonUniformShuffleRelative=66,
           VulkanMemoryModel=5345, CooperativeMatrixKHR=6022, BFloat16TypeKHR=5116,
           BFloat16CooperativeMatrixKHR=5118)
# execution modes of SPV_KHR_float_controls (operand: the float width)
MODE = dict(LocalSize=17, DenormPreserve=4459, SignedZeroInfNanPreserve=4461)
STORAGE = dict(UniformConstant=0, Input=1, Workgroup=4, Function=7, StorageBuffer=12)
DECO = dict(Block=2, ArrayStride=6, BuiltIn=11, NonWritable=24, Binding=33,
            DescriptorSet=34, Offset=35)
BUILTIN = dict(NumWorkgroups=24, WorkgroupId=26, LocalInvocationId=27, SubgroupSize=36,
               SubgroupId=40, SubgroupLocalInvocationId=41)
SCOPE_WORKGROUP = 2
SCOPE_SUBGROUP = 3
GROUP_REDUCE = 0            # GroupOperation Reduce
SEMANTICS_ACQREL_WORKGROUP = 0x8 | 0x100     # AcquireRelease | WorkgroupMemory
MEMORY_MODEL = dict(GLSL450=1, Vulkan=3)
# memory operand bits (the scope <id> of MakePointer* follows the mask)
ACCESS_AVAILABLE, ACCESS_VISIBLE, ACCESS_NON_PRIVATE = 0x8, 0x10, 0x20
FP_ENCODING_BFLOAT16 = 0     # SPV_KHR_bfloat16's OpTypeFloat encoding operand


def _string_words(s):
    """A literal string: UTF-8, NUL-terminated, padded to whole words."""
    b = s.encode() + b"\0"
    b += b"\0" * (-len(b) % 4)
    return list(struct.unpack(f"<{len(b) // 4}I", b))


def _inst(opcode, operands):
    return [((len(operands) + 1) << 16) | opcode] + [int(w) & 0xFFFFFFFF for w in operands]


class Module:
    """One SPIR-V module being built. `fn(...)` appends to the (single) function body;
    `type_*`/`const` intern types and constants."""

    def __init__(self, version=(1, 3)):
        self.version = version
        self.bound = 1
        self.caps = []
        self.exts = []
        self.imports = []
        self.entries = []
        self.modes = []
        self.decos = []
        self.globals = []        # types, constants, global variables (in order)
        self.fvars = []          # OpVariable Function (first block of the function)
        self.body = []
        self._types = {}
        self._consts = {}
        self._signed = {}        # integer type id -> signedness
        self.block = None        # label id of the block being written
        self.extra_modes = []    # (mode name, operand) on the entry point
        self.memory_model = MEMORY_MODEL["GLSL450"]

    def id(self):
        i = self.bound
        self.bound += 1
        return i

    # -- sections ------------------------------------------------------------------
    def capability(self, name):
        if CAP[name] not in self.caps:
            self.caps.append(CAP[name])

    def extension(self, name):
        if name not in self.exts:
            self.exts.append(name)

    def vulkan_memory_model(self):
        """Declare the Vulkan memory model (SPV_KHR_cooperative_matrix requires it): its
        capability, its extension (core from SPIR-V 1.5) and OpMemoryModel's operand."""
        self.capability("VulkanMemoryModel")
        if self.version < (1, 5):
            self.extension("SPV_KHR_vulkan_memory_model")
        self.memory_model = MEMORY_MODEL["Vulkan"]

    def decorate(self, target, deco, *args):
        self.decos += _inst(OP["Decorate"], [target, DECO[deco], *args])

    def member_decorate(self, struct_id, member, deco, *args):
        self.decos += _inst(OP["MemberDecorate"], [struct_id, member, DECO[deco], *args])

    # -- types ---------------------------------------------------------------------
    def _type(self, key, opcode, operands):
        t = self._types.get(key)
        if t is None:
            t = self._types[key] = self.id()
            self.globals += _inst(OP[opcode], [t, *operands])
        return t

    def type_void(self):
        return self._type(("void",), "TypeVoid", [])

    def type_bool(self):
        return self._type(("bool",), "TypeBool", [])

    def type_int(self, bits, signed):
        # the capability of each width is declared with its type: exactly the ones used
        if bits != 32:
            self.capability({8: "Int8", 16: "Int16", 64: "Int64"}[bits])
        t = self._type(("int", bits, signed), "TypeInt", [bits, int(signed)])
        self._signed[t] = signed
        return t

    def type_float(self, bits):
        if bits == 64:
            self.capability("Float64")
        elif bits == 16:
            self.capability("Float16")
        return self._type(("float", bits), "TypeFloat", [bits])

    def type_bfloat16(self):
        """bfloat16 as a SPIR-V type (SPV_KHR_bfloat16): only for cooperative matrices,
        memory and conversions."""
        self.capability("BFloat16TypeKHR")
        self.extension("SPV_KHR_bfloat16")
        return self._type(("bfloat16",), "TypeFloat", [16, FP_ENCODING_BFLOAT16])

    def type_cooperative_matrix(self, component, scope, rows, cols, use):
        """A cooperative matrix type (SPV_KHR_cooperative_matrix); `scope`, `rows`,
        `cols` and `use` are Python ints, written as u32 constants."""
        self.capability("CooperativeMatrixKHR")
        self.extension("SPV_KHR_cooperative_matrix")
        u32 = self.type_int(32, False)
        ids = [self.const(u32, v) for v in (scope, rows, cols, use)]
        return self._type(("coopmat", component, scope, rows, cols, use),
                          "TypeCooperativeMatrixKHR", [component, *ids])

    def type_vector(self, comp, n):
        return self._type(("vec", comp, n), "TypeVector", [comp, n])

    def type_array(self, elem, n):
        length = self.const(self.type_int(32, False), n)
        return self._type(("array", elem, n), "TypeArray", [elem, length])

    def type_pointer(self, storage, t):
        return self._type(("ptr", storage, t), "TypePointer", [STORAGE[storage], t])

    def type_function(self, ret):
        return self._type(("fn", ret), "TypeFunction", [ret])

    def storage_buffer_struct(self, elem, stride, key):
        """A `Block` struct holding one runtime array of `elem` (ArrayStride `stride`): the
        type of a storage buffer binding. `key` keeps one struct per binding, since
        decorations (NonWritable) go on members of distinct structs."""
        arr = self._type(("rtarray", elem), "TypeRuntimeArray", [elem])
        if ("rtarray-deco", elem) not in self._types:
            self._types[("rtarray-deco", elem)] = arr
            self.decorate(arr, "ArrayStride", stride)
        s = self._type(("struct", arr, key), "TypeStruct", [arr])
        self.decorate(s, "Block")
        self.member_decorate(s, 0, "Offset", 0)
        return s

    # -- constants -----------------------------------------------------------------
    def const(self, t, value, bits=32, is_float=False):
        """A scalar constant of type id `t` (`bits` wide; floats pass their value)."""
        key = (t, value if not is_float else struct.pack("<d", value))
        c = self._consts.get(key)
        if c is not None:
            return c
        c = self._consts[key] = self.id()
        if is_float:
            if bits == 64:
                words = list(struct.unpack("<2I", struct.pack("<d", value)))
            elif bits == 32:
                words = list(struct.unpack("<I", struct.pack("<f", value)))
            else:
                words = list(struct.unpack("<H", struct.pack("<e", value)))
        else:
            v = int(value) & ((1 << bits) - 1)
            if bits < 32 and self._signed.get(t) and v >> (bits - 1):
                v |= (1 << 32) - (1 << bits)      # a narrow signed literal is sign-extended
            words = [v & 0xFFFFFFFF, v >> 32] if bits == 64 else [v]
        self.globals += _inst(OP["Constant"], [t, c, *words])
        return c

    def const_bool(self, value):
        key = ("bool", bool(value))
        c = self._consts.get(key)
        if c is None:
            c = self._consts[key] = self.id()
            self.globals += _inst(OP["ConstantTrue" if value else "ConstantFalse"],
                                  [self.type_bool(), c])
        return c

    def const_composite(self, t, parts):
        key = ("comp", t, tuple(parts))
        c = self._consts.get(key)
        if c is None:
            c = self._consts[key] = self.id()
            self.globals += _inst(OP["ConstantComposite"], [t, c, *parts])
        return c

    def global_variable(self, ptr_type, storage):
        v = self.id()
        self.globals += _inst(OP["Variable"], [ptr_type, v, STORAGE[storage]])
        return v

    def function_variable(self, ptr_type):
        v = self.id()
        self.fvars += _inst(OP["Variable"], [ptr_type, v, STORAGE["Function"]])
        return v

    # -- function body ---------------------------------------------------------------
    def op(self, name, result_type, *operands):
        """Append a value instruction; returns its result id."""
        r = self.id()
        self.body += _inst(OP[name], [result_type, r, *operands])
        return r

    def emit(self, name, *operands):
        """Append an instruction without a result (Store, Branch, merges...)."""
        self.body += _inst(OP[name], list(operands))

    def label(self, lab):
        self.body += _inst(OP["Label"], [lab])
        self.block = lab

    def ext(self, glsl, result_type, inst, *args):
        return self.op("ExtInst", result_type, glsl, inst, *args)

    # -- output ----------------------------------------------------------------------
    def words(self, entry_fn, fn_type, entry_label, interface, local_size, name="main"):
        """The finished module: the function `entry_fn` (body so far, variables first)
        as the GLCompute entry point."""
        out = [MAGIC, (self.version[0] << 16) | (self.version[1] << 8), GENERATOR,
               self.bound, 0]
        for c in self.caps:
            out += _inst(OP["Capability"], [c])
        for e in self.exts:
            out += _inst(OP["Extension"], _string_words(e))
        out += self.imports
        out += _inst(OP["MemoryModel"], [0, self.memory_model])      # Logical addressing
        out += _inst(OP["EntryPoint"], [5, entry_fn, *_string_words(name), *interface])
        out += _inst(OP["ExecutionMode"], [entry_fn, MODE["LocalSize"], *local_size])
        for mode, arg in self.extra_modes:
            out += _inst(OP["ExecutionMode"], [entry_fn, MODE[mode], arg])
        out += self.decos
        out += self.globals
        out += _inst(OP["Function"], [self.type_void(), entry_fn, 0, fn_type])
        out += _inst(OP["Label"], [entry_label])
        out += self.fvars
        out += self.body
        out += _inst(OP["FunctionEnd"], [])
        return out

    def import_glsl(self):
        g = self.id()
        self.imports += _inst(OP["ExtInstImport"], [g, *_string_words("GLSL.std.450")])
        return g


def to_bytes(words):
    """The module as the little-endian bytes vkCreateShaderModule and spirv-val take."""
    return struct.pack(f"<{len(words)}I", *words)
