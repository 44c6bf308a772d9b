"""Elementwise kernels that read along one output axis and write along another (a permuted
copy: the channels-last image of a GPU convolution, `x.T.contiguous()`, NCHW <-> NHWC) go
through a shared-memory tile instead of `gpu.lower_elementwise`, whose work-items walk the
output in order and so read such a load with a stride: each warp touches 32 cache
sectors for 32 values.

A kernel qualifies (`plan`) when it has no loops, one global store, contiguous along the
output's innermost axis B, and a global load contiguous along another output axis A
(coefficient 1) that steps along B by more than 1, with A and B both at least MIN_SIDE
long. A group takes a TILE x TILE block of (A, B) at one position of the other axes:
- its work-items walk the block A fastest, each running the kernel's whole body for its
  elements (so the load is coalesced) and writing the value it would store into a local
  tile at [b][a] (rows padded by one word: no bank conflicts either way);
- after a barrier they walk the block B fastest, reading the tile at [b][a] and storing
  to the output (coalesced).
Past the ends of A or B nothing is computed or stored.
"""
from __future__ import annotations

from ..._core import kernel as K
from ..cstyle import Frame as BodyFrame, INDEX32, render_body
from .gemm import decode_flat, value_lines
from .analysis import coefficient, narrow_index
from .program import GPUKernel, Launch, kernel_params

ENABLED = True     # False: such kernels stay elementwise (for comparisons)
TILE = 32          # elements per tile side
THREADS = 256      # work-items per group (TILE * TILE / THREADS elements each, per phase)
MIN_SIDE = 16      # shortest A and B worth a tile


class TransposePlan:
    """The store `store`, the output axes `a` (the load's contiguous one) and `b` (the
    innermost), `others` (the remaining INDEX ids, in order) with their lengths."""
    __slots__ = ("store", "a", "b", "others", "la", "lb", "nothers")


def plan(ops):
    """The kernel's `TransposePlan`, or None (module docstring)."""
    if not ENABLED or any(op[0] in (K.LOOP, K.IF_OP, K.BARRIER) for op in ops):
        return None
    stores = [i for i, op in enumerate(ops)
              if op[0] == K.STORE and ops[op[2]][2] == K.SCOPE_GLOBAL]
    index = [i for i, op in enumerate(ops) if op[0] == K.INDEX]
    if len(stores) != 1 or len(index) < 2:
        return None
    st = ops[stores[0]]
    b = max(index, key=lambda i: ops[i][2])
    if st[3] < 0 or coefficient(ops, st[3], b, {}) != 1 or ops[b][3] < MIN_SIDE:
        return None
    loads = [op for op in ops if op[0] == K.LOAD and ops[op[2]][2] == K.SCOPE_GLOBAL
             and op[3] >= 0]
    steps = [coefficient(ops, op[3], b, {}) for op in loads]
    if 1 in steps:
        return None          # a load already coalesced along B: the tile would stride it
    for op, step_b in zip(loads, steps):
        if step_b is None or step_b in (0, -1):
            continue
        for a in index:
            if a != b and ops[a][3] >= MIN_SIDE and coefficient(ops, op[3], a, {}) == 1:
                p = TransposePlan()
                p.store, p.a, p.b = stores[0], a, b
                p.others = [j for j in index if j not in (a, b)]
                p.la, p.lb = ops[a][3], ops[b][3]
                p.nothers = 1
                for j in p.others:
                    p.nothers *= ops[j][3]
                return p
    return None


class _TileFrame(BodyFrame):
    """render_body's hooks: index math in `narrow`, and the one global store writing the
    local tile at zyx_tp instead of the output."""

    def __init__(self, narrow, store):
        self.narrow = narrow
        self._store = store

    def access(self, i, buf, index):
        return "zyx_tile[zyx_tp]" if i == self._store else f"{buf}[{index}]"


def lower_transpose(kernel, dl, info, name, p):
    """The `GPUKernel` of `kernel` with plan `p` (module docstring)."""
    ops = kernel.ops
    ta, tb = -(-p.la // TILE), -(-p.lb // TILE)
    groups = p.nothers * ta * tb
    narrow = narrow_index(ops, [groups * THREADS, (ta + 1) * TILE, (tb + 1) * TILE])
    it = INDEX32 if narrow else dl.int64
    st = ops[p.store]
    d = ops[st[2]][1]
    r, names = render_body(kernel, dl, frame=_TileFrame(narrow, p.store))

    def position(a_off, b_off):
        """Statements naming every INDEX variable for the element at (a_off, b_off) of
        this group's block, inside a test that it is in the output."""
        out = [f"    const {it} zyx_a = zyx_a0 + {a_off};",
               f"    const {it} zyx_b = zyx_b0 + {b_off};",
               f"    if (zyx_a < {p.la} && zyx_b < {p.lb}) {{",
               f"      const {it} {names[p.a]} = zyx_a;",
               f"      const {it} {names[p.b]} = zyx_b;"]
        return out + decode_flat(names, ops, p.others, "zyx_o", it, "      ")

    body = [f"  {dl.local_qualifier}{dl.storage_type(d)} zyx_tile[{TILE * (TILE + 1)}];",
            f"  const {it} zyx_tid = ({it}){dl.local_id(0)};",
            f"  const {it} zyx_grp = ({it}){dl.group_id(0)};",
            f"  const {it} zyx_b0 = (zyx_grp % {tb}) * {TILE};",
            f"  const {it} zyx_a0 = ((zyx_grp / {tb}) % {ta}) * {TILE};",
            f"  const {it} zyx_o = zyx_grp / {tb * ta};"]
    per = TILE * TILE // THREADS
    for s in range(per):             # A fastest: the transposed load is coalesced
        e = f"(zyx_tid + {s * THREADS})"
        body += ["  {"] + position(f"{e} % {TILE}", f"{e} / {TILE}")
        body.append(f"      const int zyx_tp = ({e} / {TILE}) * {TILE + 1} + {e} % {TILE};")
        body += ["    " + line for line in r.lines]
        body += ["    }", "  }"]
    body.append(f"  {dl.barrier()};")
    for s in range(per):             # B fastest: the store is coalesced
        e = f"(zyx_tid + {s * THREADS})"
        local = dict(names)
        body += ["  {"] + position(f"{e} / {TILE}", f"{e} % {TILE}")
        body += value_lines(dl, ops, [st[3]], local, narrow, "      ")
        body.append(f"      {names[st[2]]}[{local[st[3]]}] = "
                    f"zyx_tile[({e} % {TILE}) * {TILE + 1} + {e} / {TILE}];")
        body += ["    }", "  }"]
    src = (f"{dl.kernel_prefix} {name}({', '.join(kernel_params(kernel, dl, r))}) {{\n" +
           "\n".join(body) + "\n}\n")
    args = [("arg", i) for i in range(len(kernel.args))]
    g = GPUKernel(dl.prelude + src, [Launch(name, groups, THREADS, args)], (), "transpose",
                  32 if narrow else 64)
    g.variant = {"tile": TILE, "a": ops[p.a][2], "b": ops[p.b][2]}
    return g
