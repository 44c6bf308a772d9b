"""Kernel IR -> SPIR-V compute shader (32-bit words), written directly by zyx: no GLSL
compiler at run time.

One walk over the IR as `cstyle.render_body` does, emitting SPIR-V instructions instead
of C text. Every kernel argument is a storage buffer (set 0, binding = argument number)
holding a `Block` struct of one runtime array. Registers are typed as the C backend
computes: float16/bfloat16 in float32 registers (stored as 16-bit words, converted with
integer ops, round to nearest even), bool as OpTypeBool (stored as a byte), integers at
their own width. Index math is 32-bit where `analysis.narrow_index` proves it fits.

Strategies (`strategy.py` picks one): "elementwise" (loop-free kernels: tiles of
consecutive outputs, vector loads and stores, `elementwise.py`), "serial" (each
invocation computes `items` outputs, one after another at a stride of the whole
dispatch: the short reduce kernels, and elementwise ones in the older `stride` layout),
"split" (a huge reduction in two passes) and "group" (one workgroup per output: every reduce nest's loop run is
split over the lanes and the partial accumulators are combined by a tree in workgroup
memory; the row kernels of softmax & co).
"""
from __future__ import annotations

import math
import struct

from ... import dtype as dt
from ..._core import kernel as K
from ..cstyle import half_rounds, round_half
from ..gpu.analysis import eval_index, loop_ends, narrow_index, output_size
from ..gpu.reduce import RowCache, row_cache
from . import builder as B
from . import f64math
from .elementwise import vector_view, write_elementwise

# GLSL.std.450 instruction numbers
GLSL = dict(Trunc=3, FAbs=4, Floor=8, Sin=13, Cos=14, Tanh=21, Pow=26, Exp=27, Log=28,
            Exp2=29, Log2=30, Sqrt=31, FMin=37, FMax=40)
_GLSL_UNARY = {K.U_EXP2: "Exp2", K.U_LOG2: "Log2", K.U_SQRT: "Sqrt", K.U_SIN: "Sin",
               K.U_COS: "Cos", K.U_FLOOR: "Floor", K.U_TRUNC: "Trunc", K.U_ABS: "FAbs",
               K.U_EXP: "Exp", K.U_LOG: "Log", K.U_TANH: "Tanh"}
# GLSL.std.450 functions defined for 64-bit floats (the others are 16/32-bit only)
_F64_OK = {"Sqrt", "Floor", "Trunc", "FAbs"}


class SpirvKernel:
    """A written module and how to launch it."""
    __slots__ = ("words", "local_size", "invocations", "groups", "strategy", "items",
                 "dtypes")

    def __init__(self, words, local_size, groups, strategy, items, dtypes):
        self.words = words
        self.local_size = local_size
        self.groups = groups            # workgroups to dispatch (folded to 2-D at launch)
        self.strategy = strategy
        self.items = items
        self.dtypes = dtypes            # dtypes the module stores or computes with

    @property
    def code(self):
        return B.to_bytes(self.words)


def uses_dtypes(kernel):
    """The zyx dtypes a kernel reads, writes or computes with (argument and op dtypes)."""
    found = {d for d, _, _ in kernel.args}
    for op in kernel.ops:
        if op[1] is not None and op[0] != K.CONST:
            found.add(op[1])
    return found


class _Writer:
    def __init__(self, kernel, strategy, local, items, nests, fold, fp64=True,
                 float_controls=(), splits=1, phase=0, tuning=None):
        self.tuning = tuning or {}      # strategy.reduce_tuning: cache, subgroup, ilp
        self.splits = splits      # groups per output (split strategy)
        self.phase = phase        # split strategy: 1 partials, 2 their combination
        self.f64_ok = fp64
        self.float_controls = float_controls
        self.k = kernel
        self.ops = kernel.ops
        self.strategy = strategy
        self.local = local
        self.items = items
        self.nests = nests or []
        self.m = m = B.Module((1, 3))
        m.capability("Shader")
        self.glsl = m.import_glsl()
        self.fold = fold
        self.val = {}            # ssa -> result id (narrow ones are 32-bit signed)
        self.regs = {}           # REGISTER/LOCAL define ssa -> (variable id, element ptr type, is_array)
        self.bufs = {}           # GLOBAL define ssa -> (variable id, element ptr type)
        self.loops = []          # open structured constructs
        self.n_out = output_size(self.ops)
        extents = [self.n_out] + [n for _, n, _ in kernel.args]
        self.narrow = narrow_index(self.ops, extents)
        self.ends = loop_ends(self.ops)
        self.vviews = {}         # (GLOBAL define, lanes) -> vector view (elementwise.py)
        self.lane_loads = {}     # LOAD op -> value given by the elementwise strategy
        self.lane_stores = None  # STORE op -> [values] the elementwise strategy stores
        self.cache = RowCache()  # the group strategy's row cache (write_group)
        self.cache_vars = {}     # row cache slot -> (Function array variable, element pointer)
        self.positions = {}      # counted run loop -> u32 position of the open iteration
        self.unroll_vars = {}    # counted nest's leading loop -> its u32 counter
        self.loopless = set()    # split runs of exactly one iteration per lane (no loop)
        self.run_value = None    # a loopless run's flat value when not the lane (ilp copies)
        self.vec_loads = {}      # LOAD op -> component j read from `vec_got` (split pass 1)
        self.vec_got = {}        # LOAD op -> the vector its component 0 loaded

    # -- types -------------------------------------------------------------------------
    def rtype(self, d):
        """The register type of zyx dtype d."""
        m = self.m
        if d.is_bool:
            return m.type_bool()
        if d.is_float:
            if d is dt.float64:
                m.capability("Float64")
                return m.type_float(64)
            return m.type_float(32)
        self._int_caps(d.itemsize * 8)
        return m.type_int(d.itemsize * 8, d.kind == "i")

    def stype(self, d):
        """The type a storage buffer holds elements of dtype d in."""
        m = self.m
        if d.is_bool:
            bits, signed = 8, False
        elif d is dt.float16 or d is dt.bfloat16:
            bits, signed = 16, False
        elif d.is_float:
            return self.rtype(d)
        else:
            bits, signed = d.itemsize * 8, d.kind == "i"
        if bits == 8:
            m.capability("StorageBuffer8BitAccess")
            m.extension("SPV_KHR_8bit_storage")
        elif bits == 16:
            m.capability("StorageBuffer16BitAccess")
            m.extension("SPV_KHR_16bit_storage")
        self._int_caps(bits)
        return m.type_int(bits, signed)

    def _int_caps(self, bits):
        if bits == 8:
            self.m.capability("Int8")
        elif bits == 16:
            self.m.capability("Int16")
        elif bits == 64:
            self.m.capability("Int64")

    def u32(self):
        return self.m.type_int(32, False)

    def i32(self):
        return self.m.type_int(32, True)

    def boolt(self):
        return self.m.type_bool()

    def c_u32(self, v):
        return self.m.const(self.u32(), v)

    def c_i32(self, v):
        return self.m.const(self.i32(), v)

    def const(self, d, v):
        """A constant of zyx dtype d in its register type."""
        m = self.m
        if d.is_bool:
            return m.const_bool(bool(v))
        t = self.rtype(d)
        if d is dt.float16 or d is dt.bfloat16:
            v = round_half(d, float(v))       # a 16-bit constant is its dtype's value
        if d.is_float:
            return m.const(t, float(v), 64 if d is dt.float64 else 32, True)
        return m.const(t, int(v), d.itemsize * 8)

    # -- values ------------------------------------------------------------------------
    def get(self, j, narrow=False):
        """Operand j: its value, as 32-bit index math when `narrow` (constants and narrow
        values) else at its dtype (a narrow value widened to int64)."""
        op = self.ops[j]
        if op[0] == K.CONST:
            if narrow:
                return self.c_i32(int(op[2]))
            return self.const(op[1], op[2])
        v = self.val[j]
        if j in self.narrow and not narrow:
            return self.m.op("SConvert", self.rtype(K.IDX), v)
        return v

    def as_bool(self, j):
        d = self.dtype_of(j)
        x = self.get(j)
        if d.is_bool:
            return x
        return self.to_bool(d, x)

    def to_bool(self, d, x):
        m = self.m
        if d.is_float:
            return m.op("FUnordNotEqual", self.boolt(), x, self.const(d, 0.0))
        return m.op("INotEqual", self.boolt(), x, self.const(d, 0))

    def dtype_of(self, j):
        return self.ops[j][1]

    # -- control flow ------------------------------------------------------------------
    def open_loop(self, start, limit, step, itype, signed=True, unroll=False):
        """Open `for (v = start; v < limit; v += step)`; returns v's id. `unroll`: ask
        the driver to unroll it (LoopControl Unroll: a row cache's constant positions)."""
        m = self.m
        pre = m.block
        header, body, cont, merge = m.id(), m.id(), m.id(), m.id()
        m.emit("Branch", header)
        m.label(header)
        var, nxt = m.id(), m.id()
        m.body += B._inst(B.OP["Phi"], [itype, var, start, pre, nxt, cont])
        cond = m.op("SLessThan" if signed else "ULessThan", self.boolt(), var, limit)
        m.emit("LoopMerge", merge, cont, 1 if unroll else 0)
        m.emit("BranchConditional", cond, body, merge)
        m.label(body)
        self.loops.append(("loop", var, nxt, header, cont, merge, step, itype))
        return var

    def close_loop(self):
        m = self.m
        _, var, nxt, header, cont, merge, step, itype = self.loops.pop()
        m.emit("Branch", cont)
        m.label(cont)
        m.body += B._inst(B.OP["IAdd"], [itype, nxt, var, step])
        m.emit("Branch", header)
        m.label(merge)

    def open_if(self, cond):
        m = self.m
        then, merge = m.id(), m.id()
        m.emit("SelectionMerge", merge, 0)
        m.emit("BranchConditional", cond, then, merge)
        m.label(then)
        self.loops.append(("if", merge))

    def close_if(self):
        m = self.m
        _, merge = self.loops.pop()
        m.emit("Branch", merge)
        m.label(merge)

    # -- builtins ----------------------------------------------------------------------
    def builtin(self, name):
        m = self.m
        v3 = m.type_vector(self.u32(), 3)
        var = m.global_variable(m.type_pointer("Input", v3), "Input")
        m.decorate(var, "BuiltIn", B.BUILTIN[name])
        self.interface.append(var)
        return m.op("Load", v3, var)

    # -- module ------------------------------------------------------------------------
    def begin_entry(self):
        """Open the entry point: the buffers declared, `self.lane` the invocation's index
        in its workgroup. (fn_type, entry, entry_label, group, nx, nwg): `group` is the
        flat workgroup number (the 2-D fold of the dispatch undone), `nx` the groups
        along x, `nwg` the NumWorkgroups vector."""
        m = self.m
        self.interface = []
        fn_type = m.type_function(m.type_void())
        entry, entry_label = m.id(), m.id()
        m.block = entry_label
        self.declare_buffers()
        wid = self.builtin("WorkgroupId")
        lid = self.builtin("LocalInvocationId")
        nwg = self.builtin("NumWorkgroups")
        u32 = self.u32()
        wx = m.op("CompositeExtract", u32, wid, 0)
        wy = m.op("CompositeExtract", u32, wid, 1)
        nx = m.op("CompositeExtract", u32, nwg, 0)
        self.lane = m.op("CompositeExtract", u32, lid, 0)
        group = m.op("IAdd", u32, m.op("IMul", u32, wy, nx), wx)
        return fn_type, entry, entry_label, group, nx, nwg

    def write(self):
        m = self.m
        fn_type, entry, entry_label, group, nx, nwg = self.begin_entry()
        if self.strategy == "split":
            self.write_split(group)
        elif self.strategy == "group":
            self.write_group(group)
        elif self.strategy == "elementwise" and not self.items.stride:
            write_elementwise(self, group)
        else:
            self.write_serial(group, nx, nwg)
        m.emit("Return")
        self.float_modes()
        words = m.words(entry, fn_type, entry_label, self.interface, (self.local, 1, 1))
        return words

    def float_modes(self):
        """SPV_KHR_float_controls execution modes the device supports, for the float
        widths the module uses: NaN, infinities and signed zeros kept (torch's max and
        isnan rely on them), denormals kept (exp of very negative values)."""
        m = self.m
        widths = [b for b in (32, 64) if ("float", b) in m._types]
        modes = [(mode, b) for b in widths
                 for mode, key in (("SignedZeroInfNanPreserve", "nan"),
                                   ("DenormPreserve", "denorm"))
                 if f"{key}{b}" in self.float_controls]
        if modes:
            m.extension("SPV_KHR_float_controls")
            for mode, b in modes:
                m.capability(mode)
                m.extra_modes.append((mode, b))

    def declare_buffers(self):
        m = self.m
        for i, op in enumerate(self.ops):
            if op[0] == K.DEFINE and op[2] == K.SCOPE_GLOBAL:
                d, _, read_only = self.k.args[op[3]]
                elem = self.stype(d)
                s = m.storage_buffer_struct(elem, _stride(d), op[3])
                if read_only:
                    # lets the driver read through its non-coherent (texture) cache
                    m.member_decorate(s, 0, "NonWritable")
                var = m.global_variable(m.type_pointer("StorageBuffer", s), "StorageBuffer")
                m.decorate(var, "DescriptorSet", 0)
                m.decorate(var, "Binding", op[3])
                self.bufs[i] = (var, m.type_pointer("StorageBuffer", elem), d)

    def decode_indices(self, flat):
        """Each INDEX variable's value from the flat output number `flat` (u32)."""
        m = self.m
        idx = [i for i, op in enumerate(self.ops) if op[0] == K.INDEX]
        stride = 1
        u32 = self.u32()
        for ssa in reversed(idx):
            length = self.ops[ssa][3]
            e = flat if stride == 1 else m.op("UDiv", u32, flat, self.c_u32(stride))
            if ssa != idx[0]:
                e = m.op("UMod", u32, e, self.c_u32(length))
            self.set_index(ssa, e)
            stride *= length

    def set_index(self, ssa, u32_value):
        """An INDEX/LOOP variable given as a 32-bit unsigned value."""
        m = self.m
        if ssa in self.narrow:
            self.val[ssa] = m.op("Bitcast", self.i32(), u32_value)
        else:
            self.val[ssa] = m.op("UConvert", self.rtype(K.IDX), u32_value)

    def write_serial(self, group, nx, nwg):
        m = self.m
        u32 = self.u32()
        n_out = self.n_out
        items = self.items.items if self.strategy == "elementwise" else self.items
        g = m.op("IAdd", u32, m.op("IMul", u32, group, self.c_u32(self.local)), self.lane)
        if items > 1:
            ny = m.op("CompositeExtract", u32, nwg, 1)
            span = m.op("IMul", u32, m.op("IMul", u32, nx, ny), self.c_u32(self.local))
            k = self.open_loop(self.c_u32(0), self.c_u32(items), self.c_u32(1), u32,
                               signed=False)
            g = m.op("IAdd", u32, g, m.op("IMul", u32, k, span))
        self.open_if(m.op("ULessThan", self.boolt(), g, self.c_u32(n_out)))
        self.decode_indices(g)
        self.body(0, len(self.ops))
        self.close_if()
        if items > 1:
            self.close_loop()

    def write_group(self, group):
        """One workgroup per output; lanes split each nest's run, then combine."""
        m = self.m
        # every lane of a group has the same `group`: this branch is uniform, so the
        # barriers inside it are in uniform control flow
        self.open_if(m.op("ULessThan", self.boolt(), group, self.c_u32(self.n_out)))
        self.decode_indices(group)
        self.by_root = {n.run[0]: n for n in self.nests}
        self.by_end = {n.end: n for n in self.nests if n.run[0] != n.root}
        self.split_loops = {}
        self.scratch = {}
        if self.tuning.get("cache", 1):
            self.cache = row_cache(_RegisterValues, self.ops, self.nests, self.local)
        self.body(0, len(self.ops))
        self.close_if()

    def scratch_buffer(self, j, d):
        """The storage buffer of result register j's partials (binding after the
        kernel's arguments): dtype d's register values, stored as `stype`."""
        m = self.m
        binding = len(self.k.args) + j
        elem = self.stype(d)
        st = m.storage_buffer_struct(elem, _stride(d), ("scratch", binding))
        var = m.global_variable(m.type_pointer("StorageBuffer", st), "StorageBuffer")
        m.decorate(var, "DescriptorSet", 0)
        m.decorate(var, "Binding", binding)
        return var, m.type_pointer("StorageBuffer", elem)

    def write_split(self, group):
        """The two passes of one huge reduce nest (`nests[0]`, after which only the
        epilogue follows): pass 1 runs `splits` groups per output, each over a share of
        the nest's outer loop, and stores each result register's group total in a
        scratch buffer; pass 2 (one group per output) combines those partials and runs
        the epilogue."""
        m = self.m
        u32, bt = self.u32(), self.boolt()
        nest = self.nests[0]
        S = self.splits
        self.by_root = {nest.run[0]: nest}
        self.by_end = {nest.end: nest} if nest.run[0] != nest.root else {}
        self.split_loops = {}
        self.scratch = {}
        bufs = [self.scratch_buffer(j, self.ops[acc][1]) for j, acc in enumerate(nest.results)]
        n_groups = self.n_out * (S if self.phase == 1 else 1)
        self.open_if(m.op("ULessThan", bt, group, self.c_u32(n_groups)))
        out = m.op("UDiv", u32, group, self.c_u32(S)) if self.phase == 1 else group
        self.decode_indices(out)
        if self.phase == 1:
            part = m.op("UMod", u32, group, self.c_u32(S))
            self.share = part
            ilp = self.tuning.get("ilp", 1)
            if ilp > 1 and nest.run[0] != nest.root:
                self.body(0, nest.root)
                self.unrolled_share(nest, ilp)
            else:
                self.body(0, nest.end + 1)
            self.open_if(m.op("IEqual", bt, self.lane, self.c_u32(0)))
            slot = m.op("IAdd", u32, m.op("IMul", u32, out, self.c_u32(S)), part)
            for (var, eptr), acc in zip(bufs, nest.results):
                d = self.ops[acc][1]
                v = m.op("Load", self.rtype(d), self.regs[acc][0])
                m.emit("Store", m.op("AccessChain", eptr, var, self.c_u32(0), slot),
                       self.to_storage(d, v))
            self.close_if()
        else:
            self.body(0, nest.root)
            for (var, eptr), acc in zip(bufs, nest.results):
                d, rop = self.ops[acc][1], self.ops[acc][6]
                t = self.rtype(d)
                reg = self.regs[acc][0]
                k = self.open_loop(self.lane, self.c_u32(S), self.c_u32(self.local), u32,
                                   signed=False)
                slot = m.op("IAdd", u32, m.op("IMul", u32, out, self.c_u32(S)), k)
                raw = m.op("Load", self.stype(d),
                           m.op("AccessChain", eptr, var, self.c_u32(0), slot))
                v = self.from_storage(d, raw)
                m.emit("Store", reg, self.combine_values(rop, d, m.op("Load", t, reg), v))
                self.close_loop()
            self.combine(nest)
            self.body(nest.end + 1, len(self.ops))
        self.close_if()

    # -- the walk ----------------------------------------------------------------------
    def body(self, lo, hi):
        ops = self.ops
        m = self.m
        rounds = half_rounds(ops)
        for i in range(lo, hi):
            op = ops[i]
            c = op[0]
            if c in (K.CONST, K.INDEX):
                continue
            if c == K.DEFINE:
                self.define(i, op)
            elif c == K.LOOP:
                if self.strategy != "serial" and i in self.by_root:
                    self.open_split(self.by_root[i])
                    continue
                if self.strategy != "serial" and i in self.split_loops:
                    continue          # a loop of a split run: decoded from the flat loop
                if self.strategy == "split" and i == self.nests[0].root:
                    self.val[i] = self.open_share(op[2])
                    continue
                if i in self.cache.unrolled:      # a counted nest's leading (block) loop
                    k = self.open_loop(self.c_u32(0), self.c_u32(op[2]), self.c_u32(1),
                                       self.u32(), signed=False, unroll=True)
                    self.unroll_vars[i] = k
                    self.set_index(i, k)
                    continue
                narrow = i in self.narrow
                t = self.i32() if narrow else self.rtype(K.IDX)
                zero = self.c_i32(0) if narrow else self.const(K.IDX, 0)
                one = self.c_i32(1) if narrow else self.const(K.IDX, 1)
                n = self.c_i32(op[2]) if narrow else self.const(K.IDX, op[2])
                self.val[i] = self.open_loop(zero, n, one, t)
            elif c == K.ENDLOOP:
                if self.strategy != "serial" and op[2] in self.split_loops:
                    nest = self.split_loops[op[2]]
                    if op[2] == nest.run[0]:
                        if op[2] not in self.loopless:
                            self.close_loop()
                        if i == nest.end:
                            self.combine(nest)
                    continue
                self.close_loop()
                if self.strategy != "serial" and i in self.by_end:
                    self.combine(self.by_end[i])
            elif c == K.IF_OP:
                self.open_if(self.as_bool(op[2]))
            elif c == K.END_IF:
                self.close_if()
            elif c == K.BARRIER:
                m.emit("ControlBarrier", self.c_u32(B.SCOPE_WORKGROUP),
                       self.c_u32(B.SCOPE_WORKGROUP), self.c_u32(B.SEMANTICS_ACQREL_WORKGROUP))
            elif c == K.LOAD:
                self.val[i] = self.load(i, op)
            elif c == K.STORE:
                self.store(i, op)
            else:
                x = self.alu(i, op)
                if i in rounds and c != K.CAST:     # a cast to 16 bits rounds already
                    x = self.round16(op[1], x)
                self.val[i] = x

    def round16(self, d, x):
        """float32 register x rounded to the 16-bit float dtype d's value (an op's result
        is its dtype's value, as on the other backends: cstyle.half_rounds says where)."""
        if d is dt.float16:
            return self.h2f(self.f2h(x))
        u = self.m.op("ShiftLeftLogical", self.u32(), self.f2bf(x), self.c_u32(16))
        return self.m.op("Bitcast", self.rtype(d), u)

    def define(self, i, op):
        m = self.m
        d, scope, init, length = op[1], op[2], op[3], op[5]
        if scope == K.SCOPE_GLOBAL:
            return
        t = self.rtype(d)
        if scope == K.SCOPE_LOCAL:
            arr = m.type_array(t, length)
            var = m.global_variable(m.type_pointer("Workgroup", arr), "Workgroup")
            self.regs[i] = (var, m.type_pointer("Workgroup", t), True)
            return
        if length == 1:
            var = m.function_variable(m.type_pointer("Function", t))
            self.regs[i] = (var, None, False)
            if init is not None:
                m.emit("Store", var, self.const(d, init))
            return
        arr = m.type_array(t, length)
        var = m.function_variable(m.type_pointer("Function", arr))
        self.regs[i] = (var, m.type_pointer("Function", t), True)
        if init is not None:
            m.emit("Store", var, m.const_composite(arr, [self.const(d, init)] * length))

    def index_of(self, j):
        """An index operand for OpAccessChain (32-bit where narrow) and its type."""
        n = j in self.narrow or (self.ops[j][0] == K.CONST and -2**31 <= self.ops[j][2] < 2**31)
        return self.get(j, narrow=n), (self.i32() if n else self.rtype(K.IDX))

    def reg_ptr(self, ref, index_ref):
        var, eptr, is_array = self.regs[ref]
        if not is_array:
            return var
        return self.m.op("AccessChain", eptr, var, self.index_of(index_ref)[0])

    def load(self, i, op):
        m = self.m
        d = op[1]
        ref, index_ref, guard = op[2], op[3], op[4]
        if i in self.lane_loads:
            return self.lane_loads[i]
        if ref in self.regs:
            return m.op("Load", self.rtype(d), self.reg_ptr(ref, index_ref))
        if i in self.vec_loads:
            return self.vector_lane(i, op)
        if i in self.cache.uses:
            v = m.op("Load", self.rtype(d), self.cached(i, self.cache.uses[i][0], d))
            if guard >= 0:
                v = m.op("Select", self.rtype(d), self.as_bool(guard), v, self.const(d, 0))
            return v
        var, eptr, sd = self.bufs[ref]
        idx, it = self.index_of(index_ref)
        if guard >= 0:
            # both sides of OpSelect run: read element 0 (every buffer has one) instead
            # of the out-of-range one the guard excludes
            idx = m.op("Select", it, self.as_bool(guard), idx, m.const(it, 0, 32 if it == self.i32() else 64))
        ptr = m.op("AccessChain", eptr, var, self.c_u32(0), idx)
        raw = m.op("Load", self.stype(sd), ptr)
        v = self.from_storage(sd, raw)
        if d is not sd:
            v = self.convert(sd, d, v)
        if guard >= 0:
            v = m.op("Select", self.rtype(d), self.as_bool(guard), v, self.const(d, 0))
        if i in self.cache.sources:
            m.emit("Store", self.cached(i, self.cache.sources[i][0], d), v)
        return v

    def vector_lane(self, i, op):
        """Component j of the vector load i's copy 0 made (write_split's vec): copy 0
        reads the vector at its own element's index / vec (a multiple of vec)."""
        m = self.m
        j, vec = self.vec_loads[i]
        var, eptr, sd = self.bufs[op[2]]
        if j == 0:
            vvar, vptr, vt = vector_view(self, op[2], vec)
            idx, it = self.index_of(op[3])
            q = m.op("SDiv", it, idx, m.const(it, vec, 32 if it == self.i32() else 64))
            self.vec_got[i] = m.op("Load", vt, m.op("AccessChain", vptr, vvar, self.c_u32(0), q))
        v = self.from_storage(sd, m.op("CompositeExtract", self.stype(sd), self.vec_got[i], j))
        return v if op[1] is sd else self.convert(sd, op[1], v)

    def vector_loads(self, nest, vec):
        """LOAD ops of `nest`'s body that split pass 1 may read as vectors of `vec`
        elements: plain loads of 4-byte elements at base + root * flat + run, the base
        (from the output indices) a multiple of vec, checked at sampled output indices."""
        ops = self.ops
        root, run, flat = nest.root, nest.run[0], nest.flat
        if len(nest.run) != 1:
            return []
        index_vars = [i for i, op in enumerate(ops) if op[0] == K.INDEX]
        samples = [{v: (0, ops[v][3] - 1, ops[v][3] // 2)[k] for v in index_vars}
                   for k in range(3)]
        out = []
        for j in range(root + 1, nest.end):
            op = ops[j]
            if op[0] != K.LOAD or op[2] not in self.bufs or op[4] >= 0:
                continue
            sd = self.bufs[op[2]][2]
            if sd.is_bool or sd.itemsize != 4:
                continue
            ok = True
            for sample in samples:
                base = eval_index(ops, op[3], {**sample, root: 0, run: 0})
                at = eval_index(ops, op[3], {**sample, root: 3, run: 5})
                if base is None or at is None or base % vec or at != base + 3 * flat + 5:
                    ok = False
                    break
            if ok:
                out.append(j)
        return out

    def cached(self, i, slot, d):
        """Pointer to the row cache element load i reads or fills: slot `slot`'s
        Function array (one element per counted iteration of this lane) at the position
        of the iteration open in load i's nest."""
        m = self.m
        sh = self.cache_vars.get(slot)
        if sh is None:
            t = self.rtype(d)
            arr = m.type_array(t, self.cache.slots[slot][1])
            sh = self.cache_vars[slot] = (
                m.function_variable(m.type_pointer("Function", arr)),
                m.type_pointer("Function", t))
        nest = next(n for n in self.nests if n.root < i < n.end)
        return m.op("AccessChain", sh[1], sh[0], self.positions[nest.run[0]])

    def store(self, i, op):
        m = self.m
        ref, index_ref, value_ref = op[2], op[3], op[4]
        if ref in self.regs:
            d = self.ops[ref][1]
            m.emit("Store", self.reg_ptr(ref, index_ref), self.value_as(value_ref, d))
            return
        var, eptr, sd = self.bufs[ref]
        if self.lane_stores is not None and i in self.lane_stores:
            self.lane_stores[i].append(self.to_storage(sd, self.value_as(value_ref, sd)))
            return
        guarded = (self.strategy in ("group", "split") and not self.in_store_nest(i))
        if guarded:
            self.open_if(m.op("IEqual", self.boolt(), self.lane, self.c_u32(0)))
        v = self.to_storage(sd, self.value_as(value_ref, sd))
        ptr = m.op("AccessChain", eptr, var, self.c_u32(0), self.index_of(index_ref)[0])
        m.emit("Store", ptr, v)
        if guarded:
            self.close_if()

    def in_store_nest(self, i):
        return any(n.stores and n.root < i < n.end for n in self.nests)

    def value_as(self, j, d):
        """Operand j converted to dtype d's register type (stores of another dtype)."""
        sd = self.dtype_of(j)
        v = self.get(j)
        if sd is d or (sd.is_float and d.is_float and self.rtype(sd) == self.rtype(d)):
            return v
        return self.convert(sd, d, v)

    # -- storage conversions -----------------------------------------------------------
    def from_storage(self, d, raw):
        m = self.m
        if d.is_bool:
            return m.op("INotEqual", self.boolt(), raw, m.const(m.type_int(8, False), 0))
        if d is dt.bfloat16:
            u = m.op("UConvert", self.u32(), raw)
            u = m.op("ShiftLeftLogical", self.u32(), u, self.c_u32(16))
            return m.op("Bitcast", m.type_float(32), u)
        if d is dt.float16:
            return self.h2f(m.op("UConvert", self.u32(), raw))
        return raw

    def to_storage(self, d, v):
        m = self.m
        if d.is_bool:
            u8 = m.type_int(8, False)
            return m.op("Select", u8, v, m.const(u8, 1, 8), m.const(u8, 0, 8))
        if d is dt.bfloat16:
            return m.op("UConvert", m.type_int(16, False), self.f2bf(v))
        if d is dt.float16:
            return m.op("UConvert", m.type_int(16, False), self.f2h(v))
        return v

    def f2bf(self, x):
        """float32 -> bfloat16 bits (u32): round to nearest even, NaN kept quiet."""
        m, u32 = self.m, self.u32()
        u = m.op("Bitcast", u32, x)
        a = m.op("BitwiseAnd", u32, u, self.c_u32(0x7FFFFFFF))
        nan = m.op("UGreaterThan", self.boolt(), a, self.c_u32(0x7F800000))
        hi = m.op("ShiftRightLogical", u32, u, self.c_u32(16))
        qnan = m.op("BitwiseOr", u32, hi, self.c_u32(64))
        lsb = m.op("BitwiseAnd", u32, hi, self.c_u32(1))
        r = m.op("IAdd", u32, u, m.op("IAdd", u32, lsb, self.c_u32(0x7FFF)))
        r = m.op("ShiftRightLogical", u32, r, self.c_u32(16))
        return m.op("Select", u32, nan, qnan, r)

    def f2h(self, x):
        """float32 -> float16 bits (u32), round to nearest even (integer ops: the result
        is the same on every device), NaN kept quiet, overflow to infinity."""
        m, u32, b = self.m, self.u32(), self.boolt()
        f32 = m.type_float(32)
        u = m.op("Bitcast", u32, x)
        sign = m.op("BitwiseAnd", u32, m.op("ShiftRightLogical", u32, u, self.c_u32(16)),
                    self.c_u32(0x8000))
        a = m.op("BitwiseAnd", u32, u, self.c_u32(0x7FFFFFFF))
        # normal: rebias the exponent, round the 13 dropped bits to nearest even
        lsb = m.op("BitwiseAnd", u32, m.op("ShiftRightLogical", u32, a, self.c_u32(13)),
                   self.c_u32(1))
        n = m.op("ISub", u32, a, self.c_u32(0x38000000))
        n = m.op("IAdd", u32, n, m.op("IAdd", u32, lsb, self.c_u32(0xFFF)))
        n = m.op("ShiftRightLogical", u32, n, self.c_u32(13))
        n = m.op("ExtInst", u32, self.glsl, 38, n, self.c_u32(0x7C00))     # UMin: overflow -> inf
        # subnormal: |x| + 0.5 puts the f16 subnormal ulp (2^-24) in the last bit, and
        # the float add rounds to nearest even
        s = m.op("FAdd", f32, m.op("Bitcast", f32, a), m.const(f32, 0.5, 32, True))
        s = m.op("ISub", u32, m.op("Bitcast", u32, s), self.c_u32(0x3F000000))
        qnan = m.op("BitwiseOr", u32, self.c_u32(0x7E00),
                    m.op("BitwiseAnd", u32, m.op("ShiftRightLogical", u32, a, self.c_u32(13)),
                         self.c_u32(0x3FF)))
        r = m.op("Select", u32, m.op("UGreaterThanEqual", b, a, self.c_u32(0x38800000)), n, s)
        r = m.op("Select", u32, m.op("UGreaterThan", b, a, self.c_u32(0x7F800000)), qnan, r)
        return m.op("BitwiseOr", u32, r, sign)

    def h2f(self, h):
        """float16 bits (u32) -> float32, exact (GLSL UnpackHalf2x16 of the low half)."""
        m = self.m
        v2 = m.type_vector(m.type_float(32), 2)
        return m.op("CompositeExtract", m.type_float(32),
                    m.ext(self.glsl, v2, 62, h), 0)

    # -- conversions -------------------------------------------------------------------
    def convert(self, s, d, x):
        """Value x of dtype s as dtype d (C's conversions, float->int NaN -> 0)."""
        m = self.m
        if d.is_bool:
            return x if s.is_bool else self.to_bool(s, x)
        t = self.rtype(d)
        if s.is_bool:
            return m.op("Select", t, x, self.const(d, 1), self.const(d, 0))
        if s.is_float and d.is_float:
            if self.rtype(s) != t:
                x = m.op("FConvert", t, x)
            if d is dt.float16:
                return self.h2f(self.f2h(x))
            if d is dt.bfloat16:
                u = m.op("ShiftLeftLogical", self.u32(), self.f2bf(x), self.c_u32(16))
                return m.op("Bitcast", t, u)
            return x
        if s.is_float:
            ok = m.op("FOrdEqual", self.boolt(), x, x)
            x = m.op("Select", self.rtype(s), ok, x, self.const(s, 0.0))
            return m.op("ConvertFToS" if d.kind == "i" else "ConvertFToU", t, x)
        if d.is_float:
            return m.op("ConvertSToF" if s.kind == "i" else "ConvertUToF", t, x)
        if s.itemsize == d.itemsize:
            return x if s.kind == d.kind else m.op("Bitcast", t, x)
        if s.itemsize > d.itemsize:
            return m.op("UConvert", t, x) if d.kind == "u" else m.op("SConvert", t, x)
        # widening: extend by the source's signedness, then reinterpret
        mid = m.type_int(d.itemsize * 8, s.kind == "i")
        y = m.op("SConvert" if s.kind == "i" else "UConvert", mid, x)
        return y if mid == t else m.op("Bitcast", t, y)

    # -- arithmetic --------------------------------------------------------------------
    def alu(self, i, op):
        m = self.m
        c, d = op[0], op[1]
        if i in self.narrow:          # 32-bit index math
            a, b = self.get(op[3], True), self.get(op[4], True)
            return self.int_binary(op[2], dt.int32, self.i32(), a, b, op[4])
        if c == K.CAST:
            return self.convert(self.dtype_of(op[2]), d, self.get(op[2]))
        if c == K.WHERE:
            return m.op("Select", self.rtype(d), self.as_bool(op[2]),
                        self.value_as(op[3], d), self.value_as(op[4], d))
        if c == K.MAD:
            t = self.rtype(d)
            a, b, cc = (self.value_as(j, d) for j in op[2:5])
            if d.is_bool:
                return m.op("LogicalOr", t, m.op("LogicalAnd", t, a, b), cc)
            if d.is_float:
                return m.op("FAdd", t, m.op("FMul", t, a, b), cc)
            return m.op("IAdd", t, m.op("IMul", t, a, b), cc)
        if c == K.UNARY:
            return self.unary(op[2], d, self.value_as(op[3], d))
        return self.binary(i, op)

    def unary(self, u, d, x):
        m = self.m
        t = self.rtype(d)
        if d.is_bool:
            if u in (K.U_NEG, K.U_BITNOT):
                return m.op("LogicalNot", t, x)
            if u in (K.U_ABS, K.U_FLOOR, K.U_TRUNC):
                return x
            return self.convert(dt.float32, d, self.unary(u, dt.float32,
                                                          self.convert(d, dt.float32, x)))
        if u == K.U_NEG:
            return m.op("FNegate" if d.is_float else "SNegate", t, x)
        if u == K.U_BITNOT:
            return m.op("Not", t, x)
        if not d.is_float:
            if u in (K.U_FLOOR, K.U_TRUNC):
                return x
            if u == K.U_ABS:
                if d.kind == "u":
                    return x
                neg = m.op("SLessThan", self.boolt(), x, self.const(d, 0))
                return m.op("Select", t, neg, m.op("SNegate", t, x), x)
            fd = dt.float64 if d.itemsize >= 4 and self.f64_ok else dt.float32
            return self.convert(fd, d, self.unary(u, fd, self.convert(d, fd, x)))
        if u == K.U_RECIP:
            return self.fdiv(d, self.const(d, 1.0), x)
        if u == K.U_ERF:
            return f64math.erf(self, x) if d is dt.float64 else self.erf(d, x)
        name = _GLSL_UNARY[u]
        if d is dt.float64 and name not in _F64_OK:
            # GLSL.std.450 has these for 16/32-bit floats only
            return self.f64_unary(u, x)
        if u == K.U_TANH:
            return self.tanh(d, x)
        return m.ext(self.glsl, t, GLSL[name], x)

    f64_ok = True

    def f64_unary(self, u, x):
        f = f64math.F64(self)
        if u == K.U_EXP:
            return f64math.exp(self, x)
        if u == K.U_EXP2:
            return f64math.exp(self, f.mul(x, f.c(math.log(2.0))))
        if u == K.U_LOG:
            return f64math.log(self, x)
        if u == K.U_LOG2:
            return f.mul(f64math.log(self, x), f.c(1.0 / math.log(2.0)))
        if u in (K.U_SIN, K.U_COS):
            return f64math.sincos(self, x, u == K.U_COS)
        if u == K.U_TANH:
            return f64math.tanh(self, x)
        raise NotImplementedError(f"float64 {K.UNARY_NAMES[u]}")

    def tanh(self, d, x):
        """tanh within a few ulp: GLSL's Tanh is allowed large error near 0; this is
        1 - 2 / (exp(2x) + 1), with x itself below 2^-10 (where tanh x rounds to x)
        and +-1 past 9."""
        m = self.m
        t = self.rtype(d)
        ax = m.ext(self.glsl, t, GLSL["FAbs"], x)
        e = m.ext(self.glsl, t, GLSL["Exp"], m.op("FMul", t, ax, self.const(d, 2.0)))
        r = m.op("FSub", t, self.const(d, 1.0),
                 m.op("FDiv", t, self.const(d, 2.0), m.op("FAdd", t, e, self.const(d, 1.0))))
        # small |x|: x - x^3/3 + 2x^5/15 (error below float ulp for |x| < 0.04)
        x2 = m.op("FMul", t, x, x)
        poly = m.op("FAdd", t, self.const(d, -1.0 / 3.0),
                    m.op("FMul", t, x2, self.const(d, 2.0 / 15.0)))
        small = m.op("FAdd", t, x, m.op("FMul", t, x, m.op("FMul", t, x2, poly)))
        r = m.op("Select", t, m.op("FOrdGreaterThan", self.boolt(), ax, self.const(d, 9.0)),
                 self.const(d, 1.0), r)
        sign_r = m.op("Select", t, m.op("FOrdLessThan", self.boolt(), x, self.const(d, 0.0)),
                      m.op("FNegate", t, r), r)
        out = m.op("Select", t, m.op("FOrdLessThan", self.boolt(), ax, self.const(d, 0.04)),
                   small, sign_r)
        # NaN stays NaN: every comparison above is false for it, and exp(NaN) is NaN
        return out

    def erf(self, d, x):
        """erf: a Taylor series below 0.5, Abramowitz & Stegun 7.1.26 above (absolute
        error 1.5e-7), odd symmetry."""
        m = self.m
        t = self.rtype(d)
        ax = m.ext(self.glsl, t, GLSL["FAbs"], x)
        c = lambda v: self.const(d, v)      # noqa: E731
        k = m.op("FDiv", t, c(1.0), m.op("FAdd", t, c(1.0), m.op("FMul", t, c(0.3275911), ax)))
        p = c(1.061405429)
        for a in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
            p = m.op("FAdd", t, m.op("FMul", t, p, k), c(a))
        p = m.op("FMul", t, p, k)
        x2 = m.op("FMul", t, ax, ax)
        e = m.ext(self.glsl, t, GLSL["Exp"], m.op("FNegate", t, x2))
        big = m.op("FSub", t, c(1.0), m.op("FMul", t, p, e))
        s = c(1.0 / 216.0)
        for a in (-1.0 / 42.0, 1.0 / 10.0, -1.0 / 3.0, 1.0):
            s = m.op("FAdd", t, m.op("FMul", t, s, x2), c(a))
        small = m.op("FMul", t, m.op("FMul", t, s, ax), c(2.0 / math.sqrt(math.pi)))
        r = m.op("Select", t, m.op("FOrdLessThan", self.boolt(), ax, c(0.5)), small, big)
        neg = m.op("FOrdLessThan", self.boolt(), x, c(0.0))
        r = m.op("Select", t, neg, m.op("FNegate", t, r), r)
        return m.op("Select", t, m.op("IsNan", self.boolt(), x), x, r)

    def binary(self, i, op):
        m = self.m
        d, b = op[1], op[2]
        sd = self.dtype_of(op[3])
        if b in (K.B_CMPLT, K.B_CMPGT, K.B_NOTEQ, K.B_EQ) or (b in (K.B_OR, K.B_AND)):
            return self.compare(b, op[3], op[4])
        if d.is_bool:
            x, y = self.as_bool(op[3]), self.as_bool(op[4])
            t = self.boolt()
            name = {K.B_ADD: "LogicalOr", K.B_MUL: "LogicalAnd", K.B_BITOR: "LogicalOr",
                    K.B_BITAND: "LogicalAnd", K.B_BITXOR: "LogicalNotEqual",
                    K.B_MAX: "LogicalOr", K.B_MIN: "LogicalAnd", K.B_SUB: "LogicalNotEqual"
                    }.get(b)
            if name is not None:
                return m.op(name, t, x, y)
            f = self.binary_value(b, dt.uint8, self.convert(d, dt.uint8, x),
                                  self.convert(d, dt.uint8, y), op[4])
            return self.convert(dt.uint8, d, f)
        x, y = self.value_as(op[3], d), self.value_as(op[4], d)
        del sd
        return self.binary_value(b, d, x, y, op[4])

    def binary_value(self, b, d, x, y, y_ref):
        m = self.m
        t = self.rtype(d)
        if d.is_float:
            if b == K.B_MOD:
                return self.fmod(d, x, y)
            if b == K.B_DIV:
                return self.fdiv(d, x, y)
            name = {K.B_ADD: "FAdd", K.B_SUB: "FSub", K.B_MUL: "FMul", K.B_DIV: "FDiv"}.get(b)
            if name is not None:
                return m.op(name, t, x, y)
            if b in (K.B_MAX, K.B_MIN):
                # torch semantics: NaN in x or y wins, a tie (-0.0 vs 0.0) keeps x
                # ((x < y || y != y) ? y : x for max, y < x for min), as cstyle
                lo, hi = (x, y) if b == K.B_MAX else (y, x)
                cmp = m.op("FOrdLessThan", self.boolt(), lo, hi)
                pick = m.op("LogicalOr", self.boolt(), cmp,
                            m.op("FUnordNotEqual", self.boolt(), y, y))
                return m.op("Select", t, pick, y, x)
            if b == K.B_POW:
                return self.fpow(d, x, y)
            raise NotImplementedError(f"binary op {K.BINARY_NAMES[b]} on {d.name}")
        return self.int_binary(b, d, t, x, y, y_ref)

    def fdiv(self, d, x, y):
        """IEEE x / y: Vulkan defines OpFDiv only for |y| in [2^-126, 2^126] (lavapipe
        gives garbage for 0 / 0), so division by zero and by infinity are written out:
        signed infinities and zeros, NaN for 0 / 0, inf / inf and NaN operands."""
        m = self.m
        t = self.rtype(d)
        bt = self.boolt()
        bits = 64 if d is dt.float64 else 32
        ut = m.type_int(bits, False)
        q = m.op("FDiv", t, x, y)
        sign = m.op("BitwiseAnd", ut, m.op("BitwiseXor", ut, m.op("Bitcast", ut, x),
                                           m.op("Bitcast", ut, y)),
                    m.const(ut, 1 << (bits - 1), bits))
        inf_bits = 0x7FF0000000000000 if bits == 64 else 0x7F800000
        inf = m.op("Bitcast", t, m.op("BitwiseOr", ut, sign, m.const(ut, inf_bits, bits)))
        zero = m.op("Bitcast", t, sign)
        nan = self.const(d, float("nan"))
        xbad = m.op("LogicalOr", bt, m.op("IsNan", bt, x), m.op("IsInf", bt, x))
        y0 = m.op("FOrdEqual", bt, y, self.const(d, 0.0))
        x0 = m.op("LogicalOr", bt, m.op("FOrdEqual", bt, x, self.const(d, 0.0)),
                  m.op("IsNan", bt, x))
        q = m.op("Select", t, y0, m.op("Select", t, x0, nan, inf), q)
        q = m.op("Select", t, m.op("IsInf", bt, y), m.op("Select", t, xbad, nan, zero), q)
        return m.op("Select", t, m.op("IsNan", bt, y), y, q)

    def fmod(self, d, x, y):
        """C's fmod (exact, the sign of x). OpFRem is x - y * trunc(x / y), off by up to
        |y| where x / y rounds across an integer: float32 is computed in float64 (the
        product q * y is exact while |q| < 2^29), and the remainder is moved back into
        (-|y|, |y|) with x's sign."""
        m = self.m
        t = self.rtype(d)
        bt = self.boolt()
        wide = d is not dt.float64 and self.f64_ok
        w = dt.float64 if wide else d
        wt = self.rtype(w)
        xw = m.op("FConvert", wt, x) if wide else x
        yw = m.op("FConvert", wt, y) if wide else y
        q = m.ext(self.glsl, wt, GLSL["Trunc"], m.op("FDiv", wt, xw, yw))
        if wide:
            r = m.op("FSub", wt, xw, m.op("FMul", wt, q, yw))
        else:     # one rounding where the device fuses (x - q * y is then exact)
            r = m.ext(self.glsl, wt, 50, m.op("FNegate", wt, q), yw, xw)      # Fma
        ay = m.ext(self.glsl, wt, GLSL["FAbs"], yw)
        sy = m.op("Select", wt, m.op("FOrdLessThan", bt, xw, self.const(w, 0.0)),
                  m.op("FNegate", wt, ay), ay)       # |y| with x's sign
        wrong = m.op("FOrdLessThan", bt, m.op("FMul", wt, r, xw), self.const(w, 0.0))
        r = m.op("Select", wt, wrong, m.op("FAdd", wt, r, sy), r)
        over = m.op("FOrdGreaterThanEqual", bt, m.ext(self.glsl, wt, GLSL["FAbs"], r), ay)
        r = m.op("Select", wt, over, m.op("FSub", wt, r, sy), r)
        if wide:
            r = m.op("FConvert", t, r)
            big = m.op("FOrdGreaterThanEqual", bt, m.ext(self.glsl, wt, GLSL["FAbs"], q),
                       self.const(w, 2.0 ** 29))
            r = m.op("Select", t, big, m.op("FRem", t, x, y), r)
        # fmod(x, +-inf) is x for finite x; a zero result keeps x's sign
        yinf = m.op("LogicalAnd", bt, m.op("IsInf", bt, y),
                    m.op("LogicalNot", bt, m.op("IsInf", bt, x)))
        r = m.op("Select", t, yinf, x, r)
        zero = m.op("FOrdEqual", bt, r, self.const(d, 0.0))
        return m.op("Select", t, zero, m.op("FMul", t, x, self.const(d, 0.0)), r)

    def int_binary(self, b, d, t, x, y, y_ref):
        m = self.m
        signed = d.kind == "i"
        bt = self.boolt()
        simple = {K.B_ADD: "IAdd", K.B_SUB: "ISub", K.B_MUL: "IMul", K.B_BITXOR: "BitwiseXor",
                  K.B_BITOR: "BitwiseOr", K.B_BITAND: "BitwiseAnd",
                  K.B_SHL: "ShiftLeftLogical",
                  K.B_SHR: "ShiftRightArithmetic" if signed else "ShiftRightLogical"}
        if b in simple:
            return m.op(simple[b], t, x, y)
        if b in (K.B_MAX, K.B_MIN):
            name = ("SGreaterThan" if signed else "UGreaterThan") if b == K.B_MAX else \
                ("SLessThan" if signed else "ULessThan")
            return m.op("Select", t, m.op(name, bt, x, y), x, y)
        if b in (K.B_DIV, K.B_MOD):
            # x / 0 and x % 0 are 0; MIN / -1 wraps (a negation), x % -1 is 0
            yop = self.ops[y_ref]
            yc = yop[2] if yop[0] == K.CONST else None
            zero, one = self.iconst(d, t, 0), self.iconst(d, t, 1)
            if yc is not None and yc != 0 and not (signed and yc == -1):
                if signed:
                    return self.sdivrem(b, d, t, x, y)
                return m.op("UDiv" if b == K.B_DIV else "UMod", t, x, y)
            is0 = m.op("IEqual", bt, y, zero)
            bad = is0
            if signed:
                ism1 = m.op("IEqual", bt, y, self.iconst(d, t, -1))
                bad = m.op("LogicalOr", bt, is0, ism1)
            safe = m.op("Select", t, bad, one, y)
            if b == K.B_DIV:
                q = self.sdivrem(b, d, t, x, safe) if signed else m.op("UDiv", t, x, safe)
                if signed:
                    q = m.op("Select", t, ism1, m.op("SNegate", t, x), q)
                return m.op("Select", t, is0, zero, q)
            r = self.sdivrem(b, d, t, x, safe) if signed else m.op("UMod", t, x, safe)
            return m.op("Select", t, bad, zero, r)
        if b == K.B_POW:
            return self.ipow(d, t, x, y)
        raise NotImplementedError(f"binary op {K.BINARY_NAMES[b]} on {d.name}")

    def sdivrem(self, b, d, t, x, y):
        """C's signed x / y or x % y (truncating; y neither 0 nor -1 here) through
        unsigned division of the magnitudes: GLSL leaves % of negative operands
        undefined, and NVIDIA's OpSRem does not give the dividend's sign."""
        m = self.m
        bt = self.boolt()
        ut = m.type_int(d.itemsize * 8, False)
        zero = self.iconst(d, t, 0)
        xneg = m.op("SLessThan", bt, x, zero)
        yneg = m.op("SLessThan", bt, y, zero)
        ax = m.op("Bitcast", ut, m.op("Select", t, xneg, m.op("SNegate", t, x), x))
        ay = m.op("Bitcast", ut, m.op("Select", t, yneg, m.op("SNegate", t, y), y))
        uq = m.op("Bitcast", t, m.op("UDiv", ut, ax, ay))
        q = m.op("Select", t, m.op("LogicalNotEqual", bt, xneg, yneg), m.op("SNegate", t, uq), uq)
        if b == K.B_DIV:
            return q
        return m.op("ISub", t, x, m.op("IMul", t, q, y))

    def iconst(self, d, t, v):
        return self.m.const(t, v, d.itemsize * 8)

    def ipow(self, d, t, x, y):
        """Integer power by squaring over the exponent's bits (C's zyx_ipow); a negative
        exponent gives 1 for 1, +-1 for -1, else 0."""
        m = self.m
        bt = self.boolt()
        bits = d.itemsize * 8
        r, base, e = self.iconst(d, t, 1), x, y
        for _ in range(bits):
            odd = m.op("IEqual", bt, m.op("BitwiseAnd", t, e, self.iconst(d, t, 1)),
                       self.iconst(d, t, 1))
            r = m.op("Select", t, odd, m.op("IMul", t, r, base), r)
            base = m.op("IMul", t, base, base)
            e = m.op("ShiftRightLogical", t, e, self.iconst(d, t, 1))
        if d.kind == "u":
            return r
        neg = m.op("SLessThan", bt, y, self.iconst(d, t, 0))
        odd = m.op("IEqual", bt, m.op("BitwiseAnd", t, y, self.iconst(d, t, 1)),
                   self.iconst(d, t, 1))
        m1 = m.op("Select", t, odd, self.iconst(d, t, -1), self.iconst(d, t, 1))
        small = m.op("Select", t, m.op("IEqual", bt, x, self.iconst(d, t, 1)),
                     self.iconst(d, t, 1),
                     m.op("Select", t, m.op("IEqual", bt, x, self.iconst(d, t, -1)), m1,
                          self.iconst(d, t, 0)))
        return m.op("Select", t, neg, small, r)

    def fpow(self, d, x, y):
        """C's pow: GLSL's Pow is undefined for x < 0 and for x == 0 with y <= 0."""
        m = self.m
        t = self.rtype(d)
        bt = self.boolt()
        c = lambda v: self.const(d, v)      # noqa: E731
        ax = m.ext(self.glsl, t, GLSL["FAbs"], x)
        if d is dt.float64:
            r = f64math.pow_abs(self, ax, y)
        else:
            r = m.ext(self.glsl, t, GLSL["Pow"], ax, y)
        yi = m.op("FOrdEqual", bt, m.ext(self.glsl, t, GLSL["Floor"], y), y)
        odd = m.op("FOrdNotEqual", bt, m.op("FRem", t, y, c(2.0)), c(0.0))
        neg_r = m.op("Select", t, odd, m.op("FNegate", t, r), r)
        xneg = m.op("FOrdLessThan", bt, x, c(0.0))
        r = m.op("Select", t, xneg, m.op("Select", t, yi, neg_r, c(float("nan"))), r)
        xz = m.op("FOrdEqual", bt, x, c(0.0))
        zr = m.op("Select", t, m.op("FOrdGreaterThan", bt, y, c(0.0)), c(0.0), c(float("inf")))
        r = m.op("Select", t, xz, zr, r)
        nan = m.op("LogicalOr", bt, m.op("IsNan", bt, x), m.op("IsNan", bt, y))
        r = m.op("Select", t, nan, m.op("FAdd", t, x, y), r)
        r = m.op("Select", t, m.op("FOrdEqual", bt, y, c(0.0)), c(1.0), r)
        return m.op("Select", t, m.op("FOrdEqual", bt, x, c(1.0)), c(1.0), r)

    def compare(self, b, a_ref, b_ref):
        m = self.m
        bt = self.boolt()
        if b in (K.B_OR, K.B_AND):
            return m.op("LogicalOr" if b == K.B_OR else "LogicalAnd", bt,
                        self.as_bool(a_ref), self.as_bool(b_ref))
        da, db = self.dtype_of(a_ref), self.dtype_of(b_ref)
        narrow = (a_ref in self.narrow or self.ops[a_ref][0] == K.CONST) and \
                 (b_ref in self.narrow or self.ops[b_ref][0] == K.CONST) and \
                 (a_ref in self.narrow or b_ref in self.narrow)
        if narrow:
            x, y, d = self.get(a_ref, True), self.get(b_ref, True), dt.int32
        else:
            d = da if da is db else (da if self.ops[b_ref][0] == K.CONST else da)
            x, y = self.value_as(a_ref, d), self.value_as(b_ref, d)
        if d.is_bool:
            if b == K.B_EQ:
                return m.op("LogicalEqual", bt, x, y)
            if b == K.B_NOTEQ:
                return m.op("LogicalNotEqual", bt, x, y)
            if b == K.B_CMPLT:
                return m.op("LogicalAnd", bt, m.op("LogicalNot", bt, x), y)
            return m.op("LogicalAnd", bt, x, m.op("LogicalNot", bt, y))
        if d.is_float:
            name = {K.B_CMPLT: "FOrdLessThan", K.B_CMPGT: "FOrdGreaterThan",
                    K.B_EQ: "FOrdEqual", K.B_NOTEQ: "FUnordNotEqual"}[b]
        else:
            s = d.kind == "i"
            name = {K.B_CMPLT: "SLessThan" if s else "ULessThan",
                    K.B_CMPGT: "SGreaterThan" if s else "UGreaterThan",
                    K.B_EQ: "IEqual", K.B_NOTEQ: "INotEqual"}[b]
        return m.op(name, bt, x, y)

    # -- the group strategy --------------------------------------------------------------
    def share_bounds(self, length):
        """[lo, hi) of this group's share of `length` iterations (split pass 1)."""
        m = self.m
        u32 = self.u32()
        chunk = -(-length // self.splits)
        lo = m.op("IMul", u32, self.share, self.c_u32(chunk))
        hi = m.ext(self.glsl, u32, 38, m.op("IAdd", u32, lo, self.c_u32(chunk)),
                   self.c_u32(length))                                     # UMin
        return lo, hi

    def unrolled_share(self, nest, ilp):
        """Split pass 1's outer loop over this group's share, `ilp` iterations at a
        time (each a copy of the loop body with its own registers: independent loads in
        flight), then the remainder one at a time; then the lanes' combine."""
        m = self.m
        u32 = self.u32()
        root = nest.root
        lo, hi = self.share_bounds(self.ops[root][2])
        hi = m.ext(self.glsl, u32, 41, hi, lo)                                  # UMax
        count = m.op("ISub", u32, hi, lo)
        main_end = m.op("IAdd", u32, lo, m.op("IMul", u32, m.op(
            "UDiv", u32, count, self.c_u32(ilp)), self.c_u32(ilp)))
        r = self.open_loop(lo, main_end, self.c_u32(ilp), u32, signed=False)
        vec = self.tuning.get("vec", 0)
        flat = nest.flat
        loads = self.vector_loads(nest, vec) if vec > 1 and ilp % vec == 0 and \
            flat == self.local and flat % vec == 0 else []
        for u in range(ilp):
            if loads:
                # copies g * vec .. g * vec + vec - 1 take, per lane, the vec consecutive
                # elements vec * lane + j of the g-th run of vec blocks: one vector load
                # (each element is still reduced once: the copies permute the share)
                g, j = divmod(u, vec)
                e = m.op("IMul", u32, self.lane, self.c_u32(vec))
                blk = m.op("IAdd", u32, r, self.c_u32(g * vec))
                self.set_index(root, m.op("IAdd", u32, blk,
                                          m.op("UDiv", u32, e, self.c_u32(flat))))
                self.run_value = m.op("IAdd", u32, m.op("UMod", u32, e, self.c_u32(flat)),
                                      self.c_u32(j))
                self.vec_loads = {i: (j, vec) for i in loads}
            else:
                self.set_index(root, m.op("IAdd", u32, r, self.c_u32(u)) if u else r)
            self.body(root + 1, nest.end)
        self.run_value = None
        self.vec_loads = {}
        self.close_loop()
        r = self.open_loop(main_end, hi, self.c_u32(1), u32, signed=False)
        self.set_index(root, r)
        self.body(root + 1, nest.end)
        self.close_loop()
        self.combine(nest)

    def open_share(self, length):
        """The nest's outer loop over this group's share (split pass 1, the run below it
        is split over the lanes)."""
        lo, hi = self.share_bounds(length)
        f = self.open_loop(lo, hi, self.c_u32(1), self.u32(), signed=False)
        return self.index_value(self.nests[0].root, f)

    def index_value(self, ssa, u32_value):
        self.set_index(ssa, u32_value)
        return self.val[ssa]

    def open_split(self, nest):
        """Open the flat loop `for (f = lane; f < flat; f += local)` of `nest`'s run and
        give each loop of the run its value from f (split pass 1 with the run at the
        nest's root: over this group's share of it)."""
        m = self.m
        u32 = self.u32()
        for loop in nest.run:
            self.split_loops[loop] = nest
        if nest.run[0] in self.cache.counted:
            # the row cache's fixed count per lane, unrolled so that the cached values
            # get constant positions (registers): f = lane + k * local, k < flat / local
            k = self.open_loop(self.c_u32(0), self.c_u32(nest.flat // self.local),
                               self.c_u32(1), u32, signed=False, unroll=True)
            f = m.op("IAdd", u32, self.lane, m.op("IMul", u32, k, self.c_u32(self.local)))
            pos, radix = k, nest.flat // self.local
            for loop in sorted((x for x in self.unroll_vars if nest.root <= x < nest.run[0]),
                               reverse=True):
                pos = m.op("IAdd", u32, pos,
                           m.op("IMul", u32, self.unroll_vars[loop], self.c_u32(radix)))
                radix *= self.ops[loop][2]
            self.positions[nest.run[0]] = pos
        elif nest.flat == self.local and not (self.strategy == "split" and
                                               nest.run[0] == nest.root):
            # one iteration per lane: straight-line code, so that the split strategy's
            # unrolled outer iterations (write_split's ilp) have their loads in flight
            # together
            f = self.lane if self.run_value is None else self.run_value
            self.loopless.add(nest.run[0])
        elif self.strategy == "split" and nest.run[0] == nest.root:
            lo, hi = self.share_bounds(nest.flat)
            f = self.open_loop(m.op("IAdd", u32, lo, self.lane), hi, self.c_u32(self.local),
                               u32, signed=False)
        else:
            f = self.open_loop(self.lane, self.c_u32(nest.flat), self.c_u32(self.local), u32,
                               signed=False)
        stride = 1
        for loop in reversed(nest.run):
            length = self.ops[loop][2]
            e = f if stride == 1 else m.op("UDiv", u32, f, self.c_u32(stride))
            if loop != nest.run[0]:
                e = m.op("UMod", u32, e, self.c_u32(length))
            self.set_index(loop, e)
            stride *= length

    def combine(self, nest):
        """Combine each lane's partial accumulator of `nest` into every lane's: a tree in
        workgroup memory, with barriers in the group's uniform control flow (or
        subgroup operations first, `combine_subgroups`)."""
        sg = self.tuning.get("subgroup", 0)
        if sg and self.local % sg == 0 and all(
                self.subgroup_ok(self.ops[acc][1]) for acc in nest.results):
            return self.combine_subgroups(nest, sg)
        m = self.m
        u32 = self.u32()
        bt = self.boolt()
        for acc in nest.results:
            dop = self.ops[acc]
            d, rop = dop[1], dop[6]
            t = self.rtype(d)
            sh = self.scratch.get(t)
            if sh is None:
                arr = m.type_array(t, self.local)
                sh = self.scratch[t] = (m.global_variable(m.type_pointer("Workgroup", arr),
                                                          "Workgroup"),
                                        m.type_pointer("Workgroup", t))
            var, eptr = sh
            reg = self.regs[acc][0]
            mine = m.op("AccessChain", eptr, var, self.lane)
            m.emit("Store", mine, m.op("Load", t, reg))
            self.barrier()
            s = self.local // 2
            while s >= 1:
                self.open_if(m.op("ULessThan", bt, self.lane, self.c_u32(s)))
                other = m.op("AccessChain", eptr, var, m.op("IAdd", u32, self.lane,
                                                             self.c_u32(s)))
                a = m.op("Load", t, mine)
                b = m.op("Load", t, other)
                m.emit("Store", mine, self.combine_values(rop, d, a, b))
                self.close_if()
                self.barrier()
                s //= 2
            first = m.op("AccessChain", eptr, var, self.c_u32(0))
            m.emit("Store", reg, m.op("Load", t, first))
            self.barrier()        # every lane has read [0] before the scratch is reused

    @staticmethod
    def subgroup_ok(d):
        """Subgroup operations on d's registers need no extension: 32/64-bit floats
        (16-bit floats are float32 registers) and 32-bit integers (8, 16 and 64-bit
        integers need shaderSubgroupExtendedTypes; bool is left to the tree)."""
        return d.is_float or (not d.is_bool and d.itemsize == 4)

    def sub_builtin(self, name):
        """A scalar u32 subgroup built-in's value (its Input variable made once)."""
        m = self.m
        var = self.scratch.get(("builtin", name))
        if var is None:
            var = m.global_variable(m.type_pointer("Input", self.u32()), "Input")
            m.decorate(var, "BuiltIn", B.BUILTIN[name])
            self.interface.append(var)
            self.scratch[("builtin", name)] = var
        return m.op("Load", self.u32(), var)

    def subgroup_reduce(self, rop, d, v, width, arithmetic):
        """v combined over the first `width` lanes of each subgroup. `arithmetic`: one
        OpGroupNonUniform* Reduce over the whole subgroup (sums, integer max/min; every
        lane gets the result); else a shuffle-down ladder of `combine_values` (lane i
        takes lane i + s for s = width/2 .. 1: the tree's order and its NaN and
        first-of-equal rules; lane 0 gets the result)."""
        m = self.m
        t = self.rtype(d)
        scope = self.c_u32(B.SCOPE_SUBGROUP)
        bop = K.REDUCE_BINARY[rop]
        m.capability("GroupNonUniform")
        if arithmetic:
            m.capability("GroupNonUniformArithmetic")
            if bop == K.B_ADD:
                name = "FAdd" if d.is_float else "IAdd"
            else:
                name = ("S" if d.kind == "i" else "U") + ("Max" if bop == K.B_MAX else "Min")
            return m.op("GroupNonUniform" + name, t, scope, B.GROUP_REDUCE, v)
        m.capability("GroupNonUniformShuffleRelative")
        s = width // 2
        while s >= 1:
            other = m.op("GroupNonUniformShuffleDown", t, scope, v, self.c_u32(s))
            v = self.combine_values(rop, d, v, other)
            s //= 2
        return v

    def combine_subgroups(self, nest, sg):
        """`combine` through subgroups of `sg` lanes: each subgroup reduces its lanes'
        partials (subgroup_reduce), its first lane writes the result to workgroup
        memory at the subgroup's number; then, while more than one value is left, the
        lanes numbered below that count (numbered subgroup-major: SubgroupId * sg +
        SubgroupLocalInvocationId, so a subgroup reads consecutive values) reduce them
        the same way. Two barriers per level instead of one per halving."""
        m = self.m
        u32, bt = self.u32(), self.boolt()
        sub_lane = self.sub_builtin("SubgroupLocalInvocationId")
        sub_id = self.sub_builtin("SubgroupId")
        q = m.op("IAdd", u32, m.op("IMul", u32, sub_id, self.c_u32(sg)), sub_lane)
        first = m.op("IEqual", bt, sub_lane, self.c_u32(0))
        for acc in nest.results:
            dop = self.ops[acc]
            d, rop = dop[1], dop[6]
            t = self.rtype(d)
            bop = K.REDUCE_BINARY[rop]
            arithmetic = bop == K.B_ADD or (not d.is_float and bop in (K.B_MAX, K.B_MIN))
            key = ("subgroup", t)
            sh = self.scratch.get(key)
            if sh is None:
                arr = m.type_array(t, self.local // sg)
                sh = self.scratch[key] = (m.global_variable(m.type_pointer("Workgroup", arr),
                                                            "Workgroup"),
                                          m.type_pointer("Workgroup", t))
            var, eptr = sh
            reg = self.regs[acc][0]
            v = self.subgroup_reduce(rop, d, m.op("Load", t, reg), sg, arithmetic)
            n = self.local // sg
            self.open_if(first)
            m.emit("Store", m.op("AccessChain", eptr, var, sub_id), v)
            self.close_if()
            self.barrier()
            while n > 1:
                # lanes at or past n read a valid slot whose value never reaches lane 0
                slot = m.ext(self.glsl, u32, 38, q, self.c_u32(n - 1))         # UMin
                v = m.op("Load", t, m.op("AccessChain", eptr, var, slot))
                self.barrier()
                v = self.subgroup_reduce(rop, d, v, min(n, sg), False)
                self.open_if(m.op("LogicalAnd", bt, first,
                                  m.op("ULessThan", bt, q, self.c_u32(n))))
                m.emit("Store", m.op("AccessChain", eptr, var,
                                     m.op("UDiv", u32, q, self.c_u32(sg))), v)
                self.close_if()
                self.barrier()
                n = -(-n // sg)
            m.emit("Store", reg, m.op("Load", t, m.op("AccessChain", eptr, var,
                                                      self.c_u32(0))))
            self.barrier()        # every lane has read [0] before the scratch is reused

    def combine_values(self, rop, d, a, b):
        bop = K.REDUCE_BINARY[rop]
        if d.is_bool:
            name = "LogicalOr" if bop in (K.B_ADD, K.B_MAX) else "LogicalAnd"
            return self.m.op(name, self.boolt(), a, b)
        return self.binary_value(bop, d, a, b, -1)

    def barrier(self):
        self.m.emit("ControlBarrier", self.c_u32(B.SCOPE_WORKGROUP),
                    self.c_u32(B.SCOPE_WORKGROUP), self.c_u32(B.SEMANTICS_ACQREL_WORKGROUP))


class _RegisterValues:
    """The dialect question `gpu.reduce.row_cache` asks (does a load convert what it
    reads?): the SPIR-V row cache keeps register values, after any conversion, so every
    load may be cached."""

    @staticmethod
    def load_convert(d, x):
        return x


def _stride(d):
    if d.is_bool:
        return 1
    return d.itemsize


# the IR walk for other strategy modules to extend (spirv/gemm.py: shared-memory product
# tiles reuse its values, loads, stores and conversions)
KernelWriter = _Writer


def write_split(kernel, local, nests, splits, fp64=True, float_controls=(), tuning=None):
    """The two SpirvKernels (partials, combination) of a kernel given the split
    strategy: `splits` groups per output in the first pass. `tuning`: as write_kernel."""
    out = []
    for phase in (1, 2):
        w = _Writer(kernel, "split", local, 1, nests, None, fp64, float_controls, splits, phase,
                    tuning)
        words = w.write()
        groups = w.n_out * (splits if phase == 1 else 1)
        out.append(SpirvKernel(words, local, groups, "split", 1, uses_dtypes(kernel)))
    return out


def write_kernel(kernel, strategy="serial", local=256, items=1, nests=None, fp64=True,
                 float_controls=(), tuning=None):
    """The SpirvKernel of `kernel` with `strategy` ("serial", "elementwise" or "group"),
    `local` invocations per workgroup and, for "serial", `items` outputs per invocation
    (for "elementwise", `items` is the `elementwise.EwLayout`).
    `fp64`: the device computes float64 (else integer math functions go through float32).
    `float_controls`: of "nan32", "nan64", "denorm32", "denorm64", what the device can
    preserve (VkPhysicalDeviceFloatControlsProperties): those modes are declared.
    `tuning`: the reduce knobs `strategy.reduce_tuning` gives (None: row cache on, no
    subgroup operations)."""
    w = _Writer(kernel, strategy, local, items, nests, None, fp64, float_controls,
                tuning=tuning)
    words = w.write()
    n_out = w.n_out
    if strategy == "group":
        groups = n_out
    elif strategy == "elementwise":
        groups = items.groups
    else:
        groups = max(-(-n_out // (local * items)), 1)
    return SpirvKernel(words, local, groups, strategy, items, uses_dtypes(kernel))


def words_to_bytes(words):
    """The module's bytes (little-endian words)."""
    return struct.pack(f"<{len(words)}I", *words)
