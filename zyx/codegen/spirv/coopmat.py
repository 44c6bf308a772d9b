"""Cooperative-matrix products for the SPIR-V writer (Vulkan's VK_KHR_cooperative_matrix:
NVIDIA's tensor cores, AMD's and Intel's matrix units): float16 and bfloat16 matmuls,
batched matmuls, linear layers and convolutions as implicit GEMM, multiplied by the
subgroup's matrix instructions into float32 accumulators.

The analysis is the shared-memory tiles' (`gpu/gemm.plan`, as `spirv/gemm.py` uses it:
rows, cols, batch, one flat K, operands `a` and `b`, masks, block totals, epilogue); a
kernel is taken when both operands are float16 (or bfloat16) and the accumulator float32,
and the device lists a subgroup-scope shape of that dtype with float32 accumulators
(`DeviceInfo.coop_shapes`, filled by the Vulkan backend; 16x16x16 preferred). The K loop
and the copies are `spirv/gemm.py`'s (`GemmWriter`: every invocation of the group copies
its share of both operand tiles, each value computed by the kernel's own op closure, so
masks, padding and convolution windows stay right; 0 past the ends; the next step's
values read during this step's products); what changes is what the tiles hold and who
multiplies them:
- the staged tiles hold the operands' 16-bit patterns (an operand that is a plain load of
  the 16-bit buffer is copied as its bits, no conversion; a computed one is converted
  exactly with the integer rounding of `writer.f2h`), rows of the K step where the
  operand is contiguous along K (`a_kfast`/`b_kfast`: MatrixA RowMajor, MatrixB
  ColumnMajor), else rows of its own side (ColumnMajor / RowMajor), each row padded by
  PAD elements (16 bytes) against bank conflicts;
- a plain load stepping by 1 along the copy's fast direction, whose length there is a
  multiple of 8 (`gpu.gemm.vector_lanes`: K of a row-major `a`, N of a row-major `b`),
  is copied 8 values at a time: one 16-byte load through a uvec4 view of its binding
  (value by value where its index is not a multiple of 8: a view with an offset) and one
  16-byte store into a tile of uvec4s, which the cooperative loads read with the Stride
  in uvec4s (the pointer's type may differ from the matrix's components);
- the group's WM x WN subgroups (`SubgroupId`, the implementation's numbering) each own
  FM x FN fragments of the tile and, per fragment-K of the step, load FM A and FN B
  fragments with OpCooperativeMatrixLoadKHR (Stride in elements of the pointee type:
  16-bit words, or uvec4s) and multiply them into their float32 accumulators with
  OpCooperativeMatrixMulAddKHR;
- two staged copies of each operand tile where workgroup memory holds them (steps
  alternate: one barrier per step instead of two; ZYX_VK_COOPMAT_DOUBLE=0: one copy);
- after the K loop each accumulator is stored (OpCooperativeMatrixStoreKHR, RowMajor)
  into the subgroup's own M x N float32 scratch; after a subgroup barrier every
  invocation of the subgroup runs the kernel's epilogue (bias, activation, cast) and the
  guarded store for its share of the fragment's outputs (`GemmWriter.output`, the float
  tiles' epilogue), then a second barrier frees the scratch for the next fragment.
Products with block totals (over more than gpu.gemm.PLAIN_K terms) add the accumulators
into total matrices every block of K (OpFAdd on cooperative matrices), as the float
tiles do.

Memory model: SPV_KHR_cooperative_matrix requires the Vulkan memory model (capability
VulkanMemoryModel, OpMemoryModel Vulkan, SPV_KHR_vulkan_memory_model below SPIR-V 1.5);
the device enables VkPhysicalDeviceVulkanMemoryModelFeatures.vulkanMemoryModel. In that
model plain accesses are private to their invocation, so every access to the staged tiles
and the scratch that another invocation reads is non-private and made available (stores)
or visible (loads) at workgroup scope, as glslang writes `shared` variables; the group
and subgroup barriers (AcquireRelease | WorkgroupMemory) then order them.

Knobs (read at each compile): ZYX_VK_COOPMAT=0 turns the strategy off (see `requested`;
read at device start too: then the extension is not enabled and the float tiles take
these products); ZYX_VK_COOPMAT_TILE=BMxBNxBK[:WMxWN] forces a tile (BM, BN multiples of
the fragment's sides times the subgroups along them, BK of the fragment's K) and optionally
the subgroup grid; ZYX_VK_COOPMAT_VECTOR=0 copies every operand value by value;
ZYX_VK_COOPMAT_DOUBLE=0 stages one copy of the operand tiles (two barriers a step); the
float tiles' ZYX_VK_GEMM=0 turns this strategy off too, and their
ZYX_VK_GEMM_PREFETCH=0 copies each step's values at its start.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from ... import dtype as dt
from ..._core import kernel as K
from ..gpu import gemm as G
from . import builder as B
from . import gemm as spirv_gemm
from .writer import SpirvKernel, uses_dtypes

COOPMAT_ENV = "ZYX_VK_COOPMAT"
TILE_ENV = "ZYX_VK_COOPMAT_TILE"
VECTOR_ENV = "ZYX_VK_COOPMAT_VECTOR"
DOUBLE_ENV = "ZYX_VK_COOPMAT_DOUBLE"
VECTOR = G.VEC_BYTES // 2     # 16-bit values per 16-byte copy (one uvec4)
PAD = 8                 # 16-bit elements after each staged row (16 bytes)
# (rows, cols, K step) per group, tried largest first (as gpu.gemm.TILES). 128x256 (2x4
# subgroups of 64x64 outputs) was the fastest of the sweep on an H200 at 4096 (190
# TFLOP/s against 150 for 128x128, benches/gpu_vk_coopmat.py sweep); it needs 512 groups
# of 4096^2 outputs, so smaller products fall to 128x128 through the cover test.
TILES = ((128, 256, 32), (128, 128, 32), (128, 64, 32), (64, 128, 32), (64, 64, 32),
         (64, 32, 32), (32, 64, 32), (32, 32, 32))
MAX_LOCAL = 1024        # invocations per group (Vulkan's guaranteed minimum is 128)
USE_A, USE_B, USE_ACCUMULATOR = 0, 1, 2          # Cooperative Matrix Use
ROW_MAJOR, COLUMN_MAJOR = 0, 1                   # Cooperative Matrix Layout
# memory operands of the accesses other invocations see (module docstring)
SHARED_STORE = B.ACCESS_AVAILABLE | B.ACCESS_NON_PRIVATE
SHARED_LOAD = B.ACCESS_VISIBLE | B.ACCESS_NON_PRIVATE
SEMANTICS_ACQREL_WORKGROUP = B.SEMANTICS_ACQREL_WORKGROUP
DEFAULT_SUBGROUP = 32


class CoopShape(NamedTuple):
    """One shape a device multiplies cooperatively: an M x K A times a K x N B plus an
    M x N C gives the M x N result; component dtypes by name ("float16", "bfloat16",
    "float32", ...), `scope` "subgroup" (or "workgroup", ...)."""
    m: int
    n: int
    k: int
    a: str
    b: str
    c: str
    result: str
    scope: str

    def label(self):
        """MxNxK A,B->C,result (scope)."""
        return f"{self.m}x{self.n}x{self.k} {self.a},{self.b}->{self.c},{self.result} " \
               f"({self.scope})"


class CoopTile:
    """A group's tile: BM x BN outputs per K step of BK, WM x WN subgroups of `subgroup`
    invocations, each owning FM x FN fragments of shape `frag` (a CoopShape)."""
    __slots__ = ("bm", "bn", "bk", "wm", "wn", "fm", "fn", "frag", "subgroup", "buffers")

    def __init__(self, bm, bn, bk, wm, wn, frag, subgroup):
        self.bm, self.bn, self.bk, self.wm, self.wn = bm, bn, bk, wm, wn
        self.fm, self.fn = bm // (wm * frag.m), bn // (wn * frag.n)
        self.frag, self.subgroup = frag, subgroup
        self.buffers = 1        # staged copies of each operand tile (`choose` sets 2)

    @property
    def local(self):
        """Invocations per group."""
        return self.wm * self.wn * self.subgroup

    @property
    def spec(self):
        """The tile as the autotuner stores it: (BM, BN, BK, WM, WN)."""
        return (self.bm, self.bn, self.bk, self.wm, self.wn)

    def label(self):
        return f"{self.bm}x{self.bn}x{self.bk}:{self.wm}x{self.wn}"

    def __repr__(self):
        return f"CoopTile({self.label()}, fragments {self.fm}x{self.fn} of " \
               f"{self.frag.m}x{self.frag.n}x{self.frag.k}, subgroup {self.subgroup}, " \
               f"{self.buffers} staged copies)"


def requested():
    """Whether cooperative matrices may be used: yes unless ZYX_VK_COOPMAT=0 (the float
    tiles then take every product; read at device start and at each compile)."""
    return os.environ.get(COOPMAT_ENV, "1").strip() != "0"


def enabled(info):
    """Whether the strategy may take products on the device `info`: not switched off
    (`requested`), the device lists shapes and the float tiles are on
    (spirv_gemm.enabled)."""
    if not requested():
        return False
    return bool(info.coop_shapes) and spirv_gemm.enabled(info)


def fragment(info, d):
    """The CoopShape products of 16-bit dtype `d` use on the device `info` (subgroup
    scope, d x d into float32), or None: 16x16x16 where listed (every vendor's), else
    the largest."""
    fits = [s for s in info.coop_shapes if s.scope == "subgroup" and s.a == s.b == d.name
            and s.c == s.result == "float32"]
    if not fits:
        return None
    return max(fits, key=lambda s: ((s.m, s.n, s.k) == (16, 16, 16), s.m * s.n * s.k))


def subgroup_size(info):
    """Invocations per subgroup (the module is SPIR-V 1.3: without a varying-size
    pipeline flag, every subgroup has the device's subgroupSize)."""
    return int((info.extra.get("subgroup") or {}).get("size") or DEFAULT_SUBGROUP)


def make_tile(spec, frag, subgroup, what="coopmat tile"):
    """The CoopTile of (BM, BN, BK) or (BM, BN, BK, WM, WN); without WM, WN: two rows of
    subgroups, and four columns where BN has eight fragments (two where it has two).
    ValueError when the fragments do not divide the tile."""
    bm, bn, bk = (int(v) for v in spec[:3])
    if len(spec) >= 5:
        wm, wn = int(spec[3]), int(spec[4])
    else:
        wm = 2 if bm >= 2 * frag.m else 1
        wn = 4 if bn >= 8 * frag.n else 2 if bn >= 2 * frag.n else 1
    if min(bm, bn, bk, wm, wn) < 1 or bm % (wm * frag.m) or bn % (wn * frag.n) or \
            bk % frag.k:
        raise ValueError(f"{what} {bm}x{bn}x{bk}:{wm}x{wn}: rows must be a multiple of "
                         f"{wm} x {frag.m}, cols of {wn} x {frag.n}, the K step of {frag.k}")
    if wm * wn * subgroup > MAX_LOCAL:
        raise ValueError(f"{what}: {wm} x {wn} subgroups of {subgroup} exceed {MAX_LOCAL} "
                         f"invocations")
    return CoopTile(bm, bn, bk, wm, wn, frag, subgroup)


def forced_tile(frag, subgroup):
    """The CoopTile ZYX_VK_COOPMAT_TILE forces (BMxBNxBK[:WMxWN]), or None."""
    spec = os.environ.get(TILE_ENV, "").strip()
    if not spec:
        return None
    dims, _, grid = spec.lower().partition(":")
    try:
        values = [int(v) for v in dims.split("x")] + \
                 ([int(v) for v in grid.split("x")] if grid else [])
    except ValueError:
        values = []
    if len(values) not in (3, 5):
        raise ValueError(f"{TILE_ENV}={spec!r}: expected BMxBNxBK or BMxBNxBK:WMxWN, "
                         f"e.g. 128x128x32:2x4")
    return make_tile(values, frag, subgroup, f"{TILE_ENV}={spec!r}")


def staged_words(p, side, tile):
    """16-bit elements of one operand's staged tile (rows of K or of its side, padded)."""
    length = tile.bm if side == "a" else tile.bn
    kfast = p.a_kfast if side == "a" else p.b_kfast
    return length * (tile.bk + PAD) if kfast else tile.bk * (length + PAD)


def local_bytes(p, tile, buffers=1):
    """Workgroup memory: `buffers` copies of both staged tiles (16-bit) and each
    subgroup's float32 scratch of one fragment."""
    scratch = tile.wm * tile.wn * tile.frag.m * tile.frag.n * 4
    return 2 * buffers * (staged_words(p, "a", tile) + staged_words(p, "b", tile)) + scratch


def buffers(p, tile, info):
    """Staged copies per operand tile: 2 (the K step after this one is staged while this
    one is multiplied: one barrier per step instead of two) where they fit in the
    device's workgroup memory, else 1; ZYX_VK_COOPMAT_DOUBLE=0: 1."""
    if os.environ.get(DOUBLE_ENV, "1").strip() == "0" or not info.local_mem_size:
        return 1
    return 2 if local_bytes(p, tile, 2) <= info.local_mem_size else 1


def fits(p, tile, info):
    """Whether the device runs `tile` for plan `p`: invocations, workgroup memory and
    32-bit positions."""
    if tile.local > (info.max_local_threads or 0):
        return False
    if info.local_mem_size and local_bytes(p, tile) > info.local_mem_size:
        return False
    return max(p.nr + tile.bm, p.nc + tile.bn, p.nk + 2 * tile.bk,
               p.nb * tile.local) < spirv_gemm.INDEX_LIMIT


def choose_tile(p, info, frag, subgroup):
    """The largest tile of TILES that fits the device and whose groups still cover its
    compute units (tiles larger than the product skipped), None when none does (the
    other strategies take the kernel, as gpu.gemm.choose_tile)."""
    cores = max(info.num_cores, 1)
    for spec in TILES:
        try:
            tile = make_tile(spec, frag, subgroup)
        except ValueError:
            continue
        if tile.bm > max(p.nr, 2 * G.MIN_SIDE) or tile.bn > max(p.nc, 2 * G.MIN_SIDE):
            continue
        if fits(p, tile, info) and p.nb * -(-p.nr // tile.bm) * -(-p.nc // tile.bn) >= cores:
            return tile
    return None


def choose(ops, info, schedule=None):
    """(GemmPlan, CoopTile) where this strategy takes a kernel of `ops` on the device
    `info`, else None. `schedule` {"coopmat": (BM, BN, BK, WM, WN)} (the autotuner's)
    or ZYX_VK_COOPMAT_TILE force a tile; a schedule without "coopmat" (a float tile or
    another strategy's knobs) leaves the kernel to the others."""
    if not enabled(info) or (schedule is not None and "coopmat" not in schedule):
        return None
    p = G.plan(ops)
    if p is None or p.narrow is None or p.dtype is not dt.float32:
        return None
    frag = fragment(info, p.narrow)
    if frag is None:
        return None
    sub = subgroup_size(info)
    if schedule is not None:
        tile = make_tile(schedule["coopmat"], frag, sub)
    else:
        tile = forced_tile(frag, sub) or choose_tile(p, info, frag, sub)
    if tile is None or not fits(p, tile, info):
        return None
    tile.buffers = buffers(p, tile, info)
    return p, tile


def wanted(ops, info):
    """True where this strategy takes the kernel (DeviceInfo.own_tiles)."""
    return choose(ops, info) is not None


def own_tiles(info, float_tiles):
    """DeviceInfo.own_tiles of a Vulkan device: the float tiles' (`float_tiles`, None
    where they are off at device start, and this strategy with them) or this one's."""
    if float_tiles is None or not enabled(info):
        return float_tiles
    return lambda ops: float_tiles(ops) or wanted(ops, info)


def candidates(kernel, info):
    """[(label, schedule)] the autotuner may time for a kernel this strategy takes (the
    default first, then the other tiles of TILES, then the float tiles), or None."""
    got = choose(kernel.ops, info)
    if got is None:
        return None
    p, tile = got
    out = [("default", None)]
    for spec in TILES:
        try:
            t = make_tile(spec, tile.frag, tile.subgroup)
        except ValueError:
            continue
        if t.spec != tile.spec and fits(p, t, info):
            out.append((f"coopmat:{t.label()}", {"coopmat": t.spec}))
    out += [c for c in spirv_gemm.candidates(kernel, info) or () if c[1] is not None]
    return out


def write_coopmat(kernel, p, tile, fp64=True, float_controls=()):
    """The SpirvKernel of `kernel` as plan `p` with CoopTile `tile`."""
    w = CoopWriter(kernel, p, tile, fp64, float_controls)
    words = w.write()
    return SpirvKernel(words, tile.local, w.n_groups, "coopmat", 1, uses_dtypes(kernel))


class Staged(NamedTuple):
    """One operand's tile in workgroup memory: the variable, its element pointer type,
    the row stride (16-bit values), whether rows run along K, the cooperative load
    layout, and `unit`, the 16-bit values per array element (1: u16 words; VECTOR:
    uvec4s, where the operand is copied 16 bytes at a time)."""
    var: int
    eptr: int
    stride: int
    kfast: bool
    layout: int
    unit: int
    side: str
    words: int      # 16-bit values per staged copy (the second copy starts there)


class CoopWriter(spirv_gemm.GemmWriter):
    """The kernel written with cooperative matrices (module docstring)."""

    def __init__(self, kernel, p, tile, fp64, float_controls):
        super().__init__(kernel, p, (tile.bm, tile.bn, tile.bk), fp64, float_controls,
                         threads=tile.local)
        self.tile = tile
        self.scratch = {}            # KernelWriter.sub_builtin's variables
        self.m.vulkan_memory_model()

    # -- types and workgroup memory ------------------------------------------------------
    def matrix_types(self):
        """The staged words' type and the three cooperative matrix types."""
        m, f = self.m, self.tile.frag
        self.bits_t = m.type_int(16, False)
        if self.p.narrow is dt.bfloat16:
            comp = m.type_bfloat16()
            m.capability("BFloat16CooperativeMatrixKHR")
        else:
            comp = m.type_float(16)
        scope = B.SCOPE_SUBGROUP
        self.a_t = m.type_cooperative_matrix(comp, scope, f.m, f.k, USE_A)
        self.b_t = m.type_cooperative_matrix(comp, scope, f.k, f.n, USE_B)
        self.c_t = m.type_cooperative_matrix(self.acc_t, scope, f.m, f.n, USE_ACCUMULATOR)
        # (a cooperative matrix constant has one constituent: every element's value)
        self.zero_c = m.const_composite(self.c_t, [self.const(self.p.dtype, 0.0)])

    def workgroup_array(self, t, length):
        """(variable, element pointer type) of a Workgroup array of `length` t values."""
        m = self.m
        arr = m.type_array(t, length)
        var = m.global_variable(m.type_pointer("Workgroup", arr), "Workgroup")
        return var, m.type_pointer("Workgroup", t)

    def staged(self, side):
        p, t = self.p, self.tile
        kfast = p.a_kfast if side == "a" else p.b_kfast
        length = t.bm if side == "a" else t.bn
        unit = self.vector_width(side)
        elem = self.uvec4_t if unit > 1 else self.bits_t
        words = staged_words(p, side, t)
        var, eptr = self.workgroup_array(elem, words * t.buffers // unit)
        # A's rows along K are row-major; B's (K x N) along K are its columns
        layout = (ROW_MAJOR if kfast else COLUMN_MAJOR) if side == "a" else \
            (COLUMN_MAJOR if kfast else ROW_MAJOR)
        return Staged(var, eptr, t.bk + PAD if kfast else length + PAD, kfast, layout, unit,
                      side, words)

    def vector_width(self, side):
        """16-bit values per copy of one operand: VECTOR where it is a plain unguarded
        load that steps by 1 along the copy's fast direction, whose length there is a
        multiple of VECTOR (`gpu.gemm.vector_lanes`), and the staged rows hold whole
        vectors; else 1. ZYX_VK_COOPMAT_VECTOR=0: always 1."""
        if os.environ.get(VECTOR_ENV, "1").strip() == "0":
            return 1
        p, t = self.p, self.tile
        kfast = p.a_kfast if side == "a" else p.b_kfast
        length = t.bm if side == "a" else t.bn
        val = p.a if side == "a" else p.b
        if not self.plain_load(val) or p.masks or (t.bk if kfast else length) % VECTOR:
            return 1
        return VECTOR if G.vector_lanes(self.ops, p, side, kfast, p.narrow) == VECTOR else 1

    def staged_index(self, st, kk, mm):
        """u32 index (16-bit values) of K offset kk and row/col offset mm (u32 ids) in
        the staged copy of the K step being written or multiplied."""
        if st.kfast:
            at = self.uop("IAdd", self.uk("IMul", mm, st.stride), kk)
        else:
            at = self.uop("IAdd", self.uk("IMul", kk, st.stride), mm)
        if self.tile.buffers > 1:
            at = self.uop("IAdd", at, self.copy_base[st.side])
        return at

    def shared_store(self, ptr, v):
        self.m.emit("Store", ptr, v, SHARED_STORE, self.c_u32(B.SCOPE_WORKGROUP))

    def shared_load(self, t, ptr):
        return self.m.op("Load", t, ptr, SHARED_LOAD, self.c_u32(B.SCOPE_WORKGROUP))

    def subgroup_barrier(self):
        self.m.emit("ControlBarrier", self.c_u32(B.SCOPE_SUBGROUP),
                    self.c_u32(B.SCOPE_SUBGROUP), self.c_u32(SEMANTICS_ACQREL_WORKGROUP))

    # -- copies ------------------------------------------------------------------------
    def plain_load(self, val):
        """Whether operand `val` is an unguarded load of a buffer of the 16-bit dtype
        (copied as its bits)."""
        op = self.ops[val]
        return (op[0] == K.LOAD and op[4] < 0 and op[2] in self.bufs and
                op[1] is self.p.narrow and self.bufs[op[2]][2] is self.p.narrow)

    def raw_bits(self, val):
        """The 16 bits load `val` reads, unconverted."""
        op = self.ops[val]
        self.values([op[3]])
        var, eptr, sd = self.bufs[op[2]]
        ptr = self.m.op("AccessChain", eptr, var, self.c_u32(0), self.index_of(op[3])[0])
        return self.m.op("Load", self.stype(sd), ptr)

    def to_bits(self, v):
        """The 16-bit pattern of float32 register v holding a float16 (bfloat16) value:
        exact, through integer ops (no driver rounding or flushing of subnormals)."""
        m = self.m
        if self.p.narrow is dt.bfloat16:
            hi = m.op("ShiftRightLogical", self.u32(), m.op("Bitcast", self.u32(), v),
                      self.c_u32(16))
            return m.op("UConvert", self.bits_t, hi)
        return m.op("UConvert", self.bits_t, self.f2h(v))

    def computed_bits(self, val):
        """The bits of operand `val` computed by its closure, masked."""
        return self.to_bits(self.masked_value(val))

    def copy_bits(self, side, slots, k0):
        """This invocation's 16-bit values of one operand tile at K origin k0 (u32), 0
        past the ends: `GemmWriter.copy_values` with the values as staged words."""
        p = self.p
        val = p.a if side == "a" else p.b
        raw = self.plain_load(val) and not p.masks
        zero = self.m.const(self.bits_t, 0, 16)

        def compute():
            return self.raw_bits(val) if raw else self.computed_bits(val)
        return self.guarded_copies(side, slots, k0, 1, compute, self.bits_t, zero)

    # -- copies 16 bytes at a time --------------------------------------------------------
    def vector_slots(self, side):
        """`GemmWriter.slots` for a side copied in vectors: (slot, flat copy index e, K
        offset kk, row/col offset mm, ragged), each slot VECTOR values along the fast
        direction from (kk, mm)."""
        length = self.br if side == "a" else self.bc
        kfast = self.p.a_kfast if side == "a" else self.p.b_kfast
        per = length * self.bk // VECTOR
        fast = (self.bk if kfast else length) // VECTOR
        out = []
        for s in range(-(-per // self.threads)):
            e = self.uk("IAdd", self.tid, s * self.threads) if s else self.tid
            f = self.uk("IMul", self.uk("UMod", e, fast), VECTOR)
            sl = self.uk("UDiv", e, fast)
            kk, mm = (f, sl) if kfast else (sl, f)
            out.append((s, e, kk, mm, per % self.threads != 0))
        return out

    def word_view(self, define):
        """(variable, element pointer type) of a global buffer viewed as uvec4s: a
        second variable on the same binding."""
        key = ("uvec4", define)
        got = self.vviews.get(key)
        if got is None:
            m = self.m
            argno = self.ops[define][3]
            read_only = self.k.args[argno][2]
            st = m.storage_buffer_struct(self.uvec4_t, 16, key)
            if read_only:
                m.member_decorate(st, 0, "NonWritable")
            var = m.global_variable(m.type_pointer("StorageBuffer", st), "StorageBuffer")
            m.decorate(var, "DescriptorSet", 0)
            m.decorate(var, "Binding", argno)
            got = self.vviews[key] = (var, m.type_pointer("StorageBuffer", self.uvec4_t))
        return got

    def vector_bits(self, val):
        """The VECTOR 16-bit values from load `val`'s index on (a uvec4, the first value
        in the low half of word 0): one 16-byte load where the index is a multiple of
        VECTOR (the view's elements), else VECTOR loads of one value (a view with an
        offset)."""
        m = self.m
        op = self.ops[val]
        self.values([op[3]])
        idx, it = self.index_of(op[3])
        bits = 32 if it == self.i32() else 64
        out = m.function_variable(m.type_pointer("Function", self.uvec4_t))
        aligned = m.op("IEqual", self.boolt(),
                       m.op("BitwiseAnd", it, idx, m.const(it, VECTOR - 1, bits)),
                       m.const(it, 0, bits))
        self.open_if(aligned)
        var, eptr = self.word_view(op[2])
        at = m.op("ShiftRightLogical", it, idx, m.const(it, VECTOR.bit_length() - 1, bits))
        m.emit("Store", out, m.op("Load", self.uvec4_t,
                                  m.op("AccessChain", eptr, var, self.c_u32(0), at)))
        self.close_if()
        self.open_if(m.op("LogicalNot", self.boolt(), aligned))
        var, eptr, sd = self.bufs[op[2]]
        halves = []
        for j in range(VECTOR):
            at = m.op("IAdd", it, idx, m.const(it, j, bits)) if j else idx
            h = m.op("Load", self.stype(sd), m.op("AccessChain", eptr, var, self.c_u32(0), at))
            halves.append(m.op("UConvert", self.u32(), h))
        words = [self.uop("BitwiseOr", lo, self.uk("ShiftLeftLogical", hi, 16))
                 for lo, hi in zip(halves[::2], halves[1::2])]
        m.emit("Store", out, m.op("CompositeConstruct", self.uvec4_t, *words))
        self.close_if()
        return m.op("Load", self.uvec4_t, out)

    def copy_vectors(self, side, slots, k0):
        """This invocation's uvec4s of one operand tile at K origin k0 (0 past the ends:
        a vector is wholly inside or outside, `vector_width`)."""
        val = self.p.a if side == "a" else self.p.b
        zero = self.m.const_composite(self.uvec4_t, [self.c_u32(0)] * 4)
        return self.guarded_copies(side, slots, k0, VECTOR, lambda: self.vector_bits(val),
                                   self.uvec4_t, zero)

    # -- either way ------------------------------------------------------------------------
    def slots(self, side):
        st = self.sa if side == "a" else self.sb
        return self.vector_slots(side) if st.unit > 1 else super().slots(side)

    def side_type(self, side):
        """The type of one copied value of a side (u16, or uvec4 for vectors)."""
        st = self.sa if side == "a" else self.sb
        return self.uvec4_t if st.unit > 1 else self.bits_t

    def copy_values(self, side, slots, k0):
        st = self.sa if side == "a" else self.sb
        if st.unit > 1:
            return self.copy_vectors(side, slots, k0)
        return self.copy_bits(side, slots, k0)

    def store_tile(self, side, slots, vals):
        """Store this invocation's copied values into the side's staged tile."""
        st = self.sa if side == "a" else self.sb
        length = self.br if side == "a" else self.bc
        for (s, e, kk, mm, ragged), v in zip(slots, vals):
            if ragged:
                self.open_if(self.ult(e, length * self.bk // st.unit))
            at = self.staged_index(st, kk, mm)
            if st.unit > 1:
                at = self.uk("UDiv", at, st.unit)
            self.shared_store(self.m.op("AccessChain", st.eptr, st.var, at), v)
            if ragged:
                self.close_if()

    # -- products ----------------------------------------------------------------------
    def fragment_load(self, t, st, pos, q):
        """The cooperative matrix of type t at row/col `pos` (u32 id) and K offset q (an
        int) of a staged tile."""
        m = self.m
        q = self.c_u32(q)
        at = self.staged_index(st, q, pos)
        if st.unit > 1:
            at = self.uk("UDiv", at, st.unit)
        ptr = m.op("AccessChain", st.eptr, st.var, at)
        # (Stride counts elements of the pointer's type: uvec4s of a vector-copied side)
        return m.op("CooperativeMatrixLoadKHR", t, ptr, self.c_u32(st.layout),
                    self.c_u32(st.stride // st.unit), SHARED_LOAD,
                    self.c_u32(B.SCOPE_WORKGROUP))

    def products(self):
        """Every fragment-K of the step multiplied into the accumulators."""
        for q in range(0, self.bk, self.tile.frag.k):
            self.multiply(q)

    def multiply(self, q):
        """The subgroup's A and B fragments at K offset q of the step loaded, each
        accumulator multiplied into."""
        m, t, f = self.m, self.tile, self.tile.frag
        a = [self.fragment_load(self.a_t, self.sa, self.uk("IAdd", self.wr0, i * f.m), q)
             for i in range(t.fm)]
        b = [self.fragment_load(self.b_t, self.sb, self.uk("IAdd", self.wc0, j * f.n), q)
             for j in range(t.fn)]
        for i in range(t.fm):
            for j in range(t.fn):
                var = self.accs[i][j]
                acc = m.op("Load", self.c_t, var)
                m.emit("Store", var, m.op("CooperativeMatrixMulAddKHR", self.c_t,
                                          a[i], b[j], acc))

    def zero_fragments(self):
        """The accumulators (and block totals) as Function variables holding zeros."""
        m, t = self.m, self.tile
        fptr = m.type_pointer("Function", self.c_t)
        self.accs = [[m.function_variable(fptr) for _ in range(t.fn)] for _ in range(t.fm)]
        self.totals = [[m.function_variable(fptr) for _ in range(t.fn)]
                       for _ in range(t.fm)] if self.fold else None
        for row in self.accs + (self.totals or []):
            for var in row:
                m.emit("Store", var, self.zero_c)

    def fold_accumulators(self):
        m = self.m
        for arow, trow in zip(self.accs, self.totals):
            for a, t in zip(arow, trow):
                s = m.op("FAdd", self.c_t, m.op("Load", self.c_t, t),
                         m.op("Load", self.c_t, a))
                m.emit("Store", t, s)
                m.emit("Store", a, self.zero_c)

    def begin_step(self, k0):
        if self.tile.buffers > 1:
            # steps alternate between the two staged copies: step i writes the copy
            # step i - 1 did not read; step i - 2 read it, and every invocation finished
            # those reads before the barrier of step i - 1, which the writer has passed
            parity = self.uk("BitwiseAnd", self.uk("UDiv", k0, self.bk), 1)
            self.copy_base = {st.side: self.uk("IMul", parity, st.words)
                              for st in (self.sa, self.sb)}

    def end_step(self, k0):
        if self.tile.buffers == 1:
            self.barrier()          # the staged tiles are read before the next step writes
        if self.fold:
            self.fold_totals(k0)

    # -- the epilogue ----------------------------------------------------------------------
    def epilogue(self):
        """Each accumulator through the subgroup's scratch: stored cooperatively, then
        each invocation takes outputs lane, lane + subgroup, ... of the fragment."""
        m, t, f = self.m, self.tile, self.tile.frag
        area = f.m * f.n
        var, eptr = self.workgroup_array(self.acc_t, t.wm * t.wn * area)
        base = self.uk("IMul", self.sub_id, area)
        per = -(-area // t.subgroup)
        for i in range(t.fm):
            for j in range(t.fn):
                self.fragment_to_scratch(i, j, var, eptr, base)
                self.subgroup_barrier()
                row0 = self.uop("IAdd", self.r0, self.uk("IAdd", self.wr0, i * f.m))
                col0 = self.uop("IAdd", self.c0, self.uk("IAdd", self.wc0, j * f.n))
                for e in range(per):
                    at = self.uk("IAdd", self.sub_lane, e * t.subgroup) if e else self.sub_lane
                    ragged = (e + 1) * t.subgroup > area
                    if ragged:
                        self.open_if(self.ult(at, area))
                    row = self.uop("IAdd", row0, self.uk("UDiv", at, f.n))
                    col = self.uop("IAdd", col0, self.uk("UMod", at, f.n))
                    x = self.shared_load(self.acc_t,
                                         m.op("AccessChain", eptr, var, self.uop("IAdd", base, at)))
                    self.output(row, col, x)
                    if ragged:
                        self.close_if()
                self.subgroup_barrier()     # the scratch is read before the next store

    def fragment_to_scratch(self, i, j, var, eptr, base):
        """Accumulator (i, j) (plus its totals) stored row-major at element `base` (u32)
        of the Workgroup array `var`."""
        m, f = self.m, self.tile.frag
        v = m.op("Load", self.c_t, self.accs[i][j])
        if self.fold:
            v = m.op("FAdd", self.c_t, m.op("Load", self.c_t, self.totals[i][j]), v)
        m.emit("CooperativeMatrixStoreKHR", m.op("AccessChain", eptr, var, base), v,
               self.c_u32(ROW_MAJOR), self.c_u32(f.n), SHARED_STORE,
               self.c_u32(B.SCOPE_WORKGROUP))

    # -- the kernel ------------------------------------------------------------------------
    def write(self):
        m = self.m
        p, t = self.p, self.tile
        fn_type, entry, entry_label, group, _, _ = self.begin_entry()
        self.tid = self.lane
        self.acc_t = self.rtype(p.dtype)
        self.tile_t = self.rtype(self.mul_dtype)
        self.zero_tile = self.const(self.mul_dtype, 0.0)
        self.uvec4_t = m.type_vector(self.u32(), 4)
        self.matrix_types()
        self.sa, self.sb = self.staged("a"), self.staged("b")
        m.capability("GroupNonUniform")        # SubgroupId, SubgroupLocalInvocationId
        self.sub_id = self.sub_builtin("SubgroupId")
        self.sub_lane = self.sub_builtin("SubgroupLocalInvocationId")
        # this subgroup's fragments: rows wr0 + i * M, cols wc0 + j * N of the tile
        self.wr0 = self.uk("IMul", self.uk("UDiv", self.sub_id, t.wn), t.fm * t.frag.m)
        self.wc0 = self.uk("IMul", self.uk("UMod", self.sub_id, t.wn), t.fn * t.frag.n)
        self.zero_fragments()
        # (the cooperative operations, like the barriers, are then in uniform control flow)
        self.group_body(group)
        return m.words(entry, fn_type, entry_label, self.interface, (t.local, 1, 1))
