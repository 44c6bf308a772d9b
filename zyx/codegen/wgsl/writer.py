"""WGSL writer: one compute shader per zyx kernel, written by one walk over the IR.

What WGSL lacks and how the kernels get around it:

* No 8- and 16-bit integers, no bool buffers: bool, uint8, int8, uint16, int16, float16 and
  bfloat16 buffers are arrays of u32 words, several elements per word. A load shifts and
  masks its element out of the word (signed types sign-extend with an arithmetic shift);
  a store clears and sets its element's bits with two atomics on `array<atomic<u32>>`, so
  invocations storing neighbouring elements of one word never lose each other's writes.
  In registers the small integers are i32/u32 wrapped back to their width after each
  operation that can leave it (as C's casts wrap them), float16/bfloat16 are f32 (as the
  C backend computes them) rounded to their precision where the IR casts to them.
* No float64 and no 64-bit integers (core WGSL): kernels reading or writing float64,
  int64 or uint64 buffers are refused (`supports`). Index arithmetic, int64 in the IR
  (IDX), is written in i32: buffers beyond 2^31 - 1 elements are refused. Float64
  accumulators the kernelizer adds to long float sums are f32 here (the device says
  fp64 = False, so the runtime asks for no float64 elsewhere).
* No inf/NaN literals (WGSL constant expressions must be finite): they are bitcasts of
  their bits.
* At most 65,535 workgroups per dispatch dimension: larger grids are folded into 2-D
  (`groups`), the shader recovering the linear id from both.

Strategies (`WGSLKernel.strategy`):

* "serial": one invocation per output element (the grid of the kernel's INDEX ops), its
  reduce loops run serially. Every kernel can take it.
* "rows": one workgroup per output element for kernels with long reduce loops (row sums,
  softmax rows, a single sum, a convolution's weight gradient): each top-level loop,
  together with the loops it perfectly wraps (`flat_run`: a weight gradient's batch,
  height and width), is spread over the workgroup's invocations as one flat loop,
  accumulators are combined by a tree in workgroup memory (barriers only in uniform
  control flow) and every invocation continues with the combined value.
"""
from __future__ import annotations

import math
import struct

from ... import dtype as dt
from ..._core import kernel as K
from ..cstyle import alu_operands, half_rounds, round_half
from ..gpu.analysis import Nest, contiguous_loads, loop_ends, thread_run
from ..gpu.elementwise import elementwise_accesses
from ..gpu.program import read_variant
from ..gpu.reduce import RowCache, row_cache

WORKGROUP = 256              # invocations per workgroup of the serial strategy
EW_PER_MIN = 1 << 20        # fewest outputs of a loop-free kernel taking EW_DEFAULT's tiles
# Loop-free kernels of at least EW_PER_MIN outputs, `ZYX_WGSL_EW` for sweeps: `per` steps
# of `vec` consecutive outputs per invocation, `wg` invocations per workgroup; vec=4
# reads and writes the buffers every access of which is at the flat output index as
# vec4s (`_write_vec`), vec=1 is the older grid-stride layout (`_write_serial_per`).
EW_ENV = "ZYX_WGSL_EW"
# (H200 through wgpu-py, 64M float32, benches/gpu_vk_bandwidth_sweep.py wgpu: per=2 gave
# the chain 2.39 TB/s against 2.19 at per=4, the copy 2.39 against 2.27)
EW_DEFAULT = {"per": 2, "vec": 4, "wg": WORKGROUP}
EW_LIMITS = {"per": 16, "vec": 4, "wg": 1024}
VEC_DTYPES = (dt.float32, dt.int32, dt.uint32)
ROW_WORKGROUP = 256          # invocations per workgroup of the rows strategy
ROW_MIN_LOOP = 256           # fewest iterations of a reduce loop the rows strategy takes
ROW_MIN_SERIAL_WORK = 1 << 15  # "rows" only where one invocation's serial work would exceed this
# ... or where the kernel has at most this many outputs per compute unit (`units`): one
# invocation per output would leave most of a GPU idle (a convolution's weight gradient,
# 16 x 72 outputs over 64 x 14 x 14 terms, took milliseconds serially on an H200)
ROW_FEW_OUTPUTS_PER_UNIT = 32
MAX_GROUPS = 65535           # WebGPU's maxComputeWorkgroupsPerDimension default
# Longest loop written as one WGSL loop: lavapipe (llvmpipe) stops every shader loop after
# 65,535 iterations, silently, so longer loops are written as a loop of chunks
LOOP_CHUNK = 32768
# The rows strategy's knobs (ZYX_WGSL_REDUCE="cache=1,wg=128", read at every lowering):
# cache=1 keeps a row's elements in a per-invocation array from the first loop that
# reads them for the later loops that read them again (gpu.reduce.RowCache: softmax
# reads its row once instead of three times); wg: invocations per workgroup (a power of
# two; the autotuner's schedule overrides it).
REDUCE_ENV = "ZYX_WGSL_REDUCE"
# cache on: on an H200 through wgpu, with shaders built without naga's loop counters
# (backends/wgpu_direct.py), softmax 16384x4096 took 0.195 ms cached against 0.214 reading
# the row again (benches/gpu_vk_bandwidth_sweep.py wgpu; with the counters the loops were
# not unrolled, the array was not kept in registers and caching was the slower, 0.549 ms
# against 0.422).
REDUCE_DEFAULT = {"cache": 1, "wg": ROW_WORKGROUP}
INT32_MAX = 2**31 - 1

# bits per element of the dtypes packed in u32 words
PACKED = {dt.bool_: 8, dt.uint8: 8, dt.int8: 8, dt.uint16: 16, dt.int16: 16,
          dt.float16: 16, dt.bfloat16: 16}
# dtypes a WGSL kernel may hold in its buffers
BUFFER_DTYPES = (dt.bool_, dt.uint8, dt.uint16, dt.uint32, dt.int8, dt.int16, dt.int32,
                 dt.float16, dt.bfloat16, dt.float32)
UNSUPPORTED = (dt.float64, dt.int64, dt.uint64)
# The runtime passes values that change between launches (slice starts of windows into a
# realized tensor) in small read-only int64 buffers; they are index values, so they fit
# 32 bits and are read as the low word. Longer int64 buffers are data and are refused.
PARAM_LEN = 64

_UNARY_F = {K.U_EXP2: "exp2", K.U_LOG2: "log2", K.U_SQRT: "sqrt", K.U_SIN: "sin",
            K.U_COS: "cos", K.U_FLOOR: "floor", K.U_TRUNC: "trunc", K.U_ABS: "abs",
            K.U_EXP: "exp", K.U_LOG: "log", K.U_TANH: "zyx_tanh", K.U_ERF: "zyx_erf"}
_ARITH = {K.B_ADD: "+", K.B_SUB: "-", K.B_MUL: "*"}
_COMPARE = {K.B_CMPLT: "<", K.B_CMPGT: ">", K.B_NOTEQ: "!=", K.B_EQ: "=="}
_BITS = {K.B_BITXOR: "^", K.B_BITOR: "|", K.B_BITAND: "&"}

# Helpers every shader may call (naga drops the unused ones).
PRELUDE = r"""
fn zyx_isnan(x: f32) -> bool {
  // by the bits: drivers compile x != x as ordered (false for NaN) or fold it away
  return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}
fn zyx_isfinite(x: f32) -> bool { return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u; }
fn zyx_sdiv(x: i32, y: i32) -> i32 {
  // signed division through unsigned magnitudes (truncating, as C): NVIDIA's driver gets
  // OpSDiv/OpSRem of negative operands wrong; x / 0 is 0 (the C backend's rule)
  if (y == 0) { return 0; }
  let q = i32(u32(abs(x)) / u32(abs(y)));
  return select(q, -q, (x < 0) != (y < 0));
}
fn zyx_smod(x: i32, y: i32) -> i32 {
  // the remainder takes the dividend's sign (C's %), through magnitudes as zyx_sdiv
  if (y == 0) { return 0; }
  let r = i32(u32(abs(x)) % u32(abs(y)));
  return select(r, -r, x < 0);
}
fn zyx_tanh(x: f32) -> f32 {
  // tanh's exp-based forms overflow to NaN for large |x| on some drivers
  if (abs(x) > 9.0) { return sign(x); }
  if (abs(x) < 0.0625) { let x2 = x * x; return x * (1.0 + x2 * (-0.33333334 + x2 * (0.13333334 - x2 * 0.053968254))); }
  let e = exp(2.0 * x); return (e - 1.0) / (e + 1.0);
}
fn zyx_erf(x: f32) -> f32 {
  // erf by its Taylor series near 0 and erfc's continued-fraction-free rational fit
  // (Numerical Recipes' erfcc, relative error < 1.2e-7) elsewhere
  let a = abs(x);
  if (a < 0.5) {
    let x2 = x * x;
    return x * (1.1283791671 + x2 * (-0.3761263890 + x2 * (0.1128379167 + x2 * (-0.0268661707 + x2 * (0.0052239776 - x2 * 0.0008548327)))));
  }
  let t = 1.0 / (1.0 + 0.5 * a);
  let y = t * exp(-a * a - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))));
  return sign(x) * (1.0 - y);
}
fn zyx_pow(x: f32, y: f32) -> f32 {
  // C's pow: negative bases with integral exponents, pow(x, 0) = 1, pow(1, y) = 1
  if (y == 0.0 || x == 1.0) { return 1.0; }
  if (zyx_isnan(x) || zyx_isnan(y)) { return bitcast<f32>(0x7fc00000u); }
  let r = exp2(y * log2(abs(x)));
  if (x < 0.0) {
    if (y != trunc(y)) { return bitcast<f32>(0x7fc00000u); }
    if (0.5 * y != trunc(0.5 * y)) { return -r; }
  }
  return r;
}
fn zyx_fmod(x: f32, y: f32) -> f32 {
  // C's fmod, exact: WGSL's x - y * trunc(x / y) rounds (fmod(0.3, 0.1)) and gives NaN for
  // an infinite y. Long division in powers of two: each step subtracts y scaled to just
  // below the remainder, which is exact.
  if (zyx_isnan(x) || zyx_isnan(y) || !zyx_isfinite(x) || y == 0.0) { return bitcast<f32>(0x7fc00000u); }
  let b = abs(y);
  var a = abs(x);
  if (!zyx_isfinite(y) || a < b) { return x; }
  for (var k: i32 = 0; k < 300; k++) {
    if (a < b) { break; }
    var t = ldexp(b, frexp(a).exp - frexp(b).exp);
    if (t > a) { t = 0.5 * t; }
    a = a - t;
  }
  return select(a, -a, x < 0.0);
}
fn zyx_ipow(b: i32, e: i32) -> i32 {
  if (e < 0) { if (b == 1) { return 1; } if (b == -1) { return select(1, -1, (e & 1) != 0); } return 0; }
  var r: i32 = 1; var x: i32 = b; var k: i32 = e;
  loop { if (k == 0) { break; } if ((k & 1) != 0) { r = r * x; } x = x * x; k = k >> 1u; }
  return r;
}
fn zyx_upow(b: u32, e: u32) -> u32 {
  var r: u32 = 1u; var x: u32 = b; var k: u32 = e;
  loop { if (k == 0u) { break; } if ((k & 1u) != 0u) { r = r * x; } x = x * x; k = k >> 1u; }
  return r;
}
fn zyx_f2bf(x: f32) -> u32 {
  // float -> bfloat16 bits, rounded to nearest even, NaN kept quiet
  let u = bitcast<u32>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) { return ((u >> 16u) | 64u) & 0xffffu; }
  return ((u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u) & 0xffffu;
}
fn zyx_bf2f(h: u32) -> f32 { return bitcast<f32>(h << 16u); }
fn zyx_f2h(x: f32) -> u32 {
  // float -> float16 bits, rounded to nearest even, in integer steps: NVIDIA's driver
  // folds unpack2x16float(pack2x16float(x)) back into x, dropping the rounding
  let u = bitcast<u32>(x);
  let sign = (u >> 16u) & 0x8000u;
  let a = u & 0x7fffffffu;
  if (a > 0x7f800000u) { return sign | 0x7e00u; }
  if (a >= 0x477ff000u) { return sign | 0x7c00u; }
  if (a >= 0x38800000u) {
    return sign | (((a + 0x0fffu + ((a >> 13u) & 1u)) - 0x38000000u) >> 13u);
  }
  return sign | u32(round(bitcast<f32>(a) * 16777216.0));
}
fn zyx_h2f(h: u32) -> f32 { return unpack2x16float(h).x; }
"""


class UniformPlan:
    """How a kernel over the storage-buffer limit binds its small read-only buffers (the
    runtime's values read at launch): `single`, argument numbers bound as uniform buffers
    of their own; `arena`, {argument number: word offset} of those copied at launch into
    one uniform buffer (binding `nargs + 1`, `arena_words` words), once the uniform
    bindings run out too. Empty when the kernel fits."""
    __slots__ = ("single", "arena", "arena_words")

    def __init__(self, single=frozenset(), arena=None, arena_words=0):
        self.single = frozenset(single)
        self.arena = dict(arena or {})
        self.arena_words = arena_words

    def key(self):
        return (self.single, tuple(sorted(self.arena.items())))

    def __bool__(self):
        return bool(self.single or self.arena)

    def __contains__(self, argno):
        return argno in self.single or argno in self.arena


NO_UNIFORMS = UniformPlan()


class WGSLKernel:
    """A kernel written as WGSL: its dispatches (`passes`: (source, (x, y) workgroups) in
    order, entry point `main`), the storage buffers they bind (`nargs`, in argument
    order, then a scratch buffer of `scratch` bytes at binding `nargs` when `scratch` > 0:
    the partial results of a split reduction) and the strategy that wrote it."""
    __slots__ = ("passes", "nargs", "strategy", "threads", "scratch", "iterations",
                 "uniforms")

    def __init__(self, passes, nargs, strategy, threads, scratch=0, iterations=0):
        self.passes = passes
        self.nargs = nargs
        self.strategy = strategy
        self.threads = threads
        self.scratch = scratch
        self.iterations = iterations    # most loop iterations one invocation runs
        self.uniforms = NO_UNIFORMS     # small read-only buffers as uniforms (UniformPlan)

    @property
    def source(self):
        return "\n".join(src for src, _ in self.passes)

    @property
    def groups(self):
        return self.passes[0][1]

    def __repr__(self):
        return f"WGSLKernel({self.strategy}, passes={len(self.passes)}, nargs={self.nargs})"


def supports(kernel):
    """None when WGSL can run `kernel`, else the reason: a buffer of a dtype it has no type
    for (float64, int64, uint64), a uint64 value, or a buffer beyond 2^31 - 1 elements."""
    for d, n, ro in kernel.args:
        if d is dt.int64 and ro and n <= PARAM_LEN:
            continue          # values read at launch (slice starts): see load_global
        if d in UNSUPPORTED:
            return f"{d.name} buffers"
        if n > INT32_MAX:
            return f"a buffer of {n} elements (index math is 32-bit)"
    for op in kernel.ops:
        if op[0] != K.CONST and op[1] is dt.uint64:
            return "uint64 values"
        if op[0] == K.DEFINE and op[2] == K.SCOPE_LOCAL:
            return "workgroup-memory buffers in the IR"
    return None


def fold(groups, limit=MAX_GROUPS):
    """(x, y) workgroup counts covering `groups` (x * y >= groups), y > 1 only when
    `groups` exceeds `limit` in one dimension."""
    if groups <= limit:
        return (max(groups, 1), 1)
    y = -(-groups // limit)
    return (-(-groups // y), y)


def wtype(d):
    """The WGSL type a value of zyx dtype d is computed in."""
    if d.is_bool:
        return "bool"
    if d.is_float:
        return "f32"
    return "u32" if d.kind == "u" else "i32"


def literal(d, v):
    """WGSL literal of value v as zyx dtype d (computed in wtype(d))."""
    if d.is_bool:
        return "true" if v else "false"
    if d.is_float:
        v = float(v)
        if math.isnan(v):
            return "bitcast<f32>(0x7fc00000u)"
        if d is dt.float16 or d is dt.bfloat16:
            v = round_half(d, v)          # a 16-bit constant is its dtype's value
        try:
            bits = struct.unpack("<I", struct.pack("<f", v))[0]
        except OverflowError:         # beyond float32: infinity, as a float32 cast gives
            bits = 0x7f800000 if v > 0 else 0xff800000
        f = struct.unpack("<f", struct.pack("<I", bits))[0]
        if math.isinf(f):
            return f"bitcast<f32>({bits:#x}u)"
        if f == 0.0:
            return "-0.0f" if math.copysign(1.0, f) < 0 else "0.0f"
        return f"bitcast<f32>({bits:#x}u)" if abs(f) < 1.2e-38 else f"{f!r}f"
    v = int(v)
    if d.kind == "u":
        return f"{v & 0xffffffff}u"
    if v == -(1 << 31):
        return "i32(-2147483647 - 1)"
    if not -(1 << 31) < v < (1 << 31):
        v = ((v + (1 << 31)) & 0xffffffff) - (1 << 31)   # int64 index constants wrap as i32
        if v == -(1 << 31):
            return "i32(-2147483647 - 1)"
    return f"{v}i" if v >= 0 else f"({v}i)"


def wrap(d, e):
    """Expression e (computed in wtype(d)) brought back into dtype d's range, as a C cast to
    the narrow type would: masked for unsigned, sign-extended for signed."""
    if d.is_int and d.itemsize < 4:
        bits = d.itemsize * 8
        if d.kind == "u":
            return f"(({e}) & {(1 << bits) - 1}u)"
        return f"((({e}) << {32 - bits}u) >> {32 - bits}u)"
    return e


def _wide_compare(ops, op):
    """"true"/"false" for a comparison of a 32-bit value with an int64 constant outside
    the 32-bit range (`a == 2**40` on int32 `a`: the mathematical answer, as the C
    backend's 64-bit compare gives), None otherwise."""
    b = op[2]
    for side in (0, 1):
        c = ops[op[4 - side]]      # side 0: the constant on the right
        if c[0] == K.CONST and c[1] is dt.int64 and not -(1 << 31) <= int(c[2]) < (1 << 31):
            big = int(c[2]) > 0
            if b == K.B_EQ:
                return "false"
            if b == K.B_NOTEQ:
                return "true"
            # x < C is true when C is above every 32-bit value; C < x mirrors it
            less = (b == K.B_CMPLT) == (side == 0)
            return "true" if less == big else "false"
    return None


def _as_bool(d, e):
    return e if d.is_bool else f"({e} != {literal(d, 0)})"


class _Writer:
    def __init__(self, kernel, uniforms=NO_UNIFORMS):
        self.kernel = kernel
        self.uniforms = uniforms     # argument numbers bound as uniform buffers
        self.ops = kernel.ops
        self.names = {}
        self.lines = []
        self.vec_bufs = set()        # argument numbers declared as vec4 arrays (_write_vec)
        self.lane = {}               # access op -> expression read/written instead (_write_vec)
        self.globals = {}            # DEFINE position -> (argno, dtype, written)
        written = {op[2] for op in self.ops if op[0] == K.STORE}
        for i, op in enumerate(self.ops):
            if op[0] == K.DEFINE and op[2] == K.SCOPE_GLOBAL:
                self.globals[i] = (op[3], op[1], i in written)

    # -- buffers ----------------------------------------------------------------------------
    def declarations(self):
        out = []
        for i, (argno, d, written) in sorted(self.globals.items(), key=lambda t: t[1][0]):
            if argno in self.uniforms.arena:
                continue
            if argno in self.uniforms:
                words = -(-self.kernel.args[argno][1] * d.itemsize // 16)
                out.append(f"@group(0) @binding({argno}) var<uniform> g{argno}: "
                           f"array<vec4<u32>, {max(words, 1)}>;")
                continue
            if d in PACKED or d is dt.int64:
                t = "array<atomic<u32>>" if written else "array<u32>"
            elif argno in self.vec_bufs:
                t = f"array<vec4<{wtype(d)}>>"
            else:
                t = f"array<{wtype(d)}>"
            out.append(f"@group(0) @binding({argno}) var<storage, read_write> g{argno}: {t};")
        if self.uniforms.arena:
            out.append(f"@group(0) @binding({len(self.kernel.args) + 1}) var<uniform> "
                       f"zyx_arena: array<vec4<u32>, {self.uniforms.arena_words // 4}>;")
        return out

    def load_global(self, define, index):
        argno, d, written = self.globals[define]
        buf = f"g{argno}"
        if argno in self.uniforms.arena:
            off = self.uniforms.arena[argno]

            def at(w):
                return f"zyx_arena[({off} + {w}) >> 2u][({off} + {w}) & 3]"
        elif argno in self.uniforms:
            # a uniform array's elements are 16 bytes: word w is lane w & 3 of vector w >> 2
            def at(w):
                return f"{buf}[({w}) >> 2u][({w}) & 3]"
        else:
            def at(w):
                return f"{buf}[{w}]"
        if d is dt.int64:         # a launch value: its low word (PARAM_LEN)
            return f"bitcast<i32>({at(f'2 * ({index})')})"
        if d not in PACKED:
            if argno in self.uniforms:
                return at(index) if wtype(d) == "u32" else f"bitcast<{wtype(d)}>({at(index)})"
            if argno in self.vec_bufs:
                return f"{buf}[({index}) / 4][({index}) % 4]"
            return f"{buf}[{index}]"
        bits = PACKED[d]
        per = 32 // bits
        word = at(f"({index}) >> {per.bit_length() - 1}u")
        if written:
            word = f"atomicLoad(&{word})"
        shift = f"(u32(({index}) & {per - 1}) * {bits}u)"
        mask = f"{(1 << bits) - 1}u"
        if d.kind == "i":
            return f"(bitcast<i32>({word} << ({32 - bits}u - {shift})) >> {32 - bits}u)"
        raw = f"(({word} >> {shift}) & {mask})"
        if d.is_bool:
            return f"({raw} != 0u)"
        if d is dt.float16:
            return f"zyx_h2f({raw})"
        if d is dt.bfloat16:
            return f"zyx_bf2f({raw})"
        return raw

    def store_global(self, define, index, value, ind):
        argno, d, _ = self.globals[define]
        buf = f"g{argno}"
        if argno in self.vec_bufs:
            return [f"{ind}{buf}[({index}) / 4][({index}) % 4] = {value};"]
        if d not in PACKED:
            return [f"{ind}{buf}[{index}] = {value};"]
        bits = PACKED[d]
        per = 32 // bits
        mask = (1 << bits) - 1
        if d.is_bool:
            raw = f"select(0u, 1u, {value})"
        elif d is dt.float16:
            raw = f"zyx_f2h({value})"
        elif d is dt.bfloat16:
            raw = f"zyx_f2bf({value})"
        elif d.kind == "i":
            raw = f"(bitcast<u32>({value}) & {mask}u)"
        else:
            raw = f"({value} & {mask}u)"
        # the element's bits are cleared, then set: two atomics, each on the whole word, so
        # a neighbour's store into the same word in between keeps its bits
        return [f"{ind}{{",
                f"{ind}  let w = ({index}) >> {per.bit_length() - 1}u;",
                f"{ind}  let s = u32(({index}) & {per - 1}) * {bits}u;",
                f"{ind}  atomicAnd(&{buf}[w], ~({mask}u << s));",
                f"{ind}  atomicOr(&{buf}[w], {raw} << s);",
                f"{ind}}}"]

    # -- values -----------------------------------------------------------------------------
    def v(self, j):
        return self.names[j]

    def alu(self, i, op):
        c, d = op[0], op[1]
        ops, v = self.ops, self.v
        t = wtype(d)
        if c == K.CAST:
            sd = ops[op[2]][1]
            x = v(op[2])
            if d.is_bool:
                return _as_bool(sd, x)
            if sd.is_bool:
                return f"select({literal(d, 0)}, {literal(d, 1)}, {x})"
            if d.is_float:
                e = f"f32({x})"
                if d is dt.float16:
                    return f"zyx_h2f(zyx_f2h({e}))"
                if d is dt.bfloat16:
                    return f"zyx_bf2f(zyx_f2bf({e}))"
                return e
            if sd.is_float:
                # NaN converts to 0 (C leaves it undefined; the C backend pins it to 0);
                # WGSL's float -> int conversion saturates
                if d.kind == "u" and d.itemsize == 4:
                    e = f"select(0u, select(u32(i32({x})), u32({x}), {x} >= 0.0), !zyx_isnan({x}))"
                elif d.kind == "u":
                    e = f"select(0u, u32(i32({x})), !zyx_isnan({x}))"
                else:
                    e = f"select(0i, i32({x}), !zyx_isnan({x}))"
                return wrap(d, e)
            return wrap(d, f"{t}({x})") if wtype(sd) != t else wrap(d, x) if (
                sd.itemsize > d.itemsize or (sd.kind != d.kind)) else x
        if c == K.WHERE:
            cond = _as_bool(ops[op[2]][1], v(op[2]))
            return f"select({v(op[4])}, {v(op[3])}, {cond})"
        if c == K.MAD:
            return wrap(d, f"({v(op[2])} * {v(op[3])} + {v(op[4])})")
        if c == K.UNARY:
            u, x = op[2], v(op[3])
            if u == K.U_NEG:
                if d.is_bool:
                    return f"(!{x})"
                return wrap(d, f"(0u - {x})" if d.kind == "u" else f"(-{x})")
            if u == K.U_BITNOT:
                return f"(!{x})" if d.is_bool else wrap(d, f"(~{x})")
            if u == K.U_RECIP:
                if d.is_float:
                    return f"(1.0f / {x})"
                return wrap(d, f"select({literal(d, 0)}, {literal(d, 1)} / {x}, {x} != {literal(d, 0)})")
            if not d.is_float:
                if u in (K.U_FLOOR, K.U_TRUNC):
                    return x
                if u == K.U_ABS:
                    return f"abs({x})" if d.kind == "i" else x
                if d.is_bool:
                    return f"({_UNARY_F[u]}(f32({x})) != 0.0)"
                return wrap(d, f"{t}({_UNARY_F[u]}(f32({x})))")
            return f"{_UNARY_F[u]}({x})"
        # BINARY
        b, x, y = op[2], v(op[3]), v(op[4])
        xd = ops[op[3]][1]
        if d.is_bool and b in (K.B_ADD, K.B_MUL):
            b = K.B_OR if b == K.B_ADD else K.B_AND
        if b in _COMPARE and not xd.is_float:
            known = _wide_compare(ops, op)
            if known is not None:
                return known
        if b in _COMPARE and xd.is_bool and b in (K.B_CMPLT, K.B_CMPGT):
            return f"(u32({x}) {_COMPARE[b]} u32({y}))"
        if b in _COMPARE:
            if xd.is_float and op[3] == op[4] and b in (K.B_NOTEQ, K.B_EQ):
                return f"zyx_isnan({x})" if b == K.B_NOTEQ else f"(!zyx_isnan({x}))"
            if xd.is_float and b == K.B_NOTEQ:
                # unordered: true when either is NaN, whatever the driver makes of !=
                return f"(!({x} == {y}))"
            if xd.is_float:
                # ordered: false when either is NaN. The NaN tests are by the bits and
                # spelled out, because NVIDIA's driver turns select(x, c, x > c) into its
                # own min/max, which drops a NaN x (relu and clamp of NaN gave 0 and c)
                keep = [f"!zyx_isnan({e})" for i, e in ((op[3], x), (op[4], y))
                        if not _non_nan_constant(ops[i])]
                return f"(({x} {_COMPARE[b]} {y}){''.join(' && ' + k for k in keep)})"
            return f"({x} {_COMPARE[b]} {y})"
        if b == K.B_OR:
            return f"({_as_bool(xd, x)} || {_as_bool(ops[op[4]][1], y)})"
        if b == K.B_AND:
            return f"({_as_bool(xd, x)} && {_as_bool(ops[op[4]][1], y)})"
        if b == K.B_SUB and d.is_float and op[3] == op[4]:
            # x - x (isfinite's test): NaN for inf and NaN, 0 otherwise, spelled out since
            # drivers fold it to 0
            return f"select(bitcast<f32>(0x7fc00000u), 0.0f, zyx_isfinite({x}))"
        if b in _ARITH:
            return wrap(d, f"({x} {_ARITH[b]} {y})")
        if b in _BITS:
            if d.is_bool:
                return {"^": f"({x} != {y})", "|": f"({x} | {y})", "&": f"({x} & {y})"}[_BITS[b]]
            return wrap(d, f"({x} {_BITS[b]} {y})")
        if b in (K.B_SHL, K.B_SHR):
            sh = f"(u32({y}) & 31u)"
            return wrap(d, f"({x} {'<<' if b == K.B_SHL else '>>'} {sh})")
        if b in (K.B_MAX, K.B_MIN) and d.is_float:
            return float_extreme(b, x, y)
        if b == K.B_MAX:
            return f"max({x}, {y})" if not d.is_bool else f"({x} || {y})"
        if b == K.B_MIN:
            return f"min({x}, {y})" if not d.is_bool else f"({x} && {y})"
        if b in (K.B_DIV, K.B_MOD) and not d.is_float and d.kind == "i":
            return wrap(d, f"{'zyx_sdiv' if b == K.B_DIV else 'zyx_smod'}({x}, {y})")
        if b in (K.B_DIV, K.B_MOD) and not d.is_float:
            # x / 0 and x % 0 are 0 (the C backend's rule)
            z = literal(d, 0)
            sym = "/" if b == K.B_DIV else "%"
            return wrap(d, f"select({x} {sym} {y}, {z}, {y} == {z})")
        if b == K.B_DIV:
            yop = ops[op[4]]
            if yop[0] == K.CONST and float(yop[2]) == 0.0:
                # x / 0 spelled out: drivers fold a division by a zero constant to 0
                neg = math.copysign(1.0, float(yop[2])) < 0
                inf, ninf = "bitcast<f32>(0x7f800000u)", "bitcast<f32>(0xff800000u)"
                pos, negv = (ninf, inf) if neg else (inf, ninf)
                return (f"select(select({negv}, {pos}, {x} > 0.0f), bitcast<f32>(0x7fc00000u), "
                        f"{x} == 0.0f || zyx_isnan({x}))")
            return f"({x} / {y})"
        if b == K.B_MOD:
            return f"zyx_fmod({x}, {y})"
        if b == K.B_POW:
            if d.is_float:
                return f"zyx_pow({x}, {y})"
            if d.kind == "u":
                return wrap(d, f"zyx_upow({x}, {y})")
            return wrap(d, f"zyx_ipow({x}, {y})")
        raise AssertionError(f"cannot write binary op {b}")

    def value(self, i, op, ind):
        """The line defining SSA value i (a LOAD or an ALU op)."""
        d = op[1]
        self.names[i] = f"v{i}"
        if op[0] == K.LOAD:
            src = self.ops[op[2]]
            if src[2] == K.SCOPE_REGISTER:
                e = self.v(op[2]) + (f"[{self.v(op[3])}]" if op[3] >= 0 else "")
            elif i in self.lane:
                e = self.lane[i]
            else:
                e = self.load_global(op[2], self.v(op[3]))
                if op[4] >= 0:
                    # WebGPU clamps out-of-bounds accesses, so the unguarded load is safe
                    e = f"select({literal(d, 0)}, {e}, {_as_bool(self.ops[op[4]][1], self.v(op[4]))})"
            return f"{ind}let v{i}: {wtype(d)} = {e};"
        e = self.alu(i, op)
        if op[0] != K.CAST and i in half_rounds(self.ops):   # a cast to 16 bits rounds already
            e = f"zyx_h2f(zyx_f2h({e}))" if d is dt.float16 else f"zyx_bf2f(zyx_f2bf({e}))"
        return f"{ind}let v{i}: {wtype(d)} = {e};"

    def register_define(self, i, op, ind):
        d = op[1]
        self.names[i] = f"acc{i}"
        if op[5] == 1:
            return [f"{ind}var acc{i}: {wtype(d)} = {literal(d, op[3])};"]
        out = [f"{ind}var acc{i}: array<{wtype(d)}, {op[5]}>;"]
        if op[3] is not None:
            out.append(f"{ind}for (var q: i32 = 0; q < {op[5]}; q++) {{ acc{i}[q] = "
                       f"{literal(d, op[3])}; }}")
        return out


def loop_lines(var, n, ind, start="0", step=1):
    """The line(s) opening a loop of `var` over start, start + step, ... < n (closed by one
    `}`, or `}}` when chunked: see LOOP_CHUNK)."""
    if -(-n // step) <= LOOP_CHUNK:
        inc = f"{var}++" if step == 1 else f"{var} += {step}"
        return [f"{ind}for (var {var}: i32 = {start}; {var} < {n}; {inc}) {{"]
    span = step * LOOP_CHUNK
    inc = f"{var}++" if step == 1 else f"{var} += {step}"
    return [f"{ind}for (var {var}_c: i32 = {start}; {var}_c < {n}; {var}_c += {span}) {{ "
            f"let {var}_e: i32 = min({n}, {var}_c + {span});",
            f"{ind}for (var {var}: i32 = {var}_c; {var} < {var}_e; {inc}) {{"]


def loop_iterations(ops, spread=None):
    """Loop iterations one invocation runs (every loop's trips times its enclosing loops'),
    top-level loops in `spread` ({LOOP position: invocations sharing it}) divided."""
    spread = spread or {}
    total, stack = 0, [1]
    for i, op in enumerate(ops):
        if op[0] == K.LOOP:
            trips = -(-op[2] // spread.get(i, 1)) * stack[-1]
            total += trips
            stack.append(trips)
        elif op[0] == K.ENDLOOP:
            stack.pop()
    return total


def _index_names(ops):
    """INDEX position -> (axis, length), in op order."""
    return {i: (op[2], op[3]) for i, op in enumerate(ops) if op[0] == K.INDEX}


UNIFORM_MAX_BYTES = 1024     # read-only buffers this small may be bound as uniforms




def uniform_args(kernel, max_storage, max_uniform):
    """The UniformPlan of `kernel`: nothing while its buffers fit the storage-buffer limit;
    else its smallest read-only buffers, up to the uniform-buffer limit as uniform buffers
    of their own, the rest in one arena (16-byte slots) until the storage buffers left fit."""
    n = len(kernel.args)
    if n <= max_storage:
        return NO_UNIFORMS
    small = sorted((nel * d.itemsize, a) for a, (d, nel, ro) in enumerate(kernel.args)
                   if ro and 0 < nel * d.itemsize <= UNIFORM_MAX_BYTES)
    need = n - max_storage
    if need <= max_uniform:
        return UniformPlan(a for _, a in small[:need])
    single = [a for _, a in small[:max(max_uniform - 1, 0)]]
    arena, off = {}, 0
    for size, a in small[len(single):]:
        if len(arena) >= need - len(single) + 1 or max_uniform < 1:
            break
        arena[a] = off
        off += -(-size // 16) * 4            # 16-byte slots (the arena is read as vec4s)
    return UniformPlan(single, arena, off)


def write(kernel, max_groups=MAX_GROUPS, max_threads=WORKGROUP, f64_totals=False,
          uniforms=NO_UNIFORMS, strategy=None, wg=None, per=None, products=None, units=1):
    """The WGSLKernel of `kernel` (a zyx Kernel); the caller checked `supports`.
    `f64_totals`: the device has `shader-f64`, so long serial float sums may total in f64.
    `uniforms`: argument numbers bound as uniform buffers (`uniform_args`).
    `strategy`: None (chosen by the heuristics below), "serial" or "rows" (the autotuner's
    candidates, `strategies`; "rows" falls back to serial where it cannot apply); `wg`
    the invocations per workgroup (None: 256; a power of two for rows); `per` the outputs
    per invocation of a loop-free kernel (None: EW_DEFAULT's for large ones). `products`: the
    device's product tiles (wgsl/gemm.py `Products`: (kernel, walker, max_groups) ->
    WGSLKernel or None), tried first unless `strategy` names another strategy. `units`:
    the device's compute units (WebGPU reports none: the backend's estimate), for
    `_rows_plan`'s few-outputs rule."""
    if products is not None and strategy in (None, "gemm"):
        k = products(kernel, _Writer(kernel, uniforms), max_groups)
        if k is not None:
            k.uniforms = uniforms
            return k
    ops = kernel.ops
    index = _index_names(ops)
    outputs = 1
    for _, n in index.values():
        outputs *= n
    plan = None if strategy == "serial" else _rows_plan(kernel, outputs, strategy == "rows",
                                                        units * ROW_FEW_OUTPUTS_PER_UNIT)
    if plan is not None:
        k = _write_rows(kernel, index, outputs, plan, max_groups, f64_totals, uniforms,
                        min(max_threads, wg or rows_tuning()["wg"]))
    else:
        loop_free = not any(op[0] == K.LOOP for op in ops)
        var = ew_variant() if loop_free and outputs >= EW_PER_MIN else None
        if var is not None and wg is None:
            wg = var["wg"]
        k = _write_serial(kernel, index, outputs, max_groups,
                          min(max_threads, wg or WORKGROUP), f64_totals, uniforms, per, var)
    k.uniforms = uniforms
    return k


def _decompose(index, gid, ind):
    """Lines naming each INDEX value from the linear output id `gid` (u32): the highest
    axis moves fastest (row-major, as the C backend's loop nest)."""
    out, stride = [], 1
    names = {}
    for i, (axis, n) in sorted(index.items(), key=lambda t: -t[1][0]):
        e = f"{gid} / {stride}u" if stride > 1 else gid
        out.append(f"{ind}let i{i}: i32 = i32(({e}) % {n}u);")
        names[i] = f"i{i}"
        stride *= n
    return out, names


def _body(w, start, ind, skip=None, hooks=None):
    """Walk ops from `start`, writing them into w.lines (the plain serial walk); `hooks`
    may replace the writing of LOOP/ENDLOOP ops (the rows strategy)."""
    ops = w.ops
    depth = len(ind) // 2
    skip = hooks.skip if hooks else ()
    for i in range(start, len(ops)):
        if hooks is not None and i == hooks.stop:
            break
        op = ops[i]
        c = op[0]
        ind = "  " * depth
        if i in skip:
            if c == K.CONST:
                w.names[i] = literal(op[1], op[2])
            continue
        if c == K.CONST:
            w.names[i] = literal(op[1], op[2])
        elif c == K.DEFINE:
            if op[2] == K.SCOPE_GLOBAL:
                w.names[i] = f"g{op[3]}"
            else:
                w.lines.extend(w.register_define(i, op, ind))
        elif c == K.INDEX:
            pass                      # named by the frame
        elif c == K.LOOP:
            w.names[i] = f"r{i}"
            opened = hooks.open_loop(i, op, ind) if hooks else None
            w.lines.extend(opened if opened is not None else loop_lines(f"r{i}", op[2], ind))
            depth += 1
        elif c == K.ENDLOOP:
            depth -= 1
            ind = "  " * depth
            closed = hooks.close_loop(i, op, ind) if hooks else None
            w.lines.extend(closed if closed is not None else
                           [f"{ind}}}" + ("}" if ops[op[2]][2] > LOOP_CHUNK else "")])
        elif c == K.END_IF:
            depth -= 1
            w.lines.append("  " * depth + "}")
        elif c == K.IF_OP:
            w.lines.append(f"{ind}if ({_as_bool(ops[op[2]][1], w.v(op[2]))}) {{")
            depth += 1
        elif c == K.STORE:
            dst = ops[op[2]]
            if dst[2] == K.SCOPE_REGISTER:
                sub = f"[{w.v(op[3])}]" if op[3] >= 0 else ""
                w.lines.append(f"{ind}{w.v(op[2])}{sub} = {w.v(op[4])};")
            elif i in w.lane:
                w.lines.append(f"{ind}{w.lane[i]} = {w.v(op[4])};")
            else:
                w.lines.extend(w.store_global(op[2], w.v(op[3]), w.v(op[4]), ind))
        elif c == K.BARRIER:
            raise AssertionError("BARRIER in a kernel given to the WGSL writer")
        else:
            w.lines.append(w.value(i, op, ind))


def _assemble(w, head, groups, strategy, threads, workgroup, extra_decls=()):
    src = "\n".join([*w.declarations(), *extra_decls, PRELUDE,
                     f"@compute @workgroup_size({workgroup})",
                     "fn main(@builtin(workgroup_id) wid: vec3<u32>, "
                     "@builtin(local_invocation_id) lid: vec3<u32>) {",
                     *head, *w.lines, "}", ""])
    return WGSLKernel([(src, groups)], len(w.kernel.args), strategy, threads)


SUM_BLOCK = 256       # iterations a serial float sum adds before folding into its total


class _SerialHooks:
    """Long float sums of the serial strategy in blocks: each block of SUM_BLOCK
    iterations sums into a fresh partial that is then added to the accumulator with Kahan's
    compensation, or into a float64 total where the adapter has `shader-f64` (the float64
    totals the kernelizer makes elsewhere; tensors stay without float64), so rounding
    grows with the block length, not the loop's."""
    skip = frozenset()
    stop = None

    def __init__(self, w, f64_totals=False):
        self.w = w
        self.f64 = f64_totals
        ops = w.ops
        ends = {op[2]: i for i, op in enumerate(ops) if op[0] == K.ENDLOOP}
        self.loops = {}
        for t, end in ends.items():
            if ops[t][2] <= SUM_BLOCK:
                continue
            accs = _loop_accumulators(ops, t, end)
            sums = [a for a, rop in (accs or {}).items()
                    if rop == K.R_SUM and ops[a][1].is_float]
            if accs is not None and sums:
                self.loops[t] = sums
        self.ends = {ends[t]: t for t in self.loops}

    def open_loop(self, i, op, ind):
        sums = self.loops.get(i)
        if sums is None:
            return None
        w, n, b = self.w, op[2], SUM_BLOCK
        if self.f64:
            lines = [f"{ind}var acc{a}_t: f64 = f64(acc{a});" for a in sums]
        else:
            lines = [f"{ind}var acc{a}_c: f32 = 0.0f;" for a in sums]
        lines.append(f"{ind}for (var r{i}_b: i32 = 0; r{i}_b < {n}; r{i}_b += {b}) {{")
        for a in sums:
            lines.append(f"{ind}var acc{a}_p: f32 = 0.0f;")
            w.names[a] = f"acc{a}_p"
        lines.append(f"{ind}for (var r{i}: i32 = r{i}_b; r{i} < min({n}, r{i}_b + {b}); r{i}++) {{")
        return lines

    def close_loop(self, i, op, ind):
        t = self.ends.get(i)
        if t is None:
            return None
        lines = [f"{ind}}}"]
        for a in self.loops[t]:
            self.w.names[a] = f"acc{a}"
            if self.f64:
                lines.append(f"{ind}acc{a}_t = acc{a}_t + f64(acc{a}_p);")
            else:
                # Kahan's compensation (drivers that reassociate float math may drop it)
                lines += [f"{ind}{{ let y = acc{a}_p - acc{a}_c; let t = acc{a} + y; "
                          f"acc{a}_c = (t - acc{a}) - y; acc{a} = t; }}"]
        lines.append(f"{ind}}}")
        if self.f64:
            lines += [f"{ind}acc{a} = f32(acc{a}_t);" for a in self.loops[t]]
        return lines


def ew_variant(spec=None):
    """{per, vec, wg} of large loop-free kernels: EW_DEFAULT updated by `spec` (default:
    the ZYX_WGSL_EW environment variable, e.g. "per=2,vec=4,wg=256")."""
    return read_variant(EW_ENV, EW_DEFAULT, EW_LIMITS, spec)


def _write_serial(kernel, index, outputs, max_groups, workgroup, f64_totals=False,
                  uniforms=NO_UNIFORMS, per=None, variant=None):
    """`variant`: `ew_variant()` for a large loop-free kernel (None: one output per
    invocation unless `per` says otherwise)."""
    loop_free = not any(op[0] == K.LOOP for op in kernel.ops)
    vec = variant["vec"] if variant is not None else 1
    if per is None:
        per = variant["per"] if variant is not None else 1
    if loop_free and vec > 1:
        k = _write_vec(kernel, index, outputs, max_groups, workgroup, uniforms, per, vec)
        if k is not None:
            return k
    if per > 1 and loop_free:
        return _write_serial_per(kernel, index, outputs, max_groups, workgroup, uniforms, per)
    w = _Writer(kernel, uniforms)
    nwg = -(-outputs // workgroup)
    groups = fold(nwg, max_groups)
    head = [f"  let gid: u32 = (wid.y * {groups[0]}u + wid.x) * {workgroup}u + lid.x;"]
    if groups[0] * groups[1] * workgroup != outputs:
        head.append(f"  if (gid >= {outputs}u) {{ return; }}")
    lines, names = _decompose(index, "gid", "  ")
    head.extend(lines)
    w.names.update(names)
    _body(w, 0, "  ", hooks=_SerialHooks(w, f64_totals))
    k = _assemble(w, head, groups, "serial", outputs, workgroup)
    k.iterations = loop_iterations(kernel.ops)
    return k


def _write_serial_per(kernel, index, outputs, max_groups, workgroup, uniforms, per):
    """A loop-free kernel with `per` outputs per invocation, grid-strided (the invocations
    of one step touch consecutive elements)."""
    w = _Writer(kernel, uniforms)
    nwg = -(-outputs // (workgroup * per))
    groups = fold(nwg, max_groups)
    stride = groups[0] * groups[1] * workgroup
    head = [f"  let base: u32 = (wid.y * {groups[0]}u + wid.x) * {workgroup}u + lid.x;",
            f"  for (var e: u32 = 0u; e < {per}u; e++) {{",
            f"    let gid: u32 = base + e * {stride}u;",
            f"    if (gid >= {outputs}u) {{ break; }}"]
    lines, names = _decompose(index, "gid", "    ")
    head.extend(lines)
    w.names.update(names)
    _body(w, 0, "    ")
    w.lines.append("  }")
    k = _assemble(w, head, groups, "serial", outputs, workgroup)
    return k


def _vector_buffers(kernel, uniforms, vec):
    """({access op: offset}, argument numbers) of the buffers `_write_vec` declares as
    vec4 arrays: 32-bit, not packed nor uniform, and every access of them at the flat
    output index plus a multiple of 4 (`elementwise_accesses`); ({}, ()) when the kernel's
    other accesses are not coalesced (a gather, a transpose) or none qualifies."""
    ops = kernel.ops
    flat, coalesced = elementwise_accesses(ops, vec)
    if not coalesced or not flat:
        return {}, ()
    by_arg = {}
    for i, op in enumerate(ops):
        if op[0] in (K.LOAD, K.STORE) and ops[op[2]][0] == K.DEFINE \
                and ops[op[2]][2] == K.SCOPE_GLOBAL:
            by_arg.setdefault(ops[op[2]][3], []).append(i)
    args = tuple(a for a, acc in sorted(by_arg.items())
                 if kernel.args[a][0] in VEC_DTYPES and a not in uniforms
                 and all(i in flat for i in acc))
    return {i: flat[i] for a in args for i in by_arg[a]}, args


def _write_vec(kernel, index, outputs, max_groups, workgroup, uniforms, per, vec):
    """A loop-free kernel in tiles of `workgroup * per * vec` consecutive outputs per
    workgroup: step k of an invocation covers the `vec` (4) outputs from
    `(k * workgroup + lid) * 4` of the tile, so each step is coalesced; buffers accessed
    only there are vec4 arrays, read and written a vec4 per step (naga checks the bounds
    of each access: a quarter as many checks as scalars). The ragged last tile runs one
    guarded output per invocation and iteration. None when no buffer qualifies."""
    flat, args = _vector_buffers(kernel, uniforms, vec)
    if not args:
        return None
    w = _Writer(kernel, uniforms)
    w.vec_bufs = set(args)
    ops = kernel.ops
    tile = workgroup * per * vec
    tiles = -(-outputs // tile)
    if (tiles + 1) * tile > INT32_MAX:
        return None
    groups = fold(tiles, max_groups)
    head = [f"  let grp: u32 = wid.y * {groups[0]}u + wid.x;",
            f"  if (grp >= {tiles}u) {{ return; }}",
            f"  let base: u32 = grp * {tile}u;"]
    argno = {i: ops[ops[i][2]][3] for i in flat}
    loads = [i for i in sorted(flat) if ops[i][0] == K.LOAD]
    stores = [i for i in sorted(flat) if ops[i][0] == K.STORE]
    full = outputs % tile == 0
    w.lines.append("  if (base + " + f"{tile}u <= {outputs}u) {{" if not full else "  {")
    for k in range(per):
        w.lines.append(f"    let p{k}: u32 = base + ({k * workgroup}u + lid.x) * {vec}u;")
        w.lines.append(f"    let q{k}: i32 = i32(p{k} / {vec}u);")
        for i in loads:
            off = flat[i] // vec
            at = f"q{k} + {off}" if off else f"q{k}"
            w.lines.append(f"    let a{i}_{k} = g{argno[i]}[{at}];")
        for i in stores:
            w.lines.append(f"    var o{i}_{k}: vec4<{wtype(kernel.args[argno[i]][0])}>;")
        for j in range(vec):
            w.lines.append("    {")
            w.lane = {i: f"a{i}_{k}[{j}]" for i in loads}
            w.lane.update({i: f"o{i}_{k}[{j}]" for i in stores})
            lines, names = _decompose(index, f"(p{k} + {j}u)", "      ")
            w.lines.extend(lines)
            w.names.update(names)
            _body(w, 0, "      ")
            w.lines.append("    }")
        w.lane = {}
        for i in stores:
            off = flat[i] // vec
            at = f"q{k} + {off}" if off else f"q{k}"
            w.lines.append(f"    g{argno[i]}[{at}] = o{i}_{k};")
    w.lines.append("  }")
    if not full:
        w.lines.append("  else {")
        w.lines.append(f"    for (var gid: u32 = base + lid.x; gid < min(base + {tile}u, "
                       f"{outputs}u); gid += {workgroup}u) {{")
        lines, names = _decompose(index, "gid", "      ")
        w.lines.extend(lines)
        w.names.update(names)
        _body(w, 0, "      ")
        w.lines.append("    }")
        w.lines.append("  }")
    return _assemble(w, head, groups, "serial", outputs, workgroup)


# -- the rows strategy ----------------------------------------------------------------------

def strategies(kernel):
    """The strategies `write` can take for `kernel` ("serial" always; "rows" where its
    loops allow it), for the autotuner."""
    out = ["serial"]
    if _rows_plan(kernel, 1, True) is not None:
        out.append("rows")
    return out


def _rows_plan(kernel, outputs, force=False, few=0):
    """None, or what the rows strategy needs: the top-level loops of the kernel (each spread
    over a workgroup) and, per loop, the register accumulators it reduces into. Taken when
    every top-level loop is long (with the loops it wraps, `flat_run`), one invocation's
    serial work would be large or the outputs are `few` at most, and each
    loop's body touches registers only as `acc = acc op x` on length-1 accumulators
    defined outside it (the kernelizer's reduce form), with no IF and no nested register
    arrays."""
    ops = kernel.ops
    ends = {op[2]: i for i, op in enumerate(ops) if op[0] == K.ENDLOOP}
    tops, depth = [], 0
    for i, op in enumerate(ops):
        c = op[0]
        if c == K.IF_OP:
            return None
        if c == K.LOOP:
            if depth == 0:
                tops.append(i)
            depth += 1
        elif c == K.ENDLOOP:
            depth -= 1
    if not tops:
        return None
    if force:
        return _rows_loops(ops, tops, ends)
    work = 0
    for t in tops:
        if flat_trips(ops, flat_run(ops, t)) < ROW_MIN_LOOP:
            return None
        trip = 1
        for j in range(t, ends[t]):
            if ops[j][0] == K.LOOP:
                trip *= ops[j][2]
        work += trip
    # short loops over many outputs stay serial, unless their loads walk memory along the
    # loop (softmax rows): then one invocation per row reads with a stride and a workgroup
    # per row reads consecutive words
    if work < ROW_MIN_SERIAL_WORK and outputs > max(few, 1) and not all(
            contiguous_loads(ops, range(t, ends[t]), t) for t in tops):
        return None
    if outputs > MAX_GROUPS * MAX_GROUPS:
        return None
    return _rows_loops(ops, tops, ends)


def flat_run(ops, t, ends=None):
    """The loops the rows strategy spreads over a workgroup as one flat loop for the
    top-level loop at `t`: `t` and the loops it perfectly wraps (nothing but constants
    between them, `gpu.analysis.thread_run`), the innermost moving fastest, so that
    neighbouring invocations read neighbouring elements; just [t] when its body is more
    than one loop."""
    run = thread_run(ops, t, ends if ends is not None else loop_ends(ops))
    return run if run[0] == t else [t]


def flat_trips(ops, run):
    """Iterations of the flat loop over `run`."""
    return math.prod(ops[j][2] for j in run)


def _rows_loops(ops, tops, ends):
    """{top-level LOOP: (its ENDLOOP, accumulators)} or None where a loop's registers
    cannot be combined across invocations (`_loop_accumulators`)."""
    loops = {}
    for t in tops:
        accs = _loop_accumulators(ops, t, ends[t])
        if accs is None or any(ops[a][1] is dt.bool_ for a in accs):
            return None
        loops[t] = (ends[t], accs)
    # registers read after a spread loop but written inside none of them (nothing to
    # combine) are fine; registers written outside loops are per-invocation copies of the
    # same value, fine too
    return loops


def _loop_accumulators(ops, t, end):
    """{register DEFINE: reduce op} of the length-1 registers defined before LOOP t that its
    body updates as `acc = acc op x` (the kernelizer's reduce form), or None when the body
    touches such registers any other way (a partial value read mid-loop, an indexed
    register). Registers defined inside the body are private to an iteration: left out."""
    accs = {}
    for j in range(t + 1, end):
        op = ops[j]
        if op[0] == K.STORE and ops[op[2]][0] == K.DEFINE and ops[op[2]][2] == K.SCOPE_REGISTER:
            acc = op[2]
            if acc > t:
                continue
            dop = ops[acc]
            if dop[5] != 1 or op[3] >= 0:
                return None
            val = ops[op[4]]
            if val[0] != K.BINARY or val[2] not in K.REDUCE_BINARY:
                return None
            rop = K.REDUCE_BINARY.index(val[2])
            if dop[6] is not None and dop[6] != rop:
                return None
            accs[acc] = rop
    for j in range(t + 1, end):
        op = ops[j]
        if op[0] == K.LOAD and op[2] in accs:
            users = [k for k in range(j + 1, end) if j in _operands(ops[k])]
            if len(users) != 1 or ops[users[0]][0] != K.BINARY:
                return None
    return accs


def _operands(op):
    """SSA operands of any op: an ALU op's (cstyle.alu_operands), a load's or store's
    index and guard, an if's condition."""
    c = op[0]
    if c == K.LOAD or c == K.STORE:
        return (op[3], op[4])
    if c == K.IF_OP:
        return (op[2],)
    return alu_operands(op)


def combine(d, rop, x, y):
    """WGSL expression combining two partial accumulators x, y of reduce op rop."""
    b = K.REDUCE_BINARY[rop]
    if b == K.B_ADD:
        e = f"{x} + {y}" if not d.is_bool else f"{x} || {y}"
    elif b == K.B_MUL:
        e = f"{x} * {y}"
    elif d.is_float:
        e = float_extreme(b, x, y)
    else:
        e = f"max({x}, {y})" if b == K.B_MAX else f"min({x}, {y})"
    return wrap(d, f"({e})")


def _non_nan_constant(op):
    """Whether IR op `op` is a constant that is not NaN (a comparison with it needs no NaN
    test on that side)."""
    return op[0] == K.CONST and not math.isnan(float(op[2]))


def float_extreme(b, x, y):
    """WGSL of the float max (b == B_MAX) or min of expressions x and y: a NaN wins (x's
    first), a tie (-0.0 vs 0.0) keeps x, as torch.maximum. The NaN tests are outermost and
    by the bits: NVIDIA's driver turns select(x, y, x < y) into its own max, which drops a
    NaN x, so the comparison alone must not decide a NaN."""
    cmp = f"{x} < {y}" if b == K.B_MAX else f"{y} < {x}"
    return (f"select(select(select({x}, {y}, {cmp}), {y}, zyx_isnan({y})), {x}, "
            f"zyx_isnan({x}))")


def rows_tuning(spec=None):
    """{cache, wg} of the rows strategy: REDUCE_DEFAULT updated by `spec` (default: the
    ZYX_WGSL_REDUCE environment variable)."""
    out = read_variant(REDUCE_ENV, REDUCE_DEFAULT, {"wg": 1024}, spec)
    if out["cache"] not in (0, 1):
        raise ValueError(f"{REDUCE_ENV}={spec!r}: cache is 0 or 1")
    if out["wg"] < 2 or out["wg"] & (out["wg"] - 1):
        raise ValueError(f"{REDUCE_ENV}={spec!r}: wg is a power of two from 2")
    return out


class _RowValues:
    """The dialect question `gpu.reduce.row_cache` asks (does a load convert what it
    reads?): the rows strategy caches the loaded register values, after any conversion."""

    @staticmethod
    def load_convert(d, x):
        return x


def rows_cache(ops, plan, wg):
    """The RowCache of a rows kernel: each spread top-level loop is a nest whose run is
    the loop itself (its inner loops stay whole in one invocation); loads of a read-only
    buffer repeated at the same element by a later spread loop, where every invocation
    runs the same count (at most gpu.reduce.ROW_CACHE_ITEMS) of both loops."""
    nests = [Nest(t, end, [t], list(accs), False, ops[t][2]) for t, (end, accs) in
             sorted(plan.items())]
    cache = row_cache(_RowValues, ops, nests, wg)
    # the cache answers plain loads only (a guarded load keeps its select on memory)
    for j in [j for j in cache.uses if ops[j][4] >= 0]:
        del cache.uses[j]
    return cache


class _RowHooks:
    """Opens each top-level loop as a loop strided over the workgroup's invocations and
    closes it with a workgroup tree reduction of its accumulators. With `split` = (parts,
    phase): phase 1 spreads the one loop over `parts` workgroups per output and stops after
    it (invocation 0 stores the group's partial into the scratch buffer); phase 2 replaces
    the loop by one over the parts' partials and goes on with the rest of the kernel."""

    def __init__(self, w, plan, wg, split=None, f64_totals=False, cache=None):
        self.w = w
        self.plan = plan
        self.cache = cache if cache is not None else RowCache()
        self.declared = set()
        if self.cache.uses:
            self._cache_values()
        self.inner = _SerialHooks(w, f64_totals)    # long float sums inside spread loops
        self.wg = wg
        self.ends = {end: t for t, (end, _) in plan.items()}
        self.slots = 0
        self.split = split
        self.stop = None
        self.skip = frozenset()
        # spread loops collapsed with the loops they wrap (top loop -> its run): not with
        # the row cache (it counts the top loop's own iterations) or a split (one loop)
        self.runs = {}
        if split is None and not self.cache.uses:
            for t in plan:
                run = flat_run(w.ops, t)
                if len(run) > 1:
                    self.runs[t] = run
        self.collapsed = {j for run in self.runs.values() for j in run[1:]}
        self.collapsed_ends = {e for e, op in enumerate(w.ops)
                               if op[0] == K.ENDLOOP and op[2] in self.collapsed}
        if split is not None:
            (t, (end, _)), = plan.items()
            if split[1] == 1:
                self.stop = end + 1
            else:
                self.skip = frozenset(range(t + 1, end))

    def _cache_values(self):
        """Loads answered from the row cache read its array (`w.lane`); the loads that
        fill it store their value there too."""
        w = self.w
        for j, (slot, _) in self.cache.uses.items():
            w.lane[j] = f"zyx_c{slot}[zyx_k{self._loop_of(j)}]"
        value = w.value

        def value_and_keep(i, op, ind):
            line = value(i, op, ind)
            source = self.cache.sources.get(i)
            if source is None:
                return line
            return f"{line}\n{ind}zyx_c{source[0]}[zyx_k{self._loop_of(i)}] = v{i};"
        w.value = value_and_keep

    def _loop_of(self, j):
        return next(t for t, (end, _) in self.plan.items() if t < j < end)

    def open_loop(self, i, op, ind):
        if i in self.collapsed:
            return []             # its variable is decoded from the flat loop's
        if i not in self.plan:
            return self.inner.open_loop(i, op, ind)
        run = self.runs.get(i)
        if run is not None:
            ops = self.w.ops
            lines = loop_lines(f"f{i}", flat_trips(ops, run), ind, "i32(lid.x)", self.wg)
            stride = 1
            for j in reversed(run):
                e = f"f{i}" if stride == 1 else f"f{i} / {stride}"
                if j != run[0]:
                    e = f"({e}) % {ops[j][2]}"
                lines.append(f"{ind}  let r{j}: i32 = {e};")
                stride *= ops[j][2]
            return lines
        if self.split is None and i in self.cache.counted:
            # a fixed count per invocation: zyx_k{i} indexes the row cache
            lines = [f"{ind}var zyx_c{slot}: array<{wtype(d)}, {n}>;"
                     for slot, (d, n) in enumerate(self.cache.slots) if slot not in self.declared]
            self.declared.update(range(len(self.cache.slots)))
            k = f"zyx_k{i}"
            return lines + [f"{ind}for (var {k}: i32 = 0; {k} < {op[2] // self.wg}; {k}++) {{",
                            f"{ind}  let r{i}: i32 = i32(lid.x) + {k} * {self.wg};"]
        if self.split is None:
            return loop_lines(f"r{i}", op[2], ind, "i32(lid.x)", self.wg)
        parts, phase = self.split
        if phase == 1:
            start, step = f"i32(part) * {self.wg} + i32(lid.x)", self.wg * parts
            if self._split_ilp(op[2], step):
                # SPLIT_ILP strided iterations per trip of the loop: their loads are
                # independent of the running sum, so they are in flight together
                return [f"{ind}for (var r{i}_o: i32 = {start}; r{i}_o < {op[2]}; "
                        f"r{i}_o += {step * SPLIT_ILP}) {{",
                        f"{ind}for (var r{i}_u: i32 = 0; r{i}_u < {SPLIT_ILP}; r{i}_u++) {{",
                        f"{ind}  let r{i}: i32 = r{i}_o + r{i}_u * {step};"]
            return loop_lines(f"r{i}", op[2], ind, start, step)
        (acc, rop), = self.plan[i][1].items()
        d = self.w.ops[acc][1]
        x = f"zyx_part[i32(row) * {parts} + q]"
        return [f"{ind}for (var q: i32 = i32(lid.x); q < {parts}; q += {self.wg}) {{",
                f"{ind}  acc{acc} = {combine(d, rop, f'acc{acc}', x)};"]

    @staticmethod
    def _split_ilp(n, step):
        """Whether a split's first pass over `n` iterations strided by `step` runs
        SPLIT_ILP of them per trip: where they divide the loop evenly (no guard)."""
        return n % (step * SPLIT_ILP) == 0 and n // (step * SPLIT_ILP) <= LOOP_CHUNK

    def close_loop(self, i, op, ind):
        if i in self.collapsed_ends:
            return []
        t = self.ends.get(i)
        if t is None:
            return self.inner.close_loop(i, op, ind)
        accs = self.plan[t][1]
        if self.split is not None and self.split[1] == 2:
            lines = [f"{ind}}}"]
        elif self.split is not None and self._split_ilp(self.w.ops[t][2],
                                                          self.wg * self.split[0]):
            lines = [f"{ind}}}}}"]
        else:
            step = self.wg * (self.split[0] if self.split else 1)
            trips = flat_trips(self.w.ops, self.runs.get(t, [t]))
            lines = [f"{ind}}}" + ("}" if -(-trips // step) > LOOP_CHUNK else "")]
        for acc, rop in sorted(accs.items()):
            d = self.w.ops[acc][1]
            name = f"acc{acc}"
            arr = f"red_{wtype(d)}"
            comb = combine(d, rop, f"{arr}[lid.x]", f"{arr}[lid.x + s]")
            self.slots |= {"f32": 1, "i32": 2, "u32": 4}[wtype(d)]
            lines += [f"{ind}{arr}[lid.x] = {name};",
                      f"{ind}workgroupBarrier();",
                      f"{ind}for (var s: u32 = {self.wg // 2}u; s > 0u; s = s >> 1u) {{",
                      f"{ind}  if (lid.x < s) {{ {arr}[lid.x] = {comb}; }}",
                      f"{ind}  workgroupBarrier();",
                      f"{ind}}}",
                      f"{ind}{name} = {arr}[0];",
                      f"{ind}workgroupBarrier();"]
            if self.split is not None and self.split[1] == 1:
                lines.append(f"{ind}if (lid.x == 0u && live) {{ zyx_part[gid] = {name}; }}")
        return lines


SPLIT_MIN_LOOP = 1 << 16      # a reduce loop at least this long over few outputs is split
SPLIT_MAX_OUTPUTS = 64        # ... when the kernel has at most this many outputs
SPLIT_ELEMENTS = 256          # loop iterations per invocation aimed at by a split
# iterations of a split's first pass run per trip of its loop (independent loads in
# flight: one 4-byte load per invocation at a time cannot keep an H200's memory busy)
SPLIT_ILP = 4


def _split_parts(kernel, outputs, plan, wg):
    """How many workgroups share each output's reduce loop (0: no split): for a kernel of
    few outputs with one long top-level loop reducing into one accumulator and storing
    nothing inside it."""
    if outputs > SPLIT_MAX_OUTPUTS or len(plan) != 1:
        return 0
    (t, (end, accs)), = plan.items()
    n = kernel.ops[t][2]
    if n < SPLIT_MIN_LOOP or len(accs) != 1:
        return 0
    if any(kernel.ops[j][0] == K.STORE and kernel.ops[kernel.ops[j][2]][2] == K.SCOPE_GLOBAL
           for j in range(t, end)):
        return 0
    return max(2, min(1024, -(-n // (wg * SPLIT_ELEMENTS))))


def _write_rows(kernel, index, outputs, plan, max_groups, f64_totals=False,
                uniforms=NO_UNIFORMS, wg=ROW_WORKGROUP):
    """One workgroup per output element (see the module docstring); a long loop over few
    outputs is split over several workgroups per output and a second pass (`_split_parts`)."""
    parts = _split_parts(kernel, outputs, plan, wg)
    if not parts:
        src, groups, _ = _rows_pass(kernel, index, outputs, plan, max_groups, None, f64_totals,
                                    uniforms, wg)
        return WGSLKernel([(src, groups)], len(kernel.args), "rows", outputs * wg,
                          iterations=loop_iterations(kernel.ops, dict.fromkeys(plan, wg)))
    passes = [_rows_pass(kernel, index, outputs, plan, max_groups, (parts, phase),
                         f64_totals, uniforms, wg)[:2]
              for phase in (1, 2)]
    return WGSLKernel(passes, len(kernel.args), "split", outputs * parts * wg,
                      scratch=4 * outputs * parts, iterations=loop_iterations(
                          kernel.ops, dict.fromkeys(plan, wg * parts)))


def _rows_pass(kernel, index, outputs, plan, max_groups, split, f64_totals=False,
               uniforms=NO_UNIFORMS, wg=ROW_WORKGROUP):
    w = _Writer(kernel, uniforms)
    parts = split[0] if split is not None and split[1] == 1 else 1
    groups = fold(outputs * parts, max_groups)
    head = [f"  let gid: u32 = wid.y * {groups[0]}u + wid.x;"]
    # no early return: every invocation must reach the barriers; out-of-range groups
    # compute on a clamped id and do not store
    live = groups[0] * groups[1] == outputs * parts
    head.append(f"  let live: bool = {'true' if live else f'gid < {outputs * parts}u'};")
    g = "gid" if live else f"min(gid, {outputs * parts - 1}u)"
    if parts > 1:
        head.append(f"  let row: u32 = {g} / {parts}u;")
        head.append(f"  let part: u32 = {g} % {parts}u;")
    else:
        head.append(f"  let row: u32 = {g};")
    lines, names = _decompose(index, "row", "  ")
    head.extend(lines)
    w.names.update(names)
    cache = rows_cache(kernel.ops, plan, wg) if split is None and rows_tuning()["cache"] \
        else None
    hooks = _RowHooks(w, plan, wg, split, f64_totals, cache)
    _guard_stores(w, plan, live)
    _body(w, 0, "  ", hooks=hooks)
    decls = [f"var<workgroup> red_{t}: array<{t}, {wg}>;"
             for bit, t in ((1, "f32"), (2, "i32"), (4, "u32")) if hooks.slots & bit]
    if split is not None:
        (acc, _), = next(iter(plan.values()))[1].items()
        decls.append(f"@group(0) @binding({len(kernel.args)}) var<storage, read_write> "
                     f"zyx_part: array<{wtype(kernel.ops[acc][1])}>;")
    src = _assemble(w, head, groups, "rows", 0, wg, decls).passes[0][0]
    return src, groups, None


def _guard_stores(w, plan, live):
    """Global stores inside a spread loop are each done by the invocation that owns the
    iteration; those outside every spread loop by invocation 0 only, and by no one in a
    padding group."""
    inside = set()
    for t, (end, _) in plan.items():
        inside.update(range(t, end))
    store_global = w.store_global
    order = []
    for i, op in enumerate(w.ops):
        if op[0] == K.STORE and w.ops[op[2]][2] == K.SCOPE_GLOBAL:
            order.append((i, i in inside))
    flags = iter(order)
    cond = "lid.x == 0u && live"
    cond_in = "live"

    def store(define, index, value, ind):
        _, is_inside = next(flags)
        c = cond_in if is_inside else cond
        body = store_global(define, index, value, ind + ("  " if c else ""))
        if c is None:
            return body
        return [f"{ind}if ({c}) {{", *body, f"{ind}}}"]

    w.store_global = store
