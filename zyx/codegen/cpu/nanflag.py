"""Float max/min reductions with NaN tracked apart (a kernel IR -> kernel IR rewrite the C
backend applies before rendering).

zyx's max and min propagate NaN, as numpy's and torch's do: an accumulator update reads
`(acc > x || acc != acc) ? acc : x`, and the OpenMP combiner is a NaN-keeping
user-defined reduction. Both are slow in a long vectorized loop: the NaN test sits on the
loop-carried chain (gcc keeps one accumulator, so the loop runs at that chain's latency),
and gcc privatizes user-defined reductions through memory (benches/flag_ab.py, 4096x1024:
row max 0.315 -> 0.127 ms, softmax 1.38 -> 1.20 ms with the rewrite).

So in an innermost loop of at least MIN_LOOP passes whose scalar float accumulator's one
update is that max (min), the update becomes the plain `acc > x ? acc : x` (one vmaxps),
with OpenMP's built-in max combiner (reduce op NAN_MAX / NAN_MIN tells the C backend),
and a bool flag beside it records whether any x was NaN (`flag = max(flag, x != x)`, off
the chain). After the loop a NaN flag sets the accumulator to NaN, so every value read
from it is what the original kernel gave. Short loops (a pooling window) keep the
original form: there the flag would cost more than the chain.
"""
from __future__ import annotations

from ... import dtype as dt
from ..._core import kernel as K
from ..._core.passes import splice

MIN_LOOP = 64                 # shortest loop whose max/min reduction is rewritten
NAN_MAX, NAN_MIN = 16, 17     # reduce ops of rewritten accumulators (NaN kept by a flag)
_BY_REDUCE = {K.R_MAX: (K.B_MAX, K.B_CMPGT, NAN_MAX), K.R_MIN: (K.B_MIN, K.B_CMPLT, NAN_MIN)}


def _innermost_loops(ops):
    """(LOOP index, its ENDLOOP index) of every loop with no loop inside."""
    out, stack = [], []
    for i, op in enumerate(ops):
        if op[0] == K.LOOP:
            stack.append([i, False])
            if len(stack) > 1:
                stack[-2][1] = True
        elif op[0] == K.ENDLOOP:
            start, nested = stack.pop()
            if not nested:
                out.append((start, i))
    return out


def _candidates(ops):
    """(loop, endloop, accumulator, store, update, accumulator load, x) per rewritable
    reduction."""
    found = []
    for s, e in _innermost_loops(ops):
        if ops[s][2] < MIN_LOOP:
            continue
        stores = {}
        for j in range(s + 1, e):
            op = ops[j]
            if op[0] == K.STORE and op[3] == -1:
                stores.setdefault(op[2], []).append(j)
        for acc, js in stores.items():
            d = ops[acc]
            if (len(js) != 1 or acc > s or d[0] != K.DEFINE or d[2] != K.SCOPE_REGISTER
                    or d[5] != 1 or d[6] not in _BY_REDUCE or not d[1].is_float):
                continue
            j = js[0]
            upd = ops[ops[j][4]]
            if upd[0] != K.BINARY or upd[2] != _BY_REDUCE[d[6]][0]:
                continue
            for cur, x in ((upd[3], upd[4]), (upd[4], upd[3])):
                c = ops[cur]
                if c[0] == K.LOAD and c[2] == acc and c[3] == -1 and c[4] < 0:
                    found.append((s, e, acc, j, ops[j][4], cur, x))
                    break
    return found


def flag_nan_reductions(kernel):
    """`kernel` with its long loops' float max/min reductions rewritten (module doc); the
    kernel itself when there is none."""
    ops = kernel.ops
    found = _candidates(ops)
    if not found:
        return kernel
    before, after, replace = {}, {}, {}
    for n, (s, e, acc, j, upd, cur, x) in enumerate(found):
        _, cmp, marked = _BY_REDUCE[ops[acc][6]]
        flag = ("flag", n)
        replace[acc] = ops[acc][:6] + (marked,)
        before.setdefault(s, []).append(
            (flag, (K.DEFINE, dt.bool_, K.SCOPE_REGISTER, False, False, 1, K.R_MAX)))
        t = ("t", n)
        before.setdefault(upd, []).append(
            (t, (K.BINARY, dt.bool_, cmp, ("old", cur), ("old", x))))
        replace[upd] = (K.WHERE, ops[upd][1], t, ("old", cur), ("old", x))
        f1, nz, f2 = ("f1", n), ("nan", n), ("f2", n)
        after.setdefault(j, []).extend([
            (f1, (K.LOAD, dt.bool_, flag, -1, -1)),
            (nz, (K.BINARY, dt.bool_, K.B_NOTEQ, ("old", x), ("old", x))),
            (f2, (K.BINARY, dt.bool_, K.B_MAX, f1, nz)),
            (None, (K.STORE, None, flag, -1, f2))])
        fl, a, q, w = ("fl", n), ("a", n), ("q", n), ("w", n)
        d = ops[acc][1]
        after.setdefault(e, []).extend([
            (fl, (K.LOAD, dt.bool_, flag, -1, -1)),
            (a, (K.LOAD, d, ("old", acc), -1, -1)),
            (q, (K.CONST, d, float("nan"))),
            (w, (K.WHERE, d, fl, q, a)),
            (None, (K.STORE, None, ("old", acc), -1, w))])
    return K.Kernel(splice(ops, before, after, replace), kernel.args, kernel.name)
