# cython: language_level=3
"""Always-on IR passes: constant folding with algebraic identities, common subexpression
elimination and dead code elimination. Each pass maps an op list to a new op list; SSA
references are renumbered at the end so backends see a dense list."""
import math

import numpy as np

from .kernel import (CONST, DEFINE, INDEX, LOOP, ENDLOOP, LOAD, STORE, CAST, UNARY, BINARY,
                     WHERE, MAD, IF_OP, END_IF, BARRIER, SCOPE_REGISTER, B_ADD, B_SUB, B_MUL,
                     B_DIV, B_MOD, B_MAX, B_MIN, B_CMPLT, B_CMPGT, B_EQ, B_NOTEQ, B_AND,
                     B_OR, B_BITAND, B_BITOR, B_BITXOR, U_NEG, Kernel)

# positions in an op tuple that hold SSA references
REFS = {CONST: (), DEFINE: (), INDEX: (), LOOP: (), ENDLOOP: (2,), LOAD: (2, 3, 4),
        STORE: (2, 3, 4), CAST: (2,), UNARY: (3,), BINARY: (3, 4), WHERE: (2, 3, 4),
        MAD: (2, 3, 4), IF_OP: (2,), END_IF: (), BARRIER: ()}
SIDE_EFFECTS = frozenset((DEFINE, INDEX, LOOP, ENDLOOP, STORE, IF_OP, END_IF, BARRIER))

_NP_BINARY = {B_ADD: np.add, B_SUB: np.subtract, B_MUL: np.multiply, B_MAX: np.maximum,
              B_MIN: np.minimum, B_CMPLT: np.less, B_CMPGT: np.greater, B_EQ: np.equal,
              B_NOTEQ: np.not_equal, B_AND: np.logical_and, B_OR: np.logical_or,
              B_BITAND: np.bitwise_and, B_BITOR: np.bitwise_or, B_BITXOR: np.bitwise_xor}


def _py(v, dt):
    """A folded value as the Python scalar the IR keeps for dtype `dt`. Integers wrap to the
    dtype's two's-complement range like the generated code does (a folded int8 300 is 44),
    so later folds (numpy arrays of that dtype) never overflow."""
    if dt.is_bool:
        return bool(v)
    if dt.is_float:
        return float(v)
    bits = dt.itemsize * 8
    v = int(v) & ((1 << bits) - 1)
    if dt.kind == "i" and v >> (bits - 1):
        v -= 1 << bits
    return v


def _fold_binary(bop, dt, a, b, in_dt):
    if bop in _NP_BINARY:
        with np.errstate(all="ignore"):
            npdt = in_dt.np if in_dt.name != "bfloat16" else np.float32
            r = _NP_BINARY[bop](np.array(a, dtype=npdt), np.array(b, dtype=npdt))
        return _py(r, dt)
    if bop in (B_DIV, B_MOD) and in_dt.is_int and b != 0:
        q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)  # C truncation
        return _py(q if bop == B_DIV else a - q * b, dt)
    return None


def simplify(list ops):
    """Constant folding, identities and CSE in one forward walk."""
    cdef list out = []
    cdef dict remap = {}
    cdef list scopes = [{}]
    cdef int i, c
    for i, op in enumerate(ops):
        c = op[0]
        refs = REFS[c]
        if refs:
            op = list(op)
            for p in refs:
                r = op[p]
                if r >= 0:
                    op[p] = remap.get(r, r)
            op = tuple(op)
        if c == LOAD and op[4] >= 0 and out[op[4]][0] == CONST \
                and out[op[2]][2] != SCOPE_REGISTER:
            # a decided guard (a range the C backend's index-set split settled): true
            # reads plainly, false reads the 0 every backend gives a failed guard
            if out[op[4]][2]:
                op = op[:4] + (-1,)
            else:
                remap[i] = _emit_const(out, op[1], _py(0, op[1]))
                continue
        folded = _simplify_op(op, out)
        if folded is not None:
            remap[i] = folded
            continue
        if c in SIDE_EFFECTS or (c == LOAD and out[op[2]][2] == SCOPE_REGISTER):
            if c == ENDLOOP or c == END_IF:
                scopes.pop()
            remap[i] = len(out)
            out.append(op)
            if c == LOOP or c == IF_OP:
                scopes.append({})
            continue
        # CSE: an identical pure op visible in an enclosing scope is reused
        key = _cse_key(op)
        hit = None
        for s in scopes:
            hit = s.get(key)
            if hit is not None:
                break
        if hit is not None:
            remap[i] = hit
            continue
        remap[i] = len(out)
        scopes[-1][key] = len(out)
        out.append(op)
    return out


def _cse_key(tuple op):
    # constants compare by spelling: 0.0 == -0.0 in Python, but they are different values
    if op[0] == CONST:
        return (CONST, op[1], repr(op[2]))
    return op


def _const(list out, int r):
    op = out[r]
    if op[0] == CONST:
        return True, op[2]
    return False, None


def _simplify_op(tuple op, list out):
    """Return an existing SSA id to use instead of `op`, or None to keep it."""
    c = op[0]
    if c == CAST:
        if out[op[2]][1] is op[1]:
            return op[2]
        is_c, v = _const(out, op[2])
        if is_c and not op[1].name in ("float16", "bfloat16"):
            if op[1].is_int and isinstance(v, float):
                if v != v:
                    return _emit_const(out, op[1], 0)     # NaN -> 0, as the backends do
                if v in (float("inf"), float("-inf")):
                    return None                           # no int value: left to the target
            return _emit_const(out, op[1], _py(v, op[1]))
    elif c == BINARY:
        bop, a, b = op[2], op[3], op[4]
        ca, va = _const(out, a)
        cb, vb = _const(out, b)
        dt = op[1]
        if ca and cb:
            r = _fold_binary(bop, dt, va, vb, out[a][1])
            if r is not None:
                return _emit_const(out, dt, r)
        if bop == B_ADD:
            if cb and vb == 0 and (not dt.is_float or _negative_zero(vb)):
                return a
            if ca and va == 0 and (not dt.is_float or _negative_zero(va)):
                return b
        elif bop == B_SUB and cb and vb == 0 and (not dt.is_float or not _negative_zero(vb)):
            return a
        elif (bop == B_AND or bop == B_OR) and dt.is_bool and (ca or cb):
            # a guard's conjunction with a decided comparison: And(True, x) is x,
            # And(False, x) is False (Or the other way round)
            v, other = (va, b) if ca else (vb, a)
            if out[other][1].is_bool:
                if bool(v) == (bop == B_AND):
                    return other
                return _emit_const(out, dt, bop == B_OR)
        elif bop == B_MUL:
            if cb and vb == 1:
                return a
            if ca and va == 1:
                return b
            if not dt.is_float and ((cb and vb == 0) or (ca and va == 0)):
                return _emit_const(out, dt, 0)
        elif bop == B_DIV and cb and vb == 1 and not dt.is_float:
            return a
    elif c == WHERE:
        cc, vc = _const(out, op[2])
        if cc:
            return op[3] if vc else op[4]
        if op[3] == op[4]:
            return op[3]
    elif c == UNARY and op[2] == U_NEG:
        ca, va = _const(out, op[3])
        if ca and not op[1].is_bool:
            return _emit_const(out, op[1], -va if not op[1].kind == "u" else va)
    return None


def _negative_zero(v):
    """True for the float -0.0: x + -0.0 is x for every float x (+0.0 + -0.0 is +0.0,
    -0.0 + -0.0 is -0.0), which x + 0.0 is not (-0.0 + 0.0 is +0.0); x - 0.0 likewise
    is x. A cat pads each part with -0.0 for that reason, and once a range split has
    decided the guards, the sum of pads folds to the one live part."""
    return isinstance(v, float) and v == 0 and math.copysign(1.0, v) < 0


def _emit_const(list out, dt, v):
    op = (CONST, dt, v)
    # constants are hoisted by the backend; reuse an existing identical one
    for j, o in enumerate(out):
        if o == op and type(o[2]) is type(v) and repr(o[2]) == repr(v):
            return j
    out.append(op)
    return len(out) - 1


def dead_code(list ops):
    """Drop pure ops whose value nobody uses; renumber references."""
    cdef int n = len(ops)
    cdef list live = [False] * n
    cdef int i
    for i in range(n - 1, -1, -1):
        op = ops[i]
        if op[0] in SIDE_EFFECTS:
            live[i] = True
        if live[i]:
            for p in REFS[op[0]]:
                if op[p] >= 0:
                    live[op[p]] = True
    # a register Define whose only users are dead is still kept: it is a side effect
    return reorder(ops, [i for i in range(n) if live[i]])


def splice(list ops, dict before, dict after, dict replace):
    """`ops` with new ops inserted and some replaced, references renumbered: how rewrites
    add ops. `before[i]` / `after[i]`: (name, op) pairs emitted before / after old op i
    (name None: nothing refers to it); `replace[i]`: the op emitted in place of old op
    i. In every op, a reference that is an int >= 0 or ("old", j) means old op j, any
    other tuple the inserted op of that name, a negative int stays as it is."""
    cdef list out = []
    cdef dict new = {}

    def ref(x):
        if isinstance(x, tuple):
            return new[x[1]] if x[0] == "old" else new[x]
        return new[x] if x >= 0 else x

    def emit(name, op):
        refs = REFS[op[0]]
        if refs:
            op = list(op)
            for p in refs:
                op[p] = ref(op[p])
            op = tuple(op)
        out.append(op)
        if name is not None:
            new[name] = len(out) - 1

    for i, op in enumerate(ops):
        for name, extra in before.get(i, ()):
            emit(name, extra)
        emit(None, replace.get(i, op))
        new[i] = len(out) - 1
        for name, extra in after.get(i, ()):
            emit(name, extra)
    return out


def reorder(list ops, list order):
    """The ops at the positions `order` (each op after those it references), in that
    order, with their references renumbered: how rewrites drop or move ops."""
    cdef dict new = {old: i for i, old in enumerate(order)}
    cdef list out = []
    for old in order:
        op = ops[old]
        refs = REFS[op[0]]
        if refs:
            op = list(op)
            for p in refs:
                if op[p] >= 0:
                    op[p] = new[op[p]]
            op = tuple(op)
        out.append(op)
    return out


def optimize(kernel):
    """The always-on pipeline; tunable passes plug in after this one."""
    ops = dead_code(simplify(kernel.ops))
    return Kernel(ops, kernel.args, kernel.name)
