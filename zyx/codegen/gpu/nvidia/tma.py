"""Hopper's tensor memory accelerator (TMA) for the GPU lowerings: tensor maps that a
launch passes as kernel parameters, the analysis that finds one for a product's operand,
and the device helpers (mbarriers, bulk tensor copies) a kernel copies through them.

A tensor map describes a strided tensor in global memory (up to 5 dimensions, the first
contiguous) and the box one copy moves into shared memory, laid out with the 128-byte
swizzle wgmma's descriptors read. One thread issues a box copy; the copy engine moves it
and counts its bytes on an mbarrier that the readers wait on, so the copies need neither
the readers' registers nor their instructions (wgmma.lower_wgmma_tma). Boxes reaching
past a dimension's end are filled with zeros: ragged products need no tests.

A map holds its tensor's address, so the driver encodes it on the host at launch time
(`TensorMap`, gpudriver's launch path, `CUDADriver.encode_tensor_map`), again only when
the buffer moved. The address must be 16-byte aligned and every stride a multiple of 16
bytes (the copy engine also faults on a box whose start is not 16-byte aligned: a map
cannot start below the tensor and shift its coordinates). Strides and the offset in the
buffer are known when the kernel is lowered (`operand_map` refuses the others); the
buffer's address is not (a DLPack tensor may start anywhere): a launch whose buffer is
misaligned runs the kernel lowered without maps instead (gpudriver).
"""
from __future__ import annotations

from ...._core import kernel as K
# an operand a map can copy is one a vector copy can read: a (guarded) global load, or
# a padded window where(test, load, 0), whose failing rows the kernel zeroes
# (wgmma.lower_wgmma_tma)
from ..gemm import operand_source as source
from ..gemm import index_deps
from ..analysis import coefficient, eval_index

MAX_RANK = 5
MAX_BOX = 256
# cuTensorMapEncodeTiled's enums (cuda.h)
DATA_TYPES = {"float16": 6, "bfloat16": 9, "float32": 7}
SWIZZLE_128B = 3
L2_PROMOTION_256B = 3
MAP_BYTES = 128            # sizeof(CUtensorMap); 64-byte aligned
ROW_BYTES = 128            # a box's contiguous extent: one row of the 128-byte swizzle


class TensorMap:
    """A tensor map a launch passes after the kernel's buffer parameters: `arg`, the
    kernel argument whose buffer it maps (with `scratch`, the program's scratch buffer
    of that index: kcopy.py); `offset`, the byte offset of element 0 from the buffer's
    address; `dtype`, its name (DATA_TYPES); `dims`, extents fastest first; `strides`,
    bytes between steps of dims[1:]; `box`, the extents one copy moves."""
    __slots__ = ("arg", "offset", "dtype", "itemsize", "dims", "strides", "box", "scratch")

    def __init__(self, arg, offset, dtype, itemsize, dims, strides, box, scratch=False):
        self.arg, self.offset, self.dtype, self.itemsize = arg, offset, dtype, itemsize
        self.dims, self.strides, self.box = list(dims), list(strides), list(box)
        self.scratch = scratch

    @property
    def source(self):
        """The launch argument holding the mapped buffer (gpu.Launch.args' form)."""
        return ("scratch" if self.scratch else "arg", self.arg)

    def aligned(self, address):
        """True when the buffer at `address` can be mapped (element 0 16-byte aligned)."""
        return (address + self.offset) & 15 == 0

    def __repr__(self):
        return (f"TensorMap({self.source}, {self.dtype}, dims {self.dims}, strides "
                f"{self.strides}, box {self.box})")


def _linear(ops, coefs, ids):
    """The stride of a flat position over `ids` (outermost first) when the index is
    linear in it (each id's coefficient is the next inner one's times that one's
    length), else None."""
    lengths = [ops[i][3] if ops[i][0] == K.INDEX else ops[i][2] for i in ids]
    c = [coefs[i] for i in ids]
    if any(c[j] != c[j + 1] * lengths[j + 1] for j in range(len(c) - 1)):
        return None
    return c[-1]


def _coefficients(ops, index):
    """INDEX/LOOP ssa -> coefficient of the affine `index`, or None."""
    variables = [i for i, o in enumerate(ops) if o[0] in (K.INDEX, K.LOOP)]
    coefs = {v: coefficient(ops, index, v, {}) for v in variables}
    return None if any(c is None for c in coefs.values()) else coefs


def k_groups(ops, p):
    """(G, T): the product's reduce loops split into a channel group G (outermost first),
    whose flat position both operands read linearly, starting from the loop with the
    smallest coefficient in the operand copied K fastest (a matmul: all its loops; no
    loop a padding test depends on), and the other loops T, "taps" (a convolution's
    window rows and cols), which `operand_map` folds into a window's side or gives
    dimensions of their own. None where an operand's index is not affine."""
    coefs, tested = [], set()
    deps = index_deps(ops)
    for val in (p.a, p.b):
        found = source(ops, val)
        c = _coefficients(ops, ops[found[0]][3]) if found else None
        if c is None:
            return None
        coefs.append(c)
        for t in found[1]:
            tested |= set(deps.get(t) or ())
    # (the reference: an operand with a reduce loop stepping by one value, a first)
    ref = next((c for c in coefs if min(c[lp] for lp in p.loops) == 1), coefs[0])
    order = sorted(p.loops, key=lambda lp: (ref[lp], -p.loops.index(lp)))
    if ref[order[0]] < 1:
        return None
    group = [order[0]]
    for lp in order[1:]:
        inner = group[0]
        # (a loop a test depends on stays a tap: the test is applied per K step)
        if lp not in tested and all(c[lp] == c[inner] * ops[inner][2] and c[lp]
                                    for c in coefs):
            group.insert(0, lp)
        else:
            break
    return group, [lp for lp in p.loops if lp not in group]


def k_major(ops, val, inner):
    """True when operand `val` steps by one value along reduce loop `inner`."""
    found = source(ops, val)
    return found is not None and coefficient(ops, ops[found[0]][3], inner, {}) == 1


def operand_map(ops, p, side, kfast, box_side, arg_of, groups, fold=False):
    """(TensorMap, coordinates, tests) of gemm plan `p`'s operand `side` ("a": rows,
    "b": cols) copied in boxes of 128 bytes along its contiguous direction (the channel
    group G of `groups` = k_groups(...) when `kfast`, else its rows or cols) by
    `box_side` rows (cols), or (MN-major) by as many of G as a row holds; None where TMA cannot copy
    it: not a (guarded) global load, an index not affine in the positions or not linear
    in the flat side and G ones, a stride or offset that is not a multiple of 16 bytes,
    more than 5 dimensions. `arg_of`: buffer DEFINE ssa -> kernel argument. The coordinates are C
    expressions, fastest first, of the box at channel offset zyx_kn and the taps' loop
    variables (r{ssa}); an MN-major box's first one is its side origin (the kernel adds
    a row's values per block). A tap whose coefficient is a multiple of the side's stride is folded
    into the side coordinate where `fold` (a window: an image row or col moves the side
    by whole pixels), else it takes a dimension. `tests`: the operand's bool tests (a
    padded window's, `source`) the kernel must apply to the copied rows."""
    val = p.a if side == "a" else p.b
    found = source(ops, val)
    if found is None:
        return None
    op = ops[found[0]]
    tests = found[1]
    dtype = op[1]
    if dtype.name not in DATA_TYPES:
        return None
    coefs = _coefficients(ops, op[3])
    if coefs is None:
        return None
    start = eval_index(ops, op[3], {v: 0 for v in coefs})
    g, taps = groups
    ids = p.rows if side == "a" else p.cols
    other = p.cols if side == "a" else p.rows
    if start is None or any(coefs[i] for i in other):
        return None
    side_stride, g_stride = _linear(ops, coefs, ids), _linear(ops, coefs, g)
    if not side_stride or not g_stride:
        return None
    g_len = 1
    for lp in g:
        g_len *= ops[lp][2]
    extent = p.nr if side == "a" else p.nc
    origin = "zyx_r0" if side == "a" else "zyx_c0"
    folded = [t for t in taps if coefs[t] and fold and kfast and coefs[t] % side_stride == 0]
    if folded:
        # the side coordinate moves by whole rows (pixels): the map starts at the row
        # holding element 0 and spans the buffer's rows; rows past the kernel's (its
        # tests) read whatever is there or zeros
        shift, start = divmod(start, side_stride)
        extent = (ops[op[2]][5] - start) // side_stride
        origin = f"{origin} + {shift}" + "".join(
            f" + {coefs[t] // side_stride} * r{t}" for t in folded)
    if start < 0 or start * dtype.itemsize % 16:
        return None
    if kfast:
        if g_stride != 1:
            return None
        dims, strides, box, coords = [g_len, extent], [side_stride], \
            [ROW_BYTES // dtype.itemsize, box_side], ["zyx_kn", origin]
    else:
        if side_stride != 1 or folded:
            return None
        vals = ROW_BYTES // dtype.itemsize
        dims, strides, box, coords = [extent, g_len], [g_stride], [vals, vals], \
            [origin, "zyx_kn"]
    for t in taps:
        if coefs[t] and t not in folded:
            dims.append(ops[t][2])
            strides.append(coefs[t])
            box.append(1)
            coords.append(f"r{t}")
    for b in p.batch:
        if coefs[b]:
            dims.append(ops[b][3])
            strides.append(coefs[b])
            box.append(1)
            coords.append(f"i{b}")
    size = dtype.itemsize
    strides = [s * size for s in strides]
    if (len(dims) > MAX_RANK or box_side > MAX_BOX or any(s % 16 or s <= 0 for s in strides)
            or max(strides) >= 1 << 40 or max(dims) >= 1 << 31 or min(dims) < 1):
        return None
    return (TensorMap(arg_of[op[2]], start * size, dtype.name, size, dims, strides, box),
            coords, tests)


# the device side: mbarriers and box copies (inline PTX, sm_90)
HELPERS = r"""
struct __align__(64) zyx_tmap { unsigned long long v[16]; };
static __device__ __forceinline__ void zyx_bar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void zyx_bar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void zyx_bar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
static __device__ __forceinline__ void zyx_bar_wait(unsigned bar, unsigned parity) {
  asm volatile("{\n.reg .pred p;\nZYX_WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               "@!p bra ZYX_WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}
static __device__ __forceinline__ void zyx_tma2(unsigned dst, const zyx_tmap* map,
                                                int c0, int c1, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3}], [%4];"
               :: "r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar)
               : "memory");
}
static __device__ __forceinline__ void zyx_tma3(unsigned dst, const zyx_tmap* map,
                                                int c0, int c1, int c2, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];"
               :: "r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
               : "memory");
}
static __device__ __forceinline__ void zyx_tma4(unsigned dst, const zyx_tmap* map,
                                                int c0, int c1, int c2, int c3, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5}], [%6];"
               :: "r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                  "r"(bar) : "memory");
}
static __device__ __forceinline__ void zyx_tma5(unsigned dst, const zyx_tmap* map, int c0,
                                                int c1, int c2, int c3, int c4, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
               :: "r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                  "r"(c4), "r"(bar) : "memory");
}
"""


def copy_call(dst, map_param, coords, bar):
    """The C statement copying the box at `coords` (C expressions, fastest first) of the
    map parameter `map_param` into shared address `dst`, completing on mbarrier `bar`."""
    cs = ", ".join(f"(int)({c})" for c in coords)
    return f"zyx_tma{len(coords)}({dst}, &{map_param}, {cs}, {bar});"
