"""Index-set splitting: a kernel whose loads are guarded by ranges of an output index (a
cat's parts padded into place and summed, a pad) runs as a few loop nests, one per
sub-range of that index, each with the guards it decides folded away (a kernel IR ->
piece kernels rewrite the C backend applies before rendering).

`zyx.cat` pads every part into place and sums them: one kernel, whose single loop over
the output makes a guarded load of every part per element, `(lo <= i && i < hi) ?
x[...] : 0`, selects -0.0 outside the part and adds the parts up. Every element pays
the comparisons, selects and index math (`(i / 784) % 1024 * 784 + i % 784`: kept in
range for the lanes the guard masks) of every part: a cat of six flattened gradients
(1.86M floats) took 3-5 ms on 2 cores where a copy of its bytes takes 0.25 ms.

The comparisons that load guards and select conditions are made of give the cut points:
where one, affine in an index variable x (`c * x + rest < 0`, `==`, their mirrors),
starts to hold or fail whatever the other variables in `rest` are (`_cuts`; for a flat
index split into two loops, `1024 * i1 + i2 < 1048576`, both points are one row when a
part starts on a row). The index is cut there, at most MAX_PIECES pieces in all (outer
indices first), a sub-range of fewer than MIN_PIECE iterations staying with its
neighbour, kernels under MIN_WORK iterations and splits past MAX_OPS ops left whole.
Each piece is the kernel again with that index running over its sub-range: the index
math is rebuilt through `_core/symbolic` with the piece's ranges (what the kernelizer
would have written had it known them), so a comparison the ranges decide becomes a
constant and `passes.simplify` folds the rest: a guard that holds drops, a guarded
load that fails is the 0 it would read, `where` picks its side, and the sum of -0.0
pads (`x + -0.0` is `x` for every float) is the one live part, `g0[i + 802816] =
g2[i]`, a plain copy gcc vectorizes. The ranges also undo the index math's wrapping
(`(i / 784) % 1024` is `i / 784` below 1024 rows, `(i / 784) * 784 + i % 784` is `i`;
`_recombine` joins the quotient and remainder symbolic writes with different
numerators). The values are the unsplit kernel's: each piece computes the same
expression for each of its elements, with only facts true over its ranges substituted.

Why an IR rewrite here, rather than in the kernelizer or as text in the renderer: the
kernelizer's kernels serve every backend, and the pieces only pay where the index is a
CPU loop (a GPU would launch them one by one, where a masked lane costs one select);
text would have to be parsed back from C. Here every kernel the C backend compiles goes
through it, and each piece is an ordinary kernel that the other C-only rewrites
(rowstash, hoist, nanflag, padtaps) and the renderer handle as before.
`render.render_kernel` writes the pieces one after another in one function, each its
own `omp for` over all its index loops (`nowait` but the last: the pieces write
different elements), so every piece is shared by all threads.

Only index variables (INDEX ops: the loops over the output) are split; a reduce loop's
guards (a window against the output pixel) are `padtaps`' job.
"""
from __future__ import annotations

import itertools

from ..._core import kernel as K
from ..._core import passes
from ..._core import symbolic as sym

ENABLED = True
MAX_PIECES = 16      # most loop nests one kernel becomes (product over the split indices)
MIN_WORK = 1024      # kernels with fewer output iterations stay one loop nest
MIN_PIECE = 64       # a sub-range with fewer iterations (whole nest) joins a neighbour
MAX_OPS = 4000       # most ops all pieces together may have (C source, compile time)

_LIMIT = 1 << 62     # index math lifted only while its values stay well inside int64
_CMP = frozenset((K.B_CMPLT, K.B_CMPGT, K.B_EQ, K.B_NOTEQ))


def split_ranges(kernel):
    """The pieces of `kernel` (a list of Kernels, in order, together writing what it
    writes), or None when no guard gives a cut worth making (module docstring). In a
    piece each split INDEX runs over its sub-range's length from 0 and the body reads
    `index + start` wherever the kernel read the index."""
    ops = kernel.ops
    indices = [(i, op[3]) for i, op in enumerate(ops) if op[0] == K.INDEX]
    work = 1
    for _, n in indices:
        work *= n
    if work < MIN_WORK:
        return None
    forms = _lift(ops, {})
    cuts = _cuts(ops, forms, dict(indices))
    if not cuts:
        return None
    ranges = {}          # INDEX ssa -> [(start, stop)] of its sub-ranges
    pieces = 1
    for i, n in indices:          # outer indices first: their pieces are the longest
        if i not in cuts:
            continue
        bounds = _merge(sorted(cuts[i]), n, work // n)
        if len(bounds) < 3 or pieces * (len(bounds) - 1) > MAX_PIECES:
            continue
        ranges[i] = list(zip(bounds[:-1], bounds[1:]))
        pieces *= len(bounds) - 1
    if not ranges:
        return None
    split = sorted(ranges)
    out, size = [], 0
    for box in itertools.product(*(ranges[i] for i in split)):
        piece = _piece(ops, dict(zip(split, box)))
        size += len(piece)
        if size > MAX_OPS:
            return None
        out.append(K.Kernel(piece, kernel.args, kernel.name))
    return out


def _lift(ops, box):
    """{ssa: symbolic Sum} of every int64 value of `ops` computed from INDEX and LOOP
    variables and constants by + - * and by / and % of a non-negative value by a
    positive constant (where C's truncation is the floor symbolic assumes): the index
    math. An INDEX in `box` (start, stop) is `start + v` with v in [0, stop - start)."""
    forms = {}
    for i, op in enumerate(ops):
        c = op[0]
        if c == K.INDEX or c == K.LOOP:
            start, stop = box.get(i, (0, op[-1]))
            if stop > start:
                forms[i] = sym.add(sym.var(sym.Var(i, 0, stop - start - 1)), start)
        elif op[1] is K.IDX:
            if c == K.CONST:
                forms[i] = sym.constant(op[2])
            elif c == K.BINARY:
                a, b = forms.get(op[3]), forms.get(op[4])
                if a is not None and b is not None:
                    f = _binary(op[2], a, b)
                    if f is not None:
                        forms[i] = f
    return forms


def _binary(bop, a, b):
    """The Sum of `a bop b` for index math, or None where symbolic cannot say it exactly
    (also where a value could pass int64's range: symbolic's integers do not wrap)."""
    f = _exact(bop, a, b)
    if f is not None and (f.lo < -_LIMIT or f.hi > _LIMIT):
        return None
    return f


def _exact(bop, a, b):
    """`a bop b` as symbolic writes it, or None for an op or operands it has no exact
    form for (a product of two variables, a division of what may be negative)."""
    if bop == K.B_ADD:
        return _recombine(sym.add(a, b))
    if bop == K.B_SUB:
        return _recombine(sym.add(a, sym.mul(b, -1)))
    if bop == K.B_MUL:
        if b.is_const():
            return sym.mul(a, b.offset)
        if a.is_const():
            return sym.mul(b, a.offset)
        return None
    if bop in (K.B_DIV, K.B_MOD) and b.is_const() and b.offset > 0 and a.lo >= 0:
        return sym.div(a, b.offset) if bop == K.B_DIV else sym.mod(a, b.offset)
    if bop in (K.B_MAX, K.B_MIN):
        # (a clamp the range settles; ranges are inclusive)
        if a.hi <= b.lo:
            return b if bop == K.B_MAX else a
        if b.hi <= a.lo:
            return a if bop == K.B_MAX else b
    return None


def _recombine(s):
    """`s` with `c * d * (n // d) + c * (m % d)` made `c * n` where m is n with its
    coefficients and offset reduced mod d (how symbolic writes n % d): symbolic joins a
    quotient and a remainder of the same numerator only, and a flat index split in two
    for the kernel's loops (n = 1024 * i1 + i2, m = 240 * i1 + i2 for d = 784) reads a
    contiguous part through such a pair. Exact: m % d is n % d, both being non-negative."""
    mods = [(a, c) for a, c in s.terms if type(a) is sym.Mod]
    if not mods:
        return s
    coefs = dict(s.terms)
    offset = s.offset
    joined = False
    for m, c in mods:
        for q, cq in list(coefs.items()):
            if type(q) is not sym.Div or q.d != m.d or cq != c * m.d or m not in coefs:
                continue
            n, d = q.num, q.d
            reduced = sym.Sum(tuple([(t, k % d) for t, k in n.terms if k % d]), n.offset % d)
            if reduced.key != m.num.key:
                continue
            del coefs[q], coefs[m]
            for t, k in n.terms:
                coefs[t] = coefs.get(t, 0) + c * k
            offset += c * n.offset
            joined = True
            break
    if not joined:
        return s
    out = sym.constant(offset)
    for t, k in coefs.items():
        if k:
            out = sym.add(out, sym.mul(_atom_sum(t), k))
    return out


def _atom_sum(a):
    """Atom `a` (a Var, a Div, a Mod) as a Sum of itself."""
    return sym.Sum(((a, 1),), 0)


def _decide(bop, a, b):
    """True / False when comparison `a bop b` of two Sums holds / fails over their whole
    ranges, else None."""
    d = sym.add(a, sym.mul(b, -1))
    if bop == K.B_CMPLT:
        return True if d.hi < 0 else (False if d.lo >= 0 else None)
    if bop == K.B_CMPGT:
        return True if d.lo > 0 else (False if d.hi <= 0 else None)
    if d.lo == d.hi == 0:
        return bop == K.B_EQ
    if d.lo > 0 or d.hi < 0:
        return bop == K.B_NOTEQ
    return None


def _conditions(ops):
    """The comparisons that load guards and select conditions are made of (through And
    and Or), as ssa ids."""
    stack = [op[4] for op in ops if op[0] == K.LOAD and op[4] >= 0]
    stack += [op[2] for op in ops if op[0] == K.WHERE]
    seen, out = set(), []
    while stack:
        j = stack.pop()
        if j in seen:
            continue
        seen.add(j)
        op = ops[j]
        if op[0] == K.BINARY and op[2] in (K.B_AND, K.B_OR) and op[1].is_bool:
            stack += [op[3], op[4]]
        elif op[0] == K.BINARY and op[2] in _CMP:
            out.append(j)
    return out


def _cuts(ops, forms, lengths):
    """{INDEX ssa: {points}}: for each guard comparison and each index variable x in it,
    `c * x + rest` against 0, the points inside (0, length) where it starts to hold or
    fail whatever `rest` (the other variables, within their ranges) is. With x alone
    that is the one point where it changes; with x the row of a flat index split in two
    (`1024 * i1 + i2 < 1048576`) the two points meet when the part starts on a row, and
    are one row apart when it starts inside one. Farther apart they are not taken."""
    out = {}
    for j in _conditions(ops):
        op = ops[j]
        a, b = forms.get(op[3]), forms.get(op[4])
        if a is None or b is None:
            continue
        d = sym.add(a, sym.mul(b, -1))
        bop = op[2]
        if bop == K.B_CMPGT:      # d > 0 as -d < 0
            d = sym.mul(d, -1)
        for atom, coef in d.terms:
            n = lengths.get(atom.id) if type(atom) is sym.Var else None
            if n is None:
                continue      # (a reduce loop's variable, a division)
            rest = sym.add(d, sym.mul(sym.var(atom), -coef))
            if bop == K.B_EQ or bop == K.B_NOTEQ:
                # coef * x + rest == 0 fails below where it can first hold (coef * x +
                # rest.hi < 0, for coef > 0) and above where it last can
                points = (_flip(coef, rest.hi), _flip(-coef, -rest.lo))
            else:
                # coef * x + rest < 0: holds for every rest past one point, fails past another
                points = (_flip(coef, rest.hi), _flip(coef, rest.lo))
            if abs(points[0] - points[1]) > 1:
                # undecided over more than one x (a triangle's i <= j, a window tap
                # i + r - 1 >= 0): pieces there would keep the guard and only cost code
                continue
            for p in points:
                if 0 < p < n:
                    out.setdefault(atom.id, set()).add(p)
    return out


def _flip(coef, off):
    """The integer point at which `coef * x + off < 0` changes value (coef != 0): it holds
    below it when coef > 0, from it on when coef < 0."""
    return -(off // coef) if coef > 0 else off // -coef + 1


def _merge(cuts, n, inner):
    """[0, cuts..., n] without the cuts that would leave a sub-range of fewer than
    MIN_PIECE iterations (`inner`: iterations per index value); such a range stays
    with its neighbour, whose guards then stay where it needs them."""
    keep = [0]
    for p in cuts:
        if (p - keep[-1]) * inner >= MIN_PIECE:
            keep.append(p)
    if len(keep) > 1 and (n - keep[-1]) * inner < MIN_PIECE:
        keep.pop()
    return keep + [n]


def _piece(ops, box):
    """The op list of `ops` with every INDEX in `box` running over its sub-range (start,
    stop): its length stop - start and its uses start + index; index math rebuilt from
    its Sums over the piece, comparisons the piece decides made constants, folded and
    dead code dropped by the always-on passes."""
    forms = _lift(ops, box)
    out = []
    remap = {}

    def emit(op):
        out.append(op)
        return len(out) - 1

    def atom(a):
        if type(a) is sym.Var:
            return remap[a.id]
        bop = K.B_DIV if type(a) is sym.Div else K.B_MOD
        return emit((K.BINARY, K.IDX, bop, value(a.num), emit((K.CONST, K.IDX, a.d))))

    def value(s):
        # (written where it is read, so it is in scope there; CSE merges the copies)
        if not s.terms:
            return emit((K.CONST, K.IDX, s.offset))
        acc = None
        for a, coef in s.terms:
            r = atom(a)
            if coef != 1:
                r = emit((K.BINARY, K.IDX, K.B_MUL, r, emit((K.CONST, K.IDX, coef))))
            acc = r if acc is None else emit((K.BINARY, K.IDX, K.B_ADD, acc, r))
        if s.offset:
            acc = emit((K.BINARY, K.IDX, K.B_ADD, acc, emit((K.CONST, K.IDX, s.offset))))
        return acc

    for i, op in enumerate(ops):
        c = op[0]
        if c == K.INDEX or c == K.LOOP:
            if c == K.INDEX and i in box:
                start, stop = box[i]
                op = (K.INDEX, op[1], op[2], stop - start)
            remap[i] = emit(op)
            continue
        if i in forms:
            continue      # index math: written by value() where something reads it
        if c == K.BINARY and op[2] in _CMP and op[3] in forms and op[4] in forms:
            known = _decide(op[2], forms[op[3]], forms[op[4]])
            if known is not None:
                remap[i] = emit((K.CONST, op[1], known))
                continue
        refs = passes.REFS[c]
        if refs:
            op = list(op)
            for p in refs:
                r = op[p]
                if r >= 0:
                    # (an ENDLOOP names its LOOP, not the loop variable's value)
                    op[p] = value(forms[r]) if r in forms and c != K.ENDLOOP else remap[r]
            op = tuple(op)
        remap[i] = emit(op)
    return passes.dead_code(passes.simplify(out))
