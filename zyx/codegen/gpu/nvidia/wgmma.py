"""Hopper warpgroup products: the gemm strategy's lowering for float16 and bfloat16 products
whose operands are plain loads (matmul, batched matmul, linear layers), on NVIDIA GPUs of
compute capability 9.0 with a cubin for sm_90a (the architecture-specific target NVRTC
makes for them: `cuda.nvrtc_target`).

mma.py's `mma.sync` keeps a warp busy issuing every 16 x 8 x 16 product and reading its
fragments from local memory; on a Hopper GPU that reaches about a quarter of cuBLAS's
bfloat16 matmul. Here, as cuBLAS does there (the cp.async version, `lower_wgmma`, reaches
0.44x of it; operands copied through tensor maps, `lower_wgmma_tma`, 0.80x:
BENCHMARKS.md):
- `wgmma.mma_async` (a warpgroup of 4 warps issues a 64 x BC x 16 product that reads both
  operands from shared memory itself, through matrix descriptors, into float registers).
  A group is a warpgroup per 64 rows of its tile: 2 for 128 rows, 4 for 256 (`shape`).
- The operands go from global to shared memory by `cp.async` (16 bytes at a time, through
  no registers) into STAGES stages of WG_K = 64: STAGES - 2 K steps are copied ahead of
  the step being multiplied, and each step's products are left running while the next
  step waits for its copies (one batch of wgmma in flight). A copy that is not 16-byte
  aligned (a view at an odd offset) is read value by value and stored as a vector; past
  the ends of the product it stores zeros.
- Shared tiles use the 128-byte swizzle the descriptors read: a tile contiguous along K
  ("K-major": rows of 64 values = 128 bytes) stores 16-byte chunk c of row r at chunk
  c ^ (r % 8); a tile contiguous along its rows or cols ("MN-major", as `a @ b`'s b is)
  is blocks of 64 rows (or cols) x 64 K, each a K row of 128 bytes per K, chunk c of K
  row k at c ^ (k % 8). Tiles start at 1024-byte boundaries (the swizzle's period).
- The stages need more than the 48 KiB a kernel may declare: shared memory is dynamic
  (Launch.shared; 97 KiB at 3 stages of 128 x 128, 193 KiB at 4 of 256 x 128: `shape`),
  allowed per function by the driver.
The plan, the group decoding and the epilogue (the kernel's own ops on each
accumulator) are gemm's; the accumulators are laid out as mma.sync's (a 16 x 8 block
per 4 registers), so the epilogue's positions are mma.py's.

Where tensor maps can copy both operands (`tma_usable`, tma.py), `lower_wgmma_tma`
replaces the copies by one producer warpgroup issuing TMA box copies into the same
swizzled stages, synchronized through mbarriers; it also takes padded windows over a
channels-last image (`window_plan`: the plan's sides exchanged, the taps folded into the
pixel coordinate, the rows whose padding test fails zeroed by the consumers), float32
products on TF32 (k8, both operands K-major) and float32 products at "highest" on FMA
tiles (`fma_products`: the consumers multiply 16-byte reads of the stages with FMA
instructions, either operand K-major or MN-major).
"""
from __future__ import annotations

from ...._core import kernel as K
from ..gemm import PLAIN_K, Frame, decode_flat, value_lines, vector_lanes
from .mma import tf32
from . import kcopy, tma
from ..analysis import coefficient
from ..gemm import GemmPlan, index_deps


WG_ROWS = 128           # rows of a product's tile that picks this lowering (gemm's tile)
WG_K = 64               # K per stage: one 128-byte swizzled row of 16-bit values
ROW_BYTES = 128         # bytes of one swizzled row
ATOM = 1024             # 8 swizzled rows: the swizzle's period, and the tiles' alignment

_PTX = {"float16": "f16", "bfloat16": "bf16", "float32": "tf32"}


def fma_products(p, info):
    """True when plan `p` is a float32 product computed in float32 ("highest"): the
    tensor-map lowering then multiplies with FMA instructions (`lower_wgmma_tma`)."""
    return p.narrow is None and p.dtype.name == "float32" and not tf32(p, info)


def _operand_type(p):
    """(PTX type, bytes per value) the product's operands enter wgmma as: 16-bit
    values, or float32 ones as TF32 (mma.tf32: the precision setting allows it; the
    tensor cores read their TF32 bits, no rounding to nearest as mma.py's cvt.rna)."""
    d = p.narrow or p.dtype
    return _PTX[d.name], d.itemsize

_HELPERS = r"""
static __device__ __forceinline__ void zyx_copy16(unsigned dst, const void* src) {
  if ((((unsigned long long)src) & 15ull) == 0ull) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
  } else {
    const unsigned short* h = (const unsigned short*)src;
    unsigned w[4];
    #pragma unroll
    for (int i = 0; i < 4; i++) w[i] = (unsigned)h[2 * i] | ((unsigned)h[2 * i + 1] << 16);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "r"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
  }
}
static __device__ __forceinline__ void zyx_zero16(unsigned dst) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(dst), "r"(0) : "memory");
}
static __device__ __forceinline__ unsigned long long zyx_desc(unsigned addr, unsigned lead,
                                                              unsigned stride) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4)
       | ((unsigned long long)((lead & 0x3FFFFu) >> 4) << 16)
       | ((unsigned long long)((stride & 0x3FFFFu) >> 4) << 32)
       | (1ull << 62);
}
"""


def shape(p, info, var):
    """(rows per group, cols per group, stages) for plan `p` on device `info` with gemm's
    knobs `var` ("wm", "wn", "stages"; 0: choose). 256 x 128 tiles (four warpgroups)
    with 4 stages where the product still has two of them per compute unit (and its rows
    fill them as well as 128-row tiles), else 128 x
    128 (two warpgroups, two groups per SM) with 3 stages. H200, bfloat16 matmul 4096:
    256 x 128 x 4 stages 0.403 ms, 128 x 256 x 4 0.429, 128 x 128 x 3 0.448, 128 x 128 x
    4 (one group per SM) 0.548."""
    # (256-row tiles only where they leave no more rows idle than 128-row ones)
    tall = -(-p.nr // 256) * 2 == -(-p.nr // WG_ROWS)
    wide = p.nb * -(-p.nr // 256) * -(-p.nc // 128) >= 2 * max(info.num_cores, 1)
    br = var["wm"] or (256 if tall and wide and not var["wn"] else WG_ROWS)
    bc = var["wn"] or 128
    big = br * bc > WG_ROWS * 128
    return br, bc, var["stages"] or (4 if big else 3)


def smem_bytes(br, bc, n_stages):
    """Dynamic shared memory of a group: the stages' tiles and 1024 bytes to align them."""
    return n_stages * (br + bc) * WG_K * 2 + ATOM


def usable(p, ops, dl, info, tile, var):
    """True when plan `p` with gemm tile `tile` can take this lowering: a float16 or
    bfloat16 product of two plain, unmasked global loads that `gemm.vector_lanes` copies
    16 bytes at a time, no block totals, a 128 x 128 tile chosen (the product fills the
    device with them; 128 x 64 where the product has at most 64 cols and tensor maps
    can copy it, as attention's probabilities @ values), and a device compiled for
    sm_90a with the dynamic shared memory the stages need. A float32 product allowed
    TF32 (mma.tf32), or at "highest" with the knob "fma" (FMA tiles), takes it through
    tensor maps only, TF32 with both operands K-major."""
    if (not var["wgmma"] or p.masks or not getattr(dl, "mma_ptx", False) or
            (p.narrow is None and not tf32(p, info)
             and not (fma_products(p, info) and var["fma"]))):
        return False
    extra = info.extra or {}
    narrow_cols = tuple(tile[:2]) == (WG_ROWS, 64) and p.nc <= 64
    if extra.get("arch") != "sm_90a" or (tuple(tile[:2]) != (WG_ROWS, 128) and
                                         not narrow_cols):
        return False
    if p.block and var["fold"] and p.nk > PLAIN_K:
        return False
    if any(ops[v][0] != K.LOAD or ops[v][4] >= 0 for v in (p.a, p.b)):
        return False
    if narrow_cols or p.narrow is None:
        # (the cp.async version has 16-bit tiles of 128 cols or more)
        return tma_usable(ops, p, info, var)
    for side, kfast in (("a", p.a_kfast), ("b", p.b_kfast)):
        op = ops[p.a if side == "a" else p.b]
        if op[1] is not p.narrow or vector_lanes(ops, p, side, kfast, p.narrow) != 8:
            return False
    br, bc, n_stages = shape(p, info, var)
    return smem_bytes(br, bc, n_stages) <= extra.get("smem_optin", 0)


class _Copies:
    """One operand's 16-byte copies into a stage (see the module docstring for the
    layouts): `setup` statements before the K loop and `issue` statements starting this
    work-item's copies of the K step at zyx_kn into the stage at shared address zyx_buf.
    Where the operand's index is linear in the flat K (every reduce loop's coefficient
    is the next inner one's times that loop's length: a matmul's, whatever blocks the
    kernelizer split its sum into), each copy's address and row test are computed once
    in `setup` and a step adds zyx_kn times the slope; otherwise every step decodes its
    position and computes the index as the kernel does."""

    def __init__(self, dl, ops, p, fr, side, tile_len, kfast, region, threads):
        val = p.a if side == "a" else p.b
        op = ops[val]
        ids = p.rows if side == "a" else p.cols
        extent = p.nr if side == "a" else p.nc
        origin = "zyx_r0" if side == "a" else "zyx_c0"
        per_row = (WG_K if kfast else tile_len) // 8      # chunks along the fast direction
        coef = [coefficient(ops, op[3], lp, {}) for lp in p.loops]
        lengths = [ops[lp][2] for lp in p.loops]
        linear = None not in coef and all(coef[i] == coef[i + 1] * lengths[i + 1]
                                          for i in range(len(coef) - 1))
        ragged_k = p.nk % WG_K != 0
        self.setup, self.issue = [], []
        ind = "        "

        def address(names, mm, k, ind):
            """Statements naming the operand's row (col) `mm` and flat K `k` and
            computing its index; the address is names[op[2]] + names[op[3]]."""
            return (decode_flat(names, ops, ids, f"({origin} + {mm})", fr.it, ind) +
                    decode_flat(names, ops, p.loops, k, fr.it, ind) +
                    value_lines(dl, ops, [op[3]], names, fr.narrow, ind))
        for s in range(tile_len * WG_K // 8 // threads):
            e = f"(zyx_tid + {s * threads})"
            if kfast:
                mm, chunk = f"({e} / {per_row})", f"({e} % {per_row})"
                kk = f"({chunk} * 8)"
                dst = f"{mm} * {ROW_BYTES} + (({chunk} ^ ({mm} & 7)) << 4)"
            else:
                kk, chunk = f"({e} / {per_row})", f"({e} % {per_row})"
                mm = f"({chunk} * 8)"
                dst = (f"({chunk} >> 3) * {WG_K * ROW_BYTES} + {kk} * {ROW_BYTES} + "
                       f"((({chunk} & 7) ^ ({kk} & 7)) << 4)")
            tag = f"{side}{s}"
            row_ok = f"{origin} + {mm} < {extent}"
            self.setup.append(f"  const unsigned zyx_o{tag} = {region} + {dst};")
            names = dict(fr.names)
            if linear:
                # the address at K offset kk of step 0 (any address where the row is out)
                self.setup += [f"  const bool zyx_in{tag} = {row_ok};",
                               f"  const {dl.storage_type(op[1])}* zyx_q{tag} = "
                               f"{names[op[2]]};",
                               f"  if (zyx_in{tag} && {kk} < {p.nk}) {{"]
                self.setup += address(names, mm, kk, "    ")
                self.setup += [f"    zyx_q{tag} += {names[op[3]]};", "  }"]
                test = f"zyx_in{tag}" + (f" && zyx_kn + {kk} < {p.nk}" if ragged_k else "")
                self.issue += [f"    if ({test}) zyx_copy16(zyx_buf + zyx_o{tag}, "
                               f"zyx_q{tag} + zyx_kn * {coef[-1]});",
                               f"    else zyx_zero16(zyx_buf + zyx_o{tag});"]
                continue
            self.issue += ["    {",
                           f"      if ({row_ok} && zyx_kn + {kk} < {p.nk}) {{"]
            self.issue += address(names, mm, f"(zyx_kn + {kk})", ind)
            self.issue += [f"{ind}zyx_copy16(zyx_buf + zyx_o{tag}, "
                           f"{names[op[2]]} + {names[op[3]]});",
                           "      } else {",
                           f"{ind}zyx_zero16(zyx_buf + zyx_o{tag});",
                           "      }", "    }"]


def _wgmma_function(t, bc, trans_a, trans_b):
    """The inline-PTX m64n{bc}k16 product (k8 for TF32, whose operands must both be
    K-major: no transpose bits) accumulating into float d[bc / 2]."""
    n = bc // 2
    k, trans = (8, "") if t == "tf32" else (16, f", {int(trans_a)}, {int(trans_b)}")
    regs = ", ".join(f"%{i}" for i in range(n))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return (f"static __device__ __forceinline__ void zyx_wgmma(float* d, unsigned long long a,"
            f" unsigned long long b) {{\n"
            f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{n + 2}, 0;\\n"\n'
            f'    "wgmma.mma_async.sync.aligned.m64n{bc}k{k}.f32.{t}.{t} {{{regs}}}, '
            f'%{n}, %{n + 1}, p, 1, 1{trans};\\n}}\\n"\n'
            f'    : {outs}\n'
            f'    : "l"(a), "l"(b), "r"(1) : "memory");\n}}\n')


def _descriptor(base, kfast, warpgroup_rows):
    """C expression of the descriptor of one operand's 64 (or bc) rows x 16 K at K
    offset zyx_ks (in 16s) of the tile at shared address `base`; `warpgroup_rows`: the
    row offset of this warpgroup's rows (A) or None (B: all cols)."""
    if kfast:       # rows of 128 bytes, 8-row groups 1024 bytes apart; K by 32 bytes
        start = f"{base} + zyx_ks * 32"
        if warpgroup_rows:
            start += f" + {warpgroup_rows} * {ROW_BYTES}"
        return f"zyx_desc({start}, 16u, {ATOM}u)"
    # blocks of 64 rows (cols) x 64 K, K rows of 128 bytes: 16 K are 2048 bytes; the
    # next 64 rows (cols) are the next block; the next 8 K the next 1024 bytes
    start = f"{base} + zyx_ks * {16 * ROW_BYTES}"
    if warpgroup_rows:
        start += f" + ({warpgroup_rows} / 64) * {WG_K * ROW_BYTES}"
    return f"zyx_desc({start}, {WG_K * ROW_BYTES}u, {ATOM}u)"


# -- operands copied through tensor maps by a producer warpgroup (tma.py) ---------------

TMA_PRODUCER_REGS = 24      # registers a producer work-item keeps (setmaxnreg's least)
REGISTERS_PER_SM = 65536


def tma_shape(p, info, var):
    """(rows, cols, stages) of the tensor-map lowering: 128 rows (two consumer
    warpgroups of 64), 256 cols where the product has more than 128 and still a tile
    per compute unit, else 128 (64 for products of at most 64 cols; a product of 128
    cols on 256-col tiles multiplied half zeros), and as many stages as fit the
    device's shared memory (at most 6); the knobs "wm", "wn", "stages" override them.
    FMA tiles (`fma_products`): 256 x 64 for products of at most 64 cols, else 128 x
    128 (only "stages" applies)."""
    if fma_products(p, info):     # float32 FMA tiles: 8 x 8 per consumer work-item
        bc = 64 if p.nc <= 64 else 128
        br = 256 if bc == 64 else 128
    else:
        br = var["wm"] or WG_ROWS
        wide = p.nb * -(-p.nr // br) * -(-p.nc // 256) >= max(info.num_cores, 1)
        bc = var["wn"] or (64 if p.nc <= 64 else 256 if wide and p.nc > 128 else 128)
    room = (info.extra or {}).get("smem_optin", 0) - ATOM - 16 * 6
    return br, bc, var["stages"] or max(min(6, room // ((br + bc) * WG_K * 2)), 2)


def _tma_maps(ops, p, br, bc):
    """(k_groups, [(map, coordinates, tests) of a and b] through tma.operand_map, [a, b
    K-major]), or None. Only the rows side (a) may have tests (a window: the consumers
    that multiply those rows zero the ones whose test fails), and only its taps fold
    into its side."""
    groups = tma.k_groups(ops, p)
    if groups is None or not groups[0]:
        return None
    arg_of = {i: op[3] for i, op in enumerate(ops)
              if op[0] == K.DEFINE and op[2] == K.SCOPE_GLOBAL}
    # K-major where the channel group's innermost loop steps by one value (the plan's
    # a_kfast/b_kfast follow its own loop order, which may end in a tap)
    kfast = [tma.k_major(ops, val, groups[0][-1]) for val in (p.a, p.b)]
    found = [tma.operand_map(ops, p, side, kf, n, arg_of, groups, fold=side == "a")
             for side, kf, n in (("a", kfast[0], br), ("b", kfast[1], bc))]
    if None in found or found[1][2]:
        return None
    if found[0][2]:      # tests of the rows and taps only, on a K-major tile
        deps = index_deps(ops)
        allowed = set(p.rows) | set(groups[1]) | set(p.batch)
        if not kfast[0] or any(deps.get(t) is None or not deps[t] <= allowed
                               for t in found[0][2]):
            return None
    return groups, found, kfast


def swapped(p):
    """Plan `p` with its sides exchanged (rows <-> cols, a <-> b): the same sums, the
    operand with tests (a convolution's window) on the rows, which the warpgroups'
    64-row products read and the consumers can fix."""
    q = GemmPlan()
    for name in GemmPlan.__slots__:
        setattr(q, name, getattr(p, name))
    q.rows, q.cols, q.a, q.b = p.cols, p.rows, p.b, p.a
    q.nr, q.nc, q.a_kfast, q.b_kfast = p.nc, p.nr, p.b_kfast, p.a_kfast
    return q


def _consumer_registers(consumers):
    """Registers per consumer work-item: what the launch gives each of the group's
    work-items (__launch_bounds__ with one group per SM), plus the producer's share."""
    threads = 128 * (consumers + 1)
    launch_regs = min(REGISTERS_PER_SM // threads // 8 * 8, 255)
    return min((launch_regs * threads - 128 * TMA_PRODUCER_REGS) // (128 * consumers)
               // 8 * 8, 240)


def tma_usable(ops, p, info, var):
    """True when `usable`'s plan can copy both operands through tensor maps (the
    knob "tma", strides of 16-byte multiples, the stages' shared memory)."""
    if not var["tma"] or not (info.extra or {}).get("tma"):
        return False
    br, bc, n_stages = tma_shape(p, info, var)
    # (the accumulators and about 48 registers of addresses and epilogue)
    consumers = 2 if fma_products(p, info) else br // 64
    need_regs = 176 if fma_products(p, info) else bc // 2 + 48
    if n_stages < 2 or _consumer_registers(consumers) < need_regs:
        return False
    need = smem_bytes(br, bc, n_stages) + 16 * n_stages
    if need > (info.extra or {}).get("smem_optin", 0):
        return False
    found = _tma_maps(ops, p, br, bc)
    # (TF32 products read both operands K-major, wgmma has no transpose for them: an
    # MN-major one is copied K-major first; the FMA tiles read either layout)
    return found is not None and (p.narrow is not None or all(found[2])
                                  or fma_products(p, info)
                                  or _k_copies(p, found, var, info) is not None)


def _k_copies(p, found, var, info):
    """The sides ("a", "b") of a TF32 plan whose MN-major operand is copied K-major by a
    first launch (kcopy.py), found = _tma_maps(...); None where one cannot be: a window
    (taps), tests, too few rows (cols) on the other side, the knob "kcopy" off."""
    (_, taps), maps, kfast = found
    sides = [s for s, kf in zip("ab", kfast) if not kf]
    if not var["kcopy"] or not tf32(p, info) or taps:
        return None
    for s in sides:
        m, _, tests = maps[0 if s == "a" else 1]
        if tests or not kcopy.usable(m, p.nc if s == "a" else p.nr):
            return None
    return sides


def window_plan(p, ops, dl, info, var):
    """The plan, sides exchanged (`swapped`), of a 16-bit product (or a float32 one on
    TF32 or, with the knob "fma", FMA tiles) whose cols operand has tests (a
    convolution's padded window over a channels-last image) when tensor maps can copy
    it on the rows side (`tma_usable`) and its tiles fill the device; None else."""
    if (not var["wgmma"] or not var["mma"] or p.masks
            or (p.narrow is None and not tf32(p, info)
                and not (fma_products(p, info) and var["fma"]))
            or not getattr(dl, "mma_ptx", False)
            or (info.extra or {}).get("arch") != "sm_90a"
            or (p.block and var["fold"] and p.nk > PLAIN_K)):
        return None
    found = tma.source(ops, p.b)
    if found is None or not found[1]:
        return None
    q = swapped(p)
    br, bc, _ = tma_shape(q, info, var)
    if q.nb * -(-q.nr // br) * -(-q.nc // bc) < max(info.num_cores, 1):
        return None
    if not _plain_window(ops, q, found[0]):
        return None
    return q if tma_usable(ops, q, info, var) else None


def _plain_window(ops, q, load):
    """True for the windows this lowering was checked on a GPU with: one group (no
    batch position reaching the operands) and each tap moving the window by one pixel
    row or col (no dilation). Grouped and dilated convolutions keep the other
    lowerings."""
    coefs = tma._coefficients(ops, ops[load][3])
    groups = tma.k_groups(ops, q)
    if coefs is None or groups is None or any(coefs[b] for b in q.batch):
        return False
    moves = {coefs[i] for i in q.rows}
    return all(coefs[t] in moves or coefs[t] == 0 for t in groups[1])


def lower_wgmma_tma(kernel, dl, info, name, p, var):
    """The `GPUKernel` of plan `p` (see `tma_usable`) with warp-specialized groups: br /
    64 consumer warpgroups each multiply 64 rows by all bc cols of a stage as
    `lower_wgmma`'s do, and one producer warpgroup, whose first work-item alone copies
    each K step's boxes through the operands' tensor maps (tma.py). Each stage has two
    mbarriers: "full" counts the copies' bytes (the consumers wait on it), "empty" the
    consumer warps that finished reading it (the producer waits on it before copying
    the step STAGES later). The producer gives its registers to the consumers
    (setmaxnreg): a 64 x 256 accumulator is 128 registers per work-item.
    K steps walk the taps (tma.k_groups' T: a convolution's window positions) and, for
    each, the channel group in chunks of 128 bytes. Rows of a window whose test fails
    at a step (padding) are zeroed by the consumers that multiply them before their
    products (the box read the neighbouring pixels there). float32 products at
    "highest" (`fma_products`) keep the producer and maps but their two consumer
    warpgroups multiply with FMA instructions (`_fma_layout`, strategy "tmafma")."""
    ops = kernel.ops
    br, bc, n_stages = tma_shape(p, info, var)
    fma = fma_products(p, info)
    consumers = 2 if fma else br // 64
    threads = 128 * (consumers + 1)
    ptx, size = _operand_type(p)
    bk = ROW_BYTES // size          # values per K step: one swizzled row
    a_bytes, b_bytes = br * ROW_BYTES, bc * ROW_BYTES
    stage_bytes = a_bytes + b_bytes
    fr = Frame(kernel, dl, p, br, bc, bk, threads)
    found = _tma_maps(ops, p, br, bc)
    (g_loops, taps), ((map_a, at_a, tests), (map_b, at_b, _)), kfast = found
    # TF32 with an MN-major operand: a first launch copies it K-major (kcopy.py)
    k_copies = [] if fma or p.narrow is not None or all(kfast) else _k_copies(p, found, var, info)
    copied = []
    for j, side in enumerate(k_copies):
        m, at = (map_a, at_a) if side == "a" else (map_b, at_b)
        new, at, nbytes = kcopy.copied(m, at, br if side == "a" else bc, j)
        copied.append((m, nbytes))
        if side == "a":
            map_a, at_a = new, at
        else:
            map_b, at_b = new, at
        kfast = (True, kfast[1]) if side == "a" else (kfast[0], True)
    p = swapped(swapped(p))          # (a copy) with the maps' layouts
    p.a_kfast, p.b_kfast = kfast
    g_len = 1
    for lp in g_loops:
        g_len *= ops[lp][2]
    chunks = -(-g_len // bk)
    n_taps = 1
    for lp in taps:
        n_taps *= ops[lp][2]
    nkt = chunks * n_taps
    nacc = bc // 2
    consumer_regs = _consumer_registers(consumers)
    names = dict(fr.names)

    def bar(kind, s):
        return f"(zyx_bars + {8 * (0 if kind == 'full' else n_stages)}u + 8u * ({s}))"

    def step(ind):
        """Statements naming K step zyx_kt's channel offset zyx_kn and tap variables."""
        out = [f"{ind}const int zyx_kn = (zyx_kt % {chunks}) * {bk};"]
        if taps:
            out.append(f"{ind}const int zyx_tap = zyx_kt / {chunks};")
            out += decode_flat(names, ops, taps, "zyx_tap", "int", ind)
        return out

    def copies(param, at, kfast, extent, offset):
        """Statements copying one operand's boxes of step zyx_kt into zyx_buf."""
        if kfast:
            return ["      " + tma.copy_call(f"zyx_buf + {offset}u", param, at,
                                             bar("full", "zyx_s"))]
        # (MN-major: blocks of one 128-byte row of rows (cols) by bk K)
        vals = ROW_BYTES // size
        return ["      " + tma.copy_call(f"zyx_buf + {offset + blk * bk * ROW_BYTES}u", param,
                                         [f"{at[0]} + {blk * vals}"] + at[1:],
                                         bar("full", "zyx_s"))
                for blk in range(extent // vals)]

    fence_acc = (f"  for (int q = 0; q < {nacc}; q++) "
                 f"asm volatile(\"\" : \"+f\"(zyx_d[q]) :: \"memory\");")
    body = ["  extern __shared__ __align__(1024) unsigned char zyx_smem[];"] + fr.head + [
        f"  const unsigned zyx_base = ((unsigned)__cvta_generic_to_shared(zyx_smem) + "
        f"{ATOM - 1}u) & ~{ATOM - 1}u;",
        f"  const unsigned zyx_bars = zyx_base + {n_stages * stage_bytes}u;",
        "  const int zyx_lane = (int)(zyx_tid % 32);",
        "  const int zyx_wg = (int)(zyx_tid / 128);",
        "  const int zyx_w4 = (int)((zyx_tid / 32) % 4);",
        "  if (zyx_tid == 0) {",
        f"    for (int s = 0; s < {n_stages}; s++) {{",
        f"      zyx_bar_init({bar('full', 's')}, 1u);",
        f"      zyx_bar_init({bar('empty', 's')}, {4 * consumers}u);",
        "    }",
        '    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");',
        "  }",
        f"  {dl.barrier()};",
        f"  if (zyx_wg == {consumers}) {{",
        f'    asm volatile("setmaxnreg.dec.sync.aligned.u32 {TMA_PRODUCER_REGS};");',
        f"    if (zyx_tid == {128 * consumers}) {{",
        f"    for (int zyx_kt = 0; zyx_kt < {nkt}; zyx_kt++) {{",
        f"      const int zyx_s = zyx_kt % {n_stages};",
        f"      if (zyx_kt >= {n_stages}) "
        f"zyx_bar_wait({bar('empty', 'zyx_s')}, (unsigned)((zyx_kt / {n_stages} + 1) & 1));",
        f"      const unsigned zyx_buf = zyx_base + zyx_s * {stage_bytes}u;"] + step("      ") + [
        f"      zyx_bar_expect({bar('full', 'zyx_s')}, {stage_bytes}u);"]
    body += copies("zyx_mapa", at_a, p.a_kfast, br, 0)
    body += copies("zyx_mapb", at_b, p.b_kfast, bc, a_bytes)
    body += ["    }", "    }", "  } else {",
             f'    asm volatile("setmaxnreg.inc.sync.aligned.u32 {consumer_regs};");']
    if fma:
        layout = _fma_layout(ops, p, br, bc)
        body += _fma_setup(layout)
    else:
        body += [f"  float zyx_d[{nacc}];",
                 "  #pragma unroll",
                 f"  for (int q = 0; q < {nacc}; q++) zyx_d[q] = 0.0f;"]
    fix = []
    # (rows read by both consumer warpgroups: the FMA tiles' rows across lanes)
    rows_shared = fma and layout[0].steps != tuple(range(8))
    if tests:
        # the rows of this warpgroup (it alone reads them), each by `per_row`
        # work-items; the row's positions decoded once
        rows = br // consumers
        per_row = 128 // rows
        part = ROW_BYTES // per_row
        body += [f"  const int zyx_fr = zyx_wg * {rows} + (int)(zyx_tid % 128) / {per_row};",
                 "  const unsigned zyx_fo = (unsigned)zyx_fr * 128u + "
                 f"(unsigned)(zyx_tid % {per_row}) * {part}u;"]
        body += decode_flat(names, ops, p.rows, "(zyx_r0 + zyx_fr)", fr.it, "  ")
        fix = ["    {"] + step("      ")
        fix += value_lines(dl, ops, tests, names, fr.narrow, "      ")
        ok = " && ".join(f"({names.get(t, f'v{t}')})" for t in tests)
        fix += [f"      if (!({ok})) {{",
                "        #pragma unroll",
                f"        for (int q = 0; q < {part // 16}; q++) "
                "zyx_zero16(zyx_cur + zyx_fo + 16u * q);",
                "      }",
                '      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");',
                # (the warpgroup's own rows; rows across lanes: both warpgroups' rows)
                '      asm volatile("bar.sync 1, 256;" ::: "memory");' if rows_shared else
                '      asm volatile("bar.sync %0, 128;" :: "r"(1 + zyx_wg) : "memory");',
                "    }"]
    body += [f"  for (int zyx_kt = 0; zyx_kt < {nkt}; zyx_kt++) {{",
             f"    const int zyx_s = zyx_kt % {n_stages};",
             f"    zyx_bar_wait({bar('full', 'zyx_s')}, (unsigned)((zyx_kt / {n_stages}) & 1));",
             f"    const unsigned zyx_cur = zyx_base + zyx_s * {stage_bytes}u;"] + fix
    if fma:
        # (the stage's reads are generic-proxy loads and its next copy an async-proxy
        # write: the fence orders them before the release)
        body += _fma_products(layout) + [
            '    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");',
            "    __syncwarp();",
            f"    if (zyx_lane == 0) zyx_bar_arrive({bar('empty', 'zyx_s')});",
            "  }"]
        body += fr.epilogue(dl, ops, p, _fma_outputs(layout)) + ["  }"]
        return _tma_kernel(fr, kernel, dl, name, body, "tmafma", br, bc, bk, n_stages, "f32",
                           threads, map_a, map_b, _HELPERS + tma.HELPERS + _FMA_HELPERS)
    # (after the products, those of the step before are done: its stage may be copied
    # over)
    body += _step_products(p, a_bytes, fence_acc) + [
             "    if (zyx_kt > 0 && zyx_lane == 0) "
             f"zyx_bar_arrive({bar('empty', f'(zyx_kt + {n_stages - 1}) % {n_stages}')});",
             "  }",
             '  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");',
             "  #pragma unroll",
             fence_acc]
    body += fr.epilogue(dl, ops, p, _outputs(bc)) + ["  }"]
    prelude = (_HELPERS + tma.HELPERS +
               _wgmma_function(ptx, bc, not p.a_kfast, not p.b_kfast))
    return _tma_kernel(fr, kernel, dl, name, body, "wgmma", br, bc, bk, n_stages, ptx,
                       threads, map_a, map_b, prelude, copied)


def _tma_kernel(fr, kernel, dl, name, body, strategy, br, bc, bk, n_stages, kind, threads,
                map_a, map_b, prelude, copied=()):
    """The GPUKernel of a tensor-map lowering: the maps after the buffers, launch
    bounds of one group per SM, the stages' dynamic shared memory and barriers.
    `copied`: (MN-major map, bytes) of each operand a first launch copies K-major into
    scratch buffer j (kcopy.py); the product's launch takes that buffer as a parameter
    after its own (its map is encoded from it) and "kcopy" in its variant."""
    params = [f"const float* __restrict__ zyx_kcopy{j}" for j in range(len(copied))]
    maps = ["const __grid_constant__ zyx_tmap zyx_mapa",
            "const __grid_constant__ zyx_tmap zyx_mapb"]
    variant = {"rows": br, "cols": bc, "k": bk, "stages": n_stages, "tma": 1, "mma": kind}
    if copied:
        variant["kcopy"] = len(copied)
    g = fr.kernel(kernel, dl, name, body, strategy, variant, prelude=prelude,
                  extra_params=params + maps, bounds=f"__launch_bounds__({threads}, 1) ")
    g.launches[0].shared = smem_bytes(br, bc, n_stages) + 16 * n_stages
    g.launches[0].maps = [map_a, map_b]
    g.launches[0].args += [("scratch", j) for j in range(len(copied))]
    for j, (m, nbytes) in enumerate(copied):
        g.source += kcopy.source(f"{name}_kcopy{j}", m)
        g.launches.insert(j, kcopy.launch(f"{name}_kcopy{j}", m, j))
        g.scratch.append(nbytes)
    return g


# float32 FMA tiles fed by tensor maps: the two consumer warpgroups' 256 work-items hold
# 8 x 8 outputs each, at 8 rows and 8 cols of the tile (`_FmaSide`). A stage's 32 K are
# 8 chunks of 4; per chunk each side is eight 16-byte reads: of a K-major side one per
# row (col) holding 4 K, of an MN-major side (`a @ b`'s b: 32-value blocks of K rows,
# tma.operand_map) two per K holding 4 neighbouring rows (cols). Layouts, all without
# bank conflicts (a quarter warp's 8 reads fall in 8 swizzle chunks or are one
# broadcast):
# - cols across lanes (bc / 8 lanes of a row group): a K-major col side at lane + bc / 8
#   j, an MN-major one at 4 lane + {0..3} + {0, bc / 2}; a K-major row side at 8 u + i,
#   an MN-major one at 4 u + {0..3} + {0, br / 2} (u: the row group). A row-major
#   output's lanes store neighbouring values (matmuls);
# - rows across lanes (256 x 64 tiles, both sides K-major: rows lane + 32 i, cols warp +
#   8 j): an output contiguous along the rows (a convolution's NCHW pixels, its plan's
#   sides exchanged) is stored 128 bytes per warp instead of 4 bytes per lane.

_FMA_HELPERS = r"""
static __device__ __forceinline__ float zyx_part(float4 v, int c) {
  return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}
"""


class _FmaSide:
    """One side of the FMA tiles: the work-item's first row (col) `origin` (a C
    expression) and its 8 offsets `steps`, `kfast` (K-major), the tile's shared offset
    `region` in a stage and its name `tag` ("a" or "b")."""

    def __init__(self, tag, origin, steps, kfast, region):
        self.tag, self.origin, self.steps, self.kfast = tag, origin, steps, kfast
        self.region = region

    def setup(self):
        """Statements before the K loop: the work-item's shared offsets."""
        t = self.tag
        if self.kfast:
            out = [f"  const unsigned zyx_{t}o = {self.region}u + "
                   f"(unsigned)zyx_{t}1 * {ROW_BYTES}u;"]
            if self.steps != tuple(range(8)):
                out.append(f"  const unsigned zyx_{t}x = (unsigned)(zyx_{t}1 & 7);")
            return out
        # (two reads of 4 values per K: blocks of 32 values by 32 K, chunk (index % 32) / 4)
        out = []
        for h in (0, 1):
            idx = f"(zyx_{t}1 + {self.steps[4 * h]})"
            out += [f"  const unsigned zyx_{t}o{h} = {self.region}u + (unsigned)({idx} / 32) * "
                    f"{32 * ROW_BYTES}u;",
                    f"  const unsigned zyx_{t}c{h} = (unsigned)(({idx} % 32) / 4);"]
        return out

    def reads(self):
        """Statements reading K chunk zyx_q (4 K) of the stage at zyx_st into
        zyx_{tag}v[8]."""
        t = self.tag
        if self.kfast:
            # the row's swizzle phase: i where the rows are 8 from a multiple of 8, else
            # the first row's (the steps are multiples of 8)
            phase = "(unsigned)i" if self.steps == tuple(range(8)) else f"zyx_{t}x"
            return ["      #pragma unroll",
                    f"      for (int i = 0; i < 8; i++) zyx_{t}v[i] = *(const float4*)(zyx_st + "
                    f"zyx_{t}o + i * {(self.steps[1] - self.steps[0]) * ROW_BYTES}u + "
                    f"(((unsigned)zyx_q ^ {phase}) << 4));"]
        return ["      #pragma unroll",
                "      for (int kk = 0; kk < 4; kk++) {",
                "        const unsigned k = (unsigned)(zyx_q * 4 + kk);",
                f"        zyx_{t}v[2 * kk] = *(const float4*)(zyx_st + zyx_{t}o0 + k * "
                f"{ROW_BYTES}u + ((zyx_{t}c0 ^ (k & 7u)) << 4));",
                f"        zyx_{t}v[2 * kk + 1] = *(const float4*)(zyx_st + zyx_{t}o1 + k * "
                f"{ROW_BYTES}u + ((zyx_{t}c1 ^ (k & 7u)) << 4));",
                "      }"]

    def value(self, i):
        """C expression of the value at offset `i` (a C variable) and K kk of the chunk."""
        if self.kfast:
            return f"zyx_part(zyx_{self.tag}v[{i}], kk)"
        return f"zyx_part(zyx_{self.tag}v[2 * kk + {i} / 4], {i} % 4)"


def _fma_layout(ops, p, br, bc):
    """(rows side, cols side) of `lower_wgmma_tma`'s FMA tiles (see above)."""
    a_bytes = br * ROW_BYTES
    if ((br, bc) == (256, 64) and p.a_kfast and p.b_kfast and
            coefficient(ops, ops[p.store][3], p.rows[-1], {}) == 1):
        return (_FmaSide("a", "zyx_lane", tuple(range(0, 256, 32)), True, 0),
                _FmaSide("b", "(int)(zyx_tid / 32)", tuple(range(0, 64, 8)), True, a_bytes))
    nct = bc // 8
    lane, group = f"(int)(zyx_tid % {nct})", f"(int)(zyx_tid / {nct})"

    def side(tag, index, extent, kfast, region, spread):
        if kfast:
            return _FmaSide(tag, index if spread else f"{index} * 8",
                            tuple(range(0, 8 * nct, nct)) if spread else tuple(range(8)),
                            True, region)
        half = extent // 2
        return _FmaSide(tag, f"{index} * 4", (0, 1, 2, 3, half, half + 1, half + 2, half + 3),
                        False, region)
    return (side("a", group, br, p.a_kfast, 0, False),
            side("b", lane, bc, p.b_kfast, a_bytes, True))


def _fma_setup(layout):
    rows, cols = layout
    return ([f"  const int zyx_a1 = {rows.origin};",
             f"  const int zyx_b1 = {cols.origin};",
             "  const unsigned char* zyx_sp = zyx_smem + (zyx_base - "
             "(unsigned)__cvta_generic_to_shared(zyx_smem));"] + rows.setup() + cols.setup() +
            ["  float zyx_f[8][8];",
             "  #pragma unroll",
             "  for (int i = 0; i < 8; i++)",
             "    #pragma unroll",
             "    for (int j = 0; j < 8; j++) zyx_f[i][j] = 0.0f;"])


def _fma_products(layout):
    rows, cols = layout
    return (["    const unsigned char* zyx_st = zyx_sp + (zyx_cur - zyx_base);",
             "    #pragma unroll",
             "    for (int zyx_q = 0; zyx_q < 8; zyx_q++) {",
             "      float4 zyx_av[8], zyx_bv[8];"] + rows.reads() + cols.reads() +
            ["      #pragma unroll",
             "      for (int i = 0; i < 8; i++)",
             "        #pragma unroll",
             "        for (int j = 0; j < 8; j++)",
             "          #pragma unroll",
             "          for (int kk = 0; kk < 4; kk++)",
             f"            zyx_f[i][j] = fmaf({rows.value('i')}, {cols.value('j')}, "
             "zyx_f[i][j]);",
             "    }"])


def _fma_outputs(layout):
    rows, cols = layout
    return [(f"zyx_r0 + zyx_a1 + {rows.steps[i]}", f"zyx_c0 + zyx_b1 + {cols.steps[j]}",
             f"zyx_f[{i}][{j}]") for i in range(8) for j in range(8)]


def _step_products(p, a_bytes, fence_acc):
    """A K step's warpgroup products from the stage at shared address zyx_cur (A at 0,
    B at `a_bytes`): 4 products of 32 bytes of K each (k16 of 16-bit values, k8 of
    TF32), committed as one group, then a wait for all but that group (the step
    before's are done); `fence_acc` keeps the accumulators' registers in place around
    the asynchronous products."""
    return ["    #pragma unroll",
            "  " + fence_acc,
            '    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");',
            "    #pragma unroll",
            f"    for (int zyx_ks = 0; zyx_ks < {ROW_BYTES // 32}; zyx_ks++) {{",
            f"      zyx_wgmma(zyx_d, {_descriptor('zyx_cur', p.a_kfast, 'zyx_wg * 64')}, "
            f"{_descriptor(f'(zyx_cur + {a_bytes}u)', p.b_kfast, None)});",
            "    }",
            '    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");',
            '    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");',
            "    #pragma unroll",
            "  " + fence_acc]


def _outputs(bc):
    """(row, col, accumulator) of each of a consumer work-item's outputs: accumulator
    4j + q at row lane / 4 (+8 for q >= 2) of its warp's 16, col 8j + 2 (lane % 4) (+1
    for odd q), as mma.sync's m16n8 blocks."""
    return [(f"zyx_r0 + zyx_wg * 64 + zyx_w4 * 16 + {(q >> 1) * 8} + (zyx_lane >> 2)",
             f"zyx_c0 + {j * 8 + (q & 1)} + (zyx_lane & 3) * 2", f"zyx_d[{4 * j + q}]")
            for j in range(bc // 8) for q in range(4)]


def lower_wgmma(kernel, dl, info, name, p, var):
    """The `GPUKernel` of plan `p` (see `usable`) on Hopper warpgroup products (module
    docstring); `var`: gemm's knobs ("wm", "wn", "stages": see `shape`). Plans whose
    operands tensor maps can copy go to `lower_wgmma_tma`."""
    if tma_usable(kernel.ops, p, info, var):
        return lower_wgmma_tma(kernel, dl, info, name, p, var)
    ops = kernel.ops
    br, bc, n_stages = shape(p, info, var)
    bk = WG_K
    threads = 2 * br            # a warpgroup (128 work-items) per 64 rows
    a_bytes, b_bytes = br * bk * 2, bc * bk * 2
    stage_bytes = a_bytes + b_bytes
    fr = Frame(kernel, dl, p, br, bc, bk, threads)
    it = fr.it
    nkt = -(-p.nk // bk)
    nacc = bc // 2

    copies = [_Copies(dl, ops, p, fr, "a", br, p.a_kfast, 0, threads),
              _Copies(dl, ops, p, fr, "b", bc, p.b_kfast, a_bytes, threads)]
    ahead = n_stages - 2        # K steps copied ahead of the products

    def issue(step):
        """The copies of K step `step` (a C expression) into its stage, and a commit
        (an empty group past the end: "all but the newest N groups" then always counts
        steps)."""
        out = [f"  if ({step} < {nkt}) {{",
               f"    const {it} zyx_kn = ({it})({step}) * {bk};",
               f"    const unsigned zyx_buf = zyx_base + (({step}) % {n_stages}) * "
               f"{stage_bytes}u;"]
        for c in copies:
            out += c.issue
        return out + ["  }", '  asm volatile("cp.async.commit_group;" ::: "memory");']

    fence_acc = (f"  for (int q = 0; q < {nacc}; q++) "
                 f"asm volatile(\"\" : \"+f\"(zyx_d[q]) :: \"memory\");")
    body = ["  extern __shared__ __align__(1024) unsigned char zyx_smem[];"] + fr.head + [
        f"  const unsigned zyx_base = ((unsigned)__cvta_generic_to_shared(zyx_smem) + "
        f"{ATOM - 1}u) & ~{ATOM - 1}u;",
        "  const int zyx_lane = (int)(zyx_tid % 32);",
        "  const int zyx_wg = (int)(zyx_tid / 128);",
        "  const int zyx_w4 = (int)((zyx_tid / 32) % 4);",
        f"  float zyx_d[{nacc}];",
        "  #pragma unroll",
        f"  for (int q = 0; q < {nacc}; q++) zyx_d[q] = 0.0f;"]
    for c in copies:
        body += c.setup
    body += [f"  for (int zyx_s = 0; zyx_s < {ahead}; zyx_s++) {{"]
    body += ["  " + line for line in issue("zyx_s")] + ["  }"]
    # Step kt: its copies landed (this work-item's: wait_group; everyone's: the barrier,
    # after the fence that orders the generic-proxy copies before wgmma's async-proxy
    # reads). Each warpgroup left step kt - 1 after waiting for its products of step kt
    # - 2, so past the barrier no product reads step kt - 2's stage: it takes the copies
    # of step kt + STAGES - 2. Step kt's products are issued and left running while the
    # next step waits and copies (wait_group 1).
    body += [f"  for (int zyx_kt = 0; zyx_kt < {nkt}; zyx_kt++) {{",
             f'    asm volatile("cp.async.wait_group {ahead - 1};" ::: "memory");',
             '    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");',
             f"    {dl.barrier()};"]
    body += ["  " + line for line in issue(f"zyx_kt + {ahead}")]
    body.append(f"    const unsigned zyx_cur = zyx_base + (zyx_kt % {n_stages}) * "
                f"{stage_bytes}u;")
    body += _step_products(p, a_bytes, fence_acc)
    body += ["  }",
             '  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");',
             "  #pragma unroll",
             fence_acc]
    body += fr.epilogue(dl, ops, p, _outputs(bc))
    # the instruction's transpose bits: 0 reads a K-major tile, 1 an MN-major one
    prelude = _HELPERS + _wgmma_function(_PTX[p.narrow.name], bc, not p.a_kfast,
                                         not p.b_kfast)
    g = fr.kernel(kernel, dl, name, body, "wgmma",
                  {"rows": br, "cols": bc, "k": bk, "stages": n_stages,
                   "mma": _PTX[p.narrow.name]}, prelude=prelude)
    g.launches[0].shared = smem_bytes(br, bc, n_stages)
    return g
