"""Tensor-core products: the gemm strategy's lowering for float16 and bfloat16 products on
NVIDIA GPUs of compute capability 8.0 and later (Ampere, Ada, Hopper), through the PTX
warp-level matrix instructions `ldmatrix` and `mma.sync ... m16n8k16` written inline in
the CUDA source (NVRTC compiles them; no header needed). float32 products take the
same path on TF32 (`mma.sync ... m16n8k8 ... tf32`) when the user allows it
(`zyx.set_float32_matmul_precision("high")`, as PyTorch's setting of that name): the
operands are rounded to TF32 (10-bit mantissa, round to nearest) as they are copied to
local memory, and the products accumulate in float32.

The plan, the group's tile and the copies are `gemm`'s: each group of 256 work-items owns
a BR x BC tile of (rows, cols) and walks K in steps of MMA_K (32; 16 where an operand is
computed value by value, or the "mk" knob), copying
both operand tiles into local memory with the kernel's own ops. What differs:
- Local tiles hold the 16-bit values themselves (operands that are loads of the product's
  dtype are copied as bits; computed ones are rounded to it, as the product's dtype
  says). Each tile keeps the layout its global reads have: K fastest when the operand's
  loads are contiguous along K, rows (or cols) fastest otherwise, so a warp's copies
  write consecutive words; `ldmatrix` reads either layout (`.trans` for the second).
- The 8 warps of a group split the tile 2 x 4: a warp owns (BR/2) x (BC/4) outputs, as
  MI x NI fragments of 16 x 8, accumulated in float registers by `mma.sync`.
- Local rows are padded by 16 bytes: ldmatrix's 8 row addresses of one phase then fall
  in 8 different 16-byte bank groups, and stay 16-byte aligned.
- TF32 differs in the value size (4 bytes: a K-fastest 16 x 8 TF32 fragment has the
  bytes of a 16 x 16 16-bit one, so the ldmatrix addressing is the same in bytes), the
  K of one instruction (8), and rows-fastest tiles: ldmatrix's transpose moves 16-bit
  halves, so those fragments are read word by word (rows padded by 8 words: the 32
  lanes' words then fall in 32 different banks).
The epilogue runs the kernel's own ops on each accumulator, as `gemm` does; blocked sums
keep their float totals the same way.
"""
from __future__ import annotations


from .... import dtype as dt
from ...._core import kernel as K
from ..gemm import PLAIN_K, Frame, Slots, buffers, k_loop, reads_windows, vector_lanes

MMA_K = 32                  # K step per local tile where both operands are 16-byte
                            # copies (two m16n8k16 steps), else half (knob "mk")
PAD_BYTES = 16              # padding per local row (ldmatrix layouts)
PAD_WORDS_TF32 = 8          # padding of a rows-fastest TF32 row (read word by word)
WARPS_R, WARPS_C = 2, 4     # a group's 8 warps over its tile's rows x cols
TF32_K = 16                 # K step per local tile of TF32 products (64 bytes a row)
MIN_CC = (8, 0)             # m16n8k16 with bf16, m16n8k8 with tf32 need sm_80

_PTX_TYPE = {dt.float16: "f16", dt.bfloat16: "bf16"}
_ROUND = {dt.float16: "zyx_f2h", dt.bfloat16: "zyx_f2bf"}
# ldmatrix wants a shared-window address: __cvta_generic_to_shared gives it (NVRTC
# declares it without a header). ldmatrix is volatile: it reads memory the compiler does
# not see, so it must stay between the barriers; mma only reads registers, and the
# compiler may schedule it freely.
_PRELUDE = r"""
static __device__ __forceinline__ void zyx_ldm4(unsigned* r, unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a)); }
static __device__ __forceinline__ void zyx_ldm4t(unsigned* r, unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a)); }
static __device__ __forceinline__ void zyx_ldm2(unsigned* r, unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
               : "=r"(r[0]), "=r"(r[1]) : "r"(a)); }
static __device__ __forceinline__ void zyx_ldm2t(unsigned* r, unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
               : "=r"(r[0]), "=r"(r[1]) : "r"(a)); }
"""

# float -> TF32 rounded to nearest (ties away), kept in a float's bits (low 13 bits zero)
_TF32_ROUND = r"""
static __device__ __forceinline__ float zyx_tf32(float x) {
  unsigned r; asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x)); return __uint_as_float(r); }
"""

_MMA = r"""
static __device__ __forceinline__ void zyx_mma_{t}(float* c, const unsigned* a,
                                                    const unsigned* b) {{
  asm("mma.sync.aligned.m16n8k{k}.row.col.f32.{t}.{t}.f32 "
               "{{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1])); }}
"""


def tf32(p, info):
    """True when plan `p` is a float32 product the precision settings of the device let
    run on TF32: any product under `info.float32_precision` "high" or "medium"
    (zyx.set_float32_matmul_precision), a convolution's (gemm.reads_windows) under
    `info.conv_tf32` (zyx.backends.cudnn.allow_tf32, on by default as torch's)."""
    return p.narrow is None and p.dtype is dt.float32 and (
        info.float32_precision != "highest" or (info.conv_tf32 and reads_windows(p)))


def usable(p, dl, info):
    """True when plan `p` is a 16-bit product (or a float32 one allowed TF32) and the
    dialect and device have the matrix instructions this module writes (CUDA C on
    compute capability >= 8.0)."""
    if (p.narrow is None and not tf32(p, info)) or not getattr(dl, "mma_ptx", False):
        return False
    cc = (info.extra or {}).get("cc")
    return cc is not None and tuple(cc) >= MIN_CC


class _RawLoads:
    """A dialect view whose loads of 16-bit values stay bits in `unsigned short`
    registers (an operand that is such a load is copied to local memory unconverted)."""

    def __init__(self, dl):
        self._dl = dl

    def __getattr__(self, name):
        return getattr(self._dl, name)

    def ctype(self, d):
        return "unsigned short" if d in _ROUND else self._dl.ctype(d)

    def load_convert(self, d, expr):
        return expr if d in _ROUND else self._dl.load_convert(d, expr)


def _slots(dl, ops, p, side, tile_len, bk, lanes):
    """How one operand's tile is copied: its local layout (K fastest when its loads are
    contiguous along K), the stored bits, and the register type and zero. 16-bit values
    copied as vectors (`lanes` > 1: a load of the product's dtype, guarded or not) are
    stored as the bits they are."""
    kfast = p.a_kfast if side == "a" else p.b_kfast
    if p.narrow is None:      # TF32: float words, rounded as they are stored
        stride = bk + PAD_BYTES // 4 if kfast else tile_len + PAD_WORDS_TF32
    else:
        stride = (bk if kfast else tile_len) + PAD_BYTES // 2
    if kfast:
        def at(kk, mm):
            return f"{mm} * {stride} + {kk}"
    else:
        def at(kk, mm):
            return f"{kk} * {stride} + {mm}"
    if p.narrow is None:
        return Slots(at, lambda reg: f"zyx_tf32({reg})", "float"), "0.0f", kfast, stride
    val = p.a if side == "a" else p.b
    op = ops[val]
    if (op[0] == K.LOAD or lanes > 1) and op[1] is p.narrow:
        return Slots(at, None, "unsigned short", _RawLoads(dl)), "0", kfast, stride
    rnd = _ROUND[p.narrow]
    return Slots(at, lambda reg: f"{rnd}({reg})", "float"), "0.0f", kfast, stride


def lower_mma(kernel, dl, info, name, p, tile, var):
    """The `GPUKernel` of plan `p` (a float16 or bfloat16 product, or a float32 one on
    TF32) with tile (rows, cols, _) on tensor cores (module docstring); `var`: gemm's
    knobs."""
    ops = kernel.ops
    br, bc, _ = tile
    kfast_a, kfast_b = p.a_kfast, p.b_kfast
    narrow = p.narrow
    local = narrow if narrow is not None else dt.float32     # the local tiles' values
    esz = local.itemsize
    kq = 16 if narrow is not None else 8                    # K of one mma instruction
    # 16-byte copies of plain loads: the lanes are neighbours in either local layout
    lanes_a = vector_lanes(ops, p, "a", kfast_a, local) if var["vector"] else 1
    lanes_b = vector_lanes(ops, p, "b", kfast_b, local) if var["vector"] else 1
    if narrow is None:
        # a window copied as vectors (a channels-last convolution) pays its tests and
        # index math per step: twice the K per step (H200, 64x64x56x56: 0.289 -> 0.275
        # ms; a plain matmul is slower so, 1.216 -> 1.423)
        windows = p.computed and not p.scalar and lanes_a > 1 and lanes_b > 1
        bk = var["mk"] or (2 * TF32_K if windows else TF32_K)
    else:       # (at least one m16n8k16 step)
        bk = max(var["mk"], 16) if var["mk"] else (MMA_K if lanes_a > 1 and lanes_b > 1
                                                    else MMA_K // 2)
    wm, wn = br // WARPS_R, bc // WARPS_C
    mi, ni = wm // 16, wn // 8
    fr = Frame(kernel, dl, p, br, bc, bk, 32 * WARPS_R * WARPS_C)
    slots_a, zero_a, kfast_a, sa = _slots(dl, ops, p, "a", br, bk, lanes_a)
    slots_b, zero_b, kfast_b, sb = _slots(dl, ops, p, "b", bc, bk, lanes_b)
    la = br * sa if kfast_a else bk * sa
    lb = bc * sb if kfast_b else bk * sb
    fold = bool(p.block) and var["fold"] and p.nk > PLAIN_K
    if info.local_mem_size and 2 * esz * (la + lb) > info.local_mem_size:
        var = dict(var, double=0)       # two buffers would not fit
    elif p.scalar and var["double"] == 2:
        # automatic: one buffer where an operand is computed value by value (a
        # convolution's window over an NCHW image; H200, 64x64x56x56 at 64x64: bfloat16
        # 0.334 -> 0.316 ms, TF32 0.369 -> 0.360), two for vector copies (matmul: 6%
        # faster with two; a channels-last window at 64x128: bfloat16 0.233 -> 0.220)
        var = dict(var, double=0)
    nbuf = buffers(var, True)
    lt = "unsigned short" if narrow is not None else "float"
    body = [f"  {dl.local_qualifier}{dl.align16}{lt} zyx_la[{nbuf * la}];",
            f"  {dl.local_qualifier}{dl.align16}{lt} zyx_lb[{nbuf * lb}];"] + fr.head + [
            "  const int zyx_lane = (int)(zyx_tid % 32);",
            "  const int zyx_warp = (int)(zyx_tid / 32);",
            f"  const int zyx_wr = (zyx_warp / {WARPS_C}) * {wm};",
            f"  const int zyx_wc = (zyx_warp % {WARPS_C}) * {wn};",
            "  const int zyx_m8 = zyx_lane >> 3, zyx_r8 = zyx_lane & 7;",
            f"  float zyx_c[{mi}][{ni}][4];"]
    if fold:
        body.append(f"  float zyx_t[{mi}][{ni}][4];")
    body += [f"  #pragma unroll",
             f"  for (int i = 0; i < {mi}; i++)",
             f"    #pragma unroll",
             f"    for (int j = 0; j < {ni}; j++)",
             f"      #pragma unroll",
             f"      for (int q = 0; q < 4; q++) {{",
             "        zyx_c[i][j][q] = 0.0f;" + (" zyx_t[i][j][q] = 0.0f;" if fold else ""),
             "      }"]
    row16 = 16 // esz          # values in the 16 bytes of one ldmatrix row
    # each lane's ldmatrix row address (in values) for fragment 0 of K offset 0: lanes
    # 8q..8q+7 address the rows of the q-th 8 x 8 (16-bit) matrix; a rows-fastest TF32
    # tile is read word by word from lane (g, t) = (lane / 4, lane % 4) instead
    if kfast_a:   # [m][k]: matrices (m 0-7, k 0-15 bytes), (m 8-15, ...), (m 0-7, k 16-31 bytes), ...
        body.append(f"  const int zyx_oa = (zyx_wr + (zyx_m8 & 1) * 8 + zyx_r8) * {sa}"
                    f" + (zyx_m8 >> 1) * {row16};")
    elif narrow is not None:         # [k][m]: the same matrices, stored transposed
        body.append(f"  const int zyx_oa = ((zyx_m8 >> 1) * 8 + zyx_r8) * {sa}"
                    " + zyx_wr + (zyx_m8 & 1) * 8;")
    else:
        body.append(f"  const int zyx_oa = (zyx_lane & 3) * {sa} + zyx_wr + (zyx_lane >> 2);")
    if kfast_b:   # [n][k]: (n 0-7, k 0-15 bytes), (n 0-7, k 16-31 bytes), (n 8-15, ...), ...
        body.append(f"  const int zyx_ob = (zyx_wc + (zyx_m8 >> 1) * 8 + zyx_r8) * {sb}"
                    f" + (zyx_m8 & 1) * {row16};")
    elif narrow is not None:
        body.append(f"  const int zyx_ob = ((zyx_m8 & 1) * 8 + zyx_r8) * {sb}"
                    " + zyx_wc + (zyx_m8 >> 1) * 8;")
    else:
        body.append(f"  const int zyx_ob = (zyx_lane & 3) * {sb} + zyx_wc + (zyx_lane >> 2);")
    if kfast_a or narrow is not None:
        body.append(f"  const unsigned zyx_sa = (unsigned)__cvta_generic_to_shared(zyx_la)"
                    f" + {esz} * zyx_oa;")
    if kfast_b or narrow is not None:
        body.append(f"  const unsigned zyx_sb = (unsigned)__cvta_generic_to_shared(zyx_lb)"
                    f" + {esz} * zyx_ob;")

    t = _PTX_TYPE.get(narrow, "tf32")
    lda = "zyx_ldm4" if kfast_a else "zyx_ldm4t"
    pairs = ni // 2
    ldb = ("zyx_ldm4" if kfast_b else "zyx_ldm4t") if pairs else \
        ("zyx_ldm2" if kfast_b else "zyx_ldm2t")
    words = "__float_as_uint"

    def products(cur):
        out = [f"    unsigned zyx_fa[{mi}][4], zyx_fb[{ni}][2];"]
        if kfast_a or narrow is not None:        # (byte addresses)
            out.append(f"    const unsigned zyx_ba = zyx_sa + {esz} * ({cur['a']});")
        else:
            out.append(f"    const float* zyx_pa = zyx_la + {cur['a']} + zyx_oa;")
        if kfast_b or narrow is not None:
            out.append(f"    const unsigned zyx_bb = zyx_sb + {esz} * ({cur['b']});")
        else:
            out.append(f"    const float* zyx_pb = zyx_lb + {cur['b']} + zyx_ob;")
        for ks in range(0, bk, kq):
            for i in range(mi):
                if kfast_a or narrow is not None:
                    off = i * 16 * sa + ks if kfast_a else ks * sa + i * 16
                    out.append(f"    {lda}(zyx_fa[{i}], zyx_ba + {esz * off});")
                else:      # a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
                    for q, (dm, dk) in enumerate(((0, 0), (8, 0), (0, 4), (8, 4))):
                        off = (ks + dk) * sa + i * 16 + dm
                        out.append(f"    zyx_fa[{i}][{q}] = {words}(zyx_pa[{off}]);")
            if kfast_b or narrow is not None:
                for jp in range(max(pairs, 1)):
                    off = jp * 16 * sb + ks if kfast_b else ks * sb + jp * 16
                    out.append(f"    {ldb}(zyx_fb[{2 * jp}], zyx_bb + {esz * off});")
            else:          # b0 (k t, n g), b1 (k t + 4, n g)
                for j in range(ni):
                    for q in range(2):
                        off = (ks + 4 * q) * sb + j * 8
                        out.append(f"    zyx_fb[{j}][{q}] = {words}(zyx_pb[{off}]);")
            for i in range(mi):
                for j in range(ni):
                    out.append(f"    zyx_mma_{t}(zyx_c[{i}][{j}], zyx_fa[{i}], zyx_fb[{j}]);")
        return out
    after = []
    if fold:
        every = max(p.block // bk, 1)
        after = [f"    if (zyx_kt % {every} == 0) {{",
                 "      #pragma unroll",
                 f"      for (int i = 0; i < {mi}; i++)",
                 "        #pragma unroll",
                 f"        for (int j = 0; j < {ni}; j++)",
                 "          #pragma unroll",
                 "          for (int q = 0; q < 4; q++) {",
                 "            zyx_t[i][j][q] += zyx_c[i][j][q]; zyx_c[i][j][q] = 0.0f;",
                 "          }",
                 "    }"]
    body += k_loop(dl, p, fr, bk, var,
                   [("a", br, kfast_a, slots_a, zero_a, lanes_a, True, la),
                    ("b", bc, kfast_b, slots_b, zero_b, lanes_b, True, lb)], products, after,
                   tensor_cores=True)
    # accumulator q of fragment (i, j): row lane/4 (+8 for q >= 2), col 2 (lane % 4)
    # (+1 for odd q), for both instruction shapes
    outputs = []
    for i in range(mi):
        for j in range(ni):
            for q in range(4):
                acc = f"zyx_c[{i}][{j}][{q}]"
                if fold:
                    acc = f"(zyx_t[{i}][{j}][{q}] + {acc})"
                outputs.append((f"zyx_r0 + zyx_wr + {i * 16 + (q >> 1) * 8} + (zyx_lane >> 2)",
                                f"zyx_c0 + zyx_wc + {j * 8 + (q & 1)} + (zyx_lane & 3) * 2",
                                acc))
    body += fr.epilogue(dl, ops, p, outputs)
    prelude = _PRELUDE + _MMA.format(t=t, k=kq) + (_TF32_ROUND if narrow is None else "")
    return fr.kernel(kernel, dl, name, body, "mma",
                     {"rows": br, "cols": bc, "k": bk, "mma": t}, prelude=prelude)
