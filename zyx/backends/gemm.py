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

import os

from .. import dtype as dt
from .._core import kernel as K
from .cfamily import INDEX32, alu_operands, literal, value_line

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


GEMM_DEFAULT = {"fold": 1, "prefetch": 1, "hoist": 1}


def enabled():
    return os.environ.get(GEMM_ENV, "").strip() != "0"


def variant(spec=None):
    """The lowering's knobs from ZYX_GPU_GEMM ("0": no gemm tiles; "fold=0": no block
    totals, every product added into one accumulator as cuBLAS does; "prefetch=0": no
    reading of the next K step during this one's products; "hoist=0": each copy slot's
    row/col variables decoded at every K step instead of once before the loop), read at
    each lowering.
    Totals are kept only for products over more than PLAIN_K terms either way."""
    from .gpu import _read_variant
    spec = os.environ.get(GEMM_ENV, "") if spec is None else spec
    if spec.strip() in ("0", "1"):
        spec = ""
    return _read_variant(GEMM_ENV, GEMM_DEFAULT, {}, spec)


class GemmPlan:
    """What `lower_gemm` needs to know about a kernel (see the module docstring):
    INDEX ssa ids of `rows`, `cols` and `batch` (output order), the reduce `loops`
    (outermost first), the operand ssa ids `a` (rows side) and `b` (cols side), `masks`
    (bools of the reduce position multiplying the product), the inner accumulator `acc`,
    the block `total` register (or None), `block` (flat K iterations per block, 0 when
    not blocked), the global `store` op, and whether each operand's loads are contiguous
    along the innermost reduce loop (`a_kfast`, `b_kfast`: the copy walks K fastest)."""
    __slots__ = ("rows", "cols", "batch", "loops", "a", "b", "masks", "acc", "total",
                 "block", "store", "end", "a_kfast", "b_kfast", "nr", "nc", "nb", "nk", "dtype")


_NARROW = (dt.float16, dt.bfloat16)


def _deps(ops):
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
    from .gpu import child_loops
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
    deps = _deps(ops)
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
    # contiguous along the innermost reduce loop)
    from .gpu import contiguous_loads
    p.a_kfast = contiguous_loads(ops, closure(ops, [a]), inner)
    p.b_kfast = contiguous_loads(ops, closure(ops, [b]), inner)
    p.nr = _product(ops, rows)
    p.nc = _product(ops, cols)
    p.nb = _product(ops, batch)
    p.nk = 1
    for loop in loops:
        p.nk *= ops[loop][2]
    p.dtype = ops[acc][1]
    if p.nr < MIN_SIDE or p.nc < MIN_SIDE or p.nk < MIN_K:
        return None
    return p


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
        if groups >= cores:
            return tile
    return None


def wanted(ops, info):
    """True when `gpu.lower` will take this kernel as a gemm on the device `info`
    (DeviceInfo.own_tiles: the kernelizer leaves it untiled)."""
    if not enabled():
        return False
    p = plan(ops)
    return p is not None and choose_tile(p, info) is not None


def _decode(names, ops, ids, flat, itype, ind):
    """Statements naming INDEX (or LOOP) ids from a flat row-major position `flat`."""
    lines, stride = [], 1
    for k, i in enumerate(reversed(ids)):
        length = ops[i][3] if ops[i][0] == K.INDEX else ops[i][2]
        e = flat if stride == 1 else f"({flat} / {stride})"
        if k != len(ids) - 1:
            e = f"({e} % {length})"
        lines.append(f"{ind}const {itype} {names[i]} = {e};")
        stride *= length
    return lines[::-1]


def _values(dl, ops, roots, names, narrow, ind, skip=()):
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


def _copy_slots(dl, ops, p, side, names, narrow, it, ct, zero, tile_len, bk, kfast, k0,
                hoist=False):
    """Statements computing this work-item's share of one operand tile at K origin `k0`
    into registers zyx_p{side}{s} (0 past the ends), the statements storing them to
    local memory, the slot count, and with `hoist` the statements to put before the K
    loop: each slot's row (or col) position does not change along K, so its variables
    and range test are computed there once (zyx_h{side}{s}_...)."""
    threads = SIDE * SIDE
    per = tile_len * bk
    ids, val = (p.rows, p.a) if side == "a" else (p.cols, p.b)
    extent = p.nr if side == "a" else p.nc
    origin = "zyx_r0" if side == "a" else "zyx_c0"
    stride = tile_len + PAD
    # both operands are masked: an operand computed from a guarded load (0 past the real
    # K) may be inf there (1 / x), and 0 * inf is not 0
    masks = p.masks
    compute, store, before = [], [], []
    for s in range(-(-per // threads)):
        e = f"(zyx_tid + {s * threads})"
        if kfast:
            kk, mm = f"({e} % {bk})", f"({e} / {bk})"
        else:
            kk, mm = f"({e} / {tile_len})", f"({e} % {tile_len})"
        reg = f"zyx_p{side}{s}"
        ragged = per % threads != 0
        inside = f"{origin} + {mm} < {extent}"
        if ragged:
            inside = f"{mm} < {tile_len} && " + inside
        local_names = dict(names)
        ind = "        "
        if hoist:
            hn = {i: f"zyx_h{side}{s}_{names[i]}" for i in ids}
            before.append(f"  const int zyx_h{side}{s} = {inside};")
            before += _decode(hn, ops, ids, f"({origin} + {mm})", it, "  ")
            inside = f"zyx_h{side}{s}"
        guard = f"{inside} && {k0} + {kk} < {p.nk}"
        compute += ["    {", f"      {reg} = {zero};", f"      if ({guard}) {{"]
        if hoist:
            compute += [f"{ind}const {it} {names[i]} = zyx_h{side}{s}_{names[i]};" for i in ids]
        else:
            compute += _decode(local_names, ops, ids, f"({origin} + {mm})", it, ind)
        compute += _decode(local_names, ops, p.loops, f"({k0} + {kk})", it, ind)
        compute += _values(dl, ops, [val] + masks, local_names, narrow, ind)
        v = local_names[val]
        for m in masks:
            v = f"({local_names[m]} ? {v} : {zero})"
        compute += [f"{ind}{reg} = {v};", "      }", "    }"]
        line = f"zyx_l{side}[{kk} * {stride} + {mm}] = {reg};"
        store.append(f"    if ({mm} < {tile_len}) {line}" if ragged else f"    {line}")
    return compute, store, -(-per // threads), before


def lower_gemm(kernel, dl, info, name, p, tile, var=None):
    """The `GPUKernel` of plan `p` with tile (rows, cols, K step) (module docstring);
    `var`: `variant()`'s knobs (None: the environment's)."""
    from .gpu import GPUKernel, Launch, _params, narrow_index
    from .cfamily import Rendered
    var = var if var is not None else variant()
    ops = kernel.ops
    br, bc, bk = tile
    tr, tc = br // SIDE, bc // SIDE
    threads = SIDE * SIDE
    groups_r, groups_c = -(-p.nr // br), -(-p.nc // bc)
    groups = p.nb * groups_r * groups_c
    narrow = narrow_index(ops, [groups * threads, p.nr + br, p.nc + bc, p.nk + 2 * bk])
    it = INDEX32 if narrow else dl.int64
    names = {}
    r = Rendered()
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
    ct = dl.ctype(p.dtype)
    zero = literal(dl, p.dtype, 0)
    sa, sb = br + PAD, bc + PAD           # local row strides (one row per K step)
    fold = bool(p.block) and var["fold"] and p.nk > PLAIN_K
    body = [f"  {dl.local_qualifier}{dl.align16}{ct} zyx_la[{bk * sa}];",
            f"  {dl.local_qualifier}{dl.align16}{ct} zyx_lb[{bk * sb}];",
            f"  const {it} zyx_tid = ({it}){dl.local_id(0)};",
            f"  const {it} zyx_tx = zyx_tid % {SIDE};",
            f"  const {it} zyx_ty = zyx_tid / {SIDE};",
            f"  const {it} zyx_grp = ({it}){dl.group_id(0)};",
            f"  const {it} zyx_r0 = ((zyx_grp / {groups_c}) % {groups_r}) * {br};",
            f"  const {it} zyx_c0 = (zyx_grp % {groups_c}) * {bc};"]
    if p.batch:
        body += _decode(names, ops, p.batch, f"(zyx_grp / {groups_c * groups_r})", it, "  ")
    for i in range(tr):
        for j in range(tc):
            body.append(f"  {ct} zyx_s{i}_{j} = {zero};")
            if fold:
                body.append(f"  {ct} zyx_t{i}_{j} = {zero};")

    hoist = bool(var["hoist"])
    before = []

    def copies(k0):
        ca, sa_, na, ha = _copy_slots(dl, ops, p, "a", names, narrow, it, ct, zero, br, bk,
                                      p.a_kfast, k0, hoist)
        cb, sb_, nb, hb = _copy_slots(dl, ops, p, "b", names, narrow, it, ct, zero, bc, bk,
                                      p.b_kfast, k0, hoist)
        before[:] = ha + hb
        return ca + cb, sa_ + sb_, na, nb
    first, stores, na, nb = copies("0")
    body += before
    body += [f"  {ct} zyx_pa{s};" for s in range(na)] + [f"  {ct} zyx_pb{s};" for s in range(nb)]
    if var["prefetch"]:
        # the next K step's values are read from global memory while this one's products
        # run from local memory
        body += first
        nxt, _, _, _ = copies("(zyx_k0 + %d)" % bk)
    body.append(f"  for ({it} zyx_k0 = 0, zyx_kt = 1; zyx_k0 < {p.nk}; "
                f"zyx_k0 += {bk}, zyx_kt++) {{")
    if not var["prefetch"]:
        cur, _, _, _ = copies("zyx_k0")
        body += cur
    body += stores
    body.append(f"    {dl.barrier()};")
    if var["prefetch"]:
        body.append(f"    if (zyx_k0 + {bk} < {p.nk}) {{")
        body += ["  " + line for line in nxt]
        body.append("    }")
    rows_at = _positions(tr, "zyx_ty")
    cols_at = _positions(tc, "zyx_tx")
    body.append("    #pragma unroll")
    body.append(f"    for (int zyx_q = 0; zyx_q < {bk}; zyx_q++) {{")
    for i in range(tr):
        body.append(f"      const {ct} zyx_a{i} = zyx_la[zyx_q * {sa} + {rows_at[i]}];")
    for j in range(tc):
        body.append(f"      const {ct} zyx_b{j} = zyx_lb[zyx_q * {sb} + {cols_at[j]}];")
    for i in range(tr):
        for j in range(tc):
            body.append(f"      zyx_s{i}_{j} += zyx_a{i} * zyx_b{j};")
    body.append("    }")
    body.append(f"    {dl.barrier()};")
    if fold:
        every = max(p.block // bk, 1)
        body.append(f"    if (zyx_kt % {every} == 0) {{")
        for i in range(tr):
            for j in range(tc):
                body.append(f"      zyx_t{i}_{j} += zyx_s{i}_{j}; zyx_s{i}_{j} = {zero};")
        body.append("    }")
    body.append("  }")
    # epilogue: every output of the sub-tile
    result = p.total if p.total is not None else p.acc
    res_loads = {j for j, op in enumerate(ops)
                 if j > p.end and op[0] == K.LOAD and op[2] == result}
    st = ops[p.store]
    for i in range(tr):
        for j in range(tc):
            ind = "      "
            blk = ["  {",
                   f"    const {it} zyx_x = zyx_r0 + {rows_at[i]};",
                   f"    const {it} zyx_y = zyx_c0 + {cols_at[j]};",
                   f"    if (zyx_x < {p.nr} && zyx_y < {p.nc}) {{"]
            local_names = dict(names)
            blk += _decode(local_names, ops, p.rows, "zyx_x", it, ind)
            blk += _decode(local_names, ops, p.cols, "zyx_y", it, ind)
            acc = f"(zyx_t{i}_{j} + zyx_s{i}_{j})" if fold else f"zyx_s{i}_{j}"
            for q in sorted(res_loads):
                d = ops[q][1]
                local_names[q] = f"v{q}"
                blk.append(f"{ind}const {dl.ctype(d)} v{q} = ({dl.ctype(d)}){acc};")
            blk += _values(dl, ops, [st[3], st[4]], local_names, narrow, ind, skip=res_loads)
            vi = local_names[st[3]]
            if narrow and ops[st[3]][0] == K.CONST:
                vi = literal(dl, dt.int32, ops[st[3]][2])
            blk.append(f"{ind}g{ops[st[2]][3]}[{vi}] = "
                       f"{dl.store_convert(ops[st[2]][1], local_names[st[4]])};")
            blk += ["    }", "  }"]
            body += blk
    src = (f"{dl.kernel_prefix} {name}({', '.join(_params(kernel, dl, r))}) {{\n"
           + "\n".join(body) + "\n}\n")
    args = [("arg", i) for i in range(len(kernel.args))]
    g = GPUKernel(dl.prelude + src, [Launch(name, groups, threads, args)], (), "gemm",
                  32 if narrow else 64)
    g.variant = {"rows": br, "cols": bc, "k": bk}
    return g
