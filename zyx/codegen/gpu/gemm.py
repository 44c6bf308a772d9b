"""Shared-memory tiles for GPU reduce kernels shaped like a matrix product (the "gemm"
strategy of `gpu.lower`): matmul, batched matmul, attention scores, and convolutions as
implicit GEMM.

A kernel qualifies when its one reduce loop nest adds `a * b` into one float accumulator
(optionally masked by the reduce position, and optionally in blocks folded into a total:
the kernelizer's blocked float sums), where `a` does not depend on some output axes and
`b` not on others. Output axes split into three sets:
- rows: axes `a` reads and `b` does not (M of a matmul; N, H, W of a convolution),
- cols: axes `b` reads and `a` does not (N of a matmul; the output channels),
- batch: the others (a batched matmul's batch).
The reduce loops (all of them, in order) are one flat axis K. Each group computes a
BR x BC tile of (rows, cols) for one batch position: per step of BK along K its 256
work-items copy the BR x BK values of `a` and the BK x BC values of `b` into local
memory (each value computed once by the kernel's own ops, with guards past the ends),
then each work-item accumulates a TR x TC sub-tile from local memory (rows ty + 16 i,
cols tx + 16 j: neighbouring work-items read neighbouring local words and store
neighbouring outputs). The side holding the output's innermost axis is "cols", so
stores are coalesced. After the K loop every output of the sub-tile runs the kernel's
epilogue (bias, activation, cast) and its store.

Float sums: a product over at most PLAIN_K terms adds every term into one accumulator
per output, as cuBLAS does (the kernelizer's float64 block totals would cost 64 more
registers per work-item: on an H100, 4096^2 float32 took 4.7 ms with them, 3.8 ms
without). Longer products (a convolution's weight gradient over batch x height x width)
keep the kernelizer's blocks: the sub-tile's accumulators are added into totals about
every block of K (DeviceInfo.sum_block) and restarted (totals in the accumulator's
dtype, not float64, for the registers; a float32 sum of block sums is what OpenBLAS's K
blocking does).

`plan(ops)` finds the sets and operands (`GemmPlan`, or None), `choose_tile` the tile
shape for a device, `lower_gemm` writes the kernel. `gpu.lower` takes this strategy for
every kernel `plan` accepts with enough tiles to fill the device (`wanted`); the
kernelizer then leaves such kernels untiled (DeviceInfo.own_tiles). ZYX_GPU_GEMM=0
turns the strategy off.
"""
from __future__ import annotations

import math
import os

import numpy as np

from ... import dtype as dt
from ..._core import kernel as K
from ..cstyle import INDEX32, Rendered, alu_operands, literal, value_line
from .analysis import child_loops, coefficient, contiguous_loads, eval_index, narrow_index
from .program import GPUKernel, Launch, kernel_params, read_variant

GEMM_ENV = "ZYX_GPU_GEMM"
SIDE = 16              # work-items along each side of a group: 16 x 16 = 256
PAD = 4                # extra words per local row: copies K-fastest spread over banks,
                       # and rows stay 16-byte aligned for vector reads
MIN_SIDE = 16          # fewest rows and cols a gemm kernel has
MIN_K = 8              # shortest flat reduce worth a local-memory tile
PLAIN_K = 8192         # longest flat reduce added into one float accumulator (no totals)
# (rows per group, cols per group, K step) tried largest first
TILES = ((128, 128, 8), (128, 64, 8), (64, 128, 8), (64, 64, 16), (64, 32, 16),
         (32, 64, 16), (32, 32, 16))
# Largest tile (rows x cols) of a product whose operand is computed value by value (a
# convolution's padded window over an NCHW image): each copied value costs index math
# and a guarded load, and twice the groups in flight hide that better than a bigger
# tile's reuse (H200, conv2d 64x64x56x56 3x3 at 64x64 against 64x128: float32 0.72 ->
# 0.61 ms, bfloat16 0.48 -> 0.32, TF32 0.54 -> 0.36). A window copied as vectors (a
# channels-last image) takes the larger tiles: 64x128 against 64x64, float32 0.598 ->
# 0.540 ms, bfloat16 0.236 -> 0.223, TF32 0.332 -> 0.294.
COMPUTED_TILE = 64 * 64


GEMM_DEFAULT = {"fold": 1, "prefetch": 1, "hoist": 1, "mma": 1, "vector": 1, "double": 2,
                "mk": 0, "krun": 8, "korder": 1, "fk": 0, "wgmma": 1, "wm": 0,
                "wn": 0, "stages": 0, "tma": 1, "fma": 1, "kcopy": 1}


def enabled():
    return os.environ.get(GEMM_ENV, "").strip() != "0"


def variant(spec=None):
    """The lowering's knobs from ZYX_GPU_GEMM ("0": no gemm tiles; "fold=0": no block
    totals, every product added into one accumulator as cuBLAS does; "prefetch=0": no
    reading of the next K step during this one's products; "hoist=0": each copy slot's
    row/col variables decoded at every K step instead of once before the loop; "mma=0":
    16-bit products on the float tiles instead of matrix instructions; "vector=0": plain
    loads copied value by value instead of 16 bytes at a time; "double=1": two local
    buffers per operand, one barrier per K step, "double=0": one buffer, two barriers
    (default 2: two buffers on tensor cores only, where they measured 6% faster and
    float tiles 12% slower, and there not for products with an operand copied value by
    value, whose convolution measured 3-5% faster with one); "mk=8|16|32|64": the
    tensor-core K step (default 0: for 16-bit products 32 where both operands are
    copied 16 bytes at a time, else 16, which leaves registers for more groups per SM
    while computed copies wait; for TF32 16, 32 for windows copied as vectors); "krun=N": an operand contiguous
    along K is copied K fastest only where the innermost reduce loop has at least N
    values or the operand is not contiguous along its tile side (default 8; 0: always);
    "korder=0": the flat K keeps the kernel's loop order (`_k_order`); "fk=N": the float
    tiles' K step (default 0: the tile's, gemm.TILES); "wgmma=0": 16-bit products on
    Hopper through mma.sync instead of warpgroup products (wgmma.py); "wm=128|256",
    "wn=128|256": rows and cols per group of those; "stages=N": their K steps in
    shared memory (3-6); the three default to 0, wgmma.py's choice; "tma=0": their
    operands copied by every work-item with cp.async instead of by one thread through
    tensor maps (tma.py); "fma=0": float32 products ("highest") on the float tiles
    instead of through tensor maps into FMA tiles (wgmma.py: matmuls, linear layers,
    channels-last convolutions on Hopper); "kcopy=0": TF32 products with an MN-major
    operand (`a @ b`) on mma.sync instead of warpgroup products reading a K-major copy
    of it (kcopy.py). Read at each lowering.
    Totals are kept only for products over more than PLAIN_K terms either way."""
    spec = os.environ.get(GEMM_ENV, "") if spec is None else spec
    if spec.strip() in ("0", "1"):
        spec = ""
    out = read_variant(GEMM_ENV, GEMM_DEFAULT, {}, spec)
    if out["mk"] not in (0, 8, 16, 32, 64):
        raise ValueError(f"{GEMM_ENV}={spec!r}: mk must be 8 (TF32 only), 16, 32 or 64 "
                         f"(0: automatic)")
    if out["fk"] not in (0, 4, 8, 16, 32):
        raise ValueError(f"{GEMM_ENV}={spec!r}: fk must be 4, 8, 16 or 32 (0: the tile's)")
    if out["wm"] not in (0, 128, 256):
        raise ValueError(f"{GEMM_ENV}={spec!r}: wm must be 128 or 256 (0: automatic)")
    if out["wn"] not in (0, 128, 256):
        raise ValueError(f"{GEMM_ENV}={spec!r}: wn must be 128 or 256 (0: automatic)")
    if out["stages"] not in (0, 3, 4, 5, 6):
        raise ValueError(f"{GEMM_ENV}={spec!r}: stages must be 3 to 6 (0: automatic)")
    if out["double"] not in (0, 1, 2):
        raise ValueError(f"{GEMM_ENV}={spec!r}: double must be 0, 1 or 2 (automatic)")
    return out


class GemmPlan:
    """What `lower_gemm` needs to know about a kernel (see the module docstring):
    INDEX ssa ids of `rows`, `cols` and `batch` (output order), the reduce `loops`
    (outermost first), the operand ssa ids `a` (rows side) and `b` (cols side), `masks`
    (bools of the reduce position multiplying the product), the inner accumulator `acc`,
    the block `total` register (or None), `block` (flat K iterations per block, 0 when
    not blocked), the global `store` op, and whether each operand's loads are contiguous
    along the innermost reduce loop (`a_kfast`, `b_kfast`: the copy walks K fastest),
    `narrow`, the 16-bit dtype both operands are multiplied in (float16, bfloat16) or
    None, `computed`: an operand is more than a plain load (a convolution's padded
    window: a guarded load and a select), `scalar`: such an operand is copied value by
    value (`vector_lanes` takes no vectors of it), `window`: None until `reads_windows`
    answers, and the kernel's `ops`."""
    __slots__ = ("rows", "cols", "batch", "loops", "a", "b", "masks", "acc", "total",
                 "block", "store", "end", "a_kfast", "b_kfast", "nr", "nc", "nb", "nk", "dtype",
                 "narrow", "computed", "scalar", "window", "ops")


_NARROW = (dt.float16, dt.bfloat16)


def index_deps(ops):
    """ssa -> frozenset of INDEX/LOOP ids it depends on, or None for values that read a
    register (accumulators) or come from DEFINE ops."""
    deps = {}
    for i, op in enumerate(ops):
        c = op[0]
        if c in (K.INDEX, K.LOOP):
            deps[i] = frozenset((i,))
        elif c == K.CONST:
            deps[i] = frozenset()
        elif c == K.LOAD:
            if ops[op[2]][2] != K.SCOPE_GLOBAL:
                deps[i] = None
                continue
            parts = [deps.get(op[3], frozenset())] + ([deps.get(op[4])] if op[4] >= 0 else [])
            deps[i] = None if any(p is None for p in parts) else frozenset().union(*parts)
        elif c in (K.CAST, K.UNARY, K.BINARY, K.WHERE, K.MAD):
            parts = [deps.get(j) for j in _operands(op)]
            deps[i] = None if any(p is None for p in parts) else frozenset().union(*parts)
    return deps


def _operands(op):
    """SSA operands of an ALU op, a LOAD (index, guard) or a STORE (index, value)."""
    c = op[0]
    if c == K.LOAD:
        return (op[3],) + ((op[4],) if op[4] >= 0 else ())
    if c == K.STORE:
        return (op[3], op[4]) if op[3] >= 0 else (op[4],)
    return alu_operands(op)


def closure(ops, roots):
    """The value ops `roots` are computed from, in SSA order (INDEX, LOOP, DEFINE and
    CONST ops excluded: names, not statements)."""
    seen, stack = set(), list(roots)
    while stack:
        j = stack.pop()
        if j in seen or j < 0:
            continue
        op = ops[j]
        if op[0] in (K.INDEX, K.LOOP, K.DEFINE, K.CONST):
            continue
        seen.add(j)
        stack.extend(_operands(op))
    return sorted(seen)


def _chain(ops, root, ends):
    """The loops of the nest at `root` following single child loops down."""
    chain = [root]
    while True:
        kids = child_loops(ops, chain[-1], ends)
        if len(kids) != 1:
            return chain
        chain.append(kids[0])


def plan(ops):
    """The kernel's `GemmPlan`, or None when it is not a product it can tile."""
    if any(op[0] in (K.IF_OP, K.BARRIER) for op in ops):
        return None
    regs = {i: op for i, op in enumerate(ops)
            if op[0] == K.DEFINE and op[2] == K.SCOPE_REGISTER}
    if not regs or any(op[5] != 1 or op[6] != K.R_SUM or not op[1].is_float
                                        for op in regs.values()):
        return None
    ends = {op[2]: i for i, op in enumerate(ops) if op[0] == K.ENDLOOP}
    depth, tops = 0, []
    for i, op in enumerate(ops):
        if op[0] == K.LOOP:
            if depth == 0:
                tops.append(i)
            depth += 1
        elif op[0] == K.ENDLOOP:
            depth -= 1
    if len(tops) != 1:
        return None
    root = tops[0]
    end = ends[root]
    loops = _chain(ops, root, ends)
    inner = loops[-1]
    # register updates: `acc = acc + x` inside the innermost loop, and a blocked sum's
    # `total = total + cast(acc)` in the body of one enclosing loop
    updates = []
    for j in range(root, end):
        op = ops[j]
        if op[0] == K.STORE:
            if op[2] not in regs or op[3] != -1:
                return None
            val = ops[op[4]]
            if val[0] != K.BINARY or val[2] != K.B_ADD:
                return None
            for cur, x in ((val[3], val[4]), (val[4], val[3])):
                c = ops[cur]
                if c[0] == K.LOAD and c[2] == op[2] and c[3] == -1:
                    updates.append((j, op[2], x))
                    break
            else:
                return None
    inside = [u for u in updates if inner < u[0] < ends[inner]]
    if len(inside) != 1:
        return None
    _, acc, x = inside[0]
    if any(ops[j][0] == K.LOOP for j in range(inner + 1, ends[inner])):
        return None
    total, block = None, 0
    folds = [u for u in updates if u is not inside[0]]
    if folds:
        if len(folds) != 1 or acc < root or len(regs) != 2:
            return None
        j, total, y = folds[0]
        # y is cast(load acc) in the body of the loop defining acc
        while ops[y][0] == K.CAST:
            y = ops[y][2]
        if ops[y][0] != K.LOAD or ops[y][2] != acc or total > root:
            return None
        level = max(k for k, loop in enumerate(loops) if loop < acc)
        block = 1
        for loop in loops[level + 1:]:
            block *= ops[loop][2]
    elif acc > root or len(regs) != 1:
        return None
    deps = index_deps(ops)
    masks = []
    while ops[x][0] == K.WHERE and ops[ops[x][4]][0] == K.CONST and ops[ops[x][4]][2] == 0:
        masks.append(ops[x][2])
        x = ops[x][3]
    if ops[x][0] == K.CAST and ops[x][1] is ops[acc][1] and ops[ops[x][2]][1] in _NARROW:
        x = ops[x][2]    # a 16-bit product is computed in float: the cast is exact
    mul = ops[x]
    if mul[0] != K.BINARY or mul[2] != K.B_MUL or (
            mul[1] is not ops[acc][1] and mul[1] not in _NARROW):
        return None
    a, b = mul[3], mul[4]
    if deps.get(a) is None or deps.get(b) is None or any(deps.get(m) is None for m in masks):
        return None
    outs = [i for i, op in enumerate(ops) if op[0] == K.INDEX]
    rows = [o for o in outs if o in deps[a] and o not in deps[b]]
    cols = [o for o in outs if o in deps[b] and o not in deps[a]]
    batch = [o for o in outs if o not in rows and o not in cols]
    if not rows or not cols or any(deps[m] & frozenset(rows + cols) for m in masks):
        return None
    innermost = max(outs, key=lambda i: (ops[i][2], i))
    if innermost in rows:
        rows, cols, a, b = cols, rows, b, a
    elif innermost not in cols:
        return None
    # the one global store comes after the nest and reads no loop variable
    stores = [j for j, op in enumerate(ops) if op[0] == K.STORE and op[2] not in regs]
    if len(stores) != 1 or stores[0] < end:
        return None
    store = stores[0]
    for j in closure(ops, [store]):
        op = ops[j]
        if op[0] == K.LOAD and op[2] in regs and op[2] != (total if total is not None else acc):
            return None
        if any(d in loops for d in (deps.get(j) or ())):
            return None
    p = GemmPlan()
    p.rows, p.cols, p.batch, p.loops = rows, cols, batch, loops
    p.a, p.b, p.masks, p.acc, p.total, p.block, p.store = a, b, masks, acc, total, block, store
    p.end = end
    # (copying K fastest reads consecutive memory where the operand's loads are
    # contiguous along the innermost reduce loop; but a short innermost loop (a 3-wide
    # convolution window) gives runs of a few values, while a side contiguous along its
    # own innermost axis (an image row) gives a warp 128 consecutive bytes: that side
    # is copied rows (cols) fastest)
    var = variant()
    run = var["krun"]
    nk = 1
    for loop in loops:
        nk *= ops[loop][2]
    if var["korder"] and (not block or nk <= PLAIN_K):   # (blocks fold past PLAIN_K only)
        loops = p.loops = _k_order(ops, loops, run)
    inner = loops[-1]

    def kfast(val, side_axis):
        ids = closure(ops, [val])
        if not contiguous_loads(ops, ids, inner):
            return False
        return ops[inner][2] >= run or not contiguous_loads(ops, ids, side_axis)
    p.a_kfast = kfast(a, rows[-1])
    p.b_kfast = kfast(b, cols[-1])
    p.nr = _product(ops, rows)
    p.nc = _product(ops, cols)
    p.nb = _product(ops, batch)
    p.nk = 1
    for loop in loops:
        p.nk *= ops[loop][2]
    p.dtype = ops[acc][1]
    p.narrow = mul[1] if mul[1] in _NARROW else None
    p.computed = any(ops[v][0] != K.LOAD or ops[v][4] >= 0 for v in (a, b))
    local = p.narrow or p.dtype         # what the local tiles hold
    p.scalar = any((ops[v][0] != K.LOAD or ops[v][4] >= 0) and
                   vector_lanes(ops, p, side, kfast, local) == 1
                   for v, side, kfast in ((a, "a", p.a_kfast), (b, "b", p.b_kfast)))
    if p.nr < MIN_SIDE or p.nc < MIN_SIDE or p.nk < MIN_K:
        return None
    p.window, p.ops = None, ops     # (reads_windows answers when asked)
    return p


WINDOW_SAMPLE = 1024   # reduce positions reads_windows enumerates (the first ones)


def reads_windows(p):
    """Whether an operand of plan `p` reads overlapping windows (kept in `p.window` once
    asked: see _window_reads)."""
    if p.window is None:
        p.window = _window_reads(p.ops, p)
    return p.window


def _window_reads(ops, p):
    """Whether an operand of plan `p` reads overlapping windows, as a convolution reads
    its image (and its backward passes read theirs): neighbouring positions of an output
    index read some of the same elements over the reduce (x + kx: output x + 1 at kx
    reads what output x reads at kx + 1). A product of matrices never does: its reduce
    steps by whole rows of its outputs' axes, so output m + 1 reads a disjoint row.
    Each load's index math is evaluated (analysis.eval_index) at positions 0 and 1 of
    each row and column index over the first WINDOW_SAMPLE reduce positions (a window's
    neighbours meet within a few taps): a window when the two sets of elements differ
    and meet. Index math eval_index cannot evaluate counts
    as no window. The lowering reads this for zyx.backends.cudnn.allow_tf32
    (DeviceInfo.conv_tf32)."""
    outs = p.rows + p.cols
    trips = [ops[loop][2] for loop in p.loops]
    flat = np.arange(min(math.prod(trips), WINDOW_SAMPLE), dtype=np.int64)
    at_zero = {i: np.int64(0) for i, op in enumerate(ops) if op[0] in (K.INDEX, K.LOOP)}
    for loop, trip in zip(reversed(p.loops), reversed(trips)):   # innermost fastest
        at_zero[loop] = flat % trip
        flat = flat // trip
    for val in (p.a, p.b):
        for j in closure(ops, [val]):
            op = ops[j]
            if op[0] != K.LOAD or ops[op[2]][2] != K.SCOPE_GLOBAL:
                continue
            for o in outs:
                if ops[o][3] < 2:
                    continue
                first = eval_index(ops, op[3], dict(at_zero))
                second = eval_index(ops, op[3], {**at_zero, o: np.int64(1)})
                if first is None or second is None:
                    break
                first, second = np.unique(first), np.unique(second)
                if not np.array_equal(first, second) and \
                        np.intersect1d(first, second, assume_unique=True).size:
                    return True
    return False


def _k_order(ops, loops, run):
    """The reduce loops in the order the flat K walks them (outermost first). A short
    innermost loop (under `run` values: a convolution's window column) trades places
    with a loop whose length is a multiple of 16 (the input channels): a K step of 8 or
    16 then crosses no value of the other loops, whose variables and the index math
    built on them the copies compute once per step (`_Shared`). A sum does not depend
    on its order; float rounding does, as it does on any tile shape."""
    if len(loops) < 2 or ops[loops[-1]][2] >= run:
        return loops
    fits = [lp for lp in loops[:-1] if ops[lp][2] % 16 == 0]
    if not fits:
        return loops
    best = max(fits, key=lambda lp: (ops[lp][2] % 32 == 0, ops[lp][2]))
    return [lp for lp in loops if lp != best] + [best]


def _product(ops, ids):
    n = 1
    for i in ids:
        n *= ops[i][3]
    return n


def choose_tile(p, info, want=None):
    """(rows, cols, K step) per group: the largest tile of TILES whose groups still
    cover the device's compute units (or `want` when it is one of TILES), None when
    even the smallest leaves compute units idle (the other strategies split the
    reductions instead)."""
    cores = max(info.num_cores, 1)
    itemsize = p.dtype.itemsize
    for tile in TILES:
        br, bc, bk = tile
        if want is not None and (br, bc) != tuple(want[:2]):
            continue
        if info.local_mem_size and bk * (br + bc + 2 * PAD) * itemsize > info.local_mem_size:
            continue
        if info.max_local_threads and info.max_local_threads < SIDE * SIDE:
            return None
        groups = p.nb * -(-p.nr // br) * -(-p.nc // bc)
        if want is not None:
            return tile
        if br > max(p.nr, MIN_SIDE * 2) or bc > max(p.nc, MIN_SIDE * 2):
            continue          # a tile larger than the product: idle work-items
        if p.scalar and br * bc > COMPUTED_TILE:
            continue          # (see COMPUTED_TILE)
        if groups >= cores:
            return tile
    return None


PART_MIN_K = 128       # fewest reduce terms per piece of a split product
PART_WAVES = 2         # groups per compute unit a split product aims at


def parts(info, nr, nc, nk, most):
    """How many pieces (a power of two dividing `most`) a product of nr x nc outputs over
    nk terms is cut into before it is built (split-K, DeviceInfo.product_parts): 1 when
    its tiles already cover PART_WAVES x the compute units, else the fewest pieces that
    do, each at least PART_MIN_K terms long. A convolution's weight gradient (32 x 800
    outputs over batch x height x width = 51200 terms in the MNIST convnet) has 25 of the
    smallest tiles for 132 compute units; uncut it took the group strategies, one output
    per group (H200: 1.38 ms; as 16 pieces, 0.195 ms)."""
    if nr < MIN_SIDE or nc < MIN_SIDE:
        return 1
    want = PART_WAVES * max(info.num_cores, 1)
    # the smallest tile's groups: choose_tile takes at least this many when it tiles
    br, bc, _ = TILES[-1]
    tiles = -(-nr // br) * -(-nc // bc)
    n = 1
    while tiles * n < want and most % (2 * n) == 0 and nk // (2 * n) >= PART_MIN_K:
        n *= 2
    # pieces whose tiles still leave compute units idle are not tiled (choose_tile):
    # the group strategies then take the product better uncut
    return n if tiles * n >= max(info.num_cores, 1) else 1


def wanted(ops, info):
    """True when `gpu.lower` will take this kernel as a gemm on the device `info`
    (DeviceInfo.own_tiles: the kernelizer leaves it untiled)."""
    if not enabled():
        return False
    p = plan(ops)
    return p is not None and choose_tile(p, info) is not None


def flat_decode_exprs(ops, ids, flat):
    """[(id, expression)] of INDEX (or LOOP) ids `ids` taken from a flat row-major
    position `flat` (an expression), in the order of `ids` (C and WGSL spell `/` and `%`
    alike)."""
    out, stride = [], 1
    for k, i in enumerate(reversed(ids)):
        length = ops[i][3] if ops[i][0] == K.INDEX else ops[i][2]
        e = flat if stride == 1 else f"({flat} / {stride})"
        if k != len(ids) - 1:
            e = f"({e} % {length})"
        out.append((i, e))
        stride *= length
    return out[::-1]


def decode_flat(names, ops, ids, flat, itype, ind):
    """Statements naming INDEX (or LOOP) ids from a flat row-major position `flat`."""
    return [f"{ind}const {itype} {names[i]} = {e};" for i, e in flat_decode_exprs(ops, ids, flat)]


def value_lines(dl, ops, roots, names, narrow, ind, skip=()):
    """Statements computing `roots` (their closure) with `names` for variables; each call
    site is its own C block, so the v{i} names may repeat."""
    lines = []
    for j in closure(ops, roots):
        if j in skip:
            continue
        lines.append(ind + value_line(dl, ops, j, names, narrow))
    return lines


def _positions(t, tid):
    """Offsets in a tile side of a work-item's `t` rows (or cols): chunks of up to 4
    consecutive ones (local reads the compiler can merge into one vector read), the
    chunks of the 16 work-items side by side, then the next chunks."""
    chunk = min(t, 4)
    return [f"{(q // chunk) * SIDE * chunk} + {tid} * {chunk} + {q % chunk}" for q in range(t)]


class Slots:
    """How `_copy_slots` writes one operand's tile to local memory: `at(kk, mm)` the local
    index of K offset kk and row (or col) offset mm, `stored(reg)` the value stored from
    register `reg`, `reg_type` the registers' C type, `raw` a dialect whose 16-bit loads
    stay bits (or None: every value is computed as the kernel computes it)."""
    __slots__ = ("at", "stored", "reg_type", "raw")

    def __init__(self, at, stored=None, reg_type=None, raw=None):
        self.at, self.stored, self.reg_type, self.raw = at, stored, reg_type, raw


def _slot_names(ops, p, side, names, it, s, kk, mm, k0, ragged_test, hoist, before,
                shared=None):
    """What copy slot `s` of one operand tile (K offset `kk`, row or col offset `mm`)
    needs around its value: its range test (rows or cols inside the product, and
    `ragged_test` where the slots overrun the tile) and the statements naming the
    side's INDEX variables and the reduce loops' inside the slot's block. With `hoist`
    the row (or col) part, constant along K, is appended to `before` (statements put
    before the K loop, zyx_h{side}{s}_...) and only read in the block. `shared` (a
    `_Shared`): which variables the slots share are named there, not here."""
    ids = p.rows if side == "a" else p.cols
    extent = p.nr if side == "a" else p.nc
    origin = "zyx_r0" if side == "a" else "zyx_c0"
    inside = f"{origin} + {mm} < {extent}"
    if ragged_test:
        inside = f"{ragged_test} && " + inside
    ind = "        "
    if hoist:
        hn = {i: f"zyx_h{side}{s}_{names[i]}" for i in ids}
        before.append(f"  const int zyx_h{side}{s} = {inside};")
        before += decode_flat(hn, ops, ids, f"({origin} + {mm})", it, "  ")
        inside = f"zyx_h{side}{s}"
        bind = [f"{ind}const {it} {names[i]} = zyx_h{side}{s}_{names[i]};" for i in ids]
    else:
        bind = decode_flat(names, ops, ids, f"({origin} + {mm})", it, ind)
    k_mode = "all"
    if shared is not None and shared.lines is not None:
        k_mode = shared.k_mode
        if shared.rows_named:
            bind = []
    if k_mode == "none":
        return inside, bind
    if k_mode == "inner":      # the step's other reduce loops are named in `shared`
        inner = p.loops[-1]
        length = ops[inner][2]
        return inside, bind + [f"{ind}const {it} {names[inner]} = "
                               f"(({k0}) % {length}) + {kk};"]
    return inside, bind + decode_flat(names, ops, p.loops, f"({k0} + {kk})", it, ind)


class _Shared:
    """What a work-item's copy slots of one operand tile at K origin `k0` have in common,
    computed once per K step instead of in every slot's block:
    - copies K fastest whose `fast_len` slots per row divide the group's work-items: every
      slot has the same K offset `kk`, so the reduce loops' variables are shared;
    - copies rows (cols) fastest whose `fast_len` slots per row divide the work-items:
      every slot has the same row (col) `mm`, so the side's variables are shared, and
      where the innermost reduce loop's length is a multiple of the K step, so are the
      other reduce loops' (one K step never crosses them: the slots differ in the
      innermost loop alone);
    - then every value of the operand that reads none of the variables the slots differ
      in, and no memory (index math of a convolution's window: its row, channel and
      window position), is computed here once.
    `lines` (None: nothing shared), `k_mode` for `_slot_names` ("all", "none" or
    "inner"), `rows_named` (the side's variables are named here), `names` (the value
    names after `lines`) and `skip` (values computed here)."""

    def __init__(self, dl, ops, p, side, names, narrow, it, k0, kfast, bk, fast_len,
                 kk, mm, roots):
        self.lines, self.k_mode, self.rows_named = None, "all", False
        self.names, self.skip = dict(names), frozenset()
        ids = p.rows if side == "a" else p.cols
        if (SIDE * SIDE) % fast_len:
            return
        ind = "      "
        if kfast:
            lines = decode_flat(self.names, ops, p.loops, f"({k0} + {kk})", it, ind)
            varying = set(ids)
            self.k_mode = "none"
        else:
            origin = "zyx_r0" if side == "a" else "zyx_c0"
            lines = decode_flat(self.names, ops, ids, f"({origin} + {mm})", it, ind)
            self.rows_named = True
            inner = p.loops[-1]
            if len(p.loops) > 1 and ops[inner][2] % bk == 0:
                lines += decode_flat(self.names, ops, p.loops[:-1],
                                 f"({k0} / {ops[inner][2]})", it, ind)
                varying = {inner}
                self.k_mode = "inner"
            else:
                varying = set(p.loops)
        deps = index_deps(ops)
        loaded, hoisted = set(), []
        for j in closure(ops, roots):
            op = ops[j]
            if op[0] == K.LOAD or any(o in loaded for o in _operands(op)):
                loaded.add(j)
            elif deps.get(j) is not None and not (deps[j] & varying):
                hoisted.append(j)
        lines += [ind + value_line(dl, ops, j, self.names, narrow) for j in hoisted]
        self.lines, self.skip = lines, frozenset(hoisted)

    def wrap(self, compute):
        """The slots' statements inside the shared block."""
        if self.lines is None:
            return compute
        return ["    {"] + self.lines + compute + ["    }"]


def _slot_walk(count, threads, kfast, per_row, lanes):
    """The copy slots of a work-item over `count` copies of `lanes` values, `per_row` per
    local row: (slot, flat copy index `e`, K position, row-or-col position, whether the
    last slot is ragged), the K position the faster one where `kfast`."""
    for s in range(-(-count // threads)):
        e = f"(zyx_tid + {s * threads})"
        fast = f"({e} % {per_row})" if lanes == 1 else f"(({e} % {per_row}) * {lanes})"
        slow = f"({e} / {per_row})"
        kk, mm = (fast, slow) if kfast else (slow, fast)
        yield s, e, kk, mm, count % threads != 0


def _copy_slots(dl, ops, p, side, names, narrow, it, zero, tile_len, bk, kfast, k0,
                hoist, slots):
    """Statements computing this work-item's share of one operand tile at K origin `k0`
    into registers zyx_p{side}{s} (0 past the ends), the statements storing them to
    local memory (as `slots` says), the slot count, and with `hoist` the statements to
    put before the K loop: each slot's row (or col) position does not change along K, so
    its variables and range test are computed there once (zyx_h{side}{s}_...)."""
    threads = SIDE * SIDE
    per = tile_len * bk
    val = p.a if side == "a" else p.b
    # both operands are masked: an operand computed from a guarded load (0 past the real
    # K) may be inf there (1 / x), and 0 * inf is not 0
    masks = p.masks
    compute, store, before = [], [], []
    shared = _Shared(dl, ops, p, side, names, narrow, it, k0, kfast, bk,
                     bk if kfast else tile_len, f"(zyx_tid % {bk})",
                     f"(zyx_tid % {tile_len})", [val] + masks)
    for s, e, kk, mm, ragged in _slot_walk(per, threads, kfast, bk if kfast else tile_len, 1):
        reg = f"zyx_p{side}{s}"
        local_names = dict(shared.names)
        ind = "        "
        inside, bind = _slot_names(ops, p, side, names, it, s, kk, mm, k0,
                                   f"{mm} < {tile_len}" if ragged else "", hoist, before,
                                   shared)
        compute += ["    {", f"      {reg} = {zero};",
                    f"      if ({inside} && {k0} + {kk} < {p.nk}) {{"] + bind
        if slots.raw is not None:
            compute += value_lines(dl, ops, [val] + masks, local_names, narrow, ind,
                               skip=shared.skip | {val})
            compute.append(ind + value_line(slots.raw, ops, val, local_names, narrow))
        else:
            compute += value_lines(dl, ops, [val] + masks, local_names, narrow, ind,
                               skip=shared.skip)
        v = local_names[val]
        for m in masks:
            v = f"({local_names[m]} ? {v} : {zero})"
        compute += [f"{ind}{reg} = {v};", "      }", "    }"]
        value = slots.stored(reg) if slots.stored else reg
        line = f"zyx_l{side}[{slots.at(kk, mm)}] = {value};"
        store.append(f"    if ({mm} < {tile_len}) {line}" if ragged else f"    {line}")
    return shared.wrap(compute), store, -(-per // threads), before


VEC_BYTES = 16           # the widest load a GPU issues


def operand_source(ops, val):
    """(LOAD ssa, [bool tests]) of an operand a vector copy (or a tensor map, tma.py)
    can read: a global load, guarded or not, or `where(test, load, 0)` of one (a padded
    window); None else."""
    op, tests = ops[val], []
    if op[0] == K.WHERE and ops[op[4]][0] == K.CONST and ops[op[4]][2] == 0:
        tests.append(op[2])
        val = op[3]
        op = ops[val]
    if op[0] != K.LOAD or ops[op[2]][2] != K.SCOPE_GLOBAL:
        return None
    if op[4] >= 0 and op[4] not in tests:
        tests.append(op[4])
    return val, tests


def vector_lanes(ops, p, side, kfast, local_dtype):
    """Values per 16-byte copy of one operand tile (1: copied value by value). Vectors
    need the operand to be an unmasked global load of the local tile's dtype whose
    index steps by 1 along the copy's fast direction (the innermost reduce loop when
    `kfast`, else the side's innermost output axis), that direction's length a multiple
    of the lanes (a vector never straddles a row or the end), and no guard, or guards
    that do not depend on that direction (`operand_source`: a padded window of a
    channels-last image, one test for the vector's channels). Alignment is checked where
    the kernel runs (a misaligned vector is read value by value)."""
    found = operand_source(ops, p.a if side == "a" else p.b)
    if found is None or p.masks:
        return 1
    op = ops[found[0]]
    if op[1] is not local_dtype:
        return 1
    lanes = VEC_BYTES // op[1].itemsize
    var = p.loops[-1] if kfast else (p.rows if side == "a" else p.cols)[-1]
    length = ops[var][2] if kfast else ops[var][3]
    if length % lanes or coefficient(ops, op[3], var, {}) != 1:
        return 1
    if found[1]:
        deps = index_deps(ops)
        if any(var in (deps.get(t) or {var}) for t in found[1]):
            return 1
    return lanes


def _vector_slots(dl, ops, p, side, names, narrow, it, tile_len, bk, kfast, k0, hoist,
                  at, lanes, local_vector, stored=None):
    """`_copy_slots` for operands `vector_lanes` accepts: each work-item copies whole
    16-bit vectors of `lanes` values (registers zyx_p{side}{s} of 4 32-bit words or 4
    floats). `local_vector`: the lanes are neighbours in the local layout too (one vector
    store), else they are stored one by one. `stored` (4-byte lanes only): what each
    lane becomes before it is stored (TF32 rounding), applied at the store."""
    threads = SIDE * SIDE
    load, tests = operand_source(ops, p.a if side == "a" else p.b)
    op = ops[load]
    d = op[1]
    word = d if d.itemsize == 4 else dt.uint32       # 16-bit lanes travel in pairs
    per_word = 4 // d.itemsize
    vt = dl.vector_type(word, 4)
    wt = dl.ctype(word)
    nvec = tile_len * bk // lanes
    per_row = bk // lanes if kfast else tile_len // lanes
    gq, lq = dl.global_qualifier, dl.local_pointer
    st = dl.storage_type(d)
    compute, store, before = [], [], []
    # (the tests are the same for the vector's lanes: vector_lanes)
    shared = _Shared(dl, ops, p, side, names, narrow, it, k0, kfast, bk, per_row,
                     f"((zyx_tid % {per_row}) * {lanes})",
                     f"((zyx_tid % {per_row}) * {lanes})", [op[3]] + tests)
    for s, e, kk, mm, ragged in _slot_walk(nvec, threads, kfast, per_row, lanes):
        reg = f"zyx_p{side}{s}"
        local_names = dict(shared.names)
        ind = "        "
        inside, bind = _slot_names(ops, p, side, names, it, s, kk, mm, k0,
                                   f"{e} < {nvec}" if ragged else "", hoist, before,
                                   shared)
        compute += ["    {"] + [f"      {reg}.{c} = 0;" for c in "xyzw"]
        compute.append(f"      if ({inside} && {k0} + {kk} < {p.nk}) {{")
        compute += bind
        done = shared.skip
        if tests:
            compute += value_lines(dl, ops, tests, local_names, narrow, ind, skip=done)
            compute.append(f"{ind}if ({' && '.join(local_names[t] for t in tests)}) {{")
            done = done | frozenset(closure(ops, tests))
        compute += value_lines(dl, ops, [op[3]], local_names, narrow, ind, skip=done)
        ptr = f"({local_names[op[2]]} + {local_names[op[3]]})"
        compute.append(f"{ind}const {gq}{st}* zyx_v = {ptr};")
        compute.append(f"{ind}if ({dl.aligned('zyx_v', VEC_BYTES)}) {{")
        compute.append(f"{ind}  {reg} = *({gq}const {vt}*)zyx_v;")
        compute.append(f"{ind}}} else {{")
        for w, c in enumerate("xyzw"):
            parts = [f"(({wt})zyx_v[{w * per_word + h}] << {16 * h})" if h else
                     f"({wt})zyx_v[{w * per_word}]" for h in range(per_word)]
            compute.append(f"{ind}  {reg}.{c} = {' | '.join(parts)};")
        compute += [f"{ind}}}"] + ([f"{ind}}}"] if tests else []) + ["      }", "    }"]
        lines = []
        if stored is not None:
            # converted as they are stored, after this step's products: converting as
            # they arrive would wait for the global loads before the products
            assert per_word == 1, "lane conversions need 4-byte lanes"
            lines = [f"{reg}.{c} = {stored(f'{reg}.{c}')};" for c in "xyzw"]
        if local_vector:
            lines.append(f"*({lq}{vt}*)(zyx_l{side} + {at(kk, mm)}) = {reg};")
        else:
            for q in range(lanes):
                comp = "xyzw"[q // per_word]
                x = f"{reg}.{comp}" if per_word == 1 else \
                    f"(({st})({reg}.{comp} >> {16 * (q % per_word)}))"
                pos = at(f"({kk} + {q})", mm) if kfast else at(kk, f"({mm} + {q})")
                lines.append(f"zyx_l{side}[{pos}] = {x};")
        for line in lines:
            store.append(f"    if ({e} < {nvec}) {line}" if ragged else f"    {line}")
    return shared.wrap(compute), store, -(-nvec // threads), before, vt


def side_copies(dl, ops, p, side, fr, tile_len, bk, kfast, k0, hoist, slots, zero, lanes,
                local_vector):
    """One operand's copy statements (`_vector_slots` when `lanes` > 1, else
    `_copy_slots`): (compute, store, slot count, statements before the loop, register
    type)."""
    if lanes > 1:
        return _vector_slots(dl, ops, p, side, fr.names, fr.narrow, fr.it, tile_len, bk,
                             kfast, k0, hoist, slots.at, lanes, local_vector, slots.stored)
    return _copy_slots(dl, ops, p, side, fr.names, fr.narrow, fr.it, zero, tile_len, bk,
                       kfast, k0, hoist, slots) + (slots.reg_type,)


def buffers(var, tensor_cores=False):
    """Local copies of each operand tile: 2 when the next step is stored while this
    one's products run (double buffering: knob "double", automatic on tensor cores),
    else 1."""
    on = var["double"] == 1 or (var["double"] == 2 and tensor_cores)
    return 2 if var["prefetch"] and on else 1


def k_loop(dl, p, fr, bk, var, sides, products, after, tensor_cores=False):
    """The K loop: each step's copies of the operands of `sides` ((side, tile length,
    kfast, Slots, zero, lanes, local_vector, one buffer's length) each, see
    `side_copies`), the `products(cur)` statements reading the local tiles at offsets
    `cur` (side -> C expression), and `after` (register-only statements: block totals).
    With var["prefetch"] the next step's values are read from global memory into
    registers before this step's products run from local memory; with double buffers
    (`buffers`) they are stored to the other buffer after the products, so one barrier
    per step suffices (else a barrier before and after the products)."""
    hoist = bool(var["hoist"])
    double = buffers(var, tensor_cores) == 2

    def copies(k0, buf="0"):
        compute, store, regs, before = [], [], [], []
        for side, tile_len, kfast, slots, zero, lanes, local_vector, size in sides:
            at = slots.at if buf == "0" else \
                (lambda kk, mm, at=slots.at, size=size: f"{buf} * {size} + {at(kk, mm)}")
            slots_at = Slots(at, slots.stored, slots.reg_type, slots.raw)
            c, st, n, b, t = side_copies(dl, fr.ops, p, side, fr, tile_len, bk, kfast, k0,
                                         hoist, slots_at, zero, lanes, local_vector)
            compute, store, before = compute + c, store + st, before + b
            regs += [(f"zyx_p{side}{s}", t) for s in range(n)]
        return compute, store, regs, before
    first, stores, regs, before = copies("0")
    out = before + [f"  {t} {r};" for r, t in regs]
    loop = (f"  for ({fr.it} zyx_k0 = 0, zyx_kt = 1; zyx_k0 < {p.nk}; "
            f"zyx_k0 += {bk}, zyx_kt++) {{")
    more = f"    if (zyx_k0 + {bk} < {p.nk}) {{"
    barrier = f"    {dl.barrier()};"
    if double:
        out += first + ["  " + line.strip() for line in stores + [barrier]]
        out += [loop, "    const int zyx_cur = (int)((zyx_kt - 1) & 1);", more]
        out += ["  " + line for line in copies(f"(zyx_k0 + {bk})")[0]] + ["    }"]
        out += products({side[0]: f"zyx_cur * {side[7]}" for side in sides})
        out += [more] + ["  " + line for line in copies("", "(1 - zyx_cur)")[1]] + ["    }"]
        out += [barrier]
    else:
        if var["prefetch"]:
            out += first
        out.append(loop)
        if not var["prefetch"]:
            out += copies("zyx_k0")[0]
        out += stores + [barrier]
        if var["prefetch"]:
            out += [more] + ["  " + line for line in copies(f"(zyx_k0 + {bk})")[0]] + ["    }"]
        out += products({side[0]: "0" for side in sides}) + [barrier]
    return out + after + ["  }"]


class Frame:
    """What every tiled product kernel starts with: names of the kernel's constants,
    buffers and variables (`names`), its parameters (`rendered`), the index type `it`
    (32-bit where `narrow`), and the `head` statements: the group's origin zyx_r0,
    zyx_c0 in rows and cols, its batch variables, zyx_tid."""

    def __init__(self, kernel, dl, p, br, bc, bk, threads):
        ops = self.ops = kernel.ops
        self.groups_r, self.groups_c = -(-p.nr // br), -(-p.nc // bc)
        self.groups = p.nb * self.groups_r * self.groups_c
        self.threads = threads
        self.narrow = narrow_index(ops, [self.groups * threads, p.nr + br, p.nc + bc,
                                         p.nk + 2 * bk])
        it = self.it = INDEX32 if self.narrow else dl.int64
        names = self.names = {}
        r = self.rendered = Rendered()
        for i, op in enumerate(ops):
            c = op[0]
            if c == K.CONST:
                names[i] = literal(dl, op[1], op[2])
            elif c == K.DEFINE and op[2] == K.SCOPE_GLOBAL:
                names[i] = f"g{op[3]}"
                r.params.append((op[3], op[1], op[4]))
            elif c == K.INDEX:
                names[i] = f"i{i}"
            elif c == K.LOOP:
                names[i] = f"r{i}"
        gc = self.groups_c
        self.head = [f"  const {it} zyx_tid = ({it}){dl.local_id(0)};",
                     f"  const {it} zyx_grp = ({it}){dl.group_id(0)};",
                     f"  const {it} zyx_r0 = ((zyx_grp / {gc}) % {self.groups_r}) * {br};",
                     f"  const {it} zyx_c0 = (zyx_grp % {gc}) * {bc};"]
        if p.batch:
            self.head += decode_flat(names, ops, p.batch, f"(zyx_grp / {gc * self.groups_r})",
                                 it, "  ")

    def epilogue(self, dl, ops, p, outputs):
        """Statements running the kernel's epilogue and store for each output of
        `outputs`: (row position, col position, accumulated value) C expressions."""
        names, narrow, it = self.names, self.narrow, self.it
        result = p.total if p.total is not None else p.acc
        res_loads = {j for j, op in enumerate(ops)
                     if j > p.end and op[0] == K.LOAD and op[2] == result}
        st = ops[p.store]
        body = []
        for row, col, acc in outputs:
            ind = "      "
            blk = ["  {",
                   f"    const {it} zyx_x = {row};",
                   f"    const {it} zyx_y = {col};",
                   f"    if (zyx_x < {p.nr} && zyx_y < {p.nc}) {{"]
            local_names = dict(names)
            blk += decode_flat(local_names, ops, p.rows, "zyx_x", it, ind)
            blk += decode_flat(local_names, ops, p.cols, "zyx_y", it, ind)
            for q in sorted(res_loads):
                d = ops[q][1]
                local_names[q] = f"v{q}"
                blk.append(f"{ind}const {dl.ctype(d)} v{q} = ({dl.ctype(d)}){acc};")
            blk += value_lines(dl, ops, [st[3], st[4]], local_names, narrow, ind, skip=res_loads)
            vi = local_names[st[3]]
            if narrow and ops[st[3]][0] == K.CONST:
                vi = literal(dl, dt.int32, ops[st[3]][2])
            blk.append(f"{ind}g{ops[st[2]][3]}[{vi}] = "
                       f"{dl.store_convert(ops[st[2]][1], local_names[st[4]])};")
            blk += ["    }", "  }"]
            body += blk
        return body

    def kernel(self, kernel, dl, name, body, strategy, variant, prelude="", extra_params=(),
               bounds=""):
        """The `GPUKernel` of statements `body` (one launch of the frame's groups);
        `extra_params`: declarations after the buffers' (tensor maps), `bounds`: a
        `__launch_bounds__` clause."""
        params = kernel_params(kernel, dl, self.rendered) + list(extra_params)
        src = (f"{dl.kernel_prefix} {bounds}{name}({', '.join(params)}) "
               "{\n" + "\n".join(body) + "\n}\n")
        args = [("arg", i) for i in range(len(kernel.args))]
        g = GPUKernel(dl.prelude + prelude + src,
                      [Launch(name, self.groups, self.threads, args)], (), strategy,
                      32 if self.narrow else 64)
        g.variant = variant
        return g


def lower_gemm(kernel, dl, info, name, p, tile, var=None):
    """The `GPUKernel` of plan `p` with tile (rows, cols, K step) (module docstring);
    `var`: `variant()`'s knobs (None: the environment's). The device's own product
    lowerings (`DeviceInfo.product_lowerings`: matrix instructions, e.g. NVIDIA's tensor
    cores) are tried first; the float tiles below take what none of them takes."""
    var = var if var is not None else variant()
    for lower_product in info.product_lowerings:
        g = lower_product(kernel, dl, info, name, p, tile, var)
        if g is not None:
            return g
    ops = kernel.ops
    br, bc, bk = tile
    bk = var["fk"] or bk
    tr, tc = br // SIDE, bc // SIDE
    fr = Frame(kernel, dl, p, br, bc, bk, SIDE * SIDE)
    names, narrow, it = fr.names, fr.narrow, fr.it
    ct = dl.ctype(p.dtype)
    zero = literal(dl, p.dtype, 0)
    sa, sb = br + PAD, bc + PAD           # local row strides (one row per K step)
    fold = bool(p.block) and var["fold"] and p.nk > PLAIN_K
    nbuf = buffers(var)
    body = [f"  {dl.local_qualifier}{dl.align16}{ct} zyx_la[{nbuf * bk * sa}];",
            f"  {dl.local_qualifier}{dl.align16}{ct} zyx_lb[{nbuf * bk * sb}];"] + fr.head + [
            f"  const {it} zyx_tx = zyx_tid % {SIDE};",
            f"  const {it} zyx_ty = zyx_tid / {SIDE};"]
    for i in range(tr):
        for j in range(tc):
            body.append(f"  {ct} zyx_s{i}_{j} = {zero};")
            if fold:
                body.append(f"  {ct} zyx_t{i}_{j} = {zero};")

    slots_a = Slots(lambda kk, mm: f"{kk} * {sa} + {mm}", None, ct)
    slots_b = Slots(lambda kk, mm: f"{kk} * {sb} + {mm}", None, ct)
    # 16-byte copies where an operand is a plain load; one vector store per copy
    # where its lanes are neighbours in the local rows (rows or cols fastest)
    lanes_a = vector_lanes(ops, p, "a", p.a_kfast, p.dtype) if var["vector"] else 1
    lanes_b = vector_lanes(ops, p, "b", p.b_kfast, p.dtype) if var["vector"] else 1
    rows_at = _positions(tr, "zyx_ty")
    cols_at = _positions(tc, "zyx_tx")

    def products(cur):
        out = ["    #pragma unroll",
               f"    for (int zyx_q = 0; zyx_q < {bk}; zyx_q++) {{"]
        for i in range(tr):
            out.append(f"      const {ct} zyx_a{i} = zyx_la[{cur['a']} + zyx_q * {sa} + "
                       f"{rows_at[i]}];")
        for j in range(tc):
            out.append(f"      const {ct} zyx_b{j} = zyx_lb[{cur['b']} + zyx_q * {sb} + "
                       f"{cols_at[j]}];")
        for i in range(tr):
            for j in range(tc):
                out.append(f"      zyx_s{i}_{j} += zyx_a{i} * zyx_b{j};")
        return out + ["    }"]
    after = []
    if fold:
        every = max(p.block // bk, 1)
        after.append(f"    if (zyx_kt % {every} == 0) {{")
        for i in range(tr):
            for j in range(tc):
                after.append(f"      zyx_t{i}_{j} += zyx_s{i}_{j}; zyx_s{i}_{j} = {zero};")
        after.append("    }")
    body += k_loop(dl, p, fr, bk, var, [
        ("a", br, p.a_kfast, slots_a, zero, lanes_a, not p.a_kfast, bk * sa),
        ("b", bc, p.b_kfast, slots_b, zero, lanes_b, not p.b_kfast, bk * sb)],
        products, after)
    # epilogue: every output of the sub-tile
    body += fr.epilogue(dl, ops, p, [
        (f"zyx_r0 + {rows_at[i]}", f"zyx_c0 + {cols_at[j]}",
         f"(zyx_t{i}_{j} + zyx_s{i}_{j})" if fold else f"zyx_s{i}_{j}")
        for i in range(tr) for j in range(tc)])
    return fr.kernel(kernel, dl, name, body, "gemm", {"rows": br, "cols": bc, "k": bk})
