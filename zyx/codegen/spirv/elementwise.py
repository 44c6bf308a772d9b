"""The SPIR-V "elementwise" strategy (kernels without loops), the Vulkan counterpart of
`gpu/elementwise.py`: each workgroup takes a tile of `local * items * vec` consecutive
outputs; an invocation's step k covers the `vec` outputs from `(k * local + lane) * vec`
of the tile, so every step is coalesced over the workgroup. The accesses at the flat
output index (plus a constant multiple of `vec`, `gpu.elementwise.elementwise_accesses`)
are read and written as SPIR-V vectors (up to 16 bytes: `OpTypeVector` over a vector view
of the same binding) when `vload` is on, else as `vec` adjacent scalars the driver may
merge; a workgroup whose tile is ragged (the last one) runs one guarded element per
invocation and iteration instead. `stride=1` keeps the older layout (`items` scalar
outputs per invocation at a stride of the whole dispatch) for comparisons.

Why: a hand-written scalar Vulkan shader reached 64% of the H100's copy bandwidth and
zyx's scalar kernels 50%; CUDA reaches 80% with 16-byte accesses and tiles of
consecutive elements (docs/gpu-lowering.md).

Knobs: ZYX_VK_EW ("items=4,vec=4,local=256,vload=1,stride=0"), read at every lowering so
one process can compare them; the autotuner's schedules override it (`plan`)."""
from __future__ import annotations

from ..._core import kernel as K
from ..gpu.analysis import output_size
from ..gpu.elementwise import elementwise_accesses
from ..gpu.program import device_threads, read_variant

EW_ENV = "ZYX_VK_EW"
# (H200, NVIDIA's Vulkan driver, 64M float32, benches/gpu_vk_bandwidth_sweep.py: local=512
# gave the chain 2.63 TB/s against 2.29 at 256, the copy 2.92 against 2.57)
EW_DEFAULT = {"items": 4, "vec": 4, "local": 512, "vload": 1, "stride": 0}
EW_LIMITS = {"items": 16, "vec": 4, "local": 1024}
# the body is written items * vec times: at most this many IR ops in all (a big fused
# kernel gets fewer copies instead of a huge module)
EW_MAX_OPS = 4096
# outputs from which the stride=1 layout takes `items` per invocation (else one)
STRIDE_ITEMS_FROM = 1 << 22


class EwLayout:
    """How an elementwise kernel is spread: `local` invocations per workgroup, `items`
    steps of `vec` outputs each per invocation, `flat` (access op -> constant offset) the
    accesses read/written as vectors when `vload`, `stride` the older grid-stride layout,
    `groups` the workgroups to dispatch."""
    __slots__ = ("local", "items", "vec", "vload", "stride", "flat", "groups")

    def __init__(self, local, items, vec, vload, stride, flat, groups):
        self.local, self.items, self.vec, self.vload = local, items, vec, vload
        self.stride, self.flat, self.groups = stride, flat, groups

    def __repr__(self):
        return (f"EwLayout(local={self.local}, items={self.items}, vec={self.vec}, "
                f"vload={self.vload}, stride={self.stride}, vector_accesses={len(self.flat)})")


def ew_variant(spec=None):
    """{items, vec, local, vload, stride}: EW_DEFAULT updated by `spec` (default: the
    ZYX_VK_EW environment variable)."""
    out = read_variant(EW_ENV, EW_DEFAULT, EW_LIMITS, spec)
    for key in ("vload", "stride"):
        if out[key] not in (0, 1):
            raise ValueError(f"{EW_ENV}={spec!r}: {key} is 0 or 1")
    return out


def chunk(d, vec):
    """Elements per vector access of dtype d: at most 4 and 16 bytes (bool is a byte)."""
    size = 1 if d.is_bool else d.itemsize
    return max(min(vec, 4, 16 // size), 1)


def plan(kernel, info, schedule=None):
    """The EwLayout of loop-free `kernel` on a device described by `info`. `schedule`
    (the autotuner's, strategy.candidates) overrides the variant's keys it names."""
    ops = kernel.ops
    var = ew_variant()
    if schedule:
        var.update({k: v for k, v in schedule.items() if k in var})
    local = max(min(var["local"], max(info.max_local_threads, 1)), 1)
    n = output_size(ops)
    if var["stride"]:
        items = var["items"] if n >= STRIDE_ITEMS_FROM else 1
        return EwLayout(local, items, 1, 0, 1, {}, max(-(-n // (local * items)), 1))
    nops = max(len(ops), 1)
    vec, items = var["vec"], var["items"]
    while vec > 1 and vec * nops > EW_MAX_OPS:
        vec //= 2
    flat, coalesced = elementwise_accesses(ops, vec)
    if vec > 1 and not (coalesced and flat):
        vec, flat = 1, {}
    while items > 1 and items * vec * nops > EW_MAX_OPS:
        items //= 2
    fill = max(device_threads(info) // local, 1)      # workgroups the device holds at once
    while items > 1 and -(-n // (local * items * vec)) < fill:
        items //= 2          # too few tiles to fill the device: smaller ones
    tile = local * items * vec
    tiles = max(-(-n // tile), 1)
    extents = [n] + [nel for _, nel, _ in kernel.args]
    if (tiles + 1) * tile >= 2**31 or max(extents) >= 2**31:
        # the tile and vector-index arithmetic is 32-bit: larger grids take the stride layout
        items = var["items"] if n >= STRIDE_ITEMS_FROM else 1
        return EwLayout(local, items, 1, 0, 1, {}, max(-(-n // (local * items)), 1))
    return EwLayout(local, items, vec, var["vload"] if vec > 1 else 0, 0,
                    flat if var["vload"] else {}, tiles)


def vector_view(w, define, cc):
    """(variable, element pointer type, vector type) of a view of global buffer `define`
    as vectors of `cc` storage elements: a second variable on the same binding."""
    key = (define, cc)
    got = w.vviews.get(key)
    if got is not None:
        return got
    m = w.m
    argno = w.ops[define][3]
    d, _, read_only = w.k.args[argno]
    vt = m.type_vector(w.stype(d), cc)
    size = 1 if d.is_bool else d.itemsize
    s = m.storage_buffer_struct(vt, size * cc, ("vec", argno, cc))
    if read_only:
        m.member_decorate(s, 0, "NonWritable")
    var = m.global_variable(m.type_pointer("StorageBuffer", s), "StorageBuffer")
    m.decorate(var, "DescriptorSet", 0)
    m.decorate(var, "Binding", argno)
    got = w.vviews[key] = (var, m.type_pointer("StorageBuffer", vt), vt)
    return got


def _access_dtype(ops, i):
    """The buffer dtype an access reads or writes (its define's)."""
    return ops[ops[i][2]][1]


def write_elementwise(w, group):
    """Write the body of writer `w` (strategy "elementwise", layout `w.items`) for the
    flat workgroup number `group` (u32)."""
    m, u32, bt = w.m, w.u32(), w.boolt()
    lay = w.items
    n, local, tile = w.n_out, w.local, w.local * lay.items * lay.vec
    base = m.op("IMul", u32, group, w.c_u32(tile))
    inside = m.op("ULessThan", bt, group, w.c_u32(lay.groups))   # (the 2-D fold's spare)
    if n % tile == 0:
        w.open_if(inside)
        _fast(w, group, base)
        w.close_if()
        return
    full = m.op("ULessThanEqual", bt, m.op("IAdd", u32, base, w.c_u32(tile)), w.c_u32(n))
    w.open_if(full)
    _fast(w, group, base)
    w.close_if()
    w.open_if(m.op("LogicalAnd", bt, inside, m.op("LogicalNot", bt, full)))
    end = m.ext(w.glsl, u32, 38, m.op("IAdd", u32, base, w.c_u32(tile)), w.c_u32(n))  # UMin
    gid = w.open_loop(m.op("IAdd", u32, base, w.lane), end, w.c_u32(local), u32, signed=False)
    w.decode_indices(gid)
    w.body(0, len(w.ops))
    w.close_loop()
    w.close_if()


def _fast(w, group, base):
    """The full tile: per step, the vector loads, the body once per element with those
    lanes for operands, then the vector stores."""
    m, u32 = w.m, w.u32()
    lay, ops = w.items, w.ops
    local, vec = w.local, lay.vec
    flat = lay.flat if lay.vload else {}
    loads = [i for i in sorted(flat) if ops[i][0] == K.LOAD]
    stores = [i for i in sorted(flat) if ops[i][0] == K.STORE]
    for k in range(lay.items):
        first = m.op("IAdd", u32, w.c_u32(k * local), w.lane)
        p = m.op("IAdd", u32, base, m.op("IMul", u32, first, w.c_u32(vec)))
        chunks = {}            # access -> [vector value ids]
        for i in loads:
            chunks[i] = [_vload(w, i, group, first, c) for c in
                         range(vec // chunk(_access_dtype(ops, i), vec))]
        captured = {i: [] for i in stores}
        for j in range(vec):
            w.lane_loads = {i: _lane(w, i, chunks[i], j) for i in loads}
            w.lane_stores = captured
            w.decode_indices(p if j == 0 else m.op("IAdd", u32, p, w.c_u32(j)))
            w.body(0, len(ops))
        w.lane_loads, w.lane_stores = {}, None
        for i in stores:
            cc = chunk(_access_dtype(ops, i), vec)
            var, ptr, vt = vector_view(w, ops[i][2], cc)
            for c in range(vec // cc):
                parts = captured[i][c * cc:(c + 1) * cc]
                v = parts[0] if cc == 1 else m.op("CompositeConstruct", vt, *parts)
                m.emit("Store", m.op("AccessChain", ptr, var, w.c_u32(0),
                                     _vindex(w, i, group, first, c, cc)), v)


def _vindex(w, i, group, first, c, cc):
    """The vector-view index of access i's chunk c at this step: (tile start + first *
    vec + offset) / cc, every term a multiple of cc."""
    m, u32, lay = w.m, w.u32(), w.items
    tile = w.local * lay.items * lay.vec
    q = m.op("IAdd", u32, m.op("IMul", u32, group, w.c_u32(tile // cc)),
             m.op("IMul", u32, first, w.c_u32(lay.vec // cc)))
    off = (lay.flat[i] + c * cc) // cc
    return m.op("IAdd", u32, q, w.c_u32(off)) if off else q


def _vload(w, i, group, first, c):
    m, ops = w.m, w.ops
    cc = chunk(_access_dtype(ops, i), w.items.vec)
    var, ptr, vt = vector_view(w, ops[i][2], cc)
    return m.op("Load", vt, m.op("AccessChain", ptr, var, w.c_u32(0),
                                 _vindex(w, i, group, first, c, cc)))


def _lane(w, i, chunks, j):
    """Element j of load i's vectors, converted from storage to the load's dtype."""
    m, ops = w.m, w.ops
    sd = _access_dtype(ops, i)
    cc = chunk(sd, w.items.vec)
    raw = chunks[j // cc]
    if cc > 1:
        raw = m.op("CompositeExtract", w.stype(sd), raw, j % cc)
    v = w.from_storage(sd, raw)
    d = ops[i][1]
    return w.convert(sd, d, v) if d is not sd else v
