"""Growing sizes: one plan for graphs that differ only in a size that grows.

Autoregressive sampling feeds a model a context one token longer each step; the graphs of
those steps are the same ops on shapes that differ in one size. Without this module each
length is a new plan (its kernels built and compiled again). Here the runtime treats that
size as a symbolic size within a bound:

- Graphs are grouped by their shape skeleton (`skeleton`: ops, dtypes, edges and ranks,
  without sizes, pad amounts or constant values). The first graph of a skeleton gets an
  ordinary plan and is remembered (`observe`); a later one with other sizes is fitted
  (`fit`): one integer n (a size that changed by the least) such that every size that
  changed is a*n + c with a > 0. The result is the family's `Template`; a graph belongs to
  it when every size, pad and constant follows it (`Template.bind`).
- The family's plan is built for a bound B, the power of two >= n (at least MIN_BOUND), on
  the same graph with every varying size at a*B + c (`build_bound_graph`):
  * a realized input with a varying size is copied into a zero-filled buffer of its bound
    shape at each run ("stage"),
  * every reduction over a varying axis skips the positions past the real size (a WHERE
    of 0..size-1 < a*n + c, the real size read at launch),
  * a slice whose start depends on n (`x[:, -1]`) reads its start at launch; a pad after
    the end of a varying axis masks the positions between the real end and the pad,
  * a pad whose amount before the source is a*n + c (the parts after the first of a cat
    along the growing axis, `idx = cat([idx, nxt], 1)`; a growing cut of a fixed tensor,
    `cache[:, :, :t + 1]`) pads the source by fixed amounts that cover every n up to B and
    cuts the result out at a start read at launch; a growing source's positions past
    its real size are masked to the fill,
  * a result with a varying size is copied out of the bound buffer.
  Positions past the real sizes hold values that never reach a real position, so every
  result is what the graph at n computes, element for element. Sampling 200 tokens builds
  one ordinary plan and one plan per power of two, not 200.
- Graphs that fall back to a plan per size: a flip of a varying axis, a pad whose amounts
  are not a*n + c of the fitted n, a reshape that merges a varying axis with an outer
  axis or with another varying axis (a batch whose size varies, flattened with the
  positions: (b, t, c) -> (b*t, c)), value checks that the plan computes, and graphs whose
  sizes stop following the fit (a context cropped to a block size starts a new family).
  `idx = cat([idx, nxt], 1)` keeps idx realized: small realized parts are joined at once
  (Runtime.concat_copy: on the host, or by device copies on CUDA, HIP and OpenCL), and a
  small append to a realized tensor elsewhere, or of a lazy nxt, is realized at once
  (tensor.cat), so each step's graph is the same ops on a longer idx rather than a chain
  of cats one deeper per step.
"""
from __future__ import annotations

import math

import numpy as np

from . import dtype as dt
from ._core import kernel as K
from ._core.graph import (LEAF, CONST, CAST, UNARY, BINARY, WHERE, REDUCE, RESHAPE, PERMUTE,
                          EXPAND, PAD, FLIP)

MIN_BOUND = 16      # smallest bound: short contexts share one plan
# Growing inputs are copied into their bound shape and growing results out of it through
# the host; past this many bytes per run a plan per size is cheaper than the copies.
STAGE_LIMIT = 8 << 20
# Skeletons remembered at once (each keeps its first graph's shapes and pad/constant
# args, ~70 bytes a node); past it the runtime forgets them all and starts again.
MAX_FAMILIES = 256


def skeleton(graph, ids):
    """(key, sizes): the structural key of the subgraph feeding `ids` without its sizes,
    pad amounts and constants (graph.collect's shape skeleton), and every node's shape in
    the order collect lists them."""
    sizes = []
    key = graph.collect(ids, None, sizes)[1]
    return key, sizes


def _signature(graph, order):
    """(op, dtype, source positions, arg) per node: what `fit` reads of the structure."""
    pos = {nid: p for p, nid in enumerate(order)}
    out = []
    for nid in order:
        node = graph.get(nid)
        out.append((node.op, node.dtype, tuple([pos[s] for s in node.srcs]), node.arg))
    return out


def observe(graph, order, sizes):
    """What `fit` compares: each node's shape, and the arg of pads and constants."""
    out = []
    for nid, shape in zip(order, sizes):
        node = graph.get(nid)
        out.append((shape, node.arg if node.op == PAD or node.op == CONST else None))
    return out


def _same_value(a, b):
    """Constants compare as the plan key does: floats by their bits (0.0 and -0.0 differ,
    NaN equals NaN)."""
    if type(a) is float and type(b) is float:
        return a.hex() == b.hex()
    return type(a) is type(b) and a == b


def _reshape_ok(sin1, sout1, sin2, sout2, vin, vout):
    """A reshape is computed the same at the bound when each varying axis stays one axis
    of its own group (merged or split only with fixed axes inside it, after it) on both
    sides: the row-major positions of real elements are then the same at every n."""
    if 0 in sin1 or 0 in sin2:
        return False
    ni, no = len(sin1), len(sout1)
    i = j = 0
    while i < ni or j < no:
        gi, gj = [], []
        a1 = a2 = b1 = b2 = 1
        if i < ni:
            gi.append(i)
            a1, a2 = sin1[i], sin2[i]
            i += 1
        if j < no:
            gj.append(j)
            b1, b2 = sout1[j], sout2[j]
            j += 1
        while a1 != b1 or a2 != b2:
            if (a1 < b1 and a2 <= b2) or (a1 == b1 and a2 < b2):
                if i >= ni:
                    return False
                gi.append(i)
                a1 *= sin1[i]
                a2 *= sin2[i]
                i += 1
            elif (a1 > b1 and a2 >= b2) or (a1 == b1 and a2 > b2):
                if j >= no:
                    return False
                gj.append(j)
                b1 *= sout1[j]
                b2 *= sout2[j]
                j += 1
            else:
                return False
        for dims, s1, s2, v in ((gi, sin1, sin2, vin), (gj, sout1, sout2, vout)):
            var = [d for d in dims if d in v]
            if len(var) > 1:
                return False
            if var and any(s1[d] != 1 or s2[d] != 1 for d in dims if d < var[0]):
                return False
        if (len([d for d in gi if d in vin]) != len([d for d in gj if d in vout])):
            return False
    return True


def _pad_rules(obs1, obs2, p, sv, v, n1, dn):
    """Per axis of pad `p`: "keep" (same amounts at every n; "mask" when it pads after a
    varying axis), "start" (a fixed axis cut on both sides whose start moves: read at
    launch), "end" (a varying axis cut to a fixed size: its start, which depends on n, is
    read at launch), ("shift", ab, cb) (a growing result whose amount before the source
    is ab*n + cb: `cat([idx, nxt], 1)`'s new part, `cache[:, :t + 1]`'s cut end). None
    when an axis fits none of them."""
    rules = []
    for d, ((b1, e1), (b2, e2)) in enumerate(zip(obs1[p][1][0], obs2[p][1][0])):
        if d not in sv and d not in v:
            if (b1, e1) == (b2, e2):
                rules.append("keep")
            elif b1 <= 0 and e1 <= 0 and b2 <= 0 and e2 <= 0:
                rules.append("start")
            else:
                return None
        elif d in v and ((b1, e1) != (b2, e2) or d not in sv):
            ab, r = divmod(b2 - b1, dn)
            if r:
                return None
            rules.append(("shift", ab, b1 - ab * n1))
        elif d in v:
            rules.append("mask" if e1 > 0 else "keep")
        elif b1 <= 0 and e1 <= 0 and b2 <= 0 and e2 <= 0:
            rules.append("end")
        else:
            return None
    return tuple(rules)


class Template:
    """How the sizes of a family's graphs follow n (`vary`: position -> {axis: (a, c)}),
    what each pad does per axis (`pads`), which reductions are masked (`masked`), which
    constants are read at launch (`consts`: position -> is float), and the first graph's
    shapes and args to check the fixed ones against."""

    def __init__(self, ref, vary, pads, masked, consts, first):
        self.ref = ref
        self.vary = vary
        self.pads = pads
        self.masked = masked
        self.consts = consts
        self.first = first
        # for bind: the first graph's shapes, the varying axes per node, the pads and
        # constants to check
        self._base = [shape for shape, _ in first]
        self._varying = [(p, tuple([(d, a, c) for d, (a, c) in v.items()]))
                         for p, v in vary.items()]
        self._pads = [(p, rules, first[p][1][0]) for p, rules in pads.items()]
        self._consts = [(p, p in consts, first[p][1]) for p, (shape, arg) in enumerate(first)
                        if arg is not None and p not in pads]

    def shape_at(self, p, n):
        shape = self.first[p][0]
        v = self.vary.get(p)
        if not v:
            return shape
        return tuple([v[d][0] * n + v[d][1] if d in v else s for d, s in enumerate(shape)])

    def bind(self, graph, order, sizes):
        """(n, pad starts {(position, axis): start}, constants {position: value}) of a
        graph of this family (`sizes`: its shapes, from `skeleton`), or None when one of
        its sizes, pads or constants does not follow the template."""
        p0, d0 = self.ref
        n = sizes[p0][d0]
        expected = list(self._base)
        for p, dims in self._varying:
            shape = list(expected[p])
            for d, a, c in dims:
                size = a * n + c
                if size < 1:
                    return None     # an empty tensor: its own plan
                shape[d] = size
            expected[p] = tuple(shape)
        if expected != sizes:
            return None
        starts, values = {}, {}
        for p, rules, fa in self._pads:
            arg = graph.get(order[p]).arg[0]
            for d, rule in enumerate(rules):
                b, e = arg[d]
                if rule == "keep" or rule == "mask":
                    if (b, e) != fa[d]:
                        return None
                elif type(rule) is tuple:
                    if b != rule[1] * n + rule[2]:
                        return None
                elif b > 0 or e > 0:
                    return None
                else:
                    starts[(p, d)] = -b
        for p, is_param, first_value in self._consts:
            v = graph.get(order[p]).arg
            if is_param:
                values[p] = v
            elif not _same_value(v, first_value):
                return None
        return n, starts, values


def fit(graph, order, obs1, obs2):
    """The Template of two graphs of one skeleton, the second one `order` in `graph` (see
    the module docstring); None when
    no size differs; a string saying why the graphs are not one growing family."""
    diffs = []
    for p, ((s1, _), (s2, _)) in enumerate(zip(obs1, obs2)):
        if s1 != s2:
            for d, (x, y) in enumerate(zip(s1, s2)):
                if x != y:
                    diffs.append((p, d, x, y))
    if not diffs:
        return None
    step = min(abs(y - x) for _, _, x, y in diffs)
    p0, d0, n1, n2 = next(t for t in diffs if abs(t[3] - t[2]) == step)
    dn = n2 - n1
    vary = {}
    for p, d, x, y in diffs:
        a, r = divmod(y - x, dn)
        if r or a <= 0:
            return f"sizes that are not a*n + c of one n (a {x} -> {y} beside {n1} -> {n2})"
        vary.setdefault(p, {})[d] = (a, x - a * n1)
    pads, masked, consts = {}, {}, {}
    sig = _signature(graph, order)
    for p, (op, _, srcs, arg) in enumerate(sig):
        v = vary.get(p, {})
        sv = vary.get(srcs[0], {}) if srcs else {}
        if op == CAST or op == UNARY or op == BINARY or op == WHERE:
            if any(vary.get(s, {}) != v for s in srcs):
                return "an elementwise op whose inputs grow differently"
        elif op == PERMUTE:
            if {k: sv[ax] for k, ax in enumerate(arg) if ax in sv} != v:
                return "a permute that does not move the growing axes"
        elif op == EXPAND:
            src_shape = obs1[srcs[0]][0]
            if any(v.get(d) != f for d, f in sv.items()):
                return "an expand of a growing axis"
            if any(d not in sv and src_shape[d] != 1 for d in v):
                return "an expand to a growing size from an axis longer than 1"
        elif op == FLIP:
            if sv != v or any(d in v for d in arg):
                return "a flip of a growing axis"
        elif op == REDUCE:
            axes = arg[1]
            if {d: f for d, f in sv.items() if d not in axes} != v:
                return "a reduction whose kept axes grow differently"
            m = tuple([d for d in axes if d in sv])
            if m:
                masked[p] = m
        elif op == RESHAPE:
            s = srcs[0]
            if not _reshape_ok(obs1[s][0], obs1[p][0], obs2[s][0], obs2[p][0], sv, v):
                return f"a reshape {obs1[s][0]} -> {obs1[p][0]} that merges a growing axis with an outer or growing one"
        elif op == PAD:
            rules = _pad_rules(obs1, obs2, p, sv, v, n1, dn)
            if rules is None:
                return f"a pad {obs1[p][1][0]} -> {obs2[p][1][0]} whose amounts do not follow n"
            pads[p] = rules
        elif op == CONST:
            if not _same_value(obs1[p][1], obs2[p][1]):
                consts[p] = sig[p][1].is_float
    return Template((p0, d0), vary, pads, masked, consts, obs1)


def staged_bytes(t, graph, order, ids, B):
    """Bytes a run at bound B copies: its growing realized inputs and growing results."""
    pos = {nid: p for p, nid in enumerate(order)}
    copied = set([pos[i] for i in ids])
    copied.update([p for p, nid in enumerate(order) if graph.get(nid).op == LEAF])
    total = 0
    for p in copied:
        if t.vary.get(p):
            n = graph.get(order[p]).dtype.itemsize
            for s in t.shape_at(p, B):
                n *= s
            total += n
    return total


def bound_for(n):
    """The bound a plan for size n is built for: powers of two from MIN_BOUND."""
    return max(MIN_BOUND, 1 << max(0, n - 1).bit_length())


def _identity(rop, dtype):
    """The value a reduction `rop` ignores (what masked positions read), as a scalar of
    `dtype`'s kind."""
    if rop == K.R_SUM or rop == K.R_PROD:
        one = rop == K.R_PROD
        return one if dtype is dt.bool_ else (float(one) if dtype.is_float else int(one))
    big = rop == K.R_MIN
    if dtype is dt.bool_:
        return big
    if dtype.is_float:
        return math.inf if big else -math.inf
    info = np.iinfo(dtype.np)
    return int(info.max if big else info.min)


class BoundGraph:
    """A family's graph at bound B, added to the runtime's graph for building its plan
    (`order`, `targets`, `params` for kernelize), and what each run binds:
    `leaves`: (bound position, role, x) for "leaf" (the real leaf at position x),
    "stage" (the real leaf at x, copied into its bound shape), "iota" (0..x-1 as int32),
    "ints"/"floats" (the parameter arrays); `outputs`: (bound position, real position,
    varying); `int_spec`/`float_spec`: where each parameter's value comes from:
    ("size", a, c, extra) = a*n + c + extra, ("start", p, axis), ("const", p)."""

    def __init__(self):
        self.order = []
        self.added = []
        self.leaves = []
        self.outputs = []
        self.targets = []
        self.params = {}
        self.int_spec = []
        self.float_spec = []
        self.shapes = {}
        self.fdt = None

    def values(self, n, starts, consts):
        ints = []
        for s in self.int_spec:
            if s[0] == "size":
                ints.append(s[1] * n + s[2] + s[3])
            elif s[0] == "start":
                ints.append(starts[(s[1], s[2])])
            else:
                v = int(consts[s[1]])
                ints.append(v - (1 << 64) if v >= 1 << 63 else v)
        floats = [consts[s[1]] for s in self.float_spec]
        return ints, floats


def build_bound_graph(graph, order, ids, t: Template, B: int, fdt):
    """Add the family's graph at bound B to `graph` (see BoundGraph); the caller releases
    `added` once the plan is built (on an error here they are released before raising).
    `fdt`: the dtype of the float parameter array."""
    bg = BoundGraph()
    bg.fdt = fdt
    try:
        _fill(graph, order, ids, t, B, bg)
    except BaseException:
        for nid in reversed(bg.added):
            graph.release(nid)
        raise
    return bg


def _fill(graph, order, ids, t, B, bg):
    add, ext, added = graph.add, bg.order, bg.added
    mapped = [None] * len(order)
    iotas = {}
    pos = {nid: p for p, nid in enumerate(order)}
    int_slots, float_slots = [], []     # (bound position, axis) per parameter, in order

    def new(op, arg, srcs, shape, dtype):
        nid = add(op, arg, srcs, shape, dtype)
        added.append(nid)
        ext.append(nid)
        return nid, len(ext) - 1

    def placeholder(shape, dtype):
        nid = graph.leaf(None, shape, dtype)
        added.append(nid)
        ext.append(nid)
        return len(ext) - 1

    def real_size(a, c, extra, shape):
        """A CONST int32 of `shape` read at launch: a*n + c + extra."""
        _, cpos = new(CONST, a * B + c + extra, (), shape, dt.int32)
        int_slots.append((cpos, -1))
        bg.int_spec.append(("size", a, c, extra))
        return ext[cpos]

    def below(shape, axis, a, c, extra):
        """bool of `shape`: position along `axis` < a*n + c + extra."""
        size = shape[axis]
        it = iotas.get(size)
        if it is None:
            ipos = placeholder((size,), dt.int32)
            bg.leaves.append((ipos, "iota", size))
            it = iotas[size] = ext[ipos]
        one = tuple([size if d == axis else 1 for d in range(len(shape))])
        r, _ = new(RESHAPE, one, (it,), one, dt.int32)
        if one != shape:
            r, _ = new(EXPAND, shape, (r,), shape, dt.int32)
        lim = real_size(a, c, extra, shape)
        cmp, _ = new(BINARY, K.B_CMPLT, (r, lim), shape, dt.bool_)
        return cmp

    def masked(x, shape, dtype, axis, a, c, extra, fill):
        cond = below(shape, axis, a, c, extra)
        f, _ = new(CONST, fill, (), shape, dtype)
        w, _ = new(WHERE, None, (cond, x, f), shape, dtype)
        return w

    for p, nid in enumerate(order):
        node = graph.get(nid)
        op = node.op
        shape = t.shape_at(p, B)
        v = t.vary.get(p)
        src_pos = [pos[s] for s in node.srcs]
        srcs = tuple([mapped[s] for s in src_pos])
        if op == LEAF:
            if v:
                bpos = placeholder(shape, node.dtype)
                bg.leaves.append((bpos, "stage", p))
                bg.shapes[bpos] = shape
                mapped[p] = ext[bpos]
            else:
                ext.append(nid)
                bg.leaves.append((len(ext) - 1, "leaf", p))
                mapped[p] = nid
            continue
        if op == CONST:
            mapped[p], cpos = new(CONST, node.arg, (), shape, node.dtype)
            if p in t.consts:
                if t.consts[p]:
                    float_slots.append((cpos, -1))
                    bg.float_spec.append(("const", p))
                else:
                    int_slots.append((cpos, -1))
                    bg.int_spec.append(("const", p))
            continue
        if op == REDUCE and p in t.masked:
            x = srcs[0]
            src = graph.get(x)
            sv = t.vary[src_pos[0]]
            fill = _identity(node.arg[0], src.dtype)
            for d in t.masked[p]:
                x = masked(x, src.shape, src.dtype, d, sv[d][0], sv[d][1], 0, fill)
            srcs = (x,)
        arg = node.arg
        if op == RESHAPE or op == EXPAND:
            arg = shape
        elif op == PAD:
            sp = src_pos[0]
            sshape = t.shape_at(sp, B)
            sv = t.vary.get(sp, {})
            pads, fill = node.arg
            src = srcs[0]
            rules = t.pads[p]
            shifts = [(d, r) for d, r in enumerate(rules) if type(r) is tuple]
            if shifts:
                # The source moves along the result as n grows: pad it by fixed amounts
                # (L before, R after) so that every position the result may read exists,
                # then cut the result out at start L - (ab*n + cb), read at launch.
                wide, cuts = list([(0, 0)] * len(shape)), {}
                for d, (_, ab, cb) in shifts:
                    lo = min(ab + cb, ab * B + cb)      # the amount before, over n in 1..B
                    hi = max(ab + cb, ab * B + cb)
                    L = max(0, hi)
                    R = max(0, shape[d] - sshape[d] - lo)
                    wide[d] = (L, R)
                    cuts[d] = (L, ab, cb, min(L - lo, L + sshape[d] + R - shape[d]))
                wshape = tuple([s + b + e for s, (b, e) in zip(sshape, wide)])
                src, _ = new(PAD, (tuple(wide), fill), (src,), wshape, node.dtype)
            new_pads, masks, slots = [], [], []
            for d, rule in enumerate(rules):
                b, e = pads[d]
                if type(rule) is tuple:
                    L, ab, cb, s0 = cuts[d]
                    new_pads.append((-s0, s0 + shape[d] - wshape[d]))
                    slots.append((d, ("size", -ab, -cb, L)))
                    if d in sv:     # source positions past its real size: the fill
                        masks.append((d, sv[d][0] + ab, sv[d][1] + cb, 0))
                elif rule == "end":
                    new_pads.append((b, shape[d] - sshape[d] - b))
                    slots.append((d, ("start", p, d)))
                elif rule == "start":
                    new_pads.append((b, e))
                    slots.append((d, ("start", p, d)))
                else:
                    new_pads.append((b, e))
                    if rule == "mask":
                        masks.append((d, sv[d][0], sv[d][1], b))
            arg = (tuple(new_pads), fill)
            mapped[p], ppos = new(PAD, arg, (src,), shape, node.dtype)
            for d, spec in slots:
                int_slots.append((ppos, d))
                bg.int_spec.append(spec)
            for d, a, c, b in masks:
                mapped[p] = masked(mapped[p], shape, node.dtype, d, a, c, b, fill)
            continue
        mapped[p], _ = new(op, arg, srcs, shape, node.dtype)
    bpos_of = {nid: bp for bp, nid in enumerate(ext)}
    for i in ids:
        p = pos[i]
        bg.targets.append(mapped[p])
        bp = bpos_of[mapped[p]]
        if bp not in bg.shapes:     # a target listed twice is bound once
            bg.outputs.append((bp, p, bool(t.vary.get(p))))
            bg.shapes[bp] = t.shape_at(p, B)
    for slots, spec, dtype, role in ((int_slots, bg.int_spec, dt.int64, "ints"),
                                     (float_slots, bg.float_spec, bg.fdt, "floats")):
        if slots:
            lpos = placeholder((len(slots),), dtype)
            bg.leaves.append((lpos, role, len(slots)))
            for k, key in enumerate(slots):
                bg.params[key] = (lpos, k)
