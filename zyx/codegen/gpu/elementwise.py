"""The "elementwise" GPU strategy (kernels without loops): each group takes a tile of
consecutive outputs, each work-item several steps of several elements, read and written as
vectors where every access allows it; a guarded scalar loop for the ragged last tile.
Knobs: ZYX_GPU_EW (`elementwise_variant`)."""
from __future__ import annotations

from ..._core import kernel as K
from ..cstyle import INDEX32, Frame, render_body
from .analysis import narrow_index, output_size
from .program import (GPUKernel, Launch, decode_indices, device_threads, entry_source,
                      kernel_params, local_size_for, read_variant)


EW_ENV = "ZYX_GPU_EW"


# items: vector steps per work-item (a group's tile is local * items * vec elements);
# vec: consecutive elements per step, read and written as vectors of up to 16 bytes when
# every access allows it; local: work-items per group; waves: 0 = one group per tile,
# else a grid of `waves` times the groups the device holds at once, each group striding
# over the tiles.
EW_DEFAULT = {"items": 4, "vec": 4, "local": 256, "waves": 0}


EW_LIMITS = {"items": 16, "vec": 16, "local": 1024}


# The body is written once per element of a step (items * vec copies: lanes of vectors
# are named, not indexed): at most this many IR ops in all, so a big fused kernel does not
# make NVRTC compile thousands of copies (its steps shrink instead).
EW_MAX_OPS = 4096


def elementwise_variant(spec=None):
    """{items, vec, local, waves} of the elementwise strategy: EW_DEFAULT updated by `spec`
    (default: the ZYX_GPU_EW environment variable, e.g. "items=2,vec=4,local=512,waves=4")."""
    return read_variant(EW_ENV, EW_DEFAULT, EW_LIMITS, spec)


def _affine(ops, ssa, memo):
    """An index expression as (constant, {INDEX ssa: coefficient}) when it is affine in
    the INDEX variables (+, -, * by a constant; / and % of constants only), else None."""
    if ssa in memo:
        return memo[ssa]
    op = ops[ssa]
    c = op[0]
    r = None
    if c == K.CONST and not op[1].is_float and not op[1].is_bool:
        r = (int(op[2]), {})
    elif c == K.INDEX:
        r = (0, {ssa: 1})
    elif c == K.BINARY and not op[1].is_float and op[2] in (K.B_ADD, K.B_SUB, K.B_MUL,
                                                             K.B_DIV, K.B_MOD):
        a, b = _affine(ops, op[3], memo), _affine(ops, op[4], memo)
        if a is not None and b is not None:
            bop = op[2]
            if bop in (K.B_ADD, K.B_SUB):
                sign = 1 if bop == K.B_ADD else -1
                coef = dict(a[1])
                for k, v in b[1].items():
                    coef[k] = coef.get(k, 0) + sign * v
                r = (a[0] + sign * b[0], {k: v for k, v in coef.items() if v})
            elif bop == K.B_MUL and (not a[1] or not b[1]):
                k, (c0, coef) = (a[0], b) if not a[1] else (b[0], a)
                r = (k * c0, {x: k * v for x, v in coef.items()} if k else {})
            elif not a[1] and not b[1] and b[0] != 0:      # constants: C's / and %
                q = abs(a[0]) // abs(b[0]) * (1 if (a[0] < 0) == (b[0] < 0) else -1)
                r = (q, {}) if bop == K.B_DIV else (a[0] - q * b[0], {})
    memo[ssa] = r
    return r


def elementwise_accesses(ops, lanes):
    """How an elementwise kernel's global loads and stores move along the flat output
    index: (flat, coalesced). `flat` maps each access at `flat index + c` (c a multiple of
    `lanes`, loads unmasked) to c: those are read and written `lanes` elements at a time.
    `coalesced`: every other access reads, along the innermost output axis, the same or
    the next element (a broadcast, a row of a bias), so giving a work-item several
    consecutive elements keeps neighbouring memory together; False for strided, gathered
    or masked-and-strided accesses and for kernels with an IF (a store that may not run)."""
    idx = [(i, op[3]) for i, op in enumerate(ops) if op[0] == K.INDEX]
    strides, stride = {}, 1
    for ssa, length in reversed(idx):
        if length > 1:
            strides[ssa] = stride
        stride *= length
    inner = next((ssa for ssa, length in reversed(idx) if length > 1), None)
    if inner is None or any(op[0] == K.IF_OP for op in ops):
        return {}, False
    flat, coalesced, memo = {}, True, {}
    for i, op in enumerate(ops):
        if op[0] not in (K.LOAD, K.STORE) or ops[op[2]][2] != K.SCOPE_GLOBAL:
            continue
        aff = _affine(ops, op[3], memo)
        if aff is None:
            coalesced = False
            continue
        const, coef = aff
        coef = {k: v for k, v in coef.items() if k in strides}     # unit axes: index 0
        masked = op[0] == K.LOAD and op[4] >= 0
        if not masked and coef == strides and const % lanes == 0:
            flat[i] = const
        elif coef.get(inner, 0) not in (0, 1):
            coalesced = False
    return flat, coalesced


def _chunk(d, lanes):
    """Lanes per vector of dtype d: at most 4 (CUDA's widest vectors) and 16 bytes."""
    return max(min(lanes, 4, 16 // d.itemsize), 1)


class LaneFrame(Frame):
    """One element of an elementwise step: the accesses in `lane` read or write a lane of
    the step's vectors instead of the buffer."""

    def __init__(self, narrow, lane):
        self.narrow = narrow
        self.lane = lane

    def access(self, i, buf, index):
        e = self.lane.get(i)
        return e if e is not None else f"{buf}[{index}]"


def _indented(lines, ind):
    return [ind + x for x in lines]


def lower_elementwise(kernel, dl, info, name, variant=None):
    """The "elementwise" strategy: each group takes a tile of `local * items * vec`
    consecutive outputs; a work-item's step k covers the `vec` elements from
    `(k * local + lid) * vec` of the tile, so each step's accesses are coalesced over the
    group. The loads at the flat index (plus a constant) are issued for every step
    before any arithmetic (as vectors when vec > 1: float4 and the like, 16 bytes at
    most), then each element's body runs with those lanes for operands, and the results
    are stored as vectors. Full tiles whose vector pointers are aligned take this path;
    the ragged last tile and misaligned buffers (a borrowed DLPack view) run one element
    per work-item and iteration, guarded."""
    ops = kernel.ops
    n = output_size(ops)
    var = variant if variant is not None else elementwise_variant()
    local = local_size_for(info, var["local"])
    nops = max(len(ops), 1)
    lanes = var["vec"]
    while lanes > 1 and lanes * nops > EW_MAX_OPS:
        lanes //= 2
    flat, coalesced = elementwise_accesses(ops, lanes)
    if lanes > 1 and not (coalesced and flat):
        lanes = 1
        flat, _ = elementwise_accesses(ops, 1)
    if lanes == 1:     # scalars: only loads are hoisted; stores stay in the body
        flat = {i: c for i, c in flat.items() if ops[i][0] == K.LOAD}
    items = var["items"]
    while items > 1 and items * lanes * nops > EW_MAX_OPS:
        items //= 2
    fill = max(device_threads(info) // local, 1)     # groups the device holds at once
    while items > 1 and -(-n // (local * items * lanes)) < fill:
        items //= 2        # too few tiles to fill the device: smaller ones
    tile = local * items * lanes
    tiles = max(-(-n // tile), 1)
    groups = min(tiles, var["waves"] * fill) if var["waves"] else tiles
    narrow = narrow_index(ops, [groups * local, tiles * tile + tile])
    t = INDEX32 if narrow else dl.int64
    gq = dl.global_qualifier

    r, _ = render_body(kernel, dl, frame=LaneFrame(narrow, {}))
    params = kernel_params(kernel, dl, r)
    arg = {i: ops[ops[i][2]][3] for i in flat}       # access -> its buffer's argument

    def dtype_of(i):
        return ops[i][1] if ops[i][0] == K.LOAD else ops[ops[i][2]][1]

    def offset(i, k, c, cc):
        off = flat[i] + c * cc
        return f"zyx_p{k} + {off}" if off else f"zyx_p{k}"

    fast = []
    for k in range(items):
        first = f"{k * local} + zyx_lid" if k else "zyx_lid"
        if lanes > 1:
            first = f"({first}) * {lanes}"
        fast.append(f"const {t} zyx_p{k} = zyx_base + {first};")
    loads = [i for i in sorted(flat) if ops[i][0] == K.LOAD]
    stores = [i for i in sorted(flat) if ops[i][0] == K.STORE]
    for k in range(items):
        for i in loads:
            d = dtype_of(i)
            cc = _chunk(d, lanes)
            vt = dl.vector_type(d, cc)
            for c in range(lanes // cc):
                at = offset(i, k, c, cc)
                src = (f"*({gq}const {vt}*)(g{arg[i]} + {at})" if lanes > 1
                       else f"g{arg[i]}[{at}]")
                fast.append(f"const {vt} zyx_a{i}_{k}_{c} = {src};")
    for k in range(items):
        for i in stores:
            d = dtype_of(i)
            cc = _chunk(d, lanes)
            fast.append(" ".join(f"{dl.vector_type(d, cc)} zyx_o{i}_{k}_{c};"
                                 for c in range(lanes // cc)))
        for j in range(lanes):
            lane = {}
            for i in flat:
                cc = _chunk(dtype_of(i), lanes)
                comp = "." + "xyzw"[j % cc] if cc > 1 else ""
                lane[i] = f"zyx_{'a' if ops[i][0] == K.LOAD else 'o'}{i}_{k}_{j // cc}{comp}"
            body, _ = render_body(kernel, dl, frame=LaneFrame(narrow, lane))
            fast.append("{")
            fast.append(f"  const {t} zyx_gid = zyx_p{k}" + (f" + {j};" if j else ";"))
            fast += decode_indices(ops, t, "zyx_gid") + body.lines
            fast.append("}")
        for i in stores:
            d = dtype_of(i)
            cc = _chunk(d, lanes)
            vt = dl.vector_type(d, cc)
            for c in range(lanes // cc):
                fast.append(f"*({gq}{vt}*)(g{arg[i]} + {offset(i, k, c, cc)}) = "
                            f"zyx_o{i}_{k}_{c};")

    conds = [] if n % tile == 0 else [f"zyx_base + {tile} <= {n}"]
    if lanes > 1:
        need = {}
        for i in flat:
            d = dtype_of(i)
            need[arg[i]] = max(need.get(arg[i], 1), _chunk(d, lanes) * d.itemsize)
        conds += [dl.aligned(f"g{a}", b) for a, b in sorted(need.items())]
    lines = []
    if conds:
        plain, _ = render_body(kernel, dl, frame=LaneFrame(narrow, {}))
        lines.append(f"  if ({' && '.join(conds)}) {{")
        lines += _indented(fast, "    ")
        lines.append("  } else {")
        lines.append(f"    const {t} zyx_end = zyx_base + {tile} < {n} ? zyx_base + {tile} : {n};")
        lines.append(f"    for ({t} zyx_gid = zyx_base + zyx_lid; zyx_gid < zyx_end; "
                     f"zyx_gid += {local}) {{")
        lines += _indented(decode_indices(ops, t, "zyx_gid") + plain.lines, "    ")
        lines.append("    }")
        lines.append("  }")
    else:
        lines += _indented(fast, "  ")
    head = [f"  const {t} zyx_lid = ({t}){dl.local_id(0)};"]
    if var["waves"]:
        head.append(f"  for ({t} zyx_t = ({t}){dl.group_id(0)}; zyx_t < {tiles}; "
                    f"zyx_t += {groups}) {{")
        head.append(f"  const {t} zyx_base = zyx_t * {tile};")
        lines.append("  }")
    else:
        head.append(f"  const {t} zyx_base = ({t}){dl.group_id(0)} * {tile};")
    src = entry_source(dl, name, params, head, lines)
    args = [("arg", i) for i in range(len(kernel.args))]
    g = GPUKernel(dl.prelude + src, [Launch(name, groups, local, args)], (), "elementwise",
                  32 if narrow else 64)
    g.variant = {"items": items, "vec": lanes, "local": local, "waves": var["waves"],
                 "tile": tile, "vector_accesses": len(flat) if lanes > 1 else 0}
    return g
