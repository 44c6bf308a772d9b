"""Shared renderer for the C family of targets (C, OpenCL C, CUDA C, HIP).

Codegen is one linear walk over the IR: every SSA value becomes a `const` local, constants
are written inline, and the dialect hooks decide how kernels start, how global indices map
to loops or threads and how special types (f16, bf16) are read and written."""
from __future__ import annotations

import math
import struct

from .. import dtype as dt
from .._core import kernel as K

_UNARY_F = {K.U_EXP2: "exp2", K.U_LOG2: "log2", K.U_SQRT: "sqrt", K.U_SIN: "sin",
            K.U_COS: "cos", K.U_FLOOR: "floor", K.U_TRUNC: "trunc", K.U_ABS: "fabs",
            K.U_EXP: "exp", K.U_LOG: "log", K.U_TANH: "tanh", K.U_ERF: "erf"}
_BINARY_OP = {K.B_ADD: "+", K.B_SUB: "-", K.B_MUL: "*", K.B_CMPLT: "<", K.B_CMPGT: ">",
              K.B_NOTEQ: "!=", K.B_EQ: "==", K.B_OR: "||", K.B_AND: "&&", K.B_BITXOR: "^",
              K.B_BITOR: "|", K.B_BITAND: "&", K.B_SHL: "<<", K.B_SHR: ">>"}
_OMP_REDUCTION = {K.R_SUM: "+", K.R_MAX: "max", K.R_MIN: "min", K.R_PROD: "*"}


class CDialect:
    """Hooks of plain C99 with OpenMP; GPU dialects override the kernel frame."""
    name = "c"
    half_native = False          # f16 registers are floats, converted on load/store and
                                 # rounded after each op (round_value)
    int64 = "long long"
    byte_type = "unsigned char"  # element type of a buffer argument no op reads
    align16 = ""                 # attribute aligning a local array to 16 bytes (GPU dialects)

    def ctype(self, d):
        if d is dt.float16 or d is dt.bfloat16:
            return "float"
        return d.cname

    def storage_type(self, d):
        return d.cname

    def float_suffix(self, d):
        return "f" if d is not dt.float64 else ""

    def math_fn(self, name, d):
        return name + ("f" if d is not dt.float64 else "")

    def unary_fn(self, ops, op, name, d):
        """The function computing float UNARY `op` of `ops` (a dialect may pick a variant
        from what its operand is computed from)."""
        return self.math_fn(name, d)

    def load_convert(self, d, expr):
        if d is dt.float16:
            return f"zyx_h2f({expr})"
        if d is dt.bfloat16:
            return f"zyx_bf2f({expr})"
        return expr

    def store_convert(self, d, expr):
        if d is dt.float16:
            return f"zyx_f2h({expr})"
        if d is dt.bfloat16:
            return f"zyx_f2bf({expr})"
        return expr

    def round_value(self, d, expr):
        """`expr` (a float computed for a value of dtype d) rounded to the nearest value of
        d, still a float: what a float16/bfloat16 op's result is, so that a fused chain
        gives what the same ops give one kernel each (65504 * 2 is inf, not 131008). The
        dialect's prelude defines zyx_rh / zyx_rbf."""
        if d is dt.float16 and not self.half_native:
            return f"zyx_rh({expr})"
        if d is dt.bfloat16:
            return f"zyx_rbf({expr})"
        return expr

    # Vector types of the GPU dialects by storage type (CUDA's and HIP's names; OpenCL
    # differs for the 64-bit integers). CUDA has vectors of at most 4 lanes, and the
    # lowering never asks for more than 16 bytes: the widest load a GPU issues.
    _VECTOR_BASE = {"float": "float", "double": "double", "int": "int", "unsigned int": "uint",
                    "short": "short", "unsigned short": "ushort", "signed char": "char",
                    "unsigned char": "uchar", "long long": "longlong",
                    "unsigned long long": "ulonglong"}

    def vector_type(self, d, lanes):
        """The type of `lanes` consecutive stored elements of dtype d (lanes 1: the storage
        type itself); components are .x .y .z .w in every GPU dialect."""
        if lanes == 1:
            return self.storage_type(d)
        return f"{self._VECTOR_BASE[d.cname]}{lanes}"

    def aligned(self, ptr, nbytes):
        """C expression: pointer `ptr` is a multiple of `nbytes` (a power of two)."""
        return f"((((unsigned long long){ptr}) & {nbytes - 1}u) == 0)"

    def warp_shuffle_xor(self, x, lane_mask, ctype):
        """`x` of the work-item whose lane in the warp is this one's XOR `lane_mask`,
        exchanged through registers, or None where the dialect (or the C type `ctype`)
        has no such shuffle: then groups combine in local memory only. OpenCL's
        sub-group shuffles are an extension NVIDIA's OpenCL lacks, so only CUDA and HIP
        say one."""
        return None


# OpenCL C reserves `long long`: its 64-bit integers are `long` / `ulong`
_OPENCL_TYPES = {"long long": "long", "unsigned long long": "ulong"}

# Helpers the OpenCL kernels call with the names the shared renderer writes (zyx_h2f...).
# f16 is stored as 16 bits and converted with vload_half/vstore_half_rte (core OpenCL,
# no cl_khr_fp16 needed), so the math is float exactly as in the C backend; bf16 is the
# top half of a float's bits, rounded to nearest even like the C dialect. zyx_rh / zyx_rbf
# round an op's float result to its 16-bit dtype (`half_rounds`).
OPENCL_PRELUDE = r"""
inline float zyx_h2f(ushort h) { return vload_half(0, (const half*)&h); }
inline ushort zyx_f2h(float x) { ushort h; vstore_half_rte(x, 0, (half*)&h); return h; }
inline float zyx_bf2f(ushort h) { return as_float(((uint)h) << 16); }
inline ushort zyx_f2bf(float x) {
  uint u = as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (ushort)((u >> 16) | 64u);
  u += 0x7fffu + ((u >> 16) & 1u); return (ushort)(u >> 16); }
inline float zyx_rh(float x) { return zyx_h2f(zyx_f2h(x)); }
inline float zyx_rbf(float x) {
  const uint u = as_uint(x);
  return as_float((u & 0x7fffffffu) > 0x7f800000u ? ((u & 0xffff0000u) | 0x400000u)
                                                 : ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u)); }
inline float zyx_tanhf(float x) {
  if (fabs(x) > 9.0f) return copysign(1.0f, x);
  const float e = expm1(2.0f * x); return e / (e + 2.0f); }
inline long zyx_ipow(long b, long e) {
  if (e < 0) return b == 1 ? 1 : (b == -1 ? ((e & 1) ? -1 : 1) : 0);
  ulong r = 1, ub = (ulong)b;
  while (e) { if (e & 1) r *= ub; ub *= ub; e >>= 1; } return (long)r; }
"""


class OpenCLDialect(CDialect):
    """OpenCL C: same expressions as C; overloaded math (no `f` suffix), `long` for 64-bit
    integers. The kernel frame (one entry point per launch, ids, guards) is written by
    `zyx.codegen.gpu.dispatch.lower` through the GPU hooks below."""
    name = "opencl"
    int64 = "long"
    byte_type = "uchar"
    prelude = OPENCL_PRELUDE
    kernel_prefix = "__kernel void"
    global_qualifier = "__global "
    local_qualifier = "__local "
    local_pointer = "__local "   # address space of a pointer into local memory
    align16 = "__attribute__((aligned(16))) "
    restrict = "restrict"

    def ctype(self, d):
        t = super().ctype(d)
        return _OPENCL_TYPES.get(t, t)

    def storage_type(self, d):
        return _OPENCL_TYPES.get(d.cname, d.cname)

    _VECTOR_BASE = dict(CDialect._VECTOR_BASE, **{"long long": "long",
                                                  "unsigned long long": "ulong"})

    def aligned(self, ptr, nbytes):
        return f"((((ulong){ptr}) & {nbytes - 1}u) == 0)"

    def math_fn(self, name, d):
        # OpenCL allows tanh 5 ulp of error and PoCL uses it: near -1, 0.5 * x * (1 +
        # tanh(...)) in gelu then misses torch by 2e-6 where the value is 0; expm1 keeps
        # float tanh within a couple of ulp, as the C and CUDA backends' tanhf are
        if name == "tanh" and d is not dt.float64:
            return "zyx_tanhf"
        return name

    def group_id(self, axis=0):
        return f"get_group_id({axis})"

    def local_id(self, axis=0):
        return f"get_local_id({axis})"

    def local_size(self, axis=0):
        return f"get_local_size({axis})"

    def barrier(self, scope=None):
        return "barrier(CLK_LOCAL_MEM_FENCE)"



# Helpers the CUDA kernels call, for NVRTC. f16 and bf16 are stored as 16-bit integers and
# computed in float registers, as in the C and OpenCL backends: the same numerics as the
# CPU (which the test suite's tolerances assume) and what torch does for elementwise half
# math (each op's result rounded to its dtype by zyx_rh / zyx_rbf: `half_rounds`); the
# kernels are memory-bound, so float arithmetic costs nothing. The conversions
# are the hardware's: `cvt` PTX instructions, written inline because NVRTC does not ship
# cuda_fp16.h / cuda_bf16.h as built-in headers (checked with NVRTC 13.5: "could not open
# source file", and a pip-only install has no CUDA include directory to point it at).
# bf16 -> float is exact (a shift); float -> bf16 rounds to nearest even in integer ops,
# bit for bit the C backend's (NaN kept quiet with its sign), on every architecture
# (`cvt.rn.bf16.f32` needs sm_80). NVRTC defines neither NAN nor INFINITY.
_CUDA_COMMON = r"""
#ifndef NAN
#define NAN __int_as_float(0x7fc00000)
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
static __device__ __forceinline__ float zyx_bf2f(unsigned short h) {
  return __uint_as_float(((unsigned int)h) << 16); }
static __device__ __forceinline__ unsigned short zyx_f2bf(float x) {
  unsigned int u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 64u);
  u += 0x7fffu + ((u >> 16) & 1u); return (unsigned short)(u >> 16); }
static __device__ __forceinline__ float zyx_rh(float x) { return zyx_h2f(zyx_f2h(x)); }
static __device__ __forceinline__ float zyx_rbf(float x) {
  const unsigned int u = __float_as_uint(x);
  return __uint_as_float((u & 0x7fffffffu) > 0x7f800000u ? ((u & 0xffff0000u) | 0x400000u)
                                                        : ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u)); }
static __device__ __forceinline__ long long zyx_ipow(long long b, long long e) {
  if (e < 0) return b == 1 ? 1 : (b == -1 ? ((e & 1) ? -1 : 1) : 0);
  unsigned long long r = 1, ub = (unsigned long long)b;
  while (e) { if (e & 1) r *= ub; ub *= ub; e >>= 1; } return (long long)r; }
"""

CUDA_PRELUDE = r"""
static __device__ __forceinline__ float zyx_h2f(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
static __device__ __forceinline__ unsigned short zyx_f2h(float x) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x)); return h; }
""" + _CUDA_COMMON

# HIP (hiprtc, clang): no inline PTX; clang's _Float16 is the hardware's f16 on AMD GPUs
# (v_cvt_f32_f16 / v_cvt_f16_f32, round to nearest even), reinterpreted with
# __builtin_bit_cast. The rest is CUDA's: __int_as_float & co exist in HIP too.
HIP_PRELUDE = r"""
static __device__ __forceinline__ float zyx_h2f(unsigned short h) {
  return (float)__builtin_bit_cast(_Float16, h); }
static __device__ __forceinline__ unsigned short zyx_f2h(float x) {
  return __builtin_bit_cast(unsigned short, (_Float16)x); }
""" + _CUDA_COMMON


class CUDADialect(CDialect):
    """CUDA C++ for NVRTC: C's types and `f`-suffixed math (expf...), one `extern "C"`
    entry point per launch (unmangled names for cuModuleGetFunction), ids from
    blockIdx/threadIdx, `__shared__` local memory. The frame is `gpu.lower`'s."""
    name = "cuda"
    prelude = CUDA_PRELUDE
    kernel_prefix = 'extern "C" __global__ void'
    global_qualifier = ""
    local_qualifier = "__shared__ "
    local_pointer = ""           # generic pointers reach shared memory
    align16 = "__align__(16) "
    restrict = "__restrict__"
    mma_ptx = True               # inline PTX matrix instructions (mma.lower_mma)

    def group_id(self, axis=0):
        return f"blockIdx.{'xyz'[axis]}"

    def local_id(self, axis=0):
        return f"threadIdx.{'xyz'[axis]}"

    def local_size(self, axis=0):
        return f"blockDim.{'xyz'[axis]}"

    def barrier(self, scope=None):
        return "__syncthreads()"

    # accumulator C types a warp shuffle moves in registers (the others combine in local
    # memory)
    _SHUFFLED = frozenset({"float", "double", "int", "unsigned int", "long long",
                           "unsigned long long"})

    def warp_shuffle_xor(self, x, lane_mask, ctype):
        """`x` of the work-item whose lane is this one's XOR `lane_mask`, through
        registers (every lane of the warp takes part), or None where ctype cannot go."""
        if ctype not in self._SHUFFLED:
            return None
        return f"__shfl_xor_sync(0xffffffffu, {x}, {lane_mask})"


class HIPDialect(CUDADialect):
    """HIP C++ for hiprtc: CUDA's spelling (HIP keeps blockIdx, __shared__, __syncthreads,
    extern "C" __global__); only the f16 conversions differ (see HIP_PRELUDE)."""
    name = "hip"
    prelude = HIP_PRELUDE
    mma_ptx = False              # hiprtc compiles no PTX

    def warp_shuffle_xor(self, x, lane_mask, ctype):
        # HIP's shuffles take no mask: a whole wavefront (64 lanes on AMD) exchanges
        if ctype not in self._SHUFFLED:
            return None
        return f"__shfl_xor({x}, {lane_mask})"


def literal(dl, d, v):
    if d.is_bool:
        return "1" if v else "0"
    if d.is_float:
        v = float(v)
        if d is dt.float16 or d is dt.bfloat16:
            # a constant of a 16-bit dtype is that dtype's value, as the same scalar is
            # when a later run of the graph reads it from a buffer (a cast, rounded)
            v = round_half(d, v)
        if math.isnan(v):
            return "NAN"
        if math.isinf(v):
            return "INFINITY" if v > 0 else "(-INFINITY)"
        s = repr(v)
        if "e" not in s and "." not in s:
            s += ".0"
        return s + dl.float_suffix(d if d is dt.float64 else dt.float32)
    v = int(v)
    if d.itemsize == 8:
        return f"{v}ULL" if d.kind == "u" else (f"{v}LL" if v != -(1 << 63) else "(-9223372036854775807LL-1)")
    if d.kind == "u":
        return f"{v}u"
    if v == -(1 << 31):
        return "(-2147483647-1)"
    return str(v) if d.itemsize == 4 else f"(({d.cname}){v})"


class Rendered:
    """What a dialect's frame needs: the body statements and facts about the kernel."""

    def __init__(self):
        self.lines = []
        self.indices = []        # (ssa, axis, length) of INDEX ops
        self.params = []         # (argno, dtype, read_only)


class Frame:
    """Hooks through which a GPU lowering reshapes the body `render_body` writes (the C
    backend passes none and gets the plain walk). The defaults change nothing."""
    narrow = frozenset()     # SSA ids of index math rendered as 32-bit `int`

    def skip(self, i):
        """True: op i is not written (a pass that leaves out a reduce loop nest)."""
        return False

    def open_loop(self, i, op, ind):
        """Lines that open LOOP i instead of the serial `for`, or None for the default."""
        return None

    def close_loop(self, i, op, ind):
        """Lines that close LOOP op[2] at its ENDLOOP i, or None for the default `}`."""
        return None

    def after(self, i, ind):
        """Lines written after op i (also after a skipped one)."""
        return ()

    def store(self, i, line):
        """The statement that writes a global STORE (e.g. guarded to one work-item)."""
        return line

    def access(self, i, buf, index):
        """The element a global LOAD or STORE i reads or writes: `buf[index]`, or a lane of
        a vector the GPU lowering loaded (or stores) for several elements at once."""
        return f"{buf}[{index}]"


def alu_operands(op):
    """SSA operands of an ALU op (CAST, UNARY, BINARY, WHERE, MAD); () for other ops."""
    c = op[0]
    if c == K.CAST:
        return (op[2],)
    if c == K.UNARY:
        return (op[3],)
    if c == K.BINARY:
        return (op[3], op[4])
    if c in (K.WHERE, K.MAD):
        return (op[2], op[3], op[4])
    return ()


_PLAIN = Frame()
INDEX32 = "int"          # the C type of 32-bit index math


def render_body(kernel, dl, loop_pragma=None, frame=None):
    """Render every op after the leading DEFINE/INDEX block. `loop_pragma(op_i, ops)` may
    return a pragma line to put before a LOOP, or a (before, first line of the body) pair.
    `frame` (a `Frame`) lets a GPU lowering split loops, skip ops and narrow index math."""
    ops = kernel.ops
    r = Rendered()
    names = {}
    lines = r.lines
    depth = 1
    fr = frame if frame is not None else _PLAIN
    narrow = fr.narrow

    def v(i):
        return names[i]

    def v32(i):
        return _narrow_name(dl, ops, names, i)

    for i, op in enumerate(ops):
        c = op[0]
        d = op[1]
        ind = "  " * depth
        if fr.skip(i):
            if c == K.CONST:      # constants cost nothing and may be named later
                names[i] = literal(dl, d, op[2])
            lines.extend(fr.after(i, ind))
            continue
        if c == K.CONST:
            names[i] = literal(dl, d, op[2])
        elif c == K.DEFINE:
            if op[2] == K.SCOPE_GLOBAL:
                names[i] = f"g{op[3]}"
                r.params.append((op[3], d, op[4]))
            else:
                names[i] = f"acc{i}"
                if op[5] == 1:
                    lines.append(f"{ind}{dl.ctype(d)} acc{i} = {literal(dl, d, op[3])};")
                else:
                    lines.append(f"{ind}{dl.ctype(d)} acc{i}[{op[5]}];")
                    if op[3] is not None:   # (None: scratch, written before it is read)
                        lines.append(f"{ind}for (int q = 0; q < {op[5]}; q++) acc{i}[q] = "
                                     f"{literal(dl, d, op[3])};")
        elif c == K.INDEX:
            names[i] = f"i{i}"
            r.indices.append((i, op[2], op[3]))
        elif c == K.LOOP:
            names[i] = f"r{i}"
            opened = fr.open_loop(i, op, ind)
            if opened is not None:
                lines.extend(opened)
                depth += 1
                lines.extend(fr.after(i, ind))
                continue
            inside = ""
            if loop_pragma is not None:
                p = loop_pragma(i, ops)   # a line before the loop, or (before, first in body)
                if isinstance(p, tuple):
                    p, inside = p
                if p:
                    lines.append(ind + p)
            t = INDEX32 if i in narrow else dl.int64
            lines.append(f"{ind}for ({t} r{i} = 0; r{i} < {op[2]}; r{i}++) {{")
            depth += 1
            if inside:
                lines.append("  " * depth + inside)
        elif c == K.ENDLOOP or c == K.END_IF:
            depth -= 1
            closed = fr.close_loop(i, op, "  " * depth) if c == K.ENDLOOP else None
            lines.extend(closed if closed is not None else ["  " * depth + "}"])
        elif c == K.IF_OP:
            lines.append(f"{ind}if ({v(op[2])}) {{")
            depth += 1
        elif c == K.LOAD:
            lines.append(ind + value_line(dl, ops, i, names, narrow, fr.access))
        elif c == K.STORE:
            dst = ops[op[2]]
            if dst[2] == K.SCOPE_REGISTER:
                sub = f"[{v(op[3])}]" if op[3] >= 0 else ""
                lines.append(f"{ind}{v(op[2])}{sub} = {v(op[4])};")
            else:
                vi = v32 if narrow else v
                lines.append(fr.store(i, f"{ind}{fr.access(i, v(op[2]), vi(op[3]))} = "
                                         f"{dl.store_convert(dst[1], v(op[4]))};"))
        elif c == K.BARRIER:
            lines.append(f"{ind}{dl.barrier(op[2])};")
        else:
            lines.append(ind + value_line(dl, ops, i, names, narrow, fr.access))
        lines.extend(fr.after(i, "  " * depth))
    return r, names


def _narrow_name(dl, ops, names, j):
    """The name of operand j in 32-bit index math: constants are written as 32-bit
    literals, else C would widen the whole expression back to 64 bits."""
    o = ops[j]
    if o[0] == K.CONST and not o[1].is_float and not o[1].is_bool and -2**31 <= o[2] < 2**31:
        return literal(dl, dt.int32, o[2])
    return names[j]


def _plain_access(i, buf, index):
    return f"{buf}[{index}]"


def value_line(dl, ops, i, names, narrow=frozenset(), access=_plain_access):
    """The statement `const T v{i} = ...;` of value op i (a LOAD or an ALU op), its
    operands named by `names` (SSA -> C expression; v{i} is added). Index math in
    `narrow` is 32-bit, and so are the constants it reads. `access(i, buf, index)` writes
    a global load's element (a GPU lowering's `Frame.access`). Shared by `render_body`
    and the GPU lowerings that write one op's value at several places (gemm tiles)."""
    op = ops[i]
    c, d = op[0], op[1]

    def v(j):
        return names[j]

    def v32(j):
        return _narrow_name(dl, ops, names, j)

    names[i] = f"v{i}"
    if c == K.LOAD:
        if ops[op[2]][2] == K.SCOPE_REGISTER:
            sub = f"[{v(op[3])}]" if op[3] >= 0 else ""
            return f"const {dl.ctype(d)} v{i} = {v(op[2])}{sub};"
        vi = v32 if narrow else v    # a constant address of 32-bit index math
        e = dl.load_convert(d, access(i, v(op[2]), vi(op[3])))
        if op[4] >= 0:
            e = f"({v(op[4])} ? {e} : {literal(dl, d, 0)})"
        return f"const {dl.ctype(d)} v{i} = {e};"
    if i in narrow:
        return f"const {INDEX32} v{i} = {alu(dl, ops, (c, dt.int32) + op[2:], v32)};"
    if c == K.BINARY and narrow and (op[3] in narrow or op[4] in narrow):
        # a comparison (guard) of 32-bit index math: its constant is 32-bit too
        return f"const {dl.ctype(d)} v{i} = {alu(dl, ops, op, v32)};"
    e = alu(dl, ops, op, v)
    if (d is dt.float16 or d is dt.bfloat16) and i in half_rounds(ops):
        e = dl.round_value(d, e)
    return f"const {dl.ctype(d)} v{i} = {e};"


# Rounding of float16 / bfloat16 values. The C-family targets compute these dtypes in
# float registers; an op's result must still be a value of its dtype, as torch's op by op
# results are, or fusion changes results (65504 * 2 / 2 stays 65504 instead of inf). Each
# such ALU result is rounded where it is defined, except where that is a no-op or done
# anyway: ops that cannot leave the dtype's values (neg, abs, max, min, where, floor,
# trunc, fmod of exact operands), results whose every use rounds (a global store of the
# same dtype converts; neg/abs/max/min/where commute with rounding to nearest, so one
# rounding of their result serves both), and a product of two 16-bit values whose every
# use is a float32 cast summed into an accumulator: a dot product (matmul), whose
# products torch (and the GPUs' matrix instructions) keep exact in float32.
_HALF_TRANSPARENT_U = frozenset((K.U_NEG, K.U_ABS))
_HALF_TRANSPARENT_B = frozenset((K.B_MAX, K.B_MIN))
_HALF_KEEPS_U = _HALF_TRANSPARENT_U | {K.U_FLOOR, K.U_TRUNC}
_HALF_KEEPS_B = _HALF_TRANSPARENT_B | {K.B_MOD}
_half_memo = {}


def half_rounds(ops):
    """The ids of the float16/bfloat16 ALU ops of `ops` whose value `value_line` rounds
    to the dtype (see above). Computed once per op list (the renderers ask per op)."""
    key = id(ops)
    hit = _half_memo.get(key)
    if hit is not None and hit[0] is ops and hit[1] == len(ops):
        return hit[2]
    out = _half_analysis(ops)
    if len(_half_memo) >= 16:
        _half_memo.clear()
    _half_memo[key] = (ops, len(ops), out)
    return out


def round_half(d, v):
    """Python float v rounded to the nearest value of the 16-bit float dtype d (nearest
    even on ties, through float32 as the kernels round; out of range: inf)."""
    if math.isnan(v) or math.isinf(v):
        return v
    try:
        f32 = struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)
    if d is dt.float16:
        try:
            return struct.unpack("<e", struct.pack("<e", f32))[0]
        except OverflowError:
            return math.copysign(math.inf, v)
    u = struct.unpack("<I", struct.pack("<f", f32))[0]
    u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000    # (past the largest: the inf bits)
    return struct.unpack("<f", struct.pack("<I", u))[0]


def _half_analysis(ops):
    half = (dt.float16, dt.bfloat16)
    if not any(op[1] in half for op in ops if op[0] != K.DEFINE):
        return frozenset()
    users = {}
    for i, op in enumerate(ops):
        c = op[0]
        if c == K.STORE:
            users.setdefault(op[4], []).append((i, 4))
        elif c in (K.CAST, K.UNARY, K.BINARY, K.WHERE, K.MAD):
            for pos, j in zip(_OPERAND_POS[c], alu_operands(op)):
                users.setdefault(j, []).append((i, pos))
    exact = {}

    def is_exact(j):
        return exact.get(j, True)     # loads and constants are values of their dtype

    def sink(i, d, u, pos):
        o = ops[u]
        c = o[0]
        if c == K.STORE:
            dst = ops[o[2]]
            return dst[2] == K.SCOPE_GLOBAL and dst[1] is d
        if o[1] is not d:
            return False
        return ((c == K.UNARY and o[2] in _HALF_TRANSPARENT_U)
                or (c == K.BINARY and o[2] in _HALF_TRANSPARENT_B)
                or (c == K.WHERE and pos != 2))

    def accumulated(a):
        # a float add whose every use stores it into a register: a reduce's accumulator
        o = ops[a]
        us = users.get(a, ())
        return (o[0] == K.BINARY and o[2] == K.B_ADD and bool(us) and all(
            ops[s][0] == K.STORE and ops[ops[s][2]][2] == K.SCOPE_REGISTER for s, _ in us))

    def dot_product(i, op):
        # a product of exact 16-bit values (exact in float32) only summed as float32
        if not (op[0] == K.BINARY and op[2] == K.B_MUL and is_exact(op[3])
                and is_exact(op[4]) and users.get(i)):
            return False
        for u, _ in users[i]:
            o = ops[u]
            if (o[0] != K.CAST or not o[1].is_float or o[1].itemsize < 4 or not users.get(u)
                    or not all(accumulated(a) for a, _ in users[u])):
                return False
        return True

    out = set()
    for i, op in enumerate(ops):
        c, d = op[0], op[1]
        if d not in half or c not in (K.CAST, K.UNARY, K.BINARY, K.WHERE, K.MAD):
            continue
        if c == K.CAST:
            keeps = ops[op[2]][1] is d and is_exact(op[2])
        elif c == K.UNARY:
            keeps = op[2] in _HALF_KEEPS_U and is_exact(op[3])
        elif c == K.BINARY:
            keeps = op[2] in _HALF_KEEPS_B and is_exact(op[3]) and is_exact(op[4])
        elif c == K.WHERE:
            keeps = is_exact(op[3]) and is_exact(op[4])
        else:
            keeps = False
        if keeps:
            exact[i] = True
        elif all(sink(i, d, u, pos) for u, pos in users.get(i, ())) or dot_product(i, op):
            exact[i] = False
        else:
            exact[i] = True
            out.add(i)
    return frozenset(out)


_OPERAND_POS = {K.CAST: (2,), K.UNARY: (3,), K.BINARY: (3, 4), K.WHERE: (2, 3, 4),
                K.MAD: (2, 3, 4)}


def alu(dl, ops, op, v):
    c = op[0]
    d = op[1]
    if c == K.CAST:
        src_d = ops[op[2]][1]
        x = v(op[2])
        if d.is_bool:
            return f"({x} != 0)"
        if d is dt.float16 or d is dt.bfloat16:
            # (rounded to d by value_line, unless every use rounds it: `half_rounds`)
            return x if src_d is d else f"((float){x})"
        if src_d.is_float and d.is_int:
            # float -> int conversion of NaN/inf is undefined in C; pin it to 0 / saturate
            return f"(({dl.ctype(d)})({x} == {x} ? {x} : 0))"
        return f"(({dl.ctype(d)}){x})"
    if c == K.WHERE:
        return f"({v(op[2])} ? {v(op[3])} : {v(op[4])})"
    if c == K.MAD:
        # a 16-bit float product is rounded before the add, as two ops would be
        return f"({dl.round_value(d, f'({v(op[2])} * {v(op[3])})')} + {v(op[4])})"
    if c == K.UNARY:
        u, x = op[2], v(op[3])
        if u == K.U_NEG:
            return f"(!{x})" if d.is_bool else f"(-{x})"
        if u == K.U_RECIP:
            return f"({literal(dl, d, 1.0)} / {x})"
        if u == K.U_BITNOT:
            return f"(!{x})" if d.is_bool else f"(({dl.ctype(d)})~{x})"
        if u == K.U_ABS and not d.is_float:
            return f"({x} < 0 ? -{x} : {x})" if d.kind == "i" else x
        if not d.is_float:
            if u in (K.U_FLOOR, K.U_TRUNC):
                return x
            return f"(({dl.ctype(d)}){dl.math_fn(_UNARY_F[u], dt.float64)}((double){x}))"
        return f"{dl.unary_fn(ops, op, _UNARY_F[u], d)}({x})"
    # BINARY
    b, x, y = op[2], v(op[3]), v(op[4])
    if d.is_bool and b in (K.B_ADD, K.B_MUL):
        # bool arithmetic is logical (torch/numpy): 1 + 1 must stay 1, not the byte 2
        b = K.B_OR if b == K.B_ADD else K.B_AND
    if b in _BINARY_OP:
        e = f"({x} {_BINARY_OP[b]} {y})"
        if b in (K.B_SHL, K.B_SHR, K.B_BITXOR, K.B_BITOR, K.B_BITAND) or (
                not d.is_float and d.itemsize < 4 and b in (K.B_ADD, K.B_SUB, K.B_MUL)):
            e = f"(({dl.ctype(d)}){e})"   # C promotes small ints; wrap like the dtype does
        return e
    if b == K.B_MAX:
        if d.is_float:   # NaN wins; a tie (-0.0 vs 0.0) keeps x, as torch.maximum
            return f"(({x} < {y} || {y} != {y}) ? {y} : {x})"
        return f"({x} > {y} ? {x} : {y})"
    if b == K.B_MIN:
        if d.is_float:
            return f"(({y} < {x} || {y} != {y}) ? {y} : {x})"
        return f"({x} < {y} ? {x} : {y})"
    if b in (K.B_DIV, K.B_MOD) and not d.is_float:
        # Integer x / 0 is 0 (no trap), and so is x % 0. MIN / -1 overflows and traps
        # (SIGFPE on x86) for the native-width signed types: there x / -1 is a wrapping
        # negation and x % -1 is 0. Narrower types are promoted to int by C and cannot trap.
        t = dl.ctype(d)
        yop = ops[op[4]]
        yc = yop[2] if yop[0] == K.CONST else None
        traps = d.kind == "i" and d.itemsize >= 4
        neg = f"({t})(0 - (unsigned {t}){x})"
        if b == K.B_DIV:
            if yc is not None and yc != 0:
                return neg if (traps and yc == -1) else f"({x} / {y})"
            if traps:
                return f"({y} == 0 ? ({t})0 : {y} == -1 ? {neg} : ({t})({x} / {y}))"
            return f"({y} == 0 ? ({t})0 : ({t})({x} / {y}))"
        if yc is not None and yc != 0:
            return f"({t})0" if (traps and yc == -1) else f"({x} % {y})"
        if traps:
            return f"(({y} == 0 || {y} == -1) ? ({t})0 : ({t})({x} % {y}))"
        return f"({y} == 0 ? ({t})0 : ({t})({x} % {y}))"
    if b == K.B_DIV:
        return f"({x} / {y})"
    if b == K.B_MOD:
        return f"{dl.math_fn('fmod', d)}({x}, {y})"
    if b == K.B_POW:
        if d.is_float:
            return f"{dl.math_fn('pow', d)}({x}, {y})"
        return f"(({dl.ctype(d)})zyx_ipow(({dl.int64}){x}, ({dl.int64}){y}))"
    raise AssertionError(f"cannot render binary op {b}")
