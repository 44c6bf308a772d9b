"""Loop-invariant values moved out of their loops (a kernel IR -> kernel IR rewrite the C
backend applies before rendering).

A value a loop computes the same way on every pass (a load of a row's stored maximum
inside the loop over the row, and the index math leading to it) is computed once, before
the outermost loop it does not depend on. gcc hoists such values itself, but a load left
inside a `#pragma omp simd` loop next to masked selects made it give up vectorizing the
loop ("control flow in loop": a softmax backward's store loop, 2.9 vs 0.32 ms).

Only pure values move: constants, arithmetic, and loads of read-only buffers (whose
guard, if any, moves with them). Nothing moves out of an IF block or out of a loop that
may run zero times, so nothing is evaluated that the kernel would not have evaluated.
"""
from __future__ import annotations

from .._core import kernel as K
from .._core.passes import REFS

_PURE = frozenset((K.CONST, K.CAST, K.UNARY, K.BINARY, K.WHERE, K.MAD))


def hoist_invariants(kernel):
    """`kernel` with every loop-invariant pure value placed before the outermost loop it
    does not depend on; the kernel itself when nothing moves."""
    ops = kernel.ops
    n = len(ops)
    chain = [()] * n      # the LOOPs around each op, outermost first
    home = [()] * n       # the LOOPs each op's value depends on (a prefix of its chain)
    stack, ifs = [], 0
    moved = {}            # op -> the LOOP it is placed in front of
    for i, op in enumerate(ops):
        c = op[0]
        if c == K.ENDLOOP:
            stack.pop()
        elif c == K.END_IF:
            ifs -= 1
        chain[i] = tuple(stack)
        if _pure(ops, op) and not ifs and stack:
            h = ()
            for p in REFS[c]:
                j = op[p]
                if j < 0:
                    continue
                hj = home[j] + (j,) if ops[j][0] == K.LOOP else home[j]
                if len(hj) > len(h):
                    h = hj
            home[i] = h
            if len(h) < len(stack):
                outer = stack[len(h)]
                if all(ops[lp][2] > 0 for lp in stack[len(h):]):
                    moved[i] = outer
                else:
                    home[i] = chain[i]
        else:
            home[i] = chain[i]
        if c == K.LOOP:
            stack.append(i)
        elif c == K.IF_OP:
            ifs += 1
    if not moved:
        return kernel
    front = {}
    for i, loop in moved.items():
        front.setdefault(loop, []).append(i)
    order = []
    for i in range(n):
        if i in moved:
            continue
        order.extend(sorted(front.get(i, ())))
        order.append(i)
    new = {old: k for k, old in enumerate(order)}
    out = []
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
    return K.Kernel(out, kernel.args, kernel.name)


def _pure(ops, op):
    c = op[0]
    if c in _PURE:
        return True
    if c == K.LOAD:
        d = ops[op[2]]
        return d[2] == K.SCOPE_GLOBAL and bool(d[4])
    return False
