"""Shared-memory product tiles for the WGSL writer (its "gemm" strategy): matmul, batched
matmul, linear layers and convolutions as implicit GEMM, on WebGPU.

The analysis is the C-family lowering's (`codegen/gpu/gemm.py`, read its docstring):
`plan` finds a reduce kernel shaped like a product and splits its output axes into rows
(read by operand `a` only), cols (read by `b` only, holding the output's innermost axis)
and batch; the reduce loops are one flat K. What this module writes is WGSL:

* A workgroup of TX x TY invocations (16 x 16 = 256 by default) computes a BR x BC tile
  of (rows, cols) for one batch position; each invocation accumulates a TR x TC register
  sub-tile (BR = TY * TR, BC = TX * TC): rows `ty * ca + lane` of every chunk of `ca`
  consecutive rows, chunks TY * ca apart (ca = 4 where TR allows: one vec4 read of
  workgroup memory gives four rows), cols alike with tx. Neighbouring invocations read
  neighbouring workgroup words and store neighbouring outputs.
* Per K step of BK, every invocation copies its share of the BK x BR values of `a` and the
  BK x BC values of `b` into `var<workgroup>` arrays (rows padded by PAD words against
  bank conflicts, 16-byte aligned for the vec4 reads): each value is computed by the
  operand's own ops (its closure in the IR) with the row (or col) and reduce variables
  set to the slot's position, 0 past the ends (a convolution's padded window is its
  guarded load and select, as the kernel writes it). A slot's row/col position is the
  same at every K step: its variables and range test are computed once, before the loop.
  The next step's values are read into registers before this step's products run
  (prefetch), so the global loads are in flight during the arithmetic.
* `workgroupBarrier()` after the copies and after the products, in uniform control flow
  (the K loop's bounds are constants; no invocation returns early).
* Products are written out for the whole K step (no inner loop), as `fma` into vector
  accumulators (vec4 of four cols where TC allows).
* After the K loop each output of the sub-tile runs the kernel's epilogue ops (bias,
  activation, cast) with its own indices and a guarded store through the writer's store
  path (small dtypes: packed u32 words with atomics).

float16/bfloat16 operands are f32 registers in the writer (values of their dtype): their
products are exact in f32 and add into the f32 accumulator, as the kernel's own cast says.
A product over more than PLAIN_K terms (a convolution's weight gradient over batch x
height x width) adds its sub-tile into totals every FOLD_K terms and restarts, so
rounding grows with the block, not with K (the kernelizer makes no blocks on WebGPU:
DeviceInfo.sum_block is unbounded there).

Limits: the workgroup size and workgroup storage the backend read from the adapter
(`Products`), grids over the groups-per-dimension limit folded into 2-D (`writer.fold`),
and lavapipe's loop limit (a K loop of more than LOOP_CHUNK or the device's loop cap
steps is left to the other strategies).

Knobs (read at each write): ZYX_WGSL_GEMM=0 turns the strategy off;
ZYX_WGSL_GEMM_TILE=BRxBCxBK[xTRxTC] forces a tile (TR, TC default to BR/16, BC/16).
"""
from __future__ import annotations

import os
from collections import namedtuple

from ..._core import kernel as K
from ..gpu.gemm import PLAIN_K, closure, flat_decode_exprs, plan
from .writer import LOOP_CHUNK, PRELUDE, WGSLKernel, fold, literal

GEMM_ENV = "ZYX_WGSL_GEMM"
TILE_ENV = "ZYX_WGSL_GEMM_TILE"
SIDE = 16                # invocations along each side of a default workgroup: 256
PAD = 4                  # extra words per workgroup row: copies along K spread over banks,
                         # and rows stay 16-byte aligned for vec4 reads
FOLD_K = 256             # K terms added into the sub-tile before it folds into its totals
                         # (products over more than PLAIN_K terms)
# (rows, cols, K step) per workgroup tried largest first, TR x TC = rows/16 x cols/16
TILES = ((128, 128, 8), (128, 64, 8), (64, 128, 8), (64, 64, 16), (64, 32, 16),
         (32, 64, 16), (32, 32, 16))
# WebGPU reports no compute-unit count: the largest tile whose groups reach this many is
# taken (an H100 has 132 SMs; fewer groups leave units idle). A CPU adapter counts its
# host's cores.
GPU_UNITS = 128
# A product with too few outputs for even the smallest tile to give every unit a group
# still takes that tile when its K is at most this (its one-invocation-per-output
# alternative would loop over K as long); longer ones go to the writer's row and split
# strategies, which spread K over invocations.
FEW_GROUPS_MAX_K = 4096
# WebGPU's default limits (what a device asked for nothing more gets)
DEFAULT_STORAGE = 16384
DEFAULT_INVOCATIONS = 256


class Tile(namedtuple("Tile", "br bc bk tr tc")):
    """BR x BC outputs per workgroup, K step BK, TR x TC outputs per invocation."""
    __slots__ = ()

    @property
    def threads(self):
        return (self.br // self.tr) * (self.bc // self.tc)

    def storage(self):
        """Bytes of workgroup memory: both f32 operand tiles, one row per K step."""
        return 4 * self.bk * (self.br + PAD + self.bc + PAD)

    def label(self):
        return f"{self.br}x{self.bc}x{self.bk}x{self.tr}x{self.tc}"


def default_tile(br, bc, bk):
    return Tile(br, bc, bk, max(br // SIDE, 1), max(bc // SIDE, 1))


def enabled():
    return os.environ.get(GEMM_ENV, "").strip() != "0"


def parse_tile(spec):
    """The Tile of a ZYX_WGSL_GEMM_TILE value "BRxBCxBK" or "BRxBCxBKxTRxTC"; ValueError
    naming the setting when it is not one."""
    parts = spec.lower().replace(",", "x").split("x")
    try:
        nums = [int(v) for v in parts]
    except ValueError:
        nums = []
    if len(nums) not in (3, 5) or any(v < 1 for v in nums):
        raise ValueError(f"{TILE_ENV}={spec!r}: expected BRxBCxBK or BRxBCxBKxTRxTC "
                         f"(positive integers, e.g. 128x128x8 or 64x64x16x4x4)")
    if len(nums) == 3 and (nums[0] % SIDE or nums[1] % SIDE):
        raise ValueError(f"{TILE_ENV}={spec!r}: BR and BC must be multiples of {SIDE} "
                         f"(a {SIDE}x{SIDE} workgroup) unless TR and TC are given")
    t = default_tile(*nums) if len(nums) == 3 else Tile(*nums)
    if t.br % t.tr or t.bc % t.tc:
        raise ValueError(f"{TILE_ENV}={spec!r}: TR must divide BR and TC divide BC")
    return t


class Products:
    """The gemm strategy for one device: `products(kernel, writer, max_groups)` is the
    WGSLKernel of a product kernel, None for kernels it leaves to the other strategies.
    `storage`: workgroup memory bytes (maxComputeWorkgroupStorageSize), `invocations`:
    per workgroup (maxComputeInvocationsPerWorkgroup and the x size), `units`: groups
    wanted to fill the device, `loop_cap`: the driver's loop limit (0: none), `tile`: a
    forced Tile (ValueError at write when the device cannot run it)."""

    def __init__(self, storage=DEFAULT_STORAGE, invocations=DEFAULT_INVOCATIONS,
                 units=GPU_UNITS, loop_cap=0, tile=None):
        self.storage = storage
        self.invocations = invocations
        self.units = max(int(units), 1)
        self.loop_cap = loop_cap
        self.tile = tile

    def fits(self, tile):
        return tile.threads <= self.invocations and tile.storage() <= self.storage

    def choose(self, p):
        """The Tile for plan `p` (None: leave the kernel to the other strategies)."""
        if self.tile is not None:
            if not self.fits(self.tile):
                raise ValueError(
                    f"{TILE_ENV}={self.tile.label()}: {self.tile.threads} invocations and "
                    f"{self.tile.storage()} bytes of workgroup memory, the device allows "
                    f"{self.invocations} and {self.storage}")
            return self.tile
        fitting = [t for t in (default_tile(*s) for s in TILES) if self.fits(t)]
        for t in fitting:
            if t.br > max(p.nr, 2 * SIDE) or t.bc > max(p.nc, 2 * SIDE):
                continue             # a tile larger than the product: idle invocations
            if p.nb * -(-p.nr // t.br) * -(-p.nc // t.bc) >= self.units:
                return t
        if fitting and p.nk <= FEW_GROUPS_MAX_K:
            return fitting[-1]
        return None

    def plan_tile(self, ops):
        """(GemmPlan, Tile) of a kernel's ops, or None."""
        p = plan(ops)
        if p is None:
            return None
        tile = self.choose(p)
        if tile is None:
            return None
        steps = -(-p.nk // tile.bk)
        if steps > LOOP_CHUNK or (self.loop_cap and steps > self.loop_cap):
            return None
        return p, tile

    def __call__(self, kernel, w, max_groups):
        found = self.plan_tile(kernel.ops)
        if found is None:
            return None
        return write_gemm(w, found[0], found[1], max_groups)


def products(limits=None, units=GPU_UNITS, loop_cap=0, tile=None):
    """The Products of a device with adapter `limits` (the backend's dict; None: WebGPU's
    defaults), or None when ZYX_WGSL_GEMM=0. `tile`: a Tile (the autotuner's), else
    ZYX_WGSL_GEMM_TILE's, else chosen per kernel."""
    if not enabled():
        return None
    limits = limits or {}
    if tile is None:
        spec = os.environ.get(TILE_ENV, "").strip()
        tile = parse_tile(spec) if spec else None
    inv = min(limits.get("max-compute-invocations-per-workgroup", DEFAULT_INVOCATIONS),
              limits.get("max-compute-workgroup-size-x", DEFAULT_INVOCATIONS))
    return Products(limits.get("max-compute-workgroup-storage-size", DEFAULT_STORAGE), inv,
                    units, loop_cap, tile)


def candidates(ops, prod):
    """Tiles of TILES other than the chosen one that `prod` (a Products) can run for a
    product kernel's ops, for the autotuner; [] for other kernels."""
    found = prod.plan_tile(ops) if prod is not None else None
    if found is None:
        return []
    return [t for t in (default_tile(*s) for s in TILES)
            if t != found[1] and prod.fits(t)]


class GemmKernel(WGSLKernel):
    """A WGSLKernel of the gemm strategy, with the Tile it was written with."""
    __slots__ = ("tile",)

    def __init__(self, passes, nargs, strategy, threads, iterations=0, tile=None):
        super().__init__(passes, nargs, strategy, threads, iterations=iterations)
        self.tile = tile


# -- writing ----------------------------------------------------------------------------------

_VEC = {1: "f32", 2: "vec2<f32>", 4: "vec4<f32>"}
_LANES = "xyzw"


def _chunk(t):
    """Lanes of the vectors a side's workgroup reads and accumulators use (4, 2 or 1)."""
    return 4 if t % 4 == 0 else 2 if t % 2 == 0 else 1


def _decode(ops, names, ids, flat, ind):
    """Lines naming INDEX (or LOOP) ids `ids` (names[i]) from a flat row-major i32
    position `flat`."""
    return [f"{ind}let {names[i]}: i32 = {e};" for i, e in flat_decode_exprs(ops, ids, flat)]


class _Side:
    """One operand's copy into its workgroup tile."""

    def __init__(self, name, p, tile, val, ids, extent, kfast):
        self.name = name                         # "a" (rows) or "b" (cols)
        self.val = val
        self.ids = ids
        self.extent = extent
        self.kfast = kfast
        self.length = tile.br if name == "a" else tile.bc
        self.lanes = _chunk(tile.tr if name == "a" else tile.tc)
        self.stride = self.length + PAD          # words per K row of the tile
        self.origin = "zyx_r0" if name == "a" else "zyx_c0"
        self.count = self.length * tile.bk
        self.slots = -(-self.count // tile.threads)
        self.ragged = self.count % tile.threads != 0

    def array(self, bk):
        # one inner array per K row: the products index the K row by a constant, so the
        # bounds clamp WebGPU puts on dynamic indices is on the row offset alone, the same
        # at every K row (computed once, not once per read)
        return (f"var<workgroup> zyx_l{self.name}: array<array<{_VEC[self.lanes]}, "
                f"{self.stride // self.lanes}>, {bk}>;")


def write_gemm(w, p, tile, max_groups):
    """The WGSLKernel of plan `p` with Tile `tile`; `w` is the writer's walker of the
    kernel (writer._Writer: its value, load and store spellings, buffer declarations)."""
    ops = w.ops
    br, bc, bk, tr, tc = tile
    tx_n, ty_n = bc // tc, br // tr
    threads = tile.threads
    for i, op in enumerate(ops):
        c = op[0]
        if c == K.CONST:
            w.names[i] = literal(op[1], op[2])
        elif c == K.DEFINE and op[2] == K.SCOPE_GLOBAL:
            w.names[i] = f"g{op[3]}"
        elif c == K.INDEX:
            w.names[i] = f"i{i}"
        elif c == K.LOOP:
            w.names[i] = f"r{i}"
    gr, gc = -(-p.nr // br), -(-p.nc // bc)
    groups = p.nb * gr * gc
    grid = fold(groups, max_groups)
    ca, cb = _chunk(tr), _chunk(tc)
    sides = [_Side("a", p, tile, p.a, p.rows, p.nr, p.a_kfast),
             _Side("b", p, tile, p.b, p.cols, p.nc, p.b_kfast)]
    body = [f"  let zyx_grp: i32 = i32(wid.y * {grid[0]}u + wid.x);",
            "  let zyx_tid: i32 = i32(lid.x);",
            f"  let zyx_tx: i32 = zyx_tid % {tx_n};",
            f"  let zyx_ty: i32 = zyx_tid / {tx_n};",
            f"  let zyx_r0: i32 = ((zyx_grp / {gc}) % {gr}) * {br};",
            f"  let zyx_c0: i32 = (zyx_grp % {gc}) * {bc};"]
    # padding groups of a folded grid compute a wrapped tile and store nothing; they
    # still reach every barrier
    live = grid[0] * grid[1] != groups
    if live:
        body.append(f"  let zyx_live: bool = zyx_grp < {groups};")
    if p.batch:
        body += _decode(ops, w.names, p.batch, f"(zyx_grp / {gc * gr})", "  ")
    fold_k = p.nk > PLAIN_K
    acc_t = _VEC[cb]
    zero = f"{acc_t}(0.0f)"
    for i in range(tr):
        for c in range(tc // cb):
            body.append(f"  var zyx_s{i}_{c}: {acc_t} = {zero};")
            if fold_k:
                body.append(f"  var zyx_t{i}_{c}: {acc_t} = {zero};")
    # each slot's position in its tile, range test and row (col) variables: the same at
    # every K step
    for sd in sides:
        for s in range(sd.slots):
            e = f"(zyx_tid + {s * threads})"
            if sd.kfast:
                kk, mm = f"({e} % {bk})", f"({e} / {bk})"
            else:
                kk, mm = f"({e} / {sd.length})", f"({e} % {sd.length})"
            pre = f"zyx_{sd.name}{s}"
            tests = [f"{e} < {sd.count}"] if sd.ragged else []
            if sd.extent % sd.length:     # (else every tile lies inside the product)
                tests.append(f"{sd.origin} + {pre}m < {sd.extent}")
            body += [f"  let {pre}k: i32 = {kk};",
                     f"  let {pre}m: i32 = {mm};",
                     f"  let {pre}ok: bool = {' && '.join(tests) or 'true'};"]
            body += _decode(ops, {i: f"{pre}_{w.names[i]}" for i in sd.ids}, sd.ids,
                            f"({sd.origin} + {pre}m)", "  ")
            body.append(f"  var zyx_p{sd.name}{s}: f32;")

    def copies(k0, ind):
        out = []
        for sd in sides:
            for s in range(sd.slots):
                pre = f"zyx_{sd.name}{s}"
                reg = f"zyx_p{sd.name}{s}"
                inner = ind + "  "
                test = [f"{pre}ok"]
                if p.nk % bk:             # (else no K step reaches past the end)
                    test.append(f"{k0} + {pre}k < {p.nk}")
                out += [f"{ind}{reg} = 0.0f;",
                        f"{ind}if ({' && '.join(test)}) {{"]
                out += [f"{inner}let {w.names[i]}: i32 = {pre}_{w.names[i]};"
                        for i in sd.ids]
                out += _decode(ops, w.names, p.loops, f"({k0} + {pre}k)", inner)
                for j in closure(ops, [sd.val] + p.masks):
                    out.append(w.value(j, ops[j], inner))
                v = w.names[sd.val]
                for m in p.masks:
                    v = f"select(0.0f, {v}, {w.names[m]})"
                out += [f"{inner}{reg} = {v};", f"{ind}}}"]
        return out

    def stores(ind):
        out = []
        for sd in sides:
            for s in range(sd.slots):
                pre = f"zyx_{sd.name}{s}"
                dst = f"zyx_l{sd.name}[{pre}k]"
                if sd.lanes == 1:
                    dst += f"[{pre}m]"
                else:
                    dst += f"[{pre}m / {sd.lanes}][{pre}m % {sd.lanes}]"
                line = f"{dst} = zyx_p{sd.name}{s};"
                out.append(f"{ind}if ({pre}ok) {{ {line} }}" if sd.ragged else ind + line)
        return out

    def products(ind):
        out = []
        for q in range(bk):
            for c in range(tr // ca):
                out.append(f"{ind}let zyx_a{q}_{c} = zyx_la[{q}][{c * ty_n} + zyx_ty];")
            for c in range(tc // cb):
                out.append(f"{ind}let zyx_b{q}_{c} = zyx_lb[{q}][{c * tx_n} + zyx_tx];")
            for i in range(tr):
                a = f"zyx_a{q}_{i // ca}" + (f".{_LANES[i % ca]}" if ca > 1 else "")
                if cb > 1:
                    a = f"{acc_t}({a})"
                for c in range(tc // cb):
                    out.append(f"{ind}zyx_s{i}_{c} = fma({a}, zyx_b{q}_{c}, zyx_s{i}_{c});")
        return out

    steps = -(-p.nk // bk)
    body += copies("0", "  ")
    body.append(f"  for (var zyx_k0: i32 = 0; zyx_k0 < {p.nk}; zyx_k0 += {bk}) {{")
    body += stores("    ")
    body.append("    workgroupBarrier();")
    if steps > 1:
        body.append(f"    if (zyx_k0 + {bk} < {p.nk}) {{")
        body.append(f"      let zyx_kn: i32 = zyx_k0 + {bk};")
        body += copies("zyx_kn", "      ")
        body.append("    }")
    body.append("    {")
    body += products("      ")
    body.append("    }")
    body.append("    workgroupBarrier();")
    if fold_k:
        every = max(FOLD_K // bk, 1)
        body.append(f"    if ((zyx_k0 / {bk} + 1) % {every} == 0) {{")
        for i in range(tr):
            for c in range(tc // cb):
                body.append(f"      zyx_t{i}_{c} = zyx_t{i}_{c} + zyx_s{i}_{c}; "
                            f"zyx_s{i}_{c} = {zero};")
        body.append("    }")
    body.append("  }")
    body += _epilogue(w, p, ca, cb, tr, tc, tx_n, ty_n, fold_k, live)
    decls = [sd.array(bk) for sd in sides]
    src = "\n".join([*w.declarations(), *decls, PRELUDE,
                     f"@compute @workgroup_size({threads})",
                     "fn main(@builtin(workgroup_id) wid: vec3<u32>, "
                     "@builtin(local_invocation_id) lid: vec3<u32>) {",
                     *body, "}", ""])
    return GemmKernel([(src, grid)], len(w.kernel.args), "gemm", groups * threads,
                      iterations=steps, tile=tile)


def _epilogue(w, p, ca, cb, tr, tc, tx_n, ty_n, fold_k, live):
    """Every output of the invocation's sub-tile: its row and col variables, the kernel's
    ops after the reduce (the accumulator's loads named by the sub-tile's value) and its
    guarded store."""
    ops = w.ops
    result = p.total if p.total is not None else p.acc
    res_loads = [j for j, op in enumerate(ops)
                 if j > p.end and op[0] == K.LOAD and op[2] == result]
    st = ops[p.store]
    roots = [st[4]] + ([st[3]] if st[3] >= 0 else [])
    out = []
    for i in range(tr):
        row = f"zyx_r0 + {(i // ca) * ty_n * ca + i % ca} + zyx_ty * {ca}"
        for j in range(tc):
            col = f"zyx_c0 + {(j // cb) * tx_n * cb + j % cb} + zyx_tx * {cb}"
            acc = f"zyx_s{i}_{j // cb}" + (f".{_LANES[j % cb]}" if cb > 1 else "")
            if fold_k:
                acc = f"(zyx_t{i}_{j // cb}" + (f".{_LANES[j % cb]}" if cb > 1 else "") + \
                      f" + {acc})"
            ind = "      "
            test = f"zyx_x < {p.nr} && zyx_y < {p.nc}"
            out += ["  {", f"    let zyx_x: i32 = {row};", f"    let zyx_y: i32 = {col};",
                    f"    if ({'zyx_live && ' if live else ''}{test}) {{"]
            out += _decode(ops, w.names, p.rows, "zyx_x", ind)
            out += _decode(ops, w.names, p.cols, "zyx_y", ind)
            for q in res_loads:
                w.names[q] = acc
            for q in closure(ops, roots):
                if q not in res_loads:
                    out.append(w.value(q, ops[q], ind))
            index = w.names[st[3]] if st[3] >= 0 else "0"
            out += w.store_global(st[2], index, w.names[st[4]], ind)
            out += ["    }", "  }"]
    return out
