# cython: language_level=3
"""Kernelizer: cut an unrealized subgraph into fused kernels and express each in the IR.

Rules (one pass in reverse topological order decides what is stored to memory):
  * every realization target is stored (a kernel output);
  * elementwise ops and movement ops are never stored: they are inlined into every kernel
    that reads them, movement ops as index arithmetic (symbolic.py), never as copies;
  * a reduce is fused into the kernel that consumes it when everything between them is
    elementwise or a reshape (an epilogue, which keeps the flat index), otherwise it gets a
    kernel of its own. This is the only cut besides the targets: softmax's max and sum are
    cut because an expand of them feeds the next step.
  * so that code stays linear in the graph, also stored: expensive elementwise nodes that
    several kernels (or several indices of one) would each recompute, and the end of every
    long inlined chain (decide_stored).
Each stored node becomes one kernel: global indices over its output, a loop per reduced
axis, loads with guards for padding, one store. Afterwards, elementwise kernels of one
shape that share inputs become one kernel with several stores (_merge_outputs).
How a reduce kernel's outputs are tiled in registers (the "lanes" and "unroll" layouts,
one loop over neighbouring reduced axes) is chosen in zyx/codegen/heuristics.py, from
the indices a first rendering logged; the kernel is then rendered again with that layout.
"""
from . import symbolic as sym
from .graph import (LEAF, CONST, CAST, UNARY, BINARY, WHERE, REDUCE, RESHAPE, PERMUTE, EXPAND,
                    PAD, FLIP)
from .passes import reorder
from .kernel import (Kernel, IDX, CONST as K_CONST, DEFINE, INDEX, LOOP, ENDLOOP, LOAD, STORE,
                     CAST as K_CAST, UNARY as K_UNARY, BINARY as K_BINARY, WHERE as K_WHERE,
                     SCOPE_GLOBAL, SCOPE_REGISTER, B_ADD, B_MUL, B_DIV, B_MOD, B_CMPLT, B_CMPGT,
                     B_AND, REDUCE_BINARY, R_SUM, reduce_identity, U_ERF, U_TANH)
from zyx import dtype as _dt
from zyx.codegen.heuristics import (choose_upcast, contiguous_reduces, upcast_candidates,
                                    upcast_label)

EPILOGUE = frozenset((CAST, UNARY, BINARY, WHERE, RESHAPE))


class Step:
    """One kernel of a plan: `args[:nout]` are the node positions it writes (one, or
    several for a multi-output kernel), the rest it reads."""
    __slots__ = ("kernel", "args", "program", "alias", "nout")

    def __init__(self, kernel, args, alias=False, nout=1):
        self.kernel = kernel
        self.args = args
        self.program = None
        self.alias = alias   # args[0] shares the buffer of args[1] (no kernel)
        self.nout = nout


ELEMENTWISE = frozenset((CAST, UNARY, BINARY, WHERE))


def decide_stored(list nodes, list consumers, list srcpos, list targets, rows=None):
    """Positions of nodes whose value must be written to a buffer (see module doc).

    Besides targets and non-epilogue reduces, an elementwise node is stored when
    - it reaches a reduce's body through an expand and is not trivial: inlined there it
      would be recomputed once per expanded element (a conv's weight gradient would redo
      the whole activation backward for every kernel tap);
    - it is inlined into several kernels and is expensive (`SHARED_LIMIT`): each of them
      would carry its whole expression again (`x = x - x.mean()` repeated n times
      re-inlined every earlier step into every mean's kernel: n^2 code);
    - inlined, it would be rendered at several indices (`x = x + x.flip(0)`, a roll, a
      split's pieces) and the copies add up to `REPEAT_LIMIT` ops: repeated, such steps
      double the code each time;
    - it ends a chain of `CHAIN_LIMIT` inlined nodes (`_cut_long_chains`): a kernel's code
      and the renderer's recursion stay bounded however long the graph is.
    The cuts of long chains are new kernels, so the other rules run again around them.

    A reduce whose result only comes back through an expand over its own axes into one
    stored kernel (softmax's max and sum, layer_norm's mean and variance) is not stored
    when `_RowKernels` says so: that kernel walks each row as often as it needs
    (`rows`, when given, receives {kernel position: (reduced axes, expand positions)})."""
    cdef Py_ssize_t n = len(nodes)
    stored = [False] * n
    for t in targets:
        if nodes[t].op != LEAF:
            stored[t] = True
    found = {}
    _store_by_use(nodes, consumers, srcpos, stored, found)
    if _cut_long_chains(nodes, srcpos, stored):
        found = {}
        _store_by_use(nodes, consumers, srcpos, stored, found)
    if rows is not None:
        rows.update(found)
    return stored


RECOMPUTE_LIMIT = 4   # ops + inputs above which an expanded reduce input gets stored
SHARED_LIMIT = 128    # ops + inputs above which an elementwise node read by 2+ kernels is stored
SHARED_LARGE = 1 << 17   # ... and for nodes of at least this many elements (where a
SHARED_LARGE_LIMIT = 24  # kernel's fixed cost is small beside recomputing every element)
REPEAT_LIMIT = 256    # ops an elementwise node's extra renderings may add before it is stored
CHAIN_LIMIT = 64      # inlined nodes one after another in a kernel before one is stored
_COST_CAP = 1 << 30   # costs count shared inputs once per use: capped, `x = x * x` doubles them


def _numel(tuple shape):
    cdef Py_ssize_t n = 1
    for d in shape:
        n *= d
    return n


def _inline_costs(list nodes, list srcpos, list stored):
    """Rough cost of inlining each node: its elementwise ops + the inputs it reads (a
    stored node or a reduce is one read); and the most elements among those inputs."""
    cdef Py_ssize_t n = len(nodes), p, q, c, m
    cdef list cost = [0] * n
    cdef list inputs = [0] * n
    for p in range(n):
        node = nodes[p]
        op = node.op
        if op == LEAF or op == REDUCE:
            cost[p] = 1
            inputs[p] = _numel(node.shape)
        elif op != CONST:
            c = 1 if op in ELEMENTWISE else 0
            m = 0
            for q in srcpos[p]:
                if stored[q]:
                    c += 1
                    m = max(m, <Py_ssize_t>_numel(nodes[q].shape))
                else:
                    c += <Py_ssize_t>cost[q]
                    m = max(m, <Py_ssize_t>inputs[q])
            cost[p] = c if c < _COST_CAP else _COST_CAP
            inputs[p] = m
    return cost, inputs


def _shared(node, Py_ssize_t cost, Py_ssize_t inputs, Py_ssize_t k, Py_ssize_t u):
    """An elementwise node (inline cost `cost`, largest input `inputs`) worth a buffer of
    its own: not broadcast beyond its inputs, and inlined into several kernels (k == -1)
    at a cost of SHARED_LIMIT ops, or SHARED_LARGE_LIMIT for a large node (a max-pool's
    gradient, which a conv's input gradient, weight gradient and bias gradient each
    recomputed, behind padding guards: convnet step 78 -> 69 ms), or rendered at several
    indices (`u` renderings) adding REPEAT_LIMIT ops."""
    cdef Py_ssize_t n = _numel(node.shape)
    if n > inputs:
        return False
    if k == -1 and (cost >= SHARED_LIMIT or (n >= SHARED_LARGE and cost >= SHARED_LARGE_LIMIT)):
        return True
    return u > 1 and (u - 1) * cost >= REPEAT_LIMIT


def _store_by_use(list nodes, list consumers, list srcpos, list stored, dict found=None):
    """One pass in reverse topological order (consumers before their sources) storing the
    reduces that cannot be fused and the elementwise nodes inlining would recompute.
    `found` receives the row kernels (`_RowKernels.result`)."""
    cdef Py_ssize_t n = len(nodes), p, c, s, k, ck, moved, same, u
    cost, inputs = _inline_costs(nodes, srcpos, stored)
    rk = _RowKernels(nodes, consumers, srcpos, stored)
    # renders[p]: how often p gets rendered over all kernels, roughly. Consumers at p's
    # own index (elementwise ones) render it at most as often as the busiest of them (the
    # memo shares equal indices); a stored consumer, a reduce (its loop index) or a
    # movement op (another index) each add their count.
    renders = [1] * n
    sink = [-1] * n
    kernel = [-1] * n            # the one kernel that inlines the node, -1: several
    in_body = [False] * n        # inlined into some reduce's body
    under_expand = [False] * n   # ... through an expand: recomputed per expanded element
    for p in range(n - 1, -1, -1):
        node = nodes[p]
        if node.op == LEAF or node.op == CONST:
            continue
        if stored[p]:
            sink[p] = p
            kernel[p] = p
            rk.target(p)
            continue
        rk.classify(p)
        s = -2
        k = -2
        moved = 0
        same = 0
        body = False
        expanded = False
        for c in consumers[p]:
            cn = nodes[c]
            cs = sink[c] if cn.op in EPILOGUE else -1
            if s == -2:
                s = cs
            elif s != cs:
                s = -1
            if stored[c]:
                moved += 1
            elif cn.op in ELEMENTWISE:
                same = max(same, <Py_ssize_t>renders[c])
            else:
                moved += <Py_ssize_t>renders[c]
            ck = kernel[c]
            if k == -2:
                k = ck
            elif k != ck:
                k = -1
            if cn.op == REDUCE:
                body = True
            elif not stored[c]:
                body = body or in_body[c]
                # (not through a row expand: what it expands is computed once per row)
                expanded = expanded or under_expand[c] or (
                    cn.op == EXPAND and in_body[c] and not rk.is_row_expand(c))
        if s == -2:
            s = -1
        u = min(moved + same, _COST_CAP)
        if node.op == REDUCE and s == -1:
            if not rk.qualify(p):
                stored[p] = True
                s = p
        elif node.op in ELEMENTWISE and (
                (expanded and cost[p] >= RECOMPUTE_LIMIT) or _shared(node, cost[p], inputs[p], k, u)):
            # (the last not for a node broadcast beyond its inputs, a conv's window
            # view: stored it would be a buffer many times the size of what it reads)
            cut = _stored_slice(p, nodes, consumers, stored, rk)
            if cut >= 0 and not _shared(node, cost[p], inputs[p], k, u):
                # only a slice of p is read (the last step of an LSTM's stacked output):
                # store that slice, computed from p inlined, not all of p
                stored[cut] = True
                rk.target(cut)
                body = expanded = False      # p is inlined into the slice's copy only
            else:
                stored[p] = True
                s = p
        if stored[p]:
            rk.target(p)   # stored after all: a kernel of its own, whose sources it reads
        sink[p] = s
        kernel[p] = p if stored[p] else k
        renders[p] = 1 if stored[p] else max(u, 1)
        in_body[p] = body and not stored[p]
        under_expand[p] = expanded and not stored[p]
    if found is not None:
        found.update(rk.result())


# Unary ops a C kernel computes by calling libm (erff, tanhf), which gcc cannot vectorize in
# the straight-line epilogue of a register tile: see _split_call_epilogues.
_CALL_UNARIES = frozenset((U_ERF, U_TANH))
SPLIT_CALL_EPILOGUES = True     # (a switch for measuring it against the fused form)
CALL_EPILOGUE_MAX_LENGTH = 512  # reduce lengths up to which such an epilogue is split off


def _split_call_epilogues(list nodes, list consumers, list srcpos, list stored, dict rows):
    """Store a short product reduce (a matmul with K <= CALL_EPILOGUE_MAX_LENGTH) whose
    fused epilogue calls erf or tanh (GELU after a linear layer): on a CPU the epilogue of
    a register tile is straight-line code, evaluated one output at a time with a scalar
    libm call, and with a short K it cost more than the products (the recipe LM's first
    feed-forward layer: 64x128 by 512 took 3x its second layer's time for the same work).
    Stored, the reduce is a kernel of sums and products only (reassociated, vectorized)
    and the epilogue an elementwise kernel whose loop gcc vectorizes with libmvec's erff
    and tanhf. Only epilogues of elementwise ops and reshapes that end in stored nodes
    are split (no row kernel's expand, no other reduce's body)."""
    cdef Py_ssize_t n = len(nodes), r, q, c
    for r in range(n):
        node = nodes[r]
        if node.op != REDUCE or stored[r] or node.arg[0] != R_SUM:
            continue
        body = nodes[srcpos[r][0]]
        if body.op != BINARY or body.arg != B_MUL or not node.dtype.is_float:
            continue
        length = 1
        for a in node.arg[1]:
            length *= body.shape[a]
        if length > CALL_EPILOGUE_MAX_LENGTH:
            continue
        calls = False
        ends = []
        todo = [r]
        seen = set()
        ok = True
        while todo and ok:
            q = todo.pop()
            for c in consumers[q]:
                if c in seen:
                    continue
                seen.add(c)
                cn = nodes[c]
                if cn.op not in EPILOGUE:
                    ok = False
                    break
                if cn.op == UNARY and cn.arg in _CALL_UNARIES:
                    calls = True
                if stored[c]:
                    ends.append(c)
                else:
                    todo.append(c)
        if ok and calls and ends and not any(e in rows for e in ends):
            stored[r] = True


def _stored_slice(Py_ssize_t p, list nodes, list consumers, list stored, rk):
    """The position of a PAD reading at most half of p's elements that every use of p goes
    through (a chain of single-use, unstored reshapes/permutes/flips/pads), else -1: what
    to store instead of p when p would be stored only because a reduce recomputes it."""
    cdef Py_ssize_t q = p, c
    total = _numel(nodes[p].shape)
    while len(consumers[q]) == 1:
        c = consumers[q][0]
        cn = nodes[c]
        if stored[c] or cn.op not in (RESHAPE, PERMUTE, FLIP, PAD) or rk.full[c] != -1 \
                or rk.row[c] is not None or rk.rexp[c] is not None:
            return -1
        if cn.op == PAD and 2 * _numel(cn.shape) <= total:
            return c
        q = c
    return -1


ROW_MIN = 32          # fewest rows of a row kernel over more than ROW_SMALL elements
ROW_SMALL = 1 << 16   # (few long rows keep their stored reduces: a device splits each of
                      # those over many work-groups, a row kernel gives a row one group)


def _row_axes_ok(tuple shape, tuple axes):
    """A row kernel over `shape` may reduce `axes`: they are its last axes longer than 1
    (the loop storing a row walks its output contiguously, and the rows spread over
    threads/groups), at least one axis is left for the rows, and the rows are many or
    the tensor small."""
    cdef Py_ssize_t rows = 1, total = 1
    long_axes = [a for a, d in enumerate(shape) if d != 1]
    if not axes or len(axes) >= len(long_axes) or tuple(long_axes[-len(axes):]) != axes:
        return False
    for a, d in enumerate(shape):
        total *= d
        if a not in axes:
            rows *= d
    return rows >= ROW_MIN or total <= ROW_SMALL


class _RowKernels:
    """Which reduces a stored node T computes itself, once per row, instead of reading
    them from a buffer (softmax: max and sum of exp inside the kernel of the output).

    T is a "row kernel" over a full shape S with reduced axes A (the last axes of S, see
    `_row_axes_ok`): T is stored and either elementwise of shape S (softmax's output; the
    kernel indexes the rows, computes the row's reduces, then loops over A to store each
    element) or a reduce over A of a source of shape S (cross-entropy's picked log-prob;
    the kernel is the usual reduce kernel plus the row's other reduces). Nodes relative to
    T, decided from their consumers (all decided before, reverse topological order):
      - full: shape S, every use inside T's kernel at the element's own index: T itself
        (elementwise, or reading its reduce source), full elementwise nodes, reduces
        computed by T;
      - row expand: a full EXPAND from a shape with size 1 at exactly axes B, else equal;
      - row: every use is a row node or row expand of T with the same B;
      - a reduce over B of a shape-S source that is a row node qualifies (not stored) when
        B is T's A (the first qualifying reduce fixes A).
    So a qualifying reduce is used by T's kernel alone, only through row values, which the
    kernel renders once per row before anything else (`_Builder.build_rows`); any other
    shape (a permute or reshape on the way, a second consumer kernel) stores it as before."""

    def __init__(self, list nodes, list consumers, list srcpos, list stored):
        cdef Py_ssize_t n = len(nodes)
        self.nodes, self.consumers, self.srcpos, self.stored = nodes, consumers, srcpos, stored
        self.full = [-1] * n      # T when the node is a full node of T
        self.row = [None] * n     # (T, B) when it is a row node
        self.rexp = [None] * n    # (T, B) when it is a row expand
        self.qual = [-1] * n      # T when it is a reduce computed by T
        self.shape = {}           # T -> S
        self.axes = {}            # T -> A, None while no reduce fixed it
        self.expands = {}         # T -> [(row expand, B)]
        self.reduces = {}         # T -> qualifying reduces

    def target(self, Py_ssize_t p):
        """p is stored: forget its classification, note whether it can be a row kernel."""
        self.full[p] = -1
        self.row[p] = None
        self.rexp[p] = None
        node = self.nodes[p]
        if node.op in ELEMENTWISE:
            self.shape[p] = node.shape
            self.axes[p] = None
        elif node.op == REDUCE:
            ss = self.nodes[self.srcpos[p][0]].shape
            axes = tuple(sorted([a for a in node.arg[1] if ss[a] != 1]))
            if _row_axes_ok(ss, axes):
                self.shape[p] = ss
                self.axes[p] = axes

    def is_row_expand(self, Py_ssize_t p):
        """p expands values computed once per row of its kernel: over the kernel's reduced
        axes A (or, while no reduce has fixed A, over axes a row kernel could reduce). An
        expand over another axis (x @ W's x broadcast over W's output columns, which makes
        T's source look full) repeats its source along that axis: not a row expand."""
        r = self.rexp[p]
        if r is None:
            return False
        T, B = r
        A = self.axes.get(T)
        return B == A if A is not None else _row_axes_ok(self.shape[T], B)

    def classify(self, Py_ssize_t p):
        node = self.nodes[p]
        t = -2
        r = 0
        for c in self.consumers[p]:
            cn = self.nodes[c]
            ct = -1
            cr = None
            if self.stored[c]:
                if c in self.shape and (cn.op in ELEMENTWISE or self.srcpos[c][0] == p):
                    ct = c
            elif cn.op in ELEMENTWISE:
                ct = self.full[c]
                cr = self.row[c]
            elif cn.op == REDUCE:
                ct = self.qual[c]
            elif cn.op == EXPAND:
                cr = self.rexp[c]
            t = ct if t == -2 or t == ct else -1
            r = cr if r == 0 or r == cr else None
        if t >= 0 and node.shape == self.shape[t]:
            self.full[p] = t
            if node.op == EXPAND:
                self.row_expand(p, t)
        if r:
            T, B = r
            S = self.shape[T]
            if node.shape == tuple([1 if a in B else d for a, d in enumerate(S)]):
                self.row[p] = r

    def row_expand(self, Py_ssize_t p, Py_ssize_t t):
        S = self.shape[t]
        ss = self.nodes[self.srcpos[p][0]].shape
        if len(ss) != len(S):
            return
        B = []
        for a in range(len(S)):
            if ss[a] == 1 and S[a] != 1:
                B.append(a)
            elif ss[a] != S[a]:
                return
        if B:
            self.rexp[p] = (t, tuple(B))
            self.expands.setdefault(t, []).append((p, tuple(B)))

    def qualify(self, Py_ssize_t p):
        """True when reduce p is computed by the row kernel its uses lead to."""
        r = self.row[p]
        if r is None:
            return False
        T, B = r
        node = self.nodes[p]
        ss = self.nodes[self.srcpos[p][0]].shape
        axes = tuple(sorted([a for a in node.arg[1] if ss[a] != 1]))
        if ss != self.shape[T] or axes != B:
            return False
        A = self.axes[T]
        if A is None:
            if not _row_axes_ok(ss, axes):
                return False
            self.axes[T] = axes
        elif A != axes:
            return False
        self.qual[p] = T
        self.reduces.setdefault(T, []).append(p)
        return True

    def result(self):
        """{T: (A, row expands over A in topological order)} of every kernel computing
        a reduce of its own."""
        out = {}
        for T in self.reduces:
            A = self.axes[T]
            out[T] = (A, sorted([e for e, B in self.expands.get(T, ()) if B == A]))
        return out


def _cut_long_chains(list nodes, list srcpos, list stored):
    """Store nodes so that no kernel inlines more than CHAIN_LIMIT nodes one after the
    other (`t = t * 1.0001 + 0.0001` written 100,000 times): the renderer recurses once per
    inlined node, and the compiler's time grows faster than the function's length. The cut
    falls on an elementwise op or a reduce (a movement op stored would be a copy) unless a
    chain of movement ops alone grows twice as long.

    Also stored: a view after RESHAPE_LIMIT reshapes that regroup the axes of a permuted,
    flipped, padded or expanded view. Each such reshape nests the index expression in
    another `//` and `%` (a contiguous view's reshapes fold back to the flat index), and
    the expression can double in size each time (`x.reshape(3, 5).T.reshape(15)`
    repeated 20 times took minutes). True when something was stored."""
    cdef Py_ssize_t n = len(nodes), p, q, d, r
    cdef list depth = [0] * n     # longest chain of inlined nodes ending at the node
    cdef list regroups = [0] * n  # most reshapes of a moved view on an inlined path to it
    cdef list moved = [False] * n # a permute/flip/pad/expand on an inlined path to it
    cdef bint cut = False, mv
    for p in range(n):
        node = nodes[p]
        op = node.op
        if op == LEAF or op == CONST:
            continue
        d = 0
        r = 0
        mv = False
        for q in srcpos[p]:
            if not stored[q]:
                d = max(d, <Py_ssize_t>depth[q])
                r = max(r, <Py_ssize_t>regroups[q])
                mv = mv or moved[q]
        d += 1
        if op == PERMUTE or op == FLIP or op == PAD or op == EXPAND:
            mv = True
        elif op == RESHAPE and mv and _regroups_axes(node.shape, nodes[srcpos[p][0]].shape):
            r += 1
        if not stored[p] and (d >= 2 * CHAIN_LIMIT or r >= RESHAPE_LIMIT or (
                d >= CHAIN_LIMIT and (op in ELEMENTWISE or op == REDUCE))):
            stored[p] = True
            cut = True
        depth[p] = d
        regroups[p] = r
        moved[p] = mv
    return cut


RESHAPE_LIMIT = 8     # reshapes of a moved view inlined one after another (_cut_long_chains)


def _regroups_axes(tuple shape, tuple src_shape):
    """True when a reshape does more than add or remove size-1 axes."""
    return [d for d in shape if d != 1] != [d for d in src_shape if d != 1]


def accumulator_dtype(dt):
    return _dt.float32 if dt.name in ("float16", "bfloat16") else dt


# Float sums are accumulated in blocks: the reduce loops are cut into outer loops over
# blocks and inner loops over one block, the inner loops add into a fresh accumulator (in
# registers, vectorized as before) and each block's sum is added into a float64 total.
# No partial sum then grows past a block's sum of values, so float32 sums neither drift
# (16M values near 1000: mean 998.13 with one accumulator per SIMD lane, 1000.4999 now)
# nor stop growing at 2**24. Adding float32 block sums into a double loses nothing worth
# a compensation (Kahan's would be deleted by the associative math the C backend allows
# matmul-like kernels), and costs one add per block.
SUM_BLOCK = 4096    # reduce iterations per block with scalar accumulators (the reduce loop
                    # vectorizes: 256 sequential adds per lane of 16)
LANE_BLOCK = 1024   # ... with one accumulator per output lane (each adds sequentially)
                    # (0 turns blocks off: bench_core compares with SUM_BLOCK = 0)


def block_limit(int rop, acc_dt, long long block):
    """Block length for a reduce accumulating in `acc_dt` (0: not blocked; integer sums are
    exact or wrap, max/min are exact)."""
    return block if rop == R_SUM and acc_dt.is_float else 0


def block_split(list lengths, long long limit):
    """How to cut reduce loops of `lengths` (outermost first) into blocks of at most `limit`
    iterations: (j, b, exact) with loops before j outer, loop j split into ceil(n / b)
    blocks of b (b == 1: loop j is outer as a whole; `exact`: b divides n, else the last
    block is masked) and the loops after j inner. None when all fits in one block."""
    cdef long long inner = 1, n, cap, b
    cdef Py_ssize_t j = len(lengths) - 1
    total = 1
    for n in lengths:
        total *= n
    if limit <= 0 or total <= limit:
        return None
    while inner * lengths[j] <= limit:
        inner *= lengths[j]
        j -= 1
    n = lengths[j]
    cap = limit // inner
    b = cap
    while n % b:
        b -= 1
    if b * inner * 4 >= limit or inner * 4 >= limit:
        return (j, b, True)
    return (j, cap, False)   # no divisor near the block length (a prime length): mask


class _Builder:
    """Renders one stored node into IR by walking the graph from the output down."""

    def __init__(self, list nodes, list stored, Py_ssize_t out, int sum_block=0,
                 dict params=None):
        self.nodes = nodes
        self.stored = stored
        self.out = out
        self.sum_block = sum_block or SUM_BLOCK   # scalar-accumulator float sum block
        self.ops = []
        self.argpos = {}      # node position -> kernel argument number
        self.args = []        # (dtype, length, read_only)
        self.defines = {}     # argument number -> SSA id of its Define
        self.scopes = [{}]    # memo tables, one per open loop
        self.var_ssa = {}
        self.nvars = 0
        self.load_log = []    # symbolic index of every load (for the upcast heuristic)
        self.reduce_log = []  # (reduce position, loop vars) of every reduce rendered
        self.out_vars = {}    # output axis -> Var
        # values read at launch (see kernelize's `params`): (position, axis) -> (leaf
        # position, element); what they render to, and the SSA ids _hoist_index moves up
        self.params = params or {}
        self.param_ssa = {}
        self.hoisted = set()
        self.rows = None      # (reduced axes, row expands) of a row kernel (_RowKernels)
        self.reduce_splits = None   # (reduce position, axis) -> loop sizes (plan_reduce_loops)
        self.out_splits = None      # output axis -> index sizes (build)

    def emit(self, op):
        self.ops.append(op)
        return len(self.ops) - 1

    def const(self, dt, v):
        return self.emit((K_CONST, dt, v))

    def memo_get(self, key):
        for s in reversed(self.scopes):
            r = s.get(key)
            if r is not None:
                return r
        return None

    def new_var(self, Py_ssize_t n):
        v = sym.Var(self.nvars, 0, n - 1)
        self.nvars += 1
        return v

    # -- buffers -------------------------------------------------------------------------
    def arg(self, Py_ssize_t p, bint read_only):
        a = self.argpos.get(p)
        if a is None:
            node = self.nodes[p]
            numel = 1
            for d in node.shape:
                numel *= d
            a = len(self.args)
            self.argpos[p] = a
            self.args.append((node.dtype, numel, read_only))
            self.defines[a] = self.emit((DEFINE, node.dtype, SCOPE_GLOBAL, a, read_only, numel,
                                         -1))
        return self.defines[a]

    # -- values passed at launch -----------------------------------------------------------
    def param(self, tuple slot, dt):
        """The value of parameter `slot` as `dt`: a load of its element of the parameter
        leaf (cast when the leaf holds another dtype), emitted once and hoisted to the
        kernel's start, so every loop nest may use it."""
        r = self.param_ssa.get((slot, dt))
        if r is not None:
            return r
        leaf, element = slot
        src_dt = self.nodes[leaf].dtype
        c = self.const(IDX, element)
        r = self.emit((LOAD, src_dt, self.arg(leaf, True), c, -1))
        self.hoisted.update((c, r))
        if dt is not src_dt:
            r = self.emit((K_CAST, dt, r))
            self.hoisted.add(r)
        self.param_ssa[(slot, dt)] = r
        return r

    def param_offset(self, tuple slot, long long hi):
        """A slice start read at launch, as a symbolic atom in [0, hi]."""
        if hi == 0:
            return 0
        v = self.param_ssa.get(slot)
        if v is None:
            v = self.new_var(hi + 1)
            self.var_ssa[v.id] = self.param(slot, IDX)
            self.param_ssa[slot] = v
        return sym.var(v)

    # -- index expressions ---------------------------------------------------------------
    def index(self, s):
        if not s.terms:
            return self.const(IDX, s.offset)
        key = ("i", s.key)
        r = self.memo_get(key)
        if r is not None:
            return r
        acc = None
        for atom, coef in s.terms:
            a = self.atom(atom)
            if coef != 1:
                a = self.emit((K_BINARY, IDX, B_MUL, a, self.const(IDX, coef)))
            acc = a if acc is None else self.emit((K_BINARY, IDX, B_ADD, acc, a))
        if s.offset:
            acc = self.emit((K_BINARY, IDX, B_ADD, acc, self.const(IDX, s.offset)))
        self.scopes[-1][key] = acc
        return acc

    def atom(self, a):
        if type(a) is sym.Var:
            return self.var_ssa[a.id]
        op = B_DIV if type(a) is sym.Div else B_MOD
        return self.emit((K_BINARY, IDX, op, self.index(a.num), self.const(IDX, a.d)))

    def condition(self, tuple valid):
        cond = None
        for s, lo, hi in valid:
            parts = []
            if s.lo < lo:
                parts.append(self.emit((K_BINARY, _dt.bool_, B_CMPGT, self.index(s),
                                        self.const(IDX, lo - 1))))
            if s.hi > hi:
                parts.append(self.emit((K_BINARY, _dt.bool_, B_CMPLT, self.index(s),
                                        self.const(IDX, hi + 1))))
            for c in parts:
                cond = c if cond is None else self.emit((K_BINARY, _dt.bool_, B_AND, cond, c))
        return cond

    # -- values --------------------------------------------------------------------------
    def load(self, Py_ssize_t p, tuple dims, tuple valid):
        node = self.nodes[p]
        d = self.arg(p, True)
        lin = sym.linearize(dims, node.shape)
        self.load_log.append(lin)
        idx = self.index(lin)
        guard = self.condition(valid) if valid else None
        return self.emit((LOAD, node.dtype, d, idx, -1 if guard is None else guard))

    def render(self, Py_ssize_t p, tuple dims, tuple valid):
        key = (p, tuple([s.key for s in dims]), tuple([(s.key, lo, hi) for s, lo, hi in valid]))
        r = self.memo_get(key)
        if r is not None:
            return r
        r = self._render(p, dims, valid)
        self.scopes[-1][key] = r
        return r

    def _render(self, Py_ssize_t p, tuple dims, tuple valid):
        node = self.nodes[p]
        op = node.op
        if op == LEAF or (self.stored[p] and p != self.out):
            return self.load(p, dims, valid)
        if op == CONST:
            slot = self.params.get((p, -1)) if self.params else None
            if slot is not None:
                return self.param(slot, node.dtype)
            return self.const(node.dtype, node.arg)
        if op == CAST:
            return self.emit((K_CAST, node.dtype, self.render(self.src(node, 0), dims, valid)))
        if op == UNARY:
            return self.emit((K_UNARY, node.dtype, node.arg,
                              self.render(self.src(node, 0), dims, valid)))
        if op == BINARY:
            a = self.render(self.src(node, 0), dims, valid)
            b = self.render(self.src(node, 1), dims, valid)
            return self.emit((K_BINARY, node.dtype, node.arg, a, b))
        if op == WHERE:
            c = self.render(self.src(node, 0), dims, valid)
            a = self.render(self.src(node, 1), dims, valid)
            b = self.render(self.src(node, 2), dims, valid)
            return self.emit((K_WHERE, node.dtype, c, a, b))
        if op == REDUCE:
            return self.reduce(p, dims, valid)
        src = self.src(node, 0)
        sshape = self.nodes[src].shape
        if op == RESHAPE:
            return self.render(src, reshape_index(dims, node.shape, sshape), valid)
        if op == PERMUTE:
            new = [None] * len(dims)
            for k, ax in enumerate(node.arg):
                new[ax] = dims[k]
            return self.render(src, tuple(new), valid)
        if op == EXPAND:
            new = tuple([sym.constant(0) if sshape[d] == 1 and node.shape[d] != 1
                         else dims[d] for d in range(len(dims))])
            if self.rows is not None and valid:
                valid = _valid_for(valid, new)
            return self.render(src, new, valid)
        if op == FLIP:
            return self.render(src, tuple([sym.add(sym.mul(dims[d], -1), sshape[d] - 1)
                                           if d in node.arg else dims[d]
                                           for d in range(len(dims))]), valid)
        if op == PAD:
            pads, fill = node.arg
            new = []
            added = []
            for d, (before, after) in enumerate(pads):
                slot = self.params.get((p, d)) if self.params else None
                if slot is not None:    # a cut axis whose start is read at launch
                    new.append(sym.add(dims[d], self.param_offset(slot, sshape[d] - node.shape[d])))
                    continue
                x = sym.add(dims[d], -before)
                new.append(x)
                if (before > 0 or after > 0) and (x.lo < 0 or x.hi > sshape[d] - 1):
                    added.append((x, 0, sshape[d] - 1))
            v = self.render(src, tuple(new), valid + tuple(added))
            if not added:
                return v
            cond = self.condition(tuple(added))
            return self.emit((K_WHERE, node.dtype, cond, v, self.const(node.dtype, fill)))
        raise AssertionError(f"kernelizer cannot render op {op}")

    def plan_reduce_loops(self, tuple dims, tuple axes, tuple sshape, long long limit,
                          Py_ssize_t p=-1):
        """Loop variables of reduce `p`, cut into blocks of at most `limit` iterations (see
        SUM_BLOCK; `limit` 0: one block). Returns the reduce input's index with the reduced
        axes replaced by loop variables, the outer (block) and inner variables to open, the
        range check of a split loop whose last block is partial (else ()), and per reduced
        axis its innermost variable (None for size 1) for choose_upcast.

        A reduced axis listed in `reduce_splits[(p, axis)]` (sizes, outermost first) gets
        one loop per size: an axis merged from axes that are not neighbours in memory (the
        heads of an attention output read as one feature axis) then indexes memory with
        plain strides instead of a division and a remainder (`_merged_splits`)."""
        new = list(dims)
        reduced = [ax for ax in axes if sshape[ax] != 1]
        for ax in axes:
            if sshape[ax] == 1:
                new[ax] = sym.constant(0)
        virtual = []        # (axis, stride within the axis, loop length)
        groups = self.reduce_splits.get((p, "merge")) if self.reduce_splits else None
        grouped = {}
        for g in groups or ():
            for ax in g:
                grouped[ax] = g
        for ax in reduced:
            g = grouped.get(ax)
            if g is not None:
                if ax == g[0]:     # neighbours in memory: one loop (contiguous_reduces)
                    n = 1
                    for a in g:
                        n *= sshape[a]
                    virtual.append((g, 1, n))
                continue
            sizes = self.reduce_splits.get((p, ax)) if self.reduce_splits else None
            if sizes:
                stride = sshape[ax]
                for size in sizes:
                    stride //= size
                    virtual.append((ax, stride, size))
            else:
                virtual.append((ax, 1, sshape[ax]))
        split = block_split([size for _, _, size in virtual], limit)
        outer, inner, extra, innermost = [], [], (), {}
        parts = {}
        for k, (ax, stride, n) in enumerate(virtual):
            if split is not None and k == split[0] and split[1] > 1:
                b = split[1]
                vo = self.new_var(-(-n // b))
                vi = self.new_var(b)
                outer.append(vo)
                inner.append(vi)
                term = sym.add(sym.mul(sym.var(vo), b), sym.var(vi))
                if not split[2]:
                    extra = ((term, 0, n - 1),)
                innermost[ax] = vi
            else:
                v = self.new_var(n)
                (outer if split is not None and k <= split[0] else inner).append(v)
                term = sym.var(v)
                innermost[ax] = v
            if type(ax) is tuple:
                # each axis of the group from the one loop's variable (the loads'
                # index math folds the divisions back into it: contiguous_reduces)
                inner_n = n
                for i, a in enumerate(ax):
                    inner_n //= sshape[a]
                    e = sym.div(term, inner_n) if inner_n > 1 else term
                    parts[a] = sym.mod(e, sshape[a]) if i else e
                    innermost[a] = innermost[ax]
                del innermost[ax]
                continue
            part = sym.mul(term, stride)
            parts[ax] = part if ax not in parts else sym.add(parts[ax], part)
        for ax, e in parts.items():
            new[ax] = e
        return new, outer, inner, extra, [innermost.get(ax) for ax in axes]

    def open_loops(self, list variables):
        """Open one LOOP (and memo scope) per variable, outermost first."""
        loops = []
        for v in variables:
            loops.append(self.emit((LOOP, IDX, v.hi + 1)))
            self.var_ssa[v.id] = loops[-1]
            self.scopes.append({})
        return loops

    def define_acc(self, acc_dt, int rop, Py_ssize_t length):
        return self.emit((DEFINE, acc_dt, SCOPE_REGISTER, reduce_identity(rop, acc_dt), False,
                          length, rop))

    def reduce_input(self, Py_ssize_t src, list new, tuple valid, tuple extra, acc_dt, int rop):
        """The value to accumulate at index `new`, in the accumulator dtype; past the end
        of a masked last block (`extra`) it is the reduce identity and nothing is loaded."""
        x = self.render(src, tuple(new), valid + extra)
        if self.ops[x][1] is not acc_dt:
            x = self.emit((K_CAST, acc_dt, x))
        if extra:
            x = self.emit((K_WHERE, acc_dt, self.condition(extra), x,
                           self.const(acc_dt, reduce_identity(rop, acc_dt))))
        return x

    def accumulate(self, acc, index, x, acc_dt, int rop):
        cur = self.emit((LOAD, acc_dt, acc, index, -1))
        self.emit((STORE, None, acc, index,
                   self.emit((K_BINARY, acc_dt, REDUCE_BINARY[rop], cur, x))))

    def fold_block(self, total, acc, index, acc_dt):
        """total[index] += block accumulator acc[index], widened to the total's float64."""
        x = self.emit((LOAD, acc_dt, acc, index, -1))
        if acc_dt is not _dt.float64:
            x = self.emit((K_CAST, _dt.float64, x))
        self.accumulate(total, index, x, _dt.float64, R_SUM)

    def close_loops(self, list loops):
        for loop in reversed(loops):
            self.scopes.pop()
            self.emit((ENDLOOP, None, loop))

    def src(self, node, int i):
        return self.pos[node.srcs[i]]

    def reduce(self, Py_ssize_t p, tuple dims, tuple valid):
        node = self.nodes[p]
        rop, axes = node.arg
        src = self.src(node, 0)
        sshape = self.nodes[src].shape
        acc_dt = accumulator_dtype(node.dtype)
        new, outer, inner, extra, logged = self.plan_reduce_loops(
            dims, axes, sshape, block_limit(rop, acc_dt, self.sum_block), p)
        self.reduce_log.append((p, logged))
        total = self.define_acc(_dt.float64, R_SUM, 1) if outer else None
        outer_loops = self.open_loops(outer)
        acc = self.define_acc(acc_dt, rop, 1)
        loops = self.open_loops(inner)
        self.accumulate(acc, -1, self.reduce_input(src, new, valid, extra, acc_dt, rop),
                        acc_dt, rop)
        self.close_loops(loops)
        if outer:
            self.fold_block(total, acc, -1, acc_dt)
            self.close_loops(outer_loops)
            acc, acc_dt = total, _dt.float64
        r = self.emit((LOAD, acc_dt, acc, -1, -1))
        if acc_dt is not node.dtype:
            r = self.emit((K_CAST, node.dtype, r))
        return r

    def build(self, dict pos, upcast=None):
        """Render the kernel. `upcast=(reduce_pos, [(axis, size), ...])` splits those output
        axes into blocks computed together: the reduce keeps one accumulator per block
        element and its innermost loop runs over the last axis' lanes, so loads contiguous
        along that axis vectorize and independent accumulators hide FMA latency
        (matmul-like kernels whose reduce axis is strided in memory)."""
        self.pos = pos
        node = self.nodes[self.out]
        out_def = self.arg(self.out, False)
        if self.rows is not None and upcast is None:
            return self.build_rows(node, out_def)
        sizes = dict(upcast[1]) if upcast is not None else {}
        dims, lanes = self.output_dims(node.shape, sizes)
        if len(lanes) > 1:
            # the tile's loops nest in the plan's order: its last axis is the innermost
            # (vector) loop even where that axis comes before the rows' in the output
            order = [a for a, _ in upcast[1]]
            lane_axes = [a for a, n in enumerate(node.shape) if n != 1 and sizes.get(a, 0)]
            lanes = [lanes[lane_axes.index(a)] for a in order if a in lane_axes]
        if upcast is not None and upcast[2] == "unroll":
            return self.build_unrolled(node, out_def, dims, lanes, upcast[0],
                                       upcast[3] if len(upcast) > 3 else 0)
        loops = []
        if lanes:
            r = upcast[0]
            rdims = reshape_index(dims, node.shape, self.nodes[r].shape)
            value = self.reduce_lanes(r, rdims, lanes)
            for lane, J in lanes:
                loops.append(self.emit((LOOP, IDX, J)))
                self.var_ssa[lane.id] = loops[-1]
                self.scopes.append({})
            self.scopes[-1][(r, tuple([s.key for s in rdims]), ())] = value()
        val = self.render(self.out, dims, ())
        idx = self.index(sym.linearize(dims, node.shape))
        self.emit((STORE, None, out_def, idx, val))
        self.close_loops(loops)
        # INDEX ops must lead the kernel (backends open their loops/threads there)
        return _hoist_index(self.ops, self.hoisted), self.args

    def build_outputs(self, dict pos, list outs):
        """Render several stored elementwise nodes of one shape as one kernel (a
        multi-output kernel: Adam's parameter, m and v): the same indices, one store
        each, arguments 0..len(outs)-1 the outputs in `outs` order (topological). A
        member read by a later one at the same element is not loaded: the render memo
        hands the later one the value just computed. Returns (ops, args), or None when a
        member is read at another element (only a separate kernel may read it then)."""
        self.pos = pos
        shape = self.nodes[outs[0]].shape
        defs = [self.arg(q, False) for q in outs]
        dims, _ = self.output_dims(shape, {})
        idx = self.index(sym.linearize(dims, shape))
        for q, d in zip(outs, defs):
            self.out = q
            self.emit((STORE, None, d, idx, self.render(q, dims, ())))
        written = set(defs)
        if any(op[0] == LOAD and op[2] in written for op in self.ops):
            return None
        return _hoist_index(self.ops, self.hoisted), self.args

    def output_dims(self, tuple shape, dict sizes):
        """Symbolic index of each output axis (INDEX ops emitted), and the register
        tile's (lane var, size) per axis of `sizes`."""
        dims = []
        lanes = []
        for axis, n in enumerate(shape):
            if n == 1:
                dims.append(sym.constant(0))
                continue
            # an axis merged from parts not neighbouring in memory is indexed part by part
            # (one INDEX each, outermost first: backends read INDEX ops row-major), lanes
            # of a register tile along its innermost part
            parts = (self.out_splits.get(axis) if self.out_splits else None) or [n]
            J = sizes.get(axis, 0)
            e = sym.constant(0)
            stride = n
            for k, size in enumerate(parts):
                stride //= size
                if k == len(parts) - 1 and J:
                    vb = self.new_var(size // J)
                    self.var_ssa[vb.id] = self.emit((INDEX, IDX, axis, size // J))
                    lane = self.new_var(J)
                    lanes.append((lane, J))
                    term = sym.add(sym.mul(sym.var(vb), J), sym.var(lane))
                else:
                    v = self.new_var(size)
                    self.var_ssa[v.id] = self.emit((INDEX, IDX, axis, size))
                    self.out_vars[axis] = v
                    term = sym.var(v)
                e = sym.add(e, sym.mul(term, stride))
            dims.append(e)
        return tuple(dims), lanes

    def build_rows(self, node, out_def):
        """A row kernel (`_RowKernels`): INDEX over the rows; the row values its expands
        read (the reduces over the reduced axes A and what is computed from them per row)
        rendered once, before any loop, in dependency order, so every later rendering at
        the row's index (an EXPAND maps A to 0) finds them in the outermost memo scope;
        then, for an elementwise output, a LOOP over A computing and storing each element
        (a reduce output is the usual reduce, its loop reading the row values)."""
        A, expands = self.rows
        shape = node.shape
        dims = []
        for axis, n in enumerate(shape):
            if n == 1 or axis in A:
                dims.append(sym.constant(0))
            else:
                v = self.new_var(n)
                self.var_ssa[v.id] = self.emit((INDEX, IDX, axis, n))
                self.out_vars[axis] = v
                dims.append(sym.var(v))
        for e in expands:
            src = self.src(self.nodes[e], 0)
            sshape = self.nodes[src].shape
            self.render(src, tuple([sym.constant(0) if sshape[d] == 1 else dims[d]
                                    for d in range(len(sshape))]), ())
        loop_axes = [a for a in A if shape[a] != 1]
        variables = [self.new_var(shape[a]) for a in loop_axes]
        loops = self.open_loops(variables)
        for a, v in zip(loop_axes, variables):
            dims[a] = sym.var(v)
        dims = tuple(dims)
        val = self.render(self.out, dims, ())
        self.emit((STORE, None, out_def, self.index(sym.linearize(dims, shape)), val))
        self.close_loops(loops)
        return _hoist_index(self.ops, self.hoisted), self.args

    def build_unrolled(self, node, out_def, tuple dims, list lanes, Py_ssize_t r,
                       int reduce_lanes=0):
        """Every lane combination gets its own scalar accumulator and the reduce loop stays
        innermost: loads contiguous along the reduce axis vectorize there, and each loaded
        row is reused by the other axis' lanes from registers (a 4x4 tile of dot products:
        3x faster than one dot product per output for x @ W.T)."""
        import itertools
        rnode = self.nodes[r]
        rop, axes = rnode.arg
        src = self.src(rnode, 0)
        sshape = self.nodes[src].shape
        acc_dt = accumulator_dtype(rnode.dtype)
        combos = list(itertools.product(*[range(J) for _, J in lanes]))
        lane_vars = [lane for lane, _ in lanes]

        def at(tuple c, tuple ds):
            subst = {lane.id: k for lane, k in zip(lane_vars, c)}
            return tuple([_substitute(e, subst) for e in ds])
        rdims = reshape_index(dims, node.shape, rnode.shape)
        new, outer, inner, extra, _ = self.plan_reduce_loops(
            rdims, axes, sshape, block_limit(rop, acc_dt, self.sum_block), r)
        J = reduce_lanes
        if J and (not inner or (inner[-1].hi + 1) % J or extra):
            J = 0
        if J:
            # the innermost reduce loop as (its length / J) x J lanes, each accumulator an
            # array of J partial results folded after the loops: a short contiguous loop
            # (a convolution's weight gradient walks output rows of 20) otherwise ends in a
            # horizontal sum of every vector accumulator per row
            vi = inner[-1]
            vq = self.new_var((vi.hi + 1) // J)
            lane = self.new_var(J)
            at_lane = {vi.id: sym.add(sym.mul(sym.var(vq), J), sym.var(lane))}
            new = [_substitute(e, at_lane) for e in new]
            inner = inner[:-1] + [vq, lane]
        totals = [self.define_acc(_dt.float64, R_SUM, 1) for _ in combos] if outer else []
        outer_loops = self.open_loops(outer)
        accs = [self.define_acc(acc_dt, rop, J or 1) for _ in combos]
        loops = self.open_loops(inner)
        for c, acc in zip(combos, accs):
            # (a partial block's range check is on the reduce index: it has no lane)
            x = self.reduce_input(src, list(at(c, tuple(new))), (), extra, acc_dt, rop)
            self.accumulate(acc, self.var_ssa[lane.id] if J else -1, x, acc_dt, rop)
        self.close_loops(loops)
        if J:
            folded = []
            for acc in accs:
                one = self.define_acc(acc_dt, rop, 1)
                q = self.new_var(J)
                fold = self.open_loops([q])
                self.accumulate(one, -1, self.emit((LOAD, acc_dt, acc, self.var_ssa[q.id], -1)),
                                acc_dt, rop)
                self.close_loops(fold)
                folded.append(one)
            accs = folded
        if outer:
            for total, acc in zip(totals, accs):
                self.fold_block(total, acc, -1, acc_dt)
            self.close_loops(outer_loops)
            accs, acc_dt = totals, _dt.float64
        for c, acc in zip(combos, accs):
            v = self.emit((LOAD, acc_dt, acc, -1, -1))
            if acc_dt is not rnode.dtype:
                v = self.emit((K_CAST, rnode.dtype, v))
            cd = at(c, dims)
            self.scopes[-1][(r, tuple([e.key for e in at(c, rdims)]), ())] = v
            val = self.render(self.out, cd, ())
            self.emit((STORE, None, out_def, self.index(sym.linearize(cd, node.shape)), val))
        return _hoist_index(self.ops, self.hoisted), self.args

    def lane_index(self, list lanes):
        s = sym.constant(0)
        stride = 1
        for lane, J in reversed(lanes):
            s = sym.add(s, sym.mul(sym.var(lane), stride))
            stride *= J
        return self.index(s)

    def reduce_lanes(self, Py_ssize_t p, tuple dims, list lanes):
        """Emit reduce `p` with one accumulator per lane combination; returns a function
        that emits the load of the current lanes' result (inside the epilogue's loops)."""
        node = self.nodes[p]
        rop, axes = node.arg
        src = self.src(node, 0)
        sshape = self.nodes[src].shape
        acc_dt = accumulator_dtype(node.dtype)
        total = 1
        for _, J in lanes:
            total *= J
        new, outer, inner, extra, _ = self.plan_reduce_loops(
            dims, axes, sshape, block_limit(rop, acc_dt, LANE_BLOCK), p)
        totals = self.define_acc(_dt.float64, R_SUM, total) if outer else None
        outer_loops = self.open_loops(outer)
        acc = self.define_acc(acc_dt, rop, total)
        loops = self.open_loops(inner + [lane for lane, _ in lanes])
        x = self.reduce_input(src, new, (), extra, acc_dt, rop)
        self.accumulate(acc, self.lane_index(lanes), x, acc_dt, rop)
        self.close_loops(loops)
        if outer:
            q = self.new_var(total)
            fold = self.open_loops([q])
            self.fold_block(totals, acc, self.var_ssa[q.id], acc_dt)
            self.close_loops(fold)
            self.close_loops(outer_loops)
            acc, acc_dt = totals, _dt.float64

        def value():
            r = self.emit((LOAD, acc_dt, acc, self.lane_index(lanes), -1))
            if acc_dt is not node.dtype:
                r = self.emit((K_CAST, node.dtype, r))
            return r
        return value


def _divisions(s, list out):
    """Every Div/Mod atom in index expression `s` (nested ones too), as (num, d)."""
    for atom, _ in s.terms:
        if type(atom) is not sym.Var:
            out.append((atom.num, atom.d))
            _divisions(atom.num, out)


def _merged_splits(b):
    """Where the built kernel's loads divide one of its loop or output variables (an
    axis merged by a reshape from axes that are not neighbours in memory: the heads of
    an attention output read as one feature axis give `e / 32`, `e % 32`): ({(reduce
    position, axis): loop sizes}, {output axis: index sizes}), sizes outermost first.
    Cutting the axis there makes every such index plain strides. Both empty when no
    load divides a variable."""
    owner = {}
    for p, logged in b.reduce_log:
        axes = b.nodes[p].arg[1]
        sshape = b.nodes[b.src(b.nodes[p], 0)].shape
        for ax, v in zip(axes, logged):
            # (an axis cut into float-sum blocks is left alone: its variable is a part)
            if v is not None and v.hi + 1 == sshape[ax]:
                owner[v.id] = ((p, ax), v.hi + 1)
    for ax, v in b.out_vars.items():
        owner[v.id] = (ax, v.hi + 1)
    cuts = {}
    for s in b.load_log:
        found = []
        _divisions(s, found)
        for num, d in found:
            for atom, c in num.terms:
                if type(atom) is not sym.Var or atom.id not in owner or c <= 0 or d % c:
                    continue
                key, n = owner[atom.id]
                size = d // c
                if 1 < size < n and n % size == 0:
                    cuts.setdefault(key, (n, set()))[1].add(size)
    reduce_splits, out_splits = {}, {}
    for key, (n, sizes) in cuts.items():
        chain = []            # inner sizes that nest: each divides the next
        for size in sorted(sizes):
            if not chain or size % chain[-1] == 0:
                chain.append(size)
        loops = [n // chain[-1]] + [chain[k] // chain[k - 1]
                                    for k in range(len(chain) - 1, 0, -1)] + [chain[0]]
        (reduce_splits if type(key) is tuple else out_splits)[key] = loops
    return reduce_splits, out_splits


def _vars_in(s, set out):
    for atom, _ in s.terms:
        if type(atom) is sym.Var:
            out.add(atom.id)
        else:
            _vars_in(atom.num, out)
    return out


def _valid_for(tuple valid, tuple dims):
    """The range checks of `valid` that still matter below an expand to `dims`: those on
    a variable some index of `dims` uses. A check on variables the expanded value no
    longer depends on (a masked reduce block's, on a reduced axis) cannot keep its loads
    in bounds, and left in place it would give the row value another memo key inside the
    reduce loop than at the row (recomputed per element)."""
    used = set()
    for s in dims:
        _vars_in(s, used)
    return tuple([v for v in valid if not _vars_in(v[0], set()).isdisjoint(used)])


def _substitute(s, dict values):
    """Expression `s` with variables replaced (by constants: lanes; or expressions)."""
    out = sym.constant(s.offset)
    for atom, c in s.terms:
        out = sym.add(out, sym.mul(_substitute_atom(atom, values), c))
    return out


def _substitute_atom(a, dict values):
    if type(a) is sym.Var:
        if a.id not in values:
            return sym.var(a)
        v = values[a.id]
        return v if type(v) is sym.Sum else sym.constant(v)   # an expression, or a lane
    num = _substitute(a.num, values)
    return sym.div(num, a.d) if type(a) is sym.Div else sym.mod(num, a.d)


def _hoist_index(list ops, hoisted=()):
    """Move INDEX ops (and the DEFINEs before them) to the front, then the `hoisted` ops
    (parameter loads, in their order), renumbering references."""
    first = [i for i, op in enumerate(ops) if op[0] == INDEX or op[0] == DEFINE and op[2] == SCOPE_GLOBAL]
    up = [i for i in range(len(ops)) if i in hoisted]
    rest = [i for i, op in enumerate(ops) if not (op[0] == INDEX or op[0] == DEFINE and op[2] == SCOPE_GLOBAL or i in hoisted)]
    return reorder(ops, first + up + rest)


def _is_identity_copy(list ops):
    """True when the kernel only stores arg 1 element i into arg 0 element i."""
    loads = [op for op in ops if op[0] == LOAD]
    stores = [op for op in ops if op[0] == STORE]
    if len(loads) != 1 or len(stores) != 1 or any(op[0] == LOOP for op in ops):
        return False
    ld, st = loads[0], stores[0]
    return (ld[4] == -1 and ops[ld[2]][3] == 1 and ops[st[2]][3] == 0 and ld[3] == st[3]
            and st[4] == ops.index(ld))


def reshape_index(tuple dims, tuple shape, tuple src_shape):
    """Indices into `src_shape` of the element at `dims` of its reshape to `shape`.

    Axes are matched in groups whose sizes multiply to the same number (a split or a merge),
    and only within a group is the index linearized and unravelled, so unrelated axes keep
    their plain index and no needless div/mod appears."""
    a = [d for d in shape if d != 1]
    b = [d for d in src_shape if d != 1]
    if a == b:  # only size-1 axes were added or removed: map the others one to one
        it = iter([dims[i] for i, d in enumerate(shape) if d != 1])
        return tuple([next(it) if d != 1 else sym.constant(0) for d in src_shape])
    if 0 in src_shape or 0 in shape:
        # A zero-size tensor has no element to read: any in-range index serves, and
        # linearizing/unravelling through a size-0 axis would divide by zero.
        return tuple([sym.constant(0) for d in src_shape])
    out = [None] * len(src_shape)
    cdef Py_ssize_t i = 0, j = 0, i0, j0
    cdef long long pa, pb
    while i < len(shape) or j < len(src_shape):
        i0, j0 = i, j
        pa = shape[i] if i < len(shape) else 1
        pb = src_shape[j] if j < len(src_shape) else 1
        i += 1
        j += 1
        while pa != pb:
            if pa < pb:
                if i >= len(shape):
                    break
                pa *= shape[i]
                i += 1
            else:
                if j >= len(src_shape):
                    break
                pb *= src_shape[j]
                j += 1
        if pa != pb:   # cannot happen for equal element counts; stay correct anyway
            return sym.unravel(sym.linearize(dims, shape), src_shape)
        lin = sym.linearize(dims[i0:i], shape[i0:i])
        for k, v in enumerate(sym.unravel(lin, src_shape[j0:j])):
            out[j0 + k] = v
    for k in range(len(out)):
        if out[k] is None:
            out[k] = sym.constant(0)
    return tuple(out)


def kernelize(graph, list order, list target_ids, int vector_bytes=64,
              bint register_tiles=True, int sum_block=0, dict params=None, tuner=None,
              long long tile_min_outputs=0, bint window_tiles=True, own_tiles=None):
    """Cut the subgraph `order` (topologically sorted node ids) into kernels
    (`vector_bytes`: the device's vector register width, for register tiling;
    `register_tiles` False: no "lanes"/"unroll" output layouts, which exist for CPU SIMD
    registers; GPU devices turn them off and spread outputs over work-items instead;
    `sum_block`: iterations per float32 block of a float sum, 0 for SUM_BLOCK: a GPU
    work-item adds its block sequentially, with no SIMD lanes splitting it, so GPUs use
    smaller blocks to keep the CPU's accuracy; `params`: values the kernels read at
    launch instead of having them in their source, {(position, axis): (leaf position,
    element)} with axis -1 for a CONST's scalar and d for the start of a PAD's cut axis d;
    the leaves are 1-D parameter arrays at the end of `order`; `tuner`: a
    tuning.Tuner choosing each reduce kernel's output layout among
    `upcast_candidates` by timing them, instead of `choose_upcast`'s pick;
    `tile_min_outputs`: with register tiles, only kernels with at least this many outputs
    get them (a GPU: a tile per work-item leaves a kernel with few outputs too few
    work-items, where the group strategies would split its reductions instead);
    `window_tiles` False: no window lanes (choose_upcast's `windows`); `own_tiles`: a
    function of a kernel's ops, True where the device tiles that kernel itself (a GPU's
    shared-memory gemm tiles, codegen/gpu/gemm.py): it gets no register tiles. The
    autotuner's layout search runs on devices that tile every kernel (the CPU) only.

    Returns (steps, stored): steps in execution order, each reading and writing node
    positions in `order`; `stored[p]` tells which positions get a buffer."""
    cdef Py_ssize_t n = len(order), p
    nodes = [graph.get(i) for i in order]
    pos = {nid: p for p, nid in enumerate(order)}
    consumers = [[] for _ in range(n)]
    for p in range(n):
        for s in nodes[p].srcs:
            consumers[pos[s]].append(p)
    targets = [pos[t] for t in target_ids]
    srcpos = [[pos[s] for s in nodes[p].srcs] for p in range(n)]
    rows = {}
    stored = decide_stored(nodes, consumers, srcpos, targets, rows)
    if register_tiles and SPLIT_CALL_EPILOGUES:
        _split_call_epilogues(nodes, consumers, srcpos, stored, rows)
    aliases = {}
    for t in targets:   # a target that only reshapes a buffer needs no kernel
        q = t
        while nodes[q].op == RESHAPE:
            q = srcpos[q][0]
        if q != t and (nodes[q].op == LEAF or stored[q]):
            aliases[t] = q
    steps = []
    elementwise = set()   # steps of elementwise kernels (multi-output candidates)
    for p in range(n):
        if not stored[p]:
            continue
        if p in aliases:
            steps.append(Step(None, [p, aliases[p]], True))
            continue
        numel = 1
        for d in nodes[p].shape:
            numel *= d
        if numel == 0:   # nothing to compute: the scheduler only allocates
            steps.append(Step(None, [p]))
            continue
        b = _Builder(nodes, stored, p, sum_block, params)
        b.rows = rows.get(p)
        ops, args = b.build(pos)
        splits, out_splits = _merged_splits(b)
        if b.rows is not None:
            out_splits = {}
        if not splits and not out_splits and tile_min_outputs == 0:
            # (CPU devices, whose register tiles gcc keeps across one loop; the GPU
            # lowerings collapse nested reduce loops themselves)
            splits = contiguous_reduces(b, ops)
        if splits or out_splits:   # again, with those axes cut where loads divide them
                                   # (or neighbouring reduce axes walked by one loop)
            b = _Builder(nodes, stored, p, sum_block, params)
            b.rows = rows.get(p)
            b.reduce_splits, b.out_splits = splits, out_splits
            ops, args = b.build(pos)
        if len(args) == 2 and args[0][0] is args[1][0] and args[0][1] == args[1][1] \
                and _is_identity_copy(ops):
            q = [k for k, a in b.argpos.items() if a == 1][0]
            steps.append(Step(None, [p, q], True))   # e.g. a transpose of a transpose
            continue
        # (a row kernel computes several reduces per row: no register tile layout)
        # (a split output axis is tiled along its innermost part)
        tiled = tuple([out_splits[a][-1] if a in out_splits else n
                       for a, n in enumerate(nodes[p].shape)])
        tiles = register_tiles and b.rows is None and numel >= tile_min_outputs
        if tiles and own_tiles is not None and own_tiles(ops):
            tiles = False
        if tuner is not None and tiles and tile_min_outputs == 0:
            k, b = _tuned_layout(tuner, b, Kernel(ops, args, "k"), tiled, vector_bytes,
                                 nodes, stored, p, sum_block, params, splits, out_splits, pos)
        else:
            up = choose_upcast(b, tiled, vector_bytes, window_tiles) if tiles else None
            if up is not None:
                b = _Builder(nodes, stored, p, sum_block, params)
                b.reduce_splits, b.out_splits = splits, out_splits
                ops, args = b.build(pos, up)
            k = Kernel(ops, args, "k")
        positions = [None] * len(args)
        for q, a in b.argpos.items():
            positions[a] = q
        if (not splits and not out_splits and b.rows is None
                and not any(op[0] == LOOP for op in k.ops)):
            elementwise.add(len(steps))
        steps.append(Step(k, positions))
    if MULTI_OUTPUT and len(elementwise) > 1:
        steps = _merge_outputs(steps, elementwise, nodes, stored, pos, sum_block, params)
    return steps, stored


MULTI_OUTPUT = True      # elementwise kernels of one shape sharing inputs: one kernel
MULTI_OUTPUT_MAX = 8     # outputs of one multi-output kernel
MULTI_OUTPUT_OPS = 1024  # IR ops its members' kernels may have together


def _numel_of(node):
    cdef long long n = 1
    for d in node.shape:
        n *= d
    return n


def _output_groups(list steps, set elementwise, list nodes):
    """Step indices of elementwise kernels that can be one multi-output kernel, placed
    where the last of them runs: same output shape; each shares a full-size input with
    the group or reads one of its outputs (unrelated kernels gain nothing from sharing a
    loop); no step in between reads an output of the group (it would run before the
    merged kernel wrote it). Greedy, in execution order."""
    groups = []     # [shape, step indices, positions touched at full size, open, ops]
    member_of = {}  # output position -> its group
    for si, st in enumerate(steps):
        reads = st.args[1:] if st.kernel is not None or st.alias else []
        joined = None
        if si in elementwise:
            out = st.args[0]
            shape = nodes[out].shape
            n = _numel_of(nodes[out])
            touched = {a for a in reads if _numel_of(nodes[a]) == n}
            cost = len(st.kernel.ops)
            # a group whose output this kernel reads first (then the value needs no
            # load), else one it shares an input with
            fits = [g for g in groups if g[3] and g[0] == shape and len(g[1]) < MULTI_OUTPUT_MAX
                    and g[4] + cost <= MULTI_OUTPUT_OPS and touched & g[2]]
            for g in fits:
                if any(member_of.get(a) is g for a in reads):
                    joined = g
                    break
            else:
                joined = fits[0] if fits else None
            if joined is None:
                joined = [shape, [], set(), True, 0]
                groups.append(joined)
            joined[1].append(si)
            joined[2].update(touched)
            joined[2].add(out)
            joined[4] += cost
            member_of[out] = joined
        for a in reads:
            g = member_of.get(a)
            if g is not None and g is not joined:
                g[3] = False
    return [g[1] for g in groups if len(g[1]) > 1]


def _merge_outputs(list steps, set elementwise, list nodes, list stored, dict pos,
                   int sum_block, params):
    """`steps` with each `_output_groups` group rendered as one multi-output kernel
    (`_Builder.build_outputs`) at its last member's place; a group whose members read
    one another at other elements stays apart."""
    replace = {}
    for members in _output_groups(steps, elementwise, nodes):
        outs = [steps[si].args[0] for si in members]
        b = _Builder(nodes, stored, outs[0], sum_block, params)
        built = b.build_outputs(pos, outs)
        if built is None:
            continue
        ops, args = built
        positions = [None] * len(args)
        for q, a in b.argpos.items():
            positions[a] = q
        for si in members[:-1]:
            replace[si] = None
        replace[members[-1]] = Step(Kernel(ops, args, "k"), positions, nout=len(outs))
    if not replace:
        return steps
    out = []
    for si, st in enumerate(steps):
        st = replace.get(si, st)      # (None: merged into a later step)
        if st is not None:
            out.append(st)
    return out


def _tuned_layout(tuner, b, base, tuple tiled, int vector_bytes, list nodes, list stored,
                  Py_ssize_t p, int sum_block, params, splits, out_splits, dict pos):
    """(kernel, builder) of the output layout `tuner` picks for the kernel `base` (built
    untiled by `b`) among `upcast_candidates`; the heuristic's pick where there is
    nothing to choose from."""
    kernels, builders, labels = [], [], []
    for up in upcast_candidates(b, tiled, vector_bytes):
        if up is None:
            k, nb = base, b
        else:
            nb = _Builder(nodes, stored, p, sum_block, params)
            nb.reduce_splits, nb.out_splits = splits, out_splits
            ops, args = nb.build(pos, up)
            k = Kernel(ops, args, "k")
        if k in kernels:
            continue
        kernels.append(k)
        builders.append(nb)
        labels.append(upcast_label(up))
    if len(kernels) == 1:
        return kernels[0], builders[0]
    i = tuner.choose_layout(base, labels, kernels)
    return kernels[i], builders[i]
