"""Shared-memory product tiles for the SPIR-V writer (Vulkan): matmul, batched matmul,
linear layers and convolutions as implicit GEMM, written as SPIR-V words.

The analysis is the C-family lowering's (`codegen/gpu/gemm.py`, read its docstring):
`plan` finds the rows, cols and batch axes of a product kernel, its reduce loops (one
flat K), the operands `a` (rows side) and `b` (cols side), masks, the accumulator, block
totals and the store; `choose_tile` picks BR x BC x BK. This module writes the tiled
kernel for that plan, reusing the SPIR-V writer's walk (`writer.KernelWriter`) for every
value: each operand value is the kernel's own op closure evaluated with the index
variables set to the slot's (row or col, k) position, so a convolution's padded window
(guarded loads and selects) is copied as the kernel computes it.

Layout: 256 invocations (16 x 16) per workgroup, one BR x BC tile of (rows, cols) per
group for one batch position; invocation (tx, ty) accumulates a TR x TC sub-tile
(TR = BR / 16, TC = BC / 16; rows ty * c + 16 c i' + .., cols likewise with tx: chunks of
c = min(T, 4) neighbours, read from workgroup memory as one c-vector). Per K step of BK:
- every invocation stores its share of both operand tiles (BK x (BR + PAD) and
  BK x (BC + PAD) in `Workgroup` arrays, K-major, padded rows against bank conflicts)
  from registers; the values were computed one step ahead (prefetch: the global loads of
  step k + 1 are issued before step k's products, so they overlap), 0 past the ends;
- `OpControlBarrier` (Workgroup scope, WorkgroupMemory | AcquireRelease) in uniform
  control flow: the loop's trip count and the group test are the same for the group;
- the products from workgroup memory into the sub-tile's accumulators; a barrier.
16-bit operands (float16, bfloat16) are held as float32 (their exact values) and
multiplied in float32 into a float32 accumulator, as the serial strategy does. Products
over more than gpu.gemm.PLAIN_K terms with block totals add the sub-tile into totals
every block of K, as the C-family tiles do. After the K loop every output of the
sub-tile runs the kernel's epilogue (bias, activation, cast) and its guarded store.

Knobs (read at each compile, for benchmark sweeps): ZYX_VK_GEMM=0 turns the strategy off
(also the kernelizer's `own_tiles`, at device start), =1 on for CPU drivers too (off by
default there: `enabled`), ZYX_VK_GEMM_TILE=BRxBCxBK forces a
tile (BR and BC of 16, 32, 64, 128; TR = BR / 16 and TC = BC / 16 follow), ZYX_VK_GEMM_PREFETCH=0 copies
each step's values at its start instead of one step ahead.
"""
from __future__ import annotations

import os

from ... import dtype as dt
from ..._core import kernel as K
from ..cstyle import half_rounds
from ..gpu import gemm as G
from .writer import KernelWriter, SpirvKernel, uses_dtypes

GEMM_ENV = "ZYX_VK_GEMM"
TILE_ENV = "ZYX_VK_GEMM_TILE"
PREFETCH_ENV = "ZYX_VK_GEMM_PREFETCH"
SIDE = G.SIDE                 # invocations along each side of a group
THREADS = SIDE * SIDE
PAD = G.PAD                   # extra words per K row of a local tile
# rows or cols per group: TR, TC of 1, 2, 4 or 8 (at most 64 accumulators; whole chunks
# of min(T, 4) neighbours, see gpu.gemm._positions)
SIDES = (16, 32, 64, 128)
INDEX_LIMIT = 1 << 31         # positions are computed in 32-bit unsigned math


def enabled(info):
    """Whether the strategy may take products on the device `info`: ZYX_VK_GEMM=0 no,
    =1 yes, unset (or a forced tile) yes except on CPU drivers (lavapipe), where 256
    invocations meeting at barriers run as coroutines: 128^2 float32 took 124 ms tiled
    against 25 ms serial (llvmpipe, 2 cores)."""
    flag = os.environ.get(GEMM_ENV, "").strip()
    if flag == "0":
        return False
    return flag == "1" or bool(os.environ.get(TILE_ENV, "").strip()) or \
        not info.extra.get("cpu")


def forced_tile():
    """The tile ZYX_VK_GEMM_TILE forces ((BR, BC, BK)), or None."""
    spec = os.environ.get(TILE_ENV, "").strip()
    if not spec:
        return None
    try:
        tile = tuple(int(v) for v in spec.lower().split("x"))
    except ValueError:
        tile = ()
    if len(tile) != 3:
        raise ValueError(f"{TILE_ENV}={spec!r}: expected BRxBCxBK, e.g. 128x128x8")
    check_tile(tile, f"{TILE_ENV}={spec!r}")
    return tile


def check_tile(tile, what="gemm tile"):
    br, bc, bk = tile
    if any(v not in SIDES for v in (br, bc)):
        raise ValueError(f"{what}: rows and cols must be one of {SIDES}")
    if not 1 <= bk <= 64:
        raise ValueError(f"{what}: the K step must be 1 to 64")


def local_bytes(p, tile):
    """Workgroup memory of the two tiles (the values are held at their register width:
    16-bit operands as float32)."""
    br, bc, bk = tile
    size = 8 if p.dtype is dt.float64 and p.narrow is None else 4
    return bk * (br + bc + 2 * PAD) * size


def choose(ops, info, schedule=None):
    """(GemmPlan, (BR, BC, BK)) where the gemm strategy takes a kernel of `ops` on the
    device `info`, else None. `schedule` {"gemm": (BR, BC, BK)} (the autotuner's) or
    ZYX_VK_GEMM_TILE force a tile of a kernel `plan` accepts; without them the tile is
    `gpu.gemm.choose_tile`'s (None when too few groups would fill the device)."""
    if not enabled(info) or (info.max_local_threads or 0) < THREADS:
        return None
    p = G.plan(ops)
    if p is None:
        return None
    tile = schedule.get("gemm") if schedule else None
    if tile is not None:
        tile = tuple(tile)
        check_tile(tile)
    else:
        tile = forced_tile() or G.choose_tile(p, info)
    if tile is None:
        return None
    br, bc, bk = tile
    if info.local_mem_size and local_bytes(p, tile) > info.local_mem_size:
        return None
    if max(p.nr + br, p.nc + bc, p.nk + 2 * bk, p.nb * THREADS) >= INDEX_LIMIT:
        return None
    # (llvmpipe ends an invocation's loops after `loop_limit` iterations in all)
    limit = info.extra.get("loop_limit")
    if limit is not None and -(-p.nk // bk) > limit:
        return None
    return p, tile


def wanted(ops, info):
    """True where the Vulkan device `info` tiles the kernel itself (DeviceInfo.own_tiles:
    the kernelizer gives it no register tiles)."""
    return choose(ops, info) is not None


def own_tiles(info):
    """DeviceInfo.own_tiles of a Vulkan device (None where the strategy is off when the
    device starts: the kernelizer and nn.functional then treat it as before)."""
    if not enabled(info):
        return None
    return lambda ops: wanted(ops, info)


def candidates(kernel, info):
    """[(label, schedule)] the autotuner may time for a gemm kernel (the default first),
    or None when the gemm strategy does not take `kernel`."""
    got = choose(kernel.ops, info)
    if got is None:
        return None
    p, tile = got
    out = [("default", None)]
    for t in G.TILES:
        if t != tuple(tile) and not (info.local_mem_size and
                                     local_bytes(p, t) > info.local_mem_size):
            out.append((f"gemm:{t[0]}x{t[1]}x{t[2]}", {"gemm": t}))
    return out


def write_gemm(kernel, p, tile, fp64=True, float_controls=()):
    """The SpirvKernel of `kernel` tiled as plan `p` says with tile (BR, BC, BK)."""
    w = GemmWriter(kernel, p, tile, fp64, float_controls)
    words = w.write()
    return SpirvKernel(words, THREADS, w.n_groups, "gemm", 1, uses_dtypes(kernel))


class GemmWriter(KernelWriter):
    """The tiled kernel's writer; coopmat.py extends it (its copies of the operand
    tiles: `slots`, `copy_values`, and the value helpers)."""

    def __init__(self, kernel, p, tile, fp64, float_controls, threads=THREADS):
        # "serial": each invocation stores its own outputs (no lane-0 store guard)
        super().__init__(kernel, "serial", threads, 1, None, None, fp64, float_controls)
        self.threads = threads      # invocations per workgroup sharing the copies
        self.p = p
        self.br, self.bc, self.bk = tile
        self.tr, self.tc = self.br // SIDE, self.bc // SIDE
        self.gr, self.gc = -(-p.nr // self.br), -(-p.nc // self.bc)
        self.n_groups = p.nb * self.gr * self.gc
        self.mul_dtype = p.narrow or p.dtype
        self.fold = bool(p.block) and p.nk > G.PLAIN_K
        self.prefetch = os.environ.get(PREFETCH_ENV, "1").strip() != "0"
        self.rounds = half_rounds(self.ops)

    # -- helpers -----------------------------------------------------------------------
    def uop(self, name, a, b):
        """u32 arithmetic of value ids a and b."""
        return self.m.op(name, self.u32(), a, b)

    def uk(self, name, a, v):
        """u32 arithmetic of value id a and the constant v (a Python int)."""
        return self.m.op(name, self.u32(), a, self.c_u32(v))

    def ult(self, a, v):
        """a < v, unsigned, v a Python int."""
        return self.m.op("ULessThan", self.boolt(), a, self.c_u32(v))

    def decode(self, ids, flat):
        """Each INDEX (or LOOP) id of `ids` from the flat row-major position `flat`."""
        stride = 1
        for k, i in enumerate(reversed(ids)):
            op = self.ops[i]
            length = op[3] if op[0] == K.INDEX else op[2]
            e = flat if stride == 1 else self.uk("UDiv", flat, stride)
            if k != len(ids) - 1:
                e = self.uk("UMod", e, length)
            self.set_index(i, e)
            stride *= length

    def values(self, roots, skip=()):
        """Emit the ops `roots` are computed from (their closure) with the index
        variables as they are set now; each call emits them anew (an earlier call's
        values may not dominate this block)."""
        for j in G.closure(self.ops, roots):
            if j in skip:
                continue
            op = self.ops[j]
            if op[0] == K.LOAD:
                self.val[j] = self.load(j, op)
            else:
                x = self.alu(j, op)
                if j in self.rounds and op[0] != K.CAST:
                    x = self.round16(op[1], x)
                self.val[j] = x

    def guarded(self, cond, compute, t, zero):
        """compute() (a value id of type t) where `cond` holds, else `zero`: an
        if-block around the computation, so nothing outside the ranges is read (the
        value travels through a function variable, which drivers keep in a register)."""
        m = self.m
        var = m.function_variable(m.type_pointer("Function", t))
        m.emit("Store", var, zero)
        self.open_if(cond)
        m.emit("Store", var, compute())
        self.close_if()
        return m.op("Load", t, var)

    # -- the local tiles ---------------------------------------------------------------
    def tile_array(self, length, chunk):
        """A Workgroup array of `length` values read as `chunk`-vectors: (variable,
        pointer-to-value type, pointer-to-vector type, vector type, width)."""
        m = self.m
        t = self.tile_t
        w = chunk if chunk in (2, 4) else 1
        vt = m.type_vector(t, w) if w > 1 else t
        arr = m.type_array(vt, length // w)
        var = m.global_variable(m.type_pointer("Workgroup", arr), "Workgroup")
        return var, m.type_pointer("Workgroup", t), m.type_pointer("Workgroup", vt), vt, w

    def tile_ptr(self, tile, index):
        """Pointer to value `index` (u32) of a local tile."""
        var, eptr, _, _, w = tile
        if w == 1:
            return self.m.op("AccessChain", eptr, var, index)
        shift = w.bit_length() - 1
        return self.m.op("AccessChain", eptr, var, self.uk("ShiftRightLogical", index, shift),
                         self.uk("BitwiseAnd", index, w - 1))

    # -- copies --------------------------------------------------------------------------
    def slots(self, side):
        """(slot, flat copy index e, K offset kk, row/col offset mm, ragged) of this
        invocation's copies of one operand tile (the K offset the faster one where the
        operand is contiguous along K: consecutive invocations read consecutive words)."""
        length = self.br if side == "a" else self.bc
        kfast = self.p.a_kfast if side == "a" else self.p.b_kfast
        per = length * self.bk
        fast = self.bk if kfast else length
        out = []
        for s in range(-(-per // self.threads)):
            e = self.uk("IAdd", self.tid, s * self.threads) if s else self.tid
            f, sl = self.uk("UMod", e, fast), self.uk("UDiv", e, fast)
            kk, mm = (f, sl) if kfast else (sl, f)
            out.append((s, e, kk, mm, per % self.threads != 0))
        return out

    def copy_values(self, side, slots, k0):
        """This invocation's values of one operand tile at K origin k0 (u32): the
        operand's closure with the slot's row (col) and K variables, masked, 0 past the
        ends; a list of tile_t value ids."""
        val = self.p.a if side == "a" else self.p.b
        return self.guarded_copies(side, slots, k0, 1, lambda: self.masked_value(val),
                                   self.tile_t, self.zero_tile)

    def masked_value(self, val):
        """Operand value `val` at the index variables as they are set, in the products'
        dtype (tile_t), 0 where a mask of the plan is off."""
        self.values([val] + self.p.masks)
        v = self.value_as(val, self.mul_dtype)
        for mask in self.p.masks:
            v = self.m.op("Select", self.tile_t, self.as_bool(mask), v, self.zero_tile)
        return v

    def guarded_copies(self, side, slots, k0, unit, compute, ty, zero):
        """For each slot (`slots`) of one operand tile at K origin k0: `compute()` (a
        value id of type `ty`) with the index variables set to the slot's row (col) and
        K position, or `zero` past the ends of the operand or, on a ragged last slot,
        of the tile (`unit` values per slot: the tile holds length * BK / unit of them)."""
        p = self.p
        ids, extent = (p.rows, p.nr) if side == "a" else (p.cols, p.nc)
        origin = self.r0 if side == "a" else self.c0
        length = self.br if side == "a" else self.bc
        out = []
        for s, e, kk, mm, ragged in slots:
            pos = self.uop("IAdd", origin, mm)
            kpos = self.uop("IAdd", k0, kk)
            cond = self.m.op("LogicalAnd", self.boolt(), self.ult(pos, extent),
                             self.ult(kpos, p.nk))
            if ragged:
                cond = self.m.op("LogicalAnd", self.boolt(), cond,
                                 self.ult(e, length * self.bk // unit))

            def at_slot(pos=pos, kpos=kpos):
                self.decode(ids, pos)
                self.decode(p.loops, kpos)
                return compute()
            out.append(self.guarded(cond, at_slot, ty, zero))
        return out

    def store_tile(self, side, slots, vals):
        tile = self.la if side == "a" else self.lb
        stride = self.sa if side == "a" else self.sb
        length = self.br if side == "a" else self.bc
        m = self.m
        for (s, e, kk, mm, ragged), v in zip(slots, vals):
            if ragged:
                self.open_if(self.ult(e, length * self.bk))
            at = self.uop("IAdd", self.uk("IMul", kk, stride), mm)
            m.emit("Store", self.tile_ptr(tile, at), v)
            if ragged:
                self.close_if()

    # -- products --------------------------------------------------------------------
    def side_reads(self, tile, stride, t, lane, q):
        """The t values of one sub-tile side at K offset q: chunks of c neighbours, the
        16 invocations' chunks side by side (offsets (g * 16 + lane) * c + i)."""
        m = self.m
        var, eptr, vptr, vt, w = tile
        chunk = min(t, 4)
        out = []
        for g in range(t // chunk):
            base = q * stride + g * SIDE * chunk
            if w > 1:
                at = self.uk("IAdd", lane, base // w)
                vec = m.op("Load", vt, m.op("AccessChain", vptr, var, at))
                out += [m.op("CompositeExtract", self.tile_t, vec, c) for c in range(w)]
            else:
                at = self.uk("IAdd", self.uk("IMul", lane, chunk), base)
                out.append(m.op("Load", self.tile_t, m.op("AccessChain", eptr, var, at)))
        return out

    def products(self):
        m = self.m
        acc_t, tile_t = self.acc_t, self.tile_t
        for q in range(self.bk):
            av = self.side_reads(self.la, self.sa, self.tr, self.ty, q)
            bv = self.side_reads(self.lb, self.sb, self.tc, self.tx, q)
            for i in range(self.tr):
                for j in range(self.tc):
                    x = m.op("FMul", tile_t, av[i], bv[j])
                    if tile_t != acc_t:
                        x = m.op("FConvert", acc_t, x)
                    var = self.accs[i][j]
                    m.emit("Store", var, m.op("FAdd", acc_t, m.op("Load", acc_t, var), x))

    # -- the kernel ----------------------------------------------------------------------
    def write(self):
        m = self.m
        p = self.p
        fn_type, entry, entry_label, group, _, _ = self.begin_entry()
        self.tid = self.lane
        self.tx = self.uk("UMod", self.tid, SIDE)
        self.ty = self.uk("UDiv", self.tid, SIDE)
        self.acc_t = self.rtype(p.dtype)
        self.tile_t = self.rtype(self.mul_dtype)
        self.zero_tile = self.const(self.mul_dtype, 0.0)
        zero_acc = self.const(p.dtype, 0.0)
        self.sa, self.sb = self.br + PAD, self.bc + PAD
        self.la = self.tile_array(self.bk * self.sa, min(self.tr, 4))
        self.lb = self.tile_array(self.bk * self.sb, min(self.tc, 4))
        fptr = m.type_pointer("Function", self.acc_t)
        self.accs = [[m.function_variable(fptr) for _ in range(self.tc)] for _ in range(self.tr)]
        self.totals = [[m.function_variable(fptr) for _ in range(self.tc)]
                       for _ in range(self.tr)] if self.fold else None
        for row in self.accs + (self.totals or []):
            for var in row:
                m.emit("Store", var, zero_acc)
        self.group_body(group)
        return m.words(entry, fn_type, entry_label, self.interface, (THREADS, 1, 1))

    def group_body(self, group):
        """The rest of the entry point for workgroup `group`: its tile's origin, the K
        loop, the epilogue, the return. Every invocation of a group has the same `group`:
        the branch is uniform, so the barriers inside it are in uniform control flow."""
        p = self.p
        self.open_if(self.ult(group, self.n_groups))
        self.r0 = self.uk("IMul", self.uk("UMod", self.uk("UDiv", group, self.gc), self.gr),
                           self.br)
        self.c0 = self.uk("IMul", self.uk("UMod", group, self.gc), self.bc)
        if p.batch:
            self.decode(p.batch, self.uk("UDiv", group, self.gc * self.gr))
        self.k_loop()
        self.epilogue()
        self.close_if()
        self.m.emit("Return")
        self.float_modes()

    def k_loop(self):
        """The loop over K in steps of BK: this invocation's share of both operand tiles
        copied (`copy_values`, one step ahead where prefetching) and staged (`store_tile`),
        a barrier, the step's products (`products`), then `end_step`. A subclass changes
        what is copied, staged and multiplied through those methods, `side_type`,
        `begin_step` and `fold_accumulators`."""
        m = self.m
        bk = self.bk
        sides = [(side, self.slots(side)) for side in ("a", "b")]
        held = None
        if self.prefetch:
            # registers carrying the next step's values over the loop's back edge
            held = {side: [m.function_variable(m.type_pointer("Function", self.side_type(side)))
                           for _ in slots] for side, slots in sides}
            for side, slots in sides:
                for var, v in zip(held[side], self.copy_values(side, slots, self.c_u32(0))):
                    m.emit("Store", var, v)
        k0 = self.open_loop(self.c_u32(0), self.c_u32(self.p.nk), self.c_u32(bk), self.u32(),
                            signed=False)
        self.begin_step(k0)
        for side, slots in sides:
            if held:
                vals = [m.op("Load", self.side_type(side), var) for var in held[side]]
            else:
                vals = self.copy_values(side, slots, k0)
            self.store_tile(side, slots, vals)
        self.barrier()
        if held:
            nxt = self.uk("IAdd", k0, bk)
            for side, slots in sides:
                for var, v in zip(held[side], self.copy_values(side, slots, nxt)):
                    m.emit("Store", var, v)
        self.products()
        self.end_step(k0)
        self.close_loop()

    def side_type(self, side):
        """The type of one copied value of operand `side` (held over the back edge)."""
        return self.tile_t

    def begin_step(self, k0):
        """Called at the top of each K step (K origin k0), before the copies are staged:
        nothing to do here; the cooperative-matrix writer picks its staged copy."""

    def end_step(self, k0):
        """After a step's products: a barrier, so the staged tiles are read before the
        next step writes them, and every block of K the totals (`fold_totals`)."""
        self.barrier()
        if self.fold:
            self.fold_totals(k0)

    def fold_totals(self, k0):
        """Every block of K, the accumulators are added into the totals and restarted."""
        m = self.m
        every = max(self.p.block // self.bk, 1) * self.bk
        self.open_if(m.op("IEqual", self.boolt(), self.uk("UMod", k0, every),
                          self.c_u32(every - self.bk)))
        self.fold_accumulators()
        self.close_if()

    def fold_accumulators(self):
        """Each total += its accumulator; the accumulator = 0."""
        m = self.m
        zero = self.const(self.p.dtype, 0.0)
        for arow, trow in zip(self.accs, self.totals):
            for a, t in zip(arow, trow):
                s = m.op("FAdd", self.acc_t, m.op("Load", self.acc_t, t),
                         m.op("Load", self.acc_t, a))
                m.emit("Store", t, s)
                m.emit("Store", a, zero)

    def epilogue(self):
        """Every output of the sub-tile: its accumulated value through `output`."""
        m = self.m
        for i in range(self.tr):
            ci = min(self.tr, 4)
            row_off = self.uk("IAdd", self.uk("IMul", self.ty, ci),
                               (i // ci) * SIDE * ci + i % ci)
            row = self.uop("IAdd", self.r0, row_off)
            for j in range(self.tc):
                cj = min(self.tc, 4)
                col_off = self.uk("IAdd", self.uk("IMul", self.tx, cj),
                                   (j // cj) * SIDE * cj + j % cj)
                col = self.uop("IAdd", self.c0, col_off)
                v = m.op("Load", self.acc_t, self.accs[i][j])
                if self.fold:
                    v = m.op("FAdd", self.acc_t, m.op("Load", self.acc_t, self.totals[i][j]), v)
                self.output(row, col, v)

    def output(self, row, col, v):
        """The output at (row, col) (u32 positions in the group's batch) from its
        accumulated value v (an acc_t id): inside the output's range test, its row and
        col variables, v in place of the result register's loads, the kernel's ops
        after the reduction and its store."""
        m = self.m
        p, ops = self.p, self.ops
        result = p.total if p.total is not None else p.acc
        res_loads = [j for j, op in enumerate(ops)
                     if j > p.end and op[0] == K.LOAD and op[2] == result]
        st = ops[p.store]
        self.open_if(m.op("LogicalAnd", self.boolt(), self.ult(row, p.nr),
                          self.ult(col, p.nc)))
        self.decode(p.rows, row)
        self.decode(p.cols, col)
        for q in res_loads:
            d = ops[q][1]
            self.val[q] = v if d is p.dtype else self.convert(p.dtype, d, v)
        self.values([st[3], st[4]] if st[3] >= 0 else [st[4]], skip=set(res_loads))
        self.store(p.store, st)
        self.close_if()
