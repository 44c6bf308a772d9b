"""Loop-invariant loads moved out of their loops (a kernel IR -> kernel IR rewrite the C
backend applies before rendering).

A load a loop makes the same way on every pass (a row's stored maximum read inside the
loop over the row), with the index math leading to it, is made once, before the
outermost loop it does not depend on. gcc hoists such loads itself, but one left inside
a `#pragma omp simd` loop next to masked selects made it give up vectorizing the loop
("control flow in loop": a softmax backward's store loop, 2.9 vs 0.32 ms; layer_norm's
backward kernels 3x).

Only loads of read-only buffers move (their guard and index with them); arithmetic on
its own stays, gcc hoists it (moved out of a register tile's epilogue loops it made gcc
5x slower to compile that kernel), and so does everything in a register tile's vector
loop. Nothing moves out of an IF block or out of a loop that may run zero times, so
nothing is evaluated that the kernel would not have evaluated.
"""
from __future__ import annotations

from ..._core import kernel as K
from ..._core.passes import REFS, reorder

# ops whose value depends only on their operands (padtaps.py walks them too)
PURE = frozenset((K.CONST, K.CAST, K.UNARY, K.BINARY, K.WHERE, K.MAD))


def hoist_invariants(kernel):
    """`kernel` with every loop-invariant read-only load (and the index math it needs)
    placed before the outermost loop it does not depend on; the kernel itself when
    nothing moves."""
    ops = kernel.ops
    n = len(ops)
    lanes = _lane_loops(ops)
    home = [()] * n       # the LOOPs each op's value depends on (a prefix of those around it)
    stack, ifs = [], 0
    moved = {}            # op -> the LOOP it is placed in front of
    for i, op in enumerate(ops):
        c = op[0]
        if c == K.ENDLOOP:
            stack.pop()
        elif c == K.END_IF:
            ifs -= 1
        if _pure(ops, op) and not ifs and stack and stack[-1] not in lanes:
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
                    home[i] = tuple(stack)
        else:
            home[i] = tuple(stack)
        if c == K.LOOP:
            stack.append(i)
        elif c == K.IF_OP:
            ifs += 1
    # only loads move, with the index math they need: arithmetic alone gcc hoists itself,
    # and moved out of a register tile's epilogue loops it made gcc 5x slower to compile
    keep = set()
    for i in sorted(moved, reverse=True):
        if ops[i][0] == K.LOAD or i in keep:
            keep.add(i)
            for p in REFS[ops[i][0]]:
                j = ops[i][p]
                if j in moved:
                    keep.add(j)
    moved = {i: loop for i, loop in moved.items() if i in keep}
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
    return K.Kernel(reorder(ops, order), kernel.args, kernel.name)


def _lane_loops(ops):
    """LOOPs directly holding a store to a per-lane accumulator array: a register tile's
    vector loop. What they read stays in them: gcc multiplies by a broadcast straight
    from memory there, and a load moved out in front of the tile's unrolled rows loop
    made it compile a small MLP's step 5x longer (0.4 s for one kernel)."""
    out, stack = set(), []
    for i, op in enumerate(ops):
        c = op[0]
        if c == K.LOOP:
            stack.append(i)
        elif c == K.ENDLOOP:
            stack.pop()
        elif c == K.STORE and stack:
            d = ops[op[2]]
            if d[2] == K.SCOPE_REGISTER and d[5] > 1 and d[6] >= 0:
                out.add(stack[-1])
    return out


def _pure(ops, op):
    c = op[0]
    if c in PURE:
        return True
    if c == K.LOAD:
        d = ops[op[2]]
        return d[2] == K.SCOPE_GLOBAL and bool(d[4])
    return False
