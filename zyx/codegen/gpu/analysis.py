"""Facts about a kernel's IR that GPU lowerings decide with: its loops and reduce nests
(`reduce_nests`, `Nest`), which accumulators a split would leave partial, how an index
moves along a variable (`coefficient`, `contiguous_loads`), and the ranges index math
takes (`index_ranges`, `narrow_index`: 32-bit where every value fits). Pure functions of
the op list; nothing here writes source."""
from __future__ import annotations

import numpy as np

from ..._core import kernel as K
from ..cstyle import alu_operands


INT32_MAX = 2**31 - 1


def loop_ends(ops):
    """LOOP position -> position of its ENDLOOP."""
    return {op[2]: i for i, op in enumerate(ops) if op[0] == K.ENDLOOP}


def top_level_nests(ops, ends):
    """(LOOP, ENDLOOP) positions of the loops outside every loop and IF: the places where
    all work-items of a group run the same code, so a barrier may follow them."""
    nests, depth = [], 0
    for i, op in enumerate(ops):
        c = op[0]
        if c == K.LOOP:
            if depth == 0:
                nests.append((i, ends[i]))
            depth += 1
        elif c == K.IF_OP:
            depth += 1
        elif c == K.ENDLOOP or c == K.END_IF:
            depth -= 1
    return nests


def child_loops(ops, loop, ends):
    """The loops directly inside `loop`."""
    out, j = [], loop + 1
    while j < ends[loop]:
        if ops[j][0] == K.LOOP:
            out.append(j)
            j = ends[j] + 1
        else:
            j += 1
    return out


def only_wraps(ops, loop, child, ends):
    """True when `loop`'s body is `child` and nothing else but constants."""
    body = list(range(loop + 1, child)) + list(range(ends[child] + 1, ends[loop]))
    return all(ops[j][0] == K.CONST for j in body)


def thread_run(ops, root, ends):
    """The loops of the nest at `root` that the work-items of a group split: follow single
    child loops down from the root, then keep the deepest perfectly nested run (collapsed
    into one flat loop, whose innermost variable moves fastest: consecutive work-items
    read consecutive elements when the innermost loop walks memory contiguously)."""
    chain = [root]
    while True:
        kids = child_loops(ops, chain[-1], ends)
        if len(kids) != 1:
            break
        chain.append(kids[0])
    run = [chain[-1]]
    for loop in reversed(chain[:-1]):
        if not only_wraps(ops, loop, run[0], ends):
            break
        run.insert(0, loop)
    return run


def register_defines(ops):
    """REGISTER DEFINE position -> (dtype, reduce op, length)."""
    return {i: (op[1], op[6], op[5]) for i, op in enumerate(ops)
            if op[0] == K.DEFINE and op[2] == K.SCOPE_REGISTER}


def accumulate_loads(ops, regs, lo, hi):
    """Positions of the `LOAD acc` in every `acc = acc <reduce op> x` store in [lo, hi),
    mapped to x; None when a register store there has another form."""
    found = {}
    for j in range(lo, hi):
        op = ops[j]
        if op[0] != K.STORE or op[2] not in regs:
            continue
        acc = op[2]
        rop = regs[acc][1]
        val = ops[op[4]]
        if op[3] != -1 or rop < 0 or val[0] != K.BINARY or val[2] != K.REDUCE_BINARY[rop]:
            return None
        for cur, x in ((val[3], val[4]), (val[4], val[3])):
            c = ops[cur]
            if c[0] == K.LOAD and c[2] == acc and c[3] == -1:
                found[cur] = (acc, x, j)
                break
        else:
            return None
    return found


class Nest:
    """A top-level reduce loop nest the work-items of a group split.

    `run`: the loops collapsed into the split flat loop; `results`: accumulators defined
    before the nest holding per-work-item partials at its end; `reads_earlier`: the nest
    reads results of an earlier nest (then it cannot be split over groups); `stores`: a
    row kernel's store loop (no accumulator, each iteration stores its own elements:
    the work-items split it and each stores what it computed, nothing to combine)."""
    __slots__ = ("root", "end", "run", "results", "reads_earlier", "flat", "stores")

    def __init__(self, root, end, run, results, reads_earlier, flat, stores=False):
        self.root = root
        self.end = end
        self.run = run
        self.results = results
        self.reads_earlier = reads_earlier
        self.flat = flat
        self.stores = stores


def partial_results(ops, regs, root, end, run, ends):
    """The accumulators holding per-work-item partials after the nest when its `run` is
    split over work-items, or None when splitting it would change the result.

    Inside the split loop an accumulator defined outside it may only be updated by
    `acc = acc op x`; after the split loop its partial value may only flow, through casts,
    into `acc2 = acc2 op partial` with the same reduce op (a blocked sum's float64 fold:
    a sum of partial block sums is the sum); any other use would see a partial."""
    split, split_end = run[0], ends[run[0]]
    acc_loads = accumulate_loads(ops, regs, root, end)
    if acc_loads is None:
        return None
    store_of = {j: (acc, x) for acc, x, j in acc_loads.values()}
    combines = {ops[j][4] for j in store_of}      # the `acc op x` of each update
    partial = {acc for acc, _, j in acc_loads.values() if acc < split < j < split_end}
    tainted = {}          # SSA -> reduce op of the partial value it carries
    for j in range(root, end):
        op = ops[j]
        c = op[0]
        if c in (K.IF_OP, K.BARRIER) or (c == K.STORE and op[2] not in regs):
            return None
        inside = split < j < split_end
        if c == K.LOAD and op[2] in partial and j not in acc_loads:
            if inside:
                return None          # a running partial read mid-loop
            tainted[j] = regs[op[2]][1]
        elif c == K.CAST and op[2] in tainted:
            tainted[j] = tainted[op[2]]
        elif c == K.STORE and not inside:
            acc, x = store_of[j]
            if x not in tainted or tainted[x] != regs[acc][1] or acc > split:
                return None          # not a fold of partials: each work-item would add it
            partial.add(acc)
        elif j not in combines and any(a in tainted for a in alu_operands(op)):
            return None              # a partial used as if it were the whole
    return sorted(a for a in partial if a < root)


def reduce_nests(ops, split_root=False):
    """The kernel's top-level nests as `Nest`s, or None when the group strategy does not
    take this kernel (no loops, register arrays of the CPU's tiled layouts, a loop under
    an IF, a nest storing to memory, an accumulator used in a way a split would change).
    `split_root`: the loop split is each nest's outermost loop (the "columns" strategy
    splits it over groups) instead of its collapsed innermost run."""
    regs = register_defines(ops)
    if not regs or any(length != 1 for _, _, length in regs.values()):
        return None
    ends = loop_ends(ops)
    nests = []
    tops = top_level_nests(ops, ends)
    for k, (root, end) in enumerate(tops):
        run = [root] if split_root else thread_run(ops, root, ends)
        if k == len(tops) - 1 and k > 0 and store_nest(ops, regs, root, end, run, ends):
            flat = 1
            for loop in run:
                flat *= ops[loop][2]
            nests.append(Nest(root, end, run, [], True, flat, True))
            continue
        results = partial_results(ops, regs, root, end, run, ends)
        if not results:
            return None
        written = set(results)
        reads_earlier = any(op[0] == K.LOAD and op[2] in regs and op[2] < root
                            and op[2] not in written for op in ops[root:end])
        flat = 1
        for loop in run:
            flat *= ops[loop][2]
        nests.append(Nest(root, end, run, results, reads_earlier, flat))
    if any(op[0] == K.LOOP for op in ops) and not nests:
        return None
    return nests or None


def store_nest(ops, regs, root, end, run, ends):
    """True when the nest at `root` is a row kernel's store loop (kernelizer.build_rows):
    its perfectly nested `run` is the whole nest, and its body writes no register and
    stores to memory at an index that moves with the run's innermost loop (so every
    iteration writes elements of its own, and work-items splitting the run never write
    the same element)."""
    if run[0] != root or any(ops[j][0] in (K.LOOP, K.IF_OP, K.BARRIER)
                             for j in range(run[-1] + 1, ends[run[-1]])):
        return False
    memo, found = {}, False
    for j in range(root, end):
        op = ops[j]
        if op[0] == K.STORE:
            if op[2] in regs:
                return False
            if coefficient(ops, op[3], run[-1], memo) in (None, 0):
                return False
            found = True
    return found


def index_math(ops):
    """SSA ids of index arithmetic: INDEX and LOOP variables and the integer BINARY ops
    computed from them and constants only (data never flows into an address here)."""
    idx = set()
    for i, op in enumerate(ops):
        c = op[0]
        if c == K.INDEX or c == K.LOOP:
            idx.add(i)
        elif c == K.BINARY and op[1] is K.IDX and op[2] in _RANGE_OPS:
            a, b = op[3], op[4]
            if (a in idx or b in idx) and all(x in idx or ops[x][0] == K.CONST for x in (a, b)):
                idx.add(i)
    return idx


def _div_range(a, d):
    """Range of a / d, C truncation, for a constant d != 0."""
    vals = [int(x / d) for x in a]
    return min(vals), max(vals)


def _binary_range(bop, a, b, b_const):
    """Range of `a bop b` from the operands' ranges (None: not bounded here)."""
    if bop == K.B_ADD:
        return a[0] + b[0], a[1] + b[1]
    if bop == K.B_SUB:
        return a[0] - b[1], a[1] - b[0]
    if bop == K.B_MUL:
        p = [x * y for x in a for y in b]
        return min(p), max(p)
    if bop == K.B_MAX:
        return max(a[0], b[0]), max(a[1], b[1])
    if bop == K.B_MIN:
        return min(a[0], b[0]), min(a[1], b[1])
    if b_const is None or b_const == 0:
        return None
    if bop == K.B_DIV:
        return _div_range(a, b_const)
    m = abs(b_const) - 1      # B_MOD: C's remainder takes the dividend's sign
    return (-m if a[0] < 0 else 0), (m if a[1] > 0 else 0)


_RANGE_OPS = (K.B_ADD, K.B_SUB, K.B_MUL, K.B_MAX, K.B_MIN, K.B_DIV, K.B_MOD)


def index_ranges(ops, idx):
    """[lo, hi] of every index value, by interval arithmetic (None: unbounded)."""
    rng = {}

    def get(j):
        op = ops[j]
        return (op[2], op[2]) if op[0] == K.CONST else rng.get(j)
    for i in sorted(idx):
        op = ops[i]
        if op[0] == K.INDEX:
            rng[i] = (0, op[3] - 1)
        elif op[0] == K.LOOP:
            rng[i] = (0, op[2] - 1)
        else:
            a, b = get(op[3]), get(op[4])
            bc = ops[op[4]][2] if ops[op[4]][0] == K.CONST else None
            rng[i] = None if a is None or b is None else _binary_range(op[2], a, b, bc)
    return rng


def narrow_index(ops, extents):
    """The SSA ids to render as 32-bit index math: all of them when every index value and
    every launch extent (`extents`: global sizes, scratch lengths) fits in an int32,
    else none."""
    idx = index_math(ops)
    if any(n > INT32_MAX for n in extents):
        return frozenset()
    for r in index_ranges(ops, idx).values():
        if r is None or r[0] < -INT32_MAX - 1 or r[1] > INT32_MAX:
            return frozenset()
    return frozenset(idx)


def output_size(ops):
    """Number of outputs: the product of the INDEX extents."""
    n = 1
    for op in ops:
        if op[0] == K.INDEX:
            n *= op[3]
    return n


def coefficient(ops, ssa, var, memo):
    """d(index ssa)/d(var) when the index is affine in `var`, else None."""
    if ssa in memo:
        return memo[ssa]
    op = ops[ssa]
    c = op[0]
    if ssa == var:
        r = 1
    elif c in (K.CONST, K.INDEX, K.LOOP):
        r = 0
    elif c == K.BINARY and op[2] in (K.B_ADD, K.B_SUB, K.B_MUL, K.B_DIV, K.B_MOD):
        a = coefficient(ops, op[3], var, memo)
        b = coefficient(ops, op[4], var, memo)
        if a is None or b is None:
            r = None
        elif op[2] == K.B_ADD:
            r = a + b
        elif op[2] == K.B_SUB:
            r = a - b
        elif op[2] == K.B_MUL:
            if a and b:
                r = None
            elif a:
                r = a * ops[op[4]][2] if ops[op[4]][0] == K.CONST else None
            elif b:
                r = b * ops[op[3]][2] if ops[op[3]][0] == K.CONST else None
            else:
                r = 0
        else:
            r = 0 if a == 0 and b == 0 else None
    else:
        r = None
    memo[ssa] = r
    return r


def contiguous_along(ops, lo, hi, var):
    """True when every global load in [lo, hi) steps by 0 or 1 element along `var` and at
    least one steps by 1 (neighbouring values of var read neighbouring memory)."""
    return contiguous_loads(ops, range(lo, hi), var)


def contiguous_loads(ops, positions, var):
    """`contiguous_along` for the ops at `positions` (any order)."""
    memo, steps = {}, []
    for j in positions:
        op = ops[j]
        if op[0] == K.LOAD and ops[op[2]][2] == K.SCOPE_GLOBAL:
            steps.append(coefficient(ops, op[3], var, memo))
    return bool(steps) and all(s in (0, 1) for s in steps) and 1 in steps


def ends_of(ops, loop):
    """Position of LOOP `loop`'s ENDLOOP."""
    for i in range(loop + 1, len(ops)):
        if ops[i][0] == K.ENDLOOP and ops[i][2] == loop:
            return i
    raise AssertionError(f"loop {loop} has no ENDLOOP")


def eval_index(ops, ssa, env):
    """Index math `ssa` evaluated over numpy arrays (`env`: the loop and INDEX variables'
    values), C semantics; None where it is not index math over those variables."""
    if ssa in env:
        return env[ssa]
    op = ops[ssa]
    if op[0] == K.CONST and not op[1].is_float:
        return op[2]
    if op[0] != K.BINARY or op[2] not in _RANGE_OPS:
        return None
    a, b = eval_index(ops, op[3], env), eval_index(ops, op[4], env)
    if a is None or b is None:
        return None
    bop = op[2]
    if bop == K.B_ADD:
        out = a + b
    elif bop == K.B_SUB:
        out = a - b
    elif bop == K.B_MUL:
        out = a * b
    elif bop == K.B_MAX:
        out = np.maximum(a, b)
    elif bop == K.B_MIN:
        out = np.minimum(a, b)
    else:
        if np.any(np.asarray(b) == 0):
            return None
        q = np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))     # C truncates
        out = q if bop == K.B_DIV else a - b * q
    env[ssa] = out
    return out
