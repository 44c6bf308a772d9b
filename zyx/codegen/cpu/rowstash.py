"""Values a row kernel computes twice, computed once (CPU kernels; a kernel IR -> kernel IR
rewrite the C backend applies before rendering).

A row kernel (softmax) walks its row in sibling loops of the same length: one loop sums
exp(x - max), a later one stores exp(x - max) / sum. The later loop recomputes the same
value at the same element; where that value costs a transcendental call it is cheaper to
keep it: the earlier loop also writes it to a row-long stack buffer, and the later loop
reads it back (softmax 4096x1024 on 2 cores: one exp per element instead of two).

Two values are the same when their expression trees are equal with the two loops'
variables identified: the same ops on the same constants, the same values defined before
both loops, and loads of read-only buffers at equal indices. Nothing computed between the
loops (the sum) can appear in the earlier loop, so a match is always the same number.
"""
from __future__ import annotations

from ..._core import kernel as K
from ..._core.passes import REFS, splice

STASH_MAX_BYTES = 16384     # a stack buffer per stashed value (a row of 4096 floats)
COSTLY = frozenset((K.U_EXP, K.U_EXP2, K.U_LOG, K.U_LOG2, K.U_SIN, K.U_COS, K.U_TANH,
                    K.U_ERF))
_ALU = (K.CAST, K.UNARY, K.BINARY, K.WHERE, K.MAD)


def _loops(ops):
    """[(start, end, parent)] of every LOOP (end: its ENDLOOP's index; parent: the LOOP
    it is directly inside, -1 for none)."""
    out, stack = [], []
    for i, op in enumerate(ops):
        if op[0] == K.LOOP:
            stack.append(i)
        elif op[0] == K.ENDLOOP:
            s = stack.pop()
            out.append((s, i, stack[-1] if stack else -1))
    return sorted(out)


def _keys(ops, start, end, intern):
    """Structural key of each ALU op and read-only load inside loop [start, end] (the loop
    variable is 'var', values from before the loop are themselves), None where the value
    may differ between loops (a register or a written buffer read, a store). Keys are
    interned to ints (`intern`, shared by the loops compared): a key naming its sources'
    keys as nested tuples would unfold the value's DAG into a tree, exponential in its
    depth (a random generator's rounds reuse both words every round)."""
    keys = {}
    for i in range(start + 1, end):
        op = ops[i]
        c = op[0]
        key = None
        if c == K.CONST:
            v = op[2]
            key = ("c", op[1], v.hex() if isinstance(v, float) else v)
        elif c == K.LOAD:
            d = ops[op[2]]
            if d[2] == K.SCOPE_GLOBAL and d[4]:     # read-only buffer
                key = ("ld", op[1], op[2], _ref(keys, op[3], start),
                       -1 if op[4] < 0 else _ref(keys, op[4], start))
        elif c in _ALU:
            fields = list(op)
            for p in REFS[c]:
                fields[p] = _ref(keys, op[p], start)
            key = tuple(fields)
        if key is not None and None in key:
            key = None
        keys[i] = None if key is None else intern.setdefault(key, len(intern))
    return keys


def _ref(keys, j, start):
    if j == start:
        return "var"
    if j < start:
        return ("ext", j)
    return keys.get(j)


def _costly(ops, j, start, memo):
    """True when the value of op j (inside the loop at `start`) calls a transcendental."""
    r = memo.get(j)
    if r is None:
        op = ops[j]
        r = op[0] == K.UNARY and op[2] in COSTLY
        if not r and op[0] in _ALU:
            r = any(_costly(ops, op[p], start, memo) for p in REFS[op[0]]
                    if op[p] > start)
        memo[j] = r
    return r


def stash_row_values(kernel):
    """`kernel` with each costly value that a later sibling loop recomputes kept in a
    stack buffer by the earlier loop (see module doc); the kernel itself when there is
    none."""
    ops = kernel.ops
    loops = _loops(ops)
    if len(loops) < 2:
        return kernel
    intern = {}
    keys = {s: _keys(ops, s, e, intern) for s, e, _ in loops}
    plan = []          # (earlier op, later op, earlier loop, later loop)
    taken = set()
    for a, (s1, e1, parent1) in enumerate(loops):
        first = None
        for s2, e2, parent2 in loops[a + 1:]:
            if parent2 != parent1 or s2 < e1 or ops[s2][2] != ops[s1][2]:
                # (siblings only: one loop's values, kept, are the other's in the same
                # iteration of whatever loop holds both)
                continue
            if first is None:
                first = {}
                for i, key in keys[s1].items():
                    if key is not None:
                        first.setdefault(key, i)
            later = keys[s2]
            matched = {j for j, key in later.items() if key is not None and key in first}
            memo = {}
            for j in sorted(matched):
                # (a costly value is an ALU op: _costly is False for loads)
                if j in taken or not _costly(ops, j, s2, memo):
                    continue
                op = ops[j]
                users = [u for u in range(j + 1, e2)
                         if any(ops[u][p] == j for p in REFS[ops[u][0]])]
                if any(u in matched and _costly(ops, u, s2, memo) for u in users):
                    continue     # a larger matched value holds this one
                if ops[s1][2] * op[1].itemsize > STASH_MAX_BYTES:
                    continue
                plan.append((first[later[j]], j, s1, s2))
                taken.add(j)
    if not plan:
        return kernel
    return K.Kernel(_rewrite(ops, plan), kernel.args, kernel.name)


def _rewrite(ops, plan):
    """The op list with, per (i, j, s1, s2) of `plan`, a row buffer defined before loop
    s1 (no initial value: every element is written before it is read), op i's value
    stored into it at s1's variable, and op j replaced by a load of it at s2's
    variable."""
    before = {}     # old index -> ops to insert before it (new DEFINEs)
    after = {}      # old index -> ops to insert after it (STOREs)
    replace = {}    # old index -> new op (LOADs)
    for n, (i, j, s1, s2) in enumerate(plan):
        buf = ("buf", n)
        before.setdefault(s1, []).append(
            (buf, (K.DEFINE, ops[i][1], K.SCOPE_REGISTER, None, False, ops[s1][2], -1)))
        after.setdefault(i, []).append((None, (K.STORE, None, buf, ("old", s1), ("old", i))))
        replace[j] = (K.LOAD, ops[j][1], buf, ("old", s2), -1)
    return splice(ops, before, after, replace)
