"""Tile / lane / unroll choices: how a reduce kernel's outputs sit in registers.

The kernelizer (zyx/_core/kernelizer.pyx) renders every stored node once, plainly, with
its `_Builder`; for a kernel with one reduce it then asks this module how to lay the
outputs out, reading the symbolic indices that first rendering logged, and renders the
kernel again following the answer. Nothing here builds IR or decides what is fused: the
answers are plans the builder carries out (`_Builder.build(pos, layout)`), chosen so that
gcc keeps a CPU's vector registers busy. GPU devices ask for few of them
(DeviceInfo.register_tiles, tile_min_outputs, window_tiles, own_tiles: gpu.lower
spreads outputs over work-items instead).

Decided here:
- `choose_upcast`: a reduce kernel's output layout, None for one output per iteration.
  "lanes" when some load strides through memory along the innermost reduce loop while
  every load is contiguous (or constant) along the last output axis: an R x 16 tile, the
  16 lanes innermost, R rows sharing each loaded vector (R = 16 on 64-byte vectors: 1.7x
  faster than 4 rows on a matmul's weight gradient; 8 on 32-byte, 4 otherwise). Its rows
  avoid an axis whose broadcast loads step by a multiple of SET_STRIDE (rows sharing L1
  sets: an attention backward's per-head layout, 3.5 -> 1.75 ms per kernel) and take
  ALIASED_ROWS where no other axis exists (a 1024-wide row-major matmul: 20 -> 10.7 ms).
  "unroll" (a 4x4 tile of scalar accumulators, reduce loop innermost) when every load is
  contiguous along the reduce loop, from UNROLL_MIN_REDUCE terms, with reduce lanes
  below REDUCE_LANES_BELOW. Window lanes (a convolution's short window: R rows along an
  axis its lane loads are constant in) and channel lanes (CHANNEL_LANES: lanes over an
  earlier axis, a convolution's output channels, when the last axis holds no whole
  vector) are the conv-shaped variants of "lanes".
- `upcast_candidates`: the autotuner's search space (zyx/tuning.py), `choose_upcast`'s
  pick first; `upcast_label` names a layout for the schedule cache.
- `contiguous_reduces`: one loop over neighbouring reduced axes that are neighbours in
  memory (MERGE_REDUCES): gcc keeps a register tile in registers across one long loop,
  not across two nested ones (a transformer's weight gradient over (B, T): 3.9 vs 1.3 ms).
- `channel_lane_rows`: the rows of a channel-lanes tile; nn.functional predicts the
  tile from it through DeviceInfo.channel_lane_rows.

Layouts: `(r, [(axis, size), ...], "lanes")` (r: the reduce's node position; the pairs
outermost first, the last one the lanes) or `(r, [(i, 4), (j, 4)], "unroll", J)` (J:
reduce lanes, 0 for none). Every tile size divides the axis it splits.

The builder is the interface: the functions take a `_Builder` after its first `build`
and only read, never write,
  b.reduce_log   [(reduce position, [innermost loop Var, or None, per reduced axis])]
  b.load_log     [the symbolic index (symbolic.Sum) of every load]
  b.out_vars     {output axis: its Var}
and, in `contiguous_reduces`, b.nodes, b.src(node, i) (the reduce input's shape) and
b.rows (None unless a row kernel). Module-level constants are read at each call, so
benches/flag_ab.py can flip them (`zyx.codegen.heuristics.CHANNEL_LANES`).

This module imports zyx._core.symbolic and zyx._core.kernel only: never the kernelizer,
a backend, the runtime or the tensor API. Cython compiles it (setup.py COMPILED_PY), as
it did when it was part of the kernelizer; it runs once per kernel while planning.
"""
from zyx._core import symbolic as sym
from zyx._core.kernel import LOAD


def _coef(s, var):
    """Coefficient of loop variable `var` in index `s`; None when it sits inside a div/mod."""
    c = 0
    for atom, k in s.terms:
        if type(atom) is sym.Var:
            if atom.id == var.id:
                c = k
        elif _mentions(atom, var):
            return None
    return c


def _mentions(atom, var):
    if type(atom) is sym.Var:
        return atom.id == var.id
    return any(_mentions(a, var) for a, _ in atom.num.terms)


def _tile_frame(b, shape):
    """What output layouts are built around, for a kernel with one reduce: (reduce
    position, innermost reduce loop variable, the output axes longer than 1, the last of
    them, its length, its output variable); None when there is no such frame."""
    if len(b.reduce_log) != 1:
        return None
    r, rvars = b.reduce_log[0]
    loop_vars = [v for v in rvars if v is not None]
    axes = [a for a, n in enumerate(shape) if n != 1]
    if not axes or not loop_vars:
        return None
    axis = axes[-1]
    out_var = b.out_vars.get(axis)
    if out_var is None:
        return None
    return r, loop_vars[-1], axes, axis, shape[axis], out_var


def choose_upcast(b, shape, vector_bytes=64, windows=True):
    """How to lay out a reduce kernel's outputs (None: one output per iteration).

    "lanes": some load strides through memory along the innermost reduce loop while every
    load is contiguous (or constant) along the last output axis -> Rx16 output tile with
    the 16 lanes innermost, R rows sharing each loaded vector: 16 rows where a vector
    register holds 16 floats (16 of AVX-512's 32 registers; 1.7x faster than 4 rows on a
    matmul's weight gradient), 8 with 32-byte vectors, 4 otherwise. "unroll": every load
    is contiguous along the reduce loop -> 4x4 tile of scalar accumulators with the reduce
    loop innermost (_choose_unroll). `windows` False (GPU devices, where the MNIST
    convnet ran slower with them): no tile for a reduce whose loads are all contiguous
    along a short innermost loop (a convolution's window row), and never window lanes."""
    frame = _tile_frame(b, shape)
    if frame is None:
        return None
    r, k, axes, axis, n, out_var = frame
    J = 16 if n % 16 == 0 else (8 if n % 8 == 0 else (n if n <= 32 else 0))
    strided = False
    lanes_ok = J >= 2
    for s in b.load_log:
        ck = _coef(s, k)
        cj = _coef(s, out_var)
        if ck is None or cj is None:
            return None
        if cj not in (0, 1):
            lanes_ok = False
        if ck not in (0, 1):
            strided = True
    if windows and CHANNEL_LANES and (n < 16 or (k.hi < 15 and n % 16)):
        # a last axis without whole vectors (a convolution's output width, or its weight
        # gradient's kernel width), short itself or with a short window: lanes over
        # channels
        up = _choose_channel_lanes(b, shape, axes, axis, vector_bytes, r)
        if up is not None:
            return up
    if not strided:
        if not windows and k.hi < 15:
            return None      # a short window (a convolution's): no tile at all on GPUs
        # a short innermost loop (a convolution's window row) gains little from scalar
        # accumulators running along it: vector lanes over the output width first, when
        # they fill a vector: fewer than 4 lanes (a 3x3 convolution's weight gradient,
        # whose last axis is the kernel width) ran 3.4x slower than the 4x4 unroll tile
        # with reduce lanes (9.8 vs 2.9 ms, found by the autotuner)
        if windows and lanes_ok and k.hi < 15 and J >= 4:
            up = _choose_window_lanes(b, shape, axes, axis, J, vector_bytes, r)
            if up is not None:
                return up
        up = _choose_unroll(b, shape, axes, k, r)
        if up is not None or not lanes_ok or not windows:
            return up
        return _choose_window_lanes(b, shape, axes, axis, J, vector_bytes, r)
    if not lanes_ok:
        return None
    plan = [(axis, J)]
    if J == 16 and len(axes) >= 2:
        rows = 16 if vector_bytes >= 64 else (8 if vector_bytes >= 32 else 4)
        row_axis = _lane_rows_axis(b, shape, axes, out_var, rows)
        st = _row_step(b, row_axis, out_var)
        if st and st % SET_STRIDE == 0:
            # every row's broadcast load in the same L1 sets (a 1024-wide row-major
            # matmul's left operand, 4 KB apart): no more rows than the sets have ways
            rows = min(rows, ALIASED_ROWS)
        while rows > 4 and shape[row_axis] % rows:
            rows //= 2
        if shape[row_axis] % rows == 0:
            plan.insert(0, (row_axis, rows))   # rows x 16 lanes: independent FMA chains
    if len(plan) == 1 and windows:
        # no rows on the axis before: rows where loads are reused (a convolution's input
        # gradient reads each window of the output gradient for every input channel)
        up = _choose_window_lanes(b, shape, axes, axis, J, vector_bytes, r)
        if up is not None:
            return up
    return (r, plan, "lanes")


ALIASED_ROWS = 8      # "lanes" rows whose loads share L1 sets (at most the sets' ways)
SET_STRIDE = 1024     # elements (4 KB of float32): rows this far apart share L1 sets


def _row_step(b, a, out_var):
    """The largest step through memory, along output axis `a`, of the loads that
    broadcast along the lanes (`out_var`); None when a load's step is not constant."""
    v = b.out_vars.get(a)
    if v is None:
        return None
    worst = 0
    for s in b.load_log:
        cj, cr = _coef(s, out_var), _coef(s, v)
        if cr is None:
            return None
        if cj == 0 and cr:
            worst = max(worst, abs(cr))
    return worst


def _lane_rows_axis(b, shape, axes, out_var, rows):
    """The output axis of a "lanes" tile's rows: the one before the lanes, unless the
    loads broadcast along the lanes step through memory along it by a multiple of
    SET_STRIDE: then its rows all fall into the same L1 sets (16 rows 32 KB apart in an
    attention backward's per-head layout: 12 ways, 16 lines, each pass evicting the
    last), and another axis that `rows` divides, whose broadcast loads step less, is
    taken."""
    def step(a):
        return _row_step(b, a, out_var)
    first = axes[-2]
    st = step(first)
    if st is None or st == 0 or st % SET_STRIDE:
        return first
    best, best_step = first, st
    for a in axes[:-1]:
        sa = step(a)
        if a != first and shape[a] % rows == 0 and sa and sa % SET_STRIDE and sa < best_step:
            best, best_step = a, sa
    return best


CHANNEL_LANES = True   # conv-like kernels: lanes over an earlier axis (see below)


def channel_lane_rows(n, two_vectors):
    """The rows a channel-lanes tile (`_choose_channel_lanes`) takes along an output axis
    of length n: the most of its choices that divide n, 0 for none. Registers: R x J/vec
    accumulators, J/vec weight vectors and a broadcast, so fewer rows with two vectors of
    lanes. nn.functional asks it too (`_lazy_last_axis`, through
    DeviceInfo.channel_lane_rows)."""
    choices = [8, 6, 5, 4, 3, 2] if two_vectors else [12, 10, 8, 6, 5, 4, 3, 2]
    for c in choices:
        if n % c == 0:
            return c
    return 0


def _choose_channel_lanes(b, shape, axes, axis, vector_bytes, r):
    """Lanes along an output axis before the last (a convolution's output channels, whose
    operand a stored copy keeps channels innermost: nn.functional) when the last axis is
    too short for whole vectors: every reduce-body load is contiguous or constant along
    the lanes, whole vectors of them. Rows go along the output axis where the most rows
    divide and the loads contiguous along the lanes are constant (a weight vector reused
    by every row) while some other load varies (a value broadcast to the lanes): R x J
    accumulators in one or two vectors, each reduce step R broadcasts and J/V vector
    loads for R*J/V FMAs (V floats a vector). The stores stride through memory (once per
    output, after the whole reduction)."""
    rvars = [v for v in b.reduce_log[0][1] if v is not None]
    body = [s for s in b.load_log if any(_coef(s, v) != 0 for v in rvars)]
    vec = max(vector_bytes // 4, 4)
    lane = None
    for a in axes[:-1]:
        v = b.out_vars.get(a)
        if v is None or shape[a] % vec:
            continue
        coefs = [_coef(s, v) for s in body]
        if all(c in (0, 1) for c in coefs) and 1 in coefs and 0 in coefs and \
                (lane is None or shape[a] > shape[lane]):
            lane = a
    if lane is None:
        return None
    lv = b.out_vars[lane]
    J = 2 * vec if shape[lane] % (2 * vec) == 0 else vec
    best, best_rows = None, 0
    for a in axes:
        v = b.out_vars.get(a)
        if a == lane or v is None:
            continue
        reused = varies = False
        for s in body:
            cl, ca = _coef(s, lv), _coef(s, v)
            if ca is None:
                reused = False
                break
            if cl == 1:
                if ca != 0:
                    break        # the lanes' vector changes along this axis
                reused = True
            elif ca != 0:
                varies = True
        else:
            if reused and varies:
                rows = channel_lane_rows(shape[a], J > vec)
                if rows >= best_rows:          # ties: the later axis
                    best, best_rows = a, rows
    if best is None or best_rows < 2:
        return None
    return (r, [(best, best_rows), (lane, J)], "lanes")


def _choose_window_lanes(b, shape, axes, axis, J, vector_bytes, r):
    """Lanes for a reduce whose loads are all contiguous along its innermost loop but
    which _choose_unroll refuses (a short window: a convolution's kernel width): J lanes
    along the last output axis, times R rows along another output axis that every load
    varying along the lanes is constant in, while some load varying along the rows is
    constant along the lanes. For conv2d that is the output channel: each input vector
    is reused by R channels and each weight broadcast over J positions, R*J FMAs per
    R + 1 loads instead of one FMA per two loads."""
    out_var = b.out_vars[axis]
    if J % 4 == 0 and J not in (8, 16):
        # gcc keeps R rows of one 4-, 8- or 16-float vector in registers; a 20-lane row
        # (16 + a tail of 4) stays in memory: conv2d 32->32 5x5 on 24x24 took 100 ms with
        # 8x20 tiles, 57 ms with 8x4 (8x16 and 32x4 rows spill: 130-180 ms)
        J = 4
    rvars = [v for v in b.reduce_log[0][1] if v is not None]
    # the reduce body's loads (an epilogue's, read once per output, may vary along both)
    body = [s for s in b.load_log if any(_coef(s, v) != 0 for v in rvars)]
    best = None
    for a in axes[:-1]:
        v = b.out_vars.get(a)
        if v is None:
            continue
        reused = False
        for s in body:
            cj, cr = _coef(s, out_var), _coef(s, v)
            if cr is None:
                return None
            if cj != 0 and cr != 0:
                break            # this load changes along both: no reuse along rows
            if cj == 0 and cr != 0:
                reused = True
        else:
            if reused and (best is None or shape[a] > shape[best]):
                best = a
    if best is None:
        return None
    rows = 8 if vector_bytes >= 32 else 4
    while rows > 1 and shape[best] % rows:
        rows //= 2
    if rows < 2:
        return None
    return (r, [(best, rows), (axis, J)], "lanes")


REDUCE_LANES_BELOW = 64   # 4x4 tiles: innermost reduce loops shorter keep J partial sums
                          # (256: a transformer's x @ W1.T over 128 ran 153 -> 172 GFLOP/s,
                          # the step 1.6%, but its first step compiled 0.1-0.2 s longer)
UNROLL_MIN_REDUCE = 32    # shortest reduction given the 4x4 tile (attention's q.k over a
                          # head of 32: two layers 2.7 -> 1.2 ms with 8 reduce lanes)


def _choose_unroll(b, shape, axes, k, r):
    """4x4 tile of scalar accumulators when every load is contiguous (or constant) along
    the innermost reduce loop and the two last output axes split by 4, and some load along
    each of them is constant in the other (so rows are reused across the tile).

    4x4 rather than 8x2 (the same 16 accumulators): 8 vector loads per 16 FMAs instead of
    10, and when the row operand is not 64-byte aligned (a numpy batch shared through
    from_numpy is 16-byte aligned) only 4 of them split cache lines instead of 8. x @ W.T
    of the 784-128 MLP: 47 vs 58 us aligned, 54 vs 108 us misaligned (2 threads, C
    harness), training step 0.33 vs 0.37-0.39 ms."""
    if len(axes) < 2:
        return None
    if any(_coef(s, k) not in (0, 1) for s in b.load_log):
        return None
    total = 1
    for v in b.reduce_log[0][1]:
        if v is not None:
            total *= v.hi + 1
    if total < UNROLL_MIN_REDUCE:   # short reductions: not worth 16 accumulators
        return None
    # the last two output axes when they qualify (x @ W.T), else the pair of other axes
    # that does, later axes first (a convolution's weight gradient: output and input
    # channels, in front of the kernel window)
    pairs = [(axes[-2], axes[-1])] + [(i, j) for jj, j in enumerate(reversed(axes))
                                      for i in reversed(axes[:len(axes) - 1 - jj])
                                      if (i, j) != (axes[-2], axes[-1])]
    for i, j in pairs:
        if shape[i] % 4 or shape[j] % 4 or i not in b.out_vars or j not in b.out_vars:
            continue
        vi, vj = b.out_vars[i], b.out_vars[j]
        reuse_i = any(_coef(s, vi) == 0 and _coef(s, vj) not in (0, None) for s in b.load_log)
        reuse_j = any(_coef(s, vj) == 0 and _coef(s, vi) not in (0, None) for s in b.load_log)
        if reuse_i and reuse_j:
            n = k.hi + 1
            lanes = 0 if n >= REDUCE_LANES_BELOW else (
                8 if n % 8 == 0 and n >= 16 else (4 if n % 4 == 0 else 0))
            return (r, [(i, 4), (j, 4)], "unroll", lanes)
    return None


def upcast_candidates(b, shape, vector_bytes=64):
    """Every output layout worth timing for a reduce kernel (the autotuner's search
    space, zyx/tuning.py): choose_upcast's pick first, then no tile, then the same
    families with other sizes: "lanes" with 8 or 16 lanes and 0, 4, 8 or 16 rows (where
    every load is contiguous or constant along the lanes), window lanes with 2, 4 or 8
    rows and 4, 8 or 16 lanes, and the 4x4 "unroll" tile with 0, 4 or 8 reduce lanes.
    Each is legal for any kernel (a tile only groups outputs computed together) and
    divides the axes it splits; equal kernels are dropped by the caller."""
    first = choose_upcast(b, shape, vector_bytes)
    out = [first, None]
    frame = _tile_frame(b, shape)
    if frame is None:
        return out
    r, k, axes, axis, n, out_var = frame
    lanes_ok = True
    for s in b.load_log:
        ck, cj = _coef(s, k), _coef(s, out_var)
        if ck is None or cj is None:
            return out
        if cj not in (0, 1):
            lanes_ok = False
    if lanes_ok:
        for J in (16, 8):
            if n % J:
                continue
            out.append((r, [(axis, J)], "lanes"))
            if len(axes) >= 2:
                for rows in (4, 8, 16):
                    if shape[axes[-2]] % rows == 0:
                        out.append((r, [(axes[-2], rows), (axis, J)], "lanes"))
        if k.hi < 15:
            win = _choose_window_lanes(b, shape, axes, axis, 16 if n % 16 == 0 else n,
                                       vector_bytes, r)
            if win is not None:
                row_axis = win[1][0][0]
                for rows in (2, 4, 8):
                    for J in (4, 8, 16):
                        if shape[row_axis] % rows == 0 and n % J == 0:
                            out.append((r, [(row_axis, rows), (axis, J)], "lanes"))
    unroll = _choose_unroll(b, shape, axes, k, r)
    if unroll is not None:
        for lanes in (0, 4, 8):
            out.append(unroll[:3] + (lanes,))
    seen = []
    for up in out:
        if up not in seen:
            seen.append(up)
    return seen


def upcast_label(up):
    """A short stable name of an output layout (the schedule cache stores it)."""
    if up is None:
        return "plain"
    tile = "x".join([f"{a}:{n}" for a, n in up[1]])
    return f"{up[2]}[{tile}]" + (f"+r{up[3]}" if len(up) > 3 and up[3] else "")


MERGE_REDUCES = True  # one loop over reduced axes that are neighbours in memory


def contiguous_reduces(b, ops):
    """{(reduce position, "merge"): groups of reduced axes} for a kernel with one reduce
    whose neighbouring reduced axes are neighbours in memory in every load (the outer
    one's stride is the inner one's times the inner length: the batch and time axes of
    (B, T, ...) activations), so that one loop can walk them (_Builder.plan_reduce_loops):
    gcc keeps a register tile in registers across one long loop, not across two nested
    ones (a transformer's weight gradient over (B, T): 3.9 vs 1.3 ms). Empty when there is
    nothing to merge, or where loads are guarded (a range check would divide the loop
    variable). Empty too with MERGE_REDUCES off."""
    if not MERGE_REDUCES:
        return {}
    if len(b.reduce_log) != 1 or b.rows is not None:
        return {}
    if any(op[0] == LOAD and op[4] >= 0 for op in ops):
        return {}
    p, logged = b.reduce_log[0]
    axes = b.nodes[p].arg[1]
    sshape = b.nodes[b.src(b.nodes[p], 0)].shape
    seq = [(ax, v) for ax, v in zip(axes, logged) if v is not None]
    if len(seq) < 2 or any(v.hi + 1 != sshape[ax] or sshape[ax] < 2 for ax, v in seq):
        return {}          # (a blocked axis's variable is a part; an empty axis, nothing)
    groups, cur = [], [seq[0]]
    for ax, v in seq[1:]:
        pv = cur[-1][1]
        n = v.hi + 1
        ok = True
        for s in b.load_log:
            ca, cb = _coef(s, pv), _coef(s, v)
            if ca is None or cb is None or ca != n * cb:
                ok = False
                break
        if ok:
            cur.append((ax, v))
        else:
            if len(cur) > 1:
                groups.append(tuple([a for a, _ in cur]))
            cur = [(ax, v)]
    if len(cur) > 1:
        groups.append(tuple([a for a, _ in cur]))
    return {(p, "merge"): tuple(groups)} if groups else {}
